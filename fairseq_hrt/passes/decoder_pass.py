"""The planned decoder pass of the lean engines: one decoder layer loop over a fairseq
``TransformerDecoderBase``, an ``HRTDecoder`` or an SSRU decoder, read from the decoder's
own modules (so ``--quantize int8`` and ``model.half()`` apply), in four modes:

* :meth:`DecoderPass.step` -- one left-to-right step (a pass of width 1 over the cache) of the
  lean search (:mod:`fairseq_hrt.generation.lean`); :meth:`DecoderPass.static_step` is the
  same step on shapes that do not change from step to step (the whole cache, the future
  masked), what ``--compile`` compiles and the CUDA-graph engine captures;
* :meth:`DecoderPass.block` -- a causal pass over a block of ``W`` tokens per row, written
  into the cache at each row's own positions (Jacobi decoding and ``hrt-spec``'s verifying
  passes, :mod:`fairseq_hrt.generation.jacobi`);
* :meth:`DecoderPass.non_causal` -- a non-causal pass without cache over tokens at given
  positions (HRT's stage II, ``hrt-spec``'s drafts).

Every mode runs the one decoder layer of :mod:`fairseq_hrt.passes.layers` (its
self-attention, SSRU recurrence, encoder attention and embedding prologue), as the exported
graphs (:mod:`fairseq_hrt.export.graphs`) and the CUDA-graph engine do; the encoder's pass
is :mod:`fairseq_hrt.passes.encoder_pass`, the token choice :mod:`fairseq_hrt.passes.token_choice`.

A decoder has one pass (:func:`decoder_pass`), planned once per version of its weights
(:class:`~fairseq_hrt.passes.plan.StepPlan`: the modules as plain functions, with fused q/k/v
weights, made again when :func:`weights_version` changes) and shared by every engine that
decodes it. The encoder-side keys/values of a batch are projected once
(:meth:`DecoderPass.encoder`, :class:`~fairseq_hrt.passes.state.EncoderKV`) and held by the
batch's :class:`~fairseq_hrt.passes.state.DecoderState`.

The modes are labelled for ``torch.profiler`` (``hrt.step``, ``hrt.block``,
``hrt.non_causal``) while a profiler runs (:func:`profiled`; a label costs time in a
batch-1 step, so none is made otherwise).
"""

import functools
import math
import weakref
from typing import Optional

import torch
import torch.autograd.profiler as autograd_profiler
from torch import Tensor

from fairseq_hrt.modules.relative_attention import RelativeSelfAttention
from fairseq_hrt.passes.attention import (
    attention,
    encoder_padding_bias,
    padding_bias,
    pair_buckets,
    relative_buckets,
)
from fairseq_hrt.passes.layers import (
    layer_forward,
    non_causal_layers,
    prologue,
    recurrence,
    self_attention,
    ssru_step,
    ssru_step_,
)
from fairseq_hrt.passes.plan import LayerPlan, StepPlan, is_recurrent
from fairseq_hrt.passes.projections import as_function, fused_projections, ssru_projections
from fairseq_hrt.passes.state import DecoderState, EncoderKV
from fairseq_hrt.passes.support import refuse_unplanned, unplanned_modules, unsupported_features
from fairseq_hrt.passes.weights import weights_version

# what the engines, the exporter and the tests import from here (the pass's own modules)
__all__ = [
    "DecoderPass",
    "DecoderState",
    "EncoderKV",
    "LayerPlan",
    "StepPlan",
    "as_function",
    "attention",
    "compile_step",
    "decoder_pass",
    "encoder_padding_bias",
    "fused_projections",
    "is_recurrent",
    "layer_forward",
    "padding_bias",
    "profiled",
    "relative_buckets",
    "ssru_projections",
    "ssru_step",
    "ssru_step_",
    "unplanned_modules",
    "weights_version",
]

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


# ---------------------------------------------------------------------------- the pass


def cached(cache_k: Tensor, cache_v: Tensor, at, keys: Optional[int]):
    """:func:`~fairseq_hrt.passes.layers.self_attention`'s ``keys_of`` over a cache ``(N, H, T,
    d)``: the queries' keys/values are written at ``at`` -- an int (one position for every
    row; keys: the cache up to it), a ``(1,)`` tensor (the same; keys: the whole cache) or an
    ``(N, H, W, d)`` index (each row's positions; keys: the first ``keys`` of the cache)."""

    def keys_of(k: Tensor, v: Tensor):
        if type(at) is int:
            cache_k[:, :, at : at + 1] = k
            cache_v[:, :, at : at + 1] = v
            return cache_k[:, :, : at + 1], cache_v[:, :, : at + 1]
        if at.dim() == 1:
            cache_k.index_copy_(2, at, k)
            cache_v.index_copy_(2, at, v)
            return cache_k, cache_v
        cache_k.scatter_(2, at, k)
        cache_v.scatter_(2, at, v)
        return cache_k[:, :, :keys], cache_v[:, :, :keys]

    return keys_of


