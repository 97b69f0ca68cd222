"""The decoder is defined by fairseq's modules (what training runs); the planned decoder pass
(``passes/decoder_pass.py``) and the exported graphs (``export/graphs.py``) state it again for
decoding (``docs/design.md``, "Decoder definitions"). Each second statement is checked here
against the one it restates, on every decoder family, on ragged batches, and after the
weights change the ways training and loading change them -- with nothing told to forget."""

import copy
import math

import pytest
import torch
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig

from fairseq_hrt import chunking
from fairseq_hrt.export.graphs import ParallelGraph, StepGraph
from fairseq_hrt.passes.attention import ATTENTION_KERNELS, attention, attention_kernel
from fairseq_hrt.passes.decoder_pass import decoder_pass
from fairseq_hrt.passes.encoder_pass import EncoderPass
from fairseq_hrt.passes.state import EncoderKV
from fairseq_hrt.passes.weights import weights_version
from tests.hrt_fixtures import build_task_and_model, make_sample
from tests.test_generator import SPECIALS
from tests.test_lean import RAGGED, TINY_TRANSFORMER

AT = ("--hrt-mode", "at")
TWO_TIED = ("--decoder-layers", "2", "--decoder-tie-layers")

# every decoder family the planned pass knows: (arch, flags)
FAMILIES = {
    "transformer-pre-norm": ("at_tiny", AT),
    "transformer-post-norm": ("transformer", TINY_TRANSFORMER),
    "transformer-learned-pos": (
        "transformer",
        TINY_TRANSFORMER + ("--decoder-learned-pos", "--no-scale-embedding", "--layernorm-embedding"),
    ),
    "transformer-tied": ("at_tiny", AT + TWO_TIED),
    "hrt-relative": ("hrt_tiny", ()),
    "hrt-tied": ("hrt_tiny", TWO_TIED),
    "hrt-two-layers": ("hrt_tiny", ("--decoder-layers", "2")),
    "ssru": ("at_tiny_ssru", AT + ("--decoder-layers", "2")),
    "ssru-tied": ("at_tiny_ssru", AT + TWO_TIED),
}
NON_CAUSAL = ["hrt-relative", "hrt-tied"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("decoder_definitions"))


def build(data_dir, family, seed=3):
    arch, flags = FAMILIES[family]
    return build_task_and_model(data_dir, arch=arch, extra=flags, seed=seed)


def ragged_prefixes(task, rows=6, length=8, seed=0):
    """``(sample, prefixes, real)``: a ragged batch of sources, and per row a target prefix of
    its own length (``</s>`` first, then random tokens, ``<pad>`` after), ``real`` its slots
    that are not padding."""
    d = task.target_dictionary
    generator = torch.Generator().manual_seed(seed)
    prefixes = torch.full((rows, length), d.pad(), dtype=torch.long)
    for r in range(rows):
        size = 1 + (r * 3) % length
        prefixes[r, :size] = torch.randint(d.nspecial, len(d) - 8, (size,), generator=generator)
        prefixes[r, 0] = d.eos()
    return make_sample(task, RAGGED[:rows]), prefixes, prefixes.ne(d.pad())


def step_logits(model, encoder_out, prefixes):
    """The planned pass's logits ``(N, T, V)``, one :meth:`DecoderPass.step` per position."""
    the_pass = decoder_pass(model.decoder)
    n, t = prefixes.shape
    state = the_pass.begin(encoder_out, n, t, model.decoder.dictionary.eos())
    return torch.stack([the_pass.step(state, prefixes[:, i], i) for i in range(t)], dim=1)


def assert_step_pass_is_the_modules(model, task, atol=1e-5):
    """:meth:`DecoderPass.step`, position by position, gives the logits of the decoder module's
    own forward (fairseq's layers, what training runs) at every real slot of a ragged batch."""
    sample, prefixes, real = ragged_prefixes(task)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        expected, _ = model.decoder(prefixes, encoder_out=encoder_out)
        ours = step_logits(model, encoder_out, prefixes)
    assert torch.allclose(ours[real], expected[real], atol=atol), (ours[real] - expected[real]).abs().max()
    return expected[real]


def stage2_inputs(task, rows=7):
    d = task.target_dictionary
    generator = torch.Generator().manual_seed(1)
    skeleton = torch.full((rows, 6), d.pad(), dtype=torch.long)
    for r in range(rows):
        length = 1 + r % 6
        skeleton[r, : length - 1] = torch.randint(d.nspecial, len(d) - 8, (length - 1,), generator=generator)
        skeleton[r, length - 1] = d.eos()
    return chunking.stage2_input(skeleton, 2, d.pad(), task.mask_idx)


