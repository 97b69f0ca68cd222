"""Export a model into a folder that ONNX Runtime decodes (``fairseq-hrt-export``).

The folder (format :data:`FORMAT`, version :data:`VERSION`) holds:

* ``encoder.onnx`` (:class:`~fairseq_hrt.export.graphs.EncoderGraph`),
* ``step.onnx`` and ``step_top.onnx`` (:class:`~fairseq_hrt.export.graphs.StepGraph`: the greedy
  choice, and the ``k`` best for beam search with ``k`` an input),
* ``greedy.onnx`` (AT and HRT models): the greedy search (and HRT's Skip-AT) as one ONNX ``Loop``
  over :class:`~fairseq_hrt.export.graphs.GreedyLoopBody` (:mod:`fairseq_hrt.export.loop`), which
  the runtime runs for batches of few rows,
* ``parallel.onnx`` (:class:`~fairseq_hrt.export.graphs.ParallelGraph`, HRT models: stage II),
* with ``restricted`` graphs (``*_restricted.onnx``) the same with the output rows as inputs (shortlists),
* ``weights.bin``: every graph's weights, each stored once (:func:`share_weights`),
* ``output_weight.npy`` (and ``output_bias.npy``): the output layer's rows, for shortlists,
* ``dict.<src>.txt`` / ``dict.<tgt>.txt``, the SentencePiece model when there is one, and
* ``config.json``: what the runtime (:mod:`hrt_runtime`) needs -- special symbols, the symbols a
  search never produces, ``<s_k>`` ids, the model's trained chunk sizes, shapes, file names
  and the SHA-256 of the model's parameters (the cache key of ``--decoder-engine onnxruntime``).

Shapes are dynamic in batch and length. What cannot be exported is refused in one message
(:func:`unsupported`). Graphs are traced by ``torch.onnx.export``'s TorchScript exporter
(``dynamo=False``): the pinned torch has it, it needs no onnxscript, and it traces the plain
functions of the decoder pass in well under a second.
"""

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from typing import Dict, List, Optional

import numpy as np
import torch
from fairseq import checkpoint_utils

import fairseq_hrt  # noqa: F401  (registers the task and models)
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.export.graphs import EncoderGraph, GreedyLoopBody, ParallelGraph, StepGraph
from fairseq_hrt.export.loop import body_inputs, greedy_loop
from fairseq_hrt.models.cmlm_transformer import CMLMTransformerModel
from fairseq_hrt.models.kinds import family_of, unwrap
from fairseq_hrt.passes.decoder_pass import DecoderPass, decoder_pass, unplanned_modules
from fairseq_hrt.passes.search_rules import banned_symbols
from fairseq_hrt.symbols import find_sentencepiece_model
from hrt_runtime.integrity import FILES, FILES_INT8, OUTPUT_BIAS, OUTPUT_WEIGHT, list_files
from hrt_runtime.model import (  # the runtime reads what this writes: defined once
    DECLARED_KEY,
    FORMAT,
    VERSION,
    declared_of,
)

logger = logging.getLogger(__name__)

OPSET = 17
CONFIG = "config.json"


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


def _names(prefix: str, layers: int) -> List[str]:
    return [f"{prefix}_k{i}" for i in range(layers)] + [f"{prefix}_v{i}" for i in range(layers)]


def _constants_to_initializers(graph_model):
    """Move the tracer's ``Constant`` tensors (the planned weights it saw as constants) into the
    graph's initializers, where ONNX Runtime's quantization finds weights."""
    from onnx import numpy_helper  # noqa: PLC0415 - optional: onnx, for exporting

    graph = graph_model.graph
    for node in list(graph.node):
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = numpy_helper.to_array(node.attribute[0].t)
            if tensor.size > 1:  # shapes and scalars stay constants
                graph.initializer.append(numpy_helper.from_array(tensor, node.output[0]))
                graph.node.remove(node)


WEIGHTS = "weights.bin"


