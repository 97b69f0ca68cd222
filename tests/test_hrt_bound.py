"""benchmarks/hrt_bound.py's delivered rows: AT greedy from the HRT model's AT mode, or from
an AT student (--at-path) where that AT mode has decayed."""

import json
import os
from pathlib import Path

import pytest

from benchmarks import hrt_bound, measure


def _bound(trained, tmp_path, *extra):
    data, ckpts = trained
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "src.txt"
    src.write_text("\n".join(data.raw("valid", "en").read_text().splitlines()[:4]) + "\n")
    out = tmp_path / "out"
    hrt_bound.main(
        [
            "--path", str(ckpts["hrt_tiny"]), "--data", str(data.bin_dir), "--engines", "lean",
            "--batches", "1", "--runs", "1", "--src", str(src), "--delivered-runs", "1", "--out", str(out), *extra,
        ]
    )  # fmt: skip
    return json.loads((out / "hrt_bound.json").read_text()), (out / "hrt_bound.md").read_text()


@pytest.mark.slow
def test_delivered_at_row_decodes_the_at_student_given(trained, tmp_path, monkeypatch):
    _, ckpts = trained
    loaded = []
    load = measure.load
    monkeypatch.setattr(measure, "load", lambda path, *a, **kw: loaded.append(str(path)) or load(path, *a, **kw))
    report, md = _bound(trained, tmp_path, "--at-path", str(ckpts["at_tiny"]))
    delivered = report["rows"][0]["delivered"]
    # the AT row from the AT student, the HRT row from the HRT model
    assert (
        delivered["at_from"] == os.path.join(Path(ckpts["at_tiny"]).parent.name, "checkpoint_last.pt")
        and str(ckpts["at_tiny"]) in loaded
    )
    assert loaded.index(str(ckpts["at_tiny"])) < len(loaded) - 1 and loaded[-1] == str(ckpts["hrt_tiny"])
    assert delivered["ratio"] == pytest.approx(
        delivered["hrt"]["words_per_second"] / delivered["at"]["words_per_second"], abs=1e-3
    )
    assert f"AT greedy: {delivered['at_from']}." in md

    loaded.clear()
    report, md = _bound(trained, tmp_path / "again")
    assert report["rows"][0]["delivered"]["at_from"] == "AT mode" and str(ckpts["at_tiny"]) not in loaded
    assert "AT greedy: AT mode." in md


def test_at_path_needs_the_delivered_run(tmp_path):
    with pytest.raises(SystemExit):
        hrt_bound.main(["--arch", "hrt_tiny", "--at-path", "at.pt", "--out", str(tmp_path)])
