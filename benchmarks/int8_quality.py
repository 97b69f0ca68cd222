#!/usr/bin/env python
"""int8 beside float on a trained model: BLEU and speed of an exported folder and of its int8
copies (one weight scale per matrix, ``tensor``, or per output column, ``channel``), decoded by
the runtime (``hrt_runtime.Translator``, ONNX Runtime, no PyTorch) on the same sources.

For every chunk size and beam asked, each variant translates the whole input once per round, the
variants interleaved in every round (so that a slower moment of the machine falls on all of
them); speed is the fastest round's source words a second, quality sacreBLEU against the
references and the share of lines equal to float's. int8 speed stands next to its BLEU.

    python -m benchmarks.int8_quality --folder model-onnx --src test.en --ref test.de --out DIR
"""

import argparse
import json
import os
import platform
import sys
import time
from typing import Dict, List

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_files import write_files  # noqa: E402
from fairseq_hrt.export.exporter import INT8_SCALES, quantize_folder  # noqa: E402
from fairseq_hrt.scoring.metrics import sacrebleu_score  # noqa: E402
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.text_input import read_lines  # noqa: E402


def variants(folder: str, work: str, scales: List[str]) -> Dict[str, str]:
    """``{name: folder}``: the float folder and an int8 copy of it per scale (made in ``work``)."""
    out = {"float": folder}
    for scale in scales:
        out[f"int8-{scale}"] = path = os.path.join(work, f"int8-{scale}")
        quantize_folder(folder, path, scale)
    return out


def measure(translators: Dict[str, Translator], sources, refs, options: Dict, rounds: int) -> Dict[str, Dict]:
    """Each variant's translations, BLEU, fastest words/s and lines equal to float's under ``options``."""
    words = sum(len(line.split()) for line in sources)
    seconds = {name: [] for name in translators}
    hyps = {}
    for _ in range(rounds):
        for name, translator in translators.items():
            started = time.perf_counter()
            hyps[name] = translator.translate(sources, **options)
            seconds[name].append(time.perf_counter() - started)
    rows = {}
    for name in translators:
        same = sum(a == b for a, b in zip(hyps[name], hyps["float"]))
        rows[name] = {
            "bleu": round(sacrebleu_score(hyps[name], refs)["score"], 2),
            "words_per_s": round(words / min(seconds[name]), 1),
            "seconds": [round(s, 3) for s in seconds[name]],
            "equal_to_float": f"{same}/{len(sources)}",
        }
    return rows


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [
        f"int8 beside float: `{meta['folder']}` ({meta['kind']}), {meta['lines']} lines of `{meta['src']}`, "
        f"{meta['threads']} thread(s), fastest of {meta['rounds']} interleaved rounds; {meta['machine']}",
        "",
        "| chunk size | beam | variant | BLEU | vs float | words/s | x float | lines equal to float |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = next(r for r in rows if r["setting"] == row["setting"] and r["variant"] == "float")
        lines.append(
            f"| {row['chunk_size']} | {row['beam']} | {row['variant']} | {row['bleu']:.2f} | "
            f"{row['bleu'] - base['bleu']:+.2f} | {row['words_per_s']:.1f} | "
            f"{row['words_per_s'] / base['words_per_s']:.2f} | {row['equal_to_float']} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True, help="a float folder written by fairseq-hrt-export")
    p.add_argument("--src", required=True, help="source sentences, one per line (raw text)")
    p.add_argument("--ref", required=True, help="their references, one per line (raw text)")
    p.add_argument("--chunk-sizes", default="2,1", help="comma-separated (1: left to right)")
    p.add_argument("--beams", default="1,5", help="comma-separated")
    p.add_argument("--scales", default=",".join(INT8_SCALES), help="int8 variants: " + ", ".join(INT8_SCALES))
    p.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--out", required=True)
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    scales = [s for s in a.scales.split(",") if s]
    unknown = sorted(set(scales) - set(INT8_SCALES))
    if unknown:
        p.error(f"--scales {', '.join(unknown)}: one of {', '.join(INT8_SCALES)}")
    sources, refs = list(read_lines(a.src)), list(read_lines(a.ref))
    if len(sources) != len(refs):
        p.error(f"--src has {len(sources)} lines and --ref {len(refs)}: they must pair line by line")
    if a.lines:
        sources, refs = sources[: a.lines], refs[: a.lines]
    folders = variants(a.folder, os.path.join(a.out, "folders"), scales)
    translators = {name: Translator(folder, threads=a.threads) for name, folder in folders.items()}
    rows = []
    for k in (int(v) for v in a.chunk_sizes.split(",")):
        for beam in (int(v) for v in a.beams.split(",")):
            options = {"beam": beam, "chunk_size": k, "max_len_b": a.max_len_b}
            for name, row in measure(translators, sources, refs, options, a.rounds).items():
                rows.append({"setting": f"k{k}-b{beam}", "chunk_size": k, "beam": beam, "variant": name, **row})
            print(f"[int8_quality] chunk size {k}, beam {beam}: done", file=sys.stderr, flush=True)
    meta = {
        "folder": os.path.basename(os.path.normpath(a.folder)),
        "kind": translators["float"].model.kind,
        "src": os.path.basename(a.src),
        "lines": len(sources),
        "threads": a.threads,
        "rounds": a.rounds,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
    }
    table = markdown(rows, meta)
    print(table)
    report = json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    write_files(a.out, {"int8_quality.json": report, "int8_quality.md": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
