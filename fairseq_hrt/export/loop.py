"""The greedy search as one ONNX ``Loop`` (``greedy.onnx``): every step of a batch in one run.

At batch 1 on a small model what a search does around a step from Python (a ``session.run``,
its feeds, the numpy rules and the end test) is a sizeable share of the step's own arithmetic,
and an ONNX Runtime ``Loop`` iteration costs next to nothing (benchmarks/results/runtime-step-cost-cpu/README.md). The
loop's body is :class:`~fairseq_hrt.export.graphs.GreedyLoopBody`, traced like every other
graph; this module wraps it (ONNX's ``Loop`` cannot be traced from a Python loop whose length
depends on the tokens). The rules stay those of :mod:`hrt_runtime.search`: the search hands the
loop its three biases and lengths and reads back every step's token and score, from which it
makes its hypotheses as it does from its own steps.

Graph inputs: ``start (N,)`` (the first tokens: ``</s>`` or ``<s_k>``), ``stride``, ``max_len``,
``min_len`` (int64 scalars), ``usual_bias``, ``early_bias``, ``final_bias`` ``(V,)``,
``encoder_bias (N, 1, 1, S)``, per layer encoder keys, values ``(N, H, S, d)`` (``greedy_restricted``:
the output rows' ``out_weight (V', C)``, ``out_bias (V',)`` and ``out_ids (V',)``), and the empty
state the steps grow (per layer ``initial_k*``, ``initial_v*`` ``(N, H, 0, d)``; SSRU:
``initial_c*`` cells of zeros). Outputs: ``tokens (T, N)`` and ``scores (T, N)`` of the steps
made, ``T <= max_len + 1`` (the loop ends when every row has produced ``</s>``; rows that ended
before go on and are read up to their ``</s>`` only).
"""

from typing import List, Sequence

# what the body reads from the loop's graph after the carried state (GreedyLoopBody.forward's
# order), and the names of the state's start: the runtime feeds them
from hrt_runtime.model import LOOP_ROWS_INPUTS, loop_state_name
from hrt_runtime.model import LOOP_SETTINGS as SETTINGS


def body_inputs(past: Sequence[str], enc_names: Sequence[str], restricted: bool = False) -> List[str]:
    """The input names :class:`GreedyLoopBody` is traced with, in its order."""
    return ["i", "cond", "alive", "prev", *past, *SETTINGS, *enc_names, *(LOOP_ROWS_INPUTS if restricted else ())]


def greedy_loop(body_model, past: Sequence[str], present: Sequence[str], enc_names: Sequence[str]):
    """The loop graph (a ``ModelProto``) around the traced body ``body_model`` (inputs
    :func:`body_inputs`; outputs ``cond_out``, ``alive_out``, ``token``, ``present``,
    ``score``). The body's weights move to the loop's graph (where
    :func:`~fairseq_hrt.export.folder.share_weights` stores them with every other graph's), the
    settings and encoder inputs become the loop graph's own, read by the body from the enclosing
    scope."""
    from onnx import TensorProto, helper  # noqa: PLC0415 - optional: onnx, for exporting

    body = body_model.graph
    outer_names = set(SETTINGS) | set(enc_names) | set(LOOP_ROWS_INPUTS)
    outer_inputs = [value for value in body.input if value.name in outer_names]
    carried = [value for value in body.input if value.name not in outer_names]
    if [value.name for value in carried][:1] == ["i"] and "cond" not in {value.name for value in carried}:
        # the tracer drops inputs nothing reads; a Loop body takes its condition all the same
        carried.insert(1, helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    names = [value.name for value in carried]
    if names[:4] != ["i", "cond", "alive", "prev"]:
        raise RuntimeError(f"the traced loop body has inputs {names}, expected i, cond, alive, prev, ...")
    del body.input[:]
    body.input.extend(carried)
    initializers = list(body.initializer)
    del body.initializer[:]
    outputs = {value.name: value for value in body.output}
    body.node.append(helper.make_node("Identity", ["token"], ["token_scan"]))
    order = [outputs["cond_out"], outputs["alive_out"], outputs["token"], *(outputs[n] for n in present)]
    del body.output[:]
    body.output.extend(order)
    body.output.extend([helper.make_tensor_value_info("token_scan", TensorProto.INT64, None), outputs["score"]])

    initial = [loop_state_name(name) for name in past]
    state_inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in initial]
    start = helper.make_tensor_value_info("start", TensorProto.INT64, ["N"])
    nodes = [
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [], [1])),
        helper.make_node("Constant", [], ["go"], value=helper.make_tensor("go", TensorProto.BOOL, [], [True])),
        helper.make_node("Add", ["max_len", "one"], ["trips"]),
        helper.make_node("Equal", ["start", "start"], ["alive"]),  # every row: no </s> yet
        helper.make_node(
            "Loop",
            ["trips", "go", "alive", "start", *initial],
            ["last_alive", "last_token", *("last_" + n for n in present), "tokens", "scores"],
            body=body,
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "greedy_loop",
        [start, *outer_inputs, *state_inputs],
        [
            helper.make_tensor_value_info("tokens", TensorProto.INT64, ["T", "N"]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["T", "N"]),
        ],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=list(body_model.opset_import))
    model.ir_version = body_model.ir_version
    return model
