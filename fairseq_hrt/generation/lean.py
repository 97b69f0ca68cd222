"""The lean left-to-right engine (``--decoder-engine lean``): greedy and beam search over a
Transformer decoder with fairseq's hypotheses at a fraction of fairseq's Python cost.

fairseq's ``SequenceGenerator`` pays, at every step, for the generality of its incremental
state (dictionaries of cached tensors grown with ``torch.cat``, reordered by name), a full
log-softmax over the vocabulary and the bookkeeping of every search strategy. After Amun
(Junczys-Dowmunt et al. 2016), this engine instead:

* runs its own step function over the decoder's modules (the very modules, so
  ``--quantize int8`` and ``model.half()`` apply): self-attention keys/values live in
  buffers preallocated for the maximum length and written in place; the encoder-side
  keys/values are projected once per sentence and shared by its beam;
* drops finished sentences from the active batch and compacts the rest in place;
* never normalises the whole vocabulary: greedy takes the argmax of the logits, beam search
  the k best logits per row, and only those are turned into log-probabilities (with one
  log-sum-exp per row); banned symbols are masked on the logits;
* with a lexical shortlist (``--shortlist``, :mod:`fairseq_hrt.shortlist`) computes the
  output layer only for the batch's candidate tokens (the weight rows are sliced once per
  batch); scores are then log-probabilities over those candidates.

It reproduces ``SequenceGenerator`` (tokens; scores to float rounding): the maximum length
``min(max_len_a * src_len + max_len_b, max positions - 1)`` with ``src_len`` the padded
source width, ``</s>`` forced at the maximum length and banned before ``--min-len``, the
candidate/EOS rules of fairseq's ``BeamSearch`` (2 x beam candidates, EOS only among the
first beam), cumulative scores normalised by ``len ** lenpen``. It supports fairseq's
``transformer`` decoder, the HRT decoder (relative self-attention, positions
``0, k, 2k, ..`` from ``<s_k>``) and the SSRU decoder (``*_ssru``: the recurrence's state is
one ``(rows, C)`` cell per layer, updated in place); with ``--decoder-tie-layers`` the tied
layers share one set of fused weights.
"""
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_hrt.generation.options import SearchOptions
from fairseq_hrt.generation.search_rules import SearchRules, greedy_choice  # noqa: F401  (greedy_choice: re-exported)
from fairseq_hrt.generation.strategies import hypothesis, reject_unsupported_inputs
from fairseq_hrt.modules.relative_attention import RelativeSelfAttention, relative_bucket
from fairseq_hrt.generation.output_vocab import OutputVocabulary, restricted_output_layer

# ------------------------------------------------------------------------- pure functions


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``(N, C)`` -> ``(N, H, d)``."""
    return x.view(x.size(0), heads, -1)


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


def positional_scores(cumulative: Tensor) -> Tensor:
    """Cumulative scores ``(R, T)`` -> per-token scores, as fairseq's ``finalize_hypos``."""
    scores = cumulative.clone()
    scores[:, 1:] = cumulative[:, 1:] - cumulative[:, :-1]
    return scores


def candidates_per_sentence(row_scores: Tensor, row_tokens: Tensor, rows_per_sentence: int, k: int):
    """The ``k`` best of each sentence's ``rows_per_sentence`` rows of candidates.

    ``row_scores`` / ``row_tokens``: ``(N, c)`` best candidates of every row (``N`` rows,
    sentence-major). Returns ``(scores, tokens, beams)``, each ``(N / rows_per_sentence, k)``,
    ``beams`` the row of the candidate within its sentence -- fairseq's ``BeamSearch.step``
    over the whole vocabulary gives the same, as no row can hold more than ``k`` of them.
    """
    c = row_scores.size(1)
    flat_scores = row_scores.view(-1, rows_per_sentence * c)
    scores, index = flat_scores.topk(k, dim=1)
    tokens = row_tokens.view(-1, rows_per_sentence * c).gather(1, index)
    return scores, tokens, torch.div(index, c, rounding_mode="floor")