def assert_non_causal_pass_is_the_modules(model, task, atol=1e-5):
    """:meth:`DecoderPass.non_causal` gives the decoder module's non-causal features (HRT's
    stage II) at every real slot, masks and pads among them."""
    sample = make_sample(task, RAGGED[:7])
    stage2 = stage2_inputs(task)
    real = stage2.tokens.ne(task.target_dictionary.pad())
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        expected, _ = model.decoder(
            stage2.tokens, encoder_out=encoder_out, positions=stage2.positions, causal=False, features_only=True
        )
        the_pass = decoder_pass(model.decoder)
        ours = the_pass.non_causal(the_pass.encoder(encoder_out), stage2.tokens, stage2.positions)
    assert torch.allclose(ours[real], expected[real], atol=atol)
    return expected[real]


# ------------------------------------------------ the planned pass against fairseq's modules


# the passes' attention written out, and as PyTorch's fused scaled_dot_product_attention (the
# CUDA-graph engine's attention_kernel "fused"): both are fairseq's modules
KERNELS = pytest.mark.parametrize("kernel", ATTENTION_KERNELS, ids=lambda k: k or "written-out")


@KERNELS
@pytest.mark.parametrize("family", FAMILIES)
def test_step_pass_equals_the_decoder_modules(data_dir, family, kernel):
    task, model = build(data_dir, family)
    with attention_kernel(kernel):
        assert_step_pass_is_the_modules(model, task)


@KERNELS
@pytest.mark.parametrize("family", NON_CAUSAL)
def test_non_causal_pass_equals_the_decoder_modules(data_dir, family, kernel):
    task, model = build(data_dir, family)
    with attention_kernel(kernel):
        assert_non_causal_pass_is_the_modules(model, task)


@KERNELS
@pytest.mark.parametrize("family", ["transformer-pre-norm", "transformer-post-norm", "hrt-relative", "hrt-two-layers"])
def test_encoder_pass_equals_the_encoder_modules(data_dir, family, kernel):
    """The encoder's planned pass (what the CUDA-graph engine captures and the exported encoder
    traces): fairseq's encoder output, then every decoder layer's encoder keys/values, on a
    ragged (left-padded) batch."""
    task, model = build(data_dir, family)
    sample = make_sample(task, RAGGED[:7])
    src = sample["net_input"]["src_tokens"]
    with torch.no_grad(), attention_kernel(kernel):
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        bias, *kv = EncoderPass(model)(src)
        stacked_bias, stacked = EncoderPass(model).stacked(src)
    x = encoder_out["encoder_out"][0].transpose(0, 1)  # (B, S, C)
    real = src.ne(task.source_dictionary.pad())
    assert torch.equal(torch.isinf(bias.view(src.shape)), ~real)
    layers = model.decoder.layers
    for i, layer in enumerate(layers):
        attn = layer.encoder_attn
        for ours, projection in ((kv[i], attn.k_proj), (kv[len(layers) + i], attn.v_proj)):
            expected = projection(x).view(*src.shape, attn.num_heads, attn.head_dim).transpose(1, 2)
            assert torch.allclose(ours.transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-5)
    # the CUDA-graph engine's form: every layer's keys, then values, from one product
    assert stacked.shape[:2] == (2, len(layers)) and torch.equal(stacked_bias, bias)
    assert torch.allclose(stacked.flatten(0, 1), torch.stack(kv), atol=1e-6)


