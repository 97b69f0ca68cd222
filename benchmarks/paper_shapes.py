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

**Rows** (per shape; the benchmark's row schema in ``report.json``): CTranslate2 AT greedy
float32 and int8 (timed in a child process that imports no PyTorch: CTranslate2's threads
slow down beside PyTorch's in one process, ``benchmarks/runtime_vs_ct2.py`` says by how much),
our AT greedy and HRT k (``b_at = b_nat = 1``) on ONNX Runtime float and int8 and on the lean
engine, and fairseq's ``SequenceGenerator`` AT greedy (the stock reference). Every speed is
source words/s of the raw sentences, per bucket and overall; "overall" weighs each bucket
by its share of newstest2014 (an estimate of the whole test set at that batch size). Ratios
are to the fastest AT greedy row of the same run and batch size (CTranslate2's where it is
the fastest); HRT rows also have their ratio to their own engine's AT and HRT's fixed-length
bound on that engine (:func:`benchmarks.hrt_bound.fixed_length_times`, at the bucket's
mean lengths), and the weights a decoder step reads (:func:`weights_per_step`). Timing: the
fastest of ``--runs`` passes, round-robin over rows and buckets (:func:`benchmarks.timing.time_runs`).

Writes ``OUT/report.json``, ``OUT/report.md`` (printed) and ``OUT/speedup_by_length.png``::

    python benchmarks/paper_shapes.py --shapes base,e12d1,small-e6d2 --threads 1 --out-dir R/paper-shapes
"""

import argparse
import datetime
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import ct2_reference, hrt_bound  # noqa: E402
from benchmarks.benchmark import cpu_name  # noqa: E402
from benchmarks.onnx_gate import random_model  # noqa: E402
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
    """AT greedy (k = 1) or HRT k, b_at = b_nat = 1, through the one search of every engine."""

    def decode(sources, batches):
        positions = []
        for src, batch in zip(sources, batches):
            encoded = encode(src)
            if k == 1:
                config = SearchConfig(beam=1, max_len_a=0.0, max_len_b=batch.length, min_len=batch.length)
                positions += [
                    h[0]["tokens"].size for h in left_to_right(backend, encoded, src.shape[1], config, banned)
                ]
            else:  # stage I: min_len = max_len = L // k Skip-AT tokens, then </s>
                config = SearchConfig(beam=1, max_len_a=0.0, max_len_b=batch.length, min_len=batch.length // k)
                positions += [h[0]["steps"] * k for h in hrt(backend, encoded, src.shape[1], config, k, banned)]
        return positions

    return decode


def fairseq_decoder(model, tgt_dict):
    """fairseq's own ``SequenceGenerator``, greedy, one per forced length."""
    from fairseq.sequence_generator import SequenceGenerator  # noqa: PLC0415

    generators = {}

    def decode(sources, batches):
        positions = []
        for src, batch in zip(sources, batches):
            if batch.length not in generators:
                generators[batch.length] = SequenceGenerator(
                    [model], tgt_dict, beam_size=1, max_len_a=0, max_len_b=batch.length, min_len=batch.length
                )
            tokens = torch.from_numpy(src)
            lengths = (tokens != tgt_dict.pad()).sum(dim=1)
            hyps = generators[batch.length].generate(
                [model], {"net_input": {"src_tokens": tokens, "src_lengths": lengths}}
            )
            positions += [h[0]["tokens"].numel() for h in hyps]
        return positions

    return decode


def ct2_rows(model_dir: str, jobs: dict, threads: int, runs: int, compute_types: Sequence[str]) -> dict:
    """CTranslate2's rows, timed in a child process that imports no PyTorch
    (:func:`benchmarks.ct2_reference.forced_length_main`)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.json")
        out = os.path.join(tmp, "out.json")
        with open(job, "w") as f:
            json.dump(
                {
                    "model_dir": model_dir,
                    "threads": threads,
                    "runs": runs,
                    "compute_types": list(compute_types),
                    "jobs": jobs,
                },
                f,
            )
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(
            [sys.executable, "-c", "from benchmarks.ct2_reference import forced_length_main as m; m()", job, out],
            check=True,
            env=env,
            cwd=REPO,
        )
        with open(out) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- run


@dataclass
class Models:
    shape: str
    task: object
    at: object
    hrt: object
    hrt_task: object
    at_checkpoint: str
    workdir: str


def build_models(name: str, vocab: int, workdir: str) -> Models:
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
    return Models(name, task, at, hrt_model, hrt_task, at_checkpoint, folder)


def our_rows(models: Models, engines: Sequence[str], threads: int) -> Dict[str, dict]:
    """``{row name: {decode, family, decoding, engine, quantize, k, backend, encode}}`` of
    our engines and fairseq's; a row whose engine cannot run the model says why instead."""
    rows: Dict[str, dict] = {}
    shape = SHAPES[models.shape]
    variants = []
    for engine in engines:  # float, and int8 where the engine quantizes its own graphs
        variants.append((engine, "none"))
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
                backend, encode = hrt_bound.backend_of(engine, model, task, threads, int8=quantize == "int8")
            except Exception as e:  # noqa: BLE001 - a shape an engine cannot build: a line in the report
                for k in ks:
                    rows[row_name(family, k) + suffix] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
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
    rows["AT greedy (fairseq SequenceGenerator)"] = {
        "decode": fairseq_decoder(models.at, models.task.target_dictionary),
        "family": "AT",
        "engine": "fairseq",
        "quantize": "none",
        "k": 1,
    }
    return rows


def row_name(family: str, k: int) -> str:
    return "AT greedy" if family == "AT" else f"HRT k={k} b_at=1 b_nat=1"


def measure_shape(models: Models, batches_of: Dict[int, Dict[str, List[Batch]]], args) -> dict:
    """Every row of one shape at every batch size: seconds per bucket, positions, bounds."""
    torch.set_num_threads(args.threads)
    rows = our_rows(models, args.engines, args.threads)
    pad, eos = models.task.target_dictionary.pad(), models.task.target_dictionary.eos()
    out = {"rows": {}, "errors": {n: r["error"] for n, r in rows.items() if "error" in r}}
    live = {n: r for n, r in rows.items() if "error" not in r}
    ct2_dir, ct2_error = None, ct2_reference.unavailable_reason()
    if ct2_error is None:
        try:
            ct2_dir = ct2_reference.convert(models.at_checkpoint, models.workdir, models.workdir, "src", "tgt")
        except Exception as e:  # noqa: BLE001 - a model CTranslate2 cannot convert: a line in the report
            ct2_error = f"{type(e).__name__}: {e}".splitlines()[0]
    if ct2_error:
        out["errors"]["CTranslate2 AT greedy"] = ct2_error
    for bsz, buckets in batches_of.items():
        sources = {b: [source_array(x, pad, eos) for x in batches] for b, batches in buckets.items() if batches}
        fns = {
            (name, b): (lambda r=row, s=sources[b], x=buckets[b]: r["decode"](s, x))
            for name, row in live.items()
            for b in sources
        }
        with torch.inference_mode():
            for row in live.values():  # warm-up: one batch (a whole pass would cost a timed pass's time)
                first = next(iter(sources))
                row["decode"](sources[first][:1], buckets[first][:1])
            timed = time_runs(fns, runs=args.runs)
        for (name, b), t in timed.items():
            entry = out["rows"].setdefault(
                name, {k: v for k, v in live[name].items() if k in ("family", "engine", "quantize", "k")}
            )
            entry.setdefault("speed", {}).setdefault(str(bsz), {})[b] = {
                "seconds": round(t.min, 5),
                "run_seconds": [round(s, 5) for s in t.seconds],
                "positions": t.value,
            }
        if ct2_dir:
            symbols = models.task.target_dictionary.symbols
            jobs = {
                b: [{"tokens": [[symbols[i] for i in t] for t in x.tokens], "length": x.length + 1} for x in buckets[b]]
                for b in sources
            }
            for compute_type, per_bucket in ct2_rows(
                ct2_dir, jobs, args.threads, args.runs, args.ct2_compute_types
            ).items():
                name = "CTranslate2 AT greedy" + ("" if compute_type == "float32" else f" {compute_type}")
                entry = out["rows"].setdefault(
                    name, {"family": "CTranslate2", "engine": "ctranslate2", "quantize": compute_type, "k": 1}
                )
                entry.setdefault("speed", {})[str(bsz)] = per_bucket
        if bsz in args.bound_batches:
            out.setdefault("bounds", {})[str(bsz)] = bounds(live, buckets, bsz, args)
    out["weights_per_step_mb"] = {"AT": weights_per_step(models.at), "HRT": weights_per_step(models.hrt)}
    shape = SHAPES[models.shape]
    out["models"] = {
        "AT": model_description(models.at, shape.at_arch),
        "HRT": model_description(models.hrt, shape.hrt_arch),
    }
    return out


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


def bounds(live: Dict[str, dict], buckets: Dict[str, List[Batch]], bsz: int, args) -> dict:
    """HRT's fixed-length bound per engine (float and int8), k and bucket, at the bucket's
    mean source and target lengths (:func:`benchmarks.hrt_bound.fixed_length_times`)."""
    out = {}
    for name, row in live.items():
        if row["family"] != "HRT" or args.bound_runs < 1:
            continue
        for b, batches in buckets.items():
            if not batches:
                continue
            src_len = round(np.mean([len(t) for x in batches for t in x.tokens])) + 1
            tgt_len = target_length(src_len - 1) + 1
            with torch.inference_mode():
                times = hrt_bound.fixed_length_times(
                    row["backend"], row["encode"], row["task"], bsz, src_len, tgt_len, row["k"], args.bound_runs
                )
            out.setdefault(name, {})[b] = {"src_len": src_len, "tgt_len": tgt_len, **times}
    return out


# ------------------------------------------------------------------------- report


def row_speed(row: dict, batches_of, shares: Dict[str, int], words_of) -> dict:
    """A row's words/s per batch size: per bucket, and overall at newstest2014's bucket shares."""
    speed = {}
    for bsz, per_bucket in row["speed"].items():
        buckets = {}
        time_full, words_full = 0.0, 0.0
        for b, m in per_bucket.items():
            words = words_of[int(bsz)][b]
            n = sum(len(x.tokens) for x in batches_of[int(bsz)][b])
            buckets[b] = {
                "words_per_second": round(words / m["seconds"], 1),
                "seconds": m["seconds"],
                "run_seconds": m["run_seconds"],
                "sentences": n,
                "words": words,
                "positions": sum(m["positions"]),
            }
            time_full += shares[b] * m["seconds"] / n
            words_full += shares[b] * words / n
        speed[bsz] = {"words_per_second": round(words_full / time_full, 1), "buckets": buckets}
    return speed


def own_at(systems: List[dict], s: dict, bsz: str) -> Optional[dict]:
    """The AT row of HRT row ``s``'s engine and quantization at batch ``bsz``."""
    return next(
        (
            o
            for o in systems
            if o["family"] == "AT"
            and o["decoding"]["engine"] == s["decoding"]["engine"]
            and o["decoding"]["quantize"] == s["decoding"]["quantize"]
            and bsz in o["speed"]
        ),
        None,
    )


def add_ratios(systems: List[dict], measured: dict, bsz: str) -> None:
    """Each row's ratios at batch ``bsz`` to the fastest AT greedy row and, for HRT, to its own
    engine's AT (with the fixed-length bound per bucket)."""
    at = [s for s in systems if s["family"] in ("AT", "CTranslate2") and bsz in s["speed"]]
    if not at:
        return
    fastest = max(at, key=lambda s: s["speed"][bsz]["words_per_second"])
    for s in systems:
        if bsz not in s["speed"]:
            continue
        sp = s["speed"][bsz]
        sp["baseline"] = fastest["name"]
        sp["ratio_vs_baseline"] = round(sp["words_per_second"] / fastest["speed"][bsz]["words_per_second"], 3)
        for b, cell in sp["buckets"].items():
            base = fastest["speed"][bsz]["buckets"].get(b)
            if base:
                cell["ratio_vs_baseline"] = round(cell["words_per_second"] / base["words_per_second"], 3)
        own = own_at(systems, s, bsz) if s["family"] == "HRT" else None
        if own is None:
            continue
        sp["own_at"] = own["name"]
        sp["ratio_vs_own_at"] = round(sp["words_per_second"] / own["speed"][bsz]["words_per_second"], 3)
        bound = measured.get("bounds", {}).get(bsz, {}).get(s["name"], {})
        for b, cell in sp["buckets"].items():
            cell["ratio_vs_own_at"] = round(
                cell["words_per_second"] / own["speed"][bsz]["buckets"][b]["words_per_second"], 3
            )
            if b in bound:
                cell["bound"] = bound[b]["bound"]
                cell["share_of_bound"] = round(cell["ratio_vs_own_at"] / bound[b]["bound"], 3)


def summarize(shape: str, measured: dict, batches_of, shares: Dict[str, int], words_of) -> List[dict]:
    """The benchmark's rows (``report.json``'s ``systems``) of one shape: words/s per bucket
    and overall, ratios to the fastest AT greedy row and, for HRT, to its engine's AT."""
    systems = []
    for name, row in measured["rows"].items():
        systems.append(
            {
                "name": name,
                "family": row["family"],
                "shape": shape,
                "decoding": {
                    "beam": 1,
                    "engine": row["engine"],
                    "quantize": row["quantize"],
                    **({"chunk_size": row["k"], "b_at": 1, "b_nat": 1} if row["family"] == "HRT" else {}),
                },
                "model": measured["models"]["HRT" if row["family"] == "HRT" else "AT"],
                "speed": row_speed(row, batches_of, shares, words_of),
                "positions_by_bucket": {
                    bsz: {b: m["positions"] for b, m in per_bucket.items()} for bsz, per_bucket in row["speed"].items()
                },
            }
        )
    for bsz in {b for s in systems for b in s["speed"]}:
        add_ratios(systems, measured, bsz)
    return systems


def same_positions(systems: List[dict]) -> Dict[str, List[str]]:
    """``{batch size: rows whose decoder positions differ from the first row's}`` (empty lists: equal work)."""
    out = {}
    for bsz in sorted({b for s in systems for b in s["positions_by_bucket"]}, key=int):
        with_bsz = [s for s in systems if bsz in s["positions_by_bucket"]]
        first = with_bsz[0]["positions_by_bucket"][bsz]
        out[bsz] = [s["name"] for s in with_bsz if s["positions_by_bucket"][bsz] != first]
    return out


def shape_notes(shape: str, block: dict, meta: dict) -> List[str]:
    """A shape's heading and notes: when and how it was measured, what a step reads, what was
    left out, whether every row did the same work."""
    w = block["weights_per_step_mb"]
    when = block.get("measured") or {k: meta.get(k) for k in PER_SHAPE_META}
    out = [
        f"## {SHAPES[shape].title}",
        "",
        f"Measured {when['date']}: sentences per bucket (batch:sentences) {when['sentences_per_bucket']}, "
        f"the fastest of {when['runs']} passes; bound at batch {', '.join(block['bounds']) or '(none)'} "
        f"(the fastest of {when['bound_runs']}).",
        "",
        f"Weights a decoder step reads: AT {w['AT']['float32']} MB float32 / {w['AT']['int8']} MB int8, "
        f"HRT {w['HRT']['float32']} / {w['HRT']['int8']} MB.",
    ]
    for bsz, empty in block["empty_buckets"].items():
        if empty:
            out.append(f"- batch {bsz}: no sentence in bucket {', '.join(empty)} (left out of its tables and overall)")
    for name, why in block["errors"].items():
        out.append(f"- not measured: **{name}**: {why}")
    differ = block["positions_differ"]
    out.append(
        "- equal work: "
        + (
            "every row decoded the same positions at every batch size."
            if not any(differ.values())
            else "; ".join(f"batch {b}: {', '.join(v)} decoded other positions" for b, v in differ.items() if v)
        )
    )
    return out


def batch_tables(rows: List[dict], bsz: str) -> List[str]:
    """The tables of one batch size: every row's words/s per bucket, and HRT's against its own AT."""
    sample = rows[0]["speed"][bsz]["buckets"]
    head = " | ".join(f"{b} ({sample[b]['sentences']})" for b in sample)
    out = [
        "",
        f"### batch {bsz} (words/s, x the fastest AT greedy: {rows[0]['speed'][bsz]['baseline']})",
        "",
        f"| row | {head} | overall | x fastest AT | x own AT |",
        "|---|" + "---:|" * (len(sample) + 3),
    ]
    for s in sorted(rows, key=lambda s: -s["speed"][bsz]["words_per_second"]):
        sp = s["speed"][bsz]
        cells = " | ".join(
            f"{c['words_per_second']:.0f} ({c.get('ratio_vs_baseline', 0):.2f}x)" for c in sp["buckets"].values()
        )
        own = f"{sp['ratio_vs_own_at']:.2f}x" if "ratio_vs_own_at" in sp else ""
        out.append(f"| {s['name']} | {cells} | {sp['words_per_second']:.0f} | {sp['ratio_vs_baseline']:.2f}x | {own} |")
    hrt_rows = [s for s in rows if s["family"] == "HRT" and "ratio_vs_own_at" in s["speed"][bsz]]
    if hrt_rows:
        out += [
            "",
            "HRT against its own engine's AT, per bucket: delivered / bound (share of the bound)",
            "",
            f"| row | {' | '.join(sample)} |",
            "|---|" + "---:|" * len(sample),
        ]
        for s in hrt_rows:
            cells = []
            for c in s["speed"][bsz]["buckets"].values():
                cell = f"{c['ratio_vs_own_at']:.2f}x"
                if "bound" in c:
                    cell += f" / {c['bound']:.2f}x ({c['share_of_bound']:.0%})"
                cells.append(cell)
            out.append(f"| {s['name']} | {' | '.join(cells)} |")
    return out


def report_text(report: dict) -> str:
    meta = report["meta"]
    out = [
        "# HRT against AT at the papers' shapes, newstest2014 lengths, equal output length "
        f"({meta['threads']} thread(s))",
        "",
        f"{meta['device']}, torch {meta['torch']}, onnxruntime {meta['onnxruntime']}, ctranslate2 "
        f"{meta['ctranslate2']}; {meta['date']}. Random weights, vocabulary {meta['vocab']}; sources: "
        f"{meta['sentences']} lines of `{meta['src']}` cut by a {meta['spm_vocab']}-piece BPE trained on "
        f"`{meta['spm_train']}` ({meta['mean_source_tokens']} tokens per sentence on average, "
        f"{meta['tokens_per_word']} per word). Every sentence decodes L + 1 positions, L = 1.1 x its source "
        "tokens rounded up to 4q + 3 (the longest sentence's in a batch). Source words/s, the fastest of "
        "each shape's passes, round-robin over rows and buckets; overall = newstest2014's bucket shares "
        f"({', '.join(f'{b}: {n}' for b, n in meta['bucket_shares'].items())} sentences).",
        "",
    ]
    for shape in report["shapes"]:
        systems = [s for s in report["systems"] if s["shape"] == shape]
        out += shape_notes(shape, report["shapes"][shape], meta)
        for bsz in sorted({b for s in systems for b in s["speed"]}, key=int):
            out += batch_tables([s for s in systems if bsz in s["speed"]], bsz)
        out.append("")
    return "\n".join(out) + "\n"


def plot(report: dict, path: str) -> Optional[str]:
    """HRT k = 2's speed-up over its own engine's AT against source length, per shape and
    engine (batch 1), with the HRT paper's Figure 5 (CPU)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the picture

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font search logs at DEBUG
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        return f"no picture: {e}"
    names = [b for b, _, _ in BUCKETS]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"onnxruntime": "-", "lean": ":"}
    for n, shape in enumerate(report["shapes"]):
        color = f"C{n}"
        for s in report["systems"]:
            speed = s["speed"].get("1", {})
            if s["shape"] != shape or s["decoding"].get("chunk_size") != 2 or "ratio_vs_own_at" not in speed:
                continue
            cells = speed["buckets"]
            xs = [i for i, b in enumerate(names) if b in cells]
            int8 = s["decoding"]["quantize"] == "int8"
            ax.plot(
                xs,
                [cells[names[i]]["ratio_vs_own_at"] for i in xs],
                marker="x" if int8 else "o",
                linestyle="--" if int8 else styles.get(s["decoding"]["engine"], "-"),
                color=color,
                label=f"{shape}, {s['decoding']['engine']}{' int8' if int8 else ''}",
            )
    ax.plot([0, 4], [1.6, 2.0], "k*", markersize=12, label="HRT paper, Fig. 5 (CPU, batch 32, b_at 5)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("source tokens (newstest2014)")
    ax.set_ylabel("HRT k = 2 / AT greedy, same engine (batch 1)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


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
    p.add_argument("--engines", default="onnxruntime,lean", help="our engines (onnxruntime rows: float and int8)")
    p.add_argument("--ct2-compute-types", default="float32,int8")
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
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in args.engines:
        if e not in engine_choices():
            p.error(f"--engines: {e!r} is not one of {', '.join(engine_choices())}")
    args.bound_batches = {int(b) for b in args.bound_batches.split(",") if b.strip()}
    args.ct2_compute_types = [c.strip() for c in args.ct2_compute_types.split(",") if c.strip()]
    try:
        args.per_bucket = parse_sentences(args.sentences)
    except ValueError as e:
        p.error(str(e))
    if args.threads < 1 or args.runs < 1:
        p.error("--threads and --runs must be >= 1")
    for path in [args.src, *args.spm_train.split(",")]:
        if not os.path.isfile(path):
            p.error(f"no such file: {path} (newstest2013/2014: ../shared/data/wmt14-en-de-newstest, see its SOURCE.md)")
    return args


def shape_block(shape: str, measured: dict, systems: List[dict], batches_of, meta: dict) -> dict:
    """``report.json``'s block of one measured shape."""
    return {
        "title": SHAPES[shape].title,
        "measured": {k: meta[k] for k in PER_SHAPE_META},
        "weights_per_step_mb": measured["weights_per_step_mb"],
        "models": measured["models"],
        "errors": measured["errors"],
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
        models = build_models(shape, args.vocab, workdir)
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


# what each shape's block keeps of the run that measured it (--append puts runs together)
PER_SHAPE_META = ("date", "sentences_per_bucket", "runs", "bound_runs", "bound_batches")


def appended(report: dict, previous_path: str, shapes: Sequence[str]) -> dict:
    """``report`` with the shapes of an earlier run's report (``--append``) that this run does
    not measure again; the earlier run must have measured on the same machine, threads and data."""
    if not os.path.isfile(previous_path):
        return report
    with open(previous_path) as f:
        previous = json.load(f)
    for key in ("device", "threads", "vocab", "src", "spm_vocab", "sentences"):
        if previous["meta"].get(key) != report["meta"][key]:
            raise SystemExit(
                f"--append: {previous_path} was measured with another {key} ({previous['meta'].get(key)!r}, "
                f"this run: {report['meta'][key]!r}); write to another --out-dir"
            )
    for shape, block in previous["shapes"].items():
        if shape in shapes:
            continue
        block.setdefault("measured", {k: previous["meta"].get(k) for k in PER_SHAPE_META})
        report["shapes"][shape] = block
        report["systems"] += [s for s in previous["systems"] if s["shape"] == shape]
    return report


def meta(args, sentences: List[Sentence], shares: Dict[str, int]) -> dict:
    import ctranslate2  # noqa: PLC0415
    import onnxruntime  # noqa: PLC0415

    pieces = sum(len(s.pieces) for s in sentences)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": f"CPU ({cpu_name()})",
        "threads": args.threads,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "ctranslate2": ctranslate2.__version__,
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
