"""Tracing the model's passes into the ONNX graphs of an exported folder (:mod:`.exporter`).

Each graph is traced by ``torch.onnx.export``'s TorchScript exporter (``dynamo=False``: the
pinned torch has it and it needs no onnxscript) from example inputs, with every axis that
varies (batch, lengths, vocabulary rows) declared dynamic. :class:`Examples` holds what the
graphs share (the example source's encoder states, the past state of a step, their axes);
:func:`trace_graphs` writes them all, in the order ``config.json`` lists them.
"""

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from fairseq_hrt.export.graphs import EncoderGraph, GreedyLoopBody, ParallelGraph, StepGraph
from fairseq_hrt.export.loop import body_inputs, greedy_loop
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.passes.decoder_pass import decoder_pass

OPSET = 17

# the example batch: B sentences of S source tokens, a step at position t
S, t, B = 5, 3, 2


def _names(prefix: str, layers: int) -> List[str]:
    return [f"{prefix}_k{i}" for i in range(layers)] + [f"{prefix}_v{i}" for i in range(layers)]


def _constants_to_initializers(graph_model):
    """Move the tracer's ``Constant`` tensors (the planned weights it saw as constants) into the
    graph's initializers, where ONNX Runtime's quantization finds weights."""
    from onnx import numpy_helper  # noqa: PLC0415 - optional: onnx, for exporting

    graph = graph_model.graph
    for node in list(graph.node):
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = numpy_helper.to_array(node.attribute[0].t)
            if tensor.size > 1:  # shapes and scalars stay constants
                graph.initializer.append(numpy_helper.from_array(tensor, node.output[0]))
                graph.node.remove(node)


def _k_as_input(graph_model):
    """Make the ``k`` of the step graph's TopK a graph input (``k``, int64 ``(1,)``): the
    tracer writes the Python int it saw as a constant, beam search needs ``2 x beam``."""
    from onnx import TensorProto, helper  # noqa: PLC0415 - optional: onnx, for exporting

    graph = graph_model.graph
    topk = [node for node in graph.node if node.op_type == "TopK"]
    if len(topk) != 1:
        raise RuntimeError(f"expected one TopK in the step graph, found {len(topk)}")
    constant = topk[0].input[1]
    topk[0].input[1] = "k"
    graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    # drop the constant that held the traced k if nothing else reads it
    if not any(constant in node.input for node in graph.node):
        for node in list(graph.node):
            if constant in node.output:
                graph.node.remove(node)
        for init in list(graph.initializer):
            if init.name == constant:
                graph.initializer.remove(init)


class GraphWriter:
    """Traces graphs into ``folder``; ``files`` maps each graph's name (``step``) to its file
    (``step.onnx``), in the order they were written."""

    def __init__(self, folder: str):
        self.folder = folder
        self.files: Dict[str, str] = {}

    def export(self, graph, args, inputs, outputs, dynamic, name, k_input=False, wrap: Optional[Callable] = None):
        """Trace ``graph`` into ``folder/name``, weights as initializers (``k_input``: TopK's k an
        input; ``wrap``: the traced model -> the model to save)."""
        import onnx  # noqa: PLC0415 - optional: onnx, for exporting

        path = os.path.join(self.folder, name)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's notes on shape arithmetic and on its own deprecation
            torch.onnx.export(
                graph.eval(),
                args,
                path,
                dynamo=False,
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=dynamic,
                opset_version=OPSET,
            )
        graph_model = onnx.load(path)
        _constants_to_initializers(graph_model)
        if k_input:
            _k_as_input(graph_model)
        if wrap is not None:
            graph_model = wrap(graph_model)
        onnx.save(graph_model, path)
        self.files[name.rsplit(".", 1)[0]] = name


