"""Mask-Predict baseline (SPEC section 4): the cmlm_* model's length predictor and loss, the
paper's Mask-Predict decoding (checked against an independent one-row-at-a-time
re-implementation), its pure functions, and a tiny fairseq-train (fine-tuned from an AT
checkpoint) -> fairseq-generate -> fairseq-interactive run.

In-process tests use random-weight tiny models: every property tested holds for any weights.
The weights are drawn with a larger spread than fairseq's init so that predictions depend on
the context (a freshly initialised tiny model predicts nearly the same token everywhere).
"""

import logging
import math
import os
import re
import sys
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from fairseq import metrics
from fairseq.dataclass.configs import GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hrt_fixtures import build_generator, build_task_and_model, make_sample  # noqa: E402

from fairseq_hrt import chunking  # noqa: E402
from fairseq_hrt.criterions.hrt_loss import HRTLossCriterion, length_loss  # noqa: E402
from fairseq_hrt.generation.mask_predict import MaskPredictGenerator  # noqa: E402
from fairseq_hrt.passes.decoder_pass import decoder_pass  # noqa: E402
from fairseq_hrt.testing.tiny_runs import (  # noqa: E402
    SRC,
    TGT,
    USER_DIR,
    make_tiny_data,
    parse_logs,
    run_cli,
    run_cli_many,
    train_args,
)
from hrt_runtime import search  # noqa: E402  (the one search's Mask-Predict functions, on numpy arrays)
from tests.tiny_data import hyp_lines  # noqa: E402


def remask_counts(lengths, t, iterations):
    return torch.from_numpy(search.remask_counts(lengths.numpy(), t, iterations))


def lowest_confidence_mask(scores, eligible, counts):
    return torch.from_numpy(search.lowest_confidence_mask(scores.numpy(), eligible.numpy(), counts.numpy()))


def length_candidates(lprobs, beam, max_lengths):
    return tuple(torch.from_numpy(a) for a in search.length_candidates(lprobs.numpy(), beam, max_lengths.numpy()))


def initial_input(lengths, mask, eos, pad):
    return tuple(torch.from_numpy(a) for a in search.initial_input(lengths.numpy(), mask, eos, pad))


from fairseq_hrt.models.cmlm_transformer import LENGTH_CLASSES  # noqa: E402

SENTENCES = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 14], [20]]
MAX_LEN = 24


def _sharpen(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return model


def _cmlm(tmp_path_factory, seed=1, extra=()):
    data_dir = str(tmp_path_factory.mktemp("mp"))
    task, model = build_task_and_model(data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm", *extra), seed=seed)
    return data_dir, task, _sharpen(model, seed)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return _cmlm(tmp_path_factory)


def _specials(task):
    d = task.target_dictionary
    return {d.pad(), d.bos(), d.eos(), task.mask_idx, *task.chunk_start_idx.values()}


def mp_decode(task, model, sample, iterations, beam, max_len_b=MAX_LEN):
    gen = task.build_generator(
        [model], GenerationConfig(iter_decode_max_iter=iterations, iter_decode_with_beam=beam, max_len_b=max_len_b)
    )
    assert isinstance(gen, MaskPredictGenerator)
    return task.inference_step(gen, [model], sample)


def _encode_one(model, sample, row):
    net = {k: v[row : row + 1] for k, v in sample["net_input"].items()}
    return model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])


# ------------------------------------------------------------------------------- model


