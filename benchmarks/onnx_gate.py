#!/usr/bin/env python
"""One decoder step and one stage-II pass in ONNX Runtime against the lean engine's, in one run.

The gate of the ONNX Runtime engine (issue 24): a model of the ``full`` recipe's shape
(``hrt_small``: d = 256, 6-1, 4 heads, FFN 1024) with a vocabulary of ``--vocab`` symbols and
random weights (speed does not depend on the weights), on ``--threads`` threads:

* step: a greedy left-to-right pass of ``--steps`` steps (Skip-AT, k = 2: stride 2 and the
  relative keys) at batch 1 and ``--batch``: the lean engine's ``DecoderPass.step`` and its
  greedy choice against the exported model's step (``hrt_runtime.ExportedModel.step``: the
  choice inside, past keys/values in, present out); ms per step;
* stage II: one non-causal pass over ``2 x --steps`` tokens and the best allowed token of its
  ``--steps`` masks: ``DecoderPass.non_causal`` + ``OutputLayer.best`` against
  ``ExportedModel.parallel``.

Prints a table and writes ``OUT/onnx_gate.json``::

    python benchmarks/onnx_gate.py --out benchmarks/results/onnx-gate-cpu
"""

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

if not __package__:  # python benchmarks/onnx_gate.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from fairseq import options, tasks  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.dataclass.utils import convert_namespace_to_omegaconf  # noqa: E402

from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.export.exporter import export_model  # noqa: E402
from fairseq_hrt.passes.decoder_pass import decoder_pass  # noqa: E402
from fairseq_hrt.passes.output_vocab import OutputLayer  # noqa: E402
from hrt_runtime.model import ExportedModel  # noqa: E402


def random_model(arch: str, vocab: int, workdir: str, extra_args=(), checkpoint: Optional[str] = None):
    """``(task, model)``: a model of ``arch`` (``extra_args``: more model options, e.g.
    ``["--decoder-layers", "2"]``; an AT arch also takes ``["--hrt-mode", "at"]``) with random
    weights over a joined dictionary of ``vocab`` symbols, written in ``workdir`` (the data
    folder a converter reads). ``checkpoint``: the model is also saved there as a fairseq
    checkpoint (what CTranslate2's converter and ``fairseq-generate`` load)."""
    d = Dictionary()
    for i in range(vocab - 4):
        d.add_symbol(f"w{i}", n=10**6 - i)
    d.finalize(padding_factor=1)
    for lang in ("src", "tgt"):
        d.save(os.path.join(workdir, f"dict.{lang}.txt"))
    user_dir = str(Path(__file__).resolve().parents[1] / "fairseq_hrt")
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            workdir,
            "--user-dir",
            user_dir,
            "--task",
            "hrt_translation",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--arch",
            arch,
            "--chunk-sizes",
            "2",
            "--share-all-embeddings",
            "--dropout",
            "0",
            *extra_args,
        ],
    )
    torch.manual_seed(1)
    task = tasks.setup_task(args)
    model = task.build_model(args).eval()
    if checkpoint:
        cfg = convert_namespace_to_omegaconf(args)
        torch.save({"cfg": cfg, "model": model.state_dict(), "args": None}, checkpoint)
    return task, model.requires_grad_(False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="hrt_small")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--source-length", type=int, default=14)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    return p


@dataclass
class Gate:
    """The model both ways: its lean decoder pass and the exported folder's runtime, with the
    symbols a search never produces (as a mask and as ONNX Runtime's logit bias)."""

    model: torch.nn.Module
    pass_: object
    runtime: ExportedModel
    rows_all: object
    start: int
    banned: torch.Tensor
    logit_bias: np.ndarray


def step_pair(a, gate: Gate, encoder_out, kv, encoded, bsz: int):
    """``(lean, onnxruntime)``: ``a.steps`` greedy steps of Skip-AT, k = 2, each way."""
    pass_, runtime = gate.pass_, gate.runtime

    def lean_steps():
        with torch.no_grad():
            state = pass_.begin(encoder_out, bsz, a.steps + 1, gate.start, encoder=kv)
            prev = torch.full((bsz,), gate.start)
            for step in range(a.steps):
                logits = pass_.step(state, prev, step).float()
                _, prev = logits.masked_fill(gate.banned, float("-inf")).max(dim=1)

    def ort_steps():  # Skip-AT, k = 2: stride 2 and the relative keys, as lean's <s_2> start
        state = runtime.begin(encoded, bsz, a.steps + 1, gate.start, gate.rows_all)
        prev = np.full((bsz,), gate.start, np.int64)
        for step in range(a.steps):
            _, prev = runtime.step(state, prev, step, gate.logit_bias)

    return lean_steps, ort_steps