def share_weights(folder: str, graphs: List[str]):
    """Store every weight of the ``graphs`` once, in ``folder/weights.bin`` (ONNX external
    data, 64-byte aligned): the step, top-k, restricted and non-causal graphs hold the same
    planned weights, which each graph file would otherwise carry (a folder of several times the
    model's size)."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting
    from onnx import numpy_helper  # noqa: PLC0415 - optional: onnx, for exporting

    offsets: Dict[str, int] = {}
    with open(os.path.join(folder, WEIGHTS), "wb") as weights:
        for name in graphs:
            path = os.path.join(folder, name)
            graph_model = onnx.load(path)  # external data already there are read back in
            for init in graph_model.graph.initializer:
                array = numpy_helper.to_array(init)
                if array.size < 16:  # small constants stay inside the graph
                    continue
                data = array.tobytes()
                key = hashlib.sha1(data + str(array.dtype).encode() + str(array.shape).encode()).hexdigest()
                if key not in offsets:
                    weights.write(b"\0" * (-weights.tell() % 64))
                    offsets[key] = weights.tell()
                    weights.write(data)
                init.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data"):
                    init.ClearField(field)
                del init.external_data[:]
                for k, v in (("location", WEIGHTS), ("offset", str(offsets[key])), ("length", str(len(data)))):
                    entry = init.external_data.add()
                    entry.key, entry.value = k, v
                init.data_location = onnx.TensorProto.EXTERNAL
            onnx.save(graph_model, path)


def _temporary_folder(out_dir: str, prefix: str) -> str:
    """A new folder ``out_dir/<prefix><pid>-*`` where an export writes before its files move
    in, after removing those of exports whose process is gone (killed midway: nothing else
    would ever delete them)."""
    for name in os.listdir(out_dir):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return tempfile.mkdtemp(dir=out_dir, prefix=f"{prefix}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _k_as_input(graph_model):
    """Make the ``k`` of the step graph's TopK a graph input (``k``, int64 ``(1,)``): the
    tracer writes the Python int it saw as a constant, beam search needs ``2 x beam``."""
    from onnx import TensorProto, helper  # noqa: PLC0415 - optional: onnx, for exporting

    graph = graph_model.graph
    topk = [node for node in graph.node if node.op_type == "TopK"]
    if len(topk) != 1:
        raise RuntimeError(f"expected one TopK in the step graph, found {len(topk)}")
    constant = topk[0].input[1]
    topk[0].input[1] = "k"
    graph.input.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    # drop the constant that held the traced k if nothing else reads it
    if not any(constant in node.input for node in graph.node):
        for node in list(graph.node):
            if constant in node.output:
                graph.node.remove(node)
        for init in list(graph.initializer):
            if init.name == constant:
                graph.initializer.remove(init)


def export_model(model, task, out_dir: str, sentencepiece_model: Optional[str] = None, restricted: bool = True) -> Dict:
    """Write the folder of the module's docstring for a loaded ``model`` of ``task`` (its
    dictionaries); returns the config. The model is not changed (a frozen copy is traced)."""
    check_exportable(model)
    model = copy.deepcopy(unwrap(model))
    # not model.eval(): fairseq's make_generation_fast_ (run by prepare_for_inference_) replaces
    # the model's train() by a function that returns None
    model.float().cpu().requires_grad_(False)
    for module in model.modules():
        module.training = False
    decoder = model.decoder
    family = family_of(model)  # what it is decides the graphs: left to right, non-causal, a length predictor
    kind = family.kind
    tgt_dict, src_dict = task.target_dictionary, task.source_dictionary

    layers = len(decoder.layers)
    pass_ = decoder_pass(decoder)
    heads, head_dim = pass_.heads, pass_.head_dim
    max_positions = int(model.max_decoder_positions())
    V, C = len(tgt_dict), decoder.output_projection.weight.size(1)
    os.makedirs(out_dir, exist_ok=True)
    tmp = _temporary_folder(out_dir, ".export-")
    files: Dict[str, str] = {}

    def export(graph, args, inputs, outputs, dynamic, name, k_input=False, wrap=None):
        """Trace ``graph`` into ``tmp/name``, weights as initializers (``k_input``: TopK's k an
        input; ``wrap``: the traced model -> the model to save)."""
        import onnx  # noqa: PLC0415 - optional: onnx, for exporting

        path = os.path.join(tmp, name)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's notes on shape arithmetic and on its own deprecation
            torch.onnx.export(
                graph.eval(),
                args,
                path,
                dynamo=False,
                input_names=inputs,
                output_names=outputs,
                dynamic_axes=dynamic,
                opset_version=OPSET,
            )
        graph_model = onnx.load(path)
        _constants_to_initializers(graph_model)
        if k_input:
            _k_as_input(graph_model)
        if wrap is not None:
            graph_model = wrap(graph_model)
        onnx.save(graph_model, path)
        files[name.rsplit(".", 1)[0]] = name

    S, t, B = 5, 3, 2
    recurrent = pass_.recurrent  # SSRU: one cell (N, cell_dim) per layer is the step's state
    cell_dim = decoder.layers[0].ssru.input_proj.out_features if recurrent else 0
    enc_names = _names("enc", layers)
    if recurrent:
        past, present = [f"past_c{i}" for i in range(layers)], [f"present_c{i}" for i in range(layers)]
    else:
        past, present = _names("past", layers), _names("present", layers)
    # one row left-padded: fairseq's encoder passes its padding mask to the layers only when the
    # batch has padding (a Python branch the tracer fixes to the example's case)
    src = torch.full((B, S), src_dict.unk())
    src[:, -1] = src_dict.eos()
    src[1, :2] = src_dict.pad()
    length = family.length_predictor  # the encoder graph ends in the length predictor's log-probabilities too
    with torch.no_grad():
        encoder_outputs = EncoderGraph(model, length=length)(src)
    bias, enc_kv = encoder_outputs[0], list(encoder_outputs[1 : 1 + 2 * layers])
    length_out = ["length_lprobs"] if length else []
    export(
        EncoderGraph(model, length=length),
        (src,),
        ["src_tokens"],
        ["encoder_bias", *enc_names, *length_out],
        {
            "src_tokens": {0: "B", 1: "S"},
            "encoder_bias": {0: "B", 3: "S"},
            **{n: {0: "B", 2: "S"} for n in enc_names},
            **({"length_lprobs": {0: "B"}} if length else {}),
        },
        "encoder.onnx",
    )

    logit_bias = torch.zeros(V)
    window = int(pass_.window)
    r = min(16, V)  # an example shortlist's rows
    out_rows = [decoder.output_projection.weight[:r].clone(), torch.zeros(r)]
    rows_kv = [x.repeat_interleave(2, dim=0) for x in (bias, *enc_kv)]  # step graphs: one row per hypothesis
    # what the step graphs and the greedy loop share: their past state and its axes, the encoder side's axes
    caches = (
        [torch.zeros(2 * B, cell_dim) for _ in range(layers)]
        if recurrent
        else [torch.zeros(2 * B, heads, t, head_dim) for _ in range(2 * layers)]
    )
    state_axes = {
        **{n: ({0: "N"} if recurrent else {0: "N", 2: "t"}) for n in past},
        **{n: ({0: "N"} if recurrent else {0: "N", 2: "t1"}) for n in present},
    }
    encoder_axes = {"encoder_bias": {0: "N", 3: "S"}, **{n: {0: "N", 2: "S"} for n in enc_names}}
    for restricted_rows in (False, True) if restricted else (False,):
        suffix = "_restricted" if restricted_rows else ""
        rows_in = ["out_weight", "out_bias"] if restricted_rows else []
        rows_args = out_rows if restricted_rows else []
        rows_dyn = {"out_weight": {0: "V"}, "out_bias": {0: "V"}} if restricted_rows else {}
        bias_arg = logit_bias[:r] if restricted_rows else logit_bias
        relative_in = ["buckets"] if window > 0 else []
        relative_args = [torch.arange(t + 1).clamp(max=2 * window)] if window > 0 else []
        step_in = ["tokens", "position", *relative_in, "logit_bias", "encoder_bias", *enc_names, *past, *rows_in]
        step_args = (
            torch.full((2 * B,), tgt_dict.eos()),
            torch.tensor([t]),
            *relative_args,
            bias_arg,
            *rows_kv,
            *caches,
            *rows_args,
        )
        step_dyn = {
            "tokens": {0: "N"},
            "buckets": {0: "t1"},
            "logit_bias": {0: "V"},
            **encoder_axes,
            **state_axes,
            **rows_dyn,
        }
        if window == 0:
            del step_dyn["buckets"]
        if family.left_to_right:  # AT, HRT's AT mode and Skip-AT
            export(
                StepGraph(model, max_positions, top=1, restricted=restricted_rows),
                step_args,
                step_in,
                ["score", "token", *present],
                {**step_dyn, "score": {0: "N"}, "token": {0: "N"}},
                f"step{suffix}.onnx",
            )
            export(
                StepGraph(model, max_positions, top=4, restricted=restricted_rows),
                step_args,
                step_in,
                ["top_scores", "top_rows", *present],
                {**step_dyn, "top_scores": {0: "N", 1: "K"}, "top_rows": {0: "N", 1: "K"}},
                f"step_top{suffix}.onnx",
                k_input=True,
            )
        if family.non_causal:  # stage II, Mask-Predict's passes
            T = 6
            queries = torch.arange(0, T, 2)
            par_args = (
                torch.full((B, T), tgt_dict.unk()),
                torch.arange(1, T + 1).expand(B, T).contiguous(),
                queries,
                torch.arange(0, B * queries.numel(), 2),
                bias_arg,
                bias,
                *enc_kv,
                *rows_args,
            )
            export(
                ParallelGraph(model, max_positions, restricted=restricted_rows),
                par_args,
                ["tokens", "positions", "queries", "select", "logit_bias", "encoder_bias", *enc_names, *rows_in],
                ["score", "token"],
                {
                    "tokens": {0: "B", 1: "T"},
                    "positions": {0: "B", 1: "T"},
                    "queries": {0: "Q"},
                    "select": {0: "M"},
                    "logit_bias": {0: "V"},
                    "encoder_bias": {0: "B", 3: "S"},
                    **{n: {0: "B", 2: "S"} for n in enc_names},
                    "score": {0: "M"},
                    "token": {0: "M"},
                    **rows_dyn,
                },
                f"parallel{suffix}.onnx",
            )

    if family.left_to_right:  # the greedy search (AT, AT mode, Skip-AT) as one run: export/loop.py
        lengths = [torch.tensor(1), torch.tensor(10), torch.tensor(1)]  # stride, max_len, min_len
        body_args = (
            torch.tensor(t),
            torch.tensor(True),
            torch.ones(2 * B, dtype=torch.bool),
            torch.full((2 * B,), tgt_dict.eos()),
            *caches,
            *lengths,
        )
        loop_axes = {
            "alive": {0: "N"},
            "prev": {0: "N"},
            "alive_out": {0: "N"},
            "token": {0: "N"},
            "score": {0: "N"},
            **encoder_axes,
            **state_axes,
        }
        for restricted_rows in (False, True) if restricted else (False,):
            rows_args, bias_arg = (
                (out_rows + [torch.arange(r)], logit_bias[:r]) if restricted_rows else ([], logit_bias)
            )
            rows_dyn = (
                {
                    name: {0: "V"}
                    for name in ("usual_bias", "early_bias", "final_bias", "out_weight", "out_bias", "out_ids")
                }
                if restricted_rows
                else {}
            )
            export(
                GreedyLoopBody(model, max_positions, tgt_dict.eos(), restricted=restricted_rows),
                (*body_args, bias_arg, bias_arg, bias_arg, *rows_kv, *rows_args),
                body_inputs(past, enc_names, restricted_rows),
                ["cond_out", "alive_out", "token", *present, "score"],
                {**loop_axes, **rows_dyn},
                "greedy_restricted.onnx" if restricted_rows else "greedy.onnx",
                wrap=lambda body: greedy_loop(body, past, present, enc_names),
            )

    share_weights(tmp, list(files.values()))
    # the output rows as arrays: a shortlist gathers its rows from them once per batch (the only
    # files config.json does not name: hrt_runtime.integrity.AUXILIARY)
    np.save(os.path.join(tmp, OUTPUT_WEIGHT), decoder.output_projection.weight.float().numpy())
    if getattr(decoder.output_projection, "bias", None) is not None:
        np.save(os.path.join(tmp, OUTPUT_BIAS), decoder.output_projection.bias.float().numpy())
    src_lang, tgt_lang = (
        getattr(task.cfg, "source_lang", None) or "src",
        getattr(task.cfg, "target_lang", None) or "tgt",
    )
    src_dict.save(os.path.join(tmp, f"dict.{src_lang}.txt"))
    tgt_dict.save(os.path.join(tmp, f"dict.{tgt_lang}.txt"))
    spm = None
    if sentencepiece_model:
        spm = "sentencepiece.model"
        shutil.copyfile(sentencepiece_model, os.path.join(tmp, spm))
    chunk_start = {int(k): int(v) for k, v in getattr(task, "chunk_start_idx", {}).items()}
    config = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "parameters_sha256": parameters_sha256(model),
        "layers": layers,
        "heads": heads,
        "head_dim": head_dim,
        "embed_dim": int(C),
        "vocab_size": V,
        "max_target_positions": max_positions,
        "relative_window": window,
        "recurrent": bool(recurrent),
        "cell_dim": int(cell_dim),
        "length_classes": int(model.embed_length.weight.size(0)) if length else 0,
        "max_source_positions": int(model.max_positions()[0])
        if isinstance(model.max_positions(), tuple)
        else max_positions,
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
    stamp_graphs(tmp, config)
    _finish(tmp, out_dir, config)
    logger.info("exported %s model (%s) to %s", kind, ", ".join(files.values()), out_dir)
    return config


def _finish(tmp: str, out_dir: str, config: Dict) -> None:
    """An export written in ``tmp`` (:func:`_temporary_folder`) made ``out_dir``'s: its files
    recorded in ``config`` (:func:`record_files`), config.json written, and the files moved in,
    config.json last, so the folder appears whole or not at all."""
    record_files(tmp, config)
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(config, f, indent=1)
    for name in sorted(os.listdir(tmp), key=lambda n: n == CONFIG):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)


def stamp_graphs(folder: str, config: Dict) -> None:
    """Write what ``config`` declares about the graphs (:data:`hrt_runtime.model.DECLARED`) into
    every graph's metadata: the runtime compares it with ``config.json`` at load, so an edited
    ``config.json`` (positions, chunk sizes, symbols) is refused instead of translating into
    garbage. The weights stay where they are (``weights.bin``)."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting

    for name in sorted(set(config["graphs"].values())):
        path = os.path.join(folder, name)
        graph_model = onnx.load(path, load_external_data=False)
        kept = [(p.key, p.value) for p in graph_model.metadata_props if p.key != DECLARED_KEY]
        del graph_model.metadata_props[:]
        for key, value in [*kept, (DECLARED_KEY, declared_of(config))]:
            entry = graph_model.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(graph_model, path)