def test_archs_share_shapes_with_at_and_rpr_is_optional(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("shapes"))
    _, at = build_task_and_model(data_dir, arch="at_tiny", extra=("--hrt-mode", "at"))
    _, cmlm = build_task_and_model(data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm"))
    _, cmlm_rpr = build_task_and_model(
        data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm", "--decoder-rpr-window", "16")
    )
    at_shapes = {k: v.shape for k, v in at.state_dict().items()}
    cmlm_shapes = {k: v.shape for k, v in cmlm.state_dict().items()}
    # every AT tensor exists with the same shape; only the length predictor (and the HRT
    # chunk-size flags) are extra: vanilla MP has no relative keys
    assert all(cmlm_shapes.get(k) == s for k, s in at_shapes.items())
    assert set(cmlm_shapes) - set(at_shapes) == {"embed_length.weight", "trained_chunk_sizes"}
    assert cmlm.embed_length.weight.shape == (LENGTH_CLASSES, 32)
    assert any(k.endswith("relative_keys.weight") for k in cmlm_rpr.state_dict())
    assert cmlm.length_loss_factor == pytest.approx(0.1)


def test_finetune_from_at_state_reports_new_weights(tmp_path_factory, caplog):
    """An AT state dict (no length predictor, no relative keys) loads into cmlm_tiny with
    --decoder-rpr-window 16 (appendix E: FT + RPR); the fresh tensors are listed."""
    data_dir = str(tmp_path_factory.mktemp("ft"))
    _, at = build_task_and_model(data_dir, arch="at_tiny", extra=("--hrt-mode", "at"), seed=3)
    _, cmlm = build_task_and_model(
        data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm", "--decoder-rpr-window", "16"), seed=4
    )
    fresh_length = cmlm.embed_length.weight.detach().clone()
    with caplog.at_level(logging.WARNING):
        cmlm.load_state_dict(at.state_dict())
    warnings = [r.getMessage() for r in caplog.records if "new parameter" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "embed_length.weight" in warnings[0] and "relative_keys" in warnings[0]
    for name, value in at.state_dict().items():
        assert torch.equal(cmlm.state_dict()[name], value), name
    assert torch.equal(cmlm.embed_length.weight, fresh_length)


def test_length_predictor_range_and_values_by_hand(setup):
    _, task, model = setup
    sample = make_sample(task, SENTENCES)  # left-padded sources of different lengths
    src = sample["net_input"]["src_tokens"]
    enc = model.encoder(src, src_lengths=sample["net_input"]["src_lengths"])
    lprobs = model.forward_length(enc)
    assert lprobs.shape == (len(SENTENCES), LENGTH_CLASSES) and lprobs.dtype == torch.float
    assert torch.allclose(lprobs.exp().sum(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)
    states = enc["encoder_out"][0]  # T x B x C
    for b in range(len(SENTENCES)):
        real = [t for t in range(src.size(1)) if src[b, t] != task.source_dictionary.pad()]
        assert len(real) == len(SENTENCES[b]) + 1
        pooled = sum(states[t, b] for t in real) / len(real)  # padding excluded
        logits = model.embed_length.weight @ pooled
        assert torch.allclose(model.forward_length(enc, normalize=False)[b], logits, atol=1e-5)
        assert torch.allclose(lprobs[b], F.log_softmax(logits, dim=0), atol=1e-5)


def test_length_loss_value_and_weight_by_hand(setup):
    _, task, model = setup
    d = task.target_dictionary
    targets = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14]]
    width = max(map(len, targets)) + 1
    target = torch.full((len(targets), width), d.pad())
    for i, t in enumerate(targets):
        target[i, : len(t) + 1] = torch.tensor([d.index(f"w{w}") for w in t] + [d.eos()])
    sample = make_sample(task, SENTENCES[:3])
    sample["target"] = target
    sample = task.build_decoder_samples(sample, 0.0, generator=torch.Generator().manual_seed(0))
    criterion = HRTLossCriterion(task, label_smoothing=0.1)
    loss, sample_size, log = criterion(model, sample)
    factor = model.length_loss_factor
    model.length_loss_factor = 0.0
    try:
        loss_without, _, _ = criterion(model, sample)
    finally:
        model.length_loss_factor = factor
    enc = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
    lprobs = model.forward_length(enc)
    by_hand = [-float(lprobs[b, len(t)]) for b, t in enumerate(targets)]  # N without </s>
    assert log["length_loss"] == pytest.approx(sum(by_hand), rel=1e-5)
    # fairseq's weighting: factor x per-sentence mean, next to the per-token loss
    assert float(loss - loss_without) == pytest.approx(factor * sum(by_hand) / len(targets) * sample_size, rel=1e-4)
    assert sample_size == sample["hrt"]["nar"].target.ne(d.pad()).sum()
    assert "at_loss" not in log and log["cmlm_ntokens"] == sample_size
    with metrics.aggregate() as agg:
        HRTLossCriterion.reduce_metrics([log])
        logged = agg.get_smoothed_values()
    assert logged["length_loss"] == pytest.approx(sum(by_hand) / len(targets) / math.log(2), abs=1e-3)
    # lengths beyond the predictor's classes are clamped to the last one
    long_target = torch.tensor([[d.index("w5")] * 300 + [d.eos()]])
    enc1 = model.encoder(sample["net_input"]["src_tokens"][:1], src_lengths=sample["net_input"]["src_lengths"][:1])
    got = length_loss(model, enc1, long_target, d.pad(), d.eos())
    assert float(got) == pytest.approx(-float(model.forward_length(enc1)[0, LENGTH_CLASSES - 1]), rel=1e-6)


# ---------------------------------------------------------------------- pure functions


def test_remask_counts_schedule():
    for iterations in range(1, 13):
        lengths = torch.arange(0, 40)
        previous = lengths.clone()
        for t in range(1, iterations):
            got = remask_counts(lengths, t, iterations)
            expected = [math.floor(Fraction(n * (iterations - t), iterations)) for n in range(40)]
            assert got.tolist() == expected, (iterations, t)
            assert (got <= previous).all()  # linearly fewer every iteration
            previous = got
    for bad in (0, 10):
        with pytest.raises(ValueError):
            remask_counts(torch.tensor([5]), bad, 10)


def test_lowest_confidence_mask_picks_the_least_confident_eligible_slots():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows, width = 4, 9
        scores = -torch.rand(rows, width, generator=g)
        scores[0, 2] = scores[0, 5]  # a tie: the leftmost goes first
        eligible = torch.rand(rows, width, generator=g) < 0.7
        counts = torch.tensor([int(x) for x in torch.randint(0, width, (rows,), generator=g)])
        counts = torch.minimum(counts, eligible.sum(dim=1))
        got = lowest_confidence_mask(scores, eligible, counts)
        for r in range(rows):
            slots = [i for i in range(width) if eligible[r, i]]
            chosen = sorted(slots, key=lambda i: (float(scores[r, i]), i))[: int(counts[r])]
            assert [i for i in range(width) if got[r, i]] == sorted(chosen)


def test_length_candidates_best_allowed_lengths():
    g = torch.Generator().manual_seed(0)
    lprobs = F.log_softmax(torch.randn(3, 30, generator=g), dim=-1)
    lprobs[0, 0] = 10.0  # length 0 is never a candidate, however probable
    max_lengths = torch.tensor([25, 2, 1])
    lengths, scores = length_candidates(lprobs, 3, max_lengths)
    for b in range(3):
        allowed = sorted(range(1, int(max_lengths[b]) + 1), key=lambda n: -float(lprobs[b, n]))
        expected = (allowed + [allowed[0]] * 3)[:3]  # too few allowed lengths: repeat the best
        assert lengths[b].tolist() == expected
        assert scores[b].tolist() == pytest.approx([float(lprobs[b, n]) for n in expected])
    with pytest.raises(ValueError, match="length classes"):
        length_candidates(lprobs, 31, max_lengths)


def test_initial_input_matches_cmlm_training_layout(setup):
    _, task, _ = setup
    d = task.target_dictionary
    lengths = torch.tensor([3, 1, 5])
    tokens, positions = initial_input(lengths, task.mask_idx, d.eos(), d.pad())
    # a fully masked CMLM training sample of the same lengths has the same tokens/positions
    target = torch.full((3, 6), d.pad())
    for i, n in enumerate(lengths.tolist()):
        target[i, : n + 1] = torch.tensor([d.index("w7")] * n + [d.eos()])
    train = chunking.cmlm_sample(target, d.pad(), d.eos(), task.mask_idx)
    full_mask = target.masked_fill(target.ne(d.pad()) & target.ne(d.eos()), task.mask_idx)
    assert torch.equal(tokens, full_mask)
    assert torch.equal(positions, train.positions)
    assert positions[2].tolist() == [1, 2, 3, 4, 5, 6]


# -------------------------------------------------------------------------- decoding


def reference_mask_predict(task, model, encoder_out, iterations, beam, max_len):
    """Mask-Predict for one sentence, one candidate at a time, written from the paper."""
    banned = sorted(_specials(task))
    d = task.target_dictionary
    length_lprobs = model.forward_length(encoder_out)[0]
    allowed = sorted(range(1, min(max_len, LENGTH_CLASSES - 1) + 1), key=lambda n: -float(length_lprobs[n]))
    results = []
    for n_tokens in allowed[:beam]:
        tokens = [task.mask_idx] * n_tokens + [d.eos()]
        probs = [0.0] * n_tokens
        for t in range(iterations):
            if t == 0:
                masked = list(range(n_tokens))
            else:
                n = n_tokens * (iterations - t) // iterations
                masked = sorted(range(n_tokens), key=lambda i: (probs[i], i))[:n]
                for i in masked:
                    tokens[i] = task.mask_idx
            logits, _ = model.decoder(
                torch.tensor([tokens]),
                encoder_out=encoder_out,
                positions=torch.arange(1, n_tokens + 2).unsqueeze(0),
                causal=False,
            )
            lprobs = F.log_softmax(logits.float(), dim=-1)[0]
            lprobs[:, banned] = -math.inf
            for i in masked:
                tokens[i], probs[i] = int(lprobs[i].argmax()), float(lprobs[i].max())
        results.append((tokens, sum(probs) / n_tokens, probs))
    return sorted(results, key=lambda r: -r[1])


@pytest.mark.parametrize("iterations,beam", [(1, 1), (4, 3), (10, 2)])
def test_matches_reference_mask_predict_and_picks_best_average(setup, iterations, beam):
    """Batched decoding equals the paper's algorithm run on each sentence and candidate
    length alone: lengths, re-masked positions, tokens, probabilities, and the length beam's
    choice by average log-probability."""
    _, task, model = setup
    model.double()
    try:
        sample = make_sample(task, SENTENCES)
        hypos = mp_decode(task, model, sample, iterations, beam)
        for row, hs in enumerate(hypos):
            expected = reference_mask_predict(task, model, _encode_one(model, sample, row), iterations, beam, MAX_LEN)
            assert len(hs) == beam
            for h, (tokens, average, probs) in zip(hs, expected):
                assert h["tokens"].tolist() == tokens
                assert h["positional_scores"].tolist() == pytest.approx(probs + [0.0], abs=1e-5)
                assert float(h["score"]) == pytest.approx(average, abs=1e-5)
                assert h["steps"] == iterations
            best = max(expected, key=lambda r: r[1])
            assert hs[0]["tokens"].tolist() == best[0]
    finally:
        model.float()


def test_batch_equals_one_by_one(setup):
    _, task, model = setup
    model.double()
    try:
        batch = mp_decode(task, model, make_sample(task, SENTENCES), 5, 3)
        for sent, hypos in zip(SENTENCES, batch):
            single = mp_decode(task, model, make_sample(task, [sent]), 5, 3)[0]
            assert [h["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in single]
            for a, b in zip(hypos, single):
                assert float(a["score"]) == pytest.approx(float(b["score"]), abs=1e-6)
    finally:
        model.float()


@pytest.mark.parametrize("iterations", [1, 10])
def test_exactly_i_decoder_passes(setup, iterations):
    _, task, model = setup
    calls = []
    the_pass = decoder_pass(model.decoder)
    non_causal = the_pass.non_causal

    def counting(state, tokens, *args, **kwargs):
        calls.append(tokens.size(0))
        return non_causal(state, tokens, *args, **kwargs)

    the_pass.non_causal = counting
    try:
        hypos = mp_decode(task, model, make_sample(task, SENTENCES), iterations, 3)
    finally:
        del the_pass.non_causal
    assert calls == [3 * len(SENTENCES)] * iterations  # one non-causal pass per iteration, whole batch
    assert all(h["steps"] == iterations for hs in hypos for h in hs)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_special_symbols_are_never_predicted(tmp_path_factory, seed):
    """Even a model that prefers the special symbols everywhere outputs none of them: words
    only, then exactly one </s>."""
    _, task, model = _cmlm(tmp_path_factory, seed=seed)
    specials = sorted(_specials(task))
    output_layer = model.decoder.output_layer
    boost = torch.zeros(len(task.target_dictionary))
    boost[specials] = 50.0
    model.decoder.output_layer = lambda x: output_layer(x) + boost.to(x)
    d = task.target_dictionary
    sample = make_sample(task, SENTENCES)
    enc = model.encoder(**sample["net_input"])
    tokens, positions = initial_input(torch.tensor([4] * len(SENTENCES)), task.mask_idx, d.eos(), d.pad())
    raw = model.decoder(tokens, encoder_out=enc, positions=positions, causal=False)[0].argmax(-1)
    assert set(raw.view(-1).tolist()) <= set(specials)  # unrestricted, only specials would win
    for iterations, beam, max_len_b in ((1, 1, 3), (3, 4, 12), (10, 2, 30)):
        for hs in mp_decode(task, model, sample, iterations, beam, max_len_b):
            for h in hs:
                tokens = h["tokens"].tolist()
                assert tokens[-1] == d.eos() and 1 <= len(tokens) - 1 <= max_len_b
                assert not set(tokens[:-1]) & set(specials)
                assert torch.isfinite(h["positional_scores"]).all() and len(h["positional_scores"]) == len(tokens)


def test_half_precision(tmp_path_factory):
    """model.half(): scores are float, outputs valid (fp16 matmuls run on CPU too)."""
    _, task, model = _cmlm(tmp_path_factory, seed=5)
    model.half()
    d = task.target_dictionary
    for hs in mp_decode(task, model, make_sample(task, SENTENCES), 4, 2):
        for h in hs:
            tokens = h["tokens"].tolist()
            assert tokens[-1] == d.eos() and not set(tokens[:-1]) & _specials(task)
            assert h["positional_scores"].dtype == torch.float and torch.isfinite(h["score"])


def test_empty_source_gives_empty_translation(setup):
    _, task, model = setup
    hypos = mp_decode(task, model, make_sample(task, [[1, 2, 3], []]), 4, 2)
    assert hypos[1][0]["tokens"].tolist() == [task.target_dictionary.eos()]
    assert len(hypos[0][0]["tokens"]) >= 2


def test_bad_options_are_rejected(setup, tmp_path_factory):
    data_dir, task, model = setup
    with pytest.raises(ValueError, match="must be >= 1"):
        task.build_generator([model], GenerationConfig(iter_decode_max_iter=0))
    with pytest.raises(ValueError, match="must be >= 1"):
        task.build_generator([model], GenerationConfig(iter_decode_with_beam=0))
    with pytest.raises(ValueError, match="retain-iter-history"):
        task.build_generator([model], GenerationConfig(retain_iter_history=True))
    for flags in (("--decode-chunk-size", "2"), ("--b-nat", "2")):
        with pytest.raises(ValueError, match="iter-decode-max-iter"):
            build_generator(data_dir, model, *flags)
    # training: --hrt-mode and the architecture must agree
    hrt_dir = str(tmp_path_factory.mktemp("mode"))
    hrt_task, hrt_model = build_task_and_model(hrt_dir, arch="hrt_tiny", extra=("--hrt-mode", "cmlm"))
    sample = make_sample(hrt_task, SENTENCES[:2])
    sample["target"] = sample["net_input"]["src_tokens"].flip(1)
    with pytest.raises(ValueError, match="use a cmlm_\\* architecture"):
        HRTLossCriterion(hrt_task, 0.1)(hrt_model, hrt_task.build_decoder_samples(dict(sample), 0.0))
    at_task, _ = build_task_and_model(hrt_dir, arch="hrt_tiny", extra=("--hrt-mode", "hrt"))
    with pytest.raises(ValueError, match="with --hrt-mode cmlm"):
        HRTLossCriterion(at_task, 0.1)(model, at_task.build_decoder_samples(dict(sample), 0.5))


# ------------------------------------------------------------------------- end to end

GEN = ["--user-dir", USER_DIR, "--task", "hrt_translation", "--source-lang", SRC, "--target-lang", TGT, "--cpu"]
N_VALID = 16  # a multiple of 8: fairseq-generate drops a last batch under --required-batch-size-multiple


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """at_tiny (2 updates) -> cmlm_tiny fine-tuned from it (4 updates, lr so small that the
    loaded weights barely move) -> fairseq-generate and fairseq-interactive in parallel."""
    root = tmp_path_factory.mktemp("mp_e2e")
    data = make_tiny_data(root, n_train=120, n_valid=N_VALID)
    run_cli(train_args(data.bin_dir, root / "at", "--hrt-mode", "at", arch="at_tiny", max_update=2))
    at_ckpt = root / "at" / "checkpoint_last.pt"
    train_out = run_cli(
        train_args(
            data.bin_dir,
            root / "mp",
            "--hrt-mode",
            "cmlm",
            "--finetune-from-model",
            at_ckpt,
            arch="cmlm_tiny",
            max_update=4,
            lr=1e-5,
        )
    ).stdout
    ckpt = root / "mp" / "checkpoint_last.pt"
    lines = ["a man rides a horse .", "", "two dogs play ."]
    (root / "input.txt").write_text("\n".join(lines) + "\n")
    (gen_rc, gen_out), (int_rc, int_out) = run_cli_many(
        [
            [
                "generate",
                data.bin_dir,
                "--path",
                ckpt,
                "--gen-subset",
                "valid",
                "--batch-size",
                "8",
                "--iter-decode-max-iter",
                "10",
                "--iter-decode-with-beam",
                "3",
                "--max-len-b",
                "30",
                "--print-step",
                *GEN,
            ],
            [
                "interactive",
                data.bin_dir,
                "--path",
                ckpt,
                "--input",
                root / "input.txt",
                "--buffer-size",
                "2",
                "--batch-size",
                "2",
                "--iter-decode-max-iter",
                "4",
                "--max-len-b",
                "30",
                *GEN,
            ],
        ],
        log_dir=root / "logs",
    )
    return {
        "at_ckpt": at_ckpt,
        "ckpt": ckpt,
        "train": train_out,
        "generate": gen_out,
        "interactive": int_out,
        "lines": lines,
    }


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_finetune_from_at_checkpoint_and_length_loss_logged(e2e):
    out = e2e["train"]
    warnings = [line for line in out.splitlines() if "new parameter" in line]
    assert len(warnings) == 1 and "embed_length.weight" in warnings[0], out[-3000:]
    records = parse_logs(out)
    assert len(records) == 4, out[-3000:]
    for rec in records:
        assert math.isfinite(rec["length_loss"]) and rec["length_loss"] > 0
        assert rec["cmlm_ntokens"] > 0 and "at_loss" not in rec and "skip_cmlm_loss" not in rec
    at_state, mp_state = _load(e2e["at_ckpt"])["model"], _load(e2e["ckpt"])["model"]
    assert _load(e2e["ckpt"])["cfg"]["model"].arch == "cmlm_tiny"
    assert "embed_length.weight" in mp_state
    # the AT weights were loaded (4 Adam steps at lr 1e-5 move them by ~4e-5 at most)
    for name in (
        "encoder.layers.0.fc1.weight",
        "decoder.layers.0.self_attn.k_proj.weight",
        "encoder.embed_tokens.weight",
    ):
        assert torch.allclose(mp_state[name].float(), at_state[name].float(), atol=1e-3), name


@pytest.mark.slow
def test_generate_and_interactive(e2e):
    gen = e2e["generate"]
    assert sorted(hyp_lines(gen)) == list(range(N_VALID)), gen[-3000:]
    steps = re.findall(r"^I-\d+\t(\d+)$", gen, re.M)  # --print-step: passes per sentence
    assert len(steps) == N_VALID and set(steps) == {"10"}
    assert "Mask-Predict decoding: I = 10 iterations, length beam l = 3" in gen
    assert "Mask-Predict iteration 10/10" in gen  # --print-step logs the iterations
    assert not any("<mask>" in h or "<s2>" in h for h in hyp_lines(gen).values())
    inter = e2e["interactive"]
    hyps = hyp_lines(inter)
    assert sorted(hyps) == list(range(len(e2e["lines"]))), inter[-3000:]
    assert hyps[1] == ""  # empty input -> empty translation
    assert hyps[0] and hyps[2] and "<mask>" not in inter
    assert all(len(h.split()) <= 30 for h in hyps.values())  # --max-len-b
