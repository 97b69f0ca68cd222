"""``--quantize int8``: dynamic int8 quantization of a model's linear layers, applied once to a
model loaded for decoding, after its weights are loaded (the task does it before the first
generator of a model it loaded from a checkpoint: ``HRTTranslationTask.build_decoding``); a
strategy or an engine building a generator never changes a model."""

import logging

import torch
from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.engines import ENGINES
from fairseq_hrt.generation.options import DEFAULT_DECODER_ENGINE, QUANTIZE_CHOICES

logger = logging.getLogger(__name__)


def is_quantized(model) -> bool:
    """Whether any of ``model``'s modules is a quantized one (``torch.ao`` dynamic int8)."""
    return any("quantized" in type(m).__module__ for m in model.modules())


def quantize_int8(model):
    """Dynamic int8 quantization of the linear layers that are called as modules.

    The encoder's self-attention projections are left in float: fairseq's
    ``MultiheadAttention`` hands their weights to ``F.multi_head_attention_forward`` on its
    fast path (full sequences, no cache), which needs float weight tensors.
    """
    if any(p.is_cuda for p in model.parameters()):
        raise RefusedOptions(
            "--quantize int8 is dynamic int8 quantization for CPU decoding; drop it on a GPU "
            "(use --fp16 there) or decode with --cpu"
        )

    names = {
        name: default_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not (name.startswith("encoder.") and ".self_attn." in name)
    }
    quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)
    logger.info("--quantize int8: %d linear layers quantized (dynamic int8)", len(names))
    return model


def engine_quantizes_itself(engine: str) -> bool:
    """Whether ``--decoder-engine`` quantizes what it runs itself (``onnxruntime``: its exported
    graphs), so the loaded PyTorch model must stay in float."""
    found = ENGINES.get(str(engine))
    return found is not None and found.quantizes_itself


def prepare_for_decoding(model, quantize: str, engine: str = DEFAULT_DECODER_ENGINE):
    """What loading a model for decoding does with ``--quantize``: nothing for ``none``,
    :func:`quantize_int8` once for ``int8`` (a model quantized already stays as it is); nothing
    either for an engine that quantizes itself (:func:`engine_quantizes_itself`)."""
    quantize = str(quantize)
    if quantize not in QUANTIZE_CHOICES:
        raise RefusedOptions(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if quantize == "int8" and not is_quantized(model) and not engine_quantizes_itself(engine):
        quantize_int8(model)
    return model


def check_quantization(models, quantize: str, engine: str = DEFAULT_DECODER_ENGINE):
    """A generator asked for ``--quantize int8`` of a model loaded in float (or the other way
    round: a quantized model without it) says how to load it instead."""
    quantize = str(quantize)
    if quantize not in QUANTIZE_CHOICES:
        raise RefusedOptions(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if engine_quantizes_itself(engine):
        if any(is_quantized(m) for m in models):
            raise RefusedOptions(
                f"--decoder-engine {engine} quantizes its own graphs (--quantize int8) and needs the "
                f"model loaded in float; load it with --decoder-engine {engine} (the PyTorch model "
                "then stays in float)"
            )
        return
    if quantize == "int8" and not all(is_quantized(m) for m in models):
        raise RefusedOptions(
            "--quantize int8 is applied when the model is loaded (fairseq-generate / fairseq-interactive "
            "--quantize int8, fairseq_hrt.from_pretrained(..., quantize='int8'), or "
            "fairseq_hrt.generation.quantize.prepare_for_decoding(model, 'int8')); this model was loaded in float"
        )
