"""The planned decoder pass of the lean engines: one decoder layer loop over a fairseq
``TransformerDecoderBase``, an ``HRTDecoder`` or an SSRU decoder, read from the decoder's
own modules (so ``--quantize int8`` and ``model.half()`` apply), in four modes:

* :meth:`DecoderPass.step` -- one left-to-right step (a pass of width 1 over the cache) of the
  lean search (:mod:`fairseq_hrt.generation.lean`); :meth:`DecoderPass.static_step` is the
  same step on shapes that do not change from step to step (the whole cache, the future
  masked), what ``--compile`` compiles;
* :meth:`DecoderPass.block` -- a causal pass over a block of ``W`` tokens per row, written
  into the cache at each row's own positions (Jacobi decoding and ``hrt-spec``'s verifying
  passes, :mod:`fairseq_hrt.generation.jacobi`);
* :meth:`DecoderPass.non_causal` -- a non-causal pass without cache over tokens at given
  positions (HRT's stage II, ``hrt-spec``'s drafts).

Every mode runs :meth:`DecoderPass._layers` with one self-attention function
(:meth:`DecoderPass._self_attention`: queries of width ``W``, keys/values from the cache or
the same block), one SSRU recurrence (:meth:`DecoderPass._recurrence`), one encoder attention
(:meth:`EncoderKV.attention`) and one embedding prologue (:meth:`DecoderPass._prologue`).

A decoder has one pass (:func:`decoder_pass`), planned once per version of its weights
(:class:`StepPlan`: the modules as plain functions, with fused q/k/v weights, made again when
:func:`weights_version` changes) and shared by every engine that decodes it.
The encoder-side keys/values of a batch are projected once (:meth:`DecoderPass.encoder`,
:class:`EncoderKV`) and held by the batch's :class:`DecoderState`.

The modes are labelled for ``torch.profiler`` (``hrt.step``, ``hrt.block``,
``hrt.non_causal``) while a profiler runs (:func:`profiled`; a label costs a few
microseconds, so none is made otherwise).
"""

import functools
import math
import weakref
from typing import Dict, List, Optional

import torch
import torch.autograd.profiler as autograd_profiler
import torch.nn.functional as F
from fairseq.models.transformer import (
    TransformerDecoder,
    TransformerDecoderBase,
    TransformerEncoder,
    TransformerEncoderBase,
)
from fairseq.modules import (
    FairseqDropout,
    LearnedPositionalEmbedding,
    MultiheadAttention,
    SinusoidalPositionalEmbedding,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.hrt_transformer import HRTDecoder, HRTDecoderLayer
from fairseq_hrt.models.ssru_transformer import SSRUDecoder, SSRUDecoderLayer
from fairseq_hrt.modules.cpu_dropout import PCG64Dropout
from fairseq_hrt.modules.relative_attention import RelativeSelfAttention, relative_bucket
from fairseq_hrt.modules.ssru import SSRU, linear_recurrence
from fairseq_hrt.passes.output_vocab import restricted_output_layer

# ------------------------------------------------------------------------ profiling labels


def profiled(name: str):
    """Decorator: run the function inside ``torch.profiler.record_function(name)`` while a
    profiler runs, plainly otherwise (a label costs time in a batch-1 step:
    benchmarks/results/runtime-step-cost-cpu/README.md)."""

    def decorate(function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            if autograd_profiler._is_profiler_enabled:
                with torch.profiler.record_function(name):
                    return function(*args, **kwargs)
            return function(*args, **kwargs)

        return run

    return decorate


# ------------------------------------------------------------------ weights' versions

_optimizer_steps = 0  # optimizer steps taken in this process, by any torch.optim.Optimizer


def _count_optimizer_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


# fairseq's optimizers write the weights through ``p.data``, which the parameters' version
# counters do not see (an --eval-bleu validation once decoded with the fused projections of
# the previous one, and logged a BLEU far below the same weights'): every optimizer step
# (fairseq's, subclasses of torch.optim.Optimizer, included) counts instead
register_optimizer_step_post_hook(_count_optimizer_step)


def weights_version(module) -> tuple:
    """What changes whenever ``module``'s weights may have: the optimizer steps taken in this
    process, then each parameter's storage, dtype, device and version counter (a write
    through the parameter itself, ``load_state_dict``'s copies included). What is computed
    from the weights and kept (the plan's fused projections, captured graphs) is kept with
    the version it was computed at and computed again when it differs."""
    return _optimizer_steps, tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in module.parameters())


# ------------------------------------------------------------------------- pure functions


def relative_buckets(steps: int, stride: int, window: int) -> Tensor:
    """``(steps, steps)``: row ``t`` holds the relative-key index of keys ``0..t`` seen from
    query step ``t`` when step ``j`` sits at position ``j * stride``."""
    positions = (torch.arange(steps) * stride).unsqueeze(0)
    return relative_bucket(positions, positions, window)[0]


def padding_bias(padding_mask: Optional[Tensor], length: int, rows: int, dtype, device) -> Tensor:
    """Additive attention bias ``(rows, 1, 1, length)``: ``-inf`` on padding, else 0."""
    bias = torch.zeros(rows, 1, 1, length, dtype=dtype, device=device)
    if padding_mask is not None:
        bias.masked_fill_(padding_mask.view(rows, 1, 1, length), -math.inf)
    return bias


def encoder_padding_bias(encoder_out) -> Tensor:
    """:func:`padding_bias` of a fairseq encoder output's padding, ``(B, 1, 1, S)``."""
    enc = encoder_out["encoder_out"][0]
    pad_mask = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) > 0 else None
    return padding_bias(pad_mask, enc.size(0), enc.size(1), torch.float32, enc.device)


def attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    relative_keys: Optional[Tensor] = None,
    buckets: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """Scaled dot-product attention ``(N, H, W, d)`` of queries ``q`` ``(N, H, W, d)`` (already
    scaled) over ``keys``/``values`` ``(N, H, K, d)``, softmax in float32.

    ``relative_keys`` ``(d, R)``: key-only relative positions, the logit of key ``j`` gains
    ``q . relative_keys[:, bucket]`` with ``buckets`` either ``(K,)`` (the same for every
    query) or ``(N, H, W, K)``. ``bias``: an additive float mask broadcast to the scores
    (``-inf``: not seen), or ``None``."""
    scores = torch.matmul(q, keys.transpose(2, 3))  # (N, H, W, K)
    if relative_keys is not None:
        q_rel = torch.matmul(q, relative_keys)  # (N, H, W, R)
        scores = scores + (q_rel.index_select(3, buckets) if buckets.dim() == 1 else q_rel.gather(3, buckets))
    if bias is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(scores.float() + bias, dim=-1)
    return torch.matmul(probs.type_as(scores), values)


def is_recurrent(layer) -> bool:
    """Whether a decoder layer is an SSRU layer (no self-attention)."""
    return isinstance(layer, SSRUDecoderLayer)


def ssru_step(projections, cell: Tensor) -> Tensor:
    """:func:`ssru_step_` into a new tensor (the exported step's: a graph writes no input)."""
    negated_gate, projected = projections
    return torch.lerp(cell, projected, torch.sigmoid(negated_gate))


def ssru_step_(projections, cell: Tensor) -> Tensor:
    """The SSRU's next cell, in place: ``c <- c + (1 - f) (W x - c) = f c + (1 - f) W x``
    (one ``lerp``), from ``(-(W_f x + b_f), W x)``: ``sigmoid`` of the negated gate is
    ``1 - f`` without a subtraction. Equals :class:`fairseq_hrt.modules.ssru.SSRU` to float
    rounding."""
    negated_gate, projected = projections
    return cell.lerp_(projected, torch.sigmoid(negated_gate))


def ssru_projections(ssru):
    """``x -> (-(W_f x + b_f), W x)``: one matrix product over ``[-W_f; W]`` (bias
    ``[-b_f; 0]``) when both are plain ``nn.Linear`` (else, e.g. int8-quantized, one call
    each)."""
    gate, projection = ssru.forget_gate, ssru.input_proj
    if type(gate) is nn.Linear and type(projection) is nn.Linear:
        weight = torch.cat([-gate.weight, projection.weight])
        bias = torch.cat([-gate.bias, torch.zeros_like(gate.bias)])
        size = gate.out_features
        return lambda x: F.linear(x, weight, bias).split(size, dim=-1)
    gate_f, projection_f = as_function(gate), as_function(projection)
    return lambda x: (gate_f(x).neg_(), projection_f(x))


def layer_forward(layer: "LayerPlan", i: int, x: Tensor, self_block, encoder_block, pick=None) -> Tensor:
    """Decoder layer ``i`` (pre- or post-norm residual blocks) around the given self- and
    encoder-attention blocks, functions ``(layer, i, h) -> output``: the modes of
    :class:`DecoderPass` differ only in those.

    ``pick``: ``x -> x`` at the query slots only. The layer's output is then computed at those
    slots alone: ``self_block`` takes its keys and values from every slot of ``h`` and its
    queries from ``pick(h)``, and the residual, the encoder attention and the feed-forward run
    on the picked slots (the last layer of a non-causal pass whose output is read at a few
    slots: HRT's stage II reads only its masks)."""
    pre_norm = layer.pre_norm
    residual = x if pick is None else pick(x)
    h = layer.self_attn_norm(x) if pre_norm else x
    x = residual + self_block(layer, i, h)
    if not pre_norm:
        x = layer.self_attn_norm(x)
    residual = x
    h = layer.encoder_attn_norm(x) if pre_norm else x
    x = residual + encoder_block(layer, i, h)
    if not pre_norm:
        x = layer.encoder_attn_norm(x)
    residual = x
    h = layer.final_norm(x) if pre_norm else x
    x = residual + layer.fc2(layer.activation(layer.fc1(h)))
    if not pre_norm:
        x = layer.final_norm(x)
    return x


