"""Tests for fairseq_hrt.scoring: sacreBLEU wrapper, speed unit, and COMET from local files.

The COMET tests build a tiny randomly initialised COMET model offline (tests/comet_tiny.py)
and run the real load + predict path on it; its scores are meaningless.
"""

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for comet_tiny

import pickle  # noqa: E402

import sacrebleu  # noqa: E402
import torch  # noqa: E402
from comet_tiny import build_tiny_comet  # noqa: E402

from fairseq_hrt.scoring import comet as comet_mod  # noqa: E402
from fairseq_hrt.scoring.comet import (  # noqa: E402
    CometUnavailable,
    cli_main,
    comet_score,
    resolve_comet_model,
)
from fairseq_hrt.scoring.metrics import (  # noqa: E402
    mean_paired_bleu_difference,
    paired_bleu_difference,
    sacrebleu_score,
    source_words,
)

REPO = Path(__file__).resolve().parents[1]

SRCS = ["Die Katze saß auf der Matte.", "Hallo Welt, wie geht es dir?", "Guten Morgen."]
HYPS = ["The cat sat on the mat.", "Hello world, how are you?", "Good evening."]
REFS = ["The cat sat on the mat.", "Hello world, how are you doing?", "Good morning."]


@pytest.fixture(autouse=True)
def _no_comet_env(monkeypatch):
    monkeypatch.delenv("COMET_MODEL", raising=False)
    monkeypatch.delenv("COMET_ENCODER", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------- sacreBLEU


def test_sacrebleu_identical_is_100_with_signature():
    out = sacrebleu_score(REFS, REFS)
    assert out["score"] == pytest.approx(100.0)
    assert out["bp"] == pytest.approx(1.0)
    assert out["precisions"] == pytest.approx([100.0] * 4)
    sig = out["signature"]
    for field in ("nrefs:1", "case:mixed", "tok:13a", "smooth:exp", "version:"):
        assert field in sig, sig
    assert out["n"] == 3
    assert out["bleu"].startswith("BLEU = 100.00")


def test_sacrebleu_matches_sacrebleu_and_known_properties():
    out = sacrebleu_score(HYPS, REFS)
    direct = sacrebleu.corpus_bleu(HYPS, [REFS])
    assert out["score"] == pytest.approx(direct.score)
    assert 0.0 < out["score"] < 100.0
    assert out["sys_len"] == direct.sys_len and out["ref_len"] == direct.ref_len
    # hypothesis shorter than reference -> brevity penalty < 1
    assert out["sys_len"] < out["ref_len"] and out["bp"] < 1.0
    # no shared n-gram at all -> 0
    assert sacrebleu_score(["xyz qqq"], ["The cat sat on the mat."])["score"] == 0.0
    # tokenizer choice shows up in the signature
    assert "tok:none" in sacrebleu_score(HYPS, REFS, tokenize="none")["signature"]


def test_sacrebleu_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(3\).*\(2\)"):
        sacrebleu_score(HYPS, REFS[:2])
    with pytest.raises(ValueError, match="empty"):
        sacrebleu_score([], [])
    with pytest.raises(TypeError):
        sacrebleu_score("a b c", "a b c")


def _corpus(n=200, seed=0):
    """``n`` reference sentences of 8-15 words from a small vocabulary (reproducible)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 15))) for _ in range(n)]


def _drop_words(refs, rate, seed):
    rng = random.Random(seed)
    return [" ".join(w for w in r.split() if rng.random() > rate) or "w0" for r in refs]


def test_paired_bleu_difference_is_the_corpus_difference_with_a_reproducible_interval():
    refs = _corpus()
    a, b = _drop_words(refs, 0.1, 1), _drop_words(refs, 0.2, 2)
    out = paired_bleu_difference(a, b, refs, samples=300)
    assert out["difference"] == pytest.approx(sacrebleu_score(a, refs)["score"] - sacrebleu_score(b, refs)["score"])
    low, high = out["ci95"]
    assert low < out["difference"] < high and low > 0  # a clearly better system
    assert out["signature"] == sacrebleu_score(a, refs)["signature"]
    assert paired_bleu_difference(a, b, refs, samples=300) == out  # the seed fixes the resamples
    # the same resamples for both systems: swapping them negates every resampled difference
    swapped = paired_bleu_difference(b, a, refs, samples=300)
    assert swapped["difference"] == pytest.approx(-out["difference"])
    assert swapped["ci95"] == pytest.approx([-high, -low])
    # identical outputs: no difference in any resample
    assert paired_bleu_difference(a, list(a), refs, samples=50)["ci95"] == [0.0, 0.0]


def test_paired_bleu_difference_resamples_both_systems_together():
    """Two systems that differ by one word in one sentence of 200: the paired interval is as
    narrow as that word makes it, not as wide as the test set's own spread."""
    refs = _corpus()
    a = _drop_words(refs, 0.15, 3)
    b = list(a)
    b[0] = " ".join(a[0].split()[:-1])  # one word fewer
    low, high = paired_bleu_difference(a, b, refs, samples=300)["ci95"]
    assert 0 <= low <= high < 0.5
    spread = paired_bleu_difference(a, refs, refs, samples=300)["ci95"]
    assert spread[1] - spread[0] > 10 * (high - low)


def test_mean_paired_bleu_difference_resamples_every_pair_with_the_same_sentences():
    """A seed mean: the mean of each pair's difference, its interval from one set of resamples
    shared by every system of every pair."""
    refs = _corpus()
    a, b, c = _drop_words(refs, 0.1, 1), _drop_words(refs, 0.2, 2), _drop_words(refs, 0.15, 4)
    one = paired_bleu_difference(a, b, refs, samples=200)
    other = paired_bleu_difference(c, b, refs, samples=200)
    both = mean_paired_bleu_difference([(a, b), (c, b)], refs, samples=200)
    assert both["difference"] == pytest.approx((one["difference"] + other["difference"]) / 2)
    assert both["pairs"] == 2 and both["ci95"][0] < both["difference"] < both["ci95"][1]
    # the same pair twice is that pair: the resamples are shared, not drawn per pair
    twice = mean_paired_bleu_difference([(a, b), (a, b)], refs, samples=200)
    assert twice["difference"] == pytest.approx(one["difference"]) and twice["ci95"] == pytest.approx(one["ci95"])
    # a pair and its mirror cancel in every resample
    assert mean_paired_bleu_difference([(a, b), (b, a)], refs, samples=200)["ci95"] == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="no pair"):
        mean_paired_bleu_difference([], refs)


