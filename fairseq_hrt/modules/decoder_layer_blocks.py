"""The decoder layer of the layers here that replace only fairseq's self-attention (HRT's
relative self-attention, the SSRU): the passes' one layer (:mod:`fairseq_hrt.passes.layers`)
over the layer's own modules, and fairseq's wrapping of a decoder layer."""

from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from torch import Tensor

from fairseq_hrt.passes.layers import layer_forward


def wrapped_layer(layer, cfg):
    """``layer`` wrapped as fairseq's ``TransformerDecoderBase.build_decoder_layer`` wraps its
    own, so ``--checkpoint-activations``, ``--offload-activations`` and FSDP apply to it too."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0)


class ModuleLayer:
    """A decoder layer's own modules under the names the passes' layer reads
    (:class:`~fairseq_hrt.passes.plan.LayerPlan`'s), called as they are: training's layer is
    :func:`~fairseq_hrt.passes.layers.layer_forward` over them. ``self_attn_norm``: the norm
    of the layer's self block (the SSRU's, where it replaces the self-attention)."""

    __slots__ = ("pre_norm", "self_attn_norm", "encoder_attn_norm", "final_norm", "fc1", "fc2", "activation")

    def __init__(self, layer, self_attn_norm):
        self.pre_norm = layer.normalize_before
        self.self_attn_norm = self_attn_norm
        self.encoder_attn_norm = layer.encoder_attn_layer_norm
        self.final_norm = layer.final_layer_norm
        self.fc1, self.fc2, self.activation = layer.fc1, layer.fc2, layer.activation_fn


def decoder_layer(
    layer,
    self_attn_norm,
    self_block,
    x: Tensor,
    encoder_out: Optional[Tensor],
    encoder_padding_mask: Optional[Tensor],
    incremental_state=None,
    need_weights: bool = False,
    need_head_weights: bool = False,
):
    """``(x, attention)`` of ``layer`` (a ``TransformerDecoderLayerBase`` whose self-attention
    is replaced by ``self_block``, ``h -> output``, after ``self_attn_norm``): the one decoder
    layer of the passes (:func:`~fairseq_hrt.passes.layers.layer_forward`) with training's
    dropout, over fairseq's own encoder attention, pre- or post-norm as the layer is
    configured."""
    weights = []

    def encoder_block(_, i, h):
        out, attn = layer.encoder_attn(
            query=h,
            key=encoder_out,
            value=encoder_out,
            key_padding_mask=encoder_padding_mask,
            incremental_state=incremental_state,
            static_kv=True,
            need_weights=need_weights,
            need_head_weights=need_head_weights,
        )
        weights.append(attn)
        return out

    attends = layer.encoder_attn is not None and encoder_out is not None
    x = layer_forward(
        ModuleLayer(layer, self_attn_norm),
        0,
        x,
        lambda _, i, h: self_block(h),
        encoder_block if attends else None,
        dropout=(layer.dropout_module, layer.activation_dropout_module),
    )
    return x, weights[0] if weights else None
