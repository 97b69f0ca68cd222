#!/usr/bin/env python
"""One decoder step and one stage-II pass in ONNX Runtime against the lean engine's, in one run.

The gate of the ONNX Runtime engine (issue 24): a model of the ``full`` recipe's shape
(``hrt_small``: d = 256, 6-1, 4 heads, FFN 1024) with a vocabulary of ``--vocab`` symbols and
random weights (speed does not depend on the weights), on ``--threads`` threads:

* step: a greedy left-to-right pass of ``--steps`` steps (Skip-AT, k = 2: stride 2 and the
  relative keys) at batch 1 and ``--batch``: the lean engine's ``DecoderPass.step`` and its
  greedy choice against the exported :class:`StepGraph` (the choice inside; past keys/values
  in, present out) fed from numpy; ms per step;
* stage II: one non-causal pass over ``2 x --steps`` tokens and its best allowed token per slot:
  ``DecoderPass.bidirectional`` + ``OutputLayer.best`` against :class:`ParallelGraph`.

Prints a table and writes ``OUT/onnx_gate.json``::

    python benchmarks/onnx_gate.py --out benchmarks/results/onnx-gate-cpu
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if not __package__:  # python benchmarks/onnx_gate.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.timing import time_runs  # noqa: E402


def random_model(arch: str, vocab: int, workdir: str):
    from fairseq import options, tasks
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(vocab - 4):
        d.add_symbol(f"w{i}", n=10**6 - i)
    d.finalize(padding_factor=1)
    for lang in ("src", "tgt"):
        d.save(os.path.join(workdir, f"dict.{lang}.txt"))
    user_dir = str(Path(__file__).resolve().parents[1] / "fairseq_hrt")
    args = options.parse_args_and_arch(options.get_training_parser(), [
        workdir, "--user-dir", user_dir, "--task", "hrt_translation", "--source-lang", "src", "--target-lang", "tgt",
        "--arch", arch, "--chunk-sizes", "2", "--share-all-embeddings", "--dropout", "0"])
    torch.manual_seed(1)
    task = tasks.setup_task(args)
    model = task.build_model(args).eval()
    return task, model.requires_grad_(False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="hrt_small")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--source-length", type=int, default=14)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import onnxruntime as ort

    from fairseq_hrt.export.graphs import ParallelGraph, StepGraph
    from fairseq_hrt.generation.decoder_pass import decoder_pass
    from fairseq_hrt.generation.output_vocab import OutputLayer
    from fairseq_hrt.generation.search_rules import greedy_choice

    work = tempfile.mkdtemp()
    task, model = random_model(a.arch, a.vocab, work)
    tgt = task.target_dictionary
    start = task.chunk_start_idx[2]
    pass_ = decoder_pass(model.decoder)
    heads, head_dim, layers = pass_.heads, pass_.head_dim, len(model.decoder.layers)
    V = len(tgt)
    banned = torch.zeros(V, dtype=torch.bool)
    banned[[tgt.pad(), tgt.bos(), start]] = True
    logit_bias = np.where(banned.numpy(), -np.inf, 0.0).astype(np.float32)

    options = ort.SessionOptions()
    options.intra_op_num_threads = a.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL

    def export(graph, args, names_in, names_out, dynamic, path):
        torch.onnx.export(graph, args, path, dynamo=False, input_names=names_in, output_names=names_out,
                          dynamic_axes=dynamic, opset_version=17)
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    kv_in = [f"enc_k{i}" for i in range(layers)] + [f"enc_v{i}" for i in range(layers)]
    past = [f"past_k{i}" for i in range(layers)] + [f"past_v{i}" for i in range(layers)]
    present = [f"present_k{i}" for i in range(layers)] + [f"present_v{i}" for i in range(layers)]
    dyn = {"tokens": {0: "N"}, "encoder_bias": {0: "B", 3: "S"}, "score": {0: "N"}, "token": {0: "N"}}
    dyn.update({n: {0: "B", 2: "S"} for n in kv_in})
    dyn.update({n: {0: "N", 2: "t"} for n in past})
    dyn.update({n: {0: "N", 2: "t1"} for n in present})
    S = a.source_length
    example = (torch.tensor([5]), torch.tensor(3), torch.tensor(2), torch.from_numpy(logit_bias), torch.zeros(1, 1, 1, S),
               *[torch.randn(1, heads, S, head_dim) for _ in range(2 * layers)],
               *[torch.randn(1, heads, 3, head_dim) for _ in range(2 * layers)])
    step_session = export(StepGraph(model, 1024).eval(), example, ["tokens", "step", "stride", "logit_bias", "encoder_bias", *kv_in, *past],
                          ["score", "token", *present], dyn, os.path.join(work, "step.onnx"))
    dyn2 = {"tokens": {0: "B", 1: "T"}, "positions": {0: "B", 1: "T"}, "encoder_bias": {0: "B", 3: "S"},
            "score": {0: "B", 1: "T"}, "token": {0: "B", 1: "T"}}
    dyn2.update({n: {0: "B", 2: "S"} for n in kv_in})
    example2 = (torch.full((1, 6), 7), torch.arange(6).view(1, 6), torch.from_numpy(logit_bias), torch.zeros(1, 1, 1, S),
                *[torch.randn(1, heads, S, head_dim) for _ in range(2 * layers)])
    parallel_session = export(ParallelGraph(model, 1024).eval(), example2, ["tokens", "positions", "logit_bias", "encoder_bias", *kv_in],
                              ["score", "token"], dyn2, os.path.join(work, "parallel.onnx"))

    rows = []
    for bsz in (1, a.batch):
        src = torch.randint(10, V, (bsz, S))
        with torch.no_grad():
            encoder_out = model.encoder(src, src_lengths=torch.full((bsz,), S))
            kv = pass_.encoder(encoder_out)
        enc_feeds = {"encoder_bias": kv.bias.numpy()}
        enc_feeds.update({f"enc_k{i}": kv.keys[i].numpy() for i in range(layers)})
        enc_feeds.update({f"enc_v{i}": kv.values[i].numpy() for i in range(layers)})
        banned_t = banned

        def lean_steps():
            with torch.no_grad():
                state = pass_.begin(encoder_out, bsz, a.steps + 1, start, encoder=kv)
                prev = torch.full((bsz,), start)
                for step in range(a.steps):
                    logits = pass_.step(state, prev, step).float()
                    _, prev = greedy_choice(logits, banned_t)

        def ort_steps():
            caches = {n: np.zeros((bsz, heads, 0, head_dim), np.float32) for n in past}
            prev = np.full((bsz,), start, np.int64)
            stride = np.array(2, np.int64)
            for step in range(a.steps):
                out = step_session.run(None, {"tokens": prev, "step": np.array(step, np.int64), "stride": stride,
                                              "logit_bias": logit_bias, **enc_feeds, **caches})
                prev = out[1]
                caches = dict(zip(past, out[2:]))

        T = 2 * a.steps
        tokens = torch.randint(10, V, (bsz, T))
        positions = torch.arange(T).expand(bsz, T).contiguous()
        out_layer = OutputLayer(model.decoder, banned.nonzero().view(-1))

        def lean_parallel():
            with torch.no_grad():
                out_layer.best(pass_.bidirectional(kv, tokens, positions))

        feeds2 = {"tokens": tokens.numpy(), "positions": positions.numpy(), "logit_bias": logit_bias, **enc_feeds}

        def ort_parallel():
            parallel_session.run(None, feeds2)

        for what, lean, onnx, units in (("step", lean_steps, ort_steps, a.steps), ("stage II pass", lean_parallel, ort_parallel, 1)):
            # round-robin, the fastest round of each (a shared machine's slow patches hit both)
            timed = time_runs({"lean": lean, "ort": onnx}, warmup=1, runs=a.rounds)
            t_lean, t_ort = timed["lean"].min / units * 1000, timed["ort"].min / units * 1000
            rows.append({"what": what, "batch": bsz, "lean_ms": round(t_lean, 4), "onnxruntime_ms": round(t_ort, 4),
                         "speedup": round(t_lean / t_ort, 2)})
    print(f"{a.arch}, vocabulary {V}, {a.threads} thread(s), {a.steps} steps / {2 * a.steps} stage-II slots, "
          f"onnxruntime {ort.__version__}, torch {torch.__version__}")
    print("| pass | batch | lean ms | ONNX Runtime ms | ONNX Runtime speed-up |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['what']} | {r['batch']} | {r['lean_ms']:.3f} | {r['onnxruntime_ms']:.3f} | {r['speedup']:.2f}x |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "onnx_gate.json"), "w") as f:
            json.dump({"arch": a.arch, "vocab": V, "threads": a.threads, "steps": a.steps, "rows": rows,
                       "onnxruntime": ort.__version__, "torch": torch.__version__}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