# ------------------------------------------------------------------------ step function


class DecoderStep:
    """One decoding step of a fairseq ``TransformerDecoderBase`` or an ``HRTDecoder``, with
    caches preallocated for a batch (see :meth:`begin`). Reads the decoder's own modules.

    ``compile=True`` (``--compile``) runs every step as one ``torch.compile``d function of
    shapes that do not change from step to step: self-attention reads the whole preallocated
    cache with the future masked (instead of the first ``t + 1`` keys), and the step index is
    a tensor, so one compiled graph serves every step (rows, source and cache lengths are
    dynamic dimensions: batches of other shapes reuse it too)."""

    def __init__(self, decoder, compile: bool = False):
        self.decoder = decoder
        self.compile = compile
        self._compiled = None
        for reason, bad in self._unsupported(decoder).items():
            if bad:
                raise ValueError(f"--decoder-engine lean does not support {reason}; use --decoder-engine fairseq")
        first = decoder.layers[0]
        self.recurrent = is_recurrent(first)
        self_attn = getattr(first, "self_attn", None)
        self.heads = first.encoder_attn.num_heads
        self.head_dim = first.encoder_attn.head_dim
        self.relative = isinstance(self_attn, RelativeSelfAttention) and self_attn.relative_keys is not None
        self.window = self_attn.window if self.relative else 0
        self.start_stride = getattr(decoder, "start_stride", None)
        self._plan, self._plan_key = None, None

    @staticmethod
    def _unsupported(decoder) -> Dict[str, bool]:
        layers = list(decoder.layers)
        return {
            "an adaptive softmax": getattr(decoder, "adaptive_softmax", None) is not None,
            "--cross-self-attention": getattr(decoder, "cross_self_attention", False),
            "quantization noise": getattr(decoder, "quant_noise", None) is not None,
            "a decoder without encoder attention": any(layer.encoder_attn is None for layer in layers),
            "NormFormer layers (--scale-attn/--scale-heads/--scale-fc/--scale-resids)": any(
                getattr(layer, name, None) is not None for layer in layers for name in ("attn_ln", "c_attn", "ffn_layernorm", "w_resid")
            ),
            "attention with bias_kv / zero_attn": any(
                attn.bias_k is not None or attn.add_zero_attn
                for layer in layers for attn in (getattr(layer, "self_attn", None), layer.encoder_attn) if attn is not None
            ),
            "decoder layers of different shapes": len({layer.encoder_attn.num_heads for layer in layers if layer.encoder_attn is not None}) > 1
            or len({is_recurrent(layer) for layer in layers}) > 1,
        }

    def stride_of(self, start_token: int) -> int:
        """Distance of consecutive target positions for a start symbol (``<s_k>``: k)."""
        return int(self.start_stride[start_token]) if self.start_stride is not None else 1

    def position_table(self, steps: int, stride: int, start_token: int, device) -> Optional[Tensor]:
        """``(steps, C)`` position embeddings of steps ``0..steps-1``, by the decoder's own code."""
        decoder = self.decoder
        if decoder.embed_positions is None:
            return None
        tokens = torch.full((1, steps), start_token, dtype=torch.long, device=device)
        if hasattr(decoder, "embed_target_positions"):
            positions = (torch.arange(steps, device=device) * stride).unsqueeze(0)
            table = decoder.embed_target_positions(tokens, positions)
        else:
            table = decoder.embed_positions(tokens)
        return table[0].to(decoder.embed_tokens.weight.dtype)

    def begin(self, encoder_out, rows: int, steps: int, start_token: int, vocab: Optional[Tensor] = None) -> "StepState":
        """Caches for ``rows`` hypotheses (sentence-major) of the encoder output's sentences and
        at most ``steps`` steps; encoder-side keys/values are projected here, once. ``vocab``:
        the output-layer rows (sorted ids) the steps compute logits for (default: all)."""
        enc = encoder_out["encoder_out"][0]  # (S, B, C)
        dtype, device = enc.dtype, enc.device
        # the compiled step reads the whole cache (future masked): it must hold no NaN/inf
        new_cache = torch.zeros if self.compile else torch.empty
        enc_k, enc_v = self.encoder_keys_values(enc)
        self_k, self_v, cells = [], [], []
        for _ in self.decoder.layers:
            if self.recurrent:  # the SSRU's state: the last cell, c_{-1} = 0
                cells.append(torch.zeros(rows, enc.size(-1), dtype=dtype, device=device))
            else:
                self_k.append(new_cache(rows, self.heads, steps, self.head_dim, dtype=dtype, device=device))
                self_v.append(new_cache(rows, self.heads, steps, self.head_dim, dtype=dtype, device=device))
        stride = self.stride_of(start_token)
        plan = self.plan()
        return StepState(
            plan=plan,
            output=plan.output if vocab is None else plan.restricted_output(vocab),
            self_k=self_k,
            self_v=self_v,
            cells=cells,
            enc_k=enc_k,
            enc_v=enc_v,
            enc_bias=encoder_padding_bias(encoder_out),
            positions=self.position_table(steps, stride, start_token, device),
            buckets=relative_buckets(steps, stride, self.window).to(device) if self.relative else None,
        )

    def encoder_keys_values(self, enc: Tensor):
        """Every layer's encoder-attention keys and values ``(B, H, S, d)`` of ``enc`` ``(S, B, C)``."""
        src_len, bsz, _ = enc.shape
        keys, values = [], []
        for layer in self.decoder.layers:
            attn = layer.encoder_attn
            keys.append(attn.k_proj(enc).view(src_len, bsz, self.heads, self.head_dim).permute(1, 2, 0, 3).contiguous())
            values.append(attn.v_proj(enc).view(src_len, bsz, self.heads, self.head_dim).permute(1, 2, 0, 3).contiguous())
        return keys, values

    def bidirectional(self, tokens: Tensor, positions: Tensor, encoder_out) -> Tensor:
        """Decoder features ``(B, T, C)`` of one non-causal pass over ``tokens`` ``(B, T)`` at
        the original target ``positions`` (HRT's stage II and the drafts of ``hrt-spec``:
        ``model.decoder(tokens, positions=positions, causal=False, features_only=True)``
        without its modules' per-call cost). ``<pad>`` keys are masked."""
        decoder, plan = self.decoder, self.plan()
        enc_k, enc_v = self.encoder_keys_values(encoder_out["encoder_out"][0])
        enc_bias = encoder_padding_bias(encoder_out)
        n, t = tokens.shape
        x = plan.embed(tokens)
        embedded_positions = decoder.embed_target_positions(tokens, positions)
        if embedded_positions is not None:
            x = x + embedded_positions.to(x)
        if plan.layernorm_embedding is not None:
            x = plan.layernorm_embedding(x)
        self_bias = padding_bias(tokens.eq(decoder.padding_idx), t, n, torch.float32, tokens.device)
        buckets = None
        if self.relative:
            buckets = relative_bucket(positions, positions, self.window).unsqueeze(1).expand(n, self.heads, t, t)

        def self_attention(layer, h):
            q, k, v = layer.qkv(h)
            q = self.heads_of(q * layer.scaling)
            scores = torch.matmul(q, self.heads_of(k).transpose(2, 3))  # (B, H, T, T)
            if layer.relative_keys is not None:
                scores = scores + torch.matmul(q, layer.relative_keys).gather(3, buckets)
            probs = torch.softmax(scores.float() + self_bias, dim=-1).type_as(scores)
            return layer.self_out(torch.matmul(probs, self.heads_of(v)).transpose(1, 2).reshape(n, t, -1))

        for i, layer in enumerate(plan.layers):
            x = layer_forward(layer, x, lambda h, layer=layer: self_attention(layer, h),
                              lambda h, layer=layer, i=i: self.encoder_attention_block(layer, h, enc_k[i], enc_v[i], enc_bias))
        return plan.features(x)

    def heads_of(self, x: Tensor) -> Tensor:
        """``(N, W, C)`` -> ``(N, H, W, d)``."""
        n, w, _ = x.shape
        return x.view(n, w, self.heads, self.head_dim).transpose(1, 2)

    def encoder_attention_block(self, layer: "LayerPlan", x: Tensor, enc_k: Tensor, enc_v: Tensor, enc_bias: Tensor) -> Tensor:
        """Encoder attention of ``W`` queries per row ``(N, W, C)``, one sentence per row."""
        n, w, _ = x.shape
        q = self.heads_of(layer.encoder_q(x) * layer.scaling)
        scores = torch.matmul(q, enc_k.transpose(2, 3))  # (N, H, W, S)
        probs = torch.softmax(scores.float() + enc_bias, dim=-1).type_as(scores)
        out = torch.matmul(probs, enc_v)
        return layer.encoder_out(out.transpose(1, 2).reshape(n, w, -1))

    def plan(self) -> "StepPlan":
        """The decoder's modules as plain functions; rebuilt only when a parameter changed
        (moved, cast, updated in place)."""
        # the fused q/k/v weights are copies: a parameter moved, cast or overwritten in place
        # (load_state_dict copies into the same storage, which only the version counter shows)
        # must rebuild them
        key = tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in self.decoder.parameters())
        if self._plan is None or self._plan_key != key:
            self._plan, self._plan_key = StepPlan(self.decoder), key
        return self._plan

    def __call__(self, state: "StepState", tokens: Tensor, step: int) -> Tensor:
        """Logits ``(N, V)`` of the next token after ``tokens`` ``(N,)`` at ``step`` (``V``: the
        rows of ``begin``'s ``vocab``)."""
        with torch.profiler.record_function("hrt.step"):
            if self.compile:
                return self.compiled_step()(state, tokens, torch.tensor([step], device=tokens.device))
            plan = state.plan
            x = plan.embed(tokens)
            if state.positions is not None:
                x = x + state.positions[step]
            if plan.layernorm_embedding is not None:
                x = plan.layernorm_embedding(x)
            for i, layer in enumerate(plan.layers):
                x = self._layer(layer, i, state, x, step)
            return state.output(x)

    def compiled_step(self):
        """:meth:`static_step` compiled (:func:`compile_step`), once per engine."""
        if self._compiled is None:
            self._compiled = compile_step(self.static_step)
        return self._compiled

    def static_step(self, state: "StepState", tokens: Tensor, step: Tensor) -> Tensor:
        """:meth:`__call__` with ``step`` a ``(1,)`` tensor and self-attention over the whole
        cache, future positions masked: no shape depends on the step."""
        plan = state.plan
        x = plan.embed(tokens)
        if state.positions is not None:
            x = x + state.positions.index_select(0, step)
        if plan.layernorm_embedding is not None:
            x = plan.layernorm_embedding(x)
        for i, layer in enumerate(plan.layers):
            if layer.recurrent:
                self_block = lambda h, layer=layer, i=i: self._recurrence(layer, i, state, h)  # noqa: E731
            else:
                self_block = lambda h, layer=layer, i=i: self._static_self_attention(layer, i, state, h, step)  # noqa: E731
            x = layer_forward(layer, x, self_block, lambda h, layer=layer, i=i: self._encoder_attention(layer, i, state, h))
        return state.output(x)

    def _static_self_attention(self, layer: "LayerPlan", i: int, state: "StepState", x: Tensor, step: Tensor) -> Tensor:
        n = x.size(0)
        q, k, v = layer.qkv(x)
        q = split_heads(q * layer.scaling, self.heads).unsqueeze(2)  # (N, H, 1, d)
        keys, values = state.self_k[i][:n], state.self_v[i][:n]  # (N, H, T, d), T: preallocated
        keys.index_copy_(2, step, split_heads(k, self.heads).unsqueeze(2))
        values.index_copy_(2, step, split_heads(v, self.heads).unsqueeze(2))
        scores = torch.matmul(q, keys.transpose(2, 3))  # (N, H, 1, T)
        if layer.relative_keys is not None:
            q_rel = torch.matmul(q, layer.relative_keys)  # (N, H, 1, 2w+1)
            scores = scores + q_rel.index_select(3, state.buckets.index_select(0, step).view(-1))
        future = torch.arange(keys.size(2), device=x.device) > step
        scores = scores.masked_fill(future, -math.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        out = torch.matmul(probs, values)  # (N, H, 1, d)
        return layer.self_out(out.reshape(n, -1))

    def _layer(self, layer: "LayerPlan", i: int, state: "StepState", x: Tensor, step: int) -> Tensor:
        if layer.recurrent:
            self_block = lambda h: self._recurrence(layer, i, state, h)  # noqa: E731
        else:
            self_block = lambda h: self._self_attention(layer, i, state, h, step)  # noqa: E731
        return layer_forward(layer, x, self_block, lambda h: self._encoder_attention(layer, i, state, h))

    def _recurrence(self, layer: "LayerPlan", i: int, state: "StepState", x: Tensor) -> Tensor:
        """One SSRU step: ``c = f * c + (1 - f) * W x`` in place, output ``ReLU(c)``."""
        cell = state.cells[i][: x.size(0)]
        ssru_step_(layer.ssru_projections(x), cell)
        return torch.relu(cell)

    def _self_attention(self, layer: "LayerPlan", i: int, state: "StepState", x: Tensor, step: int) -> Tensor:
        n = x.size(0)
        q, k, v = layer.qkv(x)
        q = split_heads(q * layer.scaling, self.heads).unsqueeze(2)  # (N, H, 1, d)
        keys, values = state.self_k[i][:n], state.self_v[i][:n]
        keys[:, :, step] = split_heads(k, self.heads)
        values[:, :, step] = split_heads(v, self.heads)
        keys, values = keys[:, :, : step + 1], values[:, :, : step + 1]
        scores = torch.matmul(q, keys.transpose(2, 3))  # (N, H, 1, t+1)
        if layer.relative_keys is not None:
            q_rel = torch.matmul(q, layer.relative_keys)  # (N, H, 1, 2w+1)
            scores = scores + q_rel.index_select(3, state.buckets[step, : step + 1])
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)
        out = torch.matmul(probs, values)  # (N, H, 1, d)
        return layer.self_out(out.reshape(n, -1))

    def _encoder_attention(self, layer: "LayerPlan", i: int, state: "StepState", x: Tensor) -> Tensor:
        n = x.size(0)
        sentences = state.enc_k[i].size(0)
        # the rows of a sentence (its beam) are queries of one attention over its source
        q = (layer.encoder_q(x) * layer.scaling).view(sentences, n // sentences, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, state.enc_k[i].transpose(2, 3))  # (B, H, beam, S)
        probs = torch.softmax(scores.float() + state.enc_bias, dim=-1).type_as(scores)
        out = torch.matmul(probs, state.enc_v[i]).transpose(1, 2)  # (B, beam, H, d)
        return layer.encoder_out(out.reshape(n, -1))


# graphs of one compiled step: a model has one per kind of batch (1 row, 1 row per sentence,
# a beam of rows per sentence: torch.compile specialises sizes 1 and the rows-per-sentence
# relation), and a process may decode several models (the benchmark) -- more than
# torch._dynamo's default of 8, after which it would silently fall back to eager steps
COMPILED_GRAPHS_LIMIT = 64


def compile_step(step_function):
    """``torch.compile`` of a step function of static shapes (dynamic dimensions, so batches
    of other sizes reuse the graph). The default mode on every device: CUDA-graph capture
    (``reduce-overhead``) would also need the caches at static addresses and the logits read
    before the next replay, which no GPU has verified here yet."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.7
    setattr(config, name, max(getattr(config, name), COMPILED_GRAPHS_LIMIT))
    return torch.compile(step_function, dynamic=True)


def search_max_len(options: SearchOptions, src_tokens: Tensor, cap: int) -> int:
    """fairseq's maximum output length: ``max_len_a x`` the padded source width ``+ max_len_b``,
    at most ``cap`` (the decoder's positions), with fairseq's check of ``min_len``."""
    max_len = min(int(options.max_len_a * src_tokens.size(1) + options.max_len_b), cap)
    if options.min_len > max_len:
        raise ValueError("min_len cannot be larger than max_len, please adjust these!")
    return max_len


def is_recurrent(layer) -> bool:
    """Whether a decoder layer is an SSRU layer (no self-attention)."""
    return hasattr(layer, "ssru")


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


def layer_forward(layer: "LayerPlan", x: Tensor, self_attention, encoder_attention) -> Tensor:
    """One decoder layer (pre- or post-norm residual blocks) around the given self- and
    encoder-attention functions: the step of this engine and the block pass of Jacobi
    decoding differ only in those."""
    pre_norm = layer.pre_norm
    residual = x
    h = layer.self_attn_norm(x) if pre_norm else x
    x = residual + self_attention(h)
    if not pre_norm:
        x = layer.self_attn_norm(x)
    residual = x
    h = layer.encoder_attn_norm(x) if pre_norm else x
    x = residual + encoder_attention(h)
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


class StepState:
    """Caches of one batch: self-attention keys/values ``(rows, H, steps, d)`` per layer,
    written in place (SSRU layers: ``cells``, the last cell ``(rows, C)`` or, for block
    passes, every step's ``(rows, steps, C)``); encoder keys/values and padding bias per
    sentence."""

    def __init__(self, plan, self_k, self_v, enc_k, enc_v, enc_bias, positions, buckets, cells=(), output=None):
        self.plan = plan
        self.output = output if output is not None else plan.output
        self.self_k, self.self_v = self_k, self_v
        self.cells = list(cells)
        self.enc_k, self.enc_v, self.enc_bias = enc_k, enc_v, enc_bias
        self.positions, self.buckets = positions, buckets

    def reorder_rows(self, index: Tensor, step: int):
        """Row ``r`` of the caches becomes old row ``index[r]`` (steps ``0..step``), in place."""
        n = index.numel()
        for cache in self.self_k + self.self_v:
            cache[:n, :, : step + 1] = cache[:, :, : step + 1].index_select(0, index)
        for cell in self.cells:
            if cell.dim() == 2:
                cell[:n] = cell.index_select(0, index)
            else:
                cell[:n, : step + 1] = cell[:, : step + 1].index_select(0, index)

    def select_sentences(self, index: Tensor):
        """Keep only the given sentences' encoder keys/values (finished ones leave)."""
        self.enc_k = [k.index_select(0, index) for k in self.enc_k]
        self.enc_v = [v.index_select(0, index) for v in self.enc_v]
        self.enc_bias = self.enc_bias.index_select(0, index)


# ----------------------------------------------------------------------------- generator


class LeanSequenceGenerator:
    """fairseq's ``SequenceGenerator`` interface (``generate(models, sample, bos_token=...)``)
    over :class:`DecoderStep`, for one model. ``banned``: symbols never generated (``<pad>``
    always). ``shortlist``: each batch decodes over the candidates of its source tokens only
    (:meth:`Shortlist.candidates`, kept as ``last_vocab``)."""

    def __init__(self, model, tgt_dict, options: SearchOptions, banned: Sequence[int] = (),
                 shortlist=None, compile: bool = False):
        if options.beam < 1:
            raise ValueError("--beam must be >= 1")
        self.model = model
        self.rules = SearchRules(options, tgt_dict, banned)
        self.step = DecoderStep(model.decoder, compile=compile)
        self.options = options
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.vocab_size = len(tgt_dict)
        self.max_len_cap = model.max_decoder_positions() - 1
        self.last_encoder_out = None
        self.shortlist = shortlist
        self.last_vocab: Optional[Tensor] = None

    def max_len(self, src_tokens: Tensor) -> int:
        return search_max_len(self.options, src_tokens, self.max_len_cap)

    @torch.no_grad()
    def generate(self, models, sample, bos_token: Optional[int] = None, **kwargs) -> List[List[Dict[str, Tensor]]]:
        reject_unsupported_inputs("--decoder-engine lean", **kwargs)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        with torch.profiler.record_function("hrt.encoder"):
            encoder_out = self.model.encoder.forward_torchscript(net_input)
        self.last_encoder_out = encoder_out
        start = self.eos if bos_token is None else bos_token
        max_len = self.max_len(src_tokens)
        out = self.rules.full_vocab
        if self.shortlist is not None:
            out = OutputVocabulary(self.shortlist.candidates(src_tokens, self.pad), self.vocab_size, self.eos, self.unk)
        self.last_vocab = out.ids
        if self.options.beam == 1:
            return self._greedy(encoder_out, src_tokens.size(0), max_len, start, out)
        return self._beam(encoder_out, src_tokens.size(0), max_len, start, out)

    def _logits(self, state, tokens: Tensor, step: int) -> Tensor:
        return self.rules.logits(self.step(state, tokens, step))

    def _normalised(self, cumulative: Tensor, length: int) -> Tensor:
        if self.options.normalize_scores:
            return cumulative / length**self.options.len_penalty
        return cumulative

    def _greedy(self, encoder_out, bsz: int, max_len: int, start: int, out: OutputVocabulary):
        device = encoder_out["encoder_out"][0].device
        state = self.step.begin(encoder_out, bsz, max_len + 1, start, vocab=out.ids)
        tokens = torch.empty(bsz, max_len + 1, dtype=torch.long, device=device)
        cumulative = torch.empty(bsz, max_len + 1, dtype=torch.float32, device=device)
        sentence = torch.arange(bsz, device=device)  # original sentence of each active row
        prev = torch.full((bsz,), start, dtype=torch.long, device=device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        for step in range(max_len + 1):
            logits = self._logits(state, prev, step)
            score, token = self.rules.greedy(logits, step, max_len, out)
            token = out.to_full(token)
            tokens[:, step] = token
            cumulative[:, step] = score if step == 0 else cumulative[:, step - 1] + score
            done = token.eq(self.eos)
            if step < max_len and not bool(done.any()):
                prev = token
                continue
            finished = done.nonzero().view(-1) if step < max_len else torch.arange(token.numel(), device=device)
            self._finalize(finalized, sentence[finished].tolist(), tokens[finished, : step + 1], cumulative[finished, : step + 1], step)
            keep = (~done).nonzero().view(-1)
            if step == max_len or keep.numel() == 0:
                break
            # finished sentences leave the batch: the rest move to the front of every buffer
            state.reorder_rows(keep, step)
            state.select_sentences(keep)
            tokens[: keep.numel(), : step + 1] = tokens.index_select(0, keep)[:, : step + 1]
            cumulative[: keep.numel(), : step + 1] = cumulative.index_select(0, keep)[:, : step + 1]
            tokens, cumulative = tokens[: keep.numel()], cumulative[: keep.numel()]
            sentence, prev = sentence[keep], token[keep]
        return finalized

    def _finalize(self, finalized, sentences: List[int], tokens: Tensor, cumulative: Tensor, step: int):
        scores = self._normalised(cumulative[:, step], step + 1)
        per_token = positional_scores(cumulative)
        for r, sent in enumerate(sentences):
            finalized[sent].append(hypothesis(tokens[r], scores[r], per_token[r]))

    def _beam(self, encoder_out, bsz: int, max_len: int, start: int, out: OutputVocabulary):
        beam = self.options.beam
        cand_size = 2 * beam
        if cand_size > out.size - 1:
            what = f"a vocabulary of {self.vocab_size}" if out.ids is None else f"the shortlist's {out.size} candidates of this batch"
            raise ValueError(f"--beam {beam} is too large for {what}")
        device = encoder_out["encoder_out"][0].device
        # step 0 runs one row per sentence (fairseq's beams are identical there); from step 1
        # on every sentence has `beam` rows
        state = self.step.begin(encoder_out, bsz * beam, max_len + 1, start, vocab=out.ids)
        tokens = torch.empty(bsz, max_len + 1, dtype=torch.long, device=device)
        cumulative = torch.empty(bsz, max_len + 1, dtype=torch.float32, device=device)
        sentence = torch.arange(bsz, device=device)
        prev = torch.full((bsz,), start, dtype=torch.long, device=device)
        ignore = torch.zeros(bsz, beam, dtype=torch.bool, device=device)
        cand_offsets = torch.arange(cand_size, device=device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        rows_per_sentence = 1
        for step in range(max_len + 1):
            logits = self._logits(state, prev, step)
            top_logits, top_tokens = self.rules.masked(logits, step, max_len, out).topk(cand_size, dim=1)
            top_tokens = out.to_full(top_tokens)
            row_scores = top_logits - torch.logsumexp(logits, dim=1, keepdim=True)
            if step > 0:
                row_scores = row_scores + cumulative[:, step - 1 : step]
            cand_scores, cand_tokens, cand_beams = candidates_per_sentence(row_scores, top_tokens, rows_per_sentence, cand_size)
            n_sent = cand_scores.size(0)
            cand_rows = cand_beams + torch.arange(n_sent, device=device).unsqueeze(1) * rows_per_sentence

            # finalize hypotheses that end in </s> among the first `beam` candidates
            eos_mask = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)
            eos_mask[:, :beam] &= ~ignore
            eos_top = eos_mask[:, :beam]
            finished_sent = []
            if bool(eos_top.any()):
                where = eos_top.nonzero()  # row-major, as fairseq's masked_select
                rows = cand_rows[where[:, 0], where[:, 1]]
                ended = torch.cat([tokens.index_select(0, rows)[:, :step], rows.new_full((rows.numel(), 1), self.eos)], dim=1)
                ended_scores = cand_scores[where[:, 0], where[:, 1]]
                if step > 0:
                    ended_cum = torch.cat([cumulative.index_select(0, rows)[:, :step], ended_scores.unsqueeze(1)], dim=1)
                else:
                    ended_cum = ended_scores.unsqueeze(1)
                scores = self._normalised(ended_scores, step + 1)
                per_token = positional_scores(ended_cum)
                for j, s in enumerate(where[:, 0].tolist()):
                    sent = int(sentence[s])
                    if len(finalized[sent]) < beam:
                        finalized[sent].append(hypothesis(ended[j], scores[j], per_token[j]))
                    if len(finalized[sent]) == beam or step == max_len:
                        finished_sent.append(s)
            if step == max_len:
                break
            if finished_sent:
                keep = torch.ones(n_sent, dtype=torch.bool, device=device)
                keep[finished_sent] = False
                if not bool(keep.any()):
                    break
                kept = keep.nonzero().view(-1)
                eos_mask, cand_rows, cand_scores, cand_tokens, ignore = (
                    t.index_select(0, kept) for t in (eos_mask, cand_rows, cand_scores, cand_tokens, ignore)
                )
                sentence = sentence[kept]
                state.select_sentences(kept)

            # the first `beam` candidates that do not end in </s> continue
            eos_mask[:, :beam] |= ignore
            active_mask = eos_mask.long() * cand_size + cand_offsets
            new_ignore, active = active_mask.topk(beam, dim=1, largest=False)
            ignore = new_ignore.ge(cand_size)
            active_rows = cand_rows.gather(1, active).view(-1)
            prev = cand_tokens.gather(1, active).view(-1)
            tokens = tokens.index_select(0, active_rows)
            cumulative = cumulative.index_select(0, active_rows)
            tokens[:, step] = prev
            cumulative[:, step] = cand_scores.gather(1, active).view(-1)
            state.reorder_rows(active_rows, step)
            rows_per_sentence = beam
        for hypos in finalized:
            hypos.sort(key=lambda h: float(h["score"]), reverse=True)
        return finalized
