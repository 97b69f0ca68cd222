"""Dropout masks of CPU tensors from NumPy's PCG64 (``--cpu-dropout-rng pcg64``, the default of
``fairseq-train --task hrt_translation``): the same dropout as ``F.dropout``, reproducible from
torch's seed, only in fairseq-train's models."""

import pytest
import torch
from fairseq import tasks
from fairseq.modules.fairseq_dropout import FairseqDropout

from fairseq_hrt.modules.cpu_dropout import PCG64Dropout, dropout_mask, pcg64_dropout, use_cpu_dropout_rng
from fairseq_hrt.passes.decoder_pass import unplanned_modules
from tests.hrt_fixtures import build_task_and_model, training_args


def test_the_mask_keeps_each_element_with_probability_one_minus_p_and_scales_it():
    n = 1_000_000
    for p in (0.1, 0.3, 0.5):
        mask = dropout_mask((1000, 1000), p, torch.float32, seed=7)
        assert mask.shape == (1000, 1000) and mask.dtype == torch.float32
        assert mask.unique().tolist() == [0.0, pytest.approx(1 / (1 - p))]
        kept = (mask > 0).double().mean().item()
        # binomial standard deviation sqrt(p (1 - p) / n) <= 0.0005: 6 of them
        assert kept == pytest.approx(1 - p, abs=6 * (p * (1 - p) / n) ** 0.5)
    assert dropout_mask((5,), 0.0, torch.float32, seed=1).tolist() == [1.0] * 5
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        dropout_mask((5,), 1.0, torch.float32, seed=1)


def test_the_mask_is_a_function_of_its_seed_in_every_dtype():
    a = dropout_mask((64, 33), 0.3, torch.float32, seed=11)
    assert torch.equal(a, dropout_mask((64, 33), 0.3, torch.float32, seed=11))
    assert not torch.equal(a, dropout_mask((64, 33), 0.3, torch.float32, seed=12))
    half = dropout_mask((64, 33), 0.3, torch.bfloat16, seed=11)
    assert half.dtype == torch.bfloat16 and torch.equal(half > 0, a > 0)


def test_dropout_is_inverted_dropout_reproducible_from_torchs_seed_with_the_masks_gradient():
    x = torch.randn(32, 40, requires_grad=True)
    torch.manual_seed(5)
    y = pcg64_dropout(x, 0.3)
    torch.manual_seed(5)
    assert torch.equal(y, pcg64_dropout(x, 0.3))  # fairseq reseeds torch before each update
    assert not torch.equal(y, pcg64_dropout(x, 0.3))  # the next call draws another mask
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.7)
    y.sum().backward()
    assert torch.allclose(x.grad, kept.float() / 0.7)
    # in place, as F.dropout(inplace=True): the same tensor, the same values for the same seed
    z = x.detach().clone()
    torch.manual_seed(5)
    out = pcg64_dropout(z, 0.3, inplace=True)
    assert out is z and torch.equal(z, y.detach())


def test_the_module_drops_only_while_training_and_keeps_fairseqs_inference_options():
    module = PCG64Dropout.from_module(FairseqDropout(0.3, module_name="Enc"))
    assert module.module_name == "Enc" and module.p == 0.3
    x = torch.ones(200, 50)
    module.eval()
    assert module(x) is x
    module.train()
    assert (module(x) == 0).any()
    module.eval()
    module.apply_during_inference = True  # fairseq-generate --retain-dropout
    assert (module(x) == 0).any()
    every = PCG64Dropout(1.0).train()
    assert torch.equal(every(x), torch.zeros_like(x))  # as F.dropout(p=1)


def test_every_dropout_of_a_trained_model_is_replaced_and_the_lean_plan_still_reads_it(tmp_path):
    _, model = build_task_and_model(str(tmp_path / "a"), extra=("--cpu-dropout-rng", "torch"))
    n = sum(type(m) is FairseqDropout for m in model.modules())
    assert n > 0 and not any(isinstance(m, PCG64Dropout) for m in model.modules())
    assert use_cpu_dropout_rng(model, "pcg64") == n
    assert not any(type(m) is FairseqDropout for m in model.modules())
    assert unplanned_modules(model.decoder) == [] and unplanned_modules(model.encoder, "encoder") == []
    assert use_cpu_dropout_rng(model, "torch") == 0
    with pytest.raises(ValueError, match="choose one of pcg64, torch"):
        use_cpu_dropout_rng(model, "mt19937")

    # the task's default, for fairseq-train's model; a model built to load a checkpoint keeps fairseq's
    args = training_args(str(tmp_path / "b"))
    task = tasks.setup_task(args)
    assert any(isinstance(m, PCG64Dropout) for m in task.build_model(args).modules())
    loaded = task.build_model(args, from_checkpoint=True)
    assert any(type(m) is FairseqDropout for m in loaded.modules())
    assert not any(isinstance(m, PCG64Dropout) for m in loaded.modules())
