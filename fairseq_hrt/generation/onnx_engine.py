"""``--decoder-engine onnxruntime``: decoding over ONNX Runtime sessions of the exported model.

The loaded model is exported on first use (:func:`fairseq_hrt.export.exporter.export_model`)
into a cache folder keyed by the SHA-256 of its structure and parameters (``$FAIRSEQ_HRT_ONNX_CACHE``,
default ``~/.cache/fairseq-hrt/onnx``), so a checkpoint is exported once per machine.
The search is :mod:`hrt_runtime.search`, on numpy arrays: the same code the deployed runtime
(``hrt-translate``) runs. It serves left-to-right search (AT, HRT's AT mode), HRT's two
stages and Mask-Predict as a whole; ONNX Runtime uses ``torch.get_num_threads()`` threads (what
``OMP_NUM_THREADS`` or the benchmark's ``--threads`` set).
"""
import logging
import os
import threading
from typing import Dict, List, Optional

import numpy as np
import torch

from fairseq_hrt.generation.engines import DecoderEngine, register_engine
from fairseq_hrt.generation.chunk_size import chunk_sizes_of
from fairseq_hrt.generation.strategies import reject_unsupported_inputs, to_fairseq
from fairseq_hrt.models.kinds import HRT, MASK_PREDICT, model_kind, unwrap

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def cache_root() -> str:
    return os.environ.get("FAIRSEQ_HRT_ONNX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fairseq-hrt", "onnx")


def _cached(folder: str, digest: str, int8: bool) -> bool:
    from hrt_runtime.model import read_config

    try:
        config = read_config(folder)
    except (FileNotFoundError, ValueError):
        return False
    return config["parameters_sha256"] == digest and bool(config.get("int8")) == int8


def exported_folder(model, task, int8: bool = False) -> str:
    """The cache folder of ``model``'s export (``int8``: its int8 copy), made if missing."""
    from fairseq_hrt.export.exporter import check_exportable, export_model, parameters_sha256, quantize_folder

    check_exportable(model)
    digest = parameters_sha256(model)
    folder = os.path.join(cache_root(), digest[:32])
    with _LOCK:
        if not _cached(folder, digest, False):
            logger.info("exporting the model to ONNX (once per checkpoint): %s", folder)
            export_model(model, task, folder)
        if not int8:
            return folder
        quantized = folder + "-int8"
        if not _cached(quantized, digest, True):
            logger.info("quantizing the exported graphs to int8 (once per checkpoint): %s", quantized)
            quantize_folder(folder, quantized)
        return quantized


def given_folder(folder: str, model, int8: bool) -> str:
    """``--onnx-model FOLDER``, checked against the loaded model: the same parameters (SHA-256)
    and the same precision as ``--quantize`` asks for."""
    from fairseq_hrt.export.exporter import parameters_sha256
    from hrt_runtime.model import read_config

    config = read_config(folder)
    if config["parameters_sha256"] != parameters_sha256(model):
        raise ValueError(f"--onnx-model {folder} was exported from another checkpoint than --path's (the SHA-256 of "
                         "their parameters differ); export this checkpoint, or drop --onnx-model to export it on first use")
    if bool(config.get("int8")) != int8:
        raise ValueError(f"--onnx-model {folder} is {'int8' if config.get('int8') else 'float'} but --quantize is "
                         f"{'int8' if int8 else 'none'}; export with{'out' if not int8 else ''} --int8 or change --quantize")
    return folder


