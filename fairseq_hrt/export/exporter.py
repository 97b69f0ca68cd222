"""Export a model into a folder that ONNX Runtime decodes (``fairseq-hrt-export``).

The folder (format :data:`FORMAT`, version :data:`VERSION`) holds:

* ``encoder.onnx`` (:class:`~fairseq_hrt.export.graphs.EncoderGraph`),
* ``step.onnx``, ``step_tokens.onnx`` and ``step_top.onnx``
  (:class:`~fairseq_hrt.export.graphs.StepGraph`: the greedy choice, the same without its score
  for searches that read none, and the ``k`` best for beam search with ``k`` an input),
* ``greedy.onnx`` (AT and HRT models): the greedy search (and HRT's Skip-AT) as one ONNX ``Loop``
  over :class:`~fairseq_hrt.export.graphs.GreedyLoopBody` (:mod:`fairseq_hrt.export.loop`), which
  the runtime runs for batches of few rows,
* ``parallel.onnx`` (:class:`~fairseq_hrt.export.graphs.ParallelGraph`, HRT models: stage II),
* with ``restricted`` graphs (``*_restricted.onnx``) the same with the output rows as inputs (shortlists),
* ``weights.bin``: every graph's weights, each stored once (:func:`~fairseq_hrt.export.folder.share_weights`),
* ``output_weight.npy`` (and ``output_bias.npy``): the output layer's rows, for shortlists,
* ``dict.<src>.txt`` / ``dict.<tgt>.txt``, the SentencePiece model when there is one, and
* ``config.json``: what the runtime (:mod:`hrt_runtime`) needs -- special symbols, the symbols a
  search never produces, ``<s_k>`` ids, the model's trained chunk sizes, shapes, file names
  and the SHA-256 of the model's parameters (the cache key of ``--decoder-engine onnxruntime``).

Shapes are dynamic in batch and length. What cannot be exported is refused in one message
(:func:`unsupported`). :func:`export_model` checks and freezes the model, traces the graphs
(:mod:`.tracing`), stores their weights once, writes the folder's other files and its config,
and moves the folder in whole (:mod:`.folder`).
"""

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import warnings
from typing import Dict, List, Optional

import numpy as np
import torch
from fairseq import checkpoint_utils

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.export.folder import CONFIG, WEIGHTS, finish, share_weights, stamp_graphs, temporary_folder
from fairseq_hrt.export.tracing import OPSET, Examples, make_examples, trace_graphs
from fairseq_hrt.models.cmlm_transformer import CMLMTransformerModel
from fairseq_hrt.models.kinds import family_of, unwrap
from fairseq_hrt.passes.decoder_pass import DecoderPass, unplanned_modules
from fairseq_hrt.passes.search_rules import banned_symbols
from fairseq_hrt.symbols import find_sentencepiece_model
from hrt_runtime.integrity import FILES, OUTPUT_BIAS, OUTPUT_WEIGHT
from hrt_runtime.model import FORMAT, VERSION  # the runtime reads what this writes: defined once

logger = logging.getLogger(__name__)


def unsupported(model) -> List[str]:
    """Why ``model`` cannot be exported (empty: it can)."""
    model = unwrap(model)
    try:
        family = family_of(model)  # an undeclared model class is refused by name
    except ValueError as e:
        return [str(e)]
    reasons = []
    if family.length_predictor and type(model).forward_length is not CMLMTransformerModel.forward_length:
        # EncoderGraph writes CMLM's predictor: embed_length over the mean of the encoder states
        reasons.append(
            f"{type(model).__name__}.forward_length: the exported encoder computes CMLMTransformerModel's length "
            "predictor only"
        )
    decoder = model.decoder
    unknown = unplanned_modules(decoder, "decoder") + unplanned_modules(model.encoder, "encoder")
    if unknown:
        reasons.append(f"module(s) the exported graphs do not know: {', '.join(unknown)}")
    reasons += [reason for reason, bad in DecoderPass._unsupported(decoder).items() if bad]
    weight = getattr(decoder.output_projection, "weight", None)
    if not isinstance(weight, torch.Tensor):
        reasons.append(
            "a quantized model (--quantize int8): export the float checkpoint; ONNX Runtime quantizes it itself"
        )
    return reasons


