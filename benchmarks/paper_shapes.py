#!/usr/bin/env python
"""HRT against AT at the papers' shapes and newstest2014's lengths, every system forced to the same output length.

Speed at a fixed output length does not depend on the weights, so no training is needed: for
each shape of ``--shapes`` (:data:`SHAPES`: Transformer-base 6-6, the WMT'22 system's E12D1,
the ``small`` E6D2 of the Multi30k studies) an AT model (fairseq's ``transformer``, which
CTranslate2 converts) and an HRT model of the same shape are built with random weights over a
joined vocabulary (``--vocab``, 32k by default, shared embeddings).

**Sources**: newstest2014 (``--src``, raw text), cut into pieces by a SentencePiece BPE model
trained here on newstest2013 (``--spm-train``, both sides, ``--spm-vocab`` pieces: what a
user's joint BPE does to news text, whose token counts the table reports) and bucketed by
source tokens: 1-10, 11-20, 21-30, 31-50, > 50 (:data:`BUCKETS`). Each batch size takes its own
sample of every bucket (``--sentences 1:8,8:32,128:128``: sentences per bucket, drawn with
``--seed``), cut into length-sorted batches inside the bucket; every row decodes the same batches.

**Equal work**: a sentence of S source tokens gets ``L = target_length(S)`` target tokens (at
least 1.1 x S, the next ``4 q + 3``) and ``</s>``: ``L + 1`` decoder positions, the longest
sentence's in a batch. AT greedy runs ``L + 1`` steps (``</s>`` banned until the last);
HRT k runs ``(L + 1) / k`` Skip-AT steps and one stage-II pass over ``L + 1`` slots (k = 2
and 4 divide ``L + 1``); CTranslate2 runs ``L + 1`` steps (its minimum and maximum decoding
length). Each row reports the positions it decoded per sentence and the report says whether
every row decoded the same.

**Rows** (per shape; the benchmark's row schema in ``report.json``): our AT greedy and HRT k
(``b_at = b_nat = 1``) on each of ``--engines`` (ONNX Runtime float and int8 and the lean engine
on a CPU; the lean and CUDA-graph engines with ``--device cuda``, in float16 with ``--fp16`` or
bfloat16 with ``--bf16``; ``cuda-graph-stepped``: the CUDA-graph engine without its greedy
device loop, every step a host round trip, the same-run row of what the loop gains;
``cuda-graph-fused``: its graphs' attention one ``scaled_dot_product_attention``), fairseq's
``SequenceGenerator`` AT greedy (the stock reference, at ``--fairseq-batches``), and
CTranslate2's AT greedy in its float and int8 compute types (``--ct2-compute-types``; on a GPU
its float16 / bfloat16). CTranslate2 runs in a child process that imports no PyTorch (its
threads slow down beside PyTorch's in one process, ``benchmarks/runtime_vs_ct2.py`` says by how
much) and serves one pass at a time (:mod:`benchmarks.ct2_child`), so its passes take their
turns in the same round-robin as ours and meet the same state of the machine; it times each pass
itself. Every speed is source words/s of the raw sentences, per bucket and overall; "overall"
weighs each bucket by its share of newstest2014 (an estimate of the whole test set at that batch
size). Ratios are to the fastest AT greedy row of the same run and batch size (CTranslate2's
where it is the fastest); HRT rows also have their ratio to their own engine's AT and HRT's
fixed-length bound on that engine (:func:`benchmarks.hrt_bound.fixed_length_times`, at the
bucket's batches' lengths: the encoder, the AT steps, the Skip-AT steps and stage II, each timed
with the device synchronised, in the report's split tables), and the weights a decoder step
reads (:func:`weights_per_step`). Timing: the fastest of ``--runs`` passes, round-robin over
rows and buckets (:func:`benchmarks.timing.time_runs`; on a GPU the device is synchronised as
the clock starts and stops). The report names the CPU and the instruction sets it has (and the
one CTranslate2 chose), or the GPU. What cannot be measured is a line in the report and the
other rows are measured: an engine that cannot build a shape, CTranslate2 missing or without
CUDA or a compute type, a row or a whole shape out of the GPU's memory. A dtype or device this
machine lacks is refused in one line before anything is built.

Writes ``OUT/report.json``, ``OUT/report.md`` (printed) and ``OUT/speedup_by_length.png``::

    python benchmarks/paper_shapes.py --shapes base,e12d1,small-e6d2 --threads 1 --out-dir R/paper-shapes
    python benchmarks/paper_shapes.py --device cuda --fp16 --shapes base,e12d1 --out-dir R/paper-shapes-gpu
"""

