"""What importing the plugin changes in fairseq: nothing (no attribute of any fairseq module is
reassigned); for the process, fairseq checkpoints' types on PyTorch's allow-list of safe loading
(fairseq_hrt/compat.py, docs/compatibility.md); and the plugin's own scorer."""

import argparse
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from fairseq.scoring import build_scorer
from fairseq.scoring.bleu import SacrebleuConfig, SacrebleuScorer
from sacrebleu.metrics import BLEU

from fairseq_hrt import compat
from fairseq_hrt.scoring.signed_sacrebleu import SCORER_NAME, SignedSacrebleuScorer
from tests.hrt_fixtures import REPO

# The fairseq modules a run of the plugin loads (phase 1: printed after importing the plugin and
# fairseq's command lines), then, in another interpreter, the same modules imported first (phase
# 2) and every global of each, every attribute of its classes and functions (fairseq keeps state
# on functions, e.g. should_stop_early.best) compared before and after ``import fairseq_hrt``
# and fairseq's own --user-dir import of it.
_LOADED_MODULES = """
import json, sys
import fairseq_hrt, fairseq_cli.train, fairseq_cli.generate, fairseq_cli.interactive
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_cli"))))
"""
_FAIRSEQ_SNAPSHOT = """
import argparse, importlib, json, sys
MODULES = json.loads(sys.argv[1])
for name in MODULES:
    importlib.import_module(name)

def snapshot():
    seen = {}
    for name in MODULES:
        for key, value in list(vars(sys.modules[name]).items()):
            seen[f"{name}.{key}"] = id(value)
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                for attr, member in vars(value).items():
                    seen[f"{name}.{key}.{attr}"] = id(member)
            elif callable(value) and hasattr(value, "__dict__"):
                for attr, member in list(vars(value).items()):
                    seen[f"{name}.{key}.{attr}"] = id(member)
    return seen

stock = snapshot()
import torch
before = {"excepthook": id(sys.excepthook), "torch.load": id(torch.load),
          "help": id(argparse._HelpAction.__call__), "safe": len(torch.serialization.get_safe_globals())}
import fairseq_hrt
from fairseq.utils import import_user_module
import_user_module(argparse.Namespace(user_dir="fairseq_hrt"))  # as --user-dir does, again
after = snapshot()
print(json.dumps({
    "compared": len(stock),
    "changed": sorted(k for k in stock if after.get(k) != stock[k]),
    "same": [id(sys.excepthook) == before["excepthook"], id(torch.load) == before["torch.load"],
             id(argparse._HelpAction.__call__) == before["help"]],
    "safe_added": len(torch.serialization.get_safe_globals()) - before["safe"],
}))
"""


def _python(code, *args, cwd=REPO):
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_plugin_reassigns_nothing_of_fairseq():
    """In a fresh interpreter: every global of every fairseq module a plugin run loads (fairseq's
    training, checkpoint, distributed, scoring and command-line modules among them), and every
    attribute of their classes and functions, is the same object before and after ``import
    fairseq_hrt`` and fairseq's own ``--user-dir fairseq_hrt`` import. Outside a fairseq command
    line, ``sys.excepthook``, ``torch.load`` and argparse's --help are untouched too; what the
    import adds is the checkpoint types on PyTorch's allow-list."""
    modules = _python(_LOADED_MODULES)
    assert {"fairseq.checkpoint_utils", "fairseq.trainer", "fairseq.distributed.utils"} <= set(modules)
    result = _python(_FAIRSEQ_SNAPSHOT, json.dumps(modules))
    assert result["compared"] > 10000  # the snapshot did look at fairseq's modules
    assert result["changed"] == []
    assert result["same"] == [True, True, True]
    assert result["safe_added"] == len(compat.CHECKPOINT_TYPES)


def _fairseq_like_checkpoint(path):
    # what every fairseq checkpoint holds next to its weights: a pickled configuration
    torch.save({"args": argparse.Namespace(arch="hrt_tiny"), "model": {"w": torch.ones(2)}, "cfg": None}, path)


def test_safe_loading_stays_on_and_reads_fairseq_checkpoints(tmp_path):
    """torch.load keeps ``weights_only=True`` as its default; with the types registered a
    fairseq-like checkpoint loads, and a pickle naming any other type is still refused."""
    path = tmp_path / "ckpt.pt"
    _fairseq_like_checkpoint(path)
    compat.register_checkpoint_types()
    state = torch.load(path, map_location="cpu")
    assert state["args"].arch == "hrt_tiny" and torch.equal(state["model"]["w"], torch.ones(2))
    torch.save({"model": {}, "other": argparse.ArgumentParser}, tmp_path / "other.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "other.pt")
    assert compat.unsafe_types(str(tmp_path / "other.pt")) == ["argparse.ArgumentParser"]
    with pytest.raises(compat.UnsafeCheckpoint, match=r"^--path .*other\.pt was not loaded: its pickle names "):
        compat.refuse_unsafe_checkpoint([str(tmp_path / "other.pt")], "--path")


def test_registering_twice_adds_nothing():
    compat.register_checkpoint_types()
    before = list(torch.serialization.get_safe_globals())
    compat.register_checkpoint_types()
    assert torch.serialization.get_safe_globals() == before


_USER_DIR_IMPORT = """
import argparse, json, sys
from fairseq.utils import import_user_module
from fairseq.tasks import TASK_REGISTRY
try:
    import_user_module(argparse.Namespace(user_dir=sys.argv[1]))
    print(json.dumps({"task": "hrt_translation" in TASK_REGISTRY, "name": sys.modules["fairseq_hrt"].__name__}))
except ImportError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.parametrize("how", ["from the repository root", "the installed package's path", "a renamed folder"])
def test_user_dir(tmp_path, how):
    """``--user-dir fairseq_hrt`` from the repository root and the installed package's path load
    the plugin under its own name; a folder of another name (a renamed copy or link) would load it
    under that name, registering every component twice: refused in one line that says what to pass."""
    installed = _python("import fairseq_hrt, json, os; print(json.dumps(os.path.dirname(fairseq_hrt.__file__)))")
    if how == "from the repository root":
        result = _python(_USER_DIR_IMPORT, "fairseq_hrt", cwd=REPO)
    elif how == "the installed package's path":
        result = _python(_USER_DIR_IMPORT, installed, cwd=tmp_path)
    else:
        os.symlink(installed, tmp_path / "hrt_plugin")
        result = _python(_USER_DIR_IMPORT, str(tmp_path / "hrt_plugin"), cwd=tmp_path)
        assert result["error"].startswith(f"--user-dir {tmp_path / 'hrt_plugin'} was imported as 'hrt_plugin':")
        assert "must be named fairseq_hrt" in result["error"]
        return
    assert result == {"task": True, "name": "fairseq_hrt"}


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