def check_exportable(model):
    reasons = unsupported(model)
    if reasons:
        raise RefusedOptions("cannot export this model to ONNX: " + "; ".join(reasons))


def parameters_sha256(model) -> str:
    """SHA-256 over the model's structure (its module tree: layers, sizes, kinds) and its
    parameters and buffers (names, shapes, bytes): the content of its checkpoint as far as
    decoding is concerned. The structure counts: tied layers (``--decoder-tie-layers``) share
    their tensors, so two tied layers have the state dict of one. Floating-point tensors are
    hashed as float32 on the CPU, as they are exported: a model decoded in fp16 or on a GPU has
    the key of its export (which is traced from a float32 CPU copy)."""
    digest = hashlib.sha256()
    digest.update(repr(unwrap(model)).encode())
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        tensor = tensor.detach().cpu()
        tensor = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    digest.update(f"{FORMAT}-{VERSION}".encode())
    return digest.hexdigest()


def frozen_copy(model):
    """A float32 CPU copy of ``model`` in inference mode, without gradients: what is traced
    (the model itself is not changed)."""
    model = copy.deepcopy(unwrap(model))
    # not model.eval(): fairseq's make_generation_fast_ (run by prepare_for_inference_) replaces
    # the model's train() by a function that returns None
    model.float().cpu().requires_grad_(False)
    for module in model.modules():
        module.training = False
    return model


def write_side_files(model, task, folder: str, sentencepiece_model: Optional[str]):
    """The folder's files beside the graphs: the output rows, the dictionaries and the
    SentencePiece model; returns ``(source language, target language, SentencePiece file)``."""
    projection = model.decoder.output_projection
    # the output rows as arrays: a shortlist gathers its rows from them once per batch (the only
    # files config.json does not name: hrt_runtime.integrity.AUXILIARY)
    np.save(os.path.join(folder, OUTPUT_WEIGHT), projection.weight.float().numpy())
    if getattr(projection, "bias", None) is not None:
        np.save(os.path.join(folder, OUTPUT_BIAS), projection.bias.float().numpy())
    src_lang, tgt_lang = (
        getattr(task.cfg, "source_lang", None) or "src",
        getattr(task.cfg, "target_lang", None) or "tgt",
    )
    task.source_dictionary.save(os.path.join(folder, f"dict.{src_lang}.txt"))
    task.target_dictionary.save(os.path.join(folder, f"dict.{tgt_lang}.txt"))
    spm = None
    if sentencepiece_model:
        spm = "sentencepiece.model"
        shutil.copyfile(sentencepiece_model, os.path.join(folder, spm))
    return src_lang, tgt_lang, spm