import argparse
import datetime
import importlib
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import ct2_reference, hrt_bound  # noqa: E402
from benchmarks.ct2_child import ForcedLengthChild, child_rows, one_line  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.onnx_gate import random_model  # noqa: E402
from benchmarks.paper_shapes_report import (  # noqa: E402
    PER_SHAPE_META,
    plot,
    report_text,
    same_positions,
    summarize,
)
from benchmarks.report_files import write_files  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from fairseq_hrt.generation.engines import engine_choices, get_engine  # noqa: E402
from fairseq_hrt.generation.options import DEFAULT_DECODER_ENGINE  # noqa: E402
from hrt_runtime.search import SearchConfig, hrt, left_to_right  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEWSTEST = os.path.join(os.path.dirname(REPO), "shared", "data", "wmt14-en-de-newstest")

# (name, lowest, highest source tokens), the buckets of the HRT paper's Figure 5
BUCKETS = (("1-10", 1, 10), ("11-20", 11, 20), ("21-30", 21, 30), ("31-50", 31, 50), (">50", 51, 10**9))


@dataclass(frozen=True)
class Shape:
    title: str
    at_arch: str
    hrt_arch: str
    chunk_sizes: Tuple[int, ...]
    model_args: Tuple[str, ...] = ()  # both models
    at_args: Tuple[str, ...] = ()


SHAPES = {
    # the HRT paper's Transformer-base (pre-norm here, as hrt_base; the AT's decoder has no
    # relative keys, HRT's has them: each model as it is trained)
    "base": Shape(
        "Transformer-base 6-6 (d 512, FFN 2048, 8 heads)",
        "transformer",
        "hrt_base",
        (2,),
        at_args=("--encoder-normalize-before", "--decoder-normalize-before"),
    ),
    # the WMT'22 efficiency system's student, k = 2 and 4
    "e12d1": Shape("E12D1 pre-norm (d 512, FFN 2048, 8 heads)", "at_e12d1", "hrt_e12d1", (2, 4)),
    # the Multi30k studies' shape, for continuity
    "small-e6d2": Shape(
        "small E6D2 (d 256, FFN 1024, 4 heads)", "at_small", "hrt_small", (2,), model_args=("--decoder-layers", "2")
    ),
    # the tests' shape
    "tiny": Shape("tiny E2D1 (d 32)", "at_tiny", "hrt_tiny", (2, 4)),
}


def target_length(source_tokens: int) -> int:
    """Target tokens (before ``</s>``) of a source of ``source_tokens``: at least 1.1 x it,
    ``4 q + 3``, so that ``L + 1`` decoder positions split into whole Skip-AT steps for k = 2
    and 4 (HRT then does exactly AT's work: ``(L + 1) / k`` steps, ``L + 1`` slots)."""
    wanted = max(1, math.ceil(1.1 * source_tokens))
    return 4 * math.ceil((wanted + 1) / 4) - 1


def bucket_of(source_tokens: int) -> str:
    for name, low, high in BUCKETS:
        if low <= source_tokens <= high:
            return name
    raise ValueError(f"a source of {source_tokens} tokens is in no bucket")


def parse_sentences(text: str) -> Dict[int, int]:
    """``"1:8,8:32"`` -> ``{batch size: sentences per bucket}``."""
    out = {}
    for part in text.split(","):
        bsz, sep, n = part.partition(":")
        if not sep or not bsz.strip().isdigit() or not n.strip().isdigit() or int(bsz) < 1 or int(n) < 1:
            raise ValueError(
                f"--sentences {text!r}: expected BATCH:SENTENCES pairs of positive integers, e.g. 1:8,128:128"
            )
        out[int(bsz)] = int(n)
    return out


@dataclass
class Sentence:
    index: int  # line of the test set
    words: int  # whitespace words of the raw source
    pieces: List[int]  # SentencePiece ids


def read_sentences(src: str, spm_model: str) -> List[Sentence]:
    import sentencepiece  # noqa: PLC0415 - optional: the benchmark's tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    with open(src, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [Sentence(i, len(line.split()), sp.encode(line)) for i, line in enumerate(lines) if line.strip()]


def train_spm(paths: Sequence[str], vocab: int, prefix: str) -> str:
    """A BPE SentencePiece model of ``paths`` (``prefix.model``), made once."""
    import sentencepiece  # noqa: PLC0415 - optional: the benchmark's tokenizer

    if not os.path.exists(prefix + ".model"):
        sentencepiece.SentencePieceTrainer.train(
            input=list(paths),
            model_prefix=prefix,
            vocab_size=vocab,
            model_type="bpe",
            character_coverage=1.0,
            hard_vocab_limit=False,
            minloglevel=2,
        )
    return prefix + ".model"


def samples(sentences: List[Sentence], per_bucket: Dict[int, int], seed: int) -> Dict[int, Dict[str, List[Sentence]]]:
    """``{batch size: {bucket: sentences}}``, each bucket's sample drawn without replacement
    (all of the bucket when it holds fewer) and sorted by length (the batches' order)."""
    by_bucket: Dict[str, List[Sentence]] = {name: [] for name, _, _ in BUCKETS}
    for s in sentences:
        by_bucket[bucket_of(len(s.pieces))].append(s)
    out = {}
    for bsz, n in per_bucket.items():
        rng = np.random.RandomState(seed)
        out[bsz] = {}
        for name, found in by_bucket.items():
            pick = sorted(rng.choice(len(found), min(n, len(found)), replace=False).tolist()) if found else []
            out[bsz][name] = sorted((found[i] for i in pick), key=lambda s: (len(s.pieces), s.index))
    return out


