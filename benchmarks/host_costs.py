#!/usr/bin/env python
"""The host's work per call of the decoding engines that no device makes faster: the weights'
version check (:func:`fairseq_hrt.passes.weights.weights_version`) that the CUDA-graph engine
makes at every batch's encoding (the whole model, then the decoder's plan) and at its first step
and every stage-II pass (the decoder's plan), and the lean engine once a batch.

On a GPU at batch 1 these calls sit between the kernels: a captured encoder of E12D1 ran in
1.1 ms whatever its depth (issue 87), a base decoder step in 0.72 ms. The check's cost is
Python's, the same on the GPU's host as here, so it is measured on the CPU, on random models
of the papers' shapes (``benchmarks/paper_shapes.py``'s), interleaved with the walk over the
modules that it made before it kept each module's parameters (``full walk``). Best of
``--repeats`` rounds of ``--calls`` calls each. Prints a table and writes
``OUT/host_costs.{md,json}``::

    python benchmarks/host_costs.py --out-dir benchmarks/results/host-costs-cpu
"""

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.paper_shapes import build_models  # noqa: E402
from fairseq_hrt.passes.weights import weights_version  # noqa: E402


def full_walk(module) -> tuple:
    """The check as it was: every call walks the modules for their parameters."""
    return tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in module.parameters())


def best_us(calls: Dict[str, Callable[[], object]], per_round: int, repeats: int) -> Dict[str, float]:
    """Microseconds a call, the best round of each, the calls' rounds taking turns."""
    best = {name: float("inf") for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(per_round):
                call()
            best[name] = min(best[name], (time.perf_counter() - started) / per_round * 1e6)
    return best


def measure(shape: str, per_round: int, repeats: int, workdir: str) -> dict:
    models = build_models(shape, 32000, workdir)
    out = {}
    for family, model in (("AT", models.at), ("HRT", models.hrt)):
        parts = {"model": model, "decoder": model.decoder}
        calls = {}
        for part, module in parts.items():
            calls[f"{part}, kept parameters"] = lambda m=module: weights_version(m)
            calls[f"{part}, full walk"] = lambda m=module: full_walk(m)
        us = best_us(calls, per_round, repeats)
        out[family] = {
            "parameters": {part: sum(1 for _ in module.parameters()) for part, module in parts.items()},
            "us": {name: round(v, 2) for name, v in us.items()},
        }
    return out


def table(results: dict) -> str:
    lines = [
        "| shape | model | parameters (model / decoder) | whole model: full walk | kept | decoder: full walk | kept |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape, families in results.items():
        for family, r in families.items():
            us = r["us"]
            lines.append(
                f"| {shape} | {family} | {r['parameters']['model']} / {r['parameters']['decoder']} "
                f"| {us['model, full walk']:.1f} | {us['model, kept parameters']:.1f} "
                f"| {us['decoder, full walk']:.1f} | {us['decoder, kept parameters']:.1f} |"
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
        f"{meta['cpu']}, one thread.\n\n{table(results)}\n"
    )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "host_costs.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out_dir, "host_costs.json"), "w") as f:
        json.dump({"meta": meta, "shapes": results}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
