#!/usr/bin/env python
"""Our AT's encoder and decoder step at a large batch against CTranslate2's, with ONNX Runtime's
own profile of the step: where the float AT loses to CTranslate2 at batch 128 on a CPU.

For each ``--shapes`` shape (``benchmarks/paper_shapes.py``'s, random weights, vocabulary
``--vocab``): the AT model is exported (``fairseq-hrt-export``) and converted for CTranslate2 in a
child process (the only one that imports PyTorch), then, in this process (no PyTorch) with
CTranslate2 in a child process of its own, at batch ``--batch``, sources of ``--src-len`` tokens
and ``--steps`` forced steps, one round-robin loop (:func:`benchmarks.timing.time_runs`, the
fastest of ``--runs``) times:

* ``ours encoder``: ``ExportedModel.encode``; ``ours steps`` (and its variants): ``--steps``
  calls of ``ExportedModel.step`` from ``begin``, the search's own calls, each step's choice fed
  back as the next token;
* ``CTranslate2 1 step`` and ``CTranslate2 N+1 steps``: greedy decoding forced to that many
  steps (``min_decoding_length = max_decoding_length``); its step is their difference / N and its
  encoder the first less one step; the same with ``return_scores`` (``, scored``), which adds its
  log-softmax to every step, as our step has it.

Variants of our step (:data:`STEP_VARIANTS`) are rows of the same loop, checked to choose the
same tokens as the plain step. Then ONNX Runtime's profiler (``enable_profiling``) on the encoder and
step sessions over ``--runs`` rounds of an encoding and the ``--steps`` steps: each operator type's
share of the fastest round's node time, and the costliest nodes. Writes ``OUT/report.{md,json}``::

    OMP_NUM_THREADS=1 python benchmarks/batch_step.py --shapes base --out-dir benchmarks/results/batch128-cpu
"""

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Callable, Dict, List, Optional

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.ct2_child import ForcedLengthChild  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.report_files import write_files  # noqa: E402
from benchmarks.timing import TimingResult, time_runs  # noqa: E402
from hrt_runtime.model import VERSION as FORMAT_VERSION  # noqa: E402 - numpy and ONNX Runtime only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ----------------------------------------------------------------- the models (PyTorch: a child)


def prepare(shape: str, vocab: int, workdir: str) -> None:
    """The AT model of ``shape`` under ``workdir/SHAPE``: ``onnx/`` (exported) and CTranslate2's
    conversion; kept while both are there. Runs in a child process (:func:`prepared`)."""
    from benchmarks import ct2_reference  # noqa: PLC0415 - imports fairseq
    from benchmarks.onnx_gate import random_model  # noqa: PLC0415 - imports PyTorch
    from benchmarks.paper_shapes import SHAPES  # noqa: PLC0415 - imports PyTorch
    from fairseq_hrt.export.exporter import export_model  # noqa: PLC0415 - imports PyTorch

    spec = SHAPES[shape]
    folder = os.path.join(workdir, shape)
    os.makedirs(os.path.join(folder, "at"), exist_ok=True)
    checkpoint = os.path.join(folder, "at", "checkpoint.pt")
    extra = ["--hrt-mode", "at", *spec.model_args, *spec.at_args]
    task, model = random_model(spec.at_arch, vocab, folder, extra_args=extra, checkpoint=checkpoint)
    export_model(model, task, os.path.join(folder, "onnx"), restricted=False)
    ct2_reference.convert(checkpoint, folder, folder, "src", "tgt")


def prepared(shape: str, vocab: int, workdir: str) -> Dict[str, str]:
    """``{onnx, ctranslate2, dictionary}`` of ``shape``'s AT model, made by a child process
    that imports PyTorch (this one does not) unless already there."""
    folder = os.path.join(workdir, shape)
    paths = {
        "onnx": os.path.join(folder, "onnx"),
        "ctranslate2": os.path.join(folder, "ctranslate2-at"),
        "dictionary": os.path.join(folder, "dict.src.txt"),
    }
    done = os.path.join(folder, f"prepared-{vocab}-format-{FORMAT_VERSION}")
    if not os.path.exists(done):
        code = f"from benchmarks.batch_step import prepare; prepare({shape!r}, {vocab}, {workdir!r})"
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
        with open(done, "w") as f:
            f.write("\n")
    return paths


