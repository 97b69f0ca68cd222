"""The blocks of fairseq's decoder layer after its self-attention, for the layers here that
replace only the self-attention (HRT's relative self-attention, the SSRU), and fairseq's
wrapping of a decoder layer."""

from typing import Optional

from fairseq.distributed import fsdp_wrap
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from torch import Tensor


def wrapped_layer(layer, cfg):
    """``layer`` wrapped as fairseq's ``TransformerDecoderBase.build_decoder_layer`` wraps its
    own, so ``--checkpoint-activations``, ``--offload-activations`` and FSDP apply to it too."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0)


def encoder_attention_and_ffn(
    layer,
    x: Tensor,
    encoder_out: Optional[Tensor],
    encoder_padding_mask: Optional[Tensor],
    incremental_state=None,
    need_weights: bool = False,
    need_head_weights: bool = False,
):
    """``(x, attention)`` after the encoder attention and the feed-forward block of ``layer``
    (a ``TransformerDecoderLayerBase``), pre- or post-norm as the layer is configured, exactly
    as fairseq's own layer computes them."""
    attn = None
    if layer.encoder_attn is not None and encoder_out is not None:
        residual = x
        if layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)
        x, attn = layer.encoder_attn(
            query=x,
            key=encoder_out,
            value=encoder_out,
            key_padding_mask=encoder_padding_mask,
            incremental_state=incremental_state,
            static_kv=True,
            need_weights=need_weights,
            need_head_weights=need_head_weights,
        )
        x = layer.residual_connection(layer.dropout_module(x), residual)
        if not layer.normalize_before:
            x = layer.encoder_attn_layer_norm(x)

    residual = x
    if layer.normalize_before:
        x = layer.final_layer_norm(x)
    x = layer.activation_dropout_module(layer.activation_fn(layer.fc1(x)))
    x = layer.dropout_module(layer.fc2(x))
    x = layer.residual_connection(x, residual)
    if not layer.normalize_before:
        x = layer.final_layer_norm(x)
    return x, attn
