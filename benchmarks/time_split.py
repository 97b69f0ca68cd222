#!/usr/bin/env python
"""Where decoding time goes: encoder, left-to-right decoder steps, HRT's stage II and the
rest (the search around the steps: argmax, scores, finished sentences leaving the batch; batching),
per sentence, for AT greedy and HRT with the lean engine or ONNX Runtime (``--engine``).

The speed targets of the benchmark are ratios; this says why a ratio is what it is. Each
part is read from ``torch.profiler``: the decoder code marks its parts with
``torch.profiler.record_function`` scopes (``hrt.encoder``: the lean generator's encoder call,
``hrt.step``: one decoder step, ``hrt.stage2``: HRT's whole stage II), and the CPU time of
each scope (its own and its children's) and its call count come from the profile's
``key_averages()``. "other" is the measured total (wall clock, decoding under the profiler)
minus those parts, so the parts add up to the total. Decoder steps are also counted: an HRT
k = 2 sentence takes about half of AT's steps, and whatever else it pays is in the table.
Every number is measured under the profiler, which adds overhead to every operator: read
the split as shares, not as the speed of a run without it (benchmark.py measures that).

With ``--engine onnxruntime`` the parts are the wall-clock time of the exported model's session
runs (``hrt_runtime.ExportedModel.encode`` / ``step`` / ``parallel``), timed around each call
during an ordinary run (no profiler): the time a part takes where it runs in the search, after
the other parts (its weights may have left the CPU's caches), not in a loop of its own.

On a GPU (``--fp16`` for half precision; ``--engine lean`` or ``cuda-graph``) the parts are the
wall-clock time of the engine's backend calls (``encode_fairseq`` / ``step`` or ``greedy_loop`` / ``parallel``)
with the GPU synchronised before and after each: what each part costs, launches and kernels,
where the search makes it (the synchronisations keep the CPU from running ahead, so the
total is a little above an ordinary run's).

Example (after examples/multi30k/recipe.py --profile full)::

    python -m benchmarks.time_split --data R/data/data-bin --src R/data/spm/test.en \\
        --at R/at/checkpoint_last.pt --hrt R/hrt/checkpoint_last.pt --threads 2 --out-dir R/time-split

(``python benchmarks/time_split.py ...`` works too.)
"""

import argparse
import contextlib
import os
import time
from typing import Dict, List, Tuple

import torch

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import measure  # noqa: E402
from benchmarks.report_files import write_report  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.generation.engines import engine_choices, get_engine  # noqa: E402
from fairseq_hrt.generation.lean import TorchBackend  # noqa: E402
from fairseq_hrt.generation.options import DEFAULT_DECODER_ENGINE  # noqa: E402
from fairseq_hrt.generation.search_generator import SearchGenerator  # noqa: E402
from hrt_runtime.model import ExportedModel  # noqa: E402

PARTS = ("encoder", "decoder steps", "stage II", "other")
# the record_function scope of each timed part (the rest is "other")
SCOPES = {"encoder": "hrt.encoder", "decoder steps": "hrt.step", "stage II": "hrt.stage2"}


def scope_times(profile) -> Dict[str, Tuple[float, int]]:
    """``{scope: (seconds, calls)}`` of the ``hrt.*`` record_function scopes of a finished
    ``torch.profiler.profile``: the CPU time of each scope, its own and its children's."""
    out = {}
    for event in profile.key_averages():
        if event.key in SCOPES.values():
            seconds, calls = out.get(event.key, (0.0, 0))
            out[event.key] = (seconds + event.cpu_time_total / 1e6, calls + event.count)
    return out


# the ExportedModel methods of each timed part (--engine onnxruntime); a greedy loop
# (greedy.onnx: every step of a batch in one run) counts as decoder steps, as many as it made
SESSION_RUNS = {"encoder": ("encode",), "decoder steps": ("step", "greedy_loop"), "stage II": ("parallel",)}
RUN_ONLY = "hrt.step_runs"  # the decoder steps' session runs alone (without the step's feeds and state)
# the backend methods of each timed part on a GPU (lean, cuda-graph); a greedy loop (cuda-graph,
# a few sentences: every step of a batch on the device) counts as decoder steps, as many as it made
BACKEND_CALLS = {"encoder": ("encode_fairseq",), "decoder steps": ("step", "greedy_loop"), "stage II": ("parallel",)}