# ------------------------------------------------------------------------------- our passes


def fixed_inputs(model, batch: int, src_len: int, seed: int = 0):
    """``(sources (B, S), logit bias)``: random sources ending in ``</s>``, and a bias that
    bans the symbols no decoder outputs and ``</s>`` (every row makes all its steps)."""
    rng = np.random.RandomState(seed)
    config = model.config
    src = rng.randint(16, model.vocab_size - 16, (batch, src_len)).astype(np.int64)
    src[:, -1] = config["source_eos"]
    bias = np.zeros(model.vocab_size, np.float32)
    bias[[*config["banned"], model.eos]] = -np.inf
    return src, bias


def plain_steps(model, encoded, steps: int, bias: np.ndarray, scores: bool = True) -> np.ndarray:
    """``steps`` calls of ``ExportedModel.step`` from ``begin``, as the greedy search makes them;
    returns the tokens chosen ``(B, steps)``."""
    batch = encoded.size
    state = model.begin(encoded, batch, steps + 1, model.eos, model.rows(None))
    prev = np.full((batch,), model.eos, np.int64)
    chosen = []
    for step in range(steps):
        _, prev = model.step(state, prev, step, bias, scores=scores)
        chosen.append(prev)
    return np.stack(chosen, 1)


def io_bound_steps(model, encoded, steps: int, bias: np.ndarray) -> np.ndarray:
    """:func:`plain_steps` with ONNX Runtime's IO binding: the inputs bound once, each step's
    present keys/values bound as the next step's past as they are (``OrtValue``s, never numpy
    arrays), only the chosen tokens read back."""
    session = model.session("step")
    batch = encoded.size
    binding = session.io_binding()
    for name, value in encoded.feeds().items():
        binding.bind_cpu_input(name, value)
    binding.bind_cpu_input("logit_bias", bias)
    for name, value in zip(model.past_names, model.empty_past(batch)):
        binding.bind_cpu_input(name, value)
    outputs = [output.name for output in session.get_outputs()]
    prev = np.full((batch,), model.eos, np.int64)
    chosen = []
    for step in range(steps):
        binding.bind_cpu_input("tokens", prev)
        binding.bind_cpu_input("position", model.position(step))
        if model.window > 0:
            binding.bind_cpu_input("buckets", model.buckets(step, 1))
        binding.clear_binding_outputs()  # a new present each step: the past grows by one position
        for name in outputs:
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        found = binding.get_outputs()
        prev = found[1].numpy()
        chosen.append(prev)
        for name, value in zip(model.past_names, found[2:]):
            binding.bind_ortvalue_input(name, value)
    return np.stack(chosen, 1)


def row_block_steps(model, encoded, steps: int, bias: np.ndarray, block: int = 32) -> np.ndarray:
    """:func:`plain_steps` over blocks of ``block`` rows, each its own state, a step of every
    block before the next step: the output layer's logits and the past of ``block`` rows at a time."""
    batch = encoded.size
    blocks = [np.arange(start, min(start + block, batch)) for start in range(0, batch, block)]
    states = [model.begin(encoded.select(rows), rows.size, steps + 1, model.eos, model.rows(None)) for rows in blocks]
    prev = np.full((batch,), model.eos, np.int64)
    chosen = []
    for step in range(steps):
        parts = [model.step(state, prev[rows], step, bias)[1] for state, rows in zip(states, blocks)]
        prev = np.concatenate(parts)
        chosen.append(prev)
    return np.stack(chosen, 1)