@dataclass
class Examples:
    """The example inputs the graphs are traced with, their names and dynamic axes."""

    model: torch.nn.Module
    tgt_eos: int
    tgt_unk: int
    max_positions: int
    layers: int
    heads: int
    head_dim: int
    recurrent: bool
    cell_dim: int
    window: int
    length: bool  # the encoder graph ends in the length predictor's log-probabilities too
    src: torch.Tensor
    bias: torch.Tensor  # the encoder's attention bias of ``src``
    enc_kv: List[torch.Tensor]  # the encoder keys and values of ``src`` per layer
    enc_names: List[str]
    past: List[str]
    present: List[str]
    logit_bias: torch.Tensor
    r: int  # an example shortlist's rows
    out_rows: List[torch.Tensor]
    rows_kv: List[torch.Tensor]  # the encoder side with one row per hypothesis (step graphs)
    caches: List[torch.Tensor]  # the past state of a step at position t
    state_axes: Dict[str, Dict[int, str]]
    encoder_axes: Dict[str, Dict[int, str]]


def example_source(src_dict) -> torch.Tensor:
    """``(B, S)`` source tokens, one row left-padded: fairseq's encoder passes its padding mask
    to the layers only when the batch has padding (a Python branch the tracer fixes to the
    example's case)."""
    src = torch.full((B, S), src_dict.unk())
    src[:, -1] = src_dict.eos()
    src[1, :2] = src_dict.pad()
    return src


def make_examples(model, src_dict, tgt_dict) -> Examples:
    """The :class:`Examples` of a frozen float32 CPU ``model``."""
    decoder = model.decoder
    layers = len(decoder.layers)
    pass_ = decoder_pass(decoder)
    recurrent = pass_.recurrent  # SSRU: one cell (N, cell_dim) per layer is the step's state
    cell_dim = decoder.layers[0].ssru.input_proj.out_features if recurrent else 0
    if recurrent:
        past, present = [f"past_c{i}" for i in range(layers)], [f"present_c{i}" for i in range(layers)]
    else:
        past, present = _names("past", layers), _names("present", layers)
    src = example_source(src_dict)
    length = family_of(model).length_predictor
    with torch.no_grad():
        encoder_outputs = EncoderGraph(model, length=length)(src)
    bias, enc_kv = encoder_outputs[0], list(encoder_outputs[1 : 1 + 2 * layers])
    V = len(tgt_dict)
    r = min(16, V)
    enc_names = _names("enc", layers)
    # what the step graphs and the greedy loop share: their past state and its axes, the encoder side's axes
    caches = (
        [torch.zeros(2 * B, cell_dim) for _ in range(layers)]
        if recurrent
        else [torch.zeros(2 * B, pass_.heads, t, pass_.head_dim) for _ in range(2 * layers)]
    )
    state_axes = {
        **{n: ({0: "N"} if recurrent else {0: "N", 2: "t"}) for n in past},
        **{n: ({0: "N"} if recurrent else {0: "N", 2: "t1"}) for n in present},
    }
    return Examples(
        model=model,
        tgt_eos=tgt_dict.eos(),
        tgt_unk=tgt_dict.unk(),
        max_positions=int(model.max_decoder_positions()),
        layers=layers,
        heads=pass_.heads,
        head_dim=pass_.head_dim,
        recurrent=recurrent,
        cell_dim=cell_dim,
        window=int(pass_.window),
        length=length,
        src=src,
        bias=bias,
        enc_kv=enc_kv,
        enc_names=enc_names,
        past=past,
        present=present,
        logit_bias=torch.zeros(V),
        r=r,
        out_rows=[decoder.output_projection.weight[:r].clone(), torch.zeros(r)],
        rows_kv=[x.repeat_interleave(2, dim=0) for x in (bias, *enc_kv)],
        caches=caches,
        state_axes=state_axes,
        encoder_axes={"encoder_bias": {0: "N", 3: "S"}, **{n: {0: "N", 2: "S"} for n in enc_names}},
    )


