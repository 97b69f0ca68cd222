"""``--criterion hrt_loss``: label-smoothed cross-entropy of HRT's four sample kinds, summed.

The task attaches ``sample['hrt']`` (see ``HRTTranslationTask.build_decoder_samples``): one
causal pass (Skip-AT rows first, then AT rows) and one non-causal pass (Skip-CMLM rows, then
CMLM rows) over a shared encoder output. Every kind's loss and token count is logged
separately, with ``p_k``, so training curves show the curriculum.

Mask-Predict models (``cmlm_*`` archs, which have ``forward_length``) also get the
target-length loss: the NLL of every sentence's true length N (target tokens without
``</s>``, clamped to the predictor's classes), weighted as fairseq's ``nat_loss`` does:
``--length-loss-factor`` times the per-sentence mean, relative to the per-token loss. It is
logged as ``length_loss`` (bits per sentence).
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq import metrics, utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass

from fairseq_hrt import chunking
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.kinds import family_of, unwrap

KINDS = ("at", "cmlm", "skip_at", "skip_cmlm")


@dataclass
class HRTLossConfig(FairseqDataclass):
    label_smoothing: float = field(
        default=0.1, metadata={"help": "epsilon for label smoothing, 0 means no label smoothing"}
    )
    kind_weights: str = field(
        default="",
        metadata={
            "help": "training weights of the sample kinds, e.g. 'skip_cmlm=2' or 'at=1,skip_at=1.5' "
            "(kinds: at, cmlm, skip_at, skip_cmlm; unnamed kinds weigh 1); the logged losses and "
            "the validation loss stay unweighted"
        },
    )
    skip_at_self_distill: float = field(
        default=0.0,
        metadata={
            "help": "weight a of self-distillation for Skip-AT: on chunked pairs, the loss at "
            "every Skip-AT target y_ik is (1 - a) x the label-smoothed loss + a x the cross-entropy "
            "to the same model's AT-mode distribution for y_ik, teacher-forced on the full "
            "prefix (no gradient through the teacher); 0 = off. Costs one causal decoder pass "
            "without gradient over the chunked pairs"
        },
    )


def label_smoothed_token_loss(lprobs, target, epsilon: float, ignore_index: int):
    """Per-token label-smoothed NLL (fairseq's formula), 0 at ``ignore_index``.

    Returns ``(loss, nll)``, both shaped like ``target``.
    """
    nll = -lprobs.gather(dim=-1, index=target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(dim=-1)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    pad = target.eq(ignore_index)
    return loss.masked_fill(pad, 0.0), nll.masked_fill(pad, 0.0)


def parse_kind_weights(text: str) -> dict:
    """``'skip_cmlm=2,at=0.5'`` -> ``{'at': 0.5, 'cmlm': 1.0, 'skip_at': 1.0, 'skip_cmlm': 2.0}``."""
    weights = {kind: 1.0 for kind in KINDS}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        kind, sep, value = item.partition("=")
        kind = kind.strip()
        if not sep or kind not in KINDS:
            raise RefusedOptions(f"--kind-weights {text!r}: expected KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        try:
            weight = float(value)
        except ValueError:
            raise RefusedOptions(f"--kind-weights {text!r}: {value!r} is not a number")
        if weight < 0:
            raise RefusedOptions(f"--kind-weights {text!r}: weights must be >= 0")
        weights[kind] = weight
    return weights


def check_mode_matches_model(hrt_mode: str, model):
    """The ``--hrt-mode`` each architecture trains with: a Mask-Predict model (``cmlm_*``, the
    one with a length predictor) ``cmlm`` only; an HRT model (``hrt_*``) ``hrt`` or ``at``; a
    model without a non-causal pass (``at_*``, fairseq's transformer) ``at`` only, since the
    other modes' samples need one. Checked before the first update (the task's
    ``begin_epoch``) and by every forward of the criterion."""
    family = family_of(model)
    arch = getattr(getattr(unwrap(model), "args", None), "arch", None) or type(unwrap(model)).__name__
    if family.length_predictor:
        if hrt_mode != "cmlm":
            raise RefusedOptions(
                f"--arch {arch} is a Mask-Predict architecture (cmlm_*): train it with --hrt-mode cmlm, "
                f"not --hrt-mode {hrt_mode}"
            )
    elif hrt_mode == "cmlm":
        raise RefusedOptions(
            f"--hrt-mode cmlm trains a Mask-Predict baseline, which needs a target-length predictor: "
            f"use a cmlm_* architecture (e.g. --arch cmlm_base / cmlm_small), or train --arch {arch} "
            f"with --hrt-mode {'hrt' if family.non_causal else 'at'}"
        )
    elif hrt_mode != "at" and not family.non_causal:
        raise RefusedOptions(
            f"--arch {arch} decodes left to right only: train it with --hrt-mode at, "
            f"or use an hrt_* architecture for --hrt-mode {hrt_mode}"
        )


def length_loss(model, encoder_out, target, pad: int, eos: int):
    """Per-sentence NLL of the true target length N (tokens without ``</s>``), ``(B,)``."""
    length_lprobs = model.forward_length(encoder_out)
    n = (target.ne(pad) & target.ne(eos)).long().sum(dim=1).clamp(max=length_lprobs.size(-1) - 1)
    return -length_lprobs.gather(1, n.unsqueeze(1)).squeeze(1)


def run_decoder(model, decoder_sample, encoder_out, causal: bool):
    """Decoder logits for one pass: a family that declares a non-causal pass (``non_causal``)
    takes the sample's positions and the pass's direction; the others (causal decoders,
    fairseq's among them) take their default (AT) positions."""
    if family_of(model).non_causal:
        return model.decoder(
            decoder_sample.tokens,
            encoder_out=encoder_out,
            positions=decoder_sample.positions,
            causal=causal,
        )[0]
    if not causal:
        raise RefusedOptions(
            f"--arch {getattr(model, 'args', None) and model.args.arch}: a plain fairseq "
            "decoder cannot run CMLM/HRT samples; use an hrt_* (or cmlm_*) architecture"
        )
    return model.decoder(decoder_sample.tokens, encoder_out=encoder_out)[0]


@register_criterion("hrt_loss", dataclass=HRTLossConfig)
class HRTLossCriterion(FairseqCriterion):
    def __init__(self, task, label_smoothing, skip_at_self_distill=0.0, kind_weights=""):
        super().__init__(task)
        self.eps = label_smoothing
        self.kind_weights = parse_kind_weights(kind_weights)
        if not 0.0 <= skip_at_self_distill <= 1.0:
            raise RefusedOptions(f"--skip-at-self-distill must be in [0, 1], got {skip_at_self_distill}")
        if skip_at_self_distill > 0 and getattr(task.cfg, "hrt_mode", "hrt") != "hrt":
            raise RefusedOptions(
                f"--skip-at-self-distill distils AT mode into Skip-AT, which --hrt-mode "
                f"{task.cfg.hrt_mode} does not train"
            )
        self.self_distill = skip_at_self_distill

    def forward(self, model, sample, reduce=True):
        if "hrt" not in sample:
            raise RefusedOptions("--criterion hrt_loss needs --task hrt_translation")
        check_mode_matches_model(self.task.cfg.hrt_mode, model)
        hrt = sample["hrt"]
        net_input = sample["net_input"]
        encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
        n_chunked = hrt["n_chunked"]
        logging_output = {"nsentences": sample["target"].size(0)}
        if hrt["p_k"] >= 0:  # validation gives every pair all kinds: no p_k
            logging_output.update(p_k_sum=hrt["p_k"], p_k_count=1)
        total_loss = total_nll = 0.0
        sample_size = 0
        for pass_name, causal, kinds in (("ar", True, ("skip_at", "at")), ("nar", False, ("skip_cmlm", "cmlm"))):
            ds = hrt[pass_name]
            if ds is None:
                continue
            rows = hrt[f"{pass_name}_rows"]
            enc = encoder_out
            if rows.numel() != sample["target"].size(0) or not torch.equal(
                rows, torch.arange(rows.numel(), device=rows.device)
            ):
                enc = model.encoder.reorder_encoder_out(encoder_out, rows)
            logits = run_decoder(model, ds, enc, causal)
            lprobs = F.log_softmax(logits.float(), dim=-1)
            loss, nll = label_smoothed_token_loss(lprobs, ds.target, self.eps, self.padding_idx)
            ntok = ds.target.ne(self.padding_idx).long().sum(dim=1)
            row_loss, row_nll = loss.sum(dim=1), nll.sum(dim=1)
            trained = loss  # the per-kind losses logged stay the label-smoothed ones, comparable across runs
            if pass_name == "ar" and self.self_distill > 0 and n_chunked > 0 and model.training:
                trained = self._self_distilled(model, sample, encoder_out, lprobs, loss, ds, logging_output)
            for kind, sl in ((kinds[0], slice(0, n_chunked)), (kinds[1], slice(n_chunked, None))):
                if kind.startswith("skip_") and self.task.cfg.hrt_mode != "hrt":
                    continue  # --hrt-mode at / cmlm trains no chunked kinds: log none, not zeros
                logging_output[f"{kind}_loss"] = utils.item(row_loss[sl].sum().data)
                logging_output[f"{kind}_nll_loss"] = utils.item(row_nll[sl].sum().data)
                logging_output[f"{kind}_ntokens"] = utils.item(ntok[sl].sum().data)
            if model.training and any(self.kind_weights[k] != 1.0 for k in kinds):
                row_weight = trained.new_full((trained.size(0), 1), self.kind_weights[kinds[1]])
                row_weight[:n_chunked] = self.kind_weights[kinds[0]]
                trained = trained * row_weight
            total_loss = total_loss + trained.sum()
            total_nll = total_nll + row_nll.sum()
            sample_size += int(ntok.sum().item())
        if family_of(model).length_predictor:
            target = sample["target"]
            length_nll = length_loss(model, encoder_out, target, self.padding_idx, self.task.target_dictionary.eos())
            # fairseq's weighting: factor x mean over sentences, next to a per-token loss; the
            # trainer divides by sample_size, so scale the sentence mean by it
            total_loss = total_loss + model.length_loss_factor * length_nll.mean() * sample_size
            logging_output["length_loss"] = utils.item(length_nll.sum().data)
            logging_output["length_nsentences"] = target.size(0)
        logging_output.update(
            loss=utils.item(total_loss.data),
            nll_loss=utils.item(total_nll.data),
            ntokens=sample_size,
            sample_size=sample_size,
        )
        return total_loss, sample_size, logging_output

    def _self_distilled(self, model, sample, encoder_out, lprobs, loss, ds, logging_output):
        """Skip-AT's per-token loss mixed with the cross-entropy to AT mode's teacher-forced
        distribution of the same tokens (``--skip-at-self-distill``).

        The teacher is the same decoder in AT mode, without dropout and without gradient, on
        the chunked pairs' full targets: it sees ``y_1 .. y_{ik-1}`` where Skip-AT sees only
        ``y_k, y_2k, ..``, so its distribution tells Skip-AT which of its choices are
        plausible continuations of the whole sentence instead of one-hot references.
        """
        hrt = sample["hrt"]
        n_chunked = hrt["n_chunked"]
        pad, eos = self.padding_idx, self.task.target_dictionary.eos()
        chunked_rows = hrt["ar_rows"][:n_chunked]
        target = sample["target"].index_select(0, chunked_rows)
        skip_target = ds.target[:n_chunked]
        slots, valid = chunking.skip_at_teacher_slots(
            skip_target, hrt["chunk_sizes"], chunking.target_lengths(target, pad), pad
        )
        at = chunking.at_sample(target, pad, eos)
        enc = model.encoder.reorder_encoder_out(encoder_out, chunked_rows)
        was_training = model.decoder.training
        model.decoder.eval()
        try:
            with torch.no_grad():
                teacher = F.softmax(run_decoder(model, at, enc, causal=True).float(), dim=-1)
        finally:
            model.decoder.train(was_training)
        vocab = teacher.size(-1)
        teacher = teacher.gather(1, slots.unsqueeze(-1).expand(-1, -1, vocab))
        soft = -(teacher * lprobs[:n_chunked, : slots.size(1)]).sum(dim=-1).masked_fill(~valid, 0.0)
        a = self.self_distill
        mixed = torch.where(
            valid, (1.0 - a) * loss[:n_chunked, : slots.size(1)] + a * soft, loss[:n_chunked, : slots.size(1)]
        )
        loss = loss.clone()
        loss[:n_chunked, : slots.size(1)] = mixed
        logging_output["skip_at_distill_loss"] = utils.item(soft.sum().data)
        logging_output["skip_at_distill_ntokens"] = utils.item(valid.long().sum().data)
        return loss

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        def total(key):
            return sum(log.get(key, 0) for log in logging_outputs)

        sample_size = total("sample_size")
        ntokens = total("ntokens")
        metrics.log_scalar("loss", total("loss") / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", total("nll_loss") / max(ntokens, 1) / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        for kind in KINDS:
            if not any(f"{kind}_ntokens" in log for log in logging_outputs):
                continue  # a kind this run never trains (--hrt-mode at / cmlm)
            ntok = total(f"{kind}_ntokens")
            # token counts are logged even when 0, so curves show a kind fading out
            metrics.log_scalar(f"{kind}_ntokens", ntok, priority=900, round=0)
            if ntok > 0:
                metrics.log_scalar(f"{kind}_loss", total(f"{kind}_loss") / ntok / math.log(2), ntok, round=3)
        if any("skip_at_distill_ntokens" in log for log in logging_outputs):
            ntok = total("skip_at_distill_ntokens")
            if ntok > 0:
                metrics.log_scalar(
                    "skip_at_distill_loss", total("skip_at_distill_loss") / ntok / math.log(2), ntok, round=3
                )
        if any("length_loss" in log for log in logging_outputs):
            nsent = total("length_nsentences")
            metrics.log_scalar("length_loss", total("length_loss") / max(nsent, 1) / math.log(2), nsent, round=3)
        count = total("p_k_count")
        if count:
            metrics.log_scalar("p_k", total("p_k_sum") / count, count, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
