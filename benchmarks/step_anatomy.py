#!/usr/bin/env python
"""Where one decoder step's time goes in ONNX Runtime, beside CTranslate2's step of the same model.

``time_split.py`` splits a sentence into encoder, steps, stage II and the search around them;
this looks inside one step, on an exported folder (``fairseq-hrt-export``), torch-free:

* **the loop's step** (``greedy.onnx``): the cost of one more step of the greedy loop, from
  two runs of forced lengths (``</s>`` banned until the last step), over the whole vocabulary
  and, with ``--rows N``, over N output rows (``greedy_restricted.onnx``: a shortlist's);
* **inside the step graph** (``step.onnx`` at batch 1 after ``--past`` steps): every prefix of
  the optimised graph (ONNX Runtime's own optimisation, as a session applies it) is its own
  session, timed; the difference between consecutive prefixes is what that operator adds
  (kernel, allocation, dispatch), summed into the groups of :data:`GROUPS`. The prefixes share
  the run's fixed cost, which is its own line;
* **CTranslate2** (``--ctranslate2 DIR``, a converted AT model): one more step of its greedy
  search, from forced lengths too (``min_decoding_length = max_decoding_length``), float32 and
  int8, and with its vocabulary map when the folder has ``vmap.txt``.

Every time is the best of ``--repeats`` rounds (this measures what an operator costs, not
the noise of a shared machine). Prints a table and writes ``OUT/step_anatomy.{md,json}``::

    python benchmarks/step_anatomy.py --onnx model-onnx --ctranslate2 ct2-model --rows 150 --out-dir R/anatomy
"""

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.report_files import write_report  # noqa: E402
from hrt_runtime.model import ExportedModel  # noqa: E402
from hrt_runtime.search import Rules, SearchConfig  # noqa: E402