def folder_config(model, task, ex: Examples, files: Dict[str, str], src_lang: str, tgt_lang: str, spm) -> Dict:
    """``config.json``'s content but the files' list (:func:`~fairseq_hrt.export.folder.finish`
    adds it): what the runtime needs to decode with the graphs ``files``."""
    family = family_of(model)
    tgt_dict, src_dict = task.target_dictionary, task.source_dictionary
    chunk_start = {int(k): int(v) for k, v in getattr(task, "chunk_start_idx", {}).items()}
    max_positions = model.max_positions()
    return {
        "format": FORMAT,
        "version": VERSION,
        "kind": family.kind,
        "parameters_sha256": parameters_sha256(model),
        "layers": ex.layers,
        "heads": ex.heads,
        "head_dim": ex.head_dim,
        "embed_dim": int(model.decoder.output_projection.weight.size(1)),
        "vocab_size": len(tgt_dict),
        "max_target_positions": ex.max_positions,
        "relative_window": ex.window,
        "recurrent": bool(ex.recurrent),
        "cell_dim": int(ex.cell_dim),
        "length_classes": int(model.embed_length.weight.size(0)) if ex.length else 0,
        "max_source_positions": int(max_positions[0]) if isinstance(max_positions, tuple) else ex.max_positions,
        "pad": tgt_dict.pad(),
        "eos": tgt_dict.eos(),
        "unk": tgt_dict.unk(),
        "bos": tgt_dict.bos(),
        "source_eos": src_dict.eos(),
        "source_pad": src_dict.pad(),
        "source_unk": src_dict.unk(),
        "mask": getattr(task, "mask_idx", None),
        "chunk_start": {str(k): v for k, v in chunk_start.items()},
        "trained_chunk_sizes": sorted(int(k) for k in model.get_trained_chunk_sizes()) if family.chunk_sizes else [],
        "banned": banned_symbols(task, model),
        "source_lang": src_lang,
        "target_lang": tgt_lang,
        "source_dictionary": f"dict.{src_lang}.txt",
        "target_dictionary": f"dict.{tgt_lang}.txt",
        "sentencepiece_model": spm,
        "graphs": files,
        "weights": WEIGHTS,
        "opset": OPSET,
        "exported_with": {"torch": torch.__version__},
    }


def export_model(model, task, out_dir: str, sentencepiece_model: Optional[str] = None, restricted: bool = True) -> Dict:
    """Write the folder of the module's docstring for a loaded ``model`` of ``task`` (its
    dictionaries); returns the config. The model is not changed (a frozen copy is traced)."""
    check_exportable(model)
    model = frozen_copy(model)
    os.makedirs(out_dir, exist_ok=True)
    tmp = temporary_folder(out_dir, ".export-")
    ex = make_examples(model, task.source_dictionary, task.target_dictionary)
    files = trace_graphs(ex, tmp, restricted)
    share_weights(tmp, list(files.values()))
    languages = write_side_files(model, task, tmp, sentencepiece_model)
    config = folder_config(model, task, ex, files, *languages)
    stamp_graphs(tmp, config)
    finish(tmp, out_dir, config)
    logger.info("exported %s model (%s) to %s", config["kind"], ", ".join(files.values()), out_dir)
    return config


