"""The planned decoder pass (fairseq_hrt.passes.decoder_pass): one pass per decoder,
shared by every engine; its modes agree with each other; encoder keys/values are projected
once per batch; profiler labels."""

import copy

import pytest
import torch

from fairseq_hrt.export.exporter import unsupported
from fairseq_hrt.generation.jacobi import NATDrafter, ParallelGreedyGenerator
from fairseq_hrt.generation.lean import LeanSequenceGenerator
from fairseq_hrt.passes.attention import pair_buckets, relative_bucket, relative_buckets, step_buckets
from fairseq_hrt.passes.decoder_pass import DecoderPass, decoder_pass
from fairseq_hrt.passes.token_choice import argmax_block, best_allowed, choose
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample, random_tiny_models
from tests.test_lean import RAGGED, assert_same_hypotheses


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "decoder_pass")


@pytest.fixture(scope="module")
def ssru_model(tmp_path_factory):
    _, model = build_task_and_model(
        str(tmp_path_factory.mktemp("pass_ssru")),
        arch="at_tiny_ssru",
        extra=("--hrt-mode", "at", "--decoder-layers", "2"),
        seed=6,
    )
    return model


def test_one_pass_and_one_plan_per_decoder(random_models):
    """AT search, Jacobi, the hrt-spec drafter and HRT's stage II of one model use the same
    DecoderPass, hence the same plan and fused-weight tensors."""
    data_dir, task, hrt, _ = random_models
    the_pass = decoder_pass(hrt.decoder)
    assert isinstance(the_pass, DecoderPass) and decoder_pass(hrt.decoder) is the_pass
    _, spec = build_generator(data_dir, hrt, "--decoding", "hrt-spec", "--beam", "1")
    _, two_stage = build_generator(data_dir, hrt, "--decode-chunk-size", "2", "--beam", "2")
    assert isinstance(spec, ParallelGreedyGenerator) and isinstance(spec.drafter, NATDrafter)
    assert isinstance(two_stage, LeanSequenceGenerator)  # stage I and II on its backend
    passes = [spec.decoder_pass, spec.drafter.decoder_pass, two_stage.decoder_pass, two_stage.backend.decoder_pass]
    assert all(p is the_pass for p in passes)
    sample = make_sample(task, RAGGED[:6])
    plan = the_pass.plan()
    qkv_weight = plan.layers[0].qkv.__closure__[0].cell_contents  # the fused [W_q; W_k; W_v]
    spec.generate([hrt], sample)
    two_stage.generate([hrt], sample)
    assert the_pass.plan() is plan and plan.layers[0].qkv.__closure__[0].cell_contents is qkv_weight


def _count_key_projections(decoder):
    calls = []
    handles = [layer.encoder_attn.k_proj.register_forward_hook(lambda *_: calls.append(1)) for layer in decoder.layers]
    return calls, handles


@pytest.mark.parametrize(
    "flags", [("--decoding", "hrt-spec", "--beam", "1"), ("--decode-chunk-size", "2", "--beam", "3")]
)
def test_encoder_keys_values_are_projected_once_per_batch(random_models, flags):
    """hrt-spec (verifying and every drafting round) and HRT (stage I and stage II over all
    length groups) project the encoder keys/values once per batch."""
    data_dir, task, hrt, _ = random_models
    _, generator = build_generator(data_dir, hrt, "--max-len-b", "12", *flags)
    calls, handles = _count_key_projections(hrt.decoder)
    try:
        for batch in (RAGGED[:8], RAGGED[8:20]):
            calls.clear()
            hypos = generator.generate([hrt], make_sample(task, batch))
            assert len(hypos) == len(batch)
            assert len(calls) == len(hrt.decoder.layers)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("which", ["at", "hrt", "ssru"])
def test_block_pass_equals_step_pass_per_position(random_models, ssru_model, which):
    """The causal block pass over a whole prefix gives, at every position, the step pass's
    logits (and a block after a cached prefix continues it)."""
    _, task, hrt, at = random_models
    model = {"at": at, "hrt": hrt, "ssru": ssru_model}[which]
    d = task.target_dictionary
    sample = make_sample(task, RAGGED[:3])
    the_pass = decoder_pass(model.decoder)
    torch.manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d) - 8, (3, 7))
    tokens[:, 0] = d.eos()
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        step_state = the_pass.begin(encoder_out, 3, 12, d.eos())
        steps = torch.stack([the_pass.step(step_state, tokens[:, t], t) for t in range(7)], dim=1)
        block_state = the_pass.begin(encoder_out, 3, 12, d.eos(), zeroed=True)
        block = the_pass.block(block_state, tokens, torch.zeros(3, dtype=torch.long))
        assert torch.allclose(block, steps, atol=1e-5)
        split_state = the_pass.begin(encoder_out, 3, 12, d.eos(), zeroed=True)
        head = the_pass.block(split_state, tokens[:, :3], torch.zeros(3, dtype=torch.long))
        tail = the_pass.block(split_state, tokens[:, 3:], torch.full((3,), 3, dtype=torch.long))
        assert torch.allclose(torch.cat([head, tail], dim=1), steps, atol=1e-5)