@contextlib.contextmanager
def backend_call_times(backend, sync):
    """``{scope: [seconds, calls]}`` of ``backend``'s :data:`BACKEND_CALLS` inside the block,
    keyed like :func:`scope_times`: each call timed by the wall clock with ``sync()`` (the GPU
    synchronised) before and after it (a greedy loop's calls: the steps it made; a backend
    without a loop of its own, whose ``greedy_loop`` is always ``None``, is not timed there).
    The instance's methods are wrapped for the block only."""
    times = {SCOPES[part]: [0.0, 0] for part in BACKEND_CALLS}

    def timed(method, slot, count):
        def run(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            sync()
            slot[0] += time.perf_counter() - start
            slot[1] += count(result)
            return result

        return run

    def steps_made(result):
        return 0 if result is None else result[0].shape[1]

    wrapped = []
    for part, names in BACKEND_CALLS.items():
        for name in names:
            if name == "greedy_loop" and type(backend).greedy_loop is TorchBackend.greedy_loop:
                continue
            count = steps_made if name == "greedy_loop" else (lambda result: 1)
            setattr(backend, name, timed(getattr(backend, name), times[SCOPES[part]], count))
            wrapped.append(name)
    try:
        yield times
    finally:
        for name in wrapped:
            delattr(backend, name)  # the class's method again


@contextlib.contextmanager
def session_run_times():
    """``{scope: [seconds, calls]}`` of the exported model's session runs inside the block,
    keyed like :func:`scope_times`: each :data:`SESSION_RUNS` method of
    ``hrt_runtime.ExportedModel`` is wrapped in a wall-clock timer for the block's duration
    (a greedy loop's calls: the steps it made). :data:`RUN_ONLY`: the decoder steps' session
    runs alone, so that a step's own work around its run (feeds, the state) is the difference."""
    times = {SCOPES[part]: [0.0, 0] for part in SESSION_RUNS}
    times[RUN_ONLY] = [0.0, 0]
    originals = {
        (part, method): getattr(ExportedModel, method) for part, methods in SESSION_RUNS.items() for method in methods
    }
    original_runner = ExportedModel.runner

    def timed(part, method, original):
        slot = times[SCOPES[part]]
        # calls counted: one per call, a greedy loop's the steps it made (None: it made none)
        count = (
            (lambda result: 0 if result is None else result[0].shape[1])
            if method == "greedy_loop"
            else (lambda result: 1)
        )

        def run(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            slot[0] += time.perf_counter() - start
            slot[1] += count(result)
            return result

        return run

    def runner(self, graph):
        run = original_runner(self, graph)
        if not graph.startswith(("step", "greedy")):
            return run
        slot = times[RUN_ONLY]

        def timed_run(feeds):
            start = time.perf_counter()
            try:
                return run(feeds)
            finally:
                slot[0] += time.perf_counter() - start

        return timed_run

    for (part, method), original in originals.items():
        setattr(ExportedModel, method, timed(part, method, original))
    ExportedModel.runner = runner
    try:
        yield times
    finally:
        for (part, method), original in originals.items():
            setattr(ExportedModel, method, original)
        ExportedModel.runner = original_runner


def split(
    checkpoint: str,
    data: str,
    lines: List[str],
    batch_size: int,
    chunk_size: int,
    runs: int,
    engine: str = DEFAULT_DECODER_ENGINE,
    max_len_a: float = 0.0,
    max_len_b: int = 200,
    use_cuda: bool = False,
    fp16: bool = False,
) -> dict:
    model, task = measure.load(checkpoint, data, use_cuda, fp16)
    options = {
        "decoder_engine": engine,
        "quantize": "none",
        "decoding": "auto",
        "jacobi_block_size": None,
        "b_nat": 1,
        "shortlist": None,
        "decode_chunk_size": str(chunk_size),
    }
    generator = measure.build_generator(
        task, model, {"beam": 1, "max_len_a": max_len_a, "max_len_b": max_len_b}, options
    )
    if not isinstance(generator, SearchGenerator):  # its parts are not the one search's backend calls
        raise ValueError(f"--engine {engine} does not run the one search (hrt_runtime.search): its time is not split")
    batches = measure.make_batches(task, model, lines, batch_size, use_cuda)
    # warm-up (an engine that captures per shape: a whole pass, as benchmark.py warms it up)
    whole = get_engine(engine).warms_up_per_shape
    measure.generate(task, model, generator, batches if whole else batches[:1])
    if engine == "onnxruntime":
        with session_run_times() as scopes:
            timing = time_runs(lambda: measure.generate(task, model, generator, batches), runs=runs)
    elif use_cuda:
        sync = torch.cuda.synchronize
        with backend_call_times(generator.backend, sync) as scopes:
            timing = time_runs(lambda: measure.generate(task, model, generator, batches), runs=runs, sync=sync)
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            timing = time_runs(lambda: measure.generate(task, model, generator, batches), runs=runs)
        scopes = scope_times(profile)
    hyps, total = timing.value, timing.total
    n = len(lines) * runs
    per_sentence = {part: scopes.get(SCOPES[part], (0.0, 0))[0] / n * 1000 for part in PARTS[:-1]}
    per_sentence["other"] = total / n * 1000 - sum(per_sentence.values())
    step_seconds, steps = scopes.get(SCOPES["decoder steps"], (0.0, 0))
    result = {
        "ms_per_sentence": total / n * 1000,
        "parts_ms_per_sentence": per_sentence,
        "decoder_steps_per_batch": steps / runs / len(batches),
        "batches": len(batches),
        "ms_per_decoder_step": step_seconds / max(steps, 1) * 1000,
        "output_tokens_per_sentence": sum(h.numel() for h in hyps.values()) / len(lines),
    }
    if RUN_ONLY in scopes:  # ONNX Runtime: a step's session run, and the step's own work around it
        result["run_ms_per_decoder_step"] = scopes[RUN_ONLY][0] / max(steps, 1) * 1000
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", required=True, help="binarized data dir (the models' dictionaries)")
    p.add_argument("--src", required=True, help="test source as the models read it (SentencePiece pieces)")
    p.add_argument("--at", required=True, help="AT checkpoint (greedy, lean engine)")
    p.add_argument("--hrt", help="HRT checkpoint: AT mode and --chunk-size")
    p.add_argument("--chunk-size", type=int, default=2, help="HRT's k (default 2)")
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument(
        "--sentences", type=int, default=0, help="first N sentences at batch 1 (0 = all); larger batches take all"
    )
    p.add_argument("--bs1-sentences", type=int, default=100, help="sentences at batch 1 (default 100, as benchmark.py)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--engine",
        choices=engine_choices(),
        default=DEFAULT_DECODER_ENGINE,
        help="the decoder engine (onnxruntime: its session runs timed in place, no profiler; cuda-graph: a GPU)",
    )
    p.add_argument("--cpu", action="store_true", help="decode on CPU even if a GPU is present")
    p.add_argument("--fp16", action="store_true", help="half precision (GPU only)")
    p.add_argument("--out-dir", required=True)
    return p


def table_heading(args, report: dict, onnx: bool, use_cuda: bool) -> str:
    """The report's heading: what was measured, and how."""
    if onnx:
        import onnxruntime  # noqa: PLC0415 - optional: onnxruntime

        return (
            f"## Where the decoding time goes (ONNX Runtime {onnxruntime.__version__}, {args.threads} thread(s), "
            "session runs timed in place)\n\n"
            "ms per sentence (share of the total): encoder, decoder steps and stage II are the wall-clock time of "
            "the exported model's calls where the search makes them (a greedy loop, greedy.onnx, is one call for "
            "all of a batch's steps, counted as the steps it made); other: the numpy search around them and "
            "batching; of which session run: a step's session run alone (the rest of ms/step: its feeds and "
            "state)"
        )
    if use_cuda:
        return (
            f"## Where the decoding time goes ({args.engine} engine, {report['device']}, torch {torch.__version__}, "
            "each backend call timed with the GPU synchronised)\n\n"
            "ms per sentence (share of the total): encoder, decoder steps and stage II are the engine's backend "
            "calls, launches and kernels; other: the numpy search around them and batching"
        )
    return (
        f"## Where the decoding time goes (lean engine, {args.threads} thread(s), torch {torch.__version__}, "
        "measured under torch.profiler)\n\n"
        "ms per sentence (share of the total; the profiler adds overhead to every operator, so read the "
        "shares, and benchmark.py for speeds)"
    )


def split_rows(args, src, systems, report: dict, onnx: bool, use_cuda: bool) -> List[str]:
    """Every system's split at every batch size (into ``report``); returns the table's rows."""
    rows = []
    for bs in measure.parse_ints(args.batch_sizes):
        lines = src[: args.bs1_sentences] if bs == 1 else src
        for name, checkpoint, k in systems:
            result = split(
                checkpoint, args.data, lines, bs, k, args.runs, args.engine, use_cuda=use_cuda, fp16=args.fp16
            )
            result["sentences"] = len(lines)
            report["systems"].setdefault(name, {})[str(bs)] = result
            parts = result["parts_ms_per_sentence"]
            run_cell = f" {result['run_ms_per_decoder_step']:.3f} |" if onnx else ""
            rows.append(
                f"| {name} | {bs} | {result['ms_per_sentence']:.3f} | "
                + " | ".join(f"{parts[part]:.3f} ({parts[part] / result['ms_per_sentence']:.0%})" for part in PARTS)
                + f" | {result['decoder_steps_per_batch']:.1f} | {result['ms_per_decoder_step']:.3f} |"
                + run_cell
            )
    return rows


def main(argv=None):
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and not args.cpu and args.engine != "onnxruntime"
    if (args.fp16 or args.engine == "cuda-graph") and not use_cuda:
        raise SystemExit("--fp16 and --engine cuda-graph need a GPU")
    src = measure.read_lines(args.src, args.sentences)
    systems = [("AT greedy", args.at, 1)]
    if args.hrt:
        systems += [
            ("HRT AT-mode b=1", args.hrt, 1),
            (f"HRT k={args.chunk_size} b_at=1 b_nat=1", args.hrt, args.chunk_size),
        ]
    onnx = args.engine == "onnxruntime"
    report = {
        "threads": args.threads,
        "torch": torch.__version__,
        "sentences": len(src),
        "systems": {},
        "engine": args.engine,
        "measured_under": "wall clock around each session run (hrt_runtime.ExportedModel encode/step/parallel)"
        if onnx
        else "wall clock around each backend call, the GPU synchronised before and after"
        if use_cuda
        else "torch.profiler (CPU activity; hrt.* record_function scopes)",
        "device": (torch.cuda.get_device_name() + (" fp16" if args.fp16 else "")) if use_cuda else "CPU",
    }
    rows = split_rows(args, src, systems, report, onnx, use_cuda)
    run_head, run_rule = (" of which session run |", "---:|") if onnx else ("", "")
    table = [
        "| system | batch | ms/sentence | " + " | ".join(PARTS) + " | decoder steps/batch | ms/step |" + run_head,
        "|---|---:|---:|" + "---:|" * len(PARTS) + "---:|---:|" + run_rule,
    ] + rows
    text = (
        table_heading(args, report, onnx, use_cuda)
        + "; decoder steps: left-to-right steps (AT, HRT stage I) per batch, each over the batch's active "
        "rows; ms/step: mean time of one step\n\n" + "\n".join(table) + "\n"
    )
    write_report(args.out_dir, "time_split", report, text)


if __name__ == "__main__":
    main()