def bucket_shares(sentences: List[Sentence]) -> Dict[str, int]:
    counts = {name: 0 for name, _, _ in BUCKETS}
    for s in sentences:
        counts[bucket_of(len(s.pieces))] += 1
    return counts


@dataclass
class Batch:
    tokens: List[List[int]]  # model ids, without </s>
    length: int  # L: target tokens before </s> (every sentence of the batch)


def make_batches(sample: List[Sentence], bsz: int, vocab: int, nspecial: int) -> List[Batch]:
    """Length-sorted batches of ``sample``; piece ids folded into the model's vocabulary
    (random weights: which ids does not matter, how many does)."""
    room = vocab - nspecial - 16  # clear of the task's <mask> and <s_k>, appended at the end
    out = []
    for start in range(0, len(sample), bsz):
        part = sample[start : start + bsz]
        tokens = [[nspecial + p % room for p in s.pieces] for s in part]
        out.append(Batch(tokens, max(target_length(len(t)) for t in tokens)))
    return out


def source_array(batch: Batch, pad: int, eos: int) -> np.ndarray:
    """Left-padded ``(B, S)`` ending in ``</s>``, as fairseq batches sources."""
    width = max(len(t) for t in batch.tokens) + 1
    src = np.full((len(batch.tokens), width), pad, np.int64)
    for r, t in enumerate(batch.tokens):
        src[r, width - len(t) - 1 : width - 1] = t
        src[r, -1] = eos
    return src


def weights_per_step(model) -> Dict[str, float]:
    """MB of weights one decoder step reads: every decoder layer's matrices but the
    cross-attention keys/values (projected once per sentence), and the output layer (the
    embedding matrix when shared); float32, and int8 where every matrix is int8 (vectors stay
    float32). Besides these a step reads its cached keys/values, which grow with the step."""
    params = dict(model.decoder.named_parameters())
    out_proj = getattr(model.decoder, "output_projection", None)
    total = {"float32": 0.0, "int8": 0.0}
    for name, p in params.items():
        if "encoder_attn.k_proj" in name or "encoder_attn.v_proj" in name or "embed_positions" in name:
            continue
        if name == "embed_tokens.weight" and out_proj is not None and out_proj.weight is not p:
            continue  # an unshared input embedding: one row per step
        matrix = p.dim() == 2
        total["float32"] += p.numel() * 4
        total["int8"] += p.numel() * (1 if matrix else 4)
    if out_proj is not None and all(out_proj.weight is not p for p in params.values()):
        total["float32"] += out_proj.weight.numel() * 4
        total["int8"] += out_proj.weight.numel()
    return {k: round(v / 2**20, 1) for k, v in total.items()}


# ------------------------------------------------------------------------- decoders
# each: decode(batches) -> decoder positions per sentence, in the batches' order


def search_decoder(
    backend, encode, k: int, banned: Sequence[int]
) -> Callable[[List[np.ndarray], List[Batch]], List[int]]:
    """AT greedy (k = 1) or HRT k, b_at = b_nat = 1, through the one search of every engine,
    reading tokens only (``scores=False``): as ``hrt-translate`` decodes, and as CTranslate2's
    rows run (without ``return_scores``, no log-softmax)."""

    def decode(sources, batches):
        positions = []
        for src, batch in zip(sources, batches):
            encoded = encode(src)
            if k == 1:
                config = SearchConfig(beam=1, max_len_a=0.0, max_len_b=batch.length, min_len=batch.length, scores=False)
                positions += [
                    h[0]["tokens"].size for h in left_to_right(backend, encoded, src.shape[1], config, banned)
                ]
            else:  # stage I: min_len = max_len = L // k Skip-AT tokens, then </s>
                config = SearchConfig(
                    beam=1, max_len_a=0.0, max_len_b=batch.length, min_len=batch.length // k, scores=False
                )
                positions += [h[0]["steps"] * k for h in hrt(backend, encoded, src.shape[1], config, k, banned)]
        return positions

    return decode


def fairseq_decoder(model, tgt_dict):
    """fairseq's own ``SequenceGenerator``, greedy, one per forced length."""
    from fairseq.sequence_generator import SequenceGenerator  # noqa: PLC0415

    generators = {}
    device = next(model.parameters()).device

    def decode(sources, batches):
        positions = []
        for src, batch in zip(sources, batches):
            if batch.length not in generators:
                generators[batch.length] = SequenceGenerator(
                    [model], tgt_dict, beam_size=1, max_len_a=0, max_len_b=batch.length, min_len=batch.length
                )
            tokens = torch.from_numpy(src).to(device)
            lengths = (tokens != tgt_dict.pad()).sum(dim=1)
            hyps = generators[batch.length].generate(
                [model], {"net_input": {"src_tokens": tokens, "src_lengths": lengths}}
            )
            positions += [h[0]["tokens"].numel() for h in hyps]
        return positions

    return decode


