"""Deep-encoder / shallow-decoder AT baselines (SPEC section 5) as archs of fairseq's own
``transformer`` model, so fairseq's beam search, hub interface and outside converters
(CTranslate2) treat them as the stock Transformer they are. Pre-norm throughout.

Train them with ``--task hrt_translation --hrt-mode at`` so their vocabulary matches HRT's
and an HRT model can fine-tune from them.
"""

from fairseq.models import register_model_architecture
from fairseq.models.transformer import base_architecture

from fairseq_hrt.models.shapes import deep_shallow, set_shape_defaults


def pre_norm_architecture(args):
    """fairseq's ``transformer`` architecture, pre-norm, input and output embeddings shared."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", True)
    base_architecture(args)


for _layers in (6, 12, 20):
    register_model_architecture("transformer", f"at_e{_layers}d1")(deep_shallow(_layers, pre_norm_architecture))


@register_model_architecture("transformer", "at_small")
def at_small(args):
    """CPU-sized shape, the same as ``hrt_small`` (d = 256, 6-1)."""
    set_shape_defaults(args, "small")
    deep_shallow(6, pre_norm_architecture)(args)


@register_model_architecture("transformer", "at_mini")
def at_mini(args):
    """The quickstart's shape, the same as ``hrt_mini`` (d = 128, 3-1)."""
    set_shape_defaults(args, "mini")
    deep_shallow(3, pre_norm_architecture)(args)


@register_model_architecture("transformer", "at_tiny")
def at_tiny(args):
    """Test-sized shape, the same as ``hrt_tiny`` (d = 32, 2-1)."""
    set_shape_defaults(args, "tiny")
    deep_shallow(2, pre_norm_architecture)(args)
