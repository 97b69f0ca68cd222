"""Input text is read one way everywhere (runtime/hrt_runtime/text_input.py): bad bytes, control
characters, NUL, blank and huge lines, any script. Unit tests of the reader, of the task's
repair of fairseq-interactive's lines, and end to end through fairseq-interactive with
SentencePiece and ``python -m fairseq_hrt.distill`` on a tiny trained model."""

import io
import logging
import os
import re
import subprocess
import sys

import pytest

from fairseq_hrt.testing.tiny_runs import REPO, USER_DIR, cli_env, make_tiny_spm_data, run_cli, train_args
from hrt_runtime import text_input
from hrt_runtime.text_input import CONTROL, NUL, REPLACEMENT_CHARACTER, UNDECODABLE, InputTextError
from tests.hrt_fixtures import build_task_and_model
from tests.tiny_data import hyp_lines

MIXED = "Ein Mann 👨‍👩‍👧 läuft — 東京 Москва مرحبا שלום नमस्ते ½ café"


# --------------------------------------------------------------------------- pure parts


def test_valid_text_of_any_script_passes_unchanged():
    for text in (MIXED, "", "     ", "a\tb", "x" * 100_000, "\u00a0non-breaking\u3000ideographic space"):
        assert text_input.clean_text(text) == (text, [])
        assert text_input.decode_line(text.encode("utf-8")) == (text, text_input.LineProblems())


def test_invalid_utf8_is_replaced_and_located():
    text, problems = text_input.decode_line(b"hello \xff\xfe world")
    assert text == f"hello {REPLACEMENT_CHARACTER}{REPLACEMENT_CHARACTER} world"
    assert problems.kinds == [UNDECODABLE] and problems.first_bad_byte == 6
    assert "byte 6" in problems.describe() and "U+FFFD" in problems.describe()
    # a truncated multi-byte character (an emoji cut in half) at the end of a line
    text, problems = text_input.decode_line("ok 😀".encode("utf-8")[:-2])
    assert text == f"ok {REPLACEMENT_CHARACTER}" and problems.first_bad_byte == 3
    with pytest.raises(InputTextError, match=r"byte 6"):
        text_input.decode_line(b"hello \xff world", errors="strict")


def test_surrogates_from_python_decoding_become_replacement_characters():
    # what stdin gives in a C.UTF-8 locale (surrogateescape): the input that made
    # SentencePiece raise "TypeError: not a string"
    escaped = b"hello \xff world".decode("utf-8", errors="surrogateescape")
    text, kinds = text_input.clean_text(escaped)
    assert text == f"hello {REPLACEMENT_CHARACTER} world" and kinds == [UNDECODABLE]
    text.encode("utf-8")  # encodable again


def test_nul_is_removed_and_control_characters_become_spaces():
    text, problems = text_input.decode_line(b"h\x00e\x00l\x00l\x00o\x00 a\x07b\x1b[31mc\x7fd\xc2\x85e\rf\tg")
    assert text == "hello a b [31mc d e f\tg"  # tab kept, \r inside a line is a control character
    assert problems.kinds == [NUL, CONTROL]
    assert text_input.clean_text("a\u2028b\u2029c") == ("a b c", [])  # separators: spaces, no warning


def test_reader_splits_at_newline_only_and_reports_file_and_line(tmp_path, caplog):
    path = tmp_path / "in.txt"
    path.write_bytes(
        "\ufeffbom line\r\n".encode("utf-8")
        + b"cr\rinside\n"
        + b"bad \xff\n"
        + b"   \n"
        + b"\n"
        + b"nul\x00\n"
        + "last 😀 no newline".encode("utf-8")
    )
    with caplog.at_level(logging.WARNING, logger="fairseq_hrt.text_input"):
        lines = text_input.read_lines(str(path))
    # 7 lines as `wc -l` + 1 counts them: a lone \r does not split a line (text mode would)
    assert lines == ["bom line", "cr inside", f"bad {REPLACEMENT_CHARACTER}", "   ", "", "nul", "last 😀 no newline"]
    warnings = [r.getMessage() for r in caplog.records]
    assert any(f"{path}, line 2: control characters" in w for w in warnings), warnings
    assert any(f"{path}, line 3: bytes that are not valid UTF-8" in w for w in warnings), warnings
    assert any(f"{path}, line 6: NUL bytes removed" in w for w in warnings), warnings
    assert len(warnings) == 3
    with pytest.raises(InputTextError, match=re.escape(f"{path}, line 3: bytes that are not valid UTF-8")):
        text_input.read_lines(str(path), errors="strict")


def test_many_bad_lines_are_counted_not_all_listed(caplog):
    stream = io.BytesIO(b"bad \xff\n" * 25)
    with caplog.at_level(logging.WARNING, logger="fairseq_hrt.text_input"):
        lines = list(text_input.iter_lines(stream, name="big.txt", max_warnings=3))
    assert len(lines) == 25
    messages = [r.getMessage() for r in caplog.records]
    assert sum("big.txt, line" in m for m in messages) == 3
    assert any("25 of 25 lines were repaired" in m for m in messages), messages


def test_a_100k_character_line_is_read_whole():
    line = ("word " * 20_000).strip()
    assert text_input.read_lines(io.BytesIO(line.encode() + b"\nnext\n")) == [line, "next"]


# ------------------------------------------------------ fairseq-interactive and the task