def as_function(module):
    """A plain ``nn.Linear`` / ``nn.LayerNorm`` as a function of its tensors: the same
    arithmetic without the per-call cost of ``Module.__call__``, which at batch 1 is a good
    part of a step. Other modules (int8-quantized linears) are returned as they are."""
    if module is None:
        return None
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    if type(module) is nn.LayerNorm:
        shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
        return lambda x: F.layer_norm(x, shape, weight, bias, eps)
    return module


def fused_projections(*modules):
    """``x -> (m(x) for m in modules)``: one matrix product over the concatenated weights when
    every module is a plain ``nn.Linear``."""
    if all(type(m) is nn.Linear for m in modules) and all(m.bias is not None for m in modules):
        weight = torch.cat([m.weight for m in modules])
        bias = torch.cat([m.bias for m in modules])
        sizes = [m.out_features for m in modules]
        return lambda x: F.linear(x, weight, bias).split(sizes, dim=-1)
    functions = [as_function(m) for m in modules]
    return lambda x: tuple(f(x) for f in functions)


class LayerPlan:
    """One decoder layer's modules as functions (:func:`as_function`)."""

    def __init__(self, layer):
        encoder_attn = layer.encoder_attn
        self.pre_norm = layer.normalize_before
        self.recurrent = is_recurrent(layer)
        self.scaling = encoder_attn.scaling
        self.heads, self.head_dim = encoder_attn.num_heads, encoder_attn.head_dim
        if self.recurrent:  # SSRU layer: its norm stands where the self-attention's does
            self.ssru_projections = ssru_projections(layer.ssru)
            self.self_attn_norm = as_function(layer.ssru_layer_norm)
        else:
            self_attn = layer.self_attn
            self.scaling = self_attn.scaling
            self.qkv = fused_projections(self_attn.q_proj, self_attn.k_proj, self_attn.v_proj)
            keys = getattr(self_attn, "relative_keys", None)
            self.relative_keys = keys.weight.t() if keys is not None else None
            self.self_out = as_function(self_attn.out_proj)
            self.self_attn_norm = as_function(layer.self_attn_layer_norm)
        self.encoder_q = as_function(encoder_attn.q_proj)
        self.encoder_out = as_function(encoder_attn.out_proj)
        self.encoder_attn_norm = as_function(layer.encoder_attn_layer_norm)
        self.final_norm = as_function(layer.final_layer_norm)
        self.fc1, self.fc2 = as_function(layer.fc1), as_function(layer.fc2)
        self.activation = layer.activation_fn


class StepPlan:
    """The decoder's embedding, layers and output as functions."""

    def __init__(self, decoder):
        scale, embed = decoder.embed_scale, decoder.embed_tokens
        project_in = as_function(decoder.project_in_dim)

        def embed_tokens(tokens):
            x = scale * embed(tokens)
            return project_in(x) if project_in is not None else x

        self.embed = embed_tokens
        self.layernorm_embedding = as_function(decoder.layernorm_embedding)
        # tied decoder layers (--decoder-tie-layers) share one plan: one set of fused weights
        plans = {}
        self.layers = []
        for layer in decoder.layers:
            key = tuple(id(p) for p in layer.parameters()) or id(layer)
            if key not in plans:
                plans[key] = LayerPlan(layer)
            self.layers.append(plans[key])
        final_norm, project_out = as_function(decoder.layer_norm), as_function(decoder.project_out_dim)
        self.output_projection = decoder.output_projection
        projection = as_function(decoder.output_projection)

        def features(x):
            if final_norm is not None:
                x = final_norm(x)
            if project_out is not None:
                x = project_out(x)
            return x

        self.features = features
        self.output = lambda x: projection(features(x))

    def restricted_output(self, vocab: Tensor):
        """The output layer for the rows ``vocab`` only (a shortlist's candidates)."""
        project = restricted_output_layer(self.output_projection, vocab)
        features = self.features
        return lambda x: project(features(x))


# graphs of one compiled step: a model has one per kind of batch (1 row, 1 row per sentence,
# a beam of rows per sentence: torch.compile specialises sizes 1 and the rows-per-sentence
# relation), and a process may decode several models (the benchmark) -- more than
# torch._dynamo's default of 8, after which it would silently fall back to eager steps
COMPILED_GRAPHS_LIMIT = 64


