"""Deploying without PyTorch: ``fairseq-hrt-export`` and :mod:`hrt_runtime` (issue 24).

* raw text through ``hrt_runtime.Translator`` gives the strings fairseq gives (the hub and
  ``fairseq-interactive``, lean engine) for tiny AT and HRT models trained on SentencePiece data;
* ``hrt-translate`` in a fresh virtual environment with onnxruntime, numpy and sentencepiece
  only (no torch, no fairseq) gives the in-process Translator's output;
* clear errors for a wrong folder and wrong options, and the exporter's refusals.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

import fairseq_hrt  # noqa: E402
from fairseq_hrt.export.exporter import (
    cli_main,  # noqa: E402
    export_model,  # noqa: E402
    quantize_folder,  # noqa: E402
)
from fairseq_hrt.export.folder import temporary_folder  # noqa: E402
from fairseq_hrt.generation.onnx_engine import _cached  # noqa: E402
from fairseq_hrt.generation.quantize import quantize_int8  # noqa: E402
from fairseq_hrt.testing.tiny_runs import (  # noqa: E402
    REPO,
    USER_DIR,
    cli_env,
    make_tiny_spm_data,
    read_lines,
    run_cli,
    run_cli_many,
    train_args,
)
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.integrity import DamagedFolderError, sha256_of  # noqa: E402
from hrt_runtime.model import DECLARED_KEY, READABLE_VERSIONS, VERSION  # noqa: E402
from tests.hrt_fixtures import (
    build_task_and_model,  # noqa: E402
    random_tiny_models,  # noqa: E402
)
from tests.tiny_data import hyp_lines  # noqa: E402

MAX_LEN_B = 30


# ------------------------------------------------------------------ trained SentencePiece models


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """Tiny AT and HRT (k = 2, 3) models trained 150 updates (40 leave them at empty outputs) on
    SentencePiece data, each exported
    with the ``fairseq-hrt-export`` command line. ``(data, spm model, {arch: (checkpoint,
    exported folder, export log)})``."""
    root = tmp_path_factory.mktemp("deploy")
    data = make_tiny_spm_data(root)
    runs = {"at_tiny": ("--hrt-mode", "at"), "hrt_tiny": ("--chunk-sizes", "2,3"), "cmlm_tiny": ("--hrt-mode", "cmlm")}
    run_cli_many(
        [train_args(data.bin_dir, root / arch, *extra, arch=arch, max_update=150) for arch, extra in runs.items()],
        root / "train-logs",
    )
    models = {}
    for arch in runs:
        ckpt, folder = root / arch / "checkpoint_last.pt", root / f"{arch}-onnx"
        log = run_cli(
            ["fairseq_hrt.export.exporter", ckpt, folder]
        ).stdout  # the SentencePiece model is found beside the data
        models[arch] = (ckpt, folder, log)
    return data, root / "spm" / "spm.model", models


def raw_lines(data, translator):
    """Validation sentences, an empty line, a line of spaces, unknown characters and a line
    longer than the model's source positions."""
    lines = read_lines(data.raw("valid", "en"))[:8]
    long_line = lines[0]
    while len(translator.spm.encode(long_line)) <= translator.max_source_tokens:
        long_line += " " + lines[0]
    assert translator.encode(long_line).size == translator.max_source_tokens  # truncated
    return [lines[0], "", lines[1], "    ", long_line, "東京 Zürich ½ 👨‍👩‍👧", *lines[2:]]


CASES = [
    ("at_tiny", dict(beam=1)),
    ("at_tiny", dict(beam=5)),
    ("hrt_tiny", dict(chunk_size=2, beam=1)),
    ("hrt_tiny", dict(chunk_size=1, beam=1)),
    ("hrt_tiny", dict(chunk_size=1, beam=5)),
    ("hrt_tiny", dict(chunk_size=3, beam=3, b_nat=2)),
    ("hrt_tiny", dict(beam=2)),  # the default chunk size: the smallest trained one on both sides
    ("cmlm_tiny", dict(iterations=4, length_beam=2)),
]

# the Translator's Mask-Predict options under fairseq's names (the hub's keywords)
FAIRSEQ_NAMES = {"iterations": "iter_decode_max_iter", "length_beam": "iter_decode_with_beam"}


