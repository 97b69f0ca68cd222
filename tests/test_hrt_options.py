"""HRT decoding beyond the papers: a refinement pass of stage II (--hrt-refine-fraction),
exact AT-mode re-scoring of the candidates (--hrt-rescore) and a per-sentence fallback to AT
mode (--hrt-fallback-threshold), on random tiny models."""

import pytest
import torch

from benchmarks.hrt_quality import fill_skeleton_tensors
from fairseq_hrt import chunking
from fairseq_hrt.generation.hrt_generator import HRTGenerator, at_mode_scores
from fairseq_hrt.generation.lean import LeanSequenceGenerator
from fairseq_hrt.passes.search_rules import banned_symbols
from hrt_runtime.search import refine_counts
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample

SENTENCES = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 14]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("hrt_options"))
    task, model = build_task_and_model(data_dir, seed=7)
    return data_dir, task, model


class AtModeCounter:
    """HRTGenerator's stage I of k = 1 (its fallback to AT mode), counting the sentences it decodes."""

    def __init__(self, generator):
        self.generator, self.sentences = generator, 0

    def generate(self, models, sample, **kwargs):
        self.sentences += sample["net_input"]["src_tokens"].size(0)
        return self.generator.generate(models, sample, **kwargs)


def decode(data_dir, task, model, *flags):
    _, gen = build_generator(data_dir, model, "--max-len-b", "20", *flags)
    if isinstance(gen, HRTGenerator):  # the sentences that fell back to AT mode: gen.at_mode.sentences
        stage1, gen.at_mode = gen.stage1, AtModeCounter(gen.stage1(1))
        gen.stage1 = lambda k: gen.at_mode if k == 1 else stage1(k)
    return gen, task.inference_step(gen, [model], make_sample(task, SENTENCES))


def tokens_of(hypos):
    return [h[0]["tokens"].tolist() for h in hypos]


def test_refine_counts_round_up():
    assert refine_counts(torch.tensor([0, 1, 3, 10]), 0.25).tolist() == [0, 1, 1, 3]
    assert refine_counts(torch.tensor([4]), 1.0).tolist() == [4]


def _skeletons(task, model, data_dir):
    gen, hypos = decode(data_dir, task, model, "--decode-chunk-size", "2", "--beam", "1")
    stage1 = LeanSequenceGenerator(model, task.target_dictionary, gen.config.for_chunk_size(2), gen.banned)
    stage1 = stage1.generate([model], make_sample(task, SENTENCES), bos_token=task.chunk_start_idx[2])
    return [h[0]["tokens"] for h in stage1]


def test_refinement_repredicts_only_the_least_probable_fills(setup):
    """Re-masking every fill gives stage II's own input again (the same fill); re-masking
    some re-predicts exactly those slots from the rest, by one more decoder pass."""
    data_dir, task, model = setup
    d = task.target_dictionary
    skeleton = torch.nn.utils.rnn.pad_sequence(
        _skeletons(task, model, data_dir), batch_first=True, padding_value=d.pad()
    )
    sample = make_sample(task, SENTENCES)
    enc = model.encoder(**sample["net_input"])
    banned = torch.tensor(banned_symbols(task, model))
    args = (model, skeleton, torch.zeros(skeleton.shape), 2, enc, banned, task.mask_idx, d.eos(), d.pad())
    stage2, plain, plain_scores, _ = fill_skeleton_tensors(*args)
    _, everything, _, _ = fill_skeleton_tensors(*args, refine_fraction=1.0)
    assert torch.equal(everything, plain)
    _, half, half_scores, _ = fill_skeleton_tensors(*args, refine_fraction=0.5)
    # the expected second pass, by the decoder module: re-mask the lowest-probability half
    is_mask = stage2.tokens.eq(task.mask_idx)
    features, _ = model.decoder(
        stage2.tokens, encoder_out=enc, positions=stage2.positions, causal=False, features_only=True
    )
    lprobs = torch.log_softmax(model.decoder.output_layer(features).float(), -1)
    lprobs[..., banned] = -float("inf")
    first_scores, first = lprobs.max(-1)
    first = torch.where(is_mask, first, stage2.tokens)
    order = first_scores.masked_fill(~is_mask, float("inf")).argsort(dim=1, stable=True).argsort(dim=1)
    remask = (order < torch.as_tensor(refine_counts(is_mask.sum(1), 0.5)).unsqueeze(1)) & is_mask
    features, _ = model.decoder(
        first.masked_fill(remask, task.mask_idx),
        encoder_out=enc,
        positions=stage2.positions,
        causal=False,
        features_only=True,
    )
    lprobs = torch.log_softmax(model.decoder.output_layer(features).float(), -1)
    lprobs[..., banned] = -float("inf")
    expected = torch.where(remask, lprobs.argmax(-1), first)
    expected = chunking.truncate_at_first_eos(expected, d.eos(), d.pad())
    assert torch.equal(half, expected)
    assert bool((half != plain).any()) or bool(remask.any())  # the pass ran on some slots


