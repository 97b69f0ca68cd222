"""--decoding greedy-at-mode: a strategy added by one module (no other file names it)."""

import pytest

from fairseq_hrt.generation.strategies import decoding_choices
from tests.hrt_fixtures import build_generator, make_sample, random_tiny_models

RAGGED = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "greedy_at_mode")


def test_registered_by_its_module_alone():
    assert "greedy-at-mode" in decoding_choices()


@pytest.mark.parametrize("arch", ["at", "hrt"])
@pytest.mark.parametrize("engine", ["lean", "fairseq"])
def test_equals_beam_1_whatever_beam_says(tiny, arch, engine):
    data_dir, task, hrt, at = tiny
    model = {"at": at, "hrt": hrt}[arch]
    sample = make_sample(task, RAGGED)
    flags = ("--decoder-engine", engine, "--max-len-b", "8")
    _, ours = build_generator(data_dir, model, "--decoding", "greedy-at-mode", "--beam", "5", *flags)
    _, ref = build_generator(data_dir, model, "--decoding", "beam", "--beam", "1", *flags)
    got, want = task.inference_step(ours, [model], sample), task.inference_step(ref, [model], sample)
    assert [h[0]["tokens"].tolist() for h in got] == [h[0]["tokens"].tolist() for h in want]
    assert all(len(h) == 1 for h in got)  # one hypothesis: greedy, not a beam of 5


def test_refuses_an_hrt_chunk_size(tiny):
    data_dir, _, hrt, _ = tiny
    with pytest.raises(ValueError, match="AT mode"):
        build_generator(data_dir, hrt, "--decoding", "greedy-at-mode", "--decode-chunk-size", "2")