@pytest.fixture(scope="module")
def hubs(deployed):
    data, _, models = deployed  # the SentencePiece model is found beside the data, as by the exporter
    return {
        arch: fairseq_hrt.from_pretrained(str(ckpt.parent), data_name_or_path=str(data.bin_dir))
        for arch, (ckpt, _, _) in models.items()
    }


@pytest.mark.slow
def test_export_command_writes_the_folder(deployed):
    _, spm, models = deployed
    for arch, (_, folder, log) in models.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["kind"] == {"hrt_tiny": "hrt", "at_tiny": "at", "cmlm_tiny": "mask-predict"}[arch]
        assert config["sentencepiece_model"] == "sentencepiece.model"
        assert (folder / "sentencepiece.model").read_bytes() == spm.read_bytes()
        left_to_right = {"step", "step_top"} if arch != "cmlm_tiny" else set()
        assert set(config["graphs"]) >= {"encoder"} | left_to_right | ({"parallel"} if arch != "at_tiny" else set())
        assert f"{folder}: {config['kind']} model" in log and "MiB" in log
        assert not [f for f in os.listdir(folder) if f.startswith(".export-")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,options", CASES, ids=lambda v: v if isinstance(v, str) else " ".join(f"{k}={x}" for k, x in v.items())
)
def test_translator_equals_the_hub_on_raw_text(deployed, hubs, arch, options, caplog):
    data, _, models = deployed
    translator = Translator(str(models[arch][1]))
    lines = raw_lines(data, translator)
    ref = hubs[arch].translate(
        lines,
        engine="lean",
        max_len_a=0,
        max_len_b=MAX_LEN_B,
        **{FAIRSEQ_NAMES.get(k, k): v for k, v in options.items()},
    )
    with caplog.at_level(logging.WARNING, logger="hrt_runtime"):
        ours = translator.translate(lines, max_len_a=0, max_len_b=MAX_LEN_B, **options)
    assert len(ours) == len(lines)  # nothing lost, the over-long line included
    assert ours == ref
    assert ours[1] == "" and ours[3] == ""  # empty and blank lines give empty lines
    assert ours[4]  # the over-long line is translated (truncated)
    assert any("truncated" in r.getMessage() for r in caplog.records)
    assert sum(bool(o) for o in ours) >= len(lines) - 2  # the model says something for the rest


@pytest.mark.slow
def test_translator_equals_fairseq_interactive(deployed, tmp_path):
    """The command lines: ``fairseq-interactive --decoder-engine lean`` and ``hrt-translate``
    on one input file, HRT k = 2, beam 1."""
    data, spm, models = deployed
    ckpt, folder, _ = models["hrt_tiny"]
    lines = raw_lines(data, Translator(str(folder)))
    path = tmp_path / "input.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def interactive(engine):
        return run_cli(
            [
                "interactive",
                data.bin_dir,
                "--path",
                ckpt,
                "--user-dir",
                USER_DIR,
                "--task",
                "hrt_translation",
                "--source-lang",
                "en",
                "--target-lang",
                "de",
                "--cpu",
                "--bpe",
                "sentencepiece",
                "--sentencepiece-model",
                spm,
                "--input",
                path,
                "--buffer-size",
                "4",
                "--batch-size",
                "4",
                "--decode-chunk-size",
                "2",
                "--beam",
                "1",
                "--max-len-a",
                "0",
                "--max-len-b",
                MAX_LEN_B,
                "--decoder-engine",
                engine,
            ],
            env={"FAIRSEQ_HRT_ONNX_CACHE": str(tmp_path / "cache")},
        ).stdout

    out = interactive("lean")
    onnx = interactive("onnxruntime")  # fairseq-interactive --decoder-engine onnxruntime: the same H- and D- lines
    assert hyp_lines(onnx) == hyp_lines(out)

    def detokenised(text):  # (id, score, text) of the D- lines
        return [(int(i), float(score), words) for i, score, words in re.findall(r"^D-(\d+)\t(\S+)\t?(.*)$", text, re.M)]

    assert [(i, w) for i, _, w in detokenised(onnx)] == [(i, w) for i, _, w in detokenised(out)]
    assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(detokenised(onnx), detokenised(out)))
    pieces = hyp_lines(out)  # H-: pieces; D-: detokenised (SentencePiece decoded)
    detok = {int(m.group(1)): m.group(2) for m in re.finditer(r"^D-(\d+)\t\S+\t?(.*)$", out, re.M)}
    assert sorted(detok) == sorted(pieces) == list(range(len(lines)))
    ref = [detok[i] for i in range(len(lines))]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hrt_runtime",
            str(folder),
            "--input",
            str(path),
            "--chunk-size",
            "2",
            "--beam",
            "1",
            "--max-len-a",
            "0",
            "--max-len-b",
            str(MAX_LEN_B),
        ],
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ref
    assert "truncated" in proc.stderr


