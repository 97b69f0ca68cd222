"""benchmarks/int8_quality.py on a tiny exported model: the float folder and its int8 copies (one
scale per matrix, per output column) translate the same lines, each row with its BLEU, speed and
lines equal to float; sources and references that do not pair are one line."""

import json

import pytest

pytest.importorskip("onnxruntime")

from benchmarks import int8_quality  # noqa: E402
from tests.test_runtime import _sentences  # noqa: E402


def test_int8_variants_are_measured_beside_float(exported_tiny, tmp_path, capsys):
    lines = _sentences(4, seed=21)
    (tmp_path / "src").write_text("".join(line + "\n" for line in lines))
    (tmp_path / "ref").write_text("".join(line + "\n" for line in reversed(lines)))
    out = tmp_path / "out"
    args = ["--folder", exported_tiny["hrt"], "--src", str(tmp_path / "src"), "--ref", str(tmp_path / "ref")]
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
    assert "| 2 | 1 | int8-channel |" in (out / "int8_quality.md").read_text()

    (tmp_path / "ref").write_text("only one line\n")
    with pytest.raises(SystemExit) as refused:
        int8_quality.main([*args, "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.strip().splitlines()[-1].endswith(
        "--src has 4 lines and --ref 1: they must pair line by line"
    ), err
