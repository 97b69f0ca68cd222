"""The deployed runtime as dependable as fairseq-interactive (issue 33), on untrained tiny models
exported in-process (``exported_tiny``):

* a stream: ``hrt-translate`` prints each buffer as soon as it is translated (a waiting writer
  reads its line's translation before writing the next), ``Translator.translate_iter`` is lazy;
* one input repair (:mod:`hrt_runtime.text_input`) with the same outputs and warnings on every
  runtime entry point (fairseq-interactive and the hub: ``tests/test_onnx_deploy.py``, slow);
* a damaged folder (truncated, altered, another export's config.json) named at load;
* clear errors; batch invariance; many threads on one Translator; no torch in the runtime.
"""

import array
import fcntl
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import termios
import threading
import tomllib

import numpy as np
import pytest

onnxruntime = pytest.importorskip("onnxruntime")

import importlib  # noqa: E402

from fairseq_hrt.export.exporter import quantize_folder  # noqa: E402
from fairseq_hrt.testing.tiny_runs import REPO, cli_env, run_cli  # noqa: E402
from hrt_runtime import Translator, search, serve, translate_command  # noqa: E402
from hrt_runtime.errors import Refused  # noqa: E402
from hrt_runtime.integrity import DamagedFolderError  # noqa: E402
from hrt_runtime.model import DECLARED_KEY, ExportedModel  # noqa: E402
from hrt_runtime.options import CPUS, joined_values, number_of, usable_cpus  # noqa: E402


def _sentences(n, seed=0, max_words=12):
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4, 40)}" for _ in range(rng.randrange(1, max_words))) for _ in range(n)]


def _runtime(*args, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime", *map(str, args)], cwd=str(REPO), env=cli_env(), **kwargs
    )