def test_encoder_kv_stacked_and_per_layer_select_the_same_sentences():
    """An :class:`EncoderKV` over one ``(2, L, B, H, S, d)`` tensor (the CUDA-graph engine's
    buffers) and one over per-layer lists hold and select the same keys and values; a
    selection of the stacked one stays one tensor."""
    stacked = torch.randn(2, 3, 5, 2, 4, 8)
    bias = torch.randn(5, 1, 1, 4)
    of_stack = EncoderKV.of_stack(stacked, bias)
    lists = EncoderKV([k.clone() for k in stacked[0]], [v.clone() for v in stacked[1]], bias)
    assert torch.equal(lists.stack(), stacked) and of_stack.stack() is stacked
    index = torch.tensor([4, 1, 1])
    a, b = of_stack.select(index), lists.select(index)
    assert a.stacked is not None and b.stacked is None
    assert torch.equal(a.stack(), b.stack()) and torch.equal(a.bias, b.bias)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
    stacked[0, 2].zero_()  # views: the stacked one's keys are the tensor's
    assert torch.count_nonzero(of_stack.keys[2]) == 0 and torch.count_nonzero(lists.keys[2]) > 0


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias_shape", [(9,), (3, 1, 1, 9)], ids=["static-step", "padding"])
def test_half_attention_takes_its_softmax_in_float32_from_the_bias_addition(bias_shape, bias_dtype):
    """Half queries and keys (``--fp16``): the scores plus a float32 bias are float32 by
    promotion inside the addition (no cast kernel of their own), the same probabilities, bit
    for bit, as the scores cast to float32 first; a half bias is cast."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, 8, generator=generator).half()
    k, v = (torch.randn(3, 2, 9, 8, generator=generator).half() for _ in range(2))
    # values a half addition would round (a mask's are 0 and -inf), and masked keys
    bias = torch.randn(bias_shape, generator=generator) * 3
    bias = bias.masked_fill(torch.rand(bias_shape, generator=generator) > 0.6, -math.inf)
    bias[..., 0] = 0.0  # every query sees a key
    bias = bias.to(bias_dtype)
    scores = torch.matmul(q, k.transpose(2, 3))
    expected = torch.matmul(torch.softmax(scores.float() + bias, dim=-1).type_as(scores), v)
    assert torch.equal(attention(q, k, v, bias=bias), expected)


def test_an_unknown_attention_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="attention kernel 'flash'"), attention_kernel("flash"):
        pass


# ------------------------------------------------- weights that change after a first decoding


def fairseq_adam_step(task, model, other):
    """One step of fairseq's Adam, taken as fairseq-train's trainer takes it (the task's
    ``optimizer_step``), which writes the weights through ``p.data`` and so leaves the
    parameters' version counters as they were."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FairseqAdam(FairseqAdamConfig(lr=[0.05], adam_betas="(0.9, 0.999)"), params)
    generator = torch.Generator().manual_seed(2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.device)
    versions = [p._version for p in params]
    task.optimizer_step(optimizer, model, update_num=0)
    assert [p._version for p in params] == versions  # the case version counters alone miss


def torch_adam_step(task, model, other):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=0.05)
    generator = torch.Generator().manual_seed(2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.device)
    optimizer.step()


def load_other_weights(task, model, other):
    model.load_state_dict(other.state_dict())


def scale_in_place(task, model, other):
    with torch.no_grad():
        for p in model.decoder.parameters():
            p.mul_(1.5)


def first_linear(model):
    return next(m for m in model.decoder.layers[0].modules() if isinstance(m, torch.nn.Linear))


def new_parameter(task, model, other):
    """A parameter object replaced (no version counter of the old one moves)."""
    linear = first_linear(model)
    linear.weight = torch.nn.Parameter(linear.weight.detach() * 1.5)


def layer_replaced(task, model, other):
    """A submodule replaced by another of new parameters (as quantizers and adapters do)."""
    linear = first_linear(model)
    owner = next(m for m in model.decoder.layers[0].modules() if linear in m.children())
    name = next(n for n, m in owner.named_children() if m is linear)
    replacement = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        replacement.weight.copy_(linear.weight * 1.5)
        if linear.bias is not None:
            replacement.bias.copy_(linear.bias)
    setattr(owner, name, replacement)


WEIGHT_CHANGES = {
    "fairseq-adam-step": fairseq_adam_step,
    "torch-adam-step": torch_adam_step,
    "load_state_dict": load_other_weights,
    "in-place-write": scale_in_place,
    "new-parameter": new_parameter,
    "layer-replaced": layer_replaced,
}


@pytest.mark.parametrize("change", WEIGHT_CHANGES)
@pytest.mark.parametrize("family", ["transformer-pre-norm", "hrt-relative", "ssru"])
def test_the_pass_decodes_the_weights_of_the_moment(data_dir, family, change):
    """Decoded once (the plan, its fused projections made), then the weights change as an
    optimizer step or a load changes them: the next passes compute with the new weights,
    with no call to forget anything."""
    task, model = build(data_dir, family, seed=3)
    _, other = build(data_dir, family, seed=9)
    model = copy.deepcopy(model)
    before = assert_step_pass_is_the_modules(model, task)
    non_causal_before = assert_non_causal_pass_is_the_modules(model, task) if family in NON_CAUSAL else None
    plan = decoder_pass(model.decoder).plan()
    WEIGHT_CHANGES[change](task, model, other)
    after = assert_step_pass_is_the_modules(model, task)
    assert not torch.allclose(before, after, atol=1e-3)  # the change is one the outputs show
    assert decoder_pass(model.decoder).plan() is not plan
    if non_causal_before is not None:
        assert not torch.allclose(non_causal_before, assert_non_causal_pass_is_the_modules(model, task), atol=1e-3)


def test_an_unchanged_model_keeps_its_plan(data_dir):
    """No change, no new plan: decoding does not make the fused projections again."""
    task, model = build(data_dir, "hrt-relative")
    the_pass = decoder_pass(model.decoder)
    plan = the_pass.plan()
    assert_step_pass_is_the_modules(model, task)
    assert_non_causal_pass_is_the_modules(model, task)
    assert the_pass.plan() is plan


