"""The lean engine (--decoder-engine lean) reproduces fairseq's SequenceGenerator."""

import random

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.search import BeamSearch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_hrt import chunking
from fairseq_hrt.generation.lean import LeanSequenceGenerator, TorchBackend
from fairseq_hrt.modules.relative_attention import relative_bucket
from fairseq_hrt.passes import decoder_pass
from fairseq_hrt.testing.tiny_runs import run_cli
from hrt_runtime import search as numpy_search
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, generation_args, make_sample, random_tiny_models
from tests.test_generator import SPECIALS
from tests.tiny_data import hyp_lines

random.seed(11)
RAGGED = [[random.randrange(0, 40) for _ in range(random.randint(0, 14))] for _ in range(24)]


def assert_same_hypotheses(ref, ours):
    assert len(ref) == len(ours)
    for r_hypos, o_hypos in zip(ref, ours):
        assert len(r_hypos) == len(o_hypos)
        for r, o in zip(r_hypos, o_hypos):
            assert o["tokens"].tolist() == r["tokens"].tolist()
            assert float(o["score"]) == pytest.approx(float(r["score"]), abs=1e-4)
            assert torch.allclose(o["positional_scores"], r["positional_scores"], atol=1e-4)


# ------------------------------------------------------------------------- pure functions


def test_relative_buckets_are_the_attention_modules_buckets():
    for stride, window in ((1, 16), (2, 3), (3, 4)):
        table = decoder_pass.relative_buckets(9, stride, window)
        for t in range(9):
            positions = torch.arange(t + 1).unsqueeze(0) * stride
            expected = relative_bucket(positions[:, -1:], positions, window)[0, 0]
            assert table[t, : t + 1].tolist() == expected.tolist()


def test_positional_scores_undo_the_cumulative_sum():
    per_token = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -0.25, -4.0]])
    assert torch.allclose(torch.from_numpy(numpy_search.positional_scores(per_token.cumsum(dim=1).numpy())), per_token)


def test_padding_bias():
    bias = decoder_pass.padding_bias(
        torch.tensor([[True, False, False], [False, False, False]]), 3, 2, torch.float32, "cpu"
    )
    assert bias.shape == (2, 1, 1, 3)
    assert bias[0, 0, 0].tolist() == [float("-inf"), 0.0, 0.0] and bias[1].eq(0).all()


def test_candidates_per_sentence_equal_fairseq_beam_search_over_the_vocabulary():
    """Top-k of each row's logits, then of the sentence's rows = fairseq's top-k over the
    whole (beam x vocabulary) of log-probabilities plus cumulative scores."""
    torch.manual_seed(0)
    bsz, beam, vocab = 3, 4, 50
    logits = torch.randn(bsz * beam, vocab)
    cumulative = torch.randn(bsz * beam, 1)
    lprobs = torch.log_softmax(logits, dim=-1)
    search = BeamSearch(
        type("D", (), {"pad": lambda s: 1, "unk": lambda s: 3, "eos": lambda s: 2, "__len__": lambda s: vocab})()
    )
    ref_scores, ref_tokens, ref_beams = search.step(
        1, lprobs.view(bsz, beam, vocab), cumulative.view(bsz, beam, 1), None, None
    )
    top_logits, top_tokens = logits.topk(2 * beam, dim=1)
    row_scores = top_logits - torch.logsumexp(logits, dim=1, keepdim=True) + cumulative
    scores, tokens, beams = numpy_search.candidates_per_sentence(row_scores.numpy(), top_tokens.numpy(), beam, 2 * beam)
    assert tokens.tolist() == ref_tokens.tolist() and beams.tolist() == ref_beams.tolist()
    assert torch.allclose(torch.from_numpy(scores), ref_scores, atol=1e-5)


# -------------------------------------------------------------- identity, random weights


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "lean")


SEARCHES = [
    dict(beam_size=1),
    dict(beam_size=5),
    dict(beam_size=5, len_penalty=0.6, min_len=3),
    dict(beam_size=3, max_len_a=0.5, unk_penalty=0.5, temperature=1.3),
]


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("which", ["at", "hrt-at-mode", "hrt-skip-at-k2", "hrt-skip-at-k3"])
def test_lean_equals_sequence_generator(random_models, which, search):
    data_dir, task, hrt, at = random_models
    d = task.target_dictionary
    model = at if which == "at" else hrt
    suppress = [] if which == "at" else SPECIALS
    bos = {"hrt-skip-at-k2": task.chunk_start_idx[2], "hrt-skip-at-k3": task.chunk_start_idx[3]}.get(which)
    search = dict(max_len_b=9, **search)
    ref = SequenceGenerator([model], d, tokens_to_suppress=suppress, **search).generate(
        [model], make_sample(task, RAGGED), bos_token=bos
    )
    options = SearchConfig(
        beam=search["beam_size"],
        max_len_a=search.get("max_len_a", 0),
        max_len_b=9,
        min_len=search.get("min_len", 1),
        len_penalty=search.get("len_penalty", 1.0),
        unk_penalty=search.get("unk_penalty", 0.0),
    )
    ours = LeanSequenceGenerator(
        model, d, options, [d.index(s) for s in suppress], temperature=search.get("temperature", 1.0)
    )
    assert_same_hypotheses(ref, ours.generate([model], make_sample(task, RAGGED), bos_token=bos))


