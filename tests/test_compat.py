"""The compatibility layer: fairseq checkpoints load under PyTorch >= 2.6 without settings."""
import argparse
import pickle

import numpy as np
import pytest
import torch

import fairseq_hrt  # noqa: F401  (applies compat)
from fairseq import checkpoint_utils
from fairseq_hrt import compat


def _fairseq_like_checkpoint(path):
    # what every fairseq checkpoint holds next to its weights: a pickled configuration
    state = {"args": argparse.Namespace(arch="hrt_tiny"), "model": {"w": torch.ones(2)}, "cfg": None}
    torch.save(state, path)
    return state


def test_fairseq_loader_reads_pickled_config(tmp_path):
    path = tmp_path / "ckpt.pt"
    _fairseq_like_checkpoint(path)
    state = checkpoint_utils.torch.load(str(path), map_location="cpu")
    assert torch.equal(state["model"]["w"], torch.ones(2))


def test_real_checkpoint_loads_through_load_model_ensemble(tmp_path):
    """A checkpoint as fairseq-train writes it (argparse config pickled inside) loads into
    a model through fairseq's Python API, the path generate and interactive take."""
    from fairseq import options
    from tests.hrt_fixtures import build_task_and_model

    task, model = build_task_and_model(str(tmp_path))
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [str(tmp_path), "--user-dir", "fairseq_hrt", "--task", "hrt_translation", "--source-lang", "src",
         "--target-lang", "tgt", "--arch", "hrt_tiny", "--share-all-embeddings", "--chunk-sizes", "2,3"],
    )
    state = {
        "args": args,
        "model": model.state_dict(),
        "optimizer_history": [
            {"criterion_name": "HRTLossCriterion", "optimizer_name": "Adam", "lr_scheduler_state": {"best": None}, "num_updates": 7}
        ],
        "extra_state": {"train_iterator": {"epoch": 1}},
        "last_optimizer_state": None,
    }
    path = tmp_path / "checkpoint_last.pt"
    checkpoint_utils.torch_persistent_save(state, str(path))
    models, _ = checkpoint_utils.load_model_ensemble([str(path)], task=task)
    loaded = models[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert models[0].get_trained_chunk_sizes() == [2, 3]


def test_global_torch_load_keeps_its_safe_default(tmp_path):
    path = tmp_path / "ckpt.pt"
    _fairseq_like_checkpoint(path)
    if torch.__version__ >= "2.6":
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path)


def test_explicit_weights_only_is_respected(tmp_path):
    path = tmp_path / "ckpt.pt"
    _fairseq_like_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError):
        checkpoint_utils.torch.load(path, weights_only=True)


def test_apply_is_idempotent():
    before = checkpoint_utils.torch
    compat.apply()
    compat._APPLIED = False
    compat.apply()  # a second application must not wrap the wrapper
    assert checkpoint_utils.torch is before
    assert checkpoint_utils.torch.nn is torch.nn  # everything else is torch's own


def test_trainer_overflow_handler_tensor_works_without_cuda():
    """fairseq.trainer's overflow handler runs ``torch.tensor(0.0).cuda()``; on a machine
    without CUDA that must give a CPU tensor, not an AssertionError (the end-to-end check
    is tests/test_training.py::test_fp16_on_cpu_survives_gradient_overflow)."""
    import fairseq.trainer as trainer

    if torch.cuda.is_available():
        pytest.skip("only meaningful without CUDA")
    grad_norm = trainer.torch.tensor(0.0).cuda()
    assert type(grad_norm) is torch.Tensor and grad_norm.device.type == "cpu"
    assert float(grad_norm) == 0.0
    # every other attribute is torch's own, and torch itself is untouched
    assert trainer.torch.zeros_like is torch.zeros_like
    assert not hasattr(torch.tensor, "__fairseq_hrt_compat__")


@pytest.mark.parametrize("max_sentences", [1, 3, 8, 128])
@pytest.mark.parametrize("n", [1, 10, 1000, 1014])
def test_batch_by_size_never_drops_sentences(n, max_sentences):
    """fairseq 0.12 drops the last batch when its size is not a multiple of
    --required-batch-size-multiple (8 by default): fairseq-generate --batch-size 1 translated
    999 of 1000 sentences. Every index must be batched exactly once, in order, and every
    batch but the last keeps fairseq's sizes."""
    from fairseq.data import data_utils

    indices = np.arange(n, dtype=np.int64)
    batches = data_utils.batch_by_size(
        indices, lambda i: 5, max_sentences=max_sentences, required_batch_size_multiple=8
    )
    assert np.concatenate(batches).tolist() == list(range(n))
    assert all(len(b) <= max(max_sentences, 1) for b in batches)
    # an iterator (not an array) of indices works too
    again = data_utils.batch_by_size(iter(range(n)), lambda i: 5, max_sentences=max_sentences, required_batch_size_multiple=8)
    assert [b.tolist() for b in again] == [b.tolist() for b in batches]
