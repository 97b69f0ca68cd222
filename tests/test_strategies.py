"""--decoding: the strategy registry picks the model's default and refuses mismatches."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_hrt.generation.hrt_generator import HRTGenerator
from fairseq_hrt.generation.hypotheses import select_rows
from fairseq_hrt.generation.lean import LeanSequenceGenerator, TorchBackend
from fairseq_hrt.generation.mask_predict import MaskPredictGenerator
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES
from hrt_runtime.search import length_buckets
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("strategies"))
    return data_dir, {
        arch: build_task_and_model(data_dir, arch=arch)[1] for arch in ("hrt_tiny", "at_tiny", "cmlm_tiny")
    }


def test_registry_has_the_strategies():
    assert {"beam", "hrt", "mask-predict"} <= set(DECODING_STRATEGIES)


@pytest.mark.parametrize(
    "arch,decoding,expected",
    [
        ("hrt_tiny", "auto", HRTGenerator),
        ("hrt_tiny", "beam", HRTGenerator),
        ("at_tiny", "auto", SequenceGenerator),
        ("at_tiny", "beam", SequenceGenerator),
        ("cmlm_tiny", "auto", MaskPredictGenerator),
        ("cmlm_tiny", "mask-predict", MaskPredictGenerator),
    ],
)
def test_auto_and_named_strategies(models, arch, decoding, expected):
    data_dir, by_arch = models
    _, gen = build_generator(data_dir, by_arch[arch], "--decoding", decoding, "--decoder-engine", "fairseq")
    assert isinstance(gen, expected)


def test_lean_is_the_default_engine(models):
    data_dir, by_arch = models

    _, gen = build_generator(data_dir, by_arch["at_tiny"])
    assert isinstance(gen, LeanSequenceGenerator)
    _, gen = build_generator(data_dir, by_arch["hrt_tiny"], "--decode-chunk-size", "2")
    assert isinstance(gen, LeanSequenceGenerator) and gen.chunk_size == 2  # both stages on lean


def test_beam_on_hrt_model_is_at_mode(models):
    data_dir, by_arch = models
    _, gen = build_generator(data_dir, by_arch["hrt_tiny"], "--decoding", "beam")
    assert gen.chunk_size == 1


@pytest.mark.parametrize(
    "arch,flags,message",
    [
        ("at_tiny", ("--decoding", "hrt"), "needs an HRT model"),
        ("at_tiny", ("--decoding", "mask-predict"), "length predictor"),
        ("cmlm_tiny", ("--decoding", "beam"), "no left-to-right decoder"),
        ("cmlm_tiny", ("--decoding", "hrt"), "needs an HRT model"),
        ("hrt_tiny", ("--decoding", "beam", "--decode-chunk-size", "2"), "AT mode"),
        (
            "at_tiny",
            ("--decoder-engine", "lean", "--no-repeat-ngram-size", "2"),
            "does not support --no-repeat-ngram-size",
        ),
        ("hrt_tiny", ("--decoder-engine", "lean", "--sampling"), "does not support --sampling"),
        ("at_tiny", ("--print-alignment",), "does not support --print-alignment"),
    ],
)
def test_mismatches_are_refused(models, arch, flags, message):
    data_dir, by_arch = models
    with pytest.raises(ValueError, match=message):
        build_generator(data_dir, by_arch[arch], *flags)


def test_length_buckets_bound_padding():
    lengths = [10, 3, 101, 12, 4, 11, 82, 3]
    buckets = length_buckets(lengths, 0.25)
    assert sorted(r for b in buckets for r in b) == list(range(len(lengths)))
    for b in buckets:
        shortest = min(lengths[r] for r in b)
        assert max(lengths[r] for r in b) <= 1.25 * shortest + 1
    # the two runaway skeletons do not share a group with the short ones
    assert [sorted(lengths[r] for r in b) for b in buckets] == [[3, 3, 4], [10, 11, 12], [82, 101]]


def test_select_rows_keeps_per_row_entries(models):
    data_dir, by_arch = models
    task, _gen = build_generator(data_dir, by_arch["at_tiny"], "--decoder-engine", "fairseq")
    sample = make_sample(task, [[1, 2], [3, 4, 5], [6]])
    sub = select_rows(sample, [2, 0])
    assert sub["id"].tolist() == [2, 0]
    assert sub["net_input"]["src_tokens"].equal(sample["net_input"]["src_tokens"][[2, 0]])


class FixedSkeletons:
    """A stage I that returns given skeletons (of very different lengths)."""

    last_vocab = None

    def __init__(self, model, skeletons, backend):
        self.model, self.skeletons, self.backend = model, skeletons, backend
        self.last_encoded = None

    def generate(self, models, sample, bos_token=None):
        self.last_encoded = self.backend.encoding(self.model.encoder(**sample["net_input"]))
        return self.skeletons


def test_stage2_length_buckets_give_the_one_pass_output(models):
    """Stage II in groups of similar length = stage II over the whole padded batch."""
    data_dir, by_arch = models
    model = by_arch["hrt_tiny"]
    task, _ = build_generator(data_dir, model)
    d = task.target_dictionary
    torch.manual_seed(0)
    lengths = [[3, 2], [40, 38], [5, 4], [12, 3], [41, 1]]
    skeletons = [
        [
            {
                "tokens": torch.cat([torch.randint(4, 40, (n - 1,)), torch.tensor([d.eos()])]),
                "positional_scores": -torch.rand(n),
            }
            for n in pair
        ]
        for pair in lengths
    ]
    backend = TorchBackend(model, d, task.chunk_start_idx, task.mask_idx)
    stage1 = FixedSkeletons(model, skeletons, backend)
    sample = make_sample(task, [[1, 2, 3]] * len(lengths))

    def decode(bucket_padding):
        gen = HRTGenerator(
            lambda k: stage1,
            model,
            d,
            task.chunk_start_idx,
            task.mask_idx,
            chunk_size=2,
            b_at=2,
            len_penalty=1.0,
            b_nat=2,
            bucket_padding=bucket_padding,
            backend=backend,
        )
        return gen.generate([model], sample)

    one_pass, grouped = decode(float("inf")), decode(0.0)
    assert len(length_buckets([h["tokens"].numel() for hs in skeletons for h in hs], 0.0)) == 6
    for a, b in zip(one_pass, grouped):
        assert [h["tokens"].tolist() for h in a] == [h["tokens"].tolist() for h in b]
        for x, y in zip(a, b):
            assert float(x["score"]) == pytest.approx(float(y["score"]), abs=1e-5)