# ----------------------------------------------------------------------------- run

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CTranslate2's compute types beside our rows of each dtype: its float, and its int8 weights
# with that float's activations (on a CPU: float32 and int8, beside ONNX Runtime's int8)
CT2_COMPUTE_TYPES = {"float32": "float32,int8", "float16": "float16,int8_float16", "bfloat16": "bfloat16,int8_bfloat16"}


@dataclass
class Models:
    shape: str
    task: object
    at: object
    hrt: object
    hrt_task: object
    at_checkpoint: str
    workdir: str


def build_models(name: str, vocab: int, workdir: str, device: str = "cpu", dtype: str = "float32") -> Models:
    """The AT and HRT models of shape ``name`` with random weights, on ``device`` in ``dtype``
    (the AT's checkpoint, which CTranslate2 converts, stays float32)."""
    shape = SHAPES[name]
    folder = os.path.join(workdir, name)
    os.makedirs(os.path.join(folder, "at"), exist_ok=True)
    at_checkpoint = os.path.join(folder, "at", "checkpoint.pt")
    task, at = random_model(
        shape.at_arch,
        vocab,
        folder,
        extra_args=["--hrt-mode", "at", *shape.model_args, *shape.at_args],
        checkpoint=at_checkpoint,
    )
    chunk_sizes = ",".join(str(k) for k in shape.chunk_sizes)
    hrt_task, hrt_model = random_model(
        shape.hrt_arch, vocab, folder, extra_args=["--chunk-sizes", chunk_sizes, *shape.model_args]
    )
    for model in (at, hrt_model):
        model.to(device=device, dtype=DTYPES[dtype])
    return Models(name, task, at, hrt_model, hrt_task, at_checkpoint, folder)


def our_rows(models: Models, engines: Sequence[str], threads: int) -> Dict[str, dict]:
    """``{row name: {decode, family, decoding, engine, quantize, k, backend, encode}}`` of
    our engines and fairseq's; a row whose engine cannot run the model says why instead."""
    rows: Dict[str, dict] = {}
    shape = SHAPES[models.shape]
    variants = []
    for engine in engines:  # float, and int8 where the engine quantizes its own graphs
        variants.append((engine, "none"))
        if engine in ENGINE_VARIANTS:
            continue
        if get_engine(engine).quantizes_itself:
            variants.append((engine, "int8"))
    for engine, quantize in variants:
        suffix = f" ({engine})" if engine != DEFAULT_DECODER_ENGINE else ""
        suffix += " int8" if quantize == "int8" else ""
        for family, model, task, ks in (
            ("AT", models.at, models.task, (1,)),
            ("HRT", models.hrt, models.hrt_task, shape.chunk_sizes),
        ):
            try:
                backend, encode = engine_backend(engine, model, task, threads, quantize)
            except Exception as e:  # noqa: BLE001 - a shape an engine cannot build: a line in the report
                for k in ks:
                    rows[row_name(family, k) + suffix] = {"error": one_line(e)}
                continue
            for k in ks:
                rows[row_name(family, k) + suffix] = {
                    "decode": search_decoder(backend, encode, k, hrt_bound.banned_symbols(task)),
                    "family": family,
                    "engine": engine,
                    "quantize": quantize,
                    "k": k,
                    "backend": backend,
                    "encode": encode,
                    "task": task,
                }
    rows[FAIRSEQ_ROW] = {
        "decode": fairseq_decoder(models.at, models.task.target_dictionary),
        "family": "AT",
        "engine": "fairseq",
        "quantize": "none",
        "k": 1,
    }
    return rows


# rows of a registered engine with one of its settings changed: name -> (engine, the change)
ENGINE_VARIANTS = {
    "cuda-graph-stepped": ("cuda-graph", lambda backend: setattr(backend, "loop_rows", 0)),
    "cuda-graph-fused": ("cuda-graph", lambda backend: setattr(backend, "attention_kernel", "fused")),
}


def engine_backend(engine: str, model, task, threads: int, quantize: str):
    """``hrt_bound.backend_of`` of a registered engine or of one of :data:`ENGINE_VARIANTS`."""
    registered, change = ENGINE_VARIANTS.get(engine, (engine, None))
    backend, encode = hrt_bound.backend_of(registered, model, task, threads, int8=quantize == "int8")
    if change is not None:
        change(backend)
    return backend, encode


FAIRSEQ_ROW = "AT greedy (fairseq SequenceGenerator)"
CT2_ROW = "CTranslate2 AT greedy"