class OnnxRuntimeGenerator:
    """fairseq's ``generate(models, sample, bos_token=...)`` over :mod:`hrt_runtime.search`:
    left to right (``chunk_size`` 1 or a start symbol) or HRT's two stages (``chunk_size``: an
    int or a function of the source lengths, as :class:`HRTGenerator` takes it)."""

    def __init__(self, ctx, search, banned: List[int], chunk_size=1, b_nat: int = 1, iterations: int = 0,
                 length_beam: int = 1):
        from hrt_runtime.model import ExportedModel

        self.model = unwrap(ctx.model)
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--decoder-engine onnxruntime needs the onnxruntime and onnx packages ({e}); "
                             "pip install -r requirements.txt") from e
        if ctx.options.onnx_model:
            folder = given_folder(ctx.options.onnx_model, self.model, ctx.options.quantize == "int8")
        else:
            folder = exported_folder(self.model, ctx.task, int8=ctx.options.quantize == "int8")
        self.runtime = ExportedModel(folder, threads=torch.get_num_threads())
        self.config = search  # a SearchOptions is the runtime's SearchConfig (temperature is refused)
        self.banned = list(banned)
        self.chunk_size = chunk_size
        self.b_nat = b_nat
        self.iterations, self.length_beam = iterations, length_beam  # Mask-Predict's I and l
        self.shortlist = ctx.shortlist
        tgt_dict = ctx.task.target_dictionary
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()  # fairseq-generate reads eos
        self.is_hrt = model_kind(self.model) == HRT
        self.last_vocab: Optional[torch.Tensor] = None

    @torch.no_grad()
    def generate(self, models, sample, bos_token: Optional[int] = None, **kwargs) -> List[List[Dict]]:
        from hrt_runtime.search import chunk_size_groups, hrt, left_to_right, mask_predict

        reject_unsupported_inputs("--decoder-engine onnxruntime", **kwargs)
        src_tokens = sample["net_input"]["src_tokens"]
        src = src_tokens.cpu().numpy()
        width = src.shape[1]
        encoded = self.runtime.encode(src)
        if self.runtime.kind == MASK_PREDICT:
            found = mask_predict(self.runtime, encoded, src, self.iterations, self.length_beam, self.config.max_len_a,
                                 self.config.max_len_b, self.banned, rows=self.rows_of(src_tokens))
            return to_fairseq(found, src_tokens.device)
        if bos_token is not None or not self.is_hrt:
            found = left_to_right(self.runtime, encoded, width, self.config, self.banned, start=bos_token,
                                  rows=self.rows_of(src_tokens))
            return to_fairseq(found, src_tokens.device)
        per_row = chunk_sizes_of(self.chunk_size, src_tokens, self.pad)
        results: List = [None] * len(per_row)
        for k, index in chunk_size_groups(per_row):
            part, part_src = encoded, src_tokens
            if index.size < len(per_row):  # a group decodes over its own sentences' candidates, as lean's HRTGenerator
                part = encoded.select(index)
                part_src = src_tokens.index_select(0, torch.from_numpy(index).to(src_tokens.device))
            found = hrt(self.runtime, part, width, self.config, k, self.banned, b_nat=self.b_nat, rows=self.rows_of(part_src))
            for i, hypos in zip(index.tolist(), found):
                results[i] = hypos
        return to_fairseq(results, src_tokens.device)

    def rows_of(self, src_tokens):
        """The output rows of a batch: all, or its shortlist candidates (kept as ``last_vocab``)."""
        if self.shortlist is None:
            return self.runtime.rows(None)
        self.last_vocab = self.shortlist.candidates(src_tokens, self.pad)
        return self.runtime.rows(self.last_vocab.cpu().numpy())


@register_engine("onnxruntime")
class OnnxRuntimeEngine(DecoderEngine):
    """The exported model in ONNX Runtime, searched by :mod:`hrt_runtime.search` (shortlists:
    the output rows gathered once per batch and fed to the step; ``--quantize int8``: the graphs
    quantized by ONNX Runtime, the PyTorch model stays in float)."""

    supports_shortlist = True
    supports_compile = False
    supports_int8 = True
    quantizes_itself = True  # --quantize int8: ONNX Runtime's dynamic quantization of the exported graphs

    def unsupported(self, options):
        used = list(options.sequence_generator_only)
        if options.search.temperature != 1.0:
            used.append("--temperature")
        used += options.stage2_options_used()
        if options.print_step:
            used.append("--print-step")
        return used

    def unsupported_model(self, model):
        from fairseq_hrt.export.exporter import unsupported

        return unsupported(model)

    def left_to_right(self, ctx, search, banned, keep_encoder_out=False):
        if len(ctx.models) != 1:
            raise ValueError("--decoder-engine onnxruntime decodes a single model (no ensembles)")
        return OnnxRuntimeGenerator(ctx, search, banned)

    def mask_predict(self, ctx):
        used = self.unsupported(ctx.options)
        if used:
            raise ValueError(f"--decoder-engine onnxruntime does not support {', '.join(used)}")
        options = ctx.options
        return OnnxRuntimeGenerator(ctx, options.search, ctx.banned(), iterations=options.iter_decode_max_iter,
                                    length_beam=options.iter_decode_with_beam)

    def two_stage(self, ctx, chunk_size):
        return OnnxRuntimeGenerator(ctx, ctx.options.search, ctx.banned(), chunk_size=chunk_size, b_nat=ctx.options.b_nat)
