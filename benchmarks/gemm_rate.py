#!/usr/bin/env python
"""The matrix products of our AT's encoder and decoder step at batch 128, in ONNX Runtime's MLAS
(our engine's) and in Intel MKL's packed SGEMM (CTranslate2's on an Intel CPU), side by side
(issue 87, item 3).

``benchmarks/batch_step.py`` finds our encoder 5-15 % slower than CTranslate2's at batch 128 with
83-91 % of its time in ONNX Runtime's ``Gemm`` nodes. This script asks whether that gap is the
matrix products' library: every product of the two passes (``--shapes``: the papers' base 6-6
and E12D1), at the rows the pass has (the encoder: batch x source tokens; the step: batch), timed
round-robin (:func:`benchmarks.timing.time_runs`) in

* ``onnxruntime``: a one-node graph per product as the export writes it (``Gemm`` with
  ``transB`` and a bias, ``Relu`` after the first feed-forward product, which ONNX Runtime fuses
  into ``FusedGemm``; the output layer a ``MatMul``), the weight an initializer (prepacked at
  load), the runtime's session options;
* ``mkl packed``: ``torch.ops.mkl._mkl_linear`` over a weight packed once for the product's rows
  (``_mkl_reorder_linear_weight``): MKL's ``cblas_sgemm_pack`` / ``cblas_sgemm_compute``, the
  calls CTranslate2 makes (its ``CT2_VERBOSE`` log: "SGEMM backend: MKL (packed: true)");
* ``mkl``: ``torch.nn.functional.linear`` (MKL's plain SGEMM).

Each product's outputs are compared with a float64 reference. A pass's time is the sum of its
products' fastest times times their counts. Writes ``OUT/gemm_rate.{md,json}``::

    OMP_NUM_THREADS=1 python benchmarks/gemm_rate.py --out-dir benchmarks/results/batch128-cpu/gemm-rate
"""

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List

if not __package__:  # python benchmarks/gemm_rate.py (a file): the repository root on sys.path, as -m has it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.report_files import write_report  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402

# model width, feed-forward width, encoder layers, decoder layers (benchmarks/paper_shapes.py's shapes)
LAYERS = {"base": (512, 2048, 6, 6), "e12d1": (512, 2048, 12, 1), "small-e6d2": (256, 1024, 6, 2)}
ENGINES = ("onnxruntime", "mkl packed", "mkl")


@dataclass(frozen=True)
class Product:
    """``count`` products of ``(rows, inputs)`` activations by a ``(outputs, inputs)`` weight in
    one run of ``graph`` (``encoder`` or ``step``)."""

    graph: str
    name: str
    rows: int
    inputs: int
    outputs: int
    count: int
    relu: bool = False
    bias: bool = True

    @property
    def gflop(self) -> float:
        return 2 * self.rows * self.inputs * self.outputs * self.count / 1e9


def products(shape: str, batch: int, src_len: int, vocab: int) -> List[Product]:
    """The matrix products of ``shape``'s exported encoder (``batch x src_len`` rows) and step
    (``batch`` rows; its attention's own products over the cache are not here)."""
    d, ffn, enc, dec = LAYERS[shape]
    tokens = batch * src_len
    return [
        Product("encoder", "self-attention q, k, v", tokens, d, 3 * d, enc),
        Product("encoder", "self-attention output", tokens, d, d, enc),
        Product("encoder", "feed-forward 1 (+ ReLU)", tokens, d, ffn, enc, relu=True),
        Product("encoder", "feed-forward 2", tokens, ffn, d, enc),
        Product("encoder", "decoder layers' encoder keys, values", tokens, d, 2 * d, dec),
        Product("step", "self-attention q, k, v", batch, d, 3 * d, dec),
        Product("step", "self-attention output", batch, d, d, dec),
        Product("step", "encoder attention q, output", batch, d, d, 2 * dec),
        Product("step", "feed-forward 1 (+ ReLU)", batch, d, ffn, dec, relu=True),
        Product("step", "feed-forward 2", batch, ffn, d, dec),
        Product("step", "output layer", batch, d, vocab, 1, bias=False),
    ]