def compile_step(step_function):
    """``torch.compile`` of a step function of static shapes (dynamic dimensions, so batches
    of other sizes reuse the graph). The default mode on every device: CUDA-graph capture
    (``reduce-overhead``) would also need the caches at static addresses and the logits read
    before the next replay, which no GPU has verified here yet. Its calls (where dynamo
    compiles) run with a recompile limit of at least :data:`COMPILED_GRAPHS_LIMIT`; the
    process's own setting is left as it is for every other compiled function."""
    import torch._dynamo  # noqa: PLC0415 - optional: torch.compile only where --compile asks for it

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    compiled = torch.compile(step_function, dynamic=True)

    def step(*args):
        with config.patch(**{name: max(getattr(config, name), COMPILED_GRAPHS_LIMIT)}):
            return compiled(*args)

    return step


# ------------------------------------------------------------------------------ state


class EncoderKV:
    """The encoder side of one batch: every layer's encoder-attention keys and values
    ``(B, H, S, d)`` and the source padding bias ``(B, 1, 1, S)``, one row per sentence.
    Projected once per batch (:meth:`DecoderPass.encoder`); it serves a
    :class:`DecoderState` and, on its own, the non-causal pass."""

    __slots__ = ("keys", "values", "bias")

    def __init__(self, keys: List[Tensor], values: List[Tensor], bias: Tensor):
        self.keys, self.values, self.bias = keys, values, bias

    def select(self, index: Tensor) -> "EncoderKV":
        """The sentences ``index`` (in that order; repeats allowed), a new object."""
        return EncoderKV(
            [k.index_select(0, index) for k in self.keys],
            [v.index_select(0, index) for v in self.values],
            self.bias.index_select(0, index),
        )

    def attention(self, layer: "LayerPlan", i: int, x: Tensor) -> Tensor:
        """Encoder attention of layer ``i`` for ``x`` ``(N, C)`` or ``(N, W, C)``: the ``N / B``
        rows of a sentence (its beam) and their ``W`` queries are the queries of one
        attention over its source."""
        keys = self.keys[i]
        q = (layer.encoder_q(x) * layer.scaling).view(keys.size(0), -1, layer.heads, layer.head_dim).transpose(1, 2)
        out = attention(q, keys, self.values[i], None, None, self.bias).transpose(1, 2)  # (B, rows x W, H, d)
        # (reshape's shape as ints: a torch.Size costs a microsecond more, per layer and step)
        return layer.encoder_out(out.reshape(x.size(0), -1) if x.dim() == 2 else out.reshape(x.size(0), x.size(1), -1))


class DecoderState:
    """The caches of one batch for :meth:`DecoderPass.step` / :meth:`DecoderPass.block`.

    Self-attention keys/values ``(rows, H, steps, d)`` per layer, position ``p`` at index
    ``p``; SSRU layers' cells ``(rows, steps + 1, C)`` per layer, the cell after position
    ``p`` at index ``p + 1`` (index 0: the zero cell before position 0), so a step or a
    block starts from the cell at its first position's index. Both written in place.
    ``encoder``: the :class:`EncoderKV` of the batch's sentences (rows are sentence-major)."""

    def __init__(self, plan, encoder: EncoderKV, self_k, self_v, cells, positions, buckets, output=None):
        self.plan = plan
        self.output = output if output is not None else plan.output
        self.encoder = encoder
        self.self_k, self.self_v, self.cells = self_k, self_v, cells
        self.positions, self.buckets = positions, buckets

    def reorder_rows(self, index: Tensor, step: int):
        """Row ``r`` of the caches becomes old row ``index[r]`` (positions ``0..step``), in place."""
        n = index.numel()
        for cache in self.self_k + self.self_v:
            cache[:n, :, : step + 1] = cache[:, :, : step + 1].index_select(0, index)
        for cells in self.cells:
            cells[:n, : step + 2] = cells[:, : step + 2].index_select(0, index)

    def select_sentences(self, index: Tensor):
        """Keep only the given sentences' encoder keys/values (finished ones leave)."""
        self.encoder = self.encoder.select(index)


# ---------------------------------------------------------------------------- the pass


@functools.lru_cache(maxsize=None)
def _planned_classes():
    """The module classes the planned passes read, exactly (a subclass may compute otherwise)."""
    # modules the plan calls as they are (it reads their arithmetic, not their insides)
    calls = {
        nn.Linear,
        nn.LayerNorm,
        nn.Embedding,
        FairseqDropout,
        PCG64Dropout,  # fairseq-train's models on the CPU (--cpu-dropout-rng): identity at decoding
        SinusoidalPositionalEmbedding,
        LearnedPositionalEmbedding,
    }
    classes = calls | {nn.ModuleList, MultiheadAttention, RelativeSelfAttention, SSRU}
    decoder = {
        TransformerDecoderBase,
        TransformerDecoder,
        HRTDecoder,
        SSRUDecoder,
        TransformerDecoderLayerBase,
        TransformerDecoderLayer,
        HRTDecoderLayer,
        SSRUDecoderLayer,
    }
    encoder = {TransformerEncoderBase, TransformerEncoder, TransformerEncoderLayerBase, TransformerEncoderLayer}
    try:  # --quantize int8 (the lean engine runs the quantized linears as they are)
        from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear  # noqa: PLC0415 - optional: torch.ao

        classes.add(QuantizedLinear)
        calls.add(QuantizedLinear)
    except ImportError:  # pragma: no cover
        pass
    try:  # fairseq's LayerNorm on a GPU with apex
        from fairseq.modules.layer_norm import FusedLayerNorm  # noqa: PLC0415 - optional: apex, GPU only

        classes.add(FusedLayerNorm)
        calls.add(FusedLayerNorm)
    except ImportError:  # pragma: no cover
        pass
    return {"decoder": classes | decoder, "encoder": classes | encoder, "calls": calls}