def row_name(family: str, k: int) -> str:
    return "AT greedy" if family == "AT" else f"HRT k={k} b_at=1 b_nat=1"


def ct2_row_name(compute_type: str, dtype: str) -> str:
    return CT2_ROW + ("" if compute_type == dtype else f" {compute_type}")


def sync_of(device: str) -> Optional[Callable[[], None]]:
    """What the timing loop calls before starting and stopping the clock: on a GPU, so that the
    device's queued work is counted (every row, the fixed-length split's parts too)."""
    return torch.cuda.synchronize if device == "cuda" else None


def measure_shape(models: Models, batches_of: Dict[int, Dict[str, List[Batch]]], args) -> dict:
    """Every row of one shape at every batch size: seconds per bucket, positions, bounds."""
    torch.set_num_threads(args.threads)
    rows = our_rows(models, args.engines, args.threads)
    out = {"rows": {}, "errors": {n: r["error"] for n, r in rows.items() if "error" in r}}
    live = {n: r for n, r in rows.items() if "error" not in r}
    child = start_ct2(models, batches_of, args, out)
    try:
        for bsz, buckets in batches_of.items():
            measure_batch(models, live, child, bsz, buckets, args, out)
            if bsz in args.bound_batches:
                out.setdefault("bounds", {})[str(bsz)] = bounds(live, buckets, bsz, args, out["errors"])
    finally:
        if child is not None:
            child.close()
    out["weights_per_step_mb"] = {"AT": weights_per_step(models.at), "HRT": weights_per_step(models.hrt)}
    shape = SHAPES[models.shape]
    out["models"] = {
        "AT": model_description(models.at, shape.at_arch),
        "HRT": model_description(models.hrt, shape.hrt_arch),
    }
    return out


def start_ct2(models: Models, batches_of, args, out: dict) -> Optional[ForcedLengthChild]:
    """CTranslate2's child process (:mod:`benchmarks.ct2_child`) holding every batch of the
    shape (job ``"BSZ/BUCKET"``), or None, with why in ``out["errors"]``; what it says of
    itself (version, instruction set) in ``out["ctranslate2"]``."""
    why = ct2_reference.unavailable_reason(use_cuda=args.device == "cuda")
    if why is None:
        try:
            model_dir = ct2_reference.convert(models.at_checkpoint, models.workdir, models.workdir, "src", "tgt")
            symbols = models.task.target_dictionary.symbols
            jobs = {
                f"{bsz}/{b}": [
                    {"tokens": [[symbols[i] for i in t] for t in x.tokens], "length": x.length + 1} for x in batches
                ]
                for bsz, buckets in batches_of.items()
                for b, batches in buckets.items()
                if batches
            }
            child = ForcedLengthChild(model_dir, jobs, args.ct2_compute_types, args.threads, args.device)
        except Exception as e:  # noqa: BLE001 - a model CTranslate2 cannot convert or load: a line in the report
            why = one_line(e)
    if why:
        out["errors"][CT2_ROW] = why
        return None
    for compute_type, reason in child.errors.items():
        out["errors"][ct2_row_name(compute_type, args.dtype)] = reason
    out["ctranslate2"] = child.ready
    return child


def batch_cells(batch: Batch) -> int:
    """Decoder positions of a batch: its sentences x its longest's L + 1."""
    return len(batch.tokens) * (batch.length + 1)


def measure_batch(models: Models, live: Dict[str, dict], child, bsz: int, buckets, args, out: dict) -> None:
    """Every row at batch ``bsz``, CTranslate2's passes in the same round-robin as ours (the
    child times its own); a row that fails its warm-up (a GPU out of memory, a kernel a
    capture refuses) is a line in ``out["errors"]``, the others are measured."""
    pad, eos = models.task.target_dictionary.pad(), models.task.target_dictionary.eos()
    sources = {b: [source_array(x, pad, eos) for x in batches] for b, batches in buckets.items() if batches}
    # the warm-up batch: the one of the most positions, the most memory a row will ask for
    b, i = max(
        ((b, i) for b in sources for i in range(len(sources[b]))), key=lambda bi: batch_cells(buckets[bi[0]][bi[1]])
    )
    fns = {}
    for name, row in live.items():
        if row["engine"] == "fairseq" and bsz not in args.fairseq_batches:
            continue
        try:
            with torch.inference_mode():
                row["decode"](sources[b][i : i + 1], buckets[b][i : i + 1])
        except Exception as e:  # noqa: BLE001 - a row this device cannot run: a line in the report
            out["errors"][failed_at(name, bsz)] = one_line(e)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            continue
        for b in sources:
            fns[(name, b)] = lambda r=row, s=sources[b], x=buckets[b]: r["decode"](s, x)
    compute_types = {}
    for (compute_type, job), fn in child_rows(child, [f"{bsz}/{b}" for b in sources]).items():
        name = ct2_row_name(compute_type, args.dtype)
        compute_types[name] = compute_type
        fns[(name, job.split("/", 1)[1])] = fn
    try:
        with torch.inference_mode():
            timed = time_runs(fns, runs=args.runs, sync=sync_of(args.device))
    except torch.cuda.OutOfMemoryError as e:  # a row past its warm-up's memory: this batch size is a line
        out["errors"][f"batch {bsz}"] = f"out of memory in the timed passes: {one_line(e)}"
        torch.cuda.empty_cache()
        return
    for (name, b), t in timed.items():
        if name in compute_types:  # the child's own clock, without the pipe's round trip
            seconds = child.seconds[(compute_types[name], f"{bsz}/{b}")]
            fields = {"family": "CTranslate2", "engine": "ctranslate2", "quantize": compute_types[name], "k": 1}
        else:
            seconds = t.seconds
            fields = {k: v for k, v in live[name].items() if k in ("family", "engine", "quantize", "k")}
        entry = out["rows"].setdefault(name, fields)
        entry.setdefault("speed", {}).setdefault(str(bsz), {})[b] = {
            "seconds": round(min(seconds), 5),
            "run_seconds": [round(s, 5) for s in seconds],
            "positions": t.value,
        }