def trace_encoder(writer: GraphWriter, ex: Examples) -> None:
    """``encoder.onnx``: source tokens to the encoder's bias, keys and values (and the length
    predictor's log-probabilities)."""
    writer.export(
        EncoderGraph(ex.model, length=ex.length),
        (ex.src,),
        ["src_tokens"],
        ["encoder_bias", *ex.enc_names, *(["length_lprobs"] if ex.length else [])],
        {
            "src_tokens": {0: "B", 1: "S"},
            "encoder_bias": {0: "B", 3: "S"},
            **{n: {0: "B", 2: "S"} for n in ex.enc_names},
            **({"length_lprobs": {0: "B"}} if ex.length else {}),
        },
        "encoder.onnx",
    )


@dataclass
class OutputRows:
    """A graph's output rows: all of them, or (``restricted``) a shortlist's as inputs."""

    inputs: List[str]
    args: List[torch.Tensor]
    axes: Dict[str, Dict[int, str]]
    logit_bias: torch.Tensor
    suffix: str


def output_rows(ex: Examples, restricted: bool) -> OutputRows:
    if not restricted:
        return OutputRows([], [], {}, ex.logit_bias, "")
    axes = {"out_weight": {0: "V"}, "out_bias": {0: "V"}}
    return OutputRows(["out_weight", "out_bias"], ex.out_rows, axes, ex.logit_bias[: ex.r], "_restricted")


def trace_steps(writer: GraphWriter, ex: Examples, rows: OutputRows) -> None:
    """``step.onnx`` (the greedy choice), ``step_tokens.onnx`` (the same without its score: no
    log-softmax) and ``step_top.onnx`` (the ``k`` best, ``k`` an input): one decoder step of AT,
    HRT's AT mode and Skip-AT."""
    relative_in = ["buckets"] if ex.window > 0 else []
    relative_args = [torch.arange(t + 1).clamp(max=2 * ex.window)] if ex.window > 0 else []
    step_in = ["tokens", "position", *relative_in, "logit_bias", "encoder_bias", *ex.enc_names, *ex.past, *rows.inputs]
    step_args = (
        torch.full((2 * B,), ex.tgt_eos),
        torch.tensor([t]),
        *relative_args,
        rows.logit_bias,
        *ex.rows_kv,
        *ex.caches,
        *rows.args,
    )
    step_dyn = {
        "tokens": {0: "N"},
        "buckets": {0: "t1"},
        "logit_bias": {0: "V"},
        **ex.encoder_axes,
        **ex.state_axes,
        **rows.axes,
    }
    if ex.window == 0:
        del step_dyn["buckets"]
    restricted = bool(rows.inputs)
    writer.export(
        StepGraph(ex.model, ex.max_positions, top=1, restricted=restricted),
        step_args,
        step_in,
        ["score", "token", *ex.present],
        {**step_dyn, "score": {0: "N"}, "token": {0: "N"}},
        f"step{rows.suffix}.onnx",
    )
    if not restricted:  # a shortlist's searches read their scores from step_restricted.onnx
        writer.export(
            StepGraph(ex.model, ex.max_positions, top=1, scores=False),
            step_args,
            step_in,
            ["logit", "token", *ex.present],
            {**step_dyn, "logit": {0: "N"}, "token": {0: "N"}},
            "step_tokens.onnx",
        )
    writer.export(
        StepGraph(ex.model, ex.max_positions, top=4, restricted=restricted),
        step_args,
        step_in,
        ["top_scores", "top_rows", *ex.present],
        {**step_dyn, "top_scores": {0: "N", 1: "K"}, "top_rows": {0: "N", 1: "K"}},
        f"step_top{rows.suffix}.onnx",
        k_input=True,
    )


