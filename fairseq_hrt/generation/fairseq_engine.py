"""``--decoder-engine fairseq``: fairseq's own ``SequenceGenerator`` for left-to-right search
(needed for ``--prefix-size``, constraints, sampling, alignments), keeping its last encoder
output for HRT's stage II (:class:`~fairseq_hrt.generation.hrt_generator.HRTGenerator`)."""

from typing import Dict

import torch
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from torch import Tensor

from fairseq_hrt.generation.engines import DecoderEngine, register_engine
from fairseq_hrt.generation.options import fairseq_values, with_options


class _EncoderCachingEnsemble(EnsembleModel):
    """fairseq's ensemble wrapper that keeps the last encoder output for stage II."""

    def __init__(self, models):
        super().__init__(models)
        self.last_encoder_outs = None

    @torch.jit.unused
    def forward_encoder(self, net_input: Dict[str, Tensor]):
        self.last_encoder_outs = super().forward_encoder(net_input)
        return self.last_encoder_outs


class EncoderKeepingSequenceGenerator(SequenceGenerator):
    """fairseq's ``SequenceGenerator`` that keeps the encoder output of its last batch."""

    def __init__(self, models, tgt_dict, **kwargs):
        super().__init__(_EncoderCachingEnsemble(models), tgt_dict, **kwargs)

    @property
    def last_encoder_out(self):
        return self.model.last_encoder_outs[0]


@register_engine("fairseq")
class FairseqEngine(DecoderEngine):
    """fairseq's ``SequenceGenerator`` (needed for --prefix-size, constraints, sampling,
    alignments), keeping its last encoder output for HRT's stage II."""

    summary = (
        "fairseq's SequenceGenerator, the same hypotheses as lean (needed for --prefix-size, constraints, "
        "sampling, alignments)"
    )

    def left_to_right(self, ctx, search, banned, keep_encoder_out=False):
        pad = ctx.task.target_dictionary.pad()
        suppress = [ctx.task.target_dictionary[i] for i in banned if i != pad]  # fairseq bans <pad> itself
        args = ctx.options.fairseq_args
        # the search options win over the command line's (stage I's L / k, a strategy's beam)
        changed = {
            k: v for k, v in fairseq_values(search, ctx.options.temperature).items() if getattr(args, k, None) != v
        }
        if changed:
            args = with_options(args, **changed)
        if not keep_encoder_out and not suppress:  # the caller's own generator class (fairseq's convention)
            return ctx.fairseq_generator(ctx.models, args)
        return ctx.fairseq_generator(
            ctx.models,
            args,
            seq_gen_cls=EncoderKeepingSequenceGenerator,
            extra_gen_cls_kwargs={"tokens_to_suppress": suppress} if suppress else None,
        )
