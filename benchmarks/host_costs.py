#!/usr/bin/env python
"""The host's work per call of the CUDA-graph engine, which no device makes faster, on random
models of the papers' shapes (``benchmarks/paper_shapes.py``'s):

* **the weights' version check** (:func:`fairseq_hrt.passes.weights.weights_version`) that the
  engine makes at every batch's encoding (the whole model, then the decoder's plan), at its
  first step and every stage-II pass (the decoder's plan), and the lean engine once a batch;
  interleaved with the two forms it had before: a walk over the modules at every call
  (``full walk``), then each module's kept parameters read into a tuple of four attributes each
  (``kept, tuples``); now the kept parameters' addresses and version counters read by two
  C-level maps (``kept, maps``). Best of ``--repeats`` rounds of ``--calls`` calls each;
* **around the graphs**: each call of the fixed-length bound
  (:func:`benchmarks.hrt_bound.fixed_length_calls`, batch 1: the encoder, the AT steps by the
  greedy device loop and by the search's steps, stage II), once with the graphs' bodies run
  uncaptured (which makes the graphs), then with the bodies skipped (:class:`HostOnlyBackend`):
  what is left is the host's work around the graphs, in Python and PyTorch's dispatch (on a GPU
  each of its tensor operations is a kernel launch, and each body one graph replay more). Best
  of ``--repeats`` rounds of one call each.

On a GPU at batch 1 these calls sit between the kernels: a captured encoder of E12D1 ran in
1.1 ms whatever its depth (issue 87), a base decoder step in 0.72 ms. Their cost is the host's,
so it is measured on the CPU. Prints the tables and writes ``OUT/host_costs.{md,json}``::

    python benchmarks/host_costs.py --out-dir benchmarks/results/host-costs-cpu
"""

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Tuple

if not __package__:  # python benchmarks/host_costs.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.hrt_bound import fixed_length_calls  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.paper_shapes import build_models  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.generation.cuda_graph import Captured, CudaGraphBackend  # noqa: E402
from fairseq_hrt.passes.weights import _parameters, weights_version  # noqa: E402

SRC_LEN, TGT_LEN, K = 28, 27, 2  # newstest2014's mean sentence, about


def attribute_tuples(parameters) -> tuple:
    """The check's earlier reading: a tuple of four attributes a parameter."""
    return tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in parameters)


def full_walk(module) -> tuple:
    """The check as it was first: every call walks the modules for their parameters."""
    return attribute_tuples(module.parameters())


def kept_tuples(module) -> tuple:
    """The check as it was next: the kept parameters, a tuple of four attributes each."""
    return attribute_tuples(_parameters(module))


def best_us(calls: Dict[str, Callable[[], object]], per_round: int, repeats: int) -> Dict[str, float]:
    """Microseconds a call, the best of ``repeats`` rounds of ``per_round`` calls each, the
    calls' rounds taking turns (:func:`benchmarks.timing.time_runs`)."""

    def rounds(call):
        return lambda: [call() for _ in range(per_round)]

    timed = time_runs({name: rounds(call) for name, call in calls.items()}, runs=repeats)
    return {name: t.min / per_round * 1e6 for name, t in timed.items()}


class HostOnlyBackend(CudaGraphBackend):
    """The CUDA-graph engine's backend on any device, its graphs' bodies run uncaptured until
    ``bodies`` is set false: then a call does only the host's work around its graphs (their
    buffers were made and filled by the calls before)."""

    captures = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bodies = True

    def captured(self, body) -> Captured:
        graph = super().captured(body)
        run_body = graph.body
        graph.body = lambda: run_body() if self.bodies else None
        return graph


_UNSAFE_VIEW = torch.ops.aten._unsafe_view


