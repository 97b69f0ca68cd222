"""The compatibility layer: fairseq checkpoints load under PyTorch >= 2.6 without settings."""

import argparse
import pickle
import types
from unittest import mock

import fairseq.trainer as trainer
import fairseq_cli.train  # noqa: F401 - loaded, as in fairseq's whole suite
import fairseq_cli.train as fairseq_train
import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.scoring.bleu import SacrebleuConfig, SacrebleuScorer
from fairseq.trainer import Trainer
from omegaconf import OmegaConf
from sacrebleu.metrics import BLEU

import fairseq_hrt  # noqa: F401  (applies compat)
from fairseq_hrt import compat
from tests.hrt_fixtures import build_task_and_model


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
    task, model = build_task_and_model(str(tmp_path))
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        [
            str(tmp_path),
            "--user-dir",
            "fairseq_hrt",
            "--task",
            "hrt_translation",
            "--source-lang",
            "src",
            "--target-lang",
            "tgt",
            "--arch",
            "hrt_tiny",
            "--share-all-embeddings",
            "--chunk-sizes",
            "2,3",
        ],
    )
    state = {
        "args": args,
        "model": model.state_dict(),
        "optimizer_history": [
            {
                "criterion_name": "HRTLossCriterion",
                "optimizer_name": "Adam",
                "lr_scheduler_state": {"best": None},
                "num_updates": 7,
            }
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
    before = (checkpoint_utils.torch, trainer.torch, Trainer.load_checkpoint)
    compat.apply()
    compat.apply()  # a second application must not wrap the wrappers
    assert (checkpoint_utils.torch, trainer.torch, Trainer.load_checkpoint) == before
    assert checkpoint_utils.torch.nn is torch.nn  # everything else is torch's own


def test_a_changed_fairseq_signature_fails_loudly():
    def load_checkpoint(self, filename, reset_optimizer=False, reset_meters=False):
        pass

    with pytest.raises(RuntimeError, match="needs the fix reviewed"):
        compat._expect_parameters(
            load_checkpoint, ["self", "filename", "reset_optimizer", "reset_lr_scheduler"], "Trainer.load_checkpoint"
        )


@pytest.mark.parametrize("call", ["positional", "keyword", "default"])
def test_clock_fix_binds_reset_meters_however_it_is_passed(call):
    calls = []

    class FakeTrainer:
        _previous_training_time, _start_time = 100.0, 0.0

        def load_checkpoint(
            self,
            filename,
            reset_optimizer=False,
            reset_lr_scheduler=False,
            optimizer_overrides=None,
            reset_meters=False,
        ):
            calls.append(reset_meters)
            return {"extra": 1}

    wrapped = compat._load_checkpoint_restarting_the_clock(FakeTrainer.load_checkpoint)
    t = FakeTrainer()
    if call == "positional":
        assert wrapped(t, "ck.pt", True, True, None, True) == {"extra": 1}
    elif call == "keyword":
        assert wrapped(t, "ck.pt", reset_meters=True) == {"extra": 1}
    else:
        assert wrapped(t, "ck.pt") == {"extra": 1}
    reset = call != "default"
    assert calls == [reset]
    assert (t._previous_training_time == 0) == reset


def test_trainer_overflow_handler_tensor_works_without_cuda():
    """fairseq.trainer's overflow handler runs ``torch.tensor(0.0).cuda()``; on a machine
    without CUDA that must give a CPU tensor, not an AssertionError (the end-to-end check
    is tests/test_training.py::test_fp16_on_cpu_survives_gradient_overflow)."""
    if torch.cuda.is_available():
        pytest.skip("only meaningful without CUDA")
    grad_norm = trainer.torch.tensor(0.0).cuda()
    assert type(grad_norm) is torch.Tensor and grad_norm.device.type == "cpu"
    assert float(grad_norm) == 0.0
    # every other attribute is torch's own, and torch itself is untouched
    assert trainer.torch.zeros_like is torch.zeros_like
    assert not hasattr(torch.tensor, "__fairseq_hrt_compat__")


def test_a_finished_run_skips_its_epoch_and_an_unfinished_one_trains():
    calls = []

    def train(cfg, trainer, task, epoch_itr):
        calls.append(trainer.get_num_updates())
        return [1.0], False

    wrapped = compat._train_stopping_when_finished(train)

    def args(num_updates, max_update):
        cfg = types.SimpleNamespace(
            optimization=types.SimpleNamespace(max_update=max_update),
            checkpoint=types.SimpleNamespace(save_dir="ck", patience=0),
        )
        return cfg, types.SimpleNamespace(get_num_updates=lambda: num_updates), None, None

    assert wrapped(*args(300, 300)) == ([None], True)  # fairseq's loop stops, nothing saved
    assert wrapped(*args(302, 300)) == ([None], True)
    assert calls == []
    assert wrapped(*args(299, 300)) == ([1.0], False)
    assert wrapped(*args(5, 0)) == ([1.0], False)  # no --max-update: train
    assert calls == [299, 5]


def test_fairseq_train_module_is_patched_once():
    compat.patch_training_loop()
    first = fairseq_train.train
    assert getattr(first, "__fairseq_hrt_compat__", False)
    compat.patch_training_loop()
    assert fairseq_train.train is first


def test_a_checkpoint_loads_with_os_path_join_mocked():
    """fairseq's own tests (tests/test_train.py::TestLoadCheckpoint) load checkpoints with
    ``os.path.join`` replaced by a MagicMock, in a process that has loaded fairseq_cli.train;
    the plugin's wrapper of ``load_checkpoint`` used to call it and die with a TypeError."""
    assert getattr(checkpoint_utils.load_checkpoint, "__fairseq_hrt_compat__", False)
    cfg = OmegaConf.create(
        {
            "save_dir": None,
            "optimizer_overrides": "{}",
            "reset_dataloader": False,
            "reset_meters": False,
            "reset_optimizer": False,
            "reset_lr_scheduler": False,
            "finetune_from_model": None,
            "model_parallel_size": 1,
            "restore_file": "checkpoint_last.pt",
        }
    )
    trainer = mock.MagicMock()
    trainer.load_checkpoint.return_value = {"train_iterator": {"epoch": 2, "iterations_in_epoch": 0, "shuffle": False}}
    trainer.get_num_updates.return_value = 10
    with (
        mock.patch("os.makedirs"),
        mock.patch("os.path.join", mock.MagicMock()),
        mock.patch("os.path.isfile", mock.MagicMock(return_value=True)),
        mock.patch("os.path.isabs", mock.MagicMock(return_value=False)),
        mock.patch("fairseq.file_io.PathManager.exists", mock.MagicMock(return_value=False)),
    ):
        extra_state, _ = checkpoint_utils.load_checkpoint(cfg, trainer)
    assert extra_state["train_iterator"]["epoch"] == 2
    assert trainer.load_checkpoint.called
    assert getattr(fairseq_cli.train.train, "__fairseq_hrt_compat__", False)  # fairseq-train still recognised


@pytest.mark.parametrize("lowercase", [False, True])
def test_sacrebleu_scoring_prints_sacrebleus_signature_and_score(lowercase):
    """fairseq's ``--scoring sacrebleu`` line is sacreBLEU's own for the same detokenised text:
    the same score and the signature that says how it was computed."""
    hyps = ["A man rides a bike.", "Two dogs, playing in snow!", "Hello World"]
    refs = ["A man is riding a bike.", "Two dogs play in the snow!", "hello world"]
    scorer = SacrebleuScorer(SacrebleuConfig(sacrebleu_lowercase=lowercase))
    for ref, hyp in zip(refs, hyps):
        scorer.add_string(ref, hyp)
    bleu = BLEU(tokenize="13a", lowercase=lowercase)
    expected = bleu.corpus_score(hyps, [refs])
    case = "lc" if lowercase else "mixed"
    assert scorer.result_string() == expected.format(signature=bleu.get_signature().format())
    assert scorer.result_string().startswith(f"BLEU|nrefs:1|case:{case}|eff:no|tok:13a|smooth:exp|version:")
