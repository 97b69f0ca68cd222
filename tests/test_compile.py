"""--compile: the lean engine's step on static shapes, compiled with torch.compile."""

import shutil

import pytest

from fairseq_hrt.generation.lean import LeanSequenceGenerator
from fairseq_hrt.passes import decoder_pass
from fairseq_hrt.testing.tiny_runs import run_cli
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, make_sample, random_tiny_models
from tests.test_generator import SPECIALS
from tests.test_lean import RAGGED, assert_same_hypotheses
from tests.tiny_data import hyp_lines


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "compile")


@pytest.fixture
def uncompiled(monkeypatch):
    """The static-shape step as it is, without torch.compile: what the compiler is given."""
    calls = []

    def identity(step_function):
        calls.append(step_function.__name__)
        return step_function

    monkeypatch.setattr(decoder_pass, "compile_step", identity)
    return calls


@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize("which", ["at", "hrt-at-mode", "hrt-skip-at-k2"])
def test_static_step_gives_the_lean_hypotheses(random_models, uncompiled, which, beam):
    """Self-attention over the whole cache with the future masked, the step as a tensor:
    the same hypotheses as the lean step, on a ragged batch (sentences leave the batch)."""
    _, task, hrt, at = random_models
    d = task.target_dictionary
    model = at if which == "at" else hrt
    banned = [] if which == "at" else [d.index(s) for s in SPECIALS]
    bos = task.chunk_start_idx[2] if which == "hrt-skip-at-k2" else None
    options = SearchConfig(beam=beam, max_len_b=9, len_penalty=0.8)
    ref = LeanSequenceGenerator(model, d, options, banned).generate([model], make_sample(task, RAGGED), bos_token=bos)
    static = LeanSequenceGenerator(model, d, options, banned, compile=True)
    assert_same_hypotheses(ref, static.generate([model], make_sample(task, RAGGED), bos_token=bos))
    assert uncompiled == ["static_step"]  # compiled once per engine


def test_compile_reaches_hrt_stage_one(random_models, uncompiled):
    data_dir, task, hrt, _ = random_models
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, hrt, "--max-len-b", "12", "--decode-chunk-size", "2", "--beam", "2")
    _, ours = build_generator(
        data_dir, hrt, "--max-len-b", "12", "--decode-chunk-size", "2", "--beam", "2", "--compile"
    )
    assert_same_hypotheses(ref.generate([hrt], sample), ours.generate([hrt], sample))
    assert uncompiled == ["static_step"]  # stage I's engine; stage II is one pass


def test_compile_refuses_what_it_cannot_compile_in_one_message(random_models):
    data_dir, _, hrt, at = random_models
    with pytest.raises(ValueError) as error:
        build_generator(data_dir, at, "--compile", "--decoder-engine", "fairseq", "--quantize", "int8")
    message = str(error.value)
    assert "--compile" in message and "--decoder-engine fairseq" in message and "--quantize int8" in message
    with pytest.raises(ValueError, match="--compile.*--decoding pj"):
        build_generator(data_dir, at, "--compile", "--decoding", "pj", "--beam", "1")
    with pytest.raises(ValueError, match="--compile.*--decoding hrt-spec"):
        build_generator(data_dir, hrt, "--compile", "--decoding", "hrt-spec", "--beam", "1")


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
def test_fairseq_generate_compiled_gives_the_same_translations(trained):
    """The real compiler (inductor) from the command line, on trained models: fused kernels
    may round differently, yet greedy and beam outputs stay the same."""
    data, ckpts = trained
    common = [
        "generate",
        data.bin_dir,
        "--gen-subset",
        "valid",
        "--batch-size",
        "16",
        "--user-dir",
        "fairseq_hrt",
        "--task",
        "hrt_translation",
        "--source-lang",
        "en",
        "--target-lang",
        "de",
        "--cpu",
    ]
    for ckpt, flags in (
        (ckpts["at_tiny"], ["--beam", "1"]),
        (ckpts["hrt_tiny"], ["--beam", "3", "--decode-chunk-size", "2"]),
    ):
        plain = run_cli(common + ["--path", ckpt] + flags).stdout
        compiled = run_cli(common + ["--path", ckpt, "--compile"] + flags).stdout
        assert hyp_lines(compiled) == hyp_lines(plain) and len(hyp_lines(plain)) == 40