class TensorOps(TorchDispatchMode):
    """Counts the tensor operations dispatched under it that make a tensor's data (views, and
    ``_unsafe_view``, a reshape's view, excluded): on a GPU, each one a kernel launch."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view and func.overloadpacket is not _UNSAFE_VIEW
        return func(*args, **(kwargs or {}))


def tensor_ops(call) -> int:
    with TensorOps() as ops:
        call()
    return ops.count


PER_CALL = {"at_steps": TGT_LEN, "skip_at_steps": TGT_LEN // K}  # the steps' calls: per step


def per_step(values: dict) -> dict:
    return {name: round(v / PER_CALL.get(name, 1), 1) for name, v in values.items()}


def graph_calls(model, task, loop: bool):
    """``(backend, calls)``: a :class:`HostOnlyBackend` of ``model`` and its
    :func:`fixed_length_calls` (batch 1), each called once with the bodies (which makes the
    graphs); greedy steps by the device loop (``loop``) or by the search."""
    backend = HostOnlyBackend(model, task.target_dictionary, chunk_start=task.chunk_start_idx, mask=task.mask_idx)
    backend.loop_rows = backend.loop_rows if loop else 0

    def encode(src):
        tokens = torch.from_numpy(src)
        return backend.encode_fairseq({"src_tokens": tokens, "src_lengths": torch.tensor([src.shape[1]])})

    calls = fixed_length_calls(backend, encode, task, 1, SRC_LEN, TGT_LEN, K)
    for call in calls.values():
        call()
    return backend, calls


def inside_and_outside(backend, calls) -> Tuple[dict, dict]:
    """The tensor operations (:class:`TensorOps`) of each call inside its graphs (a call's with
    the bodies, less those without: on a GPU, the kernels a replay launches) and outside them;
    the bodies are off after."""
    with_bodies = {name: tensor_ops(call) for name, call in calls.items()}
    backend.bodies = False
    outside = {name: tensor_ops(call) for name, call in calls.items()}
    return {name: with_bodies[name] - outside[name] for name in calls}, outside


def around_graphs(model, task, loop: bool, repeats: int) -> Tuple[dict, dict, dict]:
    """``(us, outside, inside)`` per call of :func:`graph_calls`: microseconds of host work,
    the best of ``repeats`` with the bodies off, and :func:`inside_and_outside`."""
    with torch.no_grad():
        backend, calls = graph_calls(model, task, loop)
        inside, outside = inside_and_outside(backend, calls)
        us = best_us(calls, 1, repeats)
    return per_step(us), per_step(outside), per_step(inside)


def half_inside(model, task, loop: bool) -> dict:
    """The operations inside the graphs of a float16 copy of ``model`` (``--fp16``, what a GPU
    runs: its casts count; the CPU runs the bodies only to count them)."""
    with torch.no_grad():
        return per_step(inside_and_outside(*graph_calls(copy.deepcopy(model).half(), task, loop))[0])


def measure(shape: str, per_round: int, repeats: int, workdir: str) -> dict:
    models = build_models(shape, 32000, workdir)
    out = {}
    for family, model in (("AT", models.at), ("HRT", models.hrt)):
        parts = {"model": model, "decoder": model.decoder}
        calls = {}
        for part, module in parts.items():
            calls[f"{part}, kept, maps"] = lambda m=module: weights_version(m)
            calls[f"{part}, full walk"] = lambda m=module: full_walk(m)
            calls[f"{part}, kept, tuples"] = lambda m=module: kept_tuples(m)
        us = best_us(calls, per_round, repeats)
        out[family] = {
            "parameters": {part: sum(1 for _ in module.parameters()) for part, module in parts.items()},
            "us": {name: round(v, 2) for name, v in us.items()},
        }
    task = models.hrt_task
    keys = ("around_graphs", "tensor_ops", "tensor_ops_inside", "tensor_ops_inside_float16")
    for key in keys:
        out[key] = {}
    for how, loop in (("device loop", True), ("search's steps", False)):
        measured = (*around_graphs(models.hrt, task, loop, repeats), half_inside(models.hrt, task, loop))
        for key, values in zip(keys, measured):
            out[key][how] = values
    return out


def table(results: dict) -> str:
    lines = [
        "| shape | model | parameters (model / decoder) | whole model: full walk | kept, tuples | kept, maps "
        "| decoder: full walk | kept, tuples | kept, maps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, families in results.items():
        for family in ("AT", "HRT"):
            r = families[family]
            us = r["us"]
            lines.append(
                f"| {shape} | {family} | {r['parameters']['model']} / {r['parameters']['decoder']} "
                + "".join(
                    f"| {us[f'{part}, full walk']:.1f} | {us[f'{part}, kept, tuples']:.1f} "
                    f"| {us[f'{part}, kept, maps']:.1f} "
                    for part in ("model", "decoder")
                )
                + "|"
            )
    return "\n".join(lines)


def around_table(results: dict, key: str = "around_graphs") -> str:
    lines = [
        "| shape | steps by | encoder call | AT step | Skip-AT step | stage-II call |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for shape, measured in results.items():
        for how, us in measured[key].items():
            lines.append(
                f"| {shape} | {how} | {us['encoder']:.0f} | {us['at_steps']:.1f} | {us['skip_at_steps']:.1f} "
                f"| {us['stage2']:.0f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="base,e12d1")
    p.add_argument("--calls", type=int, default=500, help="calls a round")
    p.add_argument("--repeats", type=int, default=20, help="rounds (the best is reported)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        results = {s: measure(s, args.calls, args.repeats, workdir) for s in args.shapes.split(",")}
    meta = {"cpu": cpu_name(), "cpu_isa": cpu_isa(), "calls": args.calls, "repeats": args.repeats}
    md = (
        f"Microseconds per weights' version check, best of {args.repeats} rounds of {args.calls} calls, "
        f"{meta['cpu']}, one thread.\n\n{table(results)}\n\n"
        f"Microseconds of host work around the CUDA-graph engine's graphs per call (steps: per step), "
        f"HRT model, batch 1, {SRC_LEN} source and {TGT_LEN} target tokens, k = {K}, the graphs' bodies "
        f"skipped, best of {args.repeats}.\n\n{around_table(results)}\n\n"
        f"Tensor operations outside the graphs per call (steps: per step; views not counted; on a GPU "
        f"each is a kernel launch), the same calls.\n\n{around_table(results, 'tensor_ops')}\n\n"
        f"Tensor operations inside the graphs per call (the same count, of the graphs' bodies: on a GPU, "
        f"the kernels a replay launches).\n\n{around_table(results, 'tensor_ops_inside')}\n\n"
        f"The same, the model in float16 (`--fp16`, as a GPU runs it; its casts count).\n\n"
        f"{around_table(results, 'tensor_ops_inside_float16')}\n"
    )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "host_costs.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out_dir, "host_costs.json"), "w") as f:
        json.dump({"meta": meta, "shapes": results}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