def preallocated_steps(model, encoded, steps: int, bias: np.ndarray) -> np.ndarray:
    """:func:`io_bound_steps` with the present keys/values written into two buffers per state
    allocated once, in turn (a step reads its past from one and writes its present into the
    other): no fresh memory for them at each step (ONNX Runtime's sessions have no arena here,
    so each output is a new allocation, faulted in page by page as the graph writes it)."""
    session = model.session("step")
    batch, per_position = encoded.size, encoded.size * model.heads * model.head_dim
    buffers = [[np.empty(per_position * steps, np.float32) for _ in model.past_names] for _ in range(2)]
    binding = session.io_binding()
    for name, value in encoded.feeds().items():
        binding.bind_cpu_input(name, value)
    binding.bind_cpu_input("logit_bias", bias)
    outputs = [output.name for output in session.get_outputs()]
    prev = np.full((batch,), model.eos, np.int64)
    chosen = []
    for step in range(steps):
        past, present = buffers[step % 2], buffers[(step + 1) % 2]
        for name, flat in zip(model.past_names, past):
            binding.bind_cpu_input(name, flat[: per_position * step].reshape(batch, model.heads, step, model.head_dim))
        binding.bind_cpu_input("tokens", prev)
        binding.bind_cpu_input("position", model.position(step))
        if model.window > 0:
            binding.bind_cpu_input("buckets", model.buckets(step, 1))
        binding.clear_binding_outputs()
        for name in outputs[:2]:
            binding.bind_output(name)
        shape = [batch, model.heads, step + 1, model.head_dim]
        for name, flat in zip(outputs[2:], present):
            binding.bind_output(name, "cpu", 0, np.float32, shape, flat.ctypes.data)
        session.run_with_iobinding(binding)
        prev = binding.get_outputs()[1].numpy()
        chosen.append(prev)
    return np.stack(chosen, 1)


class ArenaModels:
    """A second :class:`ExportedModel` of each folder whose sessions keep ONNX Runtime's CPU
    memory arena (``memory_arena=True``; the runtime's default is off: a service would keep its
    largest batch's memory); ``shrink``: every run gives back the arena's free memory at its end
    (``memory.enable_memory_arena_shrinkage``), so no more than a run's outputs stay held."""

    models: Dict[tuple, object] = {}

    @classmethod
    def of(cls, model, shrink: bool = False):
        found = cls.models.get((model.folder, shrink))
        if found is None:
            found = cls.models[model.folder, shrink] = type(model)(model.folder, model.threads, memory_arena=True)
            if shrink:
                found.runner = shrinking_runner(found)
        return found


def shrinking_runner(model) -> Callable:
    """``graph -> (feeds -> outputs)`` of ``model``'s sessions, each run shrinking the arena at its end."""
    runners: Dict[str, Callable] = {}

    def runner(graph: str) -> Callable:
        found = runners.get(graph)
        if found is None:
            session = model.session(graph)
            names = [output.name for output in session.get_outputs()]
            options = model.sessions._ort.RunOptions()
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            run = session._sess.run
            found = runners[graph] = lambda feeds: run(names, feeds, options)
        return found

    return runner


def unscored_steps(model, encoded, steps: int, bias: np.ndarray) -> np.ndarray:
    """:func:`plain_steps` without the scores: the folder's ``step_tokens.onnx`` (no
    log-softmax), as the runtime's translations run it."""
    return plain_steps(model, encoded, steps, bias, scores=False)


def encode_in_blocks(model, src: np.ndarray, block: int = 16) -> List[np.ndarray]:
    """The encoder's outputs for ``src`` from runs over ``block`` sentences at a time, each run
    writing its rows into the whole batch's outputs (IO binding: no concatenation). ONNX
    Runtime's matrix products run faster over a few hundred rows than over a batch's thousands
    (``gemm_rate.py``'s products at 128 rows against 3968)."""
    session = model.session("encoder")
    names = [output.name for output in session.get_outputs()]  # the bias, then every layer's keys, values (AT)
    b, s = src.shape
    outputs = [np.empty((b, 1, 1, s), np.float32)]
    outputs += [np.empty((b, model.heads, s, model.head_dim), np.float32) for _ in names[1:]]
    binding = session.io_binding()
    for start in range(0, b, block):
        binding.bind_cpu_input("src_tokens", src[start : start + block])
        for name, whole in zip(names, outputs):
            part = whole[start : start + block]
            binding.bind_output(name, "cpu", 0, whole.dtype, list(part.shape), part.ctypes.data)
        session.run_with_iobinding(binding)
    return outputs


def arena_steps(model, encoded, steps: int, bias: np.ndarray) -> np.ndarray:
    return plain_steps(ArenaModels.of(model), encoded, steps, bias)


def shrunk_arena_steps(model, encoded, steps: int, bias: np.ndarray) -> np.ndarray:
    return plain_steps(ArenaModels.of(model, shrink=True), encoded, steps, bias)