def _cli(*args, input_bytes=b""):
    proc = subprocess.run(
        [sys.executable, "-m", "hrt_runtime", *map(str, args)],
        input=input_bytes,
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")


# ------------------------------------------------------------------------------- streaming


def test_a_waiting_writer_reads_each_translation_before_writing_the_next(exported_tiny):
    """``(echo A; sleep; echo B) | hrt-translate``: A's translation is readable while the writer
    still waits, with the default --buffer-size (a pause of the pipe ends a buffer)."""
    folder = exported_tiny["hrt"]
    expected = Translator(folder).translate(["w5 w6 w7", "w8 w9"], beam=1, max_len_b=6)
    proc = _runtime(
        folder, "--beam", "1", "--max-len-b", "6", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        proc.stdin.write(b"w5 w6 w7\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no translation of line A while the writer waits"
        assert proc.stdout.readline().decode().rstrip("\n") == expected[0]
        proc.stdin.write(b"w8 w9\n")
        proc.stdin.close()
        assert proc.stdout.read().decode().split("\n")[:-1] == expected[1:]
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_buffers_give_the_output_of_one_call(exported_tiny, tmp_path):
    """--buffer-size 1, 7 and the default on a file: the strings of one translate() call."""
    folder = exported_tiny["at"]
    lines = _sentences(40, seed=1)
    lines[3] = ""
    path = tmp_path / "in.txt"
    path.write_text("\n".join(lines) + "\n")
    expected = Translator(folder).translate(lines, beam=2, max_len_b=5)
    for size in ("1", "7", None):
        rc, out, err = _cli(
            folder, "--input", path, "--beam", "2", "--max-len-b", "5", *(("--buffer-size", size) if size else ())
        )
        assert rc == 0, err
        assert out.split("\n")[:-1] == expected
    rc, _, err = _cli(folder, "--buffer-size", "0", input_bytes=b"w1\n")
    message = "--buffer-size must be an integer from 1 to 10000000 (lines read before translating), got 0"
    assert rc == 2 and f"hrt-translate: error: {message}" in err


def test_translate_iter_is_lazy_and_equals_translate(exported_tiny):
    translator = Translator(exported_tiny["hrt"])
    lines = _sentences(9, seed=2)
    read = []

    def source():
        for line in lines:
            read.append(line)
            yield line

    outputs = translator.translate_iter(source(), buffer_size=4, beam=2, max_len_b=6)
    assert read == []  # nothing read before the first output is asked for
    first = next(outputs)
    assert len(read) == 4  # one buffer
    rest = list(outputs)
    assert [first, *rest] == translator.translate(lines, beam=2, max_len_b=6)
    with pytest.raises(ValueError, match=r"buffer_size must be an integer from 1 to .*, got 0"):
        translator.translate_iter(lines, buffer_size=0)
    with pytest.raises(
        ValueError, match=r"lenpen must be a finite number from -10 to 10 \(the length penalty\), got nan"
    ):  # checked before reading
        translator.translate_iter(source(), lenpen=float("nan"))
    with pytest.raises(TypeError, match=r"input, line 2 is int"):
        list(translator.translate_iter(["w1", 5]))


# ------------------------------------------------------------------------------- bad input

BAD_LINES = [b"w5 w6", b"w7 \xff\xfe w8", b"w9\x00w10 w11", b"w12\x07w13\x1bw14", b"", b"   ", b"w15 w16"]


def test_bad_lines_give_the_same_outputs_and_warnings_on_every_runtime_entry_point(exported_tiny, tmp_path, caplog):
    """A file of bad lines through hrt-translate (--input, stdin) and Translator.translate (the
    lines as Python decodes them, with surrogates, or with U+FFFD) and translate_iter: the
    same outputs, a warning naming each repaired line."""
    folder = exported_tiny["hrt"]
    data = b"\n".join(BAD_LINES) + b"\n"
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    translator = Translator(folder)
    decoded = data.decode("utf-8", "surrogateescape").split("\n")[:-1]
    with caplog.at_level(logging.WARNING):
        ours = translator.translate(decoded, beam=1, max_len_b=5)
        assert list(translator.translate_iter(iter(decoded), buffer_size=2, beam=1, max_len_b=5)) == ours
        assert translator.translate(data.decode("utf-8", "replace").split("\n")[:-1], beam=1, max_len_b=5) == ours
    messages = [r.getMessage() for r in caplog.records]
    assert "input, line 2: bytes that are not valid UTF-8 replaced by U+FFFD" in messages
    assert "input, line 3: NUL bytes removed" in messages
    assert "input, line 4: control characters replaced by spaces" in messages
    # NUL removed: "w9w10 w11", as fairseq-interactive reads it
    assert ours[2] == translator.translate("w9w10 w11", beam=1, max_len_b=5)
    assert ours[4] == ours[5] == ""
    for args, stdin, name in ((("--input", path), b"", str(path)), ((), data, "<stdin>")):
        rc, out, err = _cli(folder, "--beam", "1", "--max-len-b", "5", *args, input_bytes=stdin)
        assert rc == 0, err
        assert out.split("\n")[:-1] == ours
        assert f"{name}, line 2: bytes that are not valid UTF-8 (first at byte 3: b'\\xff') replaced by U+FFFD" in err
        assert f"{name}, line 3: NUL bytes removed" in err
        assert f"{name}, line 4: control characters replaced by spaces" in err


def test_a_truncated_line_is_named(exported_tiny, caplog):
    translator = Translator(exported_tiny["at"])
    long_line = " ".join(["w5"] * (translator.max_source_tokens + 10))
    with caplog.at_level(logging.WARNING):
        translator.translate(["w1", "", long_line], beam=1, max_len_b=3)
    assert any(
        r.getMessage().startswith("input, line 3: a sentence of") and "truncated" in r.getMessage()
        for r in caplog.records
    )


def test_the_runtime_imports_neither_torch_nor_fairseq():
    code = (
        "import sys, hrt_runtime, hrt_runtime.text_input, hrt_runtime.integrity, hrt_runtime.translator, "
        "hrt_runtime.serve; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'fairseq', 'fairseq_hrt', 'fairseq_cli')]; "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=cli_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- clear errors


def test_option_errors_say_what_is_expected(exported_tiny, tmp_path):
    translator = Translator(exported_tiny["hrt"])
    cases = [
        (dict(max_len_a=float("nan")), ValueError, r"max_len_a must be a finite number from 0 to 100 .*got nan"),
        (dict(max_len_a=float("inf")), ValueError, r"max_len_a must be a finite number from 0 to 100 .*got inf"),
        (dict(max_len_a="x"), TypeError, r"max_len_a must be a finite number .*got 'x'"),
        (dict(max_len_a=-1.0), ValueError, r"max_len_a must be a finite number from 0 to 100 .*got -1.0"),
        (
            dict(lenpen=None),
            TypeError,
            r"lenpen must be a finite number from -10 to 10 \(the length penalty\), got None",
        ),
        (dict(lenpen=float("nan"), beam=5), ValueError, r"lenpen must be a finite number from -10 to 10"),
        (dict(lenpen=400.0), ValueError, r"lenpen must be a finite number from -10 to 10 .*got 400.0"),
        (dict(lenpen=1e308), ValueError, r"lenpen must be a finite number from -10 to 10 .*got 1e\+308"),
        (
            dict(unkpen="a"),
            TypeError,
            r"unkpen must be a finite number from -1000 to 1000 \(the <unk> penalty\), got 'a'",
        ),
        (dict(max_len_b=-5), ValueError, r"max_len_b must be an integer from 0 to 100000 .*got -5"),
        (dict(max_len_b=2.5), TypeError, r"max_len_b must be an integer"),
        (dict(min_len=-1), ValueError, r"min_len must be an integer from 0 to"),
        (dict(iterations=0), ValueError, r"iterations must be an integer from 1 to"),
        (dict(beam=10**9), ValueError, r"beam must be an integer from 1 to 256 .*got 1000000000"),
        (dict(max_tokens=0), ValueError, r"max_tokens must be an integer from 1 to"),
        (dict(chunk_sise=1), TypeError, r"unknown option 'chunk_sise'; options: beam, chunk_size"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            translator.translate(["w1"], **options)
    with pytest.raises(
        TypeError,
        match=r"Translator\(folder\): folder is the path of a folder written by "
        r"fairseq-hrt-export, got NoneType",
    ):
        Translator(None)
    for threads in (0, -1):
        with pytest.raises(ValueError, match=rf"threads must be an integer from 1 to {CPUS} .*got {threads}"):
            Translator(exported_tiny["hrt"], threads=threads)
    for args, message in (
        (("--max-len-b", "-5"), "--max-len-b must be an integer from 0 to 100000"),
        (("--lenpen", "nan", "--beam", "5"), "--lenpen must be a finite number from -10 to 10"),
        (("--lenpen", "400"), "--lenpen must be a finite number from -10 to 10"),
        (("--max-len-a", "inf"), "--max-len-a must be a finite number from 0 to 100"),
        (("--threads", "0"), f"--threads must be an integer from 1 to {CPUS}"),
        (("--threads", "-1"), f"--threads must be an integer from 1 to {CPUS}"),
        (("--input", "."), "--input . is a folder"),
    ):
        rc, out, err = _cli(exported_tiny["hrt"], *args, input_bytes=b"w1\n")
        assert rc == 2 and out == "" and f"hrt-translate: error: {message}" in err and "Traceback" not in err, err


# ----------------------------------------------------------------------------- integrity


def _damaged(folder, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def test_a_damaged_folder_is_named_at_load(exported_tiny, tmp_path):
    config = json.loads(open(os.path.join(exported_tiny["hrt"], "config.json")).read())
    assert set(config["files"]) >= {"weights.bin", "encoder.onnx", *config["graphs"].values()}
    assert config["files"]["weights.bin"]["bytes"] == os.path.getsize(os.path.join(exported_tiny["hrt"], "weights.bin"))

    truncated = _damaged(exported_tiny["hrt"], tmp_path, "truncated")
    size = os.path.getsize(truncated / "weights.bin")
    os.truncate(truncated / "weights.bin", size // 2)
    with pytest.raises(
        DamagedFolderError,
        match=rf"damaged file: weights.bin has {size // 2} bytes, the export wrote "
        rf"{size} \(truncated\); export again",
    ):
        Translator(str(truncated))

    zeroed = _damaged(exported_tiny["hrt"], tmp_path, "zeroed")
    with open(zeroed / "weights.bin", "r+b") as f:
        f.seek(size // 3)
        f.write(bytes(min(4096, size // 3)))
    with pytest.raises(
        DamagedFolderError,
        match=r"damaged file: weights.bin is not the file the export wrote "
        r"\(its SHA-256 differs; same size\); export again",
    ):
        Translator(str(zeroed))

    swapped = _damaged(exported_tiny["hrt"], tmp_path, "swapped")
    shutil.copyfile(os.path.join(exported_tiny["at"], "config.json"), swapped / "config.json")
    with pytest.raises(
        DamagedFolderError,
        match=r"config.json does not describe the files beside it .*another export"
        r".*export again",
    ):
        Translator(str(swapped))

    rc, out, err = _cli(str(truncated), input_bytes=b"w1\n")
    assert rc == 2 and out == "" and "hrt-translate: error: " in err and "weights.bin has" in err
    assert "export again" in err and "Traceback" not in err


# --------------------------------------------------------------------------- batch, threads


@pytest.mark.parametrize(
    "kind,options",
    [
        ("hrt", dict(chunk_size=2, beam=1)),
        ("hrt", dict(chunk_size=2, beam=5)),
        ("hrt", dict(chunk_size=1, beam=1)),
        ("hrt", dict(chunk_size=1, beam=5)),
        ("at", dict(beam=1)),
        ("at", dict(beam=5)),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_outputs_do_not_depend_on_the_batch(exported_tiny, kind, options):
    """docs/deploy.md's statement: with max_len_a 0 (the default) a sentence's translation is
    the same at batch 1, 5 and 64 (and in any buffer or service batch)."""
    translator = Translator(exported_tiny[kind])
    lines = _sentences(64, seed=3)
    alone = [translator.translate(line, batch_size=1, max_len_b=8, **options) for line in lines]
    assert translator.translate(lines, batch_size=64, max_len_b=8, **options) == alone
    assert translator.translate(lines, batch_size=5, max_len_b=8, **options) == alone


def test_with_max_len_a_the_limit_follows_the_batch_width_as_in_fairseq(exported_tiny):
    """The exception, stated in docs/deploy.md: L = max_len_a x the batch's padded source width
    + max_len_b (fairseq's rule), so an output that runs to L (an untrained model's does) is
    longer beside a longer sentence."""
    translator = Translator(exported_tiny["at"])
    long_line = " ".join(f"w{5 + i % 30}" for i in range(20))
    alone = translator.translate("w5 w6", max_len_a=1.0, max_len_b=2, beam=1)
    beside = translator.translate(["w5 w6", long_line], max_len_a=1.0, max_len_b=2, beam=1)[0]
    assert len(alone.split()) <= 5 < len(beside.split())


def test_many_threads_share_one_translator(exported_tiny):
    """8 threads x 6 calls on one fresh Translator (its sessions made on first use, under its
    lock): every answer is the serial one."""
    folder = exported_tiny["hrt"]
    calls = [(_sentences(3, seed=10 + i), dict(beam=1 + i % 3, chunk_size=1 + i % 2, max_len_b=6)) for i in range(6)]
    serial = [Translator(folder).translate(lines, **options) for lines, options in calls]
    shared = Translator(folder)
    results, errors = {}, []
    start = threading.Barrier(8)

    def worker(t):
        try:
            start.wait()
            for i, (lines, options) in enumerate(calls):
                results[t, i] = shared.translate(lines, **options)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all(results[t, i] == serial[i] for t in range(8) for i in range(len(calls)))


# ------------------------------------------------------------------ the distributions' commands


def test_every_console_script_of_both_distributions_resolves(capsys):
    """The console scripts of fairseq-hrt (pyproject.toml) and hrt-runtime (runtime/pyproject.toml)
    name functions that exist, and fairseq-hrt-export answers --help."""
    for path in (REPO / "pyproject.toml", REPO / "runtime" / "pyproject.toml"):
        scripts = tomllib.loads(path.read_text())["project"]["scripts"]
        assert scripts, path
        for name, target in scripts.items():
            module, _, attr = target.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), f"{path}: {name} = {target}"
    export = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["fairseq-hrt-export"]
    module, _, attr = export.partition(":")
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), attr)(["--help"])
    assert exit_.value.code == 0 and "checkpoint" in capsys.readouterr().out.lower()


def test_very_long_lines_stay_within_the_positions_and_memory(exported_tiny):
    """Lines of the model's full source length with a length limit beyond the decoder's
    positions, HRT k = 2 (stage I once reached position 1024 of 1024 in ONNX Runtime), in
    batches cut by max_tokens; the same strings with and without the cut."""
    translator = Translator(exported_tiny["hrt"])
    width = translator.max_source_tokens
    lines = [" ".join(f"w{4 + (i * j) % 30}" for j in range(width + 5)) for i in range(3)]
    cut = translator.translate(lines, chunk_size=2, beam=1, max_len_a=1.2, max_len_b=10, max_tokens=width)
    assert len(cut) == 3 and all(cut)
    assert translator.translate(lines, chunk_size=2, beam=1, max_len_a=1.2, max_len_b=10, max_tokens=None) == cut
    with pytest.raises(ValueError, match="max_tokens must be an integer from 1 to 1000000000 .*got 0"):
        translator.translate(lines, max_tokens=0)


def test_an_int8_copy_loads_and_its_unchanged_files_are_checked(exported_tiny, tmp_path):
    """quantize_folder (--int8) lists its files after quantizing the graphs and weights.bin: the
    copy loads, and the files it copied unchanged are checked as its own are."""
    quantize_folder(exported_tiny["at"], str(tmp_path / "int8"))
    assert Translator(str(tmp_path / "int8")).translate(["w5 w6"], beam=1, max_len_b=4)[0]
    size = os.path.getsize(tmp_path / "int8" / "output_weight.npy")
    os.truncate(tmp_path / "int8" / "output_weight.npy", size - 8)
    with pytest.raises(DamagedFolderError, match="damaged file: output_weight.npy has"):
        Translator(str(tmp_path / "int8"))


def test_int8_weight_scales_per_matrix_or_per_output_column(exported_tiny, tmp_path):
    """--int8-scales: ``channel`` (the default) gives every quantized weight one scale per output
    column, ``tensor`` one; both copies load and say which they are; the option alone is refused."""
    import onnx  # noqa: PLC0415 - the exporter's dependency, not the runtime's

    for scales in ("tensor", "channel"):
        out = tmp_path / scales
        config = quantize_folder(exported_tiny["hrt"], str(out), scales)
        assert config["int8_scales"] == scales
        graph = onnx.load(str(out / "step.onnx"), load_external_data=False).graph
        weight_scales = [tuple(t.dims) for t in graph.initializer if t.name.endswith("_scale")]
        assert weight_scales and all((dims == ()) == (scales == "tensor") for dims in weight_scales), weight_scales
        assert Translator(str(out)).translate(["w5 w6"], beam=2, max_len_b=4)[0]
    with pytest.raises(ValueError, match="int8 scales 'row': one of channel, tensor"):
        quantize_folder(exported_tiny["hrt"], str(tmp_path / "row"), "row")
    bad = run_cli(["fairseq_hrt.export.exporter", "x.pt", tmp_path / "o", "--int8-scales", "channel"], check=False)
    assert bad.returncode == 2 and bad.stdout.strip().splitlines()[-1].endswith(
        "error: --int8-scales is an option of --int8"
    ), bad.stdout


class _StepLimits:
    """An exported model that records the step limit of every left-to-right search run on it
    (``begin``'s steps, or the greedy loop's ``max_len`` + 1) and forwards everything else."""

    def __init__(self, model):
        self._model, self.limits = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def begin(self, encoded, rows, steps, start, out_rows):
        self.limits.append(steps)
        return self._model.begin(encoded, rows, steps, start, out_rows)

    def greedy_loop(self, encoded, start, max_len, min_len, biases, out_rows):
        self.limits.append(max_len + 1)
        return self._model.greedy_loop(encoded, start, max_len, min_len, biases, out_rows)


def test_the_runtime_and_the_onnxruntime_engine_make_the_same_stage1_steps(exported_tiny):
    """One length limit: Translator.search and the call --decoder-engine onnxruntime makes
    (search.hrt on the batch, fairseq_hrt/generation/search_generator.py) give stage I the same
    number of steps over a grid of max_len_a, max_len_b, k and source lengths, always within
    the decoder's positions (the runtime once clamped L itself: 340 steps against 339 at k = 3,
    a = 2, b = 1001 and a 10-token source)."""
    translator = Translator(exported_tiny["hrt"])
    model = translator.model
    cap_steps = {k: search.position_cap(model.max_target_positions, k) + 1 for k in (2, 3)}
    for k in (2, 3):
        for a in (0.0, 0.5, 2.0):
            for b in (0, 7, 200, 1001):
                for length in (1, 10, 300):
                    source = np.array([4 + i % 30 for i in range(length - 1)] + [model.source_eos], np.int64)
                    options = translator.options(beam=1, chunk_size=k, max_len_a=a, max_len_b=b, min_len=0)
                    runtime = _StepLimits(model)
                    translator.model = runtime
                    try:
                        translator.search([source], options.search, k)
                    finally:
                        translator.model = model
                    engine = _StepLimits(model)
                    encoded = model.encode(source[None, :])
                    search.hrt(engine, encoded, length, options.search, k, model.config["banned"])
                    assert runtime.limits == engine.limits, (k, a, b, length)
                    assert 1 <= runtime.limits[0] <= cap_steps[k]


def test_translate_iter_on_an_open_file_is_hrt_translate_on_it(exported_tiny, tmp_path, caplog):
    """An open text file's lines end in "\\n": not control characters to repair; warnings name the file."""
    translator = Translator(exported_tiny["at"])
    lines = _sentences(6, seed=5)
    lines[2] = "w4\x01 w5"  # one line that does need repair
    path = tmp_path / "in.txt"
    path.write_text("\n".join(lines) + "\r\n")
    with caplog.at_level(logging.WARNING), open(path, encoding="utf-8") as f:
        out = list(translator.translate_iter(f, beam=1, max_len_b=5))
    rc, cli_out, _ = _cli(exported_tiny["at"], "--input", path, "--beam", "1", "--max-len-b", "5")
    assert rc == 0 and out == cli_out.split("\n")[:-1]
    repaired = [r.getMessage() for r in caplog.records if "control" in r.getMessage()]
    assert len(repaired) == 1 and repaired[0].startswith(f"{path}, line 3:"), repaired


def test_config_json_is_checked_against_the_graphs(exported_tiny, tmp_path):
    """config.json is refused at load, naming what disagrees: without its file list, or with
    declared positions, chunk sizes, symbols or shapes that are not the graphs' (each graph
    carries the declared values in its metadata since export version 5)."""
    config = json.loads(open(os.path.join(exported_tiny["hrt"], "config.json")).read())
    encoder = onnxruntime.InferenceSession(os.path.join(exported_tiny["hrt"], config["graphs"]["encoder"]))
    assert json.loads(encoder.get_modelmeta().custom_metadata_map[DECLARED_KEY])["trained_chunk_sizes"] == [2, 3]
    edits = [
        ({k: v for k, v in config.items() if k != "files"}, r"config.json has no file list \('files'\)"),
        (
            {**config, "trained_chunk_sizes": [2]},
            r"disagrees with its graphs on trained_chunk_sizes \(config.json \[2\]",
        ),
        ({**config, "max_source_positions": 4096}, r"on max_source_positions \(config.json 4096, encoder.onnx 1024\)"),
        (
            {**config, "eos": 3, "unk": 2},
            r"on eos \(config.json 3, encoder.onnx 2\), unk \(config.json 2, encoder.onnx 3\)",
        ),
        # every graph's declared values are compared before the encoder's shapes (check_shapes: folders of
        # versions 3 and 4, whose graphs carry none)
        (
            {**config, "heads": config["heads"] * 2},
            rf"on heads \(config.json {config['heads'] * 2}, encoder.onnx {config['heads']}\)",
        ),
        ({**config, "layers": config["layers"] + 1}, rf"on layers \(config.json {config['layers'] + 1}, encoder.onnx"),
    ]
    for i, (edited, message) in enumerate(edits):
        folder = _damaged(exported_tiny["hrt"], tmp_path, f"edited{i}")
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ValueError, match=message):
            Translator(str(folder))
    rc, out, err = _cli(str(folder), input_bytes=b"w1\n")
    assert rc == 2 and out == "" and "on layers" in err and "Traceback" not in err
    older = _damaged(exported_tiny["hrt"], tmp_path, "older")  # a version-4 config over stamped graphs: still compared
    (older / "config.json").write_text(json.dumps({**config, "version": 4, "max_source_positions": 4096}))
    with pytest.raises(ValueError, match="on max_source_positions"):
        Translator(str(older))


def test_min_len_beyond_the_limit_is_refused_before_anything_is_read(exported_tiny, tmp_path):
    """min_len beyond stage I's max_len_b // k is refused up front, in one line, by the API and
    the command line (fairseq's bare message once came mid-stream); with max_len_a > 0 the limit
    follows the batch, and the message names the batch's first line."""
    translator = Translator(exported_tiny["hrt"])
    with pytest.raises(ValueError, match=r"min_len 150 > 100, the longest output of stage I at chunk size 2"):
        translator.translate(["w4"], min_len=150, chunk_size=2)
    assert translator.translate(["w4"], min_len=150, max_len_b=150, chunk_size=1, beam=1)  # AT mode reaches 150
    path = tmp_path / "in.txt"
    path.write_text("w4 w5\n" * 3)
    rc, out, err = _cli(exported_tiny["hrt"], "--input", path, "--min-len", "150", "--chunk-size", "2")
    assert rc == 2 and out == "" and "min_len 150 > 100" in err and "Traceback" not in err
    lines = ["w4 w5 w6", "w7"]
    with pytest.raises(ValueError, match=r"^input, line 1 \(and 1 more lines of its batch\): min_len cannot be"):
        translator.translate(lines, min_len=5, max_len_a=0.5, max_len_b=1, chunk_size=1, beam=1)


# ------------------------------------------------------------------ one line per refusal (issue 77)


def test_negative_values_of_numeric_flags_are_joined_to_their_flag():
    numeric, flags = {"--lenpen", "--beam"}, {"--lenpen", "--beam", "--input", "-h", "--help"}
    assert joined_values(["F", "--lenpen", "-inf"], numeric, flags) == ["F", "--lenpen=-inf"]
    assert joined_values(["--len", "-1e3", "--beam", "2"], numeric, flags) == ["--len=-1e3", "--beam", "2"]
    assert joined_values(["--lenpen", "--beam", "2"], numeric, flags) == ["--lenpen", "--beam", "2"]  # a flag
    assert joined_values(["--input", "-x"], numeric, flags) == ["--input", "-x"]  # not a numeric flag
    assert joined_values(["--", "--lenpen", "-1"], numeric, flags) == ["--", "--lenpen", "-1"]
    assert joined_values(["--lenpen"], numeric, flags) == ["--lenpen"]
    assert number_of("2.5", int) == "2.5" and number_of("-inf", float) == float("-inf") and number_of(3, int) == 3
    assert CPUS == usable_cpus() >= 1


def _said(err):
    """stderr's lines but the logged warnings (the tiny folders have no SentencePiece model: a warning at load)."""
    return [line for line in err.splitlines() if not line.startswith("WARNING | ")]


def _one_line_refusal(rc, out, err, code=2):
    """A refusal as an operator should see it: exit ``code``, nothing printed, one line said."""
    return rc == code and out == "" and len(_said(err)) == 1 and "Traceback" not in err and "usage:" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--beam", "2.5"), "--beam must be an integer from 1 to 256 (the beam size; HRT's b_at), got '2.5'"),
        (("--lenpen", "-inf"), "--lenpen must be a finite number from -10 to 10 (the length penalty), got -inf"),
        (("--unkpen", "-1e9"), "--unkpen must be a finite number from -1000 to 1000"),
        (("--threads", str(CPUS + 1)), f"--threads must be an integer from 1 to {CPUS} ("),
        (("--threads", "1024"), f"at most the {CPUS} CPUs this process may use), got 1024"),
        (("--min-len", "2000"), "min_len 2000 > 510, the longest output the model's 1024 target positions allow"),
        (("--min-len", "300"), "(max_len_b // 2); lower min_len or raise max_len_b to 600"),
        (("--bogus",), "unrecognized arguments: --bogus (see hrt-translate --help)"),
        (("--lenpen",), "argument --lenpen: expected one argument (see hrt-translate --help)"),
    ],
)
def test_each_refusal_is_one_line(exported_tiny, args, message):
    rc, out, err = _cli(exported_tiny["hrt"], *args, input_bytes=b"w4\n")
    assert _one_line_refusal(rc, out, err) and _said(err)[0].startswith("hrt-translate: error: ") and message in err, (
        err
    )


def test_a_missing_folder_is_one_line_and_a_negative_lenpen_works(exported_tiny):
    rc, out, err = _cli(input_bytes=b"")
    assert _one_line_refusal(rc, out, err), err
    assert err == "hrt-translate: error: the following arguments are required: folder (see hrt-translate --help)\n"
    for lenpen in (("--lenpen", "-0.5"), ("--lenpen=-0.5",)):
        rc, out, err = _cli(exported_tiny["hrt"], *lenpen, "--beam", "2", "--max-len-b", "4", input_bytes=b"w4\nw5\n")
        assert rc == 0 and len(out.splitlines()) == 2 and _said(err) == [], err
    with pytest.raises(ValueError, match=rf"threads must be an integer from 1 to {CPUS} .*CPUs.*got {CPUS + 1}"):
        Translator(exported_tiny["hrt"], threads=CPUS + 1)


def _a_bug(*args, **kwargs):
    raise TypeError("a bug inside the runtime")


@pytest.mark.parametrize(
    "cli_main, argv, refusal",
    [
        (translate_command.cli_main, ["--beam", "0"], "hrt-translate: error: --beam must be an integer from 1 to 256"),
        (serve.cli_main, ["--max-batch", "0"], "hrt-serve: error: --max-batch must be an integer from 1 to"),
    ],
    ids=["hrt-translate", "hrt-serve"],
)
def test_only_refusals_are_one_line_a_runtime_bug_keeps_its_traceback(
    exported_tiny, monkeypatch, capsys, cli_main, argv, refusal
):
    """The command lines turn the runtime's refusals (:class:`hrt_runtime.errors.Refused`) into
    one line, and nothing else: a ``TypeError`` raised inside the runtime (here by
    ``ExportedModel.check_graphs``, replaced in this process) leaves ``cli_main`` as it was
    raised, so Python prints its traceback, instead of becoming a line that hides where it came from."""
    folder = exported_tiny["hrt"]
    with pytest.raises(SystemExit) as exit_:
        cli_main([folder, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(_said(err)) == 1 and _said(err)[0].startswith(refusal), err
    with pytest.raises(SystemExit) as exit_:  # a missing folder is a refusal too
        cli_main([folder + "-missing"])
    assert exit_.value.code == 2 and "no such folder" in capsys.readouterr().err
    monkeypatch.setattr(ExportedModel, "check_graphs", _a_bug)
    with pytest.raises(TypeError, match="a bug inside the runtime") as bug:
        cli_main([folder])
    assert not isinstance(bug.value, Refused) and bug.traceback[-1].name == "_a_bug"
    assert "error" not in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_is_one_line(exported_tiny):
    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "hrt_runtime", exported_tiny["hrt"], "--beam", "1", "--max-len-b", "4"],
            input=b"w4\n",
            stdout=full,
            stderr=subprocess.PIPE,
            cwd=str(REPO),
            env=cli_env(),
            timeout=120,
        )
    said = _said(proc.stderr.decode())
    assert proc.returncode == 1 and said == ["hrt-translate: error: cannot write the output: No space left on device"]


def _sigint_as_in_a_terminal():
    """The child takes SIGINT as a foreground command does, whatever this process was started
    with: a background job of a non-interactive shell (``pytest ... &`` in a script) inherits
    SIGINT ignored (POSIX), Python then leaves it ignored, and the command rightly goes on
    reading, so a Ctrl-C test would see exit 0 (issue 88, item 7)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _greedy_command_as_in_a_terminal(folder, stdout):
    """hrt-translate at beam 1 reading a pipe, its SIGINT at the default as in a terminal."""
    return _runtime(
        folder,
        "--beam",
        "1",
        "--max-len-b",
        "4",
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=subprocess.PIPE,
        preexec_fn=_sigint_as_in_a_terminal,
    )


def _interrupted_after_a_first_line(folder, close_input):
    """Write a line, read its translation, send SIGINT, then either close the input at once
    (``close_input``: the Ctrl-C lands as the input ends) or keep it open until the command
    has exited (only the signal can end it): (exit code, first line, rest of stdout, stderr)."""
    proc = _greedy_command_as_in_a_terminal(folder, stdout=subprocess.PIPE)
    with proc:
        try:
            proc.stdin.write(b"w4\n")
            proc.stdin.flush()
            first = proc.stdout.readline()  # translated and printed: the command now reads on
            proc.send_signal(signal.SIGINT)  # delivered before the input can end: kill() has returned
            if close_input:
                proc.stdin.close()
            proc.wait(timeout=120)  # a guard against a hang, not a duration
            return proc.returncode, first, proc.stdout.read(), proc.stderr.read().decode()
        finally:
            proc.kill()


@pytest.mark.parametrize("close_input", [False, True], ids=["input-open", "as-the-input-ends"])
def test_ctrl_c_keeps_the_output_and_is_one_line(exported_tiny, close_input):
    """SIGINT after a first translated line: what was printed stays, one line, exit 130, never a
    success, whether the input then stays open or ends at once."""
    rc, first, rest, err = _interrupted_after_a_first_line(exported_tiny["hrt"], close_input)
    assert first.strip() and rest == b""
    assert rc == 130 and _said(err) == ["hrt-translate: interrupted"], err


def _bytes_waiting(fd):
    waiting = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, waiting)
    return waiting[0]


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="pipe sizes are Linux's")
def test_ctrl_c_while_the_output_is_blocked_keeps_what_was_written(exported_tiny):
    """SIGINT while the command waits to write (its output pipe full, the reader not reading),
    then a reader that reads again: exit 130, one line, and the output is a prefix of the
    translation (what the command had written or buffered), not lost and not reported as done."""
    folder = exported_tiny["hrt"]
    lines = _sentences(2000, seed=4)
    expected = "".join(line + "\n" for line in Translator(folder).translate(lines, beam=1, max_len_b=4))
    read_end, write_end = os.pipe()
    size = fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    assert len(expected) > 2 * size
    proc = _greedy_command_as_in_a_terminal(folder, stdout=write_end)
    os.close(write_end)
    with proc, os.fdopen(read_end, "rb") as output:
        try:
            proc.stdin.write("".join(line + "\n" for line in lines).encode())
            proc.stdin.flush()
            while _bytes_waiting(read_end) < size:  # the pipe fills: the command then waits to write
                assert proc.poll() is None, proc.stderr.read()
                select.select([], [], [], 0.01)
            proc.send_signal(signal.SIGINT)
            out = output.read().decode()  # read again: the command's last flush can end
            proc.wait(timeout=120)  # a guard against a hang, not a duration
            err = proc.stderr.read().decode()
        finally:
            proc.kill()
    assert proc.returncode == 130 and _said(err) == ["hrt-translate: interrupted"], err
    assert len(out) >= size and expected.startswith(out)


# a real SIGINT sent by the command to itself as it starts importing a module: at a known phase
# whatever the machine's speed (numpy, sentencepiece: the imports of the runtime; onnxruntime:
# the model's load, which imports it)
_SIGINT_AT_IMPORT = """
import os, signal, sys

class SigintAt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintAt())
{entry}
"""


def console_script(name: str) -> str:
    """Python code that runs the runtime's console script ``name`` as pip's wrapper calls it."""
    script = tomllib.loads((REPO / "runtime" / "pyproject.toml").read_text())["project"]["scripts"][name]
    module, _, attr = script.partition(":")
    return f"from {module} import {attr}; sys.exit({attr}())"


def run_with_sigint_at_import(module: str, entry: str, args, input: bytes = b"") -> subprocess.CompletedProcess:
    """The command ``entry`` (Python code) run with ``args``, sent SIGINT as it starts importing
    ``module``, with SIGINT taken as a command in a terminal takes it."""
    return subprocess.run(
        [sys.executable, "-c", _SIGINT_AT_IMPORT.format(module=module, entry=entry), *args],
        input=input,
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        timeout=120,
        preexec_fn=_sigint_as_in_a_terminal,
    )


def _entries():
    """``python -m hrt_runtime`` and hrt-translate's console script."""
    return {
        "python -m hrt_runtime": "import runpy; runpy.run_module('hrt_runtime', run_name='__main__', alter_sys=True)",
        "console script": console_script("hrt-translate"),
    }


@pytest.mark.parametrize("module", ["numpy", "sentencepiece", "onnxruntime"])
@pytest.mark.parametrize("entry", ["python -m hrt_runtime", "console script"])
def test_ctrl_c_while_starting_is_one_line(exported_tiny, module, entry):
    """SIGINT while the command imports its libraries or loads the model: one line, exit 130,
    no traceback, nothing printed (the entry's imports are light: hrt_runtime.translate_command)."""
    args = [exported_tiny["hrt"], "--beam", "1", "--max-len-b", "4"]
    proc = run_with_sigint_at_import(module, _entries()[entry], args, input=b"w4\n")
    err = proc.stderr.decode()
    assert proc.returncode == 130 and proc.stdout == b"", err
    assert _said(err) == ["hrt-translate: interrupted"], err


def test_input_may_be_any_readable_path_but_a_folder(exported_tiny, tmp_path):
    """--input /dev/stdin, a pipe named /dev/fd/N (bash's ``<(cmd)``), a FIFO and /dev/null are
    read as a file is; a missing path is still one line."""
    folder = exported_tiny["at"]
    lines = _sentences(5, seed=3)
    expected = Translator(folder).translate(lines, beam=1, max_len_b=5)
    data = ("\n".join(lines) + "\n").encode()
    args = (folder, "--beam", "1", "--max-len-b", "5")
    rc, out, err = _cli(*args, "--input", "/dev/stdin", input_bytes=data)
    assert rc == 0 and out.split("\n")[:-1] == expected, err
    rc, out, err = _cli(*args, "--input", os.devnull, input_bytes=data)
    assert rc == 0 and out == "" and _said(err) == [], err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read_end, write_end = os.pipe()
    for path, fds in ((f"/dev/fd/{read_end}", (read_end,)), (str(fifo), ())):
        proc = _runtime(
            *args,
            "--input",
            path,
            pass_fds=fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        if fds:
            os.close(read_end)
            writer = os.fdopen(write_end, "wb")
        else:
            writer = open(fifo, "wb")  # opens once the command opens it to read
        with writer:
            writer.write(data)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.decode().split("\n")[:-1] == expected, err
    rc, out, err = _cli(*args, "--input", tmp_path / "absent.txt")
    assert _one_line_refusal(rc, out, err) and f"--input {tmp_path / 'absent.txt'}: no such file" in err