def test_profiler_labels(random_models):
    """Under torch.profiler the parts of decoding carry their labels."""
    data_dir, task, hrt, _ = random_models
    sample = make_sample(task, RAGGED[:4])
    _, two_stage = build_generator(data_dir, hrt, "--decode-chunk-size", "2", "--beam", "2")
    _, spec = build_generator(data_dir, hrt, "--decoding", "hrt-spec", "--beam", "1")
    ref = two_stage.generate([hrt], sample)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ours = two_stage.generate([hrt], sample)
        spec.generate([hrt], sample)
    names = {event.name for event in prof.events()}
    assert {"hrt.encoder", "hrt.step", "hrt.stage2", "hrt.non_causal", "hrt.block"} <= names
    assert_same_hypotheses(ref, ours)


def test_a_module_the_plan_does_not_know_is_refused_by_name(tmp_path):
    """Support is an allow-list: a module of a class the plan does not read -- here a subclass
    of nn.Linear that computes otherwise -- is refused by name by the lean engine and by the
    exporter, never planned as the class it derives from."""

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    _, model = build_task_and_model(str(tmp_path), arch="hrt_tiny", seed=3)
    odd = copy.deepcopy(model)
    fc1 = odd.decoder.layers[0].fc1
    odd.decoder.layers[0].fc1 = ScaledLinear(fc1.in_features, fc1.out_features)
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.fc1 \(ScaledLinear\).*--decoder-engine fairseq"):
        DecoderPass(odd.decoder)
    assert any("decoder.layers.0.fc1 (ScaledLinear)" in reason for reason in unsupported(odd))
    assert unsupported(model) == [] and DecoderPass(model.decoder) is not None


# ------------------------------------------- the functions every pass and graph shares


def test_the_loop_bodys_buckets_are_rows_of_the_step_table():
    """The exported greedy loop computes a step's relative buckets from the step tensor
    (:func:`step_buckets`); they are the rows of the lean pass's table, for strides of
    Skip-AT, at windows smaller and larger than the steps."""
    for stride in (1, 2, 3):
        for window in (2, 16):
            table = relative_buckets(12, stride, window)
            for step in range(12):
                expected = table[step, : step + 1]
                got = step_buckets(torch.tensor(step), torch.tensor(stride), window)
                assert torch.equal(got, expected), (stride, window, step)


def test_pair_buckets_are_training_buckets_per_head():
    """The non-causal passes' buckets (lean, CUDA graph, exported) are training's
    :func:`relative_bucket` of the positions, one copy per head."""
    positions = torch.tensor([[0, 2, 4, 6, 8], [1, 2, 3, 4, 5]])
    got = pair_buckets(positions, 3, heads=4)
    assert got.shape == (2, 4, 5, 5)
    for head in range(4):
        assert torch.equal(got[:, head], relative_bucket(positions, positions, 3))
    assert got[0, 0, 0].tolist() == [3, 5, 6, 6, 6] and got[0, 0, 4].tolist() == [0, 0, 0, 1, 3]


def test_both_forms_of_the_token_choice_pick_the_same_rows():
    """:func:`choose` (the lean steps) and :func:`best_allowed` (the graphs, stage II) are one
    choice: the same rows, banned rows never, ``top`` 1 and ``top`` K, scores equal to float
    rounding; the blocked argmax of the graphs is the plain one."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 60, generator=generator) * 4
    bias = torch.zeros(60)
    bias[[0, 5, 17]] = -float("inf")
    bias[3] = -0.5
    logits[:, 5] = 100.0  # the best logit is banned
    for top in (1, 4):
        scores, rows = choose(logits, bias, top)
        graph_scores, graph_rows = best_allowed(logits, bias, top, block=argmax_block(60) if top == 1 else 1)
        assert torch.equal(rows, graph_rows)
        assert torch.allclose(scores, graph_scores, atol=1e-5)
        assert not set(rows.flatten().tolist()) & {0, 5, 17}
    single = best_allowed(logits, bias, 1, block=0)  # one TopK(1): the loop's form
    assert torch.equal(single[1], choose(logits, bias, 1)[1])