def trace_parallel(writer: GraphWriter, ex: Examples, rows: OutputRows) -> None:
    """``parallel.onnx``: a non-causal pass (HRT's stage II, Mask-Predict's passes)."""
    T = 6
    queries = torch.arange(0, T, 2)
    par_args = (
        torch.full((B, T), ex.tgt_unk),
        torch.arange(1, T + 1).expand(B, T).contiguous(),
        queries,
        torch.arange(0, B * queries.numel(), 2),
        rows.logit_bias,
        ex.bias,
        *ex.enc_kv,
        *rows.args,
    )
    writer.export(
        ParallelGraph(ex.model, ex.max_positions, restricted=bool(rows.inputs)),
        par_args,
        ["tokens", "positions", "queries", "select", "logit_bias", "encoder_bias", *ex.enc_names, *rows.inputs],
        ["score", "token"],
        {
            "tokens": {0: "B", 1: "T"},
            "positions": {0: "B", 1: "T"},
            "queries": {0: "Q"},
            "select": {0: "M"},
            "logit_bias": {0: "V"},
            "encoder_bias": {0: "B", 3: "S"},
            **{n: {0: "B", 2: "S"} for n in ex.enc_names},
            "score": {0: "M"},
            "token": {0: "M"},
            **rows.axes,
        },
        f"parallel{rows.suffix}.onnx",
    )


def trace_greedy_loop(writer: GraphWriter, ex: Examples, restricted: bool) -> None:
    """``greedy.onnx`` (``greedy_restricted.onnx``): the greedy search of AT, AT mode and
    Skip-AT as one ONNX ``Loop`` (:mod:`.loop`)."""
    lengths = [torch.tensor(1), torch.tensor(10), torch.tensor(1)]  # stride, max_len, min_len
    body_args = (
        torch.tensor(t),
        torch.tensor(True),
        torch.ones(2 * B, dtype=torch.bool),
        torch.full((2 * B,), ex.tgt_eos),
        *ex.caches,
        *lengths,
    )
    loop_axes = {
        "alive": {0: "N"},
        "prev": {0: "N"},
        "alive_out": {0: "N"},
        "token": {0: "N"},
        "score": {0: "N"},
        **ex.encoder_axes,
        **ex.state_axes,
    }
    if restricted:
        rows_args, bias_arg = ex.out_rows + [torch.arange(ex.r)], ex.logit_bias[: ex.r]
        names = ("usual_bias", "early_bias", "final_bias", "out_weight", "out_bias", "out_ids")
        rows_dyn = {name: {0: "V"} for name in names}
    else:
        rows_args, bias_arg, rows_dyn = [], ex.logit_bias, {}
    writer.export(
        GreedyLoopBody(ex.model, ex.max_positions, ex.tgt_eos, restricted=restricted),
        (*body_args, bias_arg, bias_arg, bias_arg, *ex.rows_kv, *rows_args),
        body_inputs(ex.past, ex.enc_names, restricted),
        ["cond_out", "alive_out", "token", *ex.present, "score"],
        {**loop_axes, **rows_dyn},
        "greedy_restricted.onnx" if restricted else "greedy.onnx",
        wrap=lambda body: greedy_loop(body, ex.past, ex.present, ex.enc_names),
    )


def trace_graphs(ex: Examples, folder: str, restricted: bool) -> Dict[str, str]:
    """Write every graph the model's family decodes with into ``folder`` (``restricted``: the
    shortlist variants too); returns the graphs' files by name, in the order written."""
    family = family_of(ex.model)
    writer = GraphWriter(folder)
    trace_encoder(writer, ex)
    for restricted_rows in (False, True) if restricted else (False,):
        rows = output_rows(ex, restricted_rows)
        if family.left_to_right:  # AT, HRT's AT mode and Skip-AT
            trace_steps(writer, ex, rows)
        if family.non_causal:  # stage II, Mask-Predict's passes
            trace_parallel(writer, ex, rows)
    if family.left_to_right:  # the greedy search (AT, AT mode, Skip-AT) as one run: export/loop.py
        for restricted_rows in (False, True) if restricted else (False,):
            trace_greedy_loop(writer, ex, restricted_rows)
    return writer.files
