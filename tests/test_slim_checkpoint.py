"""benchmarks/slim_checkpoint.py: what ``gpu_run.sh prepare`` carries to a GPU machine loads as
the trained model with float16-rounded weights, chunk sizes and tied weights kept."""

from collections import defaultdict

import pytest
import torch
from fairseq import checkpoint_utils

from benchmarks import slim_checkpoint


def _shared_groups(model_state):
    groups = defaultdict(list)
    for name, tensor in model_state.items():
        groups[tensor.untyped_storage().data_ptr()].append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_slim_checkpoint_loads_as_the_model_in_half_precision(trained, arch, tmp_path):
    data, ckpts = trained
    source, out = ckpts[arch], tmp_path / "slim.pt"
    slim_checkpoint.main([str(source), str(out)])
    original = torch.load(source, map_location="cpu", weights_only=True)
    slim = torch.load(out, map_location="cpu", weights_only=True)
    assert "last_optimizer_state" in original and "last_optimizer_state" not in slim
    assert out.stat().st_size < source.stat().st_size / 2
    assert {v.dtype for v in slim["model"].values() if v.is_floating_point()} == {torch.float16}
    assert _shared_groups(slim["model"]) == _shared_groups(original["model"])  # tied weights saved once

    def load(path):
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [str(path)], arg_overrides={"data": str(data.bin_dir)}
        )
        return models[0]

    expected, got = load(source).half().float(), load(out)
    for (name, a), (_, b) in zip(expected.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    if arch == "hrt_tiny":
        assert got.get_trained_chunk_sizes() == expected.get_trained_chunk_sizes() != []
