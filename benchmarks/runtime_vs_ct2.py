#!/usr/bin/env python
"""The deployed runtime (``hrt_runtime``: ONNX Runtime, no PyTorch) against CTranslate2, in one
process without PyTorch.

``benchmark.py`` measures every engine through fairseq, in a process where PyTorch runs, and
CTranslate2's OpenMP threads are sensitive to other thread pools in their process (2 threads,
batch 1, `mini` AT, the other core busy: 1.18 ms a sentence alone, 4.8 ms after a PyTorch
operation, 3.5 ms with ``OMP_WAIT_POLICY=PASSIVE``). This process imports neither PyTorch nor
fairseq: each runtime is measured as a user deploying it would run it. (Run CTranslate2's rows
alone, without ``--onnx``, to see it without ONNX Runtime's threads too.)

Rows:

* ``--onnx NAME=FOLDER`` (repeatable): a folder of ``fairseq-hrt-export`` (``--int8`` ones
  too) decoded by ``hrt_runtime.Translator``'s search: greedy (``NAME greedy``), and for an HRT
  model its AT mode and every ``--chunk-sizes`` k it was trained for;
* ``--ctranslate2 NAME=DIR`` (repeatable): a converted AT model
  (``benchmarks/ct2_reference.py``), greedy in float32 and int8 (``--ct2-compute-types``), and
  with its vocabulary map when ``DIR/vmap.txt`` exists (``+vmap``).

Both read the same SentencePiece pieces (``--src``) and output at most ``--max-len-a`` x the
batch's longest source (with ``</s>``) + ``--max-len-b`` tokens. Speed: source words/s
(whitespace words of ``--raw-src``), decoding only (ids in, ids or pieces out); batch 1 over the
first ``--bs1-sentences`` sentences, larger batches over all of them, length-sorted; the rows'
passes go round-robin (:func:`benchmarks.timing.time_runs`). BLEU: sacreBLEU of the detokenised
output against ``--raw-ref``. Prints a table and writes ``OUT/runtime_vs_ct2.{md,json}``::

    python benchmarks/runtime_vs_ct2.py --onnx AT=at-onnx --onnx "AT int8=at-onnx-int8" \\
        --ctranslate2 AT=ct2-at --src test.en.pieces --raw-src test.en --raw-ref test.de \\
        --spm spm.model --batch-sizes 1,8,128 --threads 2 --out-dir R/runtime-vs-ct2
"""

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import sacrebleu  # noqa: E402
import sentencepiece  # noqa: E402

from benchmarks import ct2_reference  # noqa: E402
from benchmarks.report_files import write_report  # noqa: E402
from benchmarks.timing import time_runs  # noqa: E402
from hrt_runtime.search import SearchConfig  # noqa: E402
from hrt_runtime.translator import Translator  # noqa: E402


def named(values: List[str], flag: str) -> List[Tuple[str, str]]:
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} {value!r}: expected NAME=PATH")
        out.append((name, path))
    return out


