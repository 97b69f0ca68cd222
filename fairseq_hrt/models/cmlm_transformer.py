"""Mask-Predict baseline (SPEC section 4): a conditional masked language model (CMLM) with a
target-length predictor (Ghazvininejad et al. 2019), built on the HRT model.

Model ``cmlm_transformer_hrt`` (fairseq's own ``cmlm_transformer`` keeps its name), archs
``cmlm_*``. It *is* :class:`HRTTransformerModel` -- the same pre-norm encoder, the same decoder
run in its non-causal (CMLM) mode, the same AT-checkpoint loading -- plus a length
predictor, so the HRT paper's appendix-E improvements are options of this baseline:

* fine-tuning from an AT checkpoint of the same shape (fairseq's ``--finetune-from-model``);
  the weights an AT checkpoint lacks (the length predictor and, with RPR, the relative keys)
  start fresh and are listed in a warning;
* key-only relative positions in the decoder: ``--decoder-rpr-window 16`` (the default here is
  0, vanilla Mask-Predict);
* MixDistill: the task's ``--distill-data`` / ``--p-raw``.

Train with ``--task hrt_translation --hrt-mode cmlm --criterion hrt_loss``: the task builds the
CMLM samples (``chunking.cmlm_sample``: target ``y_1..y_N </s>`` at positions ``1..N+1`` with
random tokens masked, ``</s>`` visible) and the criterion adds the length loss. Decode with
``fairseq-generate --iter-decode-max-iter I --iter-decode-with-beam l``
(:class:`fairseq_hrt.generation.mask_predict.MaskPredictGenerator`).

Length predictor, as in fairseq's NAT models: the encoder states, mean-pooled over the real
(non-padding) source tokens, are multiplied with an ``embed_length`` matrix to give logits over
the target lengths ``0..LENGTH_CLASSES-1`` (N = target tokens without ``</s>``). There are 256
classes, as in fairseq, rather than ``--max-target-positions`` many: decoding never exceeds
``--max-len-b`` (L = 200 in the papers) and longer training targets are clamped to 255.
"""

import logging

import torch.nn.functional as F
from fairseq.models import register_model, register_model_architecture
from torch import Tensor, nn

from fairseq_hrt.models.hrt_transformer import (
    HRTTransformerModel,
    check_dictionary_compatible,
    fill_missing_hrt_keys,
    hrt_base_architecture,
    hrt_mini,
    hrt_small,
    hrt_tiny,
)
from fairseq_hrt.models.kinds import MASK_PREDICT, ModelFamily, declare

logger = logging.getLogger(__name__)

LENGTH_CLASSES = 256
DEFAULT_LENGTH_LOSS_FACTOR = 0.1


@register_model("cmlm_transformer_hrt")
@declare(ModelFamily(MASK_PREDICT, left_to_right=False, non_causal=True, length_predictor=True))
class CMLMTransformerModel(HRTTransformerModel):
    """Mask-Predict CMLM with a length predictor (``--arch cmlm_*``)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument(
            "--length-loss-factor",
            type=float,
            metavar="F",
            help="weight of the target-length loss relative to the token loss, as in fairseq's "
            f"NAT models (per-sentence length NLL against per-token loss; default {DEFAULT_LENGTH_LOSS_FACTOR})",
        )

    @classmethod
    def build_model(cls, args, task):
        cmlm_base_architecture(args)
        return super().build_model(args, task)

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        self.length_loss_factor = args.length_loss_factor
        dim = args.encoder_embed_dim
        self.embed_length = nn.Embedding(LENGTH_CLASSES, dim)
        nn.init.normal_(self.embed_length.weight, mean=0.0, std=dim**-0.5)

    def forward_length(self, encoder_out, normalize: bool = True) -> Tensor:
        """``(B, LENGTH_CLASSES)`` float log-probabilities (``normalize``) or logits of the
        target length N, from the mean of the encoder states over the real source tokens.

        Pooling and logits are computed in float so the same numbers come out under fp16.
        """
        enc = encoder_out["encoder_out"][0].float()  # T x B x C
        padding = encoder_out["encoder_padding_mask"]
        if len(padding) > 0:
            keep = (~padding[0]).transpose(0, 1).unsqueeze(-1).to(enc)  # T x B x 1
        else:
            keep = enc.new_ones(enc.size(0), enc.size(1), 1)
        pooled = (enc * keep).sum(dim=0) / keep.sum(dim=0).clamp(min=1.0)
        logits = F.linear(pooled, self.embed_length.weight.float())
        return F.log_softmax(logits, dim=-1) if normalize else logits

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """Accept AT (and HRT) checkpoints of the same shape: the length predictor they lack
        keeps its fresh values and, with ``--decoder-rpr-window > 0``, the relative keys start
        at zero (see :func:`fill_missing_hrt_keys`); the new tensors are listed in one warning."""
        check_dictionary_compatible(self, state_dict)
        new_keys = fill_missing_hrt_keys(self, state_dict)
        if "embed_length.weight" not in state_dict:
            state_dict["embed_length.weight"] = self.embed_length.weight.detach().clone()
            new_keys.append("embed_length.weight")
        if new_keys:
            logger.warning(
                "initialising a Mask-Predict model from a checkpoint without a length predictor "
                "(an AT or HRT checkpoint): %d new parameter tensor(s) (the length predictor freshly "
                "initialised, relative keys at zero): %s",
                len(new_keys),
                ", ".join(new_keys),
            )
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


def _cmlm_defaults(args):
    # vanilla Mask-Predict has no relative positions; appendix E adds them as an option
    args.decoder_rpr_window = getattr(args, "decoder_rpr_window", 0)
    args.length_loss_factor = getattr(args, "length_loss_factor", DEFAULT_LENGTH_LOSS_FACTOR)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_transformer_hrt")
def cmlm_base_architecture(args):
    """6-6 Transformer-base (d = 512, FFN 2048, 8 heads), pre-norm: Mask-Predict's shape."""
    _cmlm_defaults(args)
    hrt_base_architecture(args)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_base")
def cmlm_base(args):
    cmlm_base_architecture(args)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_small")
def cmlm_small(args):
    """The shape of ``hrt_small`` / ``at_small`` (d = 256, 6-1), so it fine-tunes from an
    ``at_small`` checkpoint (appendix E) and runs on the CPU benchmark beside them."""
    _cmlm_defaults(args)
    hrt_small(args)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_small_d6")
def cmlm_small_d6(args):
    """``cmlm_small`` with Mask-Predict's 6-layer decoder (d = 256, 6-6); fine-tunes from an
    ``at_small`` trained with ``--decoder-layers 6``."""
    args.decoder_layers = getattr(args, "decoder_layers", 6)
    cmlm_small(args)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_mini")
def cmlm_mini(args):
    """The shape of ``hrt_mini`` / ``at_mini`` (d = 128, 3-1)."""
    _cmlm_defaults(args)
    hrt_mini(args)


@register_model_architecture("cmlm_transformer_hrt", "cmlm_tiny")
def cmlm_tiny(args):
    """Test-sized shape, the same as ``hrt_tiny`` / ``at_tiny``."""
    _cmlm_defaults(args)
    hrt_tiny(args)