def test_rescore_ranks_candidates_by_their_exact_at_mode_score(setup):
    data_dir, task, model = setup
    d = task.target_dictionary
    _, plain = decode(data_dir, task, model, "--decode-chunk-size", "2", "--beam", "3", "--b-nat", "3")
    _, rescored = decode(
        data_dir, task, model, "--decode-chunk-size", "2", "--beam", "3", "--b-nat", "3", "--hrt-rescore"
    )
    sample = make_sample(task, SENTENCES)
    for row, hypos in enumerate(rescored):
        assert sorted(h["tokens"].tolist() for h in hypos) == sorted(h["tokens"].tolist() for h in plain[row])
        enc = model.encoder(
            **{k: v[row : row + 1].expand(len(hypos), *v.shape[1:]) for k, v in sample["net_input"].items()}
        )
        scores, _ = at_mode_scores(model, enc, [h["tokens"] for h in hypos], d.eos(), d.pad(), 1.0)
        # each candidate's score: its own AT-mode log-probability over its length
        for h, s in zip(hypos, scores):
            prev = torch.cat([torch.tensor([d.eos()]), h["tokens"][:-1]]).unsqueeze(0)
            logits, _ = model.decoder(
                prev, encoder_out=model.encoder(**{k: v[row : row + 1] for k, v in sample["net_input"].items()})
            )
            own = (
                torch.log_softmax(logits.float(), -1)[0].gather(1, h["tokens"].unsqueeze(1)).sum() / h["tokens"].numel()
            )
            assert torch.allclose(h["score"], own, atol=1e-4) and torch.allclose(s, own, atol=1e-4)
        assert [float(h["score"]) for h in hypos] == sorted((float(h["score"]) for h in hypos), reverse=True)


def test_fallback_threshold_decides_per_sentence_between_k2_and_at_mode(setup):
    data_dir, task, model = setup
    _, k2 = decode(data_dir, task, model, "--decode-chunk-size", "2", "--beam", "1")
    _, at_mode = decode(data_dir, task, model, "--decode-chunk-size", "1", "--beam", "1")
    gen, never = decode(
        data_dir, task, model, "--decode-chunk-size", "2", "--beam", "1", "--hrt-fallback-threshold", "-1000"
    )
    assert tokens_of(never) == tokens_of(k2) and gen.at_mode.sentences == 0
    gen, always = decode(
        data_dir, task, model, "--decode-chunk-size", "2", "--beam", "1", "--hrt-fallback-threshold", "0"
    )
    assert tokens_of(always) == tokens_of(at_mode) and gen.at_mode.sentences == len(SENTENCES)
    # in between: exactly the sentences whose stage-II confidence is below the threshold
    confidence = [float(h[0]["stage2_confidence"]) for h in k2]
    threshold = sorted(confidence)[len(confidence) // 2]
    gen, mixed = decode(
        data_dir, task, model, "--decode-chunk-size", "2", "--beam", "1", "--hrt-fallback-threshold", str(threshold)
    )
    expected = [a if c < threshold else b for c, a, b in zip(confidence, tokens_of(at_mode), tokens_of(k2))]
    assert tokens_of(mixed) == expected and gen.at_mode.sentences == sum(c < threshold for c in confidence)


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--hrt-refine-fraction", "1.5"), "must be in \\[0, 1\\]"),
        (("--hrt-fallback-threshold", "0.5"), "<= 0"),
        (("--decoding", "beam", "--hrt-rescore"), "has no stage II: --hrt-rescore"),
        (
            ("--decode-chunk-size", "1", "--decoding", "greedy-at-mode", "--hrt-refine-fraction", "0.2"),
            "has no stage II",
        ),
    ],
)
def test_bad_stage2_options_are_refused(setup, flags, message):
    data_dir, task, model = setup
    with pytest.raises(ValueError, match=message):
        build_generator(data_dir, model, *flags)


def test_at_mode_scores_are_the_scores_at_mode_search_gives_its_own_output(setup):
    data_dir, task, model = setup
    d = task.target_dictionary
    _, at_mode = decode(data_dir, task, model, "--decode-chunk-size", "1", "--beam", "1")
    enc = model.encoder(**make_sample(task, SENTENCES)["net_input"])
    scores, per_token = at_mode_scores(model, enc, [h[0]["tokens"] for h in at_mode], d.eos(), d.pad(), 1.0)
    for row, h in enumerate(at_mode):
        n = h[0]["tokens"].numel()
        assert torch.allclose(scores[row], h[0]["score"], atol=1e-4)
        assert torch.allclose(per_token[row, :n], h[0]["positional_scores"], atol=1e-4)