@contextlib.contextmanager
def _quiet_root_logger():
    """ONNX Runtime's quantizer logs every matrix product it skips on the root logger at INFO."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


INT8_SCALES = ("channel", "tensor")  # the first: the default


def quantize_folder(folder: str, out_dir: str, scales: str = INT8_SCALES[0]) -> Dict:
    """An int8 copy of an exported folder: ONNX Runtime's dynamic quantization of every graph's
    matrix products with constant weights (int8 weights, activations quantized per call), the
    rest copied. ``scales``: one weight scale per output column (``"channel"``, the default: on a
    trained model it keeps BLEU where one scale per matrix, ``"tensor"``, lost more; see
    benchmarks/results/int8-quality-cpu) or per matrix. Returns its config (``"int8": true``,
    ``"int8_scales"``)."""
    if scales not in INT8_SCALES:
        raise ValueError(f"int8 scales {scales!r}: one of {', '.join(INT8_SCALES)}")
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415 - optional: onnxruntime

    with open(os.path.join(folder, CONFIG)) as f:
        config = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    tmp = temporary_folder(out_dir, ".int8-")
    graphs = set(config["graphs"].values())
    # the export's own files only: one left in the folder by an earlier export would be listed,
    # and the runtime refuses a listed file that config.json does not name
    for name in sorted(config.get(FILES) or os.listdir(folder)):
        source = os.path.join(folder, name)
        if name in graphs:
            with warnings.catch_warnings(), _quiet_root_logger():
                warnings.simplefilter("ignore")
                # EnableSubgraph: the greedy loop's body (greedy.onnx) is quantized as the step is
                quantize_dynamic(
                    source,
                    os.path.join(tmp, name),
                    weight_type=QuantType.QInt8,
                    op_types_to_quantize=["MatMul", "Gemm"],
                    per_channel=scales == "channel",
                    extra_options={"EnableSubgraph": True},
                )
        elif name not in (CONFIG, WEIGHTS) and os.path.isfile(source):
            shutil.copyfile(source, os.path.join(tmp, name))
    share_weights(tmp, sorted(graphs))
    config = dict(config, int8=True, int8_scales=scales)
    stamp_graphs(tmp, config)  # quantization may drop a graph's metadata
    # the list made again, of the int8 graphs and weights.bin (not the float folder's, which the
    # runtime once exempted them from, and with them any weights.bin beside an edited "int8")
    finish(tmp, out_dir, config)
    return config


def export_checkpoint(
    checkpoint: str,
    out_dir: str,
    data: Optional[str] = None,
    sentencepiece_model: Optional[str] = None,
    restricted: bool = True,
    int8: bool = False,
    int8_scales: str = "channel",
) -> Dict:
    """Load a checkpoint as ``fairseq-generate`` does (``data``: the data-bin folder with its
    dictionaries, default the one it was trained on) and :func:`export_model` it (``int8``: then
    :func:`quantize_folder` it in place, with ``int8_scales``)."""
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"no checkpoint {checkpoint}")
    if sentencepiece_model and not os.path.isfile(sentencepiece_model):
        raise FileNotFoundError(f"--sentencepiece-model {sentencepiece_model}: no such file")
    # the plugin's task and models that the checkpoint names are registered by fairseq_hrt's
    # __init__, which importing this module ran
    overrides = {"data": data} if data else {}
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides=overrides)
    spm = sentencepiece_model or find_sentencepiece_model(data or cfg.task.data, os.path.dirname(checkpoint))
    config = export_model(models[0], task, out_dir, sentencepiece_model=spm, restricted=restricted)
    if int8:
        config = quantize_folder(out_dir, out_dir, int8_scales)
    return config


def cli_main(argv=None):
    p = argparse.ArgumentParser(
        prog="fairseq-hrt-export",
        description="Export an AT, HRT or Mask-Predict checkpoint into a folder that ONNX Runtime decodes "
        "(--decoder-engine onnxruntime, or hrt-translate without PyTorch).",
    )
    p.add_argument("checkpoint", help="a checkpoint of fairseq-train (--task hrt_translation)")
    p.add_argument("out_dir", help="the folder to write (created; files of an earlier export are replaced)")
    p.add_argument("--data", help="the data-bin folder with the dictionaries (default: the one of training)")
    p.add_argument("--sentencepiece-model", help="the SentencePiece model of the data (default: found beside the data)")
    p.add_argument(
        "--no-restricted", action="store_true", help="skip the graphs with the output rows as inputs (shortlists)"
    )
    p.add_argument(
        "--int8", action="store_true", help="quantize the graphs to int8 (ONNX Runtime's dynamic quantization)"
    )
    p.add_argument(
        "--int8-scales",
        choices=INT8_SCALES,
        help="with --int8: one weight scale per output column (channel, the default) or per matrix (tensor)",
    )
    a = p.parse_args(argv)
    if a.int8_scales and not a.int8:
        p.error("--int8-scales is an option of --int8")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    try:
        config = export_checkpoint(
            a.checkpoint,
            a.out_dir,
            a.data,
            a.sentencepiece_model,
            restricted=not a.no_restricted,
            int8=a.int8,
            int8_scales=a.int8_scales or "channel",
        )
    except (ValueError, FileNotFoundError) as e:
        p.exit(2, f"fairseq-hrt-export: error: {e}\n")
    size = sum(os.path.getsize(os.path.join(a.out_dir, f)) for f in os.listdir(a.out_dir))
    print(
        f"{a.out_dir}: {config['kind']} model{' (int8)' if config.get('int8') else ''}, "
        f"{len(config['graphs'])} graphs, "
        f"{size / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    cli_main()
