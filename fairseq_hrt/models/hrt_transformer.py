"""The HRT model: a Transformer whose one decoder runs causally (AT / Skip-AT) or
non-causally (CMLM / Skip-CMLM), with key-only relative positions in its self-attention.

SPEC section 1. The encoder is fairseq's own :class:`TransformerEncoderBase` and every decoder
parameter keeps the name it has in fairseq's transformer, so an AT checkpoint of the same shape
(fairseq's ``transformer`` / this plugin's ``at_*`` archs) initialises an HRT model; only the
relative-position embeddings are new (fine-tuning, SPEC section 2).
"""

import logging
from typing import Dict, List, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerDecoderBase, TransformerModel
from fairseq.models.transformer import base_architecture as transformer_base_architecture
from fairseq.modules import LearnedPositionalEmbedding
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.kinds import HRT, ModelFamily, declare
from fairseq_hrt.models.shapes import deep_shallow, set_shape_defaults
from fairseq_hrt.models.ssru_transformer import is_ssru_state_dict, refuse_ssru_for_non_causal
from fairseq_hrt.modules.decoder_layer_blocks import decoder_layer, wrapped_layer
from fairseq_hrt.modules.relative_attention import RelativeSelfAttention
from fairseq_hrt.symbols import MAX_CHUNK_SIZE, chunk_start_symbol

logger = logging.getLogger(__name__)

DEFAULT_RPR_WINDOW = 16


class HRTDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with the self-attention replaced by :class:`RelativeSelfAttention`."""

    def __init__(self, cfg, rpr_window: int, no_encoder_attn=False):
        self._rpr_window = rpr_window
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        return RelativeSelfAttention(
            embed_dim,
            cfg.decoder.attention_heads,
            window=self._rpr_window,
            dropout=cfg.attention_dropout,
        )

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        causal: bool,
        encoder_out: Optional[Tensor],
        encoder_padding_mask: Optional[Tensor],
        incremental_state=None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
    ):
        def self_block(h):
            return self.self_attn(
                h,
                positions,
                key_padding_mask=self_attn_padding_mask,
                causal=causal,
                incremental_state=incremental_state,
            )

        return decoder_layer(
            self,
            self.self_attn_layer_norm,
            self_block,
            x,
            encoder_out,
            encoder_padding_mask,
            incremental_state,
            need_weights=need_attn,
        )


class HRTDecoder(TransformerDecoderBase):
    """One decoder, two modes that share every parameter (SPEC section 1).

    ``forward(tokens, encoder_out, positions=None, causal=True)``:

    * ``causal=True``: AT / Skip-AT. Without explicit ``positions`` they follow from the
      start symbol: ``</s>`` (fairseq's AT start) gives ``0, 1, 2, ..``, ``<s_k>`` gives
      ``0, k, 2k, ..``. This is what makes fairseq's ``SequenceGenerator`` (which feeds the
      whole prefix at every step) run Skip-AT unchanged.
    * ``causal=False``: CMLM / Skip-CMLM, positions ``1..T`` unless given.
    """

    def __init__(self, cfg, dictionary, embed_tokens, rpr_window: int, no_encoder_attn=False):
        self._rpr_window = rpr_window
        refuse_unsupported_options(cfg)
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        # start symbol -> stride of the default positions (1 for everything but <s_k>)
        stride = torch.ones(len(dictionary), dtype=torch.long)
        for k in range(2, MAX_CHUNK_SIZE + 1):
            idx = dictionary.indices.get(chunk_start_symbol(k))
            if idx is not None:
                stride[idx] = k
        self.register_buffer("start_stride", stride, persistent=False)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrapped_layer(HRTDecoderLayer(cfg, self._rpr_window, no_encoder_attn=no_encoder_attn), cfg)

    def default_positions(self, tokens: Tensor, causal: bool) -> Tensor:
        steps = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
        if causal:
            return steps * self.start_stride[tokens[:, :1]]
        return steps + 1

    def embed_target_positions(self, tokens: Tensor, positions: Tensor) -> Optional[Tensor]:
        """Embedding of original positions; fairseq's index of position p is ``p + pad + 1``,
        so AT positions get exactly the embeddings fairseq's transformer gives them."""
        if self.embed_positions is None:
            return None
        index = (positions + self.padding_idx + 1).masked_fill(tokens.eq(self.padding_idx), self.padding_idx)
        if isinstance(self.embed_positions, LearnedPositionalEmbedding):
            return self.embed_positions(tokens, positions=index)
        weights = self.embed_positions.weights
        needed = int(index.max().item()) + 1
        if needed > weights.size(0):
            weights = self.embed_positions.get_embedding(
                needed, self.embed_positions.embedding_dim, self.padding_idx
            ).to(weights)
            self.embed_positions.weights = weights
        return weights.to(device=tokens.device).index_select(0, index.reshape(-1)).view(*index.shape, -1)

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state=None,
        features_only: bool = False,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        src_lengths=None,
        return_all_hiddens: bool = False,
        positions: Optional[Tensor] = None,
        causal: bool = True,
    ):
        x, extra = self.extract_features(
            prev_output_tokens,
            encoder_out=encoder_out,
            incremental_state=incremental_state,
            alignment_layer=alignment_layer,
            alignment_heads=alignment_heads,
            positions=positions,
            causal=causal,
        )
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out=None,
        incremental_state=None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        positions: Optional[Tensor] = None,
        causal: bool = True,
    ):
        if incremental_state is not None and not causal:
            raise ValueError("incremental decoding is causal only")
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1
        enc = padding_mask = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        tokens = prev_output_tokens
        if incremental_state is not None:
            # fairseq passes the whole prefix at every step: only the last token is new, and
            # only its position is computed (this runs at every decoding step)
            if positions is None:
                positions = (tokens.size(1) - 1) * self.start_stride[tokens[:, :1]]
            else:
                positions = positions[:, -1:]
            tokens = tokens[:, -1:]
        elif positions is None:
            positions = self.default_positions(tokens, causal)
        tokens = tokens.contiguous()

        x = self.embed_scale * self.embed_tokens(tokens)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        pos_emb = self.embed_target_positions(tokens, positions)
        if pos_emb is not None:
            x = x + pos_emb.to(x)
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        self_attn_padding_mask = tokens.eq(self.padding_idx)
        if not self_attn_padding_mask.any():
            self_attn_padding_mask = None

        attn: Optional[Tensor] = None
        inner_states: List[Optional[Tensor]] = [x]
        for idx, layer in enumerate(self.layers):
            x, layer_attn = layer(
                x,
                positions,
                causal,
                enc,
                padding_mask,
                incremental_state=incremental_state,
                self_attn_padding_mask=self_attn_padding_mask,
                need_attn=idx == alignment_layer,
            )
            inner_states.append(x)
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)
        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]
            attn = attn.mean(dim=0) if attn.dim() == 4 else attn

        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}