def test_task_translates_a_line_its_tokenizer_refuses_as_empty(tmp_path, caplog):
    task, _ = build_task_and_model(str(tmp_path))

    def encode_fn(x):
        if "boom" in x:
            raise RuntimeError("tokenizer exploded")
        return x

    eos = task.source_dictionary.eos()
    with caplog.at_level(logging.WARNING):
        tokens, lengths = task.get_interactive_tokens_and_lengths(["w1 w2", "w3"], encode_fn)
        tokens, lengths = task.get_interactive_tokens_and_lengths(["w1 boom", "w2 \udcff w3", "w4\x00w5"], encode_fn)
    assert lengths == [1, 4, 2]  # the refused line 3 is empty (</s> only); the others translate
    assert tokens[0].tolist() == [eos]
    messages = [r.getMessage() for r in caplog.records]
    assert any("input line 3 could not be tokenized (RuntimeError: tokenizer exploded)" in m for m in messages)
    assert any("input line 4" in m and UNDECODABLE in m for m in messages), messages
    assert any("input line 5" in m and NUL in m for m in messages), messages


# ---------------------------------------------------------------- end to end (subprocess)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny AT model on SentencePiece pieces (3 updates: what it translates does not matter)."""
    root = tmp_path_factory.mktemp("spm_model")
    data = make_tiny_spm_data(root)
    run_cli(train_args(data.bin_dir, root / "ck", "--hrt-mode", "at", arch="at_tiny", max_update=3))
    return data, root / "ck" / "checkpoint_last.pt", root / "spm" / "spm.model"


BAD_SESSION = [
    b"a man rides a horse .",
    b"hello \xff\xfe world",  # not UTF-8: ended the session with TypeError: not a string
    b"nul\x00here and a \x07bell \x1b[31m",
    b"      ",
    ("a horse " * 12_500).encode(),  # 100k characters
    MIXED.encode("utf-8"),
    b"two dogs play .",
]


def _interactive(model, extra, stdin: bytes):
    data, ckpt, spm = model
    args = [
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
        "--beam",
        "2",
        "--bpe",
        "sentencepiece",
        "--sentencepiece-model",
        str(spm),
        "--buffer-size",
        "2",
        "--batch-size",
        "2",
        "--max-source-positions",
        "64",
        *extra,
    ]
    cmd = [os.path.join(os.path.dirname(sys.executable), "fairseq-interactive"), *args]
    # fairseq reads stdin with Python's decoding: surrogateescape keeps bad bytes for the task to
    # repair (docs/compatibility.md; with strict decoding fairseq stops at the first bad line)
    env = cli_env({"PYTHONIOENCODING": "utf-8:surrogateescape", "LC_ALL": "C.UTF-8"})
    proc = subprocess.run(cmd, input=stdin, cwd=str(REPO), env=env, capture_output=True, timeout=300)
    return proc.returncode, proc.stdout.decode("utf-8", "replace") + proc.stderr.decode("utf-8", "replace")


@pytest.mark.slow
def test_interactive_session_survives_bad_lines(spm_model):
    """fairseq-interactive reading stdin as docs/compatibility.md says (surrogateescape): every
    line is translated, the bad ones repaired by the task with a warning naming the line."""
    rc, out = _interactive(spm_model, [], b"\n".join(BAD_SESSION) + b"\n")
    assert rc == 0, out[-4000:]
    assert "Traceback" not in out and "not a string" not in out
    hyps = hyp_lines(out)
    assert sorted(hyps) == list(range(len(BAD_SESSION))), out[-4000:]  # every line, also after the bad ones
    assert hyps[3] == ""  # a line of spaces is an empty sentence
    assert f"input line 2: {UNDECODABLE} repaired" in out
    assert f"input line 3: {NUL}, {CONTROL} repaired" in out
    assert "truncated" in out  # the 100k-character line, at --max-source-positions
    sources = dict(re.findall(r"^S-(\d+)\t(.*)$", out, re.M))
    assert len(sources["4"].split()) == 63  # 63 pieces + </s> = --max-source-positions 64


@pytest.mark.slow
def test_distill_replaces_bad_bytes_naming_file_and_line_or_stops_with_strict(spm_model, tmp_path):
    data, ckpt, _ = spm_model
    src = tmp_path / "src.en"
    pieces = (data.bin_dir.parent / "spm" / "valid.en").read_bytes().splitlines()[:4]
    src.write_bytes(b"\n".join([pieces[0], pieces[1] + b" \xff\xfe", b"", pieces[2] + b"\x00\x07", pieces[3]]) + b"\n")
    out = tmp_path / "out.de"
    cmd = [
        "fairseq_hrt.distill",
        "--data",
        data.bin_dir,
        "--path",
        ckpt,
        "--src",
        src,
        "--out",
        out,
        "--beam",
        "1",
        "--cpu",
        "--threads",
        "1",
        "--no-progress-bar",
        "--max-len-b",
        "10",
    ]
    log = run_cli(cmd).stdout
    assert "Traceback" not in log
    assert f"{src}, line 2: bytes that are not valid UTF-8 (first at byte {len(pieces[1]) + 1}" in log
    assert f"{src}, line 4: NUL bytes removed; control characters replaced by spaces" in log
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 6 and lines[2] == "" and lines[-1] == ""  # 5 lines, aligned with the source

    out.unlink()
    proc = run_cli(cmd + ["--input-errors", "strict"], check=False)
    assert proc.returncode != 0 and not out.exists()
    assert f"{src}, line 2: bytes that are not valid UTF-8 at byte {len(pieces[1]) + 1}" in proc.stdout
    assert "Traceback" not in proc.stdout