# name -> (model, encoded, steps, bias) -> tokens (B, steps): our step and its variants, rows of the
# same loop (a variant is kept here, measured, whether or not the runtime adopted it)
STEP_VARIANTS: Dict[str, Callable] = {
    "ours steps": plain_steps,
    "IO binding of the past": io_bound_steps,
    "rows in blocks of 32": row_block_steps,
    "rows in blocks of 64": lambda *a: row_block_steps(*a, block=64),
    "past in two buffers (IO binding)": preallocated_steps,
    "session with a memory arena": arena_steps,
    "memory arena, shrunk after each run": shrunk_arena_steps,
    "without scores (step_tokens.onnx: no log-softmax, as CTranslate2 without return_scores)": unscored_steps,
}


def time_shape(paths: Dict[str, str], batch: int, src_len: int, steps: int, runs: int, threads: int):
    """``(times in ms, checks)`` of our passes and CTranslate2's, round-robin, the fastest of ``runs``."""
    from hrt_runtime.model import ExportedModel  # noqa: PLC0415 - after the child made the folder
    from hrt_runtime.translator import read_dictionary  # noqa: PLC0415 - the runtime, as the model

    model = ExportedModel(paths["onnx"], threads=threads)
    src, bias = fixed_inputs(model, batch, src_len)
    symbols = read_dictionary(paths["dictionary"])
    # CTranslate2 appends </s> itself: the same sources without it
    sources = [[symbols[t] for t in row[:-1]] for row in src]
    # CTranslate2's greedy search computes the log-softmax only with return_scores (its default is
    # off); our step always returns its token's log-probability: both forms are rows, each job
    # named as its row
    jobs = {
        f"CTranslate2 {n} step{'' if n == 1 else 's'}{', scored' if scored else ''}": [
            {"tokens": sources, "length": n, "return_scores": scored}
        ]
        for n in (1, steps + 1)
        for scored in (False, True)
    }
    ct2 = ForcedLengthChild(paths["ctranslate2"], jobs, ["float32"], threads)
    try:
        encoded = model.encode(src)
        reference = plain_steps(model, encoded, steps, bias)
        fns = {
            "ours encoder": lambda: model.encode(src),
            "ours encoder, memory arena": lambda: ArenaModels.of(model).encode(src),
            "ours encoder, blocks of 16 sentences": lambda: encode_in_blocks(model, src),
        }
        for name, variant in STEP_VARIANTS.items():
            fns[name] = lambda variant=variant: variant(model, encoded, steps, bias)
        for job in jobs:
            fns[job] = ct2.timed("float32", job)
        timed = time_runs(fns, warmup=1, runs=runs)
    finally:
        ct2.close()
    for job in jobs:
        # the child's own clock (its passes without the pipe's round trip); the warm-up's left out
        timed[job] = TimingResult(tuple(ct2.seconds[("float32", job)][1:]), timed[job].value)
    checks = {
        name: bool(np.array_equal(timed[name].value, reference)) for name in STEP_VARIANTS if name != "ours steps"
    }
    whole = [encoded.bias, *encoded.keys, *encoded.values]
    checks["encoder, blocks of 16 sentences"] = all(
        np.array_equal(a, b) for a, b in zip(timed["ours encoder, blocks of 16 sentences"].value, whole)
    )
    checks["CTranslate2 steps made"] = sum(timed[f"CTranslate2 {steps + 1} steps"].value) == batch * (steps + 1)
    return (
        {name: t.min * 1000 for name, t in timed.items()},
        {k: [s * 1000 for s in t.seconds] for k, t in timed.items()},
        checks,
    )


# ------------------------------------------------------------------------------- the profile


