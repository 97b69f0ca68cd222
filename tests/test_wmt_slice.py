"""examples/wmt/setups.py's slice sizes (``slice_of(setup, size)``) and make_slice.py's cut of
them: no slice scores a model on a line it trained on, the students of a size share one shape
(HRT and Mask-Predict fine-tune from the AT student's checkpoint), an unknown size stops with
the sizes named, and make_slice.py --size writes exactly the lines its size names."""

import importlib.util
import subprocess
import sys

import pytest

from fairseq_hrt.testing.tiny_runs import REPO, cli_env

WMT = REPO / "examples" / "wmt"
SHARED_DATA = REPO.parent / "shared" / "data"

sys.path.insert(0, str(WMT))  # make_slice.py imports setups by name
_spec = importlib.util.spec_from_file_location("wmt_setups", WMT / "setups.py")
setups = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setups)

SLICES = [(name, size) for name in sorted(setups.SETUPS) for size in setups.SLICE_SIZES]


@pytest.mark.parametrize("name,size", SLICES)
def test_no_slice_tests_on_a_line_it_trains_on(name, size):
    s = setups.slice_of(setups.SETUPS[name], size)
    assert set(s.slice_splits) == {"train", "valid", "test"}
    spans = {}
    for split, (source, start, stop) in s.slice_splits.items():
        assert 0 <= start < stop, (split, start, stop)
        spans.setdefault(source, []).append((start, stop, split))
    for source, ranges in spans.items():
        ranges.sort()
        for (_, stop, first), (start, _, second) in zip(ranges, ranges[1:]):
            assert stop <= start, f"{name} {size}: {first} and {second} share lines of {source}"


@pytest.mark.parametrize("name,size", SLICES)
def test_the_students_of_a_slice_share_the_at_students_shape(name, size):
    """HRT and Mask-Predict load the AT student's weights (--finetune-from-model): the same
    shape suffix (tiny, mini) and no arch options that would change it."""
    s = setups.slice_of(setups.SETUPS[name], size)
    shape = s.at.arch.split("_", 1)[1]
    assert s.hrt.arch == f"hrt_{shape}" and s.mp.arch == f"cmlm_{shape}"
    assert s.at.extra == s.hrt.extra == s.mp.extra == ()
    assert s.teacher.arch.split("_", 1)[1] == shape


def test_learn_is_the_default_size_and_an_unknown_size_is_refused():
    learn = setups.slice_of(setups.SETUPS["wmt14_en_de"])
    assert learn == setups.slice_of(setups.SETUPS["wmt14_en_de"], "learn")
    assert learn != setups.slice_of(setups.SETUPS["wmt14_en_de"], "smoke")
    with pytest.raises(ValueError, match="smoke, learn"):
        setups.slice_of(setups.SETUPS["wmt14_en_de"], "huge")


@pytest.mark.skipif(not (SHARED_DATA / "multi30k-en-de" / "train.de").is_file(), reason="needs ../shared/data")
@pytest.mark.parametrize("size", setups.SLICE_SIZES)
def test_make_slice_writes_the_lines_its_size_names(tmp_path, size):
    s = setups.slice_of(setups.SETUPS["wmt14_en_de"], size)
    subprocess.run(
        [sys.executable, str(WMT / "make_slice.py"), "--setup", "wmt14_en_de", "--size", size]
        + ["--data", str(SHARED_DATA), "--dest", str(tmp_path), "--train-lines", "7"],
        check=True,
        env=cli_env(),
        capture_output=True,
    )
    raw = tmp_path / s.download_setup / "raw"
    for split, (source, start, stop) in s.slice_splits.items():
        stop = min(stop, start + 7) if split == "train" else stop
        for lang in (s.src, s.tgt):
            lines = (SHARED_DATA / s.slice_data / f"{source}.{lang}").read_text(encoding="utf-8").splitlines()
            assert (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines() == lines[start:stop]