def length_sorted_batches(lengths: List[int], batch_size: int) -> List[List[int]]:
    """Sentence indices, by source length, cut into batches of ``batch_size`` (fairseq's order
    of batching, and the order CTranslate2 sorts a call's inputs in)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def runtime_rows(
    name: str,
    folder: str,
    pieces: List[List[str]],
    threads: int,
    chunk_sizes: List[int],
    max_len_a: float,
    max_len_b: int,
) -> Dict[str, Tuple[Callable, Callable]]:
    """``{row: (decode(batches) -> {index: pieces}, ...)}`` of one exported folder."""
    translator = Translator(folder, threads=threads)
    model = translator.model
    unk, eos = model.config["source_unk"], model.config["source_eos"]
    sources = [np.array([translator.source_index.get(p, unk) for p in line] + [eos], np.int64) for line in pieces]
    config = SearchConfig(beam=1, max_len_a=max_len_a, max_len_b=max_len_b)
    ks = [1] + ([k for k in chunk_sizes if k in model.config["trained_chunk_sizes"]] if model.kind == "hrt" else [])

    def decoder(k: int):
        def decode(batches: List[List[int]]) -> Dict[int, List[str]]:
            out = {}
            for batch in batches:
                hypos = translator.search([sources[i] for i in batch], config, k)
                for i, sentence in zip(batch, hypos):
                    out[i] = [translator.target_symbols[t] for t in sentence[0]["tokens"].tolist() if t != model.eos]
            return out

        return decode

    rows = {}
    for k in ks:
        kind = ("greedy" if model.kind != "hrt" else "AT-mode b=1") if k == 1 else f"k={k} b_at=1 b_nat=1"
        rows[f"{name} {kind} (hrt_runtime)"] = decoder(k)
    return rows


def ctranslate2_rows(
    name: str,
    model_dir: str,
    pieces: List[List[str]],
    threads: int,
    compute_types: List[str],
    max_len_a: float,
    max_len_b: int,
) -> Dict[str, Callable]:
    import ctranslate2  # noqa: PLC0415 - optional: CTranslate2

    vocabulary = ct2_reference.target_vocabulary(model_dir) or []
    suppress = ct2_reference.suppressed(vocabulary)
    vmap = os.path.isfile(os.path.join(model_dir, ct2_reference.VMAP_FILE))
    rows = {}
    for compute_type in compute_types:
        translator = ctranslate2.Translator(
            model_dir, device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=threads
        )
        for use_vmap in (False, True) if vmap else (False,):

            def decode(batches, translator=translator, use_vmap=use_vmap):
                out = {}
                for batch in batches:
                    found = ct2_reference.translate(
                        translator,
                        [pieces[i] for i in batch],
                        len(batch),
                        1,
                        max_len_b,
                        suppress,
                        max_len_a=max_len_a,
                        use_vmap=use_vmap,
                    )
                    out.update({batch[j]: hyp for j, hyp in found.items()})
                return out

            suffix = ("" if compute_type == "float32" else f" {compute_type}") + (" +vmap" if use_vmap else "")
            rows[f"CTranslate2 {name} greedy{suffix}"] = decode
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--onnx", action="append", default=[], metavar="NAME=FOLDER", help="an exported folder (repeatable)")
    p.add_argument(
        "--ctranslate2",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a CTranslate2 model of an AT checkpoint (repeatable; vmap.txt in it: +vmap rows too)",
    )
    p.add_argument("--ct2-compute-types", default="float32,int8")
    p.add_argument(
        "--chunk-sizes", default="2", help="HRT models: the chunk sizes k decoded (those the model was trained for)"
    )
    p.add_argument("--src", required=True, help="test source, SentencePiece pieces (as the models read it)")
    p.add_argument("--raw-src", required=True, help="raw test source (its words are counted)")
    p.add_argument("--raw-ref", required=True, help="raw test reference (sacreBLEU)")
    p.add_argument("--spm", help="the SentencePiece model (detokenisation; without it pieces are joined by spaces)")
    p.add_argument("--max-sentences", type=int, default=0, help="the first N sentences (0: all)")
    p.add_argument("--bs1-sentences", type=int, default=100)
    p.add_argument("--batch-sizes", default="1,8,128")
    p.add_argument("--runs", type=int, default=5, help="passes at batch 1 (mean)")
    p.add_argument("--runs-large", type=int, default=2, help="passes at larger batches (mean)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads and CTranslate2 intra_threads")
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--out-dir", required=True)
    return p


def read_test_set(args):
    """``(pieces, raw_src, raw_ref)`` of the test set, refused unless aligned."""

    def read(path: str) -> List[str]:
        with open(path, encoding="utf-8") as f:
            lines = f.read().rstrip("\n").split("\n")
        return lines[: args.max_sentences] if args.max_sentences else lines

    pieces = [line.split() for line in read(args.src)]
    raw_src, raw_ref = read(args.raw_src), read(args.raw_ref)
    if not (len(pieces) == len(raw_src) == len(raw_ref)):
        raise SystemExit(
            f"--src, --raw-src and --raw-ref differ in lines ({len(pieces)}, {len(raw_src)}, {len(raw_ref)})"
        )
    return pieces, raw_src, raw_ref


def build_rows(args, pieces: List[List[str]]) -> Dict[str, Callable]:
    """Every row's decode function (batches of sentence indices -> outputs)."""
    chunk_sizes = [int(k) for k in args.chunk_sizes.split(",") if k]
    rows: Dict[str, Callable] = {}
    for name, folder in named(args.onnx, "--onnx"):
        rows.update(runtime_rows(name, folder, pieces, args.threads, chunk_sizes, args.max_len_a, args.max_len_b))
    for name, model_dir in named(args.ctranslate2, "--ctranslate2"):
        rows.update(
            ctranslate2_rows(
                name, model_dir, pieces, args.threads, args.ct2_compute_types.split(","), args.max_len_a, args.max_len_b
            )
        )
    return rows


