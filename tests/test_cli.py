"""End-to-end: the plugin through fairseq's own command lines, in the style of fairseq's
tests/test_binaries.py: fairseq-train -> fairseq-generate -> fairseq-interactive on tiny data."""

import os
import re
import subprocess
import sys

import pytest

import fairseq_hrt
from fairseq_hrt.generation.engines import ENGINES
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES
from fairseq_hrt.hub import HRTHubInterface
from fairseq_hrt.symbols import find_sentencepiece_model
from fairseq_hrt.testing.tiny_runs import REPO, USER_DIR, make_tiny_data, run_cli, train_args
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


def _unwrapped(help_text: str) -> str:
    """argparse's help with its line wrapping undone."""
    return re.sub(r"\s+", " ", re.sub(r"-\n\s+", "-", help_text))


def test_options_help_lists_the_plugins_options(hrt_trained):
    """fairseq 0.12's ``--help`` acts on the first of its two parses, before the task, arch and
    criterion add their options, and the plugin leaves it so; ``python -m
    fairseq_hrt.options_help`` lists them all: every decoding strategy and engine by name too."""
    data, _ = hrt_trained
    generate = ["generate", data.bin_dir, "--user-dir", USER_DIR, "--task", "hrt_translation", "--help"]
    train = ["train", data.bin_dir, "--user-dir", USER_DIR, "--task", "hrt_translation", "--arch", "hrt_tiny"]
    train += ["--criterion", "hrt_loss"]

    def run(module, cmd):
        args = [sys.executable, "-m", module, *map(str, cmd if module == "fairseq_hrt.options_help" else cmd[1:])]
        return subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True).stdout

    gen_help, train_help = (_unwrapped(run("fairseq_hrt.options_help", cmd)) for cmd in (generate, train))
    for option in ("--decoding", "--decoder-engine", "--decode-chunk-size", "--b-nat", "--shortlist", "--onnx-model"):
        assert f" {option} " in gen_help, option
    assert all(f"'{name}'" in gen_help for name in DECODING_STRATEGIES), gen_help
    assert all(f"'{name}'" in gen_help for name in ENGINES), gen_help
    for option in ("--chunk-sizes", "--kind-weights", "--decoder-rpr-window", "--label-smoothing"):
        assert f" {option} " in train_help, option
    stock_help = _unwrapped(run("fairseq_cli.generate", generate))  # fairseq's own, first parse
    assert " --decoding " not in stock_help and " --beam " in stock_help


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
        ["--decode-chunk-size", "by-length"],
    ],
)
def test_generate(hrt_trained, decode):
    data, ckpt = hrt_trained
    # --batch-size 3: 40 sentences leave a last batch of 1, which stock fairseq 0.12 drops
    # (not a multiple of --required-batch-size-multiple 8; see the task's get_batch_iterator)
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
            "sacrebleu_signature",
            *GEN,
            *decode,
        ]
    ).stdout
    hyps = hyp_lines(out)
    assert sorted(hyps) == list(range(40))  # one H line per sentence
    assert len(re.findall(r"^D-\d+\t", out, re.M)) == 40
    assert len(re.findall(r"^P-\d+\t", out, re.M)) == 40
    assert "<mask>" not in out and "<s2>" not in out
    # sacreBLEU's line with its signature (the plugin's scorer)
    assert re.search(
        r"Generate valid with beam=\d+: BLEU\|nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:", out
    )
    if decode[1] == "by-length":  # the rule as the log names it, not an object's address
        assert "HRT decoding: chunk size by-length (1 for sources under 8 tokens, else 2)," in out
        assert " object at 0x" not in out


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
    # the 300-token line was cut at --max-source-positions, the warning naming it
    assert "input line 3: a sentence of 301 tokens is truncated to the model's 64 source positions" in out
    assert "<unk>" in out  # unknown words map to <unk> in the source echo


def test_generate_truncates_long_sources_as_interactive_does(hrt_trained):
    """``fairseq-generate --max-source-positions 6`` cuts the longer test sources (five tokens
    and </s>) with a warning, as fairseq-interactive does, instead of stopping on the first
    one; both then give the same translations."""
    data, ckpt = hrt_trained
    sources = data.raw("valid", "en").read_text().splitlines()
    long = sum(len(line.split()) + 1 > 6 for line in sources)
    assert long > 0
    flags = ["--max-source-positions", "6", "--beam", "1", "--decode-chunk-size", "2", *GEN]
    out = run_cli(
        ["generate", data.bin_dir, "--path", ckpt, "--gen-subset", "valid", "--batch-size", "8", *flags]
    ).stdout
    assert f"valid: {long} source sentence(s) longer than --max-source-positions 6 tokens were truncated" in out
    echoed = {int(m[0]): m[1] for m in re.findall(r"^S-(\d+)\t(.*)$", out, re.M)}
    assert sorted(echoed) == list(range(len(sources)))
    assert all(len(echoed[i].split()) == min(len(line.split()), 5) for i, line in enumerate(sources))
    interactive = run_cli(
        ["interactive", data.bin_dir, "--path", ckpt, "--buffer-size", "8", "--batch-size", "8", *flags],
        input="\n".join(sources) + "\n",
    ).stdout
    warned = re.findall(r"input line (\d+): a sentence of \d+ tokens is truncated to the model's 6 source", interactive)
    assert len(warned) == long  # one warning per line, naming it
    assert hyp_lines(out) == hyp_lines(interactive)


def _refusal(proc) -> str:
    """The one line of a refused command (exit status 1, no traceback)."""
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return lines[0]


def test_a_refused_option_is_one_line_with_its_reason(hrt_trained, tmp_path):
    """An option combination the plugin refuses ends fairseq-generate, fairseq-interactive and
    fairseq-train with one line ``PROG: error: REASON`` and exit status 1, as argparse ends a
    bad option, not with a traceback."""
    data, ckpt = hrt_trained
    reason = "--decode-chunk-size 4: this model was trained for chunk sizes [2, 3]; use one of them, or 1 for AT mode"
    generate = run_cli(
        ["generate", data.bin_dir, "--path", ckpt, "--gen-subset", "valid", "--decode-chunk-size", "4", *GEN],
        check=False,
    )
    assert _refusal(generate).endswith(": error: " + reason)
    interactive = run_cli(
        ["interactive", data.bin_dir, "--path", ckpt, "--decode-chunk-size", "4", *GEN], input="a b\n", check=False
    )
    assert _refusal(interactive).endswith(": error: " + reason)
    train = run_cli(train_args(data.bin_dir, tmp_path / "ckpt", "--p-raw", "2", max_update=1), check=False)
    assert _refusal(train).endswith(": error: --p-raw must be in [0, 1], got 2.0")
    ssru = run_cli(train_args(data.bin_dir, tmp_path / "ckpt", arch="at_tiny_ssru", max_update=1), check=False)
    assert "an SSRU decoder is a left-to-right recurrence" in _refusal(ssru)


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
    with pytest.raises(TypeError, match="'chunk_sise' \\(did you mean 'chunk_size'\\?\\)"):
        hub.translate(lines, beam=1, chunk_sise=1)  # a misspelled option is refused, not ignored
    with pytest.raises(TypeError, match="'jacobi_blok_size'"):
        hub.translate(lines, jacobi_blok_size=4)
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