def record_files(folder: str, config: Dict) -> None:
    """List in ``config`` every file of the finished export in ``folder`` with its size and
    SHA-256: the runtime compares them when it opens the folder
    (:func:`hrt_runtime.integrity.check_folder`), so a truncated or altered file, or a
    config.json of another export, is named at load instead of failing or translating wrongly.
    Called on the finished files (an int8 folder's after quantization: :func:`quantize_folder`),
    with the ``"int8"`` they were listed for, which the runtime requires to be config.json's."""
    config[FILES] = list_files(folder)
    config[FILES_INT8] = bool(config.get("int8"))


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


def quantize_folder(folder: str, out_dir: str) -> Dict:
    """An int8 copy of an exported folder: ONNX Runtime's dynamic quantization of every graph's
    matrix products with constant weights (int8 weights, activations quantized per call), the
    rest copied. Returns its config (``"int8": true``)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415 - optional: onnxruntime

    with open(os.path.join(folder, CONFIG)) as f:
        config = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    tmp = _temporary_folder(out_dir, ".int8-")
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
                    extra_options={"EnableSubgraph": True},
                )
        elif name not in (CONFIG, WEIGHTS) and os.path.isfile(source):
            shutil.copyfile(source, os.path.join(tmp, name))
    share_weights(tmp, sorted(graphs))
    config = dict(config, int8=True)
    stamp_graphs(tmp, config)  # quantization may drop a graph's metadata
    # the list made again, of the int8 graphs and weights.bin (not the float folder's, which the
    # runtime once exempted them from, and with them any weights.bin beside an edited "int8")
    _finish(tmp, out_dir, config)
    return config


def export_checkpoint(
    checkpoint: str,
    out_dir: str,
    data: Optional[str] = None,
    sentencepiece_model: Optional[str] = None,
    restricted: bool = True,
    int8: bool = False,
) -> Dict:
    """Load a checkpoint as ``fairseq-generate`` does (``data``: the data-bin folder with its
    dictionaries, default the one it was trained on) and :func:`export_model` it (``int8``: then
    :func:`quantize_folder` it in place)."""
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"no checkpoint {checkpoint}")
    if sentencepiece_model and not os.path.isfile(sentencepiece_model):
        raise FileNotFoundError(f"--sentencepiece-model {sentencepiece_model}: no such file")
    overrides = {"data": data} if data else {}
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides=overrides)
    spm = sentencepiece_model or find_sentencepiece_model(data or cfg.task.data, os.path.dirname(checkpoint))
    config = export_model(models[0], task, out_dir, sentencepiece_model=spm, restricted=restricted)
    if int8:
        config = quantize_folder(out_dir, out_dir)
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
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    try:
        config = export_checkpoint(
            a.checkpoint, a.out_dir, a.data, a.sentencepiece_model, restricted=not a.no_restricted, int8=a.int8
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