def onnx_product(p: Product, weight: np.ndarray, bias: np.ndarray, threads: int) -> Callable:
    """``x -> y`` of a one-node ONNX Runtime graph of ``p`` as the export writes it."""
    if p.bias:
        inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")]
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h" if p.relu else "y"], transB=1)]
    else:
        inits = [numpy_helper.from_array(np.ascontiguousarray(weight.T), "w")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    if p.relu:
        nodes.append(helper.make_node("Relu", ["h"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "product",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", p.inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", p.outputs])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_cpu_mem_arena = False  # as the runtime's sessions (hrt_runtime/sessions.py)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


def mkl_products(p: Product, weight: np.ndarray, bias: np.ndarray) -> Dict[str, Callable]:
    """``{engine: x -> y}`` of ``p`` in MKL, packed for ``p.rows`` rows and plain."""
    w = torch.from_numpy(weight)
    b = torch.from_numpy(bias) if p.bias else torch.zeros(p.outputs)
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, p.rows)

    def finish(y: torch.Tensor) -> np.ndarray:
        return (y.relu_() if p.relu else y).numpy()

    return {
        "mkl packed": lambda x: finish(torch.ops.mkl._mkl_linear(torch.from_numpy(x), packed, w, b, p.rows)),
        "mkl": lambda x: finish(torch.nn.functional.linear(torch.from_numpy(x), w, b if p.bias else None)),
    }


def measure(p: Product, runs: int, threads: int, seed: int = 0) -> dict:
    """``{ms: {engine: fastest}, max_relative_difference: {engine: ...}}`` of one product."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((p.rows, p.inputs), dtype=np.float32)
    weight = (rng.standard_normal((p.outputs, p.inputs), dtype=np.float32) / np.sqrt(p.inputs)).astype(np.float32)
    bias = rng.standard_normal(p.outputs, dtype=np.float32) * 0.1
    expected = x.astype(np.float64) @ weight.T.astype(np.float64) + (bias if p.bias else 0.0)
    if p.relu:
        expected = np.maximum(expected, 0.0)
    fns = {"onnxruntime": onnx_product(p, weight, bias, threads), **mkl_products(p, weight, bias)}
    timed = time_runs({name: (lambda f=f: f(x)) for name, f in fns.items()}, warmup=1, runs=runs)
    scale = np.abs(expected).max()
    return {
        "ms": {name: round(t.min * 1000, 4) for name, t in timed.items()},
        "max_relative_difference": {name: float(np.abs(t.value - expected).max() / scale) for name, t in timed.items()},
    }


def run(shapes: List[str], batch: int, src_len: int, vocab: int, runs: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    report = {
        "cpu": cpu_name(),
        "isa_flags": cpu_isa(),
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "batch": batch,
        "src_len": src_len,
        "vocab": vocab,
        "runs": runs,
        "shapes": {},
    }
    for shape in shapes:
        rows = []
        for p in products(shape, batch, src_len, vocab):
            rows.append({**asdict(p), "gflop": round(p.gflop, 3), **measure(p, runs, threads)})
        totals = {
            graph: {e: round(sum(r["ms"][e] * r["count"] for r in rows if r["graph"] == graph), 3) for e in ENGINES}
            for graph in ("encoder", "step")
        }
        report["shapes"][shape] = {"products": rows, "pass_ms": totals}
    return report


def markdown(report: dict, command: str) -> str:
    lines = [
        f"# The matrix products of our encoder and step at batch {report['batch']}: ONNX Runtime (MLAS) "
        "against MKL's packed SGEMM (CTranslate2's)",
        "",
        f"CPU: {report['cpu']}; ISA flags: {', '.join(report['isa_flags']) or 'none found'}; onnxruntime "
        f"{report['onnxruntime']}, torch {report['torch']} (MKL); {report['threads']} thread(s); the fastest of "
        f"{report['runs']} round-robin runs per product; sources of {report['src_len']} tokens.",
        "",
        f"Command: `{command}`",
    ]
    for shape, r in report["shapes"].items():
        lines += [
            "",
            f"## {shape}",
            "",
            "| pass | product | rows x in x out | count | onnxruntime ms (GFLOP/s) | mkl packed ms (GFLOP/s) "
            "| mkl ms (GFLOP/s) | onnxruntime / mkl packed (time) |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in r["products"]:
            one = 2 * p["rows"] * p["inputs"] * p["outputs"] / 1e9
            cells = [f"{p['ms'][e]:.2f} ({one / p['ms'][e] * 1000:.0f})" for e in ENGINES]
            lines.append(
                f"| {p['graph']} | {p['name']} | {p['rows']} x {p['inputs']} x {p['outputs']} | {p['count']} | "
                + " | ".join(cells)
                + f" | {p['ms']['onnxruntime'] / p['ms']['mkl packed']:.2f}x |"
            )
        lines += ["", "| pass: all its products (ms) | onnxruntime | mkl packed | mkl | onnxruntime / mkl packed |"]
        lines.append("| --- | ---: | ---: | ---: | ---: |")
        for graph, t in r["pass_ms"].items():
            lines.append(
                f"| {graph} | {t['onnxruntime']:.1f} | {t['mkl packed']:.1f} | {t['mkl']:.1f} | "
                f"{t['onnxruntime'] / t['mkl packed']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="base,e12d1", help=f"comma-separated, of {', '.join(LAYERS)}")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--src-len", type=int, default=31, help="source tokens, </s> included (batch_step.py's)")
    p.add_argument("--vocab", type=int, default=32008, help="output rows (batch_step.py's dictionary)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", required=True)
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in LAYERS:
            p.error(f"--shapes: {s!r} is not one of {', '.join(LAYERS)}")
    report = run(shapes, args.batch, args.src_len, args.vocab, args.runs, args.threads)
    command = " ".join(["python benchmarks/gemm_rate.py", *(argv if argv is not None else sys.argv[1:])])
    report["command"] = command
    write_report(args.out_dir, "gemm_rate", report, markdown(report, command))
    return report


if __name__ == "__main__":
    main()
