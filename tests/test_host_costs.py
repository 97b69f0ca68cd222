"""benchmarks/host_costs.py: both of its tables, for a shape, from the engine's own calls."""

import json

import torch

from benchmarks import host_costs


def test_host_costs_times_the_check_and_the_work_around_the_graphs(tmp_path):
    host_costs.main(["--shapes", "tiny", "--calls", "3", "--repeats", "2", "--out-dir", str(tmp_path)])
    tiny = json.loads((tmp_path / "host_costs.json").read_text())["shapes"]["tiny"]
    for family in ("AT", "HRT"):
        us = tiny[family]["us"]
        hows = ("kept, maps", "kept, tuples", "full walk")
        assert set(us) == {f"{part}, {how}" for part in ("model", "decoder") for how in hows}
        assert all(v > 0 for v in us.values())
        assert tiny[family]["parameters"]["model"] > tiny[family]["parameters"]["decoder"] > 0
    assert set(tiny["around_graphs"]) == {"device loop", "search's steps"}
    for us in tiny["around_graphs"].values():
        assert set(us) == {"encoder", "at_steps", "skip_at_steps", "stage2"} and all(v > 0 for v in us.values())
    for ops in tiny["tensor_ops"].values():  # counted: the encoder copies its tokens in, stage II its inputs
        assert set(ops) == set(us) and ops["encoder"] >= 1 and ops["stage2"] >= 1
    for inside, outside, half in zip(
        *(tiny[key].values() for key in ("tensor_ops_inside", "tensor_ops", "tensor_ops_inside_float16"))
    ):
        assert set(inside) == set(outside) == set(half) and all(inside[call] > outside[call] for call in inside)
        assert all(half[call] >= inside[call] for call in half)  # float16 adds casts, never removes kernels
    md = (tmp_path / "host_costs.md").read_text()
    assert "| tiny | device loop |" in md and "| tiny | HRT |" in md


def test_the_host_only_backend_skips_the_bodies_and_makes_no_graph(tmp_path):
    """After the first round, a call of the host-only backend runs none of its graphs' bodies
    and makes no graph: what it times is the host's work around graphs that exist."""
    models = host_costs.build_models("tiny", 200, str(tmp_path))
    task = models.hrt_task
    backend = host_costs.HostOnlyBackend(
        models.hrt, task.target_dictionary, chunk_start=task.chunk_start_idx, mask=task.mask_idx
    )
    ran = []
    original = backend.captured

    def counted(body):
        return original(lambda: (ran.append(1), body()))

    backend.captured = counted

    def encode(src):
        return backend.encode_fairseq({"src_tokens": torch.from_numpy(src), "src_lengths": None})

    calls = host_costs.fixed_length_calls(backend, encode, task, 1, 6, 7, 2)
    for call in calls.values():
        call()
    made, bodies = backend.graphs, len(ran)
    assert made >= 3 and bodies > 0  # the encoder, the loop, stage II
    backend.bodies = False
    for call in calls.values():
        call()
    assert backend.graphs == made and len(ran) == bodies
