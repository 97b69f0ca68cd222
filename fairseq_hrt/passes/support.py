"""Which decoders and encoders the planned passes run: support is an allow-list of module
classes (:func:`unplanned_modules`) plus the features they do not support
(:func:`unsupported_features`), refused by name (:func:`refuse_unplanned`)."""

import functools
from typing import Dict, List

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
from torch import nn

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.hrt_transformer import HRTDecoder, HRTDecoderLayer
from fairseq_hrt.models.ssru_transformer import SSRUDecoder, SSRUDecoderLayer
from fairseq_hrt.modules.cpu_dropout import PCG64Dropout
from fairseq_hrt.modules.relative_attention import RelativeSelfAttention
from fairseq_hrt.modules.ssru import SSRU
from fairseq_hrt.passes.plan import is_recurrent


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


def unsupported_features(decoder) -> Dict[str, bool]:
    """What the planned passes cannot run, each with whether ``decoder`` has it."""
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


def refuse_unplanned(decoder):
    """Refuse, in one message naming them, a decoder's modules or features the planned passes
    do not know (a module the plan would skip without a word)."""
    unknown = unplanned_modules(decoder)
    if unknown:
        raise RefusedOptions(
            f"the planned decoder pass (the lean engine, Jacobi decoding, the ONNX export) does not know the "
            f"module(s) {', '.join(unknown)}; use --decoder-engine fairseq"
        )
    for reason, bad in unsupported_features(decoder).items():
        if bad:
            raise RefusedOptions(
                f"the planned decoder pass (the lean engine, Jacobi decoding, the ONNX export) does not support "
                f"{reason}; use --decoder-engine fairseq"
            )
