#!/usr/bin/env python
"""What a key/value cache written in place would save a decoder step at batch 128 on a CPU
(issue 87, item 3), before the export format is changed for it.

ONNX Runtime cannot write into a graph input, so the exported step takes every layer's past
keys/values and returns them grown by a ``Concat`` (``fairseq_hrt/export/graphs.py``). The one
CPU kernel of ONNX Runtime that writes a cache in place is the contrib operator
``GroupQueryAttention`` with its past and present bound to one buffer. This probe times one
layer's self-attention over ``--steps`` steps both ways, ONNX Runtime alone, round-robin
(:func:`benchmarks.timing.time_runs`):

* ``concat``: the exported step's form. The past comes in as an input, is grown by ``Concat``,
  and goes through ``MatMul``, ``Softmax`` and ``MatMul``; the present goes back to the caller;
* ``in place``: ``GroupQueryAttention`` over one preallocated ``(N, H, steps, d)`` buffer per
  keys and values, bound as both its past and its present (IO binding), with the step's
  sequence lengths as inputs.

Both get the same queries, keys and values, and their outputs are compared. Writes
``OUT/cache_probe.{md,json}``::

    python benchmarks/cache_probe.py --out-dir benchmarks/results/batch128-cpu/cache-probe
"""

import argparse
import json
import os
import sys
from pathlib import Path

if not __package__:  # python benchmarks/cache_probe.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402


def _model(nodes, inputs, outputs, contrib: bool):
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if contrib else [])
    graph = helper.make_graph(nodes, "probe", inputs, outputs)
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def concat_attention(rows: int, heads: int, head_dim: int) -> bytes:
    """The exported step's self-attention: the past grown by ``Concat``, then attention."""
    shape = [rows, heads, 1, head_dim]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, heads, "t", head_dim]) for n in ("pk", "pv")]
    nodes = [
        helper.make_node("Concat", ["pk", "k"], ["present_k"], axis=2),
        helper.make_node("Concat", ["pv", "v"], ["present_v"], axis=2),
        helper.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_v"], ["out"]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_k", "present_v")]
    return _model(nodes, inputs, outputs, contrib=False)


def in_place_attention(rows: int, heads: int, head_dim: int, steps: int) -> bytes:
    """``GroupQueryAttention`` over a preallocated cache (its past and present one buffer)."""
    width, cache = heads * head_dim, [rows, heads, steps, head_dim]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, 1, width]) for n in ("q", "k", "v")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in ("pk", "pv")]
    inputs += [
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [rows]),
        helper.make_tensor_value_info("total", TensorProto.INT32, [1]),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens_k", "total"],
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=heads,
        scale=1.0,
    )
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, 1, width])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache) for n in ("present_k", "present_v")]
    return _model([node], inputs, outputs, contrib=True)


