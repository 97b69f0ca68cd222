"""--decoder-engine onnxruntime and the exported folder: token-identical to the lean engine."""
import pytest
import torch

from tests.hrt_fixtures import build_generator, make_sample, random_tiny_models
from tests.test_lean import RAGGED, assert_same_hypotheses

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "onnx")


@pytest.fixture(autouse=True)
def onnx_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "onnx-cache"))


ENGINE_CASES = [
    ("at", ("--beam", "1")),
    ("at", ("--beam", "5")),
    ("at", ("--beam", "4", "--lenpen", "0.6", "--min-len", "3", "--unkpen", "0.5", "--max-len-a", "0.5")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "5")),
    ("hrt", ("--decode-chunk-size", "2", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "3", "--beam", "4", "--b-nat", "2")),
    ("hrt", ("--decode-chunk-size", "by-length", "--beam", "2")),
]


@pytest.mark.parametrize("which,flags", ENGINE_CASES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_onnxruntime_equals_lean(random_models, which, flags):
    data_dir, task, hrt, at = random_models
    model = hrt if which == "hrt" else at
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "lean")
    _, ours = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime")
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))