def profile_passes(onnx: str, batch: int, src_len: int, steps: int, rounds: int, threads: int, tmp: str) -> dict:
    """ONNX Runtime's profile (``enable_profiling``) of the runtime's encoder and step sessions over
    ``rounds`` rounds of an encoding and ``steps`` search steps at ``batch``: ``{encoder, step}``,
    each :func:`summarize_profile` of its fastest round."""
    from hrt_runtime.model import ExportedModel  # noqa: PLC0415
    from hrt_runtime.sessions import GraphSessions, session_options  # noqa: PLC0415

    class ProfiledSessions(GraphSessions):
        def _build(self, name):  # the runtime's session, with its profiler on
            options = session_options(self._ort, self._threads)
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(tmp, "profile-" + name)
            if self.weights:
                weights = self.files.read(self.weights)
                options.add_external_initializers_from_files_in_memory([self.weights], [weights], [len(weights)])
            return self._ort.InferenceSession(bytes(self.files.read(name)), options, providers=["CPUExecutionProvider"])

    model = ExportedModel(onnx, threads=threads)
    s = model.sessions
    model.sessions = ProfiledSessions(s.folder, s.graphs, s.kind, threads, s.files, s.weights)
    src, bias = fixed_inputs(model, batch, src_len)
    for _ in range(rounds):
        plain_steps(model, model.encode(src), steps, bias)
    found = {}
    for graph, per_round in (("encoder", 1), ("step", steps)):
        with open(model.session(graph).end_profiling()) as f:
            found[graph] = summarize_profile(json.load(f), per_round)
    return found