def failed_at(name: str, bsz: int) -> str:
    """The report's line of a row that could not run at a batch size."""
    return f"{name} at batch {bsz}"


def model_description(model, arch: str) -> dict:
    """What the benchmark's rows say of a model (as ``benchmarks.measure.model_shape`` says of a
    checkpoint); the parameters count shared tensors once."""
    return {
        "arch": arch,
        "embed_dim": model.encoder.embed_tokens.embedding_dim,
        "ffn_embed_dim": model.encoder.layers[0].fc1.out_features,
        "encoder_layers": len(model.encoder.layers),
        "decoder_layers": len(model.decoder.layers),
        "vocab": model.decoder.embed_tokens.num_embeddings,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def bound_lengths(batches: List[Batch]) -> Tuple[int, int]:
    """``(source, target)`` positions of the fixed-length bound of a bucket: its batches' mean
    padded width (the longest source and ``</s>``) and mean decoder positions (the longest
    sentence's L + 1, every sentence of a batch decodes them), the latter to a multiple of 4 so
    that k = 2 and 4 make whole Skip-AT steps. At batch 1 a batch's lengths are its sentence's;
    at batch 128 the bucket's mean sentence would understate what a batch decodes."""
    source = round(np.mean([max(len(t) for t in x.tokens) for x in batches])) + 1
    target = 4 * max(1, round(np.mean([x.length + 1 for x in batches]) / 4))
    return source, target


def bounds(live: Dict[str, dict], buckets: Dict[str, List[Batch]], bsz: int, args, errors: dict) -> dict:
    """HRT's fixed-length bound per engine (float and int8), k and bucket, at the bucket's
    batches' lengths (:func:`bound_lengths`; :func:`benchmarks.hrt_bound.fixed_length_times`: the
    encoder, the AT steps, the Skip-AT steps and stage II, each timed with the device
    synchronised); a row out of memory is a line in ``errors``, and a row that could not run at
    ``bsz`` has no bound."""
    out = {}
    for name, row in live.items():
        if row["family"] != "HRT" or args.bound_runs < 1 or failed_at(name, bsz) in errors:
            continue
        for b, batches in buckets.items():
            if not batches:
                continue
            src_len, tgt_len = bound_lengths(batches)
            try:
                with torch.inference_mode():
                    times = hrt_bound.fixed_length_times(
                        row["backend"], row["encode"], row["task"], bsz, src_len, tgt_len, row["k"], args.bound_runs,
                        sync=sync_of(args.device),
                    )  # fmt: skip
            except torch.cuda.OutOfMemoryError as e:
                errors[f"bound of {name} at batch {bsz}, bucket {b}"] = one_line(e)
                torch.cuda.empty_cache()
                continue
            out.setdefault(name, {})[b] = {"src_len": src_len, "tgt_len": tgt_len, **times}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default="base,e12d1,small-e6d2", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--vocab", type=int, default=32000, help="joined vocabulary of the random models")
    p.add_argument("--src", default=os.path.join(NEWSTEST, "test.en"), help="raw source sentences (newstest2014)")
    p.add_argument(
        "--spm-train",
        default=",".join(os.path.join(NEWSTEST, f"valid.{lang}") for lang in ("en", "de")),
        help="raw text the BPE model is trained on, comma-separated (newstest2013, both sides)",
    )
    p.add_argument("--spm-vocab", type=int, default=24000)
    p.add_argument("--sentences", default="1:8,8:32,128:128", help="BATCH:SENTENCES per bucket, comma-separated")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every row runs (one GPU: cuda)")
    dtype = p.add_mutually_exclusive_group()
    dtype.add_argument("--fp16", action="store_true", help="our models in float16 (--device cuda)")
    dtype.add_argument("--bf16", action="store_true", help="our models in bfloat16 (--device cuda, a GPU that has it)")
    p.add_argument(
        "--engines",
        help=f"our engines (default: {DEFAULT_ENGINES['cpu']} on cpu, {DEFAULT_ENGINES['cuda']} on cuda; "
        "onnxruntime rows: float and int8)",
    )
    p.add_argument(
        "--ct2-compute-types",
        help="CTranslate2's rows (default: its float of the run's dtype and int8 beside it: "
        + "; ".join(f"{d}: {c}" for d, c in CT2_COMPUTE_TYPES.items())
        + ")",
    )
    p.add_argument(
        "--fairseq-batches",
        help="batch sizes fairseq's SequenceGenerator row runs at, or none (default: every one of --sentences; "
        "on a GPU it is slow at batch 1)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=2, help="timed passes of every row (the fastest is reported)")
    p.add_argument("--bound-runs", type=int, default=2, help="fixed-length bound: the fastest of this many (0: none)")
    p.add_argument("--bound-batches", default="1,8", help="batch sizes the bound is measured at")
    p.add_argument("--workdir", help="models, exports and conversions (default: a temporary folder)")
    p.add_argument("--out-dir", required=True)
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the shapes of OUT-DIR/report.json that this run does not measure (the same machine, threads, data)",
    )
    return p


def parse_args(argv=None):
    """The options, their lists parsed (``args.shapes``, ``args.per_bucket``); a bad value or a
    missing file is refused in one line."""
    p = build_parser()
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"--shapes: {s!r} is not one of {', '.join(SHAPES)}")
    device_options(p, args)
    args.engines = [e.strip() for e in (args.engines or DEFAULT_ENGINES[args.device]).split(",") if e.strip()]
    for e in args.engines:
        if e not in engine_choices() and e not in ENGINE_VARIANTS:
            p.error(f"--engines: {e!r} is not one of {', '.join([*engine_choices(), *ENGINE_VARIANTS])}")
        if ENGINE_DEVICES.get(e, args.device) != args.device:
            p.error(
                f"--engines {e} runs on {ENGINE_DEVICES[e]} only here: "
                f"with --device {args.device} use {DEFAULT_ENGINES[args.device]}"
            )
    args.bound_batches = {int(b) for b in args.bound_batches.split(",") if b.strip()}
    args.ct2_compute_types = [
        c.strip() for c in (args.ct2_compute_types or CT2_COMPUTE_TYPES[args.dtype]).split(",") if c.strip()
    ]
    try:
        args.per_bucket = parse_sentences(args.sentences)
    except ValueError as e:
        p.error(str(e))
    if args.threads < 1 or args.runs < 1:
        p.error("--threads and --runs must be >= 1")
    fairseq_batches = args.fairseq_batches or ",".join(str(b) for b in args.per_bucket)
    try:
        args.fairseq_batches = {int(b) for b in fairseq_batches.split(",") if b.strip() and fairseq_batches != "none"}
    except ValueError:
        p.error(f"--fairseq-batches {fairseq_batches!r}: batch sizes, comma-separated, or none")
    for path in [args.src, *args.spm_train.split(",")]:
        if not os.path.isfile(path):
            p.error(f"no such file: {path} (newstest2013/2014: ../shared/data/wmt14-en-de-newstest, see its SOURCE.md)")
    return args


