"""How the HRT task trains (SPEC section 2): per batch, the decoder samples of the curriculum
(:mod:`fairseq_hrt.chunking`), the step's CPU precision (:mod:`fairseq_hrt.tasks.cpu_training`),
the architecture checked against ``--hrt-mode``, and each optimizer step counted on the model
so that what decoding keeps of the weights is made again (an ``--eval-bleu`` validation)."""

from typing import Optional

import torch
from fairseq.logging import metrics

from fairseq_hrt import chunking
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.criterions.hrt_loss import check_mode_matches_model
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.passes.weights import count_weights_written


class TrainingHooks:
    """fairseq's training hooks of :class:`~fairseq_hrt.tasks.hrt_translation.HRTTranslationTask`
    (placed before ``TranslationTask`` among its bases: ``super()`` is fairseq's). Reads the
    task's ``cfg``, ``chunk_sizes``, ``p_raw``, ``mask_idx``, ``chunk_start_idx`` and
    ``cpu_training``."""

    def curriculum_p_k(self, num_updates: int) -> float:
        total = self.cfg.curriculum_updates or self.cfg.max_update
        if total <= 0:
            raise RefusedOptions(
                "HRT's chunk curriculum needs the total number of updates: set --max-update (or --curriculum-updates)"
            )
        return chunking.curriculum_p_k(num_updates, total, self.cfg.curriculum_lambda)

    def chunked_rows_generator(self, sample, num_updates: int) -> torch.Generator:
        """The RNG that picks a batch's chunked pairs (:func:`chunking.chunked_rows_generator`)."""
        return chunking.chunked_rows_generator(sample["id"], self.cfg.seed, num_updates)

    def build_decoder_samples(self, sample, p_k: Optional[float], generator=None, rows_generator=None):
        """Attach ``sample['hrt']``: the decoder samples of SPEC section 2 for this batch
        (:func:`chunking.batch_decoder_samples`).

        ``p_k=None`` (validation) gives every pair all four kinds, so validation loss
        measures both decoding modes whatever the curriculum stage; ``--hrt-mode at`` /
        ``cmlm`` ignore ``p_k``.
        """
        distilled = sample.get("distilled_target")
        target, hrt = chunking.batch_decoder_samples(
            sample["target"],
            self.cfg.hrt_mode,
            p_k,
            pad=self.tgt_dict.pad(),
            eos=self.tgt_dict.eos(),
            mask=self.mask_idx,
            chunk_sizes=self.chunk_sizes,
            chunk_start=self.chunk_start_idx,
            distilled=distilled,
            p_raw=self.p_raw,
            p_raw_chunked=self.cfg.p_raw_chunked,
            generator=generator,
            rows_generator=rows_generator,
        )
        if distilled is not None:
            sample["target"] = target
        sample["hrt"] = hrt
        return sample

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        # fairseq-train's model, before its first update (a model built only to decode may be
        # of any architecture whatever this task's --hrt-mode)
        check_mode_matches_model(self.cfg.hrt_mode, model)
        # after --restore-file / --finetune-from-model the flags come from the checkpoint:
        # add the chunk sizes this run trains
        if self.cfg.hrt_mode == "hrt" and family_of(model).chunk_sizes:
            model.mark_trained_chunk_sizes(self.chunk_sizes)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        # fairseq passes the number of updates already done; Algorithm 1 counts t = 1..T, so
        # the last update of the run trains with p_k = 1 (every pair chunked)
        # AT-only / CMLM-only runs have no curriculum: p_k=None there, so none is logged
        p_k = self.curriculum_p_k(update_num + 1) if self.cfg.hrt_mode == "hrt" else None
        rows_generator = self.chunked_rows_generator(sample, update_num) if p_k is not None else None
        sample = self.build_decoder_samples(sample, p_k, rows_generator=rows_generator)
        with self.cpu_training.precision(model):
            return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def optimizer_step(self, optimizer, model, update_num):
        """fairseq's, then the step counted on ``model``: fairseq's optimizers write the weights
        through ``p.data``, which their version counters do not see, and the decoding caches
        of ``--eval-bleu`` validation (fused projections, captured graphs) are kept per
        :func:`~fairseq_hrt.passes.weights.weights_version`."""
        super().optimizer_step(optimizer, model, update_num)
        count_weights_written(model)

    def valid_step(self, sample, model, criterion):
        sample = self.build_decoder_samples(sample, None)
        return super().valid_step(sample, model, criterion)

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        # fairseq logs no "bleu" for a validation whose hypotheses are all empty (a model in its
        # first updates), and fairseq-train then dies with KeyError: 'bleu' under
        # --best-checkpoint-metric bleu; such a validation's BLEU is 0
        validated = any("_bleu_sys_len" in log for log in logging_outputs)
        if self.cfg.eval_bleu and validated and not any(log.get("_bleu_totals_0", 0) for log in logging_outputs):
            metrics.log_scalar("bleu", 0.0)