@pytest.mark.parametrize(
    "flags",
    [
        ("--decode-chunk-size", "2", "--beam", "1"),
        ("--decode-chunk-size", "3", "--beam", "4", "--b-nat", "2"),
        ("--decode-chunk-size", "by-length", "--beam", "2"),
    ],
)
def test_hrt_decoding_same_with_both_engines(random_models, flags):
    data_dir, task, hrt, _ = random_models
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, hrt, "--max-len-b", "16", *flags, "--decoder-engine", "fairseq")
    _, ours = build_generator(data_dir, hrt, "--max-len-b", "16", *flags, "--decoder-engine", "lean")
    assert_same_hypotheses(ref.generate([hrt], sample), ours.generate([hrt], sample))


def test_lean_refuses_prefix_and_ensembles(random_models):
    data_dir, task, hrt, at = random_models
    lean_task, gen = build_generator(data_dir, at, "--decoder-engine", "lean", "--beam", "1")
    with pytest.raises(ValueError, match="--prefix-size"):
        gen.generate([at], make_sample(task, RAGGED[:2]), prefix_tokens=torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="single model"):
        lean_task.build_generator([at, at], generation_args(data_dir, "--decoder-engine", "lean"))


# ------------------------------------------------------------------------------- int8


@pytest.mark.parametrize(
    "arch,flags",
    [("at_tiny", ()), ("hrt_tiny", ("--decode-chunk-size", "2")), ("cmlm_tiny", ("--iter-decode-max-iter", "2"))],
)
def test_int8_quantization_decodes(tmp_path, arch, flags):
    extra = ("--hrt-mode", "cmlm") if arch == "cmlm_tiny" else ()
    task, model = build_task_and_model(str(tmp_path), arch=arch, extra=extra)
    _, gen = build_generator(str(tmp_path), model, "--quantize", "int8", "--beam", "2", "--max-len-b", "8", *flags)
    quantized = [
        n for n, m in model.named_modules() if type(m).__name__ == "Linear" and "quantized" in type(m).__module__
    ]
    assert any(n.startswith("decoder.") for n in quantized) and any(n.startswith("encoder.") for n in quantized)
    hypos = gen.generate([model], make_sample(task, RAGGED[:5]))
    assert len(hypos) == 5 and all(h[0]["tokens"][-1] == task.target_dictionary.eos() for h in hypos)


# -------------------------------------------------------------------- trained tiny models


# ``trained`` (tiny AT and HRT models trained for 40 updates) is in conftest.py, shared with
# the Jacobi tests


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_same_hypotheses_in_process(trained, arch):
    """Trained models finish sentences at different steps (ragged batches of 16)."""
    data, ckpts = trained
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpts[arch])], arg_overrides={"data": str(data.bin_dir)}
    )
    model = models[0].eval()
    task.load_dataset("valid")
    langs = ("--source-lang", "en", "--target-lang", "de")
    decodes = [("--beam", "1"), ("--beam", "5", "--lenpen", "0.6")]
    if arch == "hrt_tiny":
        decodes = [d + ("--decode-chunk-size", "1") for d in decodes] + [("--decode-chunk-size", "2", "--beam", "3")]
    lengths = set()
    for flags in decodes:
        _, ref = build_generator(str(data.bin_dir), model, *langs, *flags, "--decoder-engine", "fairseq")
        _, ours = build_generator(str(data.bin_dir), model, *langs, *flags, "--decoder-engine", "lean")
        for sample in task.get_batch_iterator(task.dataset("valid"), max_sentences=16).next_epoch_itr(shuffle=False):
            out = ours.generate([model], sample)
            assert_same_hypotheses(ref.generate([model], sample), out)
            lengths |= {len(h[0]["tokens"]) for h in out}
    assert len(lengths) > 2  # sentences really end at different steps