DEFAULT_ENGINES = {"cpu": "onnxruntime,lean", "cuda": "lean,cuda-graph"}
# engines that run on one device only here
ENGINE_DEVICES = {"onnxruntime": "cpu", "cuda-graph": "cuda", **{variant: "cuda" for variant in ENGINE_VARIANTS}}


def device_options(p: argparse.ArgumentParser, args) -> None:
    """``args.dtype`` from ``--fp16`` / ``--bf16``; a device or dtype this machine lacks is
    refused in one line, before a model is built."""
    args.dtype = "float16" if args.fp16 else "bfloat16" if args.bf16 else "float32"
    if args.device == "cpu" and args.dtype != "float32":
        p.error(
            f"--{'fp16' if args.fp16 else 'bf16'} is for --device cuda: the CPU rows run float32 "
            "(ONNX Runtime's int8 and CTranslate2's beside them)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: torch {torch.__version__} sees no CUDA device here")
    if args.bf16 and not torch.cuda.is_bf16_supported():
        p.error(f"--bf16: {torch.cuda.get_device_name()} has no bfloat16 arithmetic; use --fp16")


def shape_block(shape: str, measured: dict, systems: List[dict], batches_of, meta: dict) -> dict:
    """``report.json``'s block of one measured shape."""
    return {
        "title": SHAPES[shape].title,
        "measured": {k: meta[k] for k in PER_SHAPE_META},
        "weights_per_step_mb": measured["weights_per_step_mb"],
        "models": measured["models"],
        "errors": measured["errors"],
        "ctranslate2": measured.get("ctranslate2", {}),
        "bounds": measured.get("bounds", {}),
        "positions_differ": same_positions(systems),
        "empty_buckets": {str(bsz): [b for b, x in per.items() if not x] for bsz, per in batches_of.items()},
        "expected_positions": {
            str(bsz): {b: [x.length + 1 for x in batches for _ in x.tokens] for b, batches in per.items() if batches}
            for bsz, per in batches_of.items()
        },
    }