@pytest.mark.slow
def test_bad_lines_give_the_same_output_and_warnings_on_every_entry_point(deployed, hubs, tmp_path, caplog):
    """One file of bad lines (invalid UTF-8, a NUL inside a line, control characters, blank
    lines) through fairseq-interactive (stdin read with surrogateescape), the hub,
    Translator.translate and hrt-translate: the
    same strings, and a warning naming each repaired line (runtime/hrt_runtime/text_input.py)."""
    data, spm, models = deployed
    ckpt, folder, _ = models["hrt_tiny"]
    good = read_lines(data.raw("valid", "en"))[:4]
    raw = [
        good[0].encode(),
        good[1].encode() + b" \xff\xfe",
        b"",
        good[2][:9].encode() + b"\x00" + good[2][9:].encode(),
        good[3].encode() + b"\x07\x1b end",
        b"   ",
    ]
    path = tmp_path / "bad.txt"
    path.write_bytes(b"\n".join(raw) + b"\n")
    options = dict(chunk_size=2, beam=1, max_len_b=MAX_LEN_B)
    # fairseq reads --input FILE as strict UTF-8: bad bytes reach the task through stdin with
    # surrogateescape, as docs/compatibility.md says
    interactive_proc = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "fairseq-interactive"),
            str(data.bin_dir),
            "--path",
            str(ckpt),
            "--user-dir",
            USER_DIR,
            "--task",
            "hrt_translation",
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--cpu",
            "--bpe",
            "sentencepiece",
            "--sentencepiece-model",
            str(spm),
            "--buffer-size",
            "4",
            "--batch-size",
            "4",
            "--decode-chunk-size",
            "2",
            "--beam",
            "1",
            "--max-len-a",
            "0",
            "--max-len-b",
            str(MAX_LEN_B),
            "--decoder-engine",
            "lean",
        ],
        input=path.read_bytes(),
        cwd=str(REPO),
        env=cli_env({"PYTHONIOENCODING": "utf-8:surrogateescape", "LC_ALL": "C.UTF-8"}),
        capture_output=True,
        timeout=600,
    )
    out = interactive_proc.stdout.decode("utf-8", "replace") + interactive_proc.stderr.decode("utf-8", "replace")
    assert interactive_proc.returncode == 0, out[-4000:]
    detok = {int(m.group(1)): m.group(2) for m in re.finditer(r"^D-(\d+)\t\S+\t?(.*)$", out, re.M)}
    interactive = [detok.get(i, "") for i in range(len(raw))]
    decoded = [line.decode("utf-8", "surrogateescape") for line in raw]  # as Python reads them
    with caplog.at_level(logging.WARNING):
        hub = hubs["hrt_tiny"].translate(decoded, engine="lean", max_len_a=0, **options)
        translator = Translator(str(folder)).translate(decoded, max_len_a=0, **options)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hrt_runtime",
            str(folder),
            "--input",
            str(path),
            "--chunk-size",
            "2",
            "--beam",
            "1",
            "--max-len-b",
            str(MAX_LEN_B),
        ],
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert interactive == hub == translator == proc.stdout.split("\n")[:-1]
    assert translator[2] == translator[5] == "" and all(translator[i] for i in (0, 1, 3, 4))
    assert f"{path}, line 2: bytes that are not valid UTF-8" in proc.stderr
    assert f"{path}, line 4: NUL bytes removed" in proc.stderr
    assert f"{path}, line 5: control characters replaced by spaces" in proc.stderr
    # the task names fairseq-interactive's lines by number (it never sees the file's name)
    assert "input line 2: bytes that are not valid UTF-8 repaired" in out
    assert "input line 4: NUL bytes repaired" in out
    assert "input line 5: control characters repaired" in out
    messages = [r.getMessage() for r in caplog.records]
    # the hub's and the Translator's warnings, alike: one each
    assert messages.count("input, line 2: bytes that are not valid UTF-8 replaced by U+FFFD") == 2
    assert messages.count("input, line 4: NUL bytes removed") == 2
    assert messages.count("input, line 5: control characters replaced by spaces") == 2


