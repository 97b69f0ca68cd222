"""benchmarks/gemm_rate.py: the products it times are the exported passes' products, and every
engine computes them (the same numbers), so the table compares the same work."""

import json

import numpy as np
import pytest

from benchmarks import gemm_rate


def test_the_products_are_the_passes_ones():
    found = gemm_rate.products("e12d1", batch=4, src_len=3, vocab=100)
    encoder = [p for p in found if p.graph == "encoder"]
    step = [p for p in found if p.graph == "step"]
    assert {p.rows for p in encoder} == {12} and {p.rows for p in step} == {4}
    # 12 encoder layers of 4 products, one decoder layer's encoder keys and values
    assert sum(p.count for p in encoder) == 12 * 4 + 1
    assert sum(p.count for p in step) == 6 + 1
    output = next(p for p in step if p.name == "output layer")
    assert (output.inputs, output.outputs, output.bias) == (512, 100, False)
    # FLOP of the base encoder at batch 128 x 31 tokens: 6 layers of 12 d^2 + 2 d x FFN, 6 x 2 d^2
    base = gemm_rate.products("base", batch=128, src_len=31, vocab=32008)
    gflop = sum(p.gflop for p in base if p.graph == "encoder")
    assert gflop == pytest.approx(2 * 3968 * (6 * (4 * 512 * 512 + 2 * 512 * 2048) + 6 * 2 * 512 * 512) / 1e9)


def test_every_engine_computes_each_product(tmp_path):
    args = ["--shapes", "small-e6d2", "--batch", "3", "--src-len", "4", "--vocab", "50", "--runs", "1"]
    gemm_rate.main(args + ["--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "gemm_rate.json").read_text())
    rows = report["shapes"]["small-e6d2"]["products"]
    assert len(rows) == 11
    for row in rows:
        assert set(row["ms"]) == set(gemm_rate.ENGINES) and all(ms > 0 for ms in row["ms"].values())
        assert max(row["max_relative_difference"].values()) < 1e-4, row["name"]
    totals = report["shapes"]["small-e6d2"]["pass_ms"]
    encoder_rows = [r for r in rows if r["graph"] == "encoder"]
    assert totals["encoder"]["mkl"] == pytest.approx(sum(r["ms"]["mkl"] * r["count"] for r in encoder_rows), abs=1e-2)
    assert "| step | output layer | 3 x 256 x 50 | 1 |" in (tmp_path / "gemm_rate.md").read_text()


def test_a_relu_product_is_checked_against_its_relu():
    """The comparison can fail: an engine that left out the ReLU differs from the reference."""
    product = gemm_rate.Product("encoder", "feed-forward 1 (+ ReLU)", 5, 16, 32, 1, relu=True)
    plain = gemm_rate.Product("encoder", "feed-forward 1", 5, 16, 32, 1)
    found = gemm_rate.measure(product, runs=1, threads=1)
    assert max(found["max_relative_difference"].values()) < 1e-5
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 16), dtype=np.float32)
    bias = np.zeros(32, np.float32)
    x = rng.standard_normal((5, 16), dtype=np.float32)
    with_relu = gemm_rate.onnx_product(product, weight, bias, 1)(x)
    without = gemm_rate.onnx_product(plain, weight, bias, 1)(x)
    assert (with_relu >= 0).all() and (without < 0).any()
    assert np.allclose(with_relu, np.maximum(without, 0))
