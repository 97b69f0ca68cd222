"""benchmarks/int8_quality.py on tiny exported models: the float folder and its int8 copies (one
scale per matrix, per output column) translate the same lines, each row with its BLEU, speed and
lines equal to float; with an AT checkpoint, CTranslate2's float32 and int8 rows beside them
(decoded in a child process without PyTorch); an HRT checkpoint, which CTranslate2 cannot
convert, is one line and the ONNX Runtime rows are still measured; sources and references that
do not pair are one line."""

import json
import os

import pytest

pytest.importorskip("onnxruntime")

from benchmarks import ct2_reference, int8_quality  # noqa: E402
from benchmarks.onnx_gate import random_model  # noqa: E402
from fairseq_hrt.export.exporter import export_model  # noqa: E402
from tests.test_runtime import _sentences  # noqa: E402

needs_ct2 = pytest.mark.skipif(ct2_reference.unavailable_reason() is not None, reason="needs ctranslate2")


def _write_inputs(tmp_path, n=4, seed=21):
    lines = _sentences(n, seed=seed)
    (tmp_path / "src").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "ref").write_text("".join(line + "\n" for line in reversed(lines)))
    return ["--src", str(tmp_path / "src"), "--ref", str(tmp_path / "ref")]


def test_int8_variants_are_measured_beside_float(exported_tiny, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--folder", exported_tiny["hrt"], *_write_inputs(tmp_path)]
    assert (
        int8_quality.main(
            [*args, "--chunk-sizes", "2,1", "--beams", "1", "--rounds", "1", "--max-len-b", "6", "--out", str(out)]
        )
        == 0
    )
    report = json.loads((out / "int8_quality.json").read_text())
    rows = {(r["chunk_size"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(k, v) for k in (2, 1) for v in ("float", "int8-channel", "int8-tensor")}
    assert all(rows[(k, "float")]["equal_to_float"] == "4/4" for k in (2, 1))
    assert all(r["words_per_s"] > 0 and isinstance(r["bleu"], float) for r in rows.values())
    configs = [json.loads((out / "folders" / f"int8-{s}" / "config.json").read_text()) for s in ("channel", "tensor")]
    assert [c["int8_scales"] for c in configs] == ["channel", "tensor"]
    assert "| 2 | 1 | ONNX Runtime, int8, one scale per output column |" in (out / "int8_quality.md").read_text()

    (tmp_path / "ref").write_text("only one line\n")
    with pytest.raises(SystemExit) as refused:
        int8_quality.main([*args, "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.strip().splitlines()[-1].endswith(
        "--src has 4 lines and --ref 1: they must pair line by line"
    ), err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random tiny AT and HRT models saved as fairseq checkpoints and exported: ``(data folder,
    {"at" | "hrt": (checkpoint, folder)})``."""
    work = tmp_path_factory.mktemp("int8_quality_ct2")
    models = {}
    for name, arch, extra in (("at", "at_tiny", ["--hrt-mode", "at"]), ("hrt", "hrt_tiny", [])):
        os.makedirs(work / name)
        checkpoint = str(work / name / "checkpoint.pt")
        task, model = random_model(arch, 60, str(work), extra_args=extra, checkpoint=checkpoint)
        export_model(model, task, str(work / f"{name}-onnx"), restricted=False)
        models[name] = (checkpoint, str(work / f"{name}-onnx"))
    return str(work), models


@needs_ct2
def test_ctranslate2_rows_stand_beside_the_onnxruntime_rows(checkpoints, tmp_path, monkeypatch):
    data, models = checkpoints
    monkeypatch.chdir(tmp_path)  # paths relative to the caller's directory, not the child's
    checkpoint, folder = (os.path.relpath(path) for path in models["at"])
    out = tmp_path / "out"
    args = ["--folder", folder, *_write_inputs(tmp_path, n=6), "--ctranslate2", checkpoint, "--data", data]
    options = ["--chunk-sizes", "1", "--beams", "1,2", "--rounds", "2", "--max-len-b", "6", "--out", "out"]
    assert int8_quality.main([*args, *options]) == 0
    report = json.loads((out / "int8_quality.json").read_text())
    rows = {(r["beam"], r["variant"]): r for r in report["rows"]}
    variants = ("float", "int8-channel", "int8-tensor", "ct2-float32", "ct2-int8")
    assert set(rows) == {(b, v) for b in (1, 2) for v in variants}
    for beam in (1, 2):
        ct2 = [rows[(beam, v)] for v in ("ct2-float32", "ct2-int8")]
        assert [(r["engine"], r["compute_type"]) for r in ct2] == [("ctranslate2", "float32"), ("ctranslate2", "int8")]
        assert all(isinstance(r["bleu"], float) and r["words_per_s"] > 0 and len(r["seconds"]) == 2 for r in ct2)
        assert ct2[0]["equal_to_float"] == "6/6"  # its own float: CTranslate2's float32
        assert ct2[0]["equal_to_onnxruntime_float"].endswith("/6")
        assert all(rows[(beam, v)]["engine"] == "onnxruntime" for v in variants[:3])
    # the same model reading the same text, greedily: CTranslate2's float32 writes ONNX Runtime's float
    # translations (its beam search stops and normalizes otherwise than fairseq's: beams may differ)
    assert rows[(1, "ct2-float32")]["equal_to_onnxruntime_float"] == "6/6", rows[(1, "ct2-float32")]
    assert report["meta"]["ctranslate2"]["child_without_pytorch"] is True
    assert report["meta"]["notes"] == []
    table = (out / "int8_quality.md").read_text()
    assert "| 1 | 2 | CTranslate2, compute type int8 |" in table
    assert "| 1 | 1 | CTranslate2, compute type float32 |" in table


@needs_ct2
def test_a_checkpoint_ctranslate2_cannot_convert_is_one_line_and_the_onnxruntime_rows_stay(
    checkpoints, tmp_path, capsys
):
    data, models = checkpoints
    checkpoint, folder = models["hrt"]
    out = tmp_path / "out"
    args = ["--folder", folder, *_write_inputs(tmp_path), "--ctranslate2", checkpoint, "--data", data]
    options = ["--chunk-sizes", "2,1", "--beams", "1", "--rounds", "1", "--max-len-b", "6", "--out", str(out)]
    assert int8_quality.main([*args, *options]) == 0
    report = json.loads((out / "int8_quality.json").read_text())
    assert {(r["chunk_size"], r["variant"]) for r in report["rows"]} == {
        (k, v) for k in (2, 1) for v in ("float", "int8-channel", "int8-tensor")
    }
    (note,) = report["meta"]["notes"]
    assert note.startswith(f"--ctranslate2 {checkpoint}: ") and "hrt_tiny" in note and "\n" not in note
    assert note.endswith("no CTranslate2 rows, the ONNX Runtime rows are measured")
    assert [line for line in capsys.readouterr().err.splitlines() if "--ctranslate2" in line] == [
        f"[int8_quality] {note}"
    ]
    assert f"- {note}" in (out / "int8_quality.md").read_text()

    with pytest.raises(SystemExit) as refused:
        int8_quality.main([*args, "--chunk-sizes", "2", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.strip().splitlines()[-1].endswith(
        "--ctranslate2 decodes left to right only: add 1 to --chunk-sizes 2"
    ), err