def unplanned_modules(module, part: str = "decoder") -> List[str]:
    """The submodules of a decoder (``part`` "decoder") or encoder (``"encoder"``) that the
    planned passes do not know, as ``name (Class)``: support is an allow-list, so a module the
    plan would skip without a word is refused by name instead."""
    known, calls = _planned_classes()[part], _planned_classes()["calls"]
    unknown: List[str] = []

    def visit(m, name):
        if type(m) not in known:
            unknown.append(f"{part}.{name or '(itself)'} ({type(m).__name__})")
        elif type(m) not in calls:  # a module the plan calls is its own business inside
            for child_name, child in m.named_children():
                visit(child, f"{name}.{child_name}" if name else child_name)

    visit(module, "")
    return unknown


class DecoderPass:
    """The planned passes of one decoder (see the module's docstring). Get it with
    :func:`decoder_pass`: one per decoder, shared by the engines that decode it."""

    def __init__(self, decoder):
        unknown = unplanned_modules(decoder)
        if unknown:
            raise RefusedOptions(
                f"the planned decoder pass (the lean engine, Jacobi decoding, the ONNX export) does not know the "
                f"module(s) {', '.join(unknown)}; use --decoder-engine fairseq"
            )
        for reason, bad in self._unsupported(decoder).items():
            if bad:
                raise RefusedOptions(
                    f"the planned decoder pass (the lean engine, Jacobi decoding, the ONNX export) does not support "
                    f"{reason}; use --decoder-engine fairseq"
                )
        self._decoder = weakref.ref(decoder)  # the pass is cached per decoder: no cycle
        first = decoder.layers[0]
        self.recurrent = is_recurrent(first)
        self_attn = getattr(first, "self_attn", None)
        self.heads = first.encoder_attn.num_heads
        self.head_dim = first.encoder_attn.head_dim
        self.relative = isinstance(self_attn, RelativeSelfAttention) and self_attn.relative_keys is not None
        self.window = self_attn.window if self.relative else 0
        self.start_stride = getattr(decoder, "start_stride", None)
        self._plan, self._plan_key = None, None

    @property
    def decoder(self):
        return self._decoder()

    @staticmethod
    def _unsupported(decoder) -> Dict[str, bool]:
        layers = list(decoder.layers)
        return {
            "an adaptive softmax": getattr(decoder, "adaptive_softmax", None) is not None,
            "--cross-self-attention": getattr(decoder, "cross_self_attention", False),
            "quantization noise": getattr(decoder, "quant_noise", None) is not None,
            "a decoder without encoder attention": any(layer.encoder_attn is None for layer in layers),
            "NormFormer layers (--scale-attn/--scale-heads/--scale-fc/--scale-resids)": any(
                getattr(layer, name, None) is not None
                for layer in layers
                for name in ("attn_ln", "c_attn", "ffn_layernorm", "w_resid")
            ),
            "attention with bias_kv / zero_attn": any(
                attn.bias_k is not None or attn.add_zero_attn
                for layer in layers
                for attn in (getattr(layer, "self_attn", None), layer.encoder_attn)
                if attn is not None
            ),
            "decoder layers of different shapes": len(
                {layer.encoder_attn.num_heads for layer in layers if layer.encoder_attn is not None}
            )
            > 1
            or len({is_recurrent(layer) for layer in layers}) > 1,
        }

    def plan(self) -> "StepPlan":
        """The decoder's modules as plain functions, built again whenever
        :func:`weights_version` of the decoder changed since: the fused q/k/v weights are
        copies of the parameters, never left stale."""
        key = weights_version(self.decoder)
        if self._plan is None or self._plan_key != key:
            self._plan, self._plan_key = StepPlan(self.decoder), key
        return self._plan

    # ------------------------------------------------------------------- batch state

    def stride_of(self, start_token: int) -> int:
        """Distance of consecutive target positions for a start symbol (``<s_k>``: k)."""
        return int(self.start_stride[start_token]) if self.start_stride is not None else 1

    def position_table(self, steps: int, stride: int, start_token: int, device) -> Optional[Tensor]:
        """``(steps, C)`` position embeddings of steps ``0..steps-1``, by the decoder's own code."""
        decoder = self.decoder
        if decoder.embed_positions is None:
            return None
        tokens = torch.full((1, steps), start_token, dtype=torch.long, device=device)

        if self.start_stride is not None:  # a decoder of <s_k> start symbols: positions 0, k, 2k, ..
            positions = (torch.arange(steps, device=device) * stride).unsqueeze(0)
            table = decoder.embed_target_positions(tokens, positions)
        else:
            table = decoder.embed_positions(tokens)
        return table[0].to(decoder.embed_tokens.weight.dtype)

    def encoder(self, encoder_out) -> EncoderKV:
        """Every layer's encoder-attention keys and values of a fairseq encoder output, and
        its padding bias: projected here, once per batch."""
        enc = encoder_out["encoder_out"][0]  # (S, B, C)
        src_len, bsz, _ = enc.shape
        keys, values = [], []
        for layer in self.decoder.layers:
            attn = layer.encoder_attn
            keys.append(attn.k_proj(enc).view(src_len, bsz, self.heads, self.head_dim).permute(1, 2, 0, 3).contiguous())
            values.append(
                attn.v_proj(enc).view(src_len, bsz, self.heads, self.head_dim).permute(1, 2, 0, 3).contiguous()
            )
        return EncoderKV(keys, values, encoder_padding_bias(encoder_out))

    def begin(
        self,
        encoder_out,
        rows: int,
        steps: int,
        start_token: int,
        vocab: Optional[Tensor] = None,
        zeroed: bool = False,
        encoder: Optional[EncoderKV] = None,
    ) -> DecoderState:
        """Caches for ``rows`` hypotheses (sentence-major) of the encoder output's sentences and
        at most ``steps`` positions; the encoder-side keys/values are projected here, once
        (or ``encoder``'s are taken). ``vocab``: the output-layer rows (sorted ids) the
        steps compute logits for (default: all). ``zeroed``: self-attention caches hold
        zeros (not uninitialised memory) for passes that read masked slots (static steps,
        blocks): ``0 x NaN`` would be NaN."""
        enc = encoder_out["encoder_out"][0]  # (S, B, C)
        dtype, device = enc.dtype, enc.device
        new_cache = torch.zeros if zeroed else torch.empty
        self_k, self_v, cells = [], [], []
        for _ in self.decoder.layers:
            if self.recurrent:  # index 0: the SSRU's c_{-1} = 0
                cells.append(torch.zeros(rows, steps + 1, enc.size(-1), dtype=dtype, device=device))
            else:
                self_k.append(new_cache(rows, self.heads, steps, self.head_dim, dtype=dtype, device=device))
                self_v.append(new_cache(rows, self.heads, steps, self.head_dim, dtype=dtype, device=device))
        stride = self.stride_of(start_token)
        plan = self.plan()
        return DecoderState(
            plan=plan,
            encoder=encoder if encoder is not None else self.encoder(encoder_out),
            self_k=self_k,
            self_v=self_v,
            cells=cells,
            positions=self.position_table(steps, stride, start_token, device),
            buckets=relative_buckets(steps, stride, self.window).to(device) if self.relative else None,
            output=plan.output if vocab is None else plan.restricted_output(vocab),
        )

    # ------------------------------------------------------------------------- modes

    @profiled("hrt.step")
    def step(self, state: DecoderState, tokens: Tensor, step: int) -> Tensor:
        """Logits ``(N, V)`` of the next token after ``tokens`` ``(N,)`` at position ``step``
        (``V``: the rows of ``begin``'s ``vocab``): a pass of width 1 over the cache."""
        n = tokens.size(0)
        x = self._prologue(state.plan, tokens, None if state.positions is None else state.positions[step])
        buckets = None if state.buckets is None else state.buckets[step, : step + 1]
        return state.output(self._layers(state, x, n, step, step + 1, buckets, None))

    def static_step(self, state: DecoderState, tokens: Tensor, step: Tensor) -> Tensor:
        """:meth:`step` with ``step`` a ``(1,)`` tensor and self-attention over the whole
        cache, future positions masked: no shape depends on the step (``--compile``)."""
        n = tokens.size(0)
        x = self._prologue(
            state.plan, tokens, None if state.positions is None else state.positions.index_select(0, step)
        )
        buckets = None if state.buckets is None else state.buckets.index_select(0, step).view(-1)
        bias = None
        if not self.recurrent:
            future = torch.arange(state.self_k[0].size(2), device=tokens.device) > step
            bias = torch.zeros((), dtype=torch.float32, device=tokens.device).masked_fill(future, -math.inf)
        return state.output(self._layers(state, x, n, step, None, buckets, bias))

    def compiled_step(self):
        """A new ``torch.compile``d :meth:`static_step` (:func:`compile_step`; one per search
        engine) as a function ``(state, tokens, step: int) -> logits``, labelled ``hrt.step``."""
        static = compile_step(self.static_step)

        @profiled("hrt.step")
        def step(state: DecoderState, tokens: Tensor, step: int) -> Tensor:
            return static(state, tokens, torch.tensor([step], device=tokens.device))

        return step

    @profiled("hrt.block")
    def block(self, state: DecoderState, tokens: Tensor, first: Tensor) -> Tensor:
        """Logits ``(N, W, V)`` after ``tokens`` ``(N, W)`` at positions ``first[n] + 0..W-1``
        (each row at its own positions): a causal pass whose keys/values (SSRU: cells) are
        written into the cache at those positions; each query sees the cache up to its own
        position (earlier blocks' final tokens and the block). Needs ``begin(zeroed=True)``."""
        n, w = tokens.shape
        device = tokens.device
        positions = first.unsqueeze(1) + torch.arange(w, device=device)  # (N, W)
        x = self._prologue(state.plan, tokens, None if state.positions is None else state.positions[positions])
        if self.recurrent:
            return state.output(self._layers(state, x, n, positions, None, None, None))
        keys = int(positions.max()) + 1
        future = torch.arange(keys, device=device).view(1, 1, 1, keys) > positions.view(n, 1, w, 1)
        bias = torch.zeros((), dtype=torch.float32, device=device).masked_fill(future, -math.inf)  # (N, 1, W, K)
        buckets = None
        if self.relative:
            buckets = state.buckets[positions][:, :, :keys].unsqueeze(1).expand(n, self.heads, w, keys)
        index = positions.view(n, 1, w, 1).expand(n, self.heads, w, self.head_dim)
        return state.output(self._layers(state, x, n, index, keys, buckets, bias))

    @profiled("hrt.non_causal")
    def non_causal(self, state, tokens: Tensor, positions: Tensor, queries: Optional[Tensor] = None) -> Tensor:
        """Decoder features ``(B, T, C)`` of one non-causal pass over ``tokens`` ``(B, T)`` at
        the original target ``positions`` (HRT's stage II and the drafts of ``hrt-spec``:
        ``model.decoder(tokens, positions=positions, causal=False, features_only=True)``
        without its modules' per-call cost). ``<pad>`` keys are masked. ``state``: an
        :class:`EncoderKV` with one row per row of ``tokens`` (or a state holding one).

        ``queries`` ``(Q,)``: the columns whose features are wanted (``(B, Q, C)`` then): the
        last layer computes its keys and values at every slot but everything else at these
        columns only (:func:`layer_forward`'s ``pick``); the same features as the whole pass
        at those columns."""
        if self.recurrent:
            raise ValueError("an SSRU decoder has no non-causal pass")
        encoder = state if isinstance(state, EncoderKV) else state.encoder
        decoder, plan = self.decoder, self.plan()
        n, t = tokens.shape
        embedded_positions = decoder.embed_target_positions(tokens, positions)
        x = plan.embed(tokens)
        x = self._prologue(plan, tokens, None if embedded_positions is None else embedded_positions.to(x), x)
        bias = padding_bias(tokens.eq(decoder.padding_idx), t, n, torch.float32, tokens.device)
        buckets = None
        if self.relative:
            buckets = relative_bucket(positions, positions, self.window).unsqueeze(1).expand(n, self.heads, t, t)
        cacheless = DecoderState(plan, encoder, None, None, None, None, None)
        return plan.features(self._layers(cacheless, x, n, None, None, buckets, bias, queries))

    # ------------------------------------------------------------- the one layer loop

    @staticmethod
    def _prologue(plan: "StepPlan", tokens: Tensor, positions: Optional[Tensor], x: Optional[Tensor] = None) -> Tensor:
        """Token embeddings (``x`` when already made) plus ``positions``' embeddings, then the
        embedding layer norm."""
        if x is None:
            x = plan.embed(tokens)
        if positions is not None:
            x = x + positions
        if plan.layernorm_embedding is not None:
            x = plan.layernorm_embedding(x)
        return x

    def _layers(
        self,
        state: DecoderState,
        x: Tensor,
        n: int,
        at,
        keys: Optional[int],
        buckets,
        bias,
        queries: Optional[Tensor] = None,
    ) -> Tensor:
        """The decoder layers over ``x`` ``(N, C)`` (one query per row) or ``(N, W, C)``; the
        queries' keys/values are written into ``state``'s caches ``at`` (see
        :meth:`_self_attention`); SSRU layers run :meth:`_recurrence` from ``at``.
        ``queries`` (no cache only): the last layer's output at these columns only."""
        if self.recurrent:

            def self_block(layer, i, h):
                return self._recurrence(layer, state.cells[i][:n], h, at)
        elif at is None:  # no cache: the queries are the keys

            def self_block(layer, i, h):
                return self._self_attention(layer, h, None, None, None, None, buckets, bias)
        else:

            def self_block(layer, i, h):
                return self._self_attention(layer, h, state.self_k[i][:n], state.self_v[i][:n], at, keys, buckets, bias)

        encoder_block = state.encoder.attention
        last = len(state.plan.layers) - 1
        for i, layer in enumerate(state.plan.layers):
            if i == last and queries is not None:

                def pick(y):
                    return y.index_select(1, queries)

                def last_block(layer, i, h):
                    return self._self_attention(layer, h, None, None, None, None, buckets, bias, pick)

                if buckets is not None:  # (N, H, T, T): the picked queries' rows
                    buckets = buckets.index_select(2, queries)
                x = layer_forward(layer, i, x, last_block, encoder_block, pick)
            else:
                x = layer_forward(layer, i, x, self_block, encoder_block)
        return x

    def _self_attention(
        self, layer: "LayerPlan", x: Tensor, cache_k, cache_v, at, keys: Optional[int], buckets, bias, pick=None
    ) -> Tensor:
        """Self-attention of the queries ``x`` ``(N, C)`` or ``(N, W, C)``. Their keys/values are
        written into ``cache_k``/``cache_v`` ``(N, H, T, d)`` at ``at`` -- an int (one
        position for every row; keys: the cache up to it), a ``(1,)`` tensor (the same; keys:
        the whole cache) or an ``(N, H, W, d)`` index (each row's positions; keys: the first
        ``keys`` of the cache) -- or, ``at`` ``None``, are the keys themselves. ``pick``
        (``at`` ``None``): the queries are ``pick(x)``'s slots only."""
        n, one_query = x.size(0), x.dim() == 2
        q, k, v = layer.qkv(x)
        if pick is not None:
            q = pick(q)
        q = q * layer.scaling
        if one_query:  # (N, C) -> (N, H, 1, d): a view; keys/values (N, H, d)
            q = q.view(n, self.heads, 1, self.head_dim)
            k, v = k.view(n, self.heads, self.head_dim), v.view(n, self.heads, self.head_dim)
        else:  # (N, W, C) -> (N, H, W, d)
            shape = (n, -1, self.heads, self.head_dim)
            q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        if at is None:
            key_rows, value_rows = k, v
        elif type(at) is int:
            cache_k[:, :, at] = k
            cache_v[:, :, at] = v
            key_rows, value_rows = cache_k[:, :, : at + 1], cache_v[:, :, : at + 1]
        elif at.dim() == 1:
            cache_k.index_copy_(2, at, k.unsqueeze(2))
            cache_v.index_copy_(2, at, v.unsqueeze(2))
            key_rows, value_rows = cache_k, cache_v
        else:
            cache_k.scatter_(2, at, k)
            cache_v.scatter_(2, at, v)
            key_rows, value_rows = cache_k[:, :, :keys], cache_v[:, :, :keys]
        out = attention(q, key_rows, value_rows, layer.relative_keys, buckets, bias)  # (N, H, W, d)
        return layer.self_out(out.reshape(n, -1) if one_query else out.transpose(1, 2).reshape(n, q.size(2), -1))

    @staticmethod
    def _recurrence(layer: "LayerPlan", cells: Tensor, x: Tensor, at) -> Tensor:
        """The SSRU of queries ``x`` with its cells ``(N, T + 1, C)`` (:class:`DecoderState`):
        ``at`` an int or a ``(1,)`` tensor, one step for every row from the cell at ``at``
        (``c = f * c + (1 - f) * W x``, :func:`ssru_step_`); ``(N, W)`` positions, each
        row's block from the cell before its first position by a parallel scan
        (:func:`~fairseq_hrt.modules.ssru.linear_recurrence`). The new cells are cached;
        output ``ReLU(c)``."""
        projections = layer.ssru_projections(x)
        if type(at) is int:
            cell = cells[:, at + 1]
            ssru_step_(projections, cell.copy_(cells[:, at]))
            return torch.relu(cell)
        if at.dim() == 1:
            cell = ssru_step_(projections, cells.index_select(1, at).squeeze(1))
            cells.index_copy_(1, at + 1, cell.unsqueeze(1))
            return torch.relu(cell)
        n, w, c = x.shape
        negated_gate, projected = projections
        forget = torch.sigmoid(-negated_gate)
        initial = cells.gather(1, at[:, :1].unsqueeze(-1).expand(n, 1, c)).squeeze(1)
        block = linear_recurrence(
            forget.transpose(0, 1), ((1.0 - forget) * projected).transpose(0, 1), initial
        ).transpose(0, 1)
        cells.scatter_(1, (at + 1).unsqueeze(-1).expand(n, w, c), block)
        return torch.relu(block)


_PASSES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_pass(decoder) -> DecoderPass:
    """The one :class:`DecoderPass` of ``decoder`` (made on first use, kept while the decoder
    lives): every engine decoding the decoder shares it, and its plan."""
    found = _PASSES.get(decoder)
    if found is None:
        found = _PASSES[decoder] = DecoderPass(decoder)
    return found