def parallel_pair(a, gate: Gate, kv, encoded, bsz: int, V: int):
    """``(lean, onnxruntime)``: one stage-II pass over ``2 x a.steps`` slots, each way."""
    T = 2 * a.steps
    tokens = torch.randint(10, V, (bsz, T))
    positions = torch.arange(1, T + 1).expand(bsz, T).contiguous()
    is_mask = torch.zeros(bsz, T, dtype=torch.bool)
    is_mask[:, 0::2] = True  # k = 2: every other slot is a mask
    out_layer = OutputLayer(gate.model.decoder, gate.banned.nonzero().view(-1))

    queries = torch.arange(0, T, 2)

    def lean_parallel():
        with torch.no_grad():
            out_layer.best(gate.pass_.non_causal(kv, tokens, positions, queries)[is_mask[:, queries]])

    tokens_np, positions_np, queries_np = tokens.numpy(), positions.numpy(), queries.numpy()
    select = np.flatnonzero(is_mask.numpy()[:, queries_np])

    def ort_parallel():
        gate.runtime.parallel(encoded, tokens_np, positions_np, queries_np, select, gate.logit_bias, gate.rows_all)

    return lean_parallel, ort_parallel


def batch_rows(a, gate: Gate, tgt, bsz: int) -> List[dict]:
    """The step's and the stage-II pass's times at batch ``bsz``, lean against ONNX Runtime."""
    V, S = len(tgt), a.source_length
    src = torch.randint(10, V, (bsz, S))
    src[:, -1] = tgt.eos()
    with torch.no_grad():
        encoder_out = gate.model.encoder(src, src_lengths=torch.full((bsz,), S))
        kv = gate.pass_.encoder(encoder_out)
    encoded = gate.runtime.encode(src.numpy())
    lean_steps, ort_steps = step_pair(a, gate, encoder_out, kv, encoded, bsz)
    lean_parallel, ort_parallel = parallel_pair(a, gate, kv, encoded, bsz, V)
    rows = []
    for what, lean, onnx, units in (
        ("step", lean_steps, ort_steps, a.steps),
        ("stage II pass", lean_parallel, ort_parallel, 1),
    ):
        # round-robin, the fastest round of each (a shared machine's slow patches hit both)
        timed = time_runs({"lean": lean, "ort": onnx}, warmup=1, runs=a.rounds)
        t_lean, t_ort = timed["lean"].min / units * 1000, timed["ort"].min / units * 1000
        rows.append(
            {
                "what": what,
                "batch": bsz,
                "lean_ms": round(t_lean, 4),
                "onnxruntime_ms": round(t_ort, 4),
                "speedup": round(t_lean / t_ort, 2),
            }
        )
    return rows


def report(a, rows: List[dict], V: int, ort_version: str) -> None:
    """The table on stdout, and ``--out``/onnx_gate.json."""
    print(
        f"{a.arch}, vocabulary {V}, {a.threads} thread(s), {a.steps} steps / {2 * a.steps} stage-II slots, "
        f"onnxruntime {ort_version}, torch {torch.__version__}"
    )
    print("| pass | batch | lean ms | ONNX Runtime ms | ONNX Runtime speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['batch']} | {r['lean_ms']:.3f} | {r['onnxruntime_ms']:.3f} | {r['speedup']:.2f}x |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "onnx_gate.json"), "w") as f:
            json.dump(
                {
                    "arch": a.arch,
                    "vocab": V,
                    "threads": a.threads,
                    "steps": a.steps,
                    "rows": rows,
                    "onnxruntime": ort_version,
                    "torch": torch.__version__,
                },
                f,
                indent=1,
            )


def main(argv=None):
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    import onnxruntime as ort  # noqa: PLC0415 - optional: onnxruntime

    work = tempfile.mkdtemp()
    task, model = random_model(a.arch, a.vocab, work)
    tgt = task.target_dictionary
    start = task.chunk_start_idx[2]
    pass_ = decoder_pass(model.decoder)
    V = len(tgt)
    banned = torch.zeros(V, dtype=torch.bool)
    banned[[tgt.pad(), tgt.bos(), start]] = True
    logit_bias = np.where(banned.numpy(), -np.inf, 0.0).astype(np.float32)
    folder = os.path.join(work, "onnx")
    export_model(model, task, folder, restricted=False)
    # the engine's and the deployed runtime's sessions
    runtime = ExportedModel(folder, threads=a.threads)
    gate = Gate(model, pass_, runtime, runtime.rows(None), start, banned, logit_bias)
    rows = []
    for bsz in (1, a.batch):
        rows += batch_rows(a, gate, tgt, bsz)
    report(a, rows, V, ort.__version__)
    return rows


if __name__ == "__main__":
    main()
