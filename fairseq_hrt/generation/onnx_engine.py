"""``--decoder-engine onnxruntime``: decoding over ONNX Runtime sessions of the exported model.

The loaded model is exported on first use (:func:`fairseq_hrt.export.exporter.export_model`)
into a cache folder keyed by the SHA-256 of its structure and parameters (``$FAIRSEQ_HRT_ONNX_CACHE``,
default ``~/.cache/fairseq-hrt/onnx``), so a checkpoint is exported once per machine; a
generator whose model's weights changed since (:func:`~fairseq_hrt.passes.decoder_pass.weights_version`:
a model validated with this engine while it trains) exports them again at its next batch.
The search is :mod:`hrt_runtime.search`, on numpy arrays: the same code the deployed runtime
(``hrt-translate``) runs. It serves left-to-right search (AT, HRT's AT mode), HRT's two
stages and Mask-Predict as a whole; ONNX Runtime uses ``torch.get_num_threads()`` threads (what
``OMP_NUM_THREADS`` or the benchmark's ``--threads`` set).
"""

import logging
import os
import threading
from typing import List

import torch

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.export import exporter
from fairseq_hrt.generation.engines import DecoderEngine, register_engine
from fairseq_hrt.generation.search_generator import SearchGenerator
from fairseq_hrt.models.kinds import unwrap
from fairseq_hrt.passes.decoder_pass import weights_version
from hrt_runtime.model import VERSION, ExportedModel, read_config

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def cache_root() -> str:
    return os.environ.get("FAIRSEQ_HRT_ONNX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fairseq-hrt", "onnx"
    )


def _cached(folder: str, digest: str, int8: bool) -> bool:
    try:
        config = read_config(folder)
    except (FileNotFoundError, ValueError):
        return False
    # an export of an earlier version is made again: it would decode, without the newer graphs;
    # so is an int8 copy of other weight scales than quantize_folder's default (one made before it)
    scales = config.get("int8_scales") == exporter.INT8_SCALES[0] if int8 else True
    same = config["parameters_sha256"] == digest and bool(config.get("int8")) == int8
    return same and scales and config["version"] == VERSION


def exported_folder(model, task, int8: bool = False) -> str:
    """The cache folder of ``model``'s export (``int8``: its int8 copy), made if missing."""
    exporter.check_exportable(model)
    digest = exporter.parameters_sha256(model)
    folder = os.path.join(cache_root(), digest[:32])
    with _LOCK:
        if not _cached(folder, digest, False):
            logger.info("exporting the model to ONNX (once per checkpoint): %s", folder)
            exporter.export_model(model, task, folder)
        if not int8:
            return folder
        quantized = folder + "-int8"
        if not _cached(quantized, digest, True):
            logger.info("quantizing the exported graphs to int8 (once per checkpoint): %s", quantized)
            exporter.quantize_folder(folder, quantized)
        return quantized


def given_folder(folder: str, model, int8: bool) -> str:
    """``--onnx-model FOLDER``, checked against the loaded model: the same parameters (SHA-256)
    and the same precision as ``--quantize`` asks for."""
    config = read_config(folder)
    if config["parameters_sha256"] != exporter.parameters_sha256(model):
        raise RefusedOptions(
            f"--onnx-model {folder} was exported from another checkpoint than --path's (the SHA-256 of "
            "their parameters differ); export this checkpoint, or drop --onnx-model to export it on first use"
        )
    if bool(config.get("int8")) != int8:
        raise RefusedOptions(
            f"--onnx-model {folder} is {'int8' if config.get('int8') else 'float'} but --quantize is "
            f"{'int8' if int8 else 'none'}; export with{'out' if not int8 else ''} --int8 or change --quantize"
        )
    return folder


class OnnxRuntimeGenerator(SearchGenerator):
    """The one search (:class:`SearchGenerator`) over the exported model's ONNX Runtime
    sessions (:class:`hrt_runtime.model.ExportedModel`): the code the deployed runtime runs."""

    engine = "onnxruntime"

    def __init__(self, ctx, config, banned: List[int], **kwargs):
        model = unwrap(ctx.model)
        try:
            import onnxruntime  # noqa: F401,PLC0415 - optional: onnxruntime
        except ImportError as e:
            raise RefusedOptions(
                f"--decoder-engine onnxruntime needs the onnxruntime and onnx packages ({e}); "
                "pip install -r requirements.txt"
            ) from e
        self.model, self.task = model, ctx.task
        self.given, self.int8 = ctx.options.onnx_model, ctx.options.quantize == "int8"
        self.exported_version = weights_version(model)
        runtime = self._runtime()
        super().__init__(runtime, ctx.task.target_dictionary, config, banned, ctx.shortlist, **kwargs)
        self.runtime = runtime

    def _runtime(self) -> ExportedModel:
        if self.given:
            folder = given_folder(self.given, self.model, self.int8)
        else:
            folder = exported_folder(self.model, self.task, int8=self.int8)
        return ExportedModel(folder, threads=torch.get_num_threads())

    def encode(self, net_input):
        # the graphs hold the weights as constants: a model whose weights changed since (one
        # being trained, validated with this engine) is exported again (or --onnx-model refused)
        version = weights_version(self.model)
        if version != self.exported_version:
            self.runtime = self.backend = self._runtime()
            self.exported_version = version
        return self.runtime.encode(net_input["src_tokens"].cpu().numpy())


@register_engine("onnxruntime")
class OnnxRuntimeEngine(DecoderEngine):
    """The exported model in ONNX Runtime, searched by :mod:`hrt_runtime.search` (shortlists:
    the output rows gathered once per batch and fed to the step; ``--quantize int8``: the graphs
    quantized by ONNX Runtime, the PyTorch model stays in float)."""

    supports_shortlist = True
    quantizes_itself = True  # --quantize int8: ONNX Runtime's dynamic quantization of the exported graphs
    runs_mask_predict = True

    def unsupported(self, options):
        used = list(options.sequence_generator_only)
        if options.temperature != 1.0:
            used.append("--temperature")
        used += options.stage2_options_used()
        if options.print_step:
            used.append("--print-step")
        return used + super().unsupported(options)

    def unsupported_model(self, model):
        return exporter.unsupported(model)

    def left_to_right(self, ctx, config, banned):
        if len(ctx.models) != 1:
            raise RefusedOptions("--decoder-engine onnxruntime decodes a single model (no ensembles)")
        return OnnxRuntimeGenerator(ctx, config, banned)

    def mask_predict(self, ctx):
        options = ctx.options
        return OnnxRuntimeGenerator(
            ctx,
            options.search_config,
            ctx.banned(),
            iterations=options.iter_decode_max_iter,
            length_beam=options.iter_decode_with_beam,
        )

    def two_stage(self, ctx, chunk_size):
        return OnnxRuntimeGenerator(
            ctx, ctx.options.search_config, ctx.banned(), chunk_size=chunk_size, b_nat=ctx.options.b_nat
        )