def main(argv=None):
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="paper-shapes-")
    os.makedirs(workdir, exist_ok=True)
    spm_model = train_spm(args.spm_train.split(","), args.spm_vocab, os.path.join(workdir, f"bpe{args.spm_vocab}"))
    sentences = read_sentences(args.src, spm_model)
    shares = bucket_shares(sentences)
    drawn = samples(sentences, args.per_bucket, args.seed)
    report = {"meta": meta(args, sentences, shares), "shapes": {}, "systems": []}
    if args.append:
        report = appended(report, os.path.join(args.out_dir, "report.json"), args.shapes)
    for shape in args.shapes:
        try:
            models = build_models(shape, args.vocab, workdir, args.device, args.dtype)
        except torch.cuda.OutOfMemoryError as e:  # a shape too large for the device: a line, the next shape measured
            report["meta"].setdefault("not_measured", {})[shape] = one_line(e)
            torch.cuda.empty_cache()
            write(report, args.out_dir)
            continue
        nspecial = models.task.target_dictionary.nspecial
        batches_of = {
            bsz: {b: make_batches(found, bsz, args.vocab, nspecial) for b, found in per.items()}
            for bsz, per in drawn.items()
        }
        words_of = {bsz: {b: sum(s.words for s in found) for b, found in per.items()} for bsz, per in drawn.items()}
        measured = measure_shape(models, batches_of, args)
        systems = summarize(shape, measured, batches_of, shares, words_of)
        report["systems"] += systems
        report["shapes"][shape] = shape_block(shape, measured, systems, batches_of, report["meta"])
        write(report, args.out_dir)  # each shape as soon as it is measured
    write(report, args.out_dir, picture=True)


def appended(report: dict, previous_path: str, shapes: Sequence[str]) -> dict:
    """``report`` with the shapes of an earlier run's report (``--append``) that this run does
    not measure again; the earlier run must have measured on the same machine, threads and data."""
    if not os.path.isfile(previous_path):
        return report
    with open(previous_path) as f:
        previous = json.load(f)
    for key in ("device", "dtype", "threads", "vocab", "src", "spm_vocab", "sentences"):
        then, now = (m.get(key, "float32" if key == "dtype" else None) for m in (previous["meta"], report["meta"]))
        if then != now:  # (a report from before --fp16 / --bf16 measured float32)
            raise SystemExit(
                f"--append: {previous_path} was measured with another {key} ({then!r}, "
                f"this run: {now!r}); write to another --out-dir"
            )
    for shape, block in previous["shapes"].items():
        if shape in shapes:
            continue
        block.setdefault("measured", {k: previous["meta"].get(k) for k in PER_SHAPE_META})
        report["shapes"][shape] = block
        report["systems"] += [s for s in previous["systems"] if s["shape"] == shape]
    return report


def version_of(package: str) -> str:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return "not installed"


def meta(args, sentences: List[Sentence], shares: Dict[str, int]) -> dict:
    pieces = sum(len(s.pieces) for s in sentences)
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), host CPU {cpu_name()}"
    else:
        device = f"CPU ({cpu_name()})"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device,
        "dtype": args.dtype,
        # what the CPU's kernels may use (ONNX Runtime's MLAS, CTranslate2's oneDNN / MKL / own)
        "cpu_isa": cpu_isa(),
        "threads": args.threads,
        "torch": torch.__version__,
        "onnxruntime": version_of("onnxruntime"),
        "ctranslate2": version_of("ctranslate2"),
        "vocab": args.vocab,
        "src": os.path.relpath(args.src, args.out_dir),
        "spm_train": ", ".join(os.path.relpath(t, args.out_dir) for t in args.spm_train.split(",")),
        "spm_vocab": args.spm_vocab,
        "sentences": len(sentences),
        "mean_source_tokens": round(pieces / max(len(sentences), 1), 1),
        "tokens_per_word": round(pieces / max(sum(s.words for s in sentences), 1), 2),
        "bucket_shares": shares,
        "sentences_per_bucket": args.sentences,
        "runs": args.runs,
        "bound_runs": args.bound_runs,
        "bound_batches": sorted(args.bound_batches),
        "baseline": "the fastest AT greedy row of this run, per batch size (CTranslate2's included)",
    }


def write(report: dict, out_dir: str, picture: bool = False):
    files = {"report.md": report_text(report), "report.json": json.dumps(report, indent=2)}
    write_files(out_dir, files)
    if picture:
        why = plot(report, os.path.join(out_dir, "speedup_by_length.png"))
        if why:
            print(why)
        print(files["report.md"])


if __name__ == "__main__":
    main()
