"""The compatibility layer: what fairseq 0.12 needs on PyTorch 2.x, and that importing the
plugin changes nothing else of fairseq."""

import argparse
import json
import pickle
import subprocess
import sys

import fairseq.trainer as trainer
import pytest
import torch
from fairseq import checkpoint_utils, options
from fairseq.scoring import build_scorer
from fairseq.scoring.bleu import SacrebleuConfig, SacrebleuScorer
from sacrebleu.metrics import BLEU

import fairseq_hrt  # noqa: F401  (applies compat)
from fairseq_hrt import compat
from fairseq_hrt.scoring.signed_sacrebleu import SCORER_NAME, SignedSacrebleuScorer
from tests.hrt_fixtures import REPO, build_task_and_model


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
    before = (checkpoint_utils.torch, trainer.torch)
    compat.apply()
    compat.apply()  # a second application must not wrap the wrappers
    assert (checkpoint_utils.torch, trainer.torch) == before
    assert checkpoint_utils.torch.nn is torch.nn  # everything else is torch's own


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


# Every fairseq module the plugin's runs touch, and what it holds: its globals, and the attributes
# of its classes and functions (fairseq keeps state on functions, e.g. should_stop_early.best).
_FAIRSEQ_SNAPSHOT = """
import importlib, json, sys
MODULES = [
    "fairseq.checkpoint_utils", "fairseq.trainer", "fairseq.distributed.utils", "fairseq.utils",
    "fairseq.options", "fairseq.file_io", "fairseq.scoring.bleu", "fairseq.tasks.translation",
    "fairseq.tasks.fairseq_task", "fairseq.sequence_generator", "fairseq.data.data_utils",
    "fairseq_cli.train", "fairseq_cli.generate", "fairseq_cli.interactive",
]
def snapshot():
    seen = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for key, value in vars(module).items():
            seen[f"{name}.{key}"] = id(value)
            if getattr(value, "__module__", None) == name and isinstance(value, type):
                for attr, member in vars(value).items():
                    seen[f"{name}.{key}.{attr}"] = id(member)
            elif callable(value) and hasattr(value, "__dict__"):
                for attr, member in vars(value).items():
                    seen[f"{name}.{key}.{attr}"] = id(member)
    return seen
stock = snapshot()
excepthook = id(sys.excepthook)
import torch, argparse
torch_load, help_action = id(torch.load), id(argparse._HelpAction.__call__)
import fairseq_hrt
from fairseq.utils import import_user_module
import_user_module(argparse.Namespace(user_dir="fairseq_hrt"))  # as --user-dir does, again
after = snapshot()
changed = sorted(k for k in stock if after.get(k) != stock[k])
print(json.dumps({"changed": changed, "excepthook": id(sys.excepthook) == excepthook,
                  "torch": (id(torch.load), id(argparse._HelpAction.__call__)) == (torch_load, help_action)}))
"""


def test_importing_the_plugin_changes_only_the_listed_fixes_of_fairseq():
    """In a fresh interpreter: every global of fairseq's training, checkpoint, scoring and
    command-line modules, every attribute of their classes and functions, is the same object
    before and after ``import fairseq_hrt`` (and fairseq's own user-dir import), but for the
    ``torch`` globals that compat.py's fixes replace. So fairseq-train's loop, the trainer's
    checkpoint methods, fairseq-interactive's reader, the scorers, the distributed set-up and
    argparse's --help are fairseq's own for every task."""
    done = subprocess.run(
        [sys.executable, "-c", _FAIRSEQ_SNAPSHOT], cwd=REPO, capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["changed"] == sorted(f"{module}.{name}" for module, name in compat.PATCHED)
    assert result["excepthook"] and result["torch"]


@pytest.mark.parametrize("lowercase", [False, True])
def test_sacrebleu_signature_scoring_prints_sacrebleus_signature_and_score(lowercase):
    """``--scoring sacrebleu_signature`` (the plugin's scorer) prints sacreBLEU's own line for
    the same detokenised text: the same score and the signature that says how it was computed;
    fairseq's ``--scoring sacrebleu`` prints its own line, the same score without it."""
    hyps = ["A man rides a bike.", "Two dogs, playing in snow!", "Hello World"]
    refs = ["A man is riding a bike.", "Two dogs play in the snow!", "hello world"]
    cfg = SacrebleuConfig(sacrebleu_lowercase=lowercase)
    signed, plain = SignedSacrebleuScorer(cfg), SacrebleuScorer(cfg)
    for ref, hyp in zip(refs, hyps):
        signed.add_string(ref, hyp)
        plain.add_string(ref, hyp)
    bleu = BLEU(tokenize="13a", lowercase=lowercase)
    expected = bleu.corpus_score(hyps, [refs])
    case = "lc" if lowercase else "mixed"
    assert signed.result_string() == expected.format(signature=bleu.get_signature().format())
    assert signed.result_string().startswith(f"BLEU|nrefs:1|case:{case}|eff:no|tok:13a|smooth:exp|version:")
    assert plain.result_string() == expected.format()  # fairseq's own, unchanged
    assert SacrebleuScorer.result_string.__module__ == "fairseq.scoring.bleu"


def test_sacrebleu_signature_is_a_scorer_of_fairseqs_registry():
    scorer = build_scorer(argparse.Namespace(scoring=SCORER_NAME, sacrebleu_tokenizer="13a"), None)
    assert isinstance(scorer, SignedSacrebleuScorer)
    assert type(build_scorer(argparse.Namespace(scoring="sacrebleu"), None)) is SacrebleuScorer
