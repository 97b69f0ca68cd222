"""``--decoder-engine fairseq``: fairseq's own ``SequenceGenerator`` for left-to-right search
(needed for ``--prefix-size``, constraints, sampling, alignments); as HRT's stage I it keeps its
last batch's encoding for stage II (:class:`~fairseq_hrt.generation.hrt_generator.HRTGenerator`),
which runs on the model's :class:`~fairseq_hrt.generation.lean.TorchBackend`."""

from typing import Dict

import torch
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from torch import Tensor

from fairseq_hrt.generation.engines import DecoderEngine, register_engine
from fairseq_hrt.generation.lean import TorchBackend, TorchEncoded
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
    """fairseq's ``SequenceGenerator`` that keeps the encoding of its last batch
    (``last_encoded``, in ``backend``'s form) for HRT's stage II."""

    last_vocab = None  # no shortlist

    def __init__(self, models, tgt_dict, backend: TorchBackend = None, **kwargs):
        super().__init__(_EncoderCachingEnsemble(models), tgt_dict, **kwargs)
        self.backend = backend

    @property
    def last_encoded(self) -> TorchEncoded:
        return self.backend.encoding(self.model.last_encoder_outs[0])


@register_engine("fairseq")
class FairseqEngine(DecoderEngine):
    """fairseq's ``SequenceGenerator`` (needed for --prefix-size, constraints, sampling,
    alignments); HRT's stage II and Mask-Predict run on the model's :class:`TorchBackend`."""

    backend_supports_shortlist = True  # its backend is the lean engine's TorchBackend

    def backend(self, ctx):
        return TorchBackend(ctx.model, ctx.task.target_dictionary, ctx.task.chunk_start_idx, ctx.task.mask_idx)

    def left_to_right(self, ctx, config, banned):
        return self._generator(ctx, config, banned, keep_encoding=False)

    def stage1(self, ctx, config, banned):
        return self._generator(ctx, config, banned, keep_encoding=True)

    def _generator(self, ctx, config, banned, keep_encoding: bool):
        pad = ctx.task.target_dictionary.pad()
        suppress = [ctx.task.target_dictionary[i] for i in banned if i != pad]  # fairseq bans <pad> itself
        args = ctx.options.fairseq_args
        # the search options win over the command line's (stage I's L / k, a strategy's beam)
        changed = {
            k: v for k, v in fairseq_values(config, ctx.options.temperature).items() if getattr(args, k, None) != v
        }
        if changed:
            args = with_options(args, **changed)
        if not keep_encoding and not suppress:  # the caller's own generator class (fairseq's convention)
            return ctx.fairseq_generator(ctx.models, args)
        extra = {"tokens_to_suppress": suppress} if suppress else {}
        if keep_encoding:
            extra["backend"] = self.backend(ctx)
        return ctx.fairseq_generator(
            ctx.models, args, seq_gen_cls=EncoderKeepingSequenceGenerator, extra_gen_cls_kwargs=extra or None
        )