class DecoderPass:
    """The planned passes of one decoder (see the module's docstring). Get it with
    :func:`decoder_pass`: one per decoder, shared by the engines that decode it."""

    _unsupported = staticmethod(unsupported_features)  # what the exporter refuses too

    def __init__(self, decoder):
        refuse_unplanned(decoder)
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
        x = prologue(state.plan, tokens, None if state.positions is None else state.positions[step])
        buckets = None if state.buckets is None else state.buckets[step, : step + 1]
        return state.output(cached_layers(state, x, n, step, step + 1, buckets, None))

    def static_step(self, state: DecoderState, tokens: Tensor, step: Tensor) -> Tensor:
        """:meth:`step` with ``step`` a ``(1,)`` tensor and self-attention over the whole
        cache, future positions masked: no shape depends on the step (``--compile``)."""
        n = tokens.size(0)
        x = prologue(state.plan, tokens, None if state.positions is None else state.positions.index_select(0, step))
        buckets = None if state.buckets is None else state.buckets.index_select(0, step).view(-1)
        bias = None
        if not self.recurrent:
            future = torch.arange(state.self_k[0].size(2), device=tokens.device) > step
            bias = torch.zeros((), dtype=torch.float32, device=tokens.device).masked_fill(future, -math.inf)
        return state.output(cached_layers(state, x, n, step, None, buckets, bias))

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
        x = prologue(state.plan, tokens, None if state.positions is None else state.positions[positions])
        if self.recurrent:
            return state.output(cached_layers(state, x, n, positions, None, None, None))
        keys = int(positions.max()) + 1
        future = torch.arange(keys, device=device).view(1, 1, 1, keys) > positions.view(n, 1, w, 1)
        bias = torch.zeros((), dtype=torch.float32, device=device).masked_fill(future, -math.inf)  # (N, 1, W, K)
        buckets = None
        if self.relative:
            buckets = state.buckets[positions][:, :, :keys].unsqueeze(1).expand(n, self.heads, w, keys)
        index = positions.view(n, 1, w, 1).expand(n, self.heads, w, self.head_dim)
        return state.output(cached_layers(state, x, n, index, keys, buckets, bias))

    @profiled("hrt.non_causal")
    def non_causal(self, state, tokens: Tensor, positions: Tensor, queries: Optional[Tensor] = None) -> Tensor:
        """Decoder features ``(B, T, C)`` of one non-causal pass over ``tokens`` ``(B, T)`` at
        the original target ``positions`` (HRT's stage II and the drafts of ``hrt-spec``:
        ``model.decoder(tokens, positions=positions, causal=False, features_only=True)``
        without its modules' per-call cost). ``<pad>`` keys are masked. ``state``: an
        :class:`EncoderKV` with one row per row of ``tokens`` (or a state holding one).
        ``queries`` ``(Q,)``: the columns whose features are wanted (``(B, Q, C)`` then),
        :func:`~fairseq_hrt.passes.layers.non_causal_layers`."""
        if self.recurrent:
            raise ValueError("an SSRU decoder has no non-causal pass")
        encoder = state if isinstance(state, EncoderKV) else state.encoder
        decoder, plan = self.decoder, self.plan()
        n, t = tokens.shape
        embedded_positions = decoder.embed_target_positions(tokens, positions)
        x = plan.embed(tokens)
        x = prologue(plan, tokens, None if embedded_positions is None else embedded_positions.to(x), x)
        bias = padding_bias(tokens.eq(decoder.padding_idx), t, n, torch.float32, tokens.device)
        buckets = pair_buckets(positions, self.window, self.heads) if self.relative else None
        x = plan.features(non_causal_layers(plan, encoder, x.reshape(n * t, -1), n, buckets, bias, queries))
        return x.view(n, -1, x.size(-1))


def cached_layers(state: DecoderState, x: Tensor, n: int, at, keys: Optional[int], buckets, bias) -> Tensor:
    """The decoder layers over ``x`` ``(N, C)`` (one query per row) or ``(N, W, C)``; the
    queries' keys/values are written into ``state``'s caches ``at`` (:func:`cached`); SSRU
    layers (``state.cells``) run :func:`~fairseq_hrt.passes.layers.recurrence` from ``at``."""
    if state.cells:

        def self_block(layer, i, h):
            return recurrence(layer, state.cells[i][:n], h, at)
    else:
        rows = None if x.dim() == 2 else n

        def self_block(layer, i, h):
            keys_of = cached(state.self_k[i][:n], state.self_v[i][:n], at, keys)
            return self_attention(layer, h, rows, keys_of, buckets, bias)

    for i, layer in enumerate(state.plan.layers):
        x = layer_forward(layer, i, x, self_block, state.encoder.attention)
    return x


_PASSES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_pass(decoder) -> DecoderPass:
    """The one :class:`DecoderPass` of ``decoder`` (made on first use, kept while the decoder
    lives): every engine decoding the decoder shares it, and its plan."""
    found = _PASSES.get(decoder)
    if found is None:
        found = _PASSES[decoder] = DecoderPass(decoder)
    return found