# ------------------------------------------ the exported graphs (in torch) against the planned pass


@pytest.mark.parametrize("family", ["transformer-pre-norm", "transformer-post-norm", "hrt-relative", "ssru-tied"])
def test_step_graph_equals_the_step_pass(data_dir, family):
    """``export.graphs.StepGraph`` (past keys/values in, present out; scaling folded into the
    query weights), run in torch step by step with every row kept (``top`` = the vocabulary),
    gives the planned pass's log-probabilities at every real slot."""
    task, model = build(data_dir, family)
    d = task.target_dictionary
    sample, prefixes, real = ragged_prefixes(task)
    n, t = prefixes.shape
    vocab = len(d)
    graph = StepGraph(model, model.decoder.max_positions(), top=vocab)
    the_pass = decoder_pass(model.decoder)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        expected = torch.log_softmax(step_logits(model, encoder_out, prefixes), dim=-1)
        kv = the_pass.encoder(encoder_out)
        layers = len(graph.plan.layers)
        if graph.recurrent:
            past = [torch.zeros(n, the_pass.heads * the_pass.head_dim) for _ in range(layers)]
        else:
            empty = torch.zeros(n, the_pass.heads, 0, the_pass.head_dim)
            past = [empty] * (2 * layers)
        ours = []
        for i in range(t):
            buckets = []
            if graph.window > 0:
                buckets = [torch.clamp(torch.arange(i + 1) - i, -graph.window, graph.window) + graph.window]
            scores, rows, *past = graph(
                prefixes[:, i],
                torch.tensor([i]),
                *buckets,
                torch.zeros(vocab),
                kv.bias,
                *kv.keys,
                *kv.values,
                *past,
            )
            ours.append(torch.empty(n, vocab).scatter_(1, rows, scores))
    ours = torch.stack(ours, dim=1)
    assert torch.allclose(ours[real], expected[real], atol=1e-5)


@pytest.mark.parametrize("family", NON_CAUSAL)
def test_parallel_graph_equals_the_non_causal_pass(data_dir, family):
    """``export.graphs.ParallelGraph`` (stage II's pass with its choice) chooses at every real
    slot the planned non-causal pass's best allowed token, with its log-probability."""
    task, model = build(data_dir, family)
    d = task.target_dictionary
    sample = make_sample(task, RAGGED[:7])
    stage2 = stage2_inputs(task)
    n, t = stage2.tokens.shape
    real = stage2.tokens.ne(d.pad()).view(-1)
    banned = torch.zeros(len(d))
    banned[[d.index(s) for s in SPECIALS]] = -float("inf")
    graph = ParallelGraph(model, model.decoder.max_positions())
    the_pass = decoder_pass(model.decoder)
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(sample["net_input"])
        kv = the_pass.encoder(encoder_out)
        features = the_pass.non_causal(kv, stage2.tokens, stage2.positions)
        expected, expected_rows = (torch.log_softmax(the_pass.plan().output(features), dim=-1) + banned).max(dim=-1)
        select = torch.arange(n * t)
        scores, rows = graph(
            stage2.tokens, stage2.positions, torch.arange(t), select, banned, kv.bias, *kv.keys, *kv.values
        )
    assert rows[real].tolist() == expected_rows.view(-1)[real].tolist()
    assert torch.allclose(scores[real], expected.view(-1)[real], atol=1e-5)


@pytest.mark.parametrize("change", [None, "layer-replaced", "new-parameter"])
def test_the_kept_parameters_are_the_modules_parameters(data_dir, change):
    """weights_version reads each module's kept list of parameters: the list a walk over the
    modules gives, in its order, also after a layer or a parameter was replaced."""
    task, model = build(data_dir, "hrt-relative")
    model = copy.deepcopy(model)
    for module in (model, model.decoder):
        weights_version(module)
    if change is not None:
        WEIGHT_CHANGES[change](task, model, None)
    for module in (model, model.decoder):
        walked = list(module.parameters())
        assert weights_version(module)[1:] == (tuple(p.data_ptr() for p in walked), tuple(p._version for p in walked))


def test_a_cast_and_a_cast_back_change_the_weights_version(data_dir):
    """The version reads addresses and version counters, not dtypes: a cast makes new storage
    and bumps the counters, and a cast back is not the version before (the plan made before
    it would hold the weights as they were before their rounding)."""
    _, model = build(data_dir, "hrt-relative")
    model = copy.deepcopy(model)
    before = weights_version(model)
    model.half()
    halved = weights_version(model)
    model.float()
    assert len({before, halved, weights_version(model)}) == 3
    assert weights_version(model) == weights_version(model)
