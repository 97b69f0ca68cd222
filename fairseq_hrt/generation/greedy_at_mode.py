"""``--decoding greedy-at-mode``: greedy left-to-right search from ``</s>`` whatever ``--beam``
says -- an AT model's greedy search, an HRT model's AT mode (k = 1, b = 1). The quality
reference of HRT's speed-ups, as one name for fairseq-generate, the API and benchmarks."""

import dataclasses

from fairseq_hrt.generation.hrt_generator import BeamDecoding
from fairseq_hrt.generation.strategies import DecodingContext, LeftToRightDecoding, register_decoding


@register_decoding("greedy-at-mode")
class GreedyATModeDecoding(LeftToRightDecoding):
    """Left-to-right search with beam 1 (the engine of ``--decoder-engine``)."""

    supports_shortlist = BeamDecoding.supports_shortlist
    supports_compile = BeamDecoding.supports_compile

    @classmethod
    def build(cls, ctx: DecodingContext):
        return BeamDecoding.build(dataclasses.replace(ctx, options=ctx.options.replace(beam=1)))
