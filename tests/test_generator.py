"""Decoding invariants of the HRT generator (SPEC section 3) on random tiny models."""

import math

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

from fairseq_hrt import chunking
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample

# symbols the HRT generator suppresses in every stage (fairseq's tokens_to_suppress option)
SPECIALS = ["<s>", "<mask>"] + [f"<s{k}>" for k in range(2, 9)]
SENTENCES = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 14]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("gen"))
    task, model = build_task_and_model(data_dir)
    return data_dir, task, model


def generate(task, model, data_dir, sample, *flags):
    _, gen = build_generator(data_dir, model, "--max-len-b", "24", *flags)
    return gen.generate([model], sample)


def test_at_mode_equals_fairseq_sequence_generator(setup):
    data_dir, task, model = setup
    sample = make_sample(task, SENTENCES)
    for beam in (1, 5):
        ours = generate(task, model, data_dir, sample, "--decode-chunk-size", "1", "--beam", str(beam))
        ref = SequenceGenerator(
            [model], task.target_dictionary, beam_size=beam, max_len_b=24, tokens_to_suppress=SPECIALS
        ).generate([model], sample)
        for o, r in zip(ours, ref):
            assert torch.equal(o[0]["tokens"], r[0]["tokens"])
            assert torch.allclose(o[0]["positional_scores"], r[0]["positional_scores"], atol=1e-5)


def _full_causal_logprobs(model, encoder_out, tokens, positions):
    logits, _ = model.decoder(tokens, encoder_out=encoder_out, positions=positions, causal=True)
    return F.log_softmax(logits.float(), dim=-1)


def test_at_mode_greedy_matches_non_incremental_greedy(setup):
    """The incremental path (cached keys and positions) gives the greedy decode that a plain
    full-sequence forward at every step gives."""
    data_dir, task, model = setup
    d = task.target_dictionary
    sample = make_sample(task, SENTENCES[:2])
    hypos = generate(task, model, data_dir, sample, "--decode-chunk-size", "1", "--beam", "1")
    for row, h in enumerate(hypos):
        sub = {"net_input": {k: v[row : row + 1] for k, v in sample["net_input"].items()}}
        enc = model.encoder(**sub["net_input"])
        prefix = torch.tensor([[d.eos()]])
        out = []
        for _ in range(25):
            positions = torch.arange(prefix.size(1)).unsqueeze(0)
            lp = _full_causal_logprobs(model, enc, prefix, positions)[0, -1]
            lp[d.pad()] = -math.inf
            lp[[d.index(s) for s in SPECIALS]] = -math.inf
            if not out:  # fairseq's --min-len 1: no </s> as the first token
                lp[d.eos()] = -math.inf
            if len(out) == 24:  # fairseq forces </s> at max length
                nxt = d.eos()
            else:
                nxt = int(lp.argmax())
            out.append(nxt)
            if nxt == d.eos():
                break
            prefix = torch.cat([prefix, torch.tensor([[nxt]])], dim=1)
        assert h[0]["tokens"].tolist() == out


@pytest.mark.parametrize("k", [2, 3])
def test_hrt_keeps_stage1_tokens_and_fills_only_masks(setup, k):
    data_dir, task, model = setup
    d = task.target_dictionary
    sample = make_sample(task, SENTENCES)
    _, gen = build_generator(data_dir, model, "--max-len-b", "24", "--decode-chunk-size", str(k), "--beam", "1")
    skeletons = SequenceGenerator([model], d, beam_size=1, max_len_b=24 // k, tokens_to_suppress=SPECIALS).generate(
        [model], sample, bos_token=task.chunk_start_idx[k]
    )
    hypos = gen.generate([model], sample)
    specials = {d.pad(), task.mask_idx, d.bos(), *task.chunk_start_idx.values()}
    for skel, h in zip(skeletons, hypos):
        z = skel[0]["tokens"].tolist()
        y = h[0]["tokens"].tolist()
        assert y[-1] == d.eos() and d.eos() not in y[:-1]  # truncated at the first </s>
        assert len(y) <= len(z) * k
        # stage-I token z_i sits at position i*k, unchanged (up to the truncation point)
        for i, zi in enumerate(z, start=1):
            if i * k <= len(y) - 1:
                assert y[i * k - 1] == zi
        assert not specials.intersection(y)  # no mask, pad or start symbol in the output


