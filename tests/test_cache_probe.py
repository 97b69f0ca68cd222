"""benchmarks/cache_probe.py: both forms of a layer's cached self-attention compute the same
outputs, so the probe times the same work."""

import json

import numpy as np

from benchmarks import cache_probe


def test_the_cache_written_in_place_attends_as_the_grown_past(tmp_path):
    shape = ["--rows", "5", "--heads", "2", "--head-dim", "8", "--steps", "6", "--runs", "1"]
    cache_probe.main(shape + ["--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "cache_probe.json").read_text())
    assert result["max_abs_difference"] < 1e-5
    assert all(ms["min"] > 0 for ms in result["ms"].values()) and result["steps"] == 6
    assert "| in place |" in (tmp_path / "cache_probe.md").read_text()


def test_a_cache_told_empty_at_every_step_attends_otherwise():
    """The comparison can fail: the in-place form told that no key came before differs from
    the second step on."""
    probe = cache_probe.Probe(rows=3, heads=2, head_dim=8, steps=4)  # GQA: a multiple of 8
    expected = probe.concat()
    run = probe.in_place_session.run_with_iobinding

    def told_empty(binding):
        binding.bind_cpu_input("seqlens_k", np.zeros(3, np.int32))
        binding.bind_cpu_input("total", np.ones(1, np.int32))
        return run(binding)

    probe.in_place_session.run_with_iobinding = told_empty
    ours = probe.in_place()
    assert np.abs(expected[0] - ours[0]).max() < 1e-5 and np.abs(expected[1:] - ours[1:]).max() > 1e-3