@pytest.mark.slow
def test_fairseq_generate_same_output_with_both_engines(trained):
    data, ckpts = trained
    common = [
        "generate",
        data.bin_dir,
        "--path",
        ckpts["at_tiny"],
        "--gen-subset",
        "valid",
        "--batch-size",
        "7",
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
    outs = {e: run_cli(common + ["--beam", "4", "--decoder-engine", e]).stdout for e in ("lean", "fairseq")}
    assert hyp_lines(outs["lean"]) == hyp_lines(outs["fairseq"]) and len(hyp_lines(outs["lean"])) == 40


TINY_TRANSFORMER = (
    "--encoder-embed-dim",
    "32",
    "--decoder-embed-dim",
    "32",
    "--encoder-ffn-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "64",
    "--encoder-layers",
    "1",
    "--decoder-layers",
    "2",
    "--encoder-attention-heads",
    "4",
    "--decoder-attention-heads",
    "2",
    "--hrt-mode",
    "at",
)


@pytest.mark.parametrize(
    "variant",
    [
        ("--decoder-normalize-before",),  # pre-norm
        (),  # post-norm
        ("--decoder-learned-pos", "--no-scale-embedding", "--layernorm-embedding"),
    ],
)
def test_lean_on_fairseq_transformer_variants(tmp_path, variant):
    task, model = build_task_and_model(str(tmp_path), arch="transformer", extra=TINY_TRANSFORMER + variant, seed=5)
    d = task.target_dictionary
    sample = make_sample(task, RAGGED)
    for beam in (1, 3):
        ref = SequenceGenerator([model], d, beam_size=beam, max_len_b=7).generate([model], sample)
        ours = LeanSequenceGenerator(model, d, SearchConfig(beam=beam, max_len_b=7)).generate([model], sample)
        assert_same_hypotheses(ref, ours)


def _assert_lean_decodes_changed_weights(random_models, change):
    """Lean, built and run once, then ``change(task, at)`` alters the AT model's weights: its
    next hypotheses are SequenceGenerator's on the changed weights."""
    data_dir, task, hrt, at = random_models
    d = task.target_dictionary
    sample = make_sample(task, RAGGED[:6])
    gen = LeanSequenceGenerator(at, d, SearchConfig(beam=1, max_len_b=6))
    before = gen.generate([at], sample)
    original = {k: v.clone() for k, v in at.state_dict().items()}
    try:
        change(task, at)
        ref = SequenceGenerator([at], d, beam_size=1, max_len_b=6).generate([at], sample)
        # the change is one the hypotheses show
        assert any(abs(float(r[0]["score"]) - float(b[0]["score"])) > 1e-3 for r, b in zip(ref, before))
        assert_same_hypotheses(ref, gen.generate([at], sample))
    finally:
        at.load_state_dict(original)


def test_lean_sees_weights_loaded_after_it_was_built(random_models):
    """The fused projections are rebuilt when the model's weights change in place."""

    def scale(task, at):
        with torch.no_grad():
            for p in at.decoder.parameters():
                p.mul_(1.5)

    _assert_lean_decodes_changed_weights(random_models, scale)


def test_lean_decodes_the_weights_after_fairseqs_optimizer_step(random_models):
    """fairseq's optimizers write the weights through ``p.data`` (no version counter moves):
    after a step of fairseq's Adam taken as fairseq-train's trainer takes it (the task's
    ``optimizer_step``), as between two --eval-bleu validations, the lean engine decodes the
    new weights, not the fused q/k/v projections of its last batch, with no call to forget
    anything."""

    def fairseq_adam_step(task, at):
        params = [p for p in at.parameters() if p.requires_grad]
        optimizer = FairseqAdam(FairseqAdamConfig(lr=[0.05], adam_betas="(0.9, 0.999)"), params)
        generator = torch.Generator().manual_seed(2)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        task.optimizer_step(optimizer, at, update_num=0)
        for p in params:
            p.grad = None

    _assert_lean_decodes_changed_weights(random_models, fairseq_adam_step)


def test_non_causal_pass_equals_the_decoder_module(random_models):
    """The lean non-causal pass (stage II, hrt-spec drafts) gives the HRT decoder's features
    on a ragged batch of stage-II inputs (masks, pads, positions 1, 2, .. per row)."""
    _, task, hrt, _ = random_models
    d = task.target_dictionary
    sample = make_sample(task, RAGGED[:9])
    encoder_out = hrt.encoder.forward_torchscript(sample["net_input"])
    skeleton = torch.full((9, 6), d.pad(), dtype=torch.long)
    for r in range(9):
        length = 1 + r % 6
        skeleton[r, : length - 1] = torch.randint(d.nspecial, len(d) - 8, (length - 1,))
        skeleton[r, length - 1] = d.eos()
    stage2 = chunking.stage2_input(skeleton, 2, d.pad(), task.mask_idx)
    ref, _ = hrt.decoder(
        stage2.tokens, encoder_out=encoder_out, positions=stage2.positions, causal=False, features_only=True
    )
    the_pass = decoder_pass.decoder_pass(hrt.decoder)
    ours = the_pass.non_causal(the_pass.encoder(encoder_out), stage2.tokens, stage2.positions)
    real = stage2.tokens.ne(d.pad())
    assert stage2.tokens.eq(d.pad()).any() and stage2.tokens.eq(task.mask_idx).any()
    assert torch.allclose(ours[real], ref[real], atol=1e-5)


def test_backend_follows_the_model_to_its_device(tmp_path):
    """fairseq-train builds the --eval-bleu generator before the trainer moves the model to the
    GPU: a device read at construction sent the search's tokens to the CPU (embedding on cuda:0
    with an index on the CPU, at the first validation of a GPU run)."""
    task, model = build_task_and_model(str(tmp_path))
    backend = TorchBackend(model, task.target_dictionary)
    assert backend.device == torch.device("cpu")
    model.to("meta")  # a device this machine has without a GPU
    assert backend.device.type == "meta"
    assert backend._tensor(np.zeros(3, np.int64)).device.type == "meta"