def summarize_profile(events: List[dict], per_round: int) -> dict:
    """Node times (``cat`` ``Node``, the ``..._kernel_time`` events) by operator type and by node
    of the fastest round of ``per_round`` session runs (``model_run`` events, a node in the run
    that started last before it): ``{runs, rounds, total_ms, op_types, nodes}``."""
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    rounds = [(defaultdict(float), {}) for _ in range(max(1, -(-len(starts) // per_round)))]
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        run = max(0, bisect.bisect_right(starts, event["ts"]) - 1)
        by_type, by_node = rounds[min(run // per_round, len(rounds) - 1)]
        ms = event["dur"] / 1000
        op = event.get("args", {}).get("op_name", "?")
        by_type[op] += ms
        node = event["name"][: -len("_kernel_time")]
        by_node.setdefault(node, [node, op, 0.0])[2] += ms
    by_type, by_node = min(rounds, key=lambda r: sum(r[0].values()))
    nodes = sorted(by_node.values(), key=lambda n: -n[2])
    return {
        "runs": min(per_round, len(starts)),
        "rounds": len(rounds),
        "total_ms": round(sum(by_type.values()), 3),
        "op_types": {op: round(ms, 3) for op, ms in sorted(by_type.items(), key=lambda kv: -kv[1])},
        "nodes": [[name, op, round(ms, 3)] for name, op, ms in nodes[:15]],
    }


# --------------------------------------------------------------------------------- the report


def shape_result(shape: str, args, tmp: str) -> dict:
    paths = prepared(shape, args.vocab, args.workdir)
    best, seconds, checks = time_shape(paths, args.batch, args.src_len, args.steps, args.runs, args.threads)
    ct2_step = (best[f"CTranslate2 {args.steps + 1} steps"] - best["CTranslate2 1 step"]) / args.steps
    scored = f"CTranslate2 {args.steps + 1} steps, scored"
    derived = {
        **{name: best[name] for name in best if name.startswith("ours encoder")},
        "CTranslate2 encoder": best["CTranslate2 1 step"] - ct2_step,
        "CTranslate2 step": ct2_step,
        "CTranslate2 step, scored": (best[scored] - best["CTranslate2 1 step, scored"]) / args.steps,
        **{f"{name} (per step)": best[name] / args.steps for name in STEP_VARIANTS},
    }
    profile = profile_passes(paths["onnx"], args.batch, args.src_len, args.steps, args.runs, args.threads, tmp)
    return {
        "fastest_ms": {k: round(v, 3) for k, v in best.items()},
        "run_ms": {k: [round(s, 3) for s in v] for k, v in seconds.items()},
        "derived_ms": {k: round(v, 3) for k, v in derived.items()},
        "same_tokens": checks,
        "profile": profile,
    }


def profile_table(graph: str, p: dict) -> List[str]:
    lines = [
        "",
        f"ONNX Runtime's profile of the {graph} session (the fastest of {p['rounds']} rounds of {p['runs']} "
        f"run(s); node time {p['total_ms']:.0f} ms, {p['total_ms'] / max(1, p['runs']):.1f} ms a run):",
        "",
        "| operator type | ms | share |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {op} | {ms:.1f} | {100 * ms / p['total_ms']:.1f} % |" for op, ms in p["op_types"].items()]
    lines += ["", f"| costliest nodes of the {graph} | type | ms |", "| --- | --- | ---: |"]
    return lines + [f"| {name} | {op} | {ms:.1f} |" for name, op, ms in p["nodes"]]


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [
        f"# Our AT's encoder and step at batch {m['batch']} against CTranslate2's (CPU, {m['threads']} thread)",
        "",
        f"CPU: {m['cpu']}; ISA flags: {', '.join(m['isa_flags']) or 'none found'}; onnxruntime "
        f"{m['onnxruntime']}, ctranslate2 {m['ctranslate2']}; OMP_NUM_THREADS={m['omp_num_threads']}.",
        f"Sources of {m['src_len']} tokens, {m['steps']} forced steps, vocabulary {m['vocab']}, random weights; "
        f"the fastest of {m['runs']} round-robin runs. CTranslate2's step: (its {m['steps'] + 1} forced steps less "
        f"its 1 step) / {m['steps']}; its encoder: its 1 step less a step. Our step: {m['steps']} calls of "
        "`ExportedModel.step` / " + f"{m['steps']}; each variant checked to choose the plain step's tokens.",
        "The profiles are of separate runs after the timing loop (the profiler's own cost and the machine's "
        "load of that moment in their times): read their shares, not their milliseconds.",
        "",
        f"Command: `{m['command']}`",
        "",
    ]
    for shape, r in report["shapes"].items():
        d = r["derived_ms"]
        lines += [
            f"## {shape}",
            "",
            "| pass (ms) | ours | CTranslate2 | CTranslate2 / ours |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name in (name for name in d if name.startswith("ours encoder")):
            lines.append(
                f"| {name[5:]} | {d[name]:.1f} | {d['CTranslate2 encoder']:.1f} | "
                f"{d['CTranslate2 encoder'] / d[name]:.2f}x |"
            )
        for name in STEP_VARIANTS:
            ours = d[f"{name} (per step)"]
            same = r["same_tokens"].get(name, True)
            lines.append(
                f"| step: {name}{'' if same else ' (other tokens!)'} | {ours:.2f} | {d['CTranslate2 step']:.2f} | "
                f"{d['CTranslate2 step'] / ours:.2f}x |"
            )
        if "CTranslate2 step, scored" in d:  # reports written before it: no such row
            ours, scored = d["ours steps (per step)"], d["CTranslate2 step, scored"]
            lines.append(
                f"| step, CTranslate2 with return_scores (its log-softmax too, as ours) | {ours:.2f} | {scored:.2f} | "
                f"{scored / ours:.2f}x |"
            )
        for graph, p in r["profile"].items():
            lines += profile_table(graph, p)
        lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="base", help="shapes of benchmarks/paper_shapes.py, comma-separated")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--src-len", type=int, default=31, help="source tokens, </s> included")
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "batch-step-models"))
    p.add_argument("--out-dir", required=True)
    return p


def main(argv: Optional[List[str]] = None):
    args = build_parser().parse_args(argv)
    import ctranslate2  # noqa: PLC0415 - optional: CTranslate2
    import onnxruntime  # noqa: PLC0415 - optional: onnxruntime

    report = {
        "meta": {
            "cpu": cpu_name(),
            "isa_flags": cpu_isa(),
            "threads": args.threads,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "onnxruntime": onnxruntime.__version__,
            "ctranslate2": ctranslate2.__version__,
            "batch": args.batch,
            "src_len": args.src_len,
            "steps": args.steps,
            "vocab": args.vocab,
            "runs": args.runs,
            "command": " ".join(["python benchmarks/batch_step.py", *(argv if argv is not None else sys.argv[1:])]),
        },
        "shapes": {},
    }
    if "torch" in sys.modules:
        raise SystemExit("batch_step: PyTorch was imported into the measuring process (its threads would share it)")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            report["shapes"][shape] = shape_result(shape, args, tmp)
    text = markdown(report)
    print(text)
    write_files(args.out_dir, {"report.md": text, "report.json": json.dumps(report, indent=2)})


if __name__ == "__main__":
    main()