def test_paired_bleu_difference_rejects_bad_input():
    refs = _corpus(20)
    with pytest.raises(ValueError, match="baseline hypotheses"):
        paired_bleu_difference(refs, refs[:19], refs)
    with pytest.raises(ValueError, match=r"\(20\).*\(19\)"):
        paired_bleu_difference(refs, refs, refs[:19])
    with pytest.raises(ValueError, match="samples must be positive"):
        paired_bleu_difference(refs, refs, refs, samples=0)


def test_source_words():
    assert source_words(["a b  c", "", "  d\te\n"]) == 5
    assert source_words([]) == 0
    assert source_words(SRCS) == sum(len(s.split()) for s in SRCS)


# --------------------------------------------------------------------------- COMET: unavailable


def test_comet_unavailable_without_model():
    with pytest.raises(CometUnavailable) as exc:
        resolve_comet_model(None)
    msg = str(exc.value)
    assert msg.startswith("no local model")
    assert "COMET_MODEL" in msg and "--model" in msg
    assert "cannot be downloaded" in msg
    assert "wmt22-comet-da" in msg and "checkpoints/model.ckpt" in msg
    with pytest.raises(CometUnavailable):
        comet_score(SRCS, HYPS, REFS)


def test_comet_unavailable_bad_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("COMET_MODEL", str(tmp_path / "nope"))
    with pytest.raises(CometUnavailable, match=r"does not exist.*\$COMET_MODEL|\$COMET_MODEL.*does not exist"):
        resolve_comet_model()
    monkeypatch.delenv("COMET_MODEL")
    with pytest.raises(CometUnavailable, match="no checkpoints/model.ckpt"):
        resolve_comet_model(str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    ptr = tmp_path / "checkpoints" / "model.ckpt"
    ptr.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 2277\n")
    (tmp_path / "hparams.yaml").write_text("class_identifier: regression_metric\n")
    with pytest.raises(CometUnavailable, match="Git LFS pointer"):
        resolve_comet_model(str(tmp_path))


def test_comet_cli_exits_2_without_model(tmp_path, capsys):
    files = {}
    for name, lines in (("src", SRCS), ("hyp", HYPS), ("ref", REFS)):
        files[name] = tmp_path / name
        files[name].write_text("\n".join(lines) + "\n")
    argv = ["--src", str(files["src"]), "--hyp", str(files["hyp"]), "--ref", str(files["ref"])]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "COMET: not available (no local model" in err

    assert cli_main(argv + ["--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["score"] is None and out["available"] is False

    # as a module, in a fresh interpreter (the console script calls the same cli_main)
    env = {k: v for k, v in os.environ.items() if k not in ("COMET_MODEL", "COMET_ENCODER")}
    proc = subprocess.run(
        [sys.executable, "-m", "fairseq_hrt.scoring.comet"] + argv,
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "COMET: not available (no local model" in proc.stderr
    # the lazy import really is lazy: failing early must not have imported unbabel-comet
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, fairseq_hrt.scoring; print('comet' in sys.modules)"],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip().splitlines()[-1] == "False", probe.stderr


# --------------------------------------------------------------------------- COMET: real plumbing


@pytest.fixture(scope="module")
def tiny_comet(tmp_path_factory):
    """A tiny self-contained COMET model (encoder files in <model dir>/encoder) -> (root, ckpt)."""
    pytest.importorskip("comet")

    root = tmp_path_factory.mktemp("tiny_comet")
    ckpt = build_tiny_comet(root)
    yield root, ckpt
    comet_mod._MODEL_CACHE.clear()


def test_comet_score_tiny_model(tiny_comet):
    root, ckpt = tiny_comet
    comet_mod._MODEL_CACHE.clear()
    out = comet_score(SRCS, HYPS, REFS, model_path=str(root / "model"), batch_size=2)
    assert out["n"] == 3 and len(out["scores"]) == 3
    assert all(isinstance(s, float) and math.isfinite(s) for s in out["scores"])
    assert out["score"] == pytest.approx(sum(out["scores"]) / 3, abs=1e-12)
    assert out["model"] == str(Path(ckpt).resolve())
    assert out["encoder"] == str((root / "model" / "encoder").resolve())
    # segment scores are in input order (COMET sorts by length internally): scoring one
    # segment alone gives the same value as its position in the batch
    single = comet_score(SRCS[1:2], HYPS[1:2], REFS[1:2], model_path=str(ckpt))
    assert single["scores"][0] == pytest.approx(out["scores"][1], abs=1e-5)

    # deterministic, also after reloading from disk (dropout is off in eval mode)
    comet_mod._MODEL_CACHE.clear()
    again = comet_score(SRCS, HYPS, REFS, model_path=str(ckpt), batch_size=2)
    assert again["scores"] == pytest.approx(out["scores"], abs=1e-6)
    assert again["score"] == pytest.approx(out["score"], abs=1e-6)


def test_comet_checkpoint_needs_weights_only_false(tiny_comet):
    """The checkpoint (like real Lightning ones) is refused by torch.load's default;
    comet_score loads it anyway (weights_only=False for this trusted local file) and does
    not change the global torch.load default."""
    _, ckpt = tiny_comet
    with pytest.raises(pickle.UnpicklingError):
        torch.load(str(ckpt), map_location="cpu")
    comet_mod._MODEL_CACHE.clear()
    assert comet_score(SRCS[:1], HYPS[:1], REFS[:1], model_path=str(ckpt))["n"] == 1
    with pytest.raises(pickle.UnpicklingError):
        torch.load(str(ckpt), map_location="cpu")


def test_comet_env_var_and_cli(tiny_comet, tmp_path, monkeypatch, capsys):
    root, ckpt = tiny_comet
    monkeypatch.setenv("COMET_MODEL", str(root / "model"))
    assert resolve_comet_model() == str(Path(ckpt).resolve())
    expected = comet_score(SRCS, HYPS, REFS)

    paths = []
    for name, lines in (("src", SRCS), ("hyp", HYPS), ("ref", REFS)):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        paths += ["--" + name, str(tmp_path / name)]
    assert cli_main(paths + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["available"] is True
    assert out["scores"] == pytest.approx(expected["scores"], abs=1e-6)

    monkeypatch.delenv("COMET_MODEL")
    assert cli_main(paths + ["--model", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith(f"COMET = {expected['score']:.4f}")


def test_comet_hub_named_encoder_needs_local_files(tiny_comet, tmp_path, monkeypatch):
    """Like wmt22-comet-da (hparams: pretrained_model: xlm-roberta-large): the encoder's
    config + tokenizer must be given locally; without them COMET is unavailable, offline."""
    root, _ = tiny_comet
    enc = root / "encoder"
    ckpt = build_tiny_comet(tmp_path / "hub", encoder_dir=enc, bundle_encoder=False)
    comet_mod._MODEL_CACHE.clear()
    with pytest.raises(CometUnavailable, match="encoder files missing.*tiny-xlmr-not-on-disk"):
        comet_score(SRCS, HYPS, REFS, model_path=str(ckpt))

    a = comet_score(SRCS, HYPS, REFS, model_path=str(ckpt), encoder_path=str(enc))
    assert a["encoder"] == str(enc.resolve()) and len(a["scores"]) == 3

    monkeypatch.setenv("COMET_ENCODER", str(tmp_path / "missing"))
    with pytest.raises(CometUnavailable, match=r"encoder files missing.*\$COMET_ENCODER"):
        comet_score(SRCS, HYPS, REFS, model_path=str(ckpt))
    monkeypatch.setenv("COMET_ENCODER", str(enc))
    assert comet_score(SRCS, HYPS, REFS, model_path=str(ckpt))["scores"] == a["scores"]
    monkeypatch.delenv("COMET_ENCODER")

    # self-contained model dir: encoder files in <model dir>/encoder/
    shutil.copytree(enc, tmp_path / "hub" / "model" / "encoder")
    b = comet_score(SRCS, HYPS, REFS, model_path=str(tmp_path / "hub" / "model"))
    assert b["encoder"] == str((tmp_path / "hub" / "model" / "encoder").resolve())
    assert b["scores"] == pytest.approx(a["scores"], abs=1e-6)


def test_comet_refuses_checkpoint_with_missing_weights(tiny_comet, tmp_path):
    """COMET loads with strict=False; a checkpoint lacking weights must not be scored with
    randomly initialised layers."""
    root, ckpt = tiny_comet
    broken = tmp_path / "broken"
    shutil.copytree(root / "model", broken)
    state = torch.load(str(ckpt), map_location="cpu", weights_only=False)
    dropped = [k for k in state["state_dict"] if k.startswith("estimator.")]
    for k in dropped:
        del state["state_dict"][k]
    torch.save(state, str(broken / "checkpoints" / "model.ckpt"))
    comet_mod._MODEL_CACHE.clear()
    with pytest.raises(RuntimeError, match="weights missing"):
        comet_score(SRCS, HYPS, REFS, model_path=str(broken))


def test_comet_score_input_checks(tiny_comet):
    _, ckpt = tiny_comet
    with pytest.raises(ValueError, match="aligned"):
        comet_score(SRCS, HYPS[:2], REFS, model_path=str(ckpt))
    with pytest.raises(ValueError, match="empty"):
        comet_score([], [], [], model_path=str(ckpt))
    with pytest.raises(ValueError, match="gpus"):
        comet_score(SRCS, HYPS, REFS, model_path=str(ckpt), gpus=2)
    with pytest.raises(ValueError, match="needs references"):
        comet_score(SRCS, HYPS, None, model_path=str(ckpt))