@register_model("hrt_transformer")
@declare(ModelFamily(HRT, left_to_right=True, non_causal=True, chunk_sizes=True))
class HRTTransformerModel(TransformerModel):
    """Hybrid-Regressive Translation model (``--arch hrt_*``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument(
            "--decoder-rpr-window",
            type=int,
            metavar="W",
            help="clip window of the decoder self-attention's relative key positions "
            f"(HRT paper: {DEFAULT_RPR_WINDOW}); 0 turns relative positions off",
        )

    @classmethod
    def build_model(cls, args, task):
        # fairseq's TransformerModel builds embeddings (paths, sharing), the encoder and the
        # model with every fairseq option; only the decoder is this plugin's (as fairseq's
        # NAT models do it)
        hrt_base_architecture(args)
        if args.decoder_rpr_window < 0:
            raise RefusedOptions(f"--decoder-rpr-window must be >= 0, got {args.decoder_rpr_window}")
        refuse_unsupported_options(args)
        return super().build_model(args, task)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(cfg)
        window = getattr(cfg, "decoder_rpr_window", None)
        return HRTDecoder(cfg, tgt_dict, embed_tokens, rpr_window=DEFAULT_RPR_WINDOW if window is None else window)

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        # which chunk sizes k this model was trained for (flag per k); saved with the
        # weights so fairseq-generate can refuse a k the model never learnt
        self.register_buffer("trained_chunk_sizes", torch.zeros(MAX_CHUNK_SIZE + 1, dtype=torch.long))

    def mark_trained_chunk_sizes(self, chunk_sizes):
        for k in chunk_sizes:
            self.trained_chunk_sizes[k] = 1

    def get_trained_chunk_sizes(self) -> List[int]:
        return [k for k in range(2, MAX_CHUNK_SIZE + 1) if int(self.trained_chunk_sizes[k]) > 0]

    def forward(
        self,
        src_tokens,
        src_lengths,
        prev_output_tokens,
        positions: Optional[Tensor] = None,
        causal: bool = True,
        return_all_hiddens: bool = False,
        features_only: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths)
        return self.decoder(
            prev_output_tokens,
            encoder_out=encoder_out,
            features_only=features_only,
            alignment_layer=alignment_layer,
            alignment_heads=alignment_heads,
            positions=positions,
            causal=causal,
        )

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        check_dictionary_compatible(self, state_dict)
        new_keys = fill_missing_hrt_keys(self, state_dict)
        if new_keys:
            logger.warning(
                "initialising from a checkpoint without relative position weights (an AT "
                "checkpoint): %d new parameter tensor(s), set to zero so that the model "
                "starts as the AT model it is loaded from: %s",
                len(new_keys),
                ", ".join(new_keys),
            )
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


# fairseq transformer options that HRT's decoder (its own layer forward and relative
# self-attention) does not implement: refused together, instead of silently ignored
UNSUPPORTED_OPTIONS = {
    "cross_self_attention": "--cross-self-attention",
    "adaptive_softmax_cutoff": "--adaptive-softmax-cutoff",
    "scale_attn": "--scale-attn",
    "scale_fc": "--scale-fc",
    "scale_heads": "--scale-heads",
    "scale_resids": "--scale-resids",
    "adaptive_input": "--adaptive-input",
    "char_inputs": "--char-inputs",
}


def refuse_unsupported_options(cfg):
    """One error that names every option set in ``cfg`` (a namespace or TransformerConfig)
    that the HRT decoder does not support."""
    used = [flag for name, flag in UNSUPPORTED_OPTIONS.items() if getattr(cfg, name, None) not in (None, False)]
    if used:
        raise RefusedOptions(
            f"hrt_transformer / cmlm_transformer_hrt do not support {', '.join(used)}: the HRT decoder "
            "layer has its own self-attention (relative positions, two modes); drop these options "
            "or train an at_* (fairseq transformer) model"
        )


def check_dictionary_compatible(model, state_dict):
    """Fail with a clear message when a checkpoint was trained with another dictionary."""
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        if name not in state_dict:
            continue
        expected = model.state_dict()[name]
        got = state_dict[name].size(0)
        if got != expected.size(0):
            raise RefusedOptions(
                f"checkpoint was trained with another dictionary: its {name} has {got} "
                f"entries, the task's dictionary has {expected.size(0)}. Binarize with the "
                "same dict.txt and train every model (AT, CMLM, HRT) with --task "
                "hrt_translation, which adds <mask> and <s2>..<s8> identically."
            )


def fill_missing_hrt_keys(model, state_dict) -> List[str]:
    """Accept an AT checkpoint: the tensors it lacks that only HRT has are added.

    Only the relative-position embeddings (and the trained-chunk-size flags) qualify, and the
    embeddings only when the checkpoint has none of them (a real AT checkpoint); a partly
    missing HRT checkpoint still fails strict loading.

    The relative keys start at **zero**: ``q . R = 0`` adds nothing to any attention score,
    so the HRT model at step 0 of fine-tuning computes exactly the AT model it was loaded
    from (AT mode keeps fairseq's absolute positions ``0, 1, 2, ..``), as the paper's
    fine-tuning intends. A random table (the initialisation of a model trained from
    scratch) would perturb every self-attention score before the first update. Zero is no
    saddle point: the gradient of a score w.r.t. its relative key is the query, so the table
    trains from the first update.
    """
    if is_ssru_state_dict(state_dict):
        refuse_ssru_for_non_causal(f"loading an SSRU checkpoint into {type(model).__name__}")
    own = model.state_dict()
    new = []
    if "trained_chunk_sizes" in own and "trained_chunk_sizes" not in state_dict:
        state_dict["trained_chunk_sizes"] = own["trained_chunk_sizes"].clone()
    rel = [k for k in own if k.endswith("self_attn.relative_keys.weight")]
    if rel and not any(k in state_dict for k in rel):
        for key in rel:
            state_dict[key] = torch.zeros_like(own[key])
        new = rel
    return new


@register_model_architecture("hrt_transformer", "hrt_transformer")
def hrt_base_architecture(args):
    """6-6 Transformer-base, pre-norm (SPEC sections 1, 5)."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.decoder_rpr_window = getattr(args, "decoder_rpr_window", DEFAULT_RPR_WINDOW)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", True)
    transformer_base_architecture(args)


@register_model_architecture("hrt_transformer", "hrt_base")
def hrt_base(args):
    hrt_base_architecture(args)


for _layers in (6, 12, 20):
    register_model_architecture("hrt_transformer", f"hrt_e{_layers}d1")(deep_shallow(_layers, hrt_base_architecture))


@register_model_architecture("hrt_transformer", "hrt_small")
def hrt_small(args):
    """CPU-sized deep-encoder/shallow-decoder shape for benchmarks on 2 cores (d = 256, 6-1)."""
    set_shape_defaults(args, "small")
    hrt_base_architecture(args)


@register_model_architecture("hrt_transformer", "hrt_mini")
def hrt_mini(args):
    """The quickstart's shape (d = 128, FFN 256, 2 heads, 3-1), for convergence studies on CPU."""
    set_shape_defaults(args, "mini")
    hrt_base_architecture(args)


@register_model_architecture("hrt_transformer", "hrt_tiny")
def hrt_tiny(args):
    """Test-sized shape (d = 32, 2-1)."""
    set_shape_defaults(args, "tiny")
    hrt_base_architecture(args)