def test_hrt_score_is_equation_2(setup):
    """Recompute eq. (2) independently: teacher-forced Skip-AT log-probs of the skeleton plus
    one non-causal pass for the filled tokens, over the kept tokens, / len ** lenpen."""
    data_dir, task, model = setup
    d = task.target_dictionary
    k, lenpen = 2, 0.6
    sample = make_sample(task, SENTENCES)
    hypos = generate(
        task,
        model,
        data_dir,
        sample,
        "--decode-chunk-size",
        str(k),
        "--beam",
        "3",
        "--b-nat",
        "2",
        "--lenpen",
        str(lenpen),
    )
    skeletons = SequenceGenerator(
        [model], d, beam_size=3, max_len_b=24 // k, len_penalty=lenpen, tokens_to_suppress=SPECIALS
    ).generate([model], sample, bos_token=task.chunk_start_idx[k])
    for row, (hs, skels) in enumerate(zip(hypos, skeletons)):
        assert len(hs) == 2  # b_nat hypotheses
        enc = model.encoder(**{k_: v[row : row + 1] for k_, v in sample["net_input"].items()})
        expected = []
        for skel in skels[:2]:
            z = skel["tokens"].unsqueeze(0)
            inp = torch.cat([torch.tensor([[task.chunk_start_idx[k]]]), z[:, :-1]], dim=1)
            pos = torch.arange(z.size(1)).unsqueeze(0) * k
            lp1 = _full_causal_logprobs(model, enc, inp, pos)[0].gather(1, z[0].unsqueeze(1)).squeeze(1)
            st2 = chunking.stage2_input(z, k, d.pad(), task.mask_idx)
            logits, _ = model.decoder(st2.tokens, encoder_out=enc, positions=st2.positions, causal=False)
            lp2 = F.log_softmax(logits.float(), dim=-1)[0]
            for s in [d.pad(), task.mask_idx, d.bos(), *task.chunk_start_idx.values()]:
                lp2[:, s] = -math.inf
            y, scores = [], []
            for j in range(st2.tokens.size(1)):
                if (j + 1) % k == 0:
                    tok, sc = int(z[0, (j + 1) // k - 1]), float(lp1[(j + 1) // k - 1])
                else:
                    tok, sc = int(lp2[j].argmax()), float(lp2[j].max())
                y.append(tok)
                scores.append(sc)
                if tok == d.eos():
                    break
            expected.append((y, sum(scores) / len(y) ** lenpen))
        expected.sort(key=lambda t: t[1], reverse=True)
        for h, (y, score) in zip(hs, expected):
            assert h["tokens"].tolist() == y
            assert float(h["score"]) == pytest.approx(score, abs=1e-4)
            assert float(h["positional_scores"].sum()) / len(y) ** lenpen == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize(
    "flags",
    [
        ("--decode-chunk-size", "2", "--beam", "1"),
        ("--decode-chunk-size", "3", "--beam", "4", "--b-nat", "2"),
        ("--decode-chunk-size", "1", "--beam", "3"),
    ],
)
def test_batch_equals_one_by_one(setup, flags):
    data_dir, task, model = setup
    model64 = model.double()
    try:
        batch = generate(task, model64, data_dir, make_sample(task, SENTENCES), *flags)
        for sent, hypos in zip(SENTENCES, batch):
            single = generate(task, model64, data_dir, make_sample(task, [sent]), *flags)[0]
            assert [h["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in single]
            for a, b in zip(hypos, single):
                assert float(a["score"]) == pytest.approx(float(b["score"]), abs=1e-6)
    finally:
        model.float()


def test_by_length_chunk_size_per_sentence(setup):
    data_dir, task, model = setup
    sample = make_sample(task, SENTENCES)
    mixed = generate(task, model, data_dir, sample, "--decode-chunk-size", "by-length", "--beam", "1")
    at = generate(task, model, data_dir, sample, "--decode-chunk-size", "1", "--beam", "1")
    hrt = generate(task, model, data_dir, sample, "--decode-chunk-size", "2", "--beam", "1")
    for sent, m, a, h in zip(SENTENCES, mixed, at, hrt):
        expected = a if len(sent) + 1 < 8 else h
        assert m[0]["tokens"].tolist() == expected[0]["tokens"].tolist()


def test_bad_decoding_options_are_rejected(setup):
    data_dir, task, model = setup
    with pytest.raises(ValueError, match="b_at >= b_nat"):
        build_generator(data_dir, model, "--beam", "2", "--b-nat", "3")
    with pytest.raises(ValueError, match="trained for chunk sizes"):
        build_generator(data_dir, model, "--decode-chunk-size", "4")
    with pytest.raises(ValueError, match=">= 1"):
        build_generator(data_dir, model, "--decode-chunk-size", "0")
    with pytest.raises(ValueError, match="integer"):
        build_generator(data_dir, model, "--decode-chunk-size", "two")


def test_empty_source_gives_empty_translation(setup):
    data_dir, task, model = setup
    d = task.source_dictionary
    sample = make_sample(task, [[1, 2, 3], []])
    task, gen = build_generator(data_dir, model, "--decode-chunk-size", "2", "--beam", "1")
    hypos = task.inference_step(gen, [model], sample)
    assert hypos[1][0]["tokens"].tolist() == [d.eos()]
    assert len(hypos[0][0]["tokens"]) > 1 or hypos[0][0]["tokens"].tolist() == [d.eos()]


@pytest.mark.parametrize(
    "flags", [("--decode-chunk-size", "1", "--beam", "1"), ("--decode-chunk-size", "2", "--beam", "3", "--b-nat", "2")]
)
def test_half_precision_model(setup, flags):
    """What --fp16 does at generation time (model.half()): both stages run in half
    precision, scores are accumulated in float32, and the output is the fp32 one."""
    data_dir, task, model = setup
    sample = make_sample(task, SENTENCES)
    ref = generate(task, model, data_dir, sample, *flags)
    try:
        model.half()
        out = generate(task, model, data_dir, sample, *flags)
    finally:
        model.float()
    for r, o in zip(ref, out):
        assert o[0]["tokens"].tolist() == r[0]["tokens"].tolist()
        assert float(o[0]["score"]) == pytest.approx(float(r[0]["score"]), abs=2e-2)
