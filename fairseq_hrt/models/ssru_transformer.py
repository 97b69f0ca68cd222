"""AT students with an SSRU decoder (Marian's WNGT 2019 students, section 3.1 of
``marian-wngt2019-ludicrously-fast-nmt``): fairseq's Transformer whose decoder layers replace
self-attention by the :class:`~fairseq_hrt.modules.ssru.SSRU` recurrence.

Model ``transformer_ssru`` (a :class:`TransformerModel` that builds only its own decoder, as
fairseq's NAT models do), archs ``at_e{6,12,20}d1_ssru``, ``at_small_ssru``, ``at_mini_ssru``,
``at_tiny_ssru`` with the shapes of their attention twins. Trained with ``--task
hrt_translation --hrt-mode at`` and decoded with fairseq-generate (fairseq's
``SequenceGenerator`` through fairseq's incremental state, or the lean engine).

Only left-to-right (AT) decoding can use a recurrence: HRT and Mask-Predict decode (partly)
non-causally, so an SSRU decoder is refused there (:func:`refuse_ssru_for_non_causal`).
"""

from typing import Dict, List, Optional

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerDecoderBase, TransformerModel
from fairseq.modules import LayerNorm
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models import at_transformer
from fairseq_hrt.models.kinds import AT, ModelFamily, declare
from fairseq_hrt.models.shapes import deep_shallow
from fairseq_hrt.modules.decoder_layer_blocks import decoder_layer, wrapped_layer
from fairseq_hrt.modules.ssru import SSRU

SSRU_KEY = ".ssru."

# fairseq decoder options that act on the self-attention the SSRU layer does not have
UNSUPPORTED_OPTIONS = {"cross_self_attention": "--cross-self-attention"}


def refuse_unsupported_options(cfg):
    used = [flag for name, flag in UNSUPPORTED_OPTIONS.items() if getattr(cfg, name, None) not in (None, False)]
    if used:
        raise RefusedOptions(
            f"transformer_ssru (--arch *_ssru) does not support {', '.join(used)}: its decoder layers "
            "have an SSRU instead of self-attention; drop these options or use the attention twin (at_*)"
        )


def is_ssru_state_dict(state_dict) -> bool:
    return any(SSRU_KEY in key for key in state_dict)


def refuse_ssru_for_non_causal(what: str):
    """The one error for SSRU with HRT / Mask-Predict (a model, a mode or a checkpoint)."""
    raise RefusedOptions(
        f"{what}: an SSRU decoder is a left-to-right recurrence, but HRT and Mask-Predict decode "
        "(partly) non-causally (CMLM / Skip-CMLM passes see later positions), which a recurrence "
        "cannot. Use SSRU only for AT students (--arch *_ssru --hrt-mode at); fine-tune HRT / "
        "Mask-Predict from an attention AT checkpoint (at_*)"
    )


class SSRUDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer with the self-attention block replaced by an SSRU block:
    ``x + dropout(SSRU(LN(x)))`` (pre-norm) or ``LN(x + dropout(SSRU(x)))`` (post-norm, the
    paper's form); encoder attention and FFN are fairseq's."""

    def __init__(self, cfg, no_encoder_attn=False):
        refuse_unsupported_options(cfg)
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        # fairseq's constructor built a self-attention and its norm; this layer has neither
        del self.self_attn
        del self.self_attn_layer_norm
        self.ssru = SSRU(self.embed_dim)
        self.ssru_layer_norm = LayerNorm(self.embed_dim, export=cfg.export)

    def forward(
        self,
        x: Tensor,
        encoder_out: Optional[Tensor] = None,
        encoder_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        prev_self_attn_state: Optional[List[Tensor]] = None,
        prev_attn_state: Optional[List[Tensor]] = None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
    ):
        # self_attn_mask (the causal mask) is not needed: the recurrence is causal
        if prev_self_attn_state is not None or prev_attn_state is not None:
            raise ValueError("SSRU decoder layers do not take prev_self_attn_state / prev_attn_state")
        if need_head_weights:
            need_attn = True
        x, attn = decoder_layer(
            self,
            self.ssru_layer_norm,
            lambda h: self.ssru(h, incremental_state=incremental_state, padding_mask=self_attn_padding_mask),
            x,
            encoder_out,
            encoder_padding_mask,
            incremental_state,
            need_weights=need_attn or (not self.training and self.need_attn),
            need_head_weights=need_head_weights,
        )
        return x, attn, None


class SSRUDecoder(TransformerDecoderBase):
    """fairseq's Transformer decoder (embeddings, positions, incremental decoding, output
    layer) over :class:`SSRUDecoderLayer` layers."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrapped_layer(SSRUDecoderLayer(cfg, no_encoder_attn=no_encoder_attn), cfg)


@register_model("transformer_ssru")
@declare(ModelFamily(AT, left_to_right=True, recurrent_decoder=True))
class SSRUTransformerModel(TransformerModel):
    """Transformer with an SSRU decoder (``--arch *_ssru``)."""

    @classmethod
    def build_model(cls, args, task):
        refuse_unsupported_options(args)
        return super().build_model(args, task)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return SSRUDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


def _ssru_twin(name, attention_arch):
    def arch(args):
        attention_arch(args)

    arch.__doc__ = f"The shape of ``{name}`` with SSRU decoder layers."
    return arch


@register_model_architecture("transformer_ssru", "transformer_ssru")
def ssru_base_architecture(args):
    """Transformer-base shape, 6 encoder layers and 1 SSRU decoder layer, pre-norm."""
    deep_shallow(6, at_transformer.pre_norm_architecture)(args)


for _layers in (6, 12, 20):
    register_model_architecture("transformer_ssru", f"at_e{_layers}d1_ssru")(
        _ssru_twin(f"at_e{_layers}d1", deep_shallow(_layers, at_transformer.pre_norm_architecture))
    )
for _name in ("at_small", "at_mini", "at_tiny"):
    register_model_architecture("transformer_ssru", f"{_name}_ssru")(_ssru_twin(_name, getattr(at_transformer, _name)))