# the groups of the step graph's operators (the output layer: the matrix product whose logits
# the log-softmax reads; the choice: everything after it)
GROUPS = ("embedding", "layer norms", "projections", "attention", "residuals and reshapes", "output layer", "choice")
ATTENTION_OPS = {"MatMul", "FusedMatMul", "Softmax", "Concat", "Transpose", "Where"}
MATRIX_PRODUCTS = {"MatMul", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
PROJECTION_OPS = {
    "Gemm",
    "FusedGemm",
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "DynamicQuantizeLinear",
    "MatMulIntegerToFloat",
    "Relu",
}


def best_time(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` rounds of ``calls`` calls, after a warm-up."""
    for _ in range(max(3, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def session_options(threads: int):
    import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def source_ids(model, length: int) -> np.ndarray:
    """One source sentence of ``length`` tokens (ordinary symbols, then ``</s>``)."""
    first = 4 + len(model.chunk_start) + 1  # past the special symbols
    tokens = first + np.arange(length - 1) % max(1, model.vocab_size - first - 16)
    return np.array([[*tokens, model.source_eos]], np.int64)


def loop_step_cost(
    model, source: np.ndarray, short: int, long: int, calls: int, repeats: int, rows: Optional[np.ndarray] = None
) -> Dict[str, float]:
    """us per step of the greedy loop (``greedy.onnx``, or ``greedy_restricted.onnx`` over
    ``rows``), called as the search calls it (``ExportedModel.greedy_loop``): two runs of
    ``short`` and ``long`` forced steps, the difference per step."""
    encoded = model.encode(source)
    out_rows = model.rows(rows)
    size = model.vocab_size if rows is None else rows.size

    def run(steps: int):
        rules = Rules(
            SearchConfig(beam=1, max_len_b=steps - 1), model.eos, model.unk, model.config["banned"], out_rows, size
        )
        biases = (rules.early, rules.early, rules.final)  # </s> banned until the last step, which forces it
        return lambda: model.greedy_loop(encoded, model.eos, steps - 1, rules.config.min_len, biases, out_rows)

    assert run(long)()[0].shape[1] == long
    t_short = best_time(run(short), calls, repeats)
    t_long = best_time(run(long), max(1, calls * short // long), repeats)
    return {
        "us_per_step": (t_long - t_short) / (long - short) * 1e6,
        "us_run_of_short": t_short * 1e6,
        "us_run_of_long": t_long * 1e6,
        "steps": [short, long],
        "rows": int(size),
    }


def step_feeds(model, source: np.ndarray, past_steps: int) -> dict:
    """The step graph's feeds at batch 1 after ``past_steps`` greedy steps."""
    encoded = model.encode(source)
    state = model.begin(encoded, 1, past_steps + 1, model.eos, model.rows(None))
    bias = np.zeros(model.vocab_size, np.float32)
    bias[model.config["banned"]] = -np.inf
    tokens = np.full(1, model.eos, np.int64)
    for step in range(past_steps):
        _, row = model.step(state, tokens, step, bias)
        tokens = row
    feeds = dict(state.feeds)
    feeds.update(zip(model.past_names, state.past))
    feeds.update(tokens=tokens, position=model.position(past_steps), logit_bias=bias)
    if model.window > 0:
        feeds["buckets"] = model.buckets(past_steps, 1)
    return feeds


def optimized_step_graph(model, tmp: str, threads: int):
    """The step graph as ONNX Runtime's session optimises it (written into ``tmp``, with its
    weights beside it)."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting
    import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

    options = session_options(threads)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # what a session runs
    options.optimized_model_filepath = os.path.join(tmp, "step.optimized.onnx")
    # the optimised weights beside it (the prefixes' external data, relative to tmp)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
    ort.InferenceSession(
        os.path.join(model.folder, model.config["graphs"]["step"]), options, providers=["CPUExecutionProvider"]
    )
    return onnx.load(options.optimized_model_filepath, load_external_data=False)


def operator_group(nodes, i: int, output_layer: int) -> str:
    """Which of :data:`GROUPS` operator ``i`` of the step graph belongs to."""
    op = nodes[i].op_type
    if i == output_layer:
        return "output layer"
    if i > output_layer:
        return "choice"
    if op == "Gather" and any(name in ("tokens", "position") for name in nodes[i].input):
        return "embedding"
    if op in ("LayerNormalization", "SkipLayerNormalization"):
        return "layer norms"
    if op in PROJECTION_OPS:
        return "projections"
    if op in ATTENTION_OPS:
        return "attention"
    return "residuals and reshapes"


def prefix_session(graph_model, producer: dict, last: int, feeds: dict, tmp: str, threads: int):
    """``(session, feeds, outputs)`` of the graph's operators that operator ``last``'s output needs."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting
    import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

    graph = graph_model.graph
    nodes = list(graph.node)
    needed, stack = set(), [nodes[last].output[0]]
    while stack:
        name = stack.pop()
        i = producer.get(name)
        if i is None or i in needed:
            continue
        needed.add(i)
        stack.extend(nodes[i].input)
    kept = [nodes[i] for i in sorted(needed)]
    names = {name for node in kept for name in node.input}
    sub = onnx.helper.make_graph(
        kept,
        "prefix",
        [v for v in graph.input if v.name in names],
        [onnx.helper.make_empty_tensor_value_info(nodes[last].output[0])],
        [init for init in graph.initializer if init.name in names],
    )
    sub_model = onnx.helper.make_model(sub, opset_imports=graph_model.opset_import)
    sub_model.ir_version = graph_model.ir_version
    path = os.path.join(tmp, f"prefix{last}.onnx")
    onnx.save(sub_model, path)
    off = session_options(threads)
    off.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # already optimised
    session = ort.InferenceSession(path, off, providers=["CPUExecutionProvider"])
    inputs = {v.name for v in session.get_inputs()}
    return session, {k: v for k, v in feeds.items() if k in inputs}, [nodes[last].output[0]]


def step_graph_prefixes(model, source: np.ndarray, past_steps: int, calls: int, repeats: int, threads: int):
    """``(fixed, [(op, group, us)], total)`` of the optimised step graph at batch 1 after
    ``past_steps`` steps: the run of its first operator alone (``fixed``: the run's own cost
    and that operator), then what each further operator adds."""
    feeds = step_feeds(model, source, past_steps)
    with tempfile.TemporaryDirectory(prefix="step-anatomy-") as tmp:
        graph_model = optimized_step_graph(model, tmp, threads)
        nodes = list(graph_model.graph.node)
        producer = {out: i for i, node in enumerate(nodes) for out in node.output}
        # the output layer: the matrix product the log-softmax reads (through a bias or a cast)
        output_layer = producer[next(node for node in nodes if node.op_type == "LogSoftmax").input[0]]
        while nodes[output_layer].op_type not in MATRIX_PRODUCTS:
            output_layer = producer[nodes[output_layer].input[0]]
        # prefixes in topological order, each ending at one more operator (cumulative times)
        cumulative = []
        for last in range(len(nodes)):
            session, sub_feeds, outputs = prefix_session(graph_model, producer, last, feeds, tmp, threads)
            run = session._sess.run
            cumulative.append(best_time(lambda: run(outputs, sub_feeds, None), calls, repeats) * 1e6)
        full = model.session("step")
        names = [o.name for o in full.get_outputs()]
        total = best_time(lambda: full._sess.run(names, feeds, None), calls, repeats) * 1e6
    # a prefix holds only the operators its last output needs: the increment of operator i is
    # measured against the largest earlier prefix it contains (its inputs' prefixes)
    added = []
    for i in range(1, len(nodes)):
        before = [producer[name] for name in nodes[i].input if name in producer]
        base = max((cumulative[j] for j in before), default=cumulative[0])
        added.append((nodes[i].op_type, operator_group(nodes, i, output_layer), max(0.0, cumulative[i] - base)))
    return cumulative[0], added, total


def ctranslate2_step_cost(model_dir: str, length: int, short: int, long: int, calls: int, repeats: int, threads: int):
    """us per greedy step of CTranslate2 (float32, int8; with the vocabulary map when the
    folder has one): forced lengths ``short`` and ``long``, the difference per step."""
    import ctranslate2  # noqa: PLC0415 - optional: CTranslate2

    source = [[f"▁w{i}" for i in range(length - 1)]]
    out = {}
    vmap = os.path.isfile(os.path.join(model_dir, "vmap.txt"))
    for compute_type in ("float32", "int8"):
        translator = ctranslate2.Translator(
            model_dir, device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=threads
        )
        for use_vmap in (False, True) if vmap else (False,):

            def run(steps):
                return lambda: translator.translate_batch(
                    source, beam_size=1, max_decoding_length=steps, min_decoding_length=steps, use_vmap=use_vmap
                )

            t_short = best_time(run(short), calls, repeats)
            t_long = best_time(run(long), max(1, calls * short // long), repeats)
            name = compute_type + (" +vmap" if use_vmap else "")
            out[name] = {"us_per_step": (t_long - t_short) / (long - short) * 1e6, "us_run_of_short": t_short * 1e6}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--onnx", required=True, help="a folder of fairseq-hrt-export (AT or HRT)")
    p.add_argument("--ctranslate2", help="the same AT model converted to CTranslate2 (its per-step cost beside ours)")
    p.add_argument("--rows", type=int, default=0, help="also the loop over this many output rows (a shortlist's size)")
    p.add_argument("--source-length", type=int, default=15, help="source tokens with </s> (test2016: 14.9 on average)")
    p.add_argument("--past", type=int, default=8, help="steps before the measured step of the step graph")
    p.add_argument("--steps", default="4,32", help="the loop's two forced lengths")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", required=True)
    return p


def loop_costs(args, model, source: np.ndarray, short: int, long: int, report: dict) -> dict:
    """The greedy loop's cost per step over the whole vocabulary (and ``--rows`` rows)."""
    loops = {"whole vocabulary": loop_step_cost(model, source, short, long, args.calls, args.repeats)}
    if args.rows and "greedy_restricted" not in model.config["graphs"]:
        report["loop_rows_skipped"] = "the folder has no greedy_restricted graph (exported with --no-restricted)"
    elif args.rows:
        rng = np.random.default_rng(0)
        ids = np.unique(
            np.concatenate(
                [[model.eos, model.unk], rng.choice(np.arange(8, model.vocab_size), args.rows - 2, replace=False)]
            )
        )
        loops[f"{ids.size} rows"] = loop_step_cost(
            model, source, short, long, args.calls, args.repeats, ids.astype(np.int64)
        )
    return loops


def markdown(args, report: dict, loops: dict, groups: Dict[str, List[float]], ort_version: str) -> str:
    """The report's text: the loop's cost per step, and what each group of the step graph's
    operators adds (``groups``: group -> [us, operators])."""
    graph = report["step_graph"]
    fixed, total, operators = graph["us_first_operator_run"], graph["us_total"], graph["operators"]
    lines = [
        f"## One decoder step: ONNX Runtime {ort_version} ({args.threads} thread(s)) and CTranslate2",
        "",
        f"Batch 1, a source of {args.source_length} tokens; best of {args.repeats} rounds.",
        "",
        "| per step | us |",
        "|---|---:|",
    ]
    for name, cost in loops.items():
        lines.append(f"| ONNX Runtime greedy loop, {name} | {cost['us_per_step']:.1f} |")
    for name, cost in report.get("ctranslate2", {}).items():
        lines.append(f"| CTranslate2 greedy, {name} | {cost['us_per_step']:.1f} |")
    if "loop_rows_skipped" in report:
        lines += ["", f"No loop over {args.rows} rows: {report['loop_rows_skipped']}."]
    lines += [
        "",
        f"Inside `step.onnx` after {args.past} steps (one run from Python: {total:.1f} us; "
        f"{operators} operators after ONNX Runtime's optimisation; what each group adds, summed over "
        "prefix sessions of the graph):",
        "",
        "| part | operators | us |",
        "|---|---:|---:|",
        f"| a run and its first operator | 1 | {fixed:.1f} |",
    ]
    for g in GROUPS:
        if g in groups:
            lines.append(f"| {g} | {groups[g][1]} | {groups[g][0]:.1f} |")
    lines.append(f"| sum | {operators} | {fixed + sum(v[0] for v in groups.values()):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None):
    args = build_parser().parse_args(argv)
    import onnxruntime  # noqa: PLC0415 - optional: onnxruntime

    short, long = (int(x) for x in args.steps.split(","))
    model = ExportedModel(args.onnx, threads=args.threads)
    source = source_ids(model, args.source_length)
    report = {
        "folder": os.path.relpath(args.onnx, args.out_dir),
        "onnxruntime": onnxruntime.__version__,
        "threads": args.threads,
        "source_length": args.source_length,
        "int8": bool(model.config.get("int8")),
    }
    loops = loop_costs(args, model, source, short, long, report)
    report["loop"] = loops
    fixed, added, total = step_graph_prefixes(model, source, args.past, args.calls, args.repeats, args.threads)
    groups: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for op, group, us in added:
        groups[group][0] += us
        groups[group][1] += 1
    report["step_graph"] = {
        "us_total": total,
        "us_first_operator_run": fixed,
        "operators": len(added) + 1,
        "groups": {g: {"us": groups[g][0], "operators": groups[g][1]} for g in GROUPS if g in groups},
        "operators_added": [{"op": op, "group": g, "us": us} for op, g, us in added],
    }
    if args.ctranslate2:
        report["ctranslate2"] = ctranslate2_step_cost(
            args.ctranslate2, args.source_length, short, long, args.calls // 4, args.repeats, args.threads
        )
    write_report(args.out_dir, "step_anatomy", report, markdown(args, report, loops, groups, onnxruntime.__version__))


if __name__ == "__main__":
    main()