# ------------------------------------------------------------------ a fresh virtual environment


RUNTIME_PACKAGES = ["onnxruntime==1.32.0", "numpy<2", "sentencepiece==0.2.0"]
NETWORK_ERRORS = (
    "Could not find a version",
    "No matching distribution",
    "NewConnectionError",
    "Max retries",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Connection refused",
)


def _pip(venv_dir: Path, *args, timeout=900):
    started = time.perf_counter()
    proc = subprocess.run(
        [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(e in output for e in NETWORK_ERRORS):
            pytest.skip(f"pip cannot reach the package index: {output.strip().splitlines()[-1]}")
        raise AssertionError(f"pip install {' '.join(args)} failed:\n{output[-4000:]}")
    return seconds


def _site_packages_mib(venv_dir: Path, names) -> float:
    site = next((venv_dir / "lib").glob("python3*/site-packages"))
    total = 0
    for path in site.iterdir():
        if any(path.name.lower().startswith(n) for n in names):
            for f in path.rglob("*") if path.is_dir() else [path]:
                if f.is_file():
                    total += f.stat().st_size
    return total / 2**20


@pytest.mark.slow
def test_hrt_translate_in_a_fresh_venv_without_torch(deployed, tmp_path):
    """``pip install onnxruntime numpy sentencepiece`` and ``pip install ./runtime`` (hrt-runtime) in a
    new virtual environment: ``hrt-translate`` there gives the in-process Translator's output,
    and ``import torch`` fails there."""
    data, _, models = deployed
    venv_dir = tmp_path / "venv"
    started = time.perf_counter()
    venv.EnvBuilder(with_pip=True, clear=True).create(venv_dir)
    made = time.perf_counter() - started
    deps = _pip(venv_dir, *RUNTIME_PACKAGES)
    # the runtime's distribution (runtime/) as pip installs it, copied so that the build leaves nothing in
    # the checkout; its dependencies are the pinned ones just installed
    source = tmp_path / "runtime"
    shutil.copytree(REPO / "runtime", source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    own = _pip(venv_dir, str(source))
    sizes = {
        "onnxruntime": _site_packages_mib(venv_dir, ["onnxruntime"]),
        "numpy": _site_packages_mib(venv_dir, ["numpy"]),
        "sentencepiece": _site_packages_mib(venv_dir, ["sentencepiece"]),
    }
    print(
        f"\nfresh venv: created in {made:.1f} s, runtime packages installed in {deps:.1f} s, the repository in "
        f"{own:.1f} s; installed sizes (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in sizes.items())
    )

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    python = str(venv_dir / "bin" / "python")
    no_torch = subprocess.run(
        [python, "-c", "import torch"], capture_output=True, text=True, cwd=str(tmp_path), env=env
    )
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    no_fairseq = subprocess.run(
        [python, "-c", "import fairseq"], capture_output=True, text=True, cwd=str(tmp_path), env=env
    )
    assert no_fairseq.returncode != 0
    assert not (venv_dir / "bin" / "fairseq-hrt-export").exists()  # the plugin's commands stay with the plugin

    for arch, flags, options in (
        ("hrt_tiny", ["--chunk-size", "2", "--beam", "1"], dict(chunk_size=2, beam=1)),
        ("at_tiny", ["--beam", "5"], dict(beam=5)),
    ):
        folder = models[arch][1]
        lines = raw_lines(data, Translator(str(folder)))
        path = tmp_path / "input.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        proc = subprocess.run(
            [
                str(venv_dir / "bin" / "hrt-translate"),
                str(folder),
                "--input",
                str(path),
                *flags,
                "--max-len-b",
                str(MAX_LEN_B),
            ],
            capture_output=True,
            text=True,
            cwd=str(tmp_path),
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        expected = Translator(str(folder)).translate(lines, max_len_b=MAX_LEN_B, **options)
        assert proc.stdout.split("\n")[:-1] == expected
        assert "truncated" in proc.stderr
    # the same from standard input, as python -m hrt_runtime
    proc = subprocess.run(
        [python, "-m", "hrt_runtime", str(models["at_tiny"][1]), "--beam", "1", "--max-len-b", "5"],
        input="\n".join(lines[:3]) + "\n",
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == Translator(str(models["at_tiny"][1])).translate(
        lines[:3], beam=1, max_len_b=5
    )

    # the service's extra brings what hrt-serve imports and nothing of the training side
    _pip(venv_dir, f"{source}[serve]")
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    print("\nhrt-runtime[serve] in a fresh venv: " + ", ".join(sorted(installed)))
    assert {"hrt-runtime", "aiohttp", "prometheus-client", "onnxruntime", "numpy", "sentencepiece"} <= installed
    training_side = {"sacrebleu", "lxml", "regex", "tabulate", "portalocker", "colorama", "torch", "fairseq"}
    assert not installed & training_side
    served = subprocess.run(
        [str(venv_dir / "bin" / "hrt-serve"), "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert served.returncode == 0 and "POST /translate" in served.stdout, served.stderr


# ---------------------------------------------------------------------------- clear errors


@pytest.fixture(scope="module")
def exported_random(tmp_path_factory):
    """Untrained tiny AT and HRT models exported in-process: ``{kind: folder}`` (inputs are
    pieces: no SentencePiece model)."""
    data_dir, task, hrt, at = random_tiny_models(tmp_path_factory, "deploy_random")
    root = tmp_path_factory.mktemp("deploy_random_onnx")
    for name, model in (("hrt", hrt), ("at", at)):
        export_model(model, task, str(root / name), restricted=False)
    return {"hrt": str(root / "hrt"), "at": str(root / "at")}


def test_random_models_translate_pieces(exported_random):
    for folder in exported_random.values():
        out = Translator(folder).translate(["w1 w2 w3", "", "w4 nonsense"], beam=2, max_len_b=5)
        assert len(out) == 3 and out[1] == "" and all(p.startswith("w") for p in " ".join(out).split())


def _copy(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_folder_errors(exported_random, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        Translator(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match=r"no config.json \(not a folder written by fairseq-hrt-export\)"):
        Translator(str(tmp_path))
    folder = _copy(exported_random["at"], tmp_path)
    config = json.loads((folder / "config.json").read_text())

    other = VERSION + 1
    readable = ", ".join(map(str, READABLE_VERSIONS))
    for bad, message in (
        (
            {**config, "format": "ctranslate2"},
            rf"format 'ctranslate2' version {VERSION}, this runtime reads "
            rf"'fairseq-hrt-onnx' versions {readable}; export the checkpoint again",
        ),
        ({**config, "version": other}, rf"version {other}, this runtime reads 'fairseq-hrt-onnx' versions {readable}"),
        ([1, 2], r"not a fairseq-hrt-export configuration \(a JSON list"),
        ({k: v for k, v in config.items() if k != "graphs"}, r"lacks graphs; export the checkpoint again"),
    ):
        (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            Translator(str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        Translator(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "step.onnx").unlink()
    with pytest.raises(FileNotFoundError, match=r"config.json names step.onnx, which is missing"):
        Translator(str(folder))


def _edited(folder, tmp_path, edit, name="edited"):
    """A copy of ``folder`` with ``edit(copy, config)`` applied, config.json written back."""
    copy = _copy(folder, tmp_path, name)
    config = json.loads((copy / "config.json").read_text())
    edit(copy, config)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _zero(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(bytes(size))


def test_int8_in_config_json_exempts_no_file(exported_random, tmp_path):
    """ "int8": true added to a float folder's config.json once switched off the check of the
    graphs and weights.bin: zeroed weights then gave empty lines with exit code 0. Every listed
    file is checked, an int8 export's too (its list made after quantizing)."""

    def int8_zeroed(folder, config):
        config["int8"] = True
        _zero(folder / "weights.bin")

    folder = _edited(exported_random["at"], tmp_path, int8_zeroed)
    with pytest.raises(
        DamagedFolderError, match=r"damaged file: weights.bin is not the file the export wrote .*\"int8\" added by hand"
    ):
        Translator(str(folder))
    folder = _edited(exported_random["at"], tmp_path, lambda _, config: config.update(int8=True), "int8_flag")
    with pytest.raises(DamagedFolderError, match=r"int8 flag disagrees with its file list .*; export again"):
        Translator(str(folder))
    int8 = tmp_path / "int8"
    quantize_folder(exported_random["at"], str(int8))
    assert Translator(str(int8)).translate(["w5 w6"], beam=1, max_len_b=4)[0]
    _zero(int8 / "weights.bin")
    with pytest.raises(DamagedFolderError, match=r"damaged file: weights.bin is not the file the export wrote"):
        Translator(str(int8))


def test_every_graph_is_checked_against_its_role(exported_random, tmp_path):
    """Two graph names swapped in config.json's "graphs" once loaded, decoded at beam 1 and
    failed at beam 5 inside ONNX Runtime (``Invalid input name: k``); each graph is now read at
    load, its inputs and outputs against its role, its declared values against config.json."""

    def swap(first, second):
        def edit(_, config):
            graphs = config["graphs"]
            graphs[first], graphs[second] = graphs[second], graphs[first]

        return edit

    for kind, first, second, message in (
        (
            "at",
            "step",
            "step_top",
            r"names step_top.onnx as the 'step' graph, which it is not \(inputs the role is "
            r"not fed: k\); export again",
        ),
        (
            "hrt",
            "parallel",
            "encoder",
            r"names parallel.onnx as the 'encoder' graph, which it is not \(inputs the role is not fed: .*; inputs "
            r"it lacks: src_tokens; 2 outputs, the role reads 3\); export again",
        ),
    ):
        folder = _edited(exported_random[kind], tmp_path, swap(first, second), f"swapped-{kind}")
        with pytest.raises(ValueError, match=message):
            Translator(str(folder))

    onnx = pytest.importorskip("onnx")

    def restamp(folder, config):  # step.onnx of an export with other positions, listed as the export's
        graph = onnx.load(str(folder / "step.onnx"), load_external_data=False)
        entry = next(e for e in graph.metadata_props if e.key == DECLARED_KEY)
        entry.value = json.dumps({**json.loads(entry.value), "max_source_positions": 4096})
        onnx.save(graph, str(folder / "step.onnx"))
        path = folder / "step.onnx"
        config["files"]["step.onnx"] = {"bytes": path.stat().st_size, "sha256": sha256_of(str(path))}

    def step_dropped(_, config):  # from "graphs" and from the file list
        del config["graphs"]["step"], config["files"]["step.onnx"]

    folder = _edited(exported_random["at"], tmp_path, step_dropped, "no-step")
    with pytest.raises(ValueError, match=r"\"graphs\" has no step graph, which an AT model needs; export again"):
        Translator(str(folder))
    folder = _edited(exported_random["at"], tmp_path, restamp, "restamped")
    with pytest.raises(ValueError, match=r"disagrees with its graphs on max_source_positions .*step.onnx 4096"):
        Translator(str(folder))


def test_a_mistyped_config_key_is_named(exported_random, tmp_path):
    """``"layers": "1"`` once failed in a Python TypeError naming no file."""
    folder = _copy(exported_random["at"], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for key, value, expected in (
        ("layers", "1", r"'layers' must be an integer >= 0, not \"1\""),
        ("banned", [1, "2"], r"'banned' must be a list of integers >= 0, not \[1, \"2\"\]"),
        ("graphs", {"encoder": 3}, r"'graphs' must be an object of graph roles to file names in the folder"),
        ("weights", "../weights.bin", r"'weights' must be a file name in the folder or null"),
    ):
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + ": " + expected):
            Translator(str(folder))


def test_a_listed_file_config_json_does_not_name_is_refused(exported_random, tmp_path, caplog):
    """``"sentencepiece_model": null`` beside the exported SentencePiece model once read raw
    pieces with exit code 0; a folder exported without one (pieces) loads with a warning."""

    def spm_dropped(folder, config):  # an export with a SentencePiece model, then the key set to null
        (folder / "sentencepiece.model").write_bytes(b"a SentencePiece model")
        config["files"]["sentencepiece.model"] = {"bytes": 21, "sha256": sha256_of(str(folder / "sentencepiece.model"))}
        config["sentencepiece_model"] = None

    folder = _edited(exported_random["at"], tmp_path, spm_dropped)
    with pytest.raises(
        DamagedFolderError,
        match=r"lists sentencepiece.model among the exported files but does not "
        r"name it .*; export again",
    ):
        Translator(str(folder))
    folder = _edited(exported_random["at"], tmp_path, lambda _, config: config["graphs"].pop("greedy"), "no-greedy")
    with pytest.raises(DamagedFolderError, match=r"lists greedy.onnx among the exported files but does not name it"):
        Translator(str(folder))
    with caplog.at_level(logging.WARNING, logger="hrt_runtime.model"):
        Translator(exported_random["at"])
    assert [r.getMessage() for r in caplog.records] == [
        f"{exported_random['at']} has no SentencePiece model: its input is read as whitespace-separated pieces of "
        "its source dictionary, and its output written as pieces"
    ]


def test_a_file_given_for_the_folder(exported_random):
    config = os.path.join(exported_random["at"], "config.json")
    with pytest.raises(FileNotFoundError, match=r"config.json is a file, not a folder: give the folder"):
        Translator(config)
    rc, out, err = _cli(config, input_text="w1\n")
    assert (
        rc == 2
        and out == ""
        and err.strip().splitlines()
        == [
            f"hrt-translate: error: {config} is a file, not a folder: give the folder fairseq-hrt-export wrote (the "
            "one holding config.json)"
        ]
    )


def test_a_folder_of_the_previous_version_decodes_without_the_loop(exported_random, tmp_path):
    """A version-3 folder (exported before greedy.onnx) still translates, the search making
    its own steps, to the same output; the engine's cache exports such a folder again."""
    folder = _copy(exported_random["hrt"], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["graphs"]["greedy"]
    del config["files"]["greedy.onnx"]  # a listed file config.json does not name is refused
    (folder / "config.json").write_text(json.dumps({**config, "version": 3}))
    lines = ["w1 w2 w3", "w4 w5 w6 w7 w8"]
    current, previous = Translator(exported_random["hrt"]), Translator(str(folder))
    for options in ({"beam": 1}, {"beam": 1, "chunk_size": 2}):
        assert previous.translate(lines, batch_size=1, **options) == current.translate(lines, batch_size=1, **options)
    assert not _cached(str(folder), config["parameters_sha256"], False)
    assert _cached(exported_random["hrt"], config["parameters_sha256"], False)


def test_the_engines_int8_cache_holds_the_default_weight_scales_only(exported_random, tmp_path):
    """An int8 copy in the engine's cache quantized with one scale per matrix (as every int8 copy
    was before one per output column became the default) is quantized again, not reused."""
    digest = json.loads((Path(exported_random["at"]) / "config.json").read_text())["parameters_sha256"]
    for scales in ("channel", "tensor"):
        quantize_folder(exported_random["at"], str(tmp_path / scales), scales)
    assert _cached(str(tmp_path / "channel"), digest, True)
    assert not _cached(str(tmp_path / "tensor"), digest, True)
    assert not _cached(str(tmp_path / "channel"), digest, False)


def test_option_errors(exported_random):
    at, hrt = Translator(exported_random["at"]), Translator(exported_random["hrt"])
    with pytest.raises(TypeError, match=r"translate\(\) takes a string or a list of strings, got NoneType"):
        at.translate(None)
    with pytest.raises(TypeError, match=r"item 1 of the list is bytes"):
        at.translate(["w1", b"w2"])
    for translator in (at, hrt):
        with pytest.raises(ValueError, match=r"chunk_size must be an integer from 1 to 64 .*got 0"):
            translator.translate(["w1"], chunk_size=0)
        with pytest.raises(TypeError, match=r"chunk_size must be an integer"):
            translator.translate(["w1"], chunk_size="2")
        with pytest.raises(ValueError, match="beam must be an integer from 1 to 256 .*got 0"):
            translator.translate(["w1"], beam=0)
    # refused before anything is decoded, also when every line is empty
    with pytest.raises(ValueError, match=r"chunk_size 2: this is an AT model, it has no chunk size"):
        at.translate(["", ""], chunk_size=2)
    with pytest.raises(ValueError, match=r"chunk_size 4: this model was trained for chunk sizes 2, 3"):
        hrt.translate(["w1"], chunk_size=4)
    with pytest.raises(ValueError, match=r"b_nat 3 > beam 2: .* b_nat must be <= beam"):
        hrt.translate(["w1"], chunk_size=2, beam=2, b_nat=3)
    assert at.translate(["", " "], chunk_size=1) == ["", ""]


def _cli(*args, input_text=""):
    proc = subprocess.run(
        [sys.executable, "-m", "hrt_runtime", *map(str, args)],
        input=input_text,
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_errors_exit_2_with_a_message(exported_random, tmp_path):
    rc, out, err = _cli(tmp_path)
    assert (
        rc == 2 and out == "" and f"hrt-translate: error: {tmp_path}: no config.json" in err and "Traceback" not in err
    )
    rc, _, err = _cli(exported_random["at"], "--chunk-size", "2", input_text="w1\n")
    assert rc == 2 and "hrt-translate: error: chunk_size 2: this is an AT model" in err and "Traceback" not in err
    rc, _, err = _cli(exported_random["hrt"], "--beam", "1", "--b-nat", "2", input_text="w1\n")
    assert rc == 2 and "hrt-translate: error: b_nat 2 > beam 1" in err
    rc, _, err = _cli(exported_random["at"], "--input", tmp_path / "absent.txt")
    assert rc == 2 and f"hrt-translate: error: --input {tmp_path / 'absent.txt'}: no such file" in err
    # bad bytes and a lone \r do not end the run nor shift the lines
    path = tmp_path / "bad.txt"
    path.write_bytes(b"\xef\xbb\xbfw1 w2\r\nw3 \xff w4\nw5\rw6\n\n")
    rc, out, err = _cli(exported_random["at"], "--input", path, "--beam", "1", "--max-len-b", "3")
    assert rc == 0, err
    assert len(out.split("\n")[:-1]) == 4 and out.split("\n")[3] == ""


# ------------------------------------------------------------------------ export refusals


@pytest.mark.parametrize(
    "arch,extra,reason",
    [
        ("at_tiny", ("--hrt-mode", "at"), "a quantized model (--quantize int8): export the float checkpoint"),
    ],
)
def test_exporter_refuses_in_one_message(tmp_path, arch, extra, reason):
    (tmp_path / "data").mkdir()
    task, model = build_task_and_model(str(tmp_path / "data"), arch=arch, extra=extra)
    quantize_int8(model)  # PyTorch's int8 modules: the graphs are exported from float weights
    out = tmp_path / "onnx"
    with pytest.raises(ValueError) as error:
        export_model(model, task, str(out))
    message = str(error.value)
    assert message.startswith("cannot export this model to ONNX: ") and reason in message
    assert "\n" not in message
    assert not out.exists()  # nothing written


def test_export_command_errors_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main([str(tmp_path / "absent.pt"), str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert f"fairseq-hrt-export: error: no checkpoint {tmp_path / 'absent.pt'}" in capsys.readouterr().err


# ------------------------------------------------------------------------------- README


def test_readme_deploy_example_runs(exported_random, tmp_path):
    """README's "Deploy without PyTorch" Python example, verbatim, on an exported HRT model
    named as there (``model-onnx``)."""
    text = (REPO / "README.md").read_text()
    section = re.search(r"## Deploy without PyTorch\n(.*?)\n## ", text, re.S).group(1)
    code = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    commands = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)
    assert "fairseq-hrt-export " in commands and "hrt-translate model-onnx" in commands
    os.symlink(exported_random["hrt"], tmp_path / "model-onnx")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    translations = eval(proc.stdout.strip().splitlines()[-1])  # a printed list of three strings
    assert len(translations) == 3 and translations[1] == "" and translations[0] and translations[2]


@pytest.mark.slow
def test_the_python_api_decodes_with_onnxruntime(deployed, hubs, tmp_path, monkeypatch):
    """``from_pretrained(...).translate(..., engine="onnxruntime")``: the strings of the lean engine."""
    monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path / "cache"))
    data, _, models = deployed
    lines = read_lines(data.raw("valid", "en"))[:12]
    for arch, options in (
        ("at_tiny", dict(beam=4)),
        ("hrt_tiny", dict(chunk_size=2, beam=1)),
        ("cmlm_tiny", dict(iter_decode_max_iter=3)),
    ):
        ref = hubs[arch].translate(lines, engine="lean", max_len_b=MAX_LEN_B, **options)
        assert hubs[arch].translate(lines, engine="onnxruntime", max_len_b=MAX_LEN_B, **options) == ref


def test_an_export_removes_what_a_killed_export_left(tmp_path):
    """A killed export leaves its temporary folder (``.export-<pid>-*``, ``.int8-<pid>-*``);
    the next export into that folder removes those of processes that are gone, and keeps those
    of a live process (an export running beside it)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = [tmp_path / f".export-{gone.pid}-x1", tmp_path / f".int8-{gone.pid}-x2"]
    running = tmp_path / f".export-{os.getppid()}-x3"
    for folder in (*left, running):
        folder.mkdir()
        (folder / "encoder.onnx").write_text("half written")
    made = temporary_folder(str(tmp_path), ".export-")
    temporary_folder(str(tmp_path), ".int8-")
    assert not any(folder.exists() for folder in left) and running.exists()
    assert os.path.basename(made).startswith(f".export-{os.getpid()}-")