class Probe:
    """Both forms' sessions (one thread) and their inputs; :meth:`concat` and :meth:`in_place`
    each run every step and return its outputs ``(steps, N, H x d)``."""

    def __init__(self, rows: int, heads: int, head_dim: int, steps: int, seed: int = 0):
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        cpu = ["CPUExecutionProvider"]
        self.rows, self.heads, self.head_dim, self.steps = rows, heads, head_dim, steps
        self.concat_session = ort.InferenceSession(concat_attention(rows, heads, head_dim), options, providers=cpu)
        self.in_place_session = ort.InferenceSession(
            in_place_attention(rows, heads, head_dim, steps), options, providers=cpu
        )
        rng = np.random.default_rng(seed)
        self.qkv = rng.standard_normal((3, steps, rows, heads, 1, head_dim), dtype=np.float32)
        # the in-place form's inputs: (N, 1, H x d), made once (the layer's projection gives them so)
        self.flat = np.ascontiguousarray(self.qkv.transpose(0, 1, 2, 4, 3, 5).reshape(3, steps, rows, 1, -1))
        self.cache = np.zeros((2, rows, heads, steps, head_dim), np.float32)
        self.out = np.zeros((rows, 1, heads * head_dim), np.float32)

    def concat(self) -> np.ndarray:
        past_k = past_v = np.zeros((self.rows, self.heads, 0, self.head_dim), np.float32)
        outs = []
        for t in range(self.steps):
            q, k, v = self.qkv[:, t]
            out, past_k, past_v = self.concat_session.run(None, {"q": q, "k": k, "v": v, "pk": past_k, "pv": past_v})
            outs.append(out.transpose(0, 2, 1, 3).reshape(self.rows, -1))
        return np.stack(outs)

    def in_place(self) -> np.ndarray:
        self.cache[:] = 0
        binding = self.in_place_session.io_binding()
        for name, i in (("k", 0), ("v", 1)):
            buffer = ort.OrtValue.ortvalue_from_numpy(self.cache[i])
            binding.bind_ortvalue_input(f"p{name}", buffer)
            binding.bind_ortvalue_output(f"present_{name}", buffer)
        binding.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(self.out))
        outs = []
        for t in range(self.steps):
            for name, x in zip("qkv", self.flat[:, t]):
                binding.bind_cpu_input(name, x)
            binding.bind_cpu_input("seqlens_k", np.full(self.rows, t, np.int32))  # keys before this step
            binding.bind_cpu_input("total", np.array([t + 1], np.int32))
            self.in_place_session.run_with_iobinding(binding)
            outs.append(self.out.reshape(self.rows, -1).copy())
        return np.stack(outs)


def measure(rows: int, heads: int, head_dim: int, steps: int, runs: int) -> dict:
    probe = Probe(rows, heads, head_dim, steps)
    difference = float(np.abs(probe.concat() - probe.in_place()).max())
    timed = time_runs({"concat": probe.concat, "in place": probe.in_place}, warmup=1, runs=runs)
    ms = {name: {"min": t.min * 1e3, "median": t.median * 1e3} for name, t in timed.items()}
    return {
        "rows": rows,
        "heads": heads,
        "head_dim": head_dim,
        "steps": steps,
        "runs": runs,
        "max_abs_difference": difference,
        "ms": ms,
        "concat_over_in_place": ms["concat"]["min"] / ms["in place"]["min"],
        "saved_ms_per_layer_step": (ms["concat"]["min"] - ms["in place"]["min"]) / steps,
    }


def markdown(result: dict, meta: dict) -> str:
    ms = result["ms"]
    rows = [
        f"| {name} | {ms[name]['min']:.1f} | {ms[name]['median']:.1f} | {ms[name]['min'] / result['steps']:.2f} |"
        for name in ("concat", "in place")
    ]
    return (
        f"One layer's decoder self-attention, {result['rows']} rows, {result['heads']} heads of "
        f"{result['head_dim']}, {result['steps']} steps from an empty cache; ONNX Runtime "
        f"{meta['onnxruntime']}, one thread, {meta['cpu']}; fastest and median of {result['runs']} "
        f"round-robin runs.\n\n"
        "| form | ms, fastest | ms, median | ms a step, fastest |\n| --- | ---: | ---: | ---: |\n"
        + "\n".join(rows)
        + f"\n\nconcat / in place: {result['concat_over_in_place']:.2f}x; saved per layer and step: "
        f"{result['saved_ms_per_layer_step']:.3f} ms; largest difference of the outputs: "
        f"{result['max_abs_difference']:.1e}.\n"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=36)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    if args.head_dim % 8:
        p.error(f"--head-dim {args.head_dim}: GroupQueryAttention's CPU kernel takes a multiple of 8")
    result = measure(args.rows, args.heads, args.head_dim, args.steps, args.runs)
    meta = {"cpu": cpu_name(), "cpu_isa": cpu_isa(), "onnxruntime": ort.__version__}
    md = markdown(result, meta)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "cache_probe.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out_dir, "cache_probe.json"), "w") as f:
        json.dump({"meta": meta, **result}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
