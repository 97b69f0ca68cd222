"""End-to-end: the plugin through fairseq's own command lines, in the style of fairseq's
tests/test_binaries.py: fairseq-train -> fairseq-generate -> fairseq-interactive on tiny data."""

import os
import re
import subprocess
import sys

import pytest

import fairseq_hrt
from benchmarks.tiny_runs import REPO, USER_DIR, make_tiny_data, run_cli
from fairseq_hrt.hub import HRTHubInterface
from fairseq_hrt.symbols import find_sentencepiece_model
from tests.tiny_data import hyp_lines

GEN = ["--user-dir", USER_DIR, "--task", "hrt_translation", "--source-lang", "en", "--target-lang", "de", "--cpu"]


@pytest.fixture(scope="module")
def hrt_trained(trained):
    """conftest's session-wide tiny HRT model (k = 2, 3, 40 updates) and its data."""
    data, ckpts = trained
    return data, ckpts["hrt_tiny"]


def test_plugin_loads_from_repo_path_and_installed_path():
    installed = os.path.dirname(fairseq_hrt.__file__)
    for user_dir in (os.path.join(REPO, "fairseq_hrt"), installed, "fairseq_hrt"):
        out = subprocess.run(
            [sys.executable, "-m", "fairseq_cli.train", "--user-dir", user_dir, "--task", "hrt_translation", "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "hrt_loss" in out  # fairseq's --help lists registered criterions only


def test_importing_twice_registers_once():
    code = (
        "import importlib, fairseq_hrt; from fairseq.utils import import_user_module; "
        "from argparse import Namespace; import_user_module(Namespace(user_dir='fairseq_hrt')); "
        "import_user_module(Namespace(user_dir='fairseq_hrt')); importlib.import_module('fairseq_hrt.tasks'); "
        "from fairseq.tasks import TASK_REGISTRY; from fairseq.models import ARCH_MODEL_REGISTRY as A; "
        "print('hrt_translation' in TASK_REGISTRY and {'hrt_e6d1', 'hrt_e12d1', 'hrt_e20d1', 'at_e12d1'} <= set(A))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("True")


@pytest.mark.parametrize(
    "decode",
    [
        ["--decode-chunk-size", "2"],
        ["--decode-chunk-size", "3", "--beam", "3", "--b-nat", "2"],
        ["--decode-chunk-size", "1"],
    ],
)
def test_generate(hrt_trained, decode):
    data, ckpt = hrt_trained
    # --batch-size 3: 40 sentences leave a last batch of 1, which stock fairseq 0.12 drops
    # (not a multiple of --required-batch-size-multiple 8; see compat.py)
    out = run_cli(
        [
            "generate",
            data.bin_dir,
            "--path",
            ckpt,
            "--gen-subset",
            "valid",
            "--batch-size",
            "3",
            "--beam",
            "1",
            "--scoring",
            "sacrebleu",
            *GEN,
            *decode,
        ]
    ).stdout
    hyps = hyp_lines(out)
    assert sorted(hyps) == list(range(40))  # one H line per sentence
    assert len(re.findall(r"^D-\d+\t", out, re.M)) == 40
    assert len(re.findall(r"^P-\d+\t", out, re.M)) == 40
    assert "<mask>" not in out and "<s2>" not in out
    assert re.search(r"Generate valid with beam=\d+: BLEU = ", out)  # sacrebleu scorer line


def test_interactive_empty_long_and_unknown_input(hrt_trained):
    data, ckpt = hrt_trained
    long_line = " ".join(["the"] * 300)
    lines = ["a man rides a horse .", "", long_line, "zzzunknownword qqqq", "", "two dogs play ."]
    out = run_cli(
        [
            "interactive",
            data.bin_dir,
            "--path",
            ckpt,
            "--buffer-size",
            "4",
            "--batch-size",
            "4",
            "--beam",
            "2",
            "--max-source-positions",
            "64",
            "--decode-chunk-size",
            "2",
            *GEN,
        ],
        input="\n".join(lines) + "\n",
    ).stdout
    hyps = hyp_lines(out)
    assert sorted(hyps) == list(range(len(lines)))  # every input line gets an output line, in order
    assert hyps[1] == "" and hyps[4] == ""  # empty input -> empty translation
    assert "truncated" in out  # the 300-token line was cut at --max-source-positions
    assert "<unk>" in out  # unknown words map to <unk> in the source echo


def test_checkpoint_from_another_dictionary_is_refused(hrt_trained, tmp_path):
    data, ckpt = hrt_trained
    # a synthetic corpus of another vocabulary size: another dictionary whichever corpus the
    # checkpoint was trained on (Multi30k when ../shared/data has it, synthetic otherwise)
    other = make_tiny_data(tmp_path / "other", n_train=60, n_valid=10, prefer="synthetic", seed=7, vocab=31)
    proc = run_cli(["generate", other.bin_dir, "--path", ckpt, "--gen-subset", "valid", *GEN], check=False)
    assert proc.returncode != 0
    assert "another dictionary" in proc.stdout


# ------------------------------------------------------------------ Python API (hub)


def _interactive(data, ckpt, lines, *decode):
    proc = run_cli(
        ["interactive", data.bin_dir, "--path", ckpt, "--buffer-size", "8", "--batch-size", "8", *GEN, *decode],
        input="\n".join(lines) + "\n",
    )
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("D-"):
            i, _, text = line[2:].split("\t", 2)
            out[int(i)] = text
    return [out[i] for i in range(len(lines))]


def test_python_api_translates_as_fairseq_interactive(hrt_trained):
    """``fairseq_hrt.from_pretrained(...).translate(...)`` gives fairseq-interactive's
    translations for the same options, empty and over-long lines included, and leaves the
    loaded options as they were after each call."""
    data, ckpt = hrt_trained
    lines = [
        "a man rides a horse .",
        "",
        " ".join(["the"] * 300),
        "two dogs play in the snow .",
        "zzzunknownword qqqq",
        "a woman sings .",
    ]
    hub = fairseq_hrt.from_pretrained(
        str(ckpt.parent), checkpoint_file=ckpt.name, data_name_or_path=str(data.bin_dir), max_source_positions=64
    )
    for kwargs, flags in (
        ({"chunk_size": 2, "beam": 1}, ["--decode-chunk-size", "2", "--beam", "1"]),
        (
            {"chunk_size": 3, "beam": 3, "b_nat": 2, "batch_size": 2},
            ["--decode-chunk-size", "3", "--beam", "3", "--b-nat", "2"],
        ),
        ({"chunk_size": 1, "beam": 2}, ["--decode-chunk-size", "1", "--beam", "2"]),
    ):
        got = hub.translate(lines, **kwargs)
        assert got == _interactive(data, ckpt, lines, "--max-source-positions", "64", *flags), kwargs
        assert got[1] == "" and len(got) == len(lines)
        assert hub.task.cfg.decode_chunk_size == "auto-trained" and hub.task.cfg.b_nat == 1
        assert hub.cfg.dataset.batch_size is None
    assert hub.translate(lines[0], chunk_size=2) == hub.translate(lines, chunk_size=2)[0]  # one string in, one out
    with pytest.raises(ValueError, match="trained for chunk sizes"):
        hub.translate(lines, chunk_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        hub.translate(lines, batch_size=0)
    with pytest.raises(FileNotFoundError, match="data_name_or_path"):
        fairseq_hrt.from_pretrained(str(ckpt.parent), checkpoint_file=ckpt.name)


def test_python_api_builds_a_generator_once_per_options(hrt_trained, monkeypatch):
    """fairseq's hub builds a generator on every call; this one builds one per options (an
    engine's set-up, e.g. onnxruntime's sessions, is paid once), and the same options give the
    same translations from it."""
    data, ckpt = hrt_trained
    hub = fairseq_hrt.from_pretrained(str(ckpt.parent), checkpoint_file=ckpt.name, data_name_or_path=str(data.bin_dir))
    built = []
    build = hub.task.build_generator
    monkeypatch.setattr(hub.task, "build_generator", lambda *a, **k: built.append(a[1].beam) or build(*a, **k))
    lines = ["a man rides a horse .", "two dogs play in the snow .", "a woman sings ."]
    first = [hub.translate(line, chunk_size=2) for line in lines]
    assert built == [1]
    assert hub.translate(lines, chunk_size=2, beam=2, batch_size=1)
    assert built == [1, 2]
    assert [hub.translate(line, chunk_size=2) for line in lines] == first
    assert hub.translate(lines, chunk_size=2) == first and built == [1, 2]


def test_python_api_says_what_it_expects(tmp_path):
    """A missing model folder or checkpoint, and input that is not text, get errors that say
    what was expected (not fairseq's TypeError about None)."""
    with pytest.raises(FileNotFoundError, match=r"no/such/dir.*does not exist.*checkpoint_last\.pt"):
        fairseq_hrt.from_pretrained("no/such/dir", data_name_or_path=str(tmp_path))
    (tmp_path / "checkpoint_best.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file checkpoint_last\.pt.*checkpoint_best\.pt"):
        fairseq_hrt.from_pretrained(str(tmp_path))
    with pytest.raises(TypeError, match="folder path"):
        fairseq_hrt.from_pretrained(None)
    hub = object.__new__(HRTHubInterface)  # the input is checked before the model is used
    for bad, what in ((None, "NoneType"), (3, "int"), (["a b", None], "item 1")):
        with pytest.raises(TypeError, match=f"a string or a list of strings.*{what}"):
            hub.translate(bad)


def test_sentencepiece_model_found_beside_the_data(tmp_path):
    (tmp_path / "data-bin").mkdir()
    (tmp_path / "ckpt").mkdir()
    assert find_sentencepiece_model(str(tmp_path / "data-bin"), str(tmp_path / "ckpt")) is None
    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "spm.model").write_bytes(b"x")  # prepare.sh's layout: DATA/data-bin, DATA/spm
    assert find_sentencepiece_model(str(tmp_path / "data-bin"), str(tmp_path / "ckpt")) == str(
        tmp_path / "spm" / "spm.model"
    )
    (tmp_path / "ckpt" / "sentencepiece.bpe.model").write_bytes(b"x")
    assert find_sentencepiece_model(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "sentencepiece.bpe.model")
