"""What kind of model a decoder is handed: the one place that decides.

Decoding strategies, the criterion, the task and the benchmarks ask these questions; they
answer from the model classes of this plugin (and fairseq's own ``transformer`` for AT
models), never from ``hasattr`` guesses spread over the code.
"""
from torch import nn

from fairseq_hrt.models.cmlm_transformer import CMLMTransformerModel
from fairseq_hrt.models.hrt_transformer import HRTTransformerModel

AT, HRT, MASK_PREDICT = "at", "hrt", "mask-predict"


def unwrap(model):
    """The model inside fairseq's and torch's training wrappers (``ModuleProxyWrapper``,
    ``DistributedDataParallel``: each holds it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def is_mask_predict(model) -> bool:
    """A CMLM model with a length predictor (``cmlm_*``), decoded by Mask-Predict."""
    return isinstance(unwrap(model), CMLMTransformerModel)


def is_hrt(model) -> bool:
    """An HRT model (``hrt_*``): one decoder with causal, Skip-AT and non-causal modes."""
    return isinstance(unwrap(model), HRTTransformerModel) and not is_mask_predict(model)


def model_kind(model) -> str:
    """``"hrt"``, ``"mask-predict"`` or ``"at"`` (every other left-to-right model: fairseq's
    ``transformer``, the ``at_*`` and ``*_ssru`` students)."""
    if is_mask_predict(model):
        return MASK_PREDICT
    if is_hrt(model):
        return HRT
    return AT