def time_rows(args, rows: Dict[str, Callable], words: List[int], lengths: List[int], batch_sizes, report) -> Dict:
    """Every row's speed at every batch size into ``report["rows"]``; returns the rows' outputs
    of the batch sizes that decoded every sentence."""
    outputs: Dict[str, Dict[int, List[str]]] = {}
    for bs in batch_sizes:
        n = min(args.bs1_sentences, len(lengths)) if bs == 1 and args.bs1_sentences else len(lengths)
        batches = length_sorted_batches(lengths[:n], bs)
        for decode in rows.values():  # warm-up: one batch
            decode(batches[:1])
        timed = time_runs(
            {row: (lambda decode=decode: decode(batches)) for row, decode in rows.items()},
            runs=args.runs if bs == 1 else args.runs_large,
        )
        for row, timing in timed.items():
            report["rows"].setdefault(row, {})[str(bs)] = {
                "words_per_second": sum(words[:n]) / timing.mean,
                "seconds": list(timing.seconds),
                "sentences": n,
            }
            if n == len(lengths):
                outputs[row] = timing.value
    return outputs


def score_rows(report, outputs, detok, raw_ref: List[str], batch_sizes) -> Dict[int, float]:
    """Each row's BLEU (into ``report``); returns CTranslate2's fastest greedy words/s per batch size."""
    fastest_ct2 = {}
    for row, result in report["rows"].items():
        hyps = outputs.get(row)
        if hyps is not None:
            text = [detok(hyps[i]) for i in range(report["sentences"])]
            result["bleu"] = sacrebleu.corpus_bleu(text, [raw_ref]).score
        if row.startswith("CTranslate2") and row.endswith("greedy"):
            for bs in batch_sizes:
                fastest_ct2[bs] = max(fastest_ct2.get(bs, 0.0), result[str(bs)]["words_per_second"])
    return fastest_ct2


def markdown(args, report, words: List[int], batch_sizes, fastest_ct2) -> str:
    sentences = report["sentences"]
    head = [
        "| row | BLEU | " + " | ".join(f"bs={bs} words/s" for bs in batch_sizes) + " |",
        "|---|---:|" + "---:|" * len(batch_sizes),
    ]
    lines = [
        f"## The deployed runtime against CTranslate2 ({args.threads} thread(s), a process without PyTorch)",
        "",
        f"test: {sentences} sentences ({sum(words)} source words); batch 1: the first "
        f"{min(args.bs1_sentences, sentences)}, mean of {args.runs} runs; larger batches: all, "
        f"{args.runs_large} run(s); outputs at most {args.max_len_a} x source + {args.max_len_b} tokens. "
        "In brackets: the ratio to CTranslate2's float greedy row of the same run.",
        "",
    ] + head
    for row, result in report["rows"].items():
        cells = []
        for bs in batch_sizes:
            wps = result[str(bs)]["words_per_second"]
            ratio = f" ({wps / fastest_ct2[bs]:.2f}x)" if fastest_ct2.get(bs) else ""
            cells.append(f"{wps:.1f}{ratio}")
        bleu = f"{result['bleu']:.2f}" if "bleu" in result else "-"
        lines.append(f"| {row} | {bleu} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None):
    args = build_parser().parse_args(argv)
    if "torch" in sys.modules:
        raise SystemExit("runtime_vs_ct2: PyTorch was imported into this process; the point is a process without it")
    pieces, raw_src, raw_ref = read_test_set(args)
    rows = build_rows(args, pieces)
    if "torch" in sys.modules:  # a module above imported it after all
        raise SystemExit("runtime_vs_ct2: a row's module imported PyTorch")
    detok = sentencepiece.SentencePieceProcessor(model_file=args.spm).decode if args.spm else " ".join
    words = [len(line.split()) for line in raw_src]
    lengths = [len(line) for line in pieces]
    report = {
        "threads": args.threads,
        "sentences": len(pieces),
        "bs1_sentences": args.bs1_sentences,
        "max_len_a": args.max_len_a,
        "max_len_b": args.max_len_b,
        "rows": {},
    }
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    outputs = time_rows(args, rows, words, lengths, batch_sizes, report)
    fastest_ct2 = score_rows(report, outputs, detok, raw_ref, batch_sizes)
    write_report(args.out_dir, "runtime_vs_ct2", report, markdown(args, report, words, batch_sizes, fastest_ct2))


if __name__ == "__main__":
    main()
