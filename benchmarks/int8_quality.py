#!/usr/bin/env python
"""int8 beside float on a trained model: BLEU and speed of an exported folder and of its int8
copies (one weight scale per matrix, ``tensor``, or per output column, ``channel``), decoded by
the runtime (``hrt_runtime.Translator``, ONNX Runtime, no PyTorch) on the same sources; with
``--ctranslate2 CHECKPOINT`` (an AT checkpoint, the folder's own), also CTranslate2's conversion
of it in float32 and int8 (compute types), left to right (chunk size 1), tokenized as the
runtime tokenizes (:mod:`benchmarks.ct2_text_child`, a child process without PyTorch).

For every chunk size and beam asked, each variant translates the whole input once per round, the
variants interleaved in every round (so that a slower moment of the machine falls on all of
them); speed is the fastest round's source words a second, quality sacreBLEU against the
references and the share of lines equal to its own float's (ONNX Runtime's float for its int8
copies, CTranslate2's float32 for its int8). int8 speed stands next to its BLEU.

    python -m benchmarks.int8_quality --folder model-onnx --src test.en --ref test.de --out DIR \\
        [--ctranslate2 checkpoint.pt --data data-bin]
"""

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ct2_reference  # noqa: E402
from benchmarks.ct2_child import ChildFailed  # noqa: E402
from benchmarks.ct2_text_child import TextChild  # noqa: E402
from benchmarks.machine import cpu_isa, cpu_name  # noqa: E402
from benchmarks.report_files import write_files  # noqa: E402
from fairseq_hrt.export.exporter import INT8_SCALES, quantize_folder  # noqa: E402
from fairseq_hrt.scoring.metrics import sacrebleu_score  # noqa: E402
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.text_input import read_lines  # noqa: E402

CT2_PREFIX = "ct2-"  # CTranslate2's variants: ct2-<compute type>
CT2_FLOAT = CT2_PREFIX + "float32"

# a variant's decoding of the sources under a chunk size and beam: (translations, seconds)
Decoder = Callable[[Dict], tuple]


def variants(folder: str, work: str, scales: List[str]) -> Dict[str, str]:
    """``{name: folder}``: the float folder and an int8 copy of it per scale (made in ``work``)."""
    out = {"float": folder}
    for scale in scales:
        out[f"int8-{scale}"] = path = os.path.join(work, f"int8-{scale}")
        quantize_folder(folder, path, scale)
    return out


def own_float(name: str) -> str:
    """The variant whose translations ``name``'s are compared with: its engine's float."""
    return CT2_FLOAT if name.startswith(CT2_PREFIX) else "float"


def runtime_decoder(translator: Translator, sources: List[str]) -> Decoder:
    def decode(options):
        started = time.perf_counter()
        hyps = translator.translate(sources, **options)
        return hyps, time.perf_counter() - started

    return decode


def ct2_decoder(child: TextChild, compute_type: str) -> Decoder:
    """CTranslate2 decodes left to right only: its rows are made where the chunk size is 1."""

    def decode(options):
        return child.translate(compute_type, options["beam"], options["max_len_b"])

    return decode


def measure(decoders: Dict[str, Decoder], sources, refs, options: Dict, rounds: int) -> Dict[str, Dict]:
    """Each variant's BLEU, fastest words/s and lines equal to its own float's under ``options``."""
    words = sum(len(line.split()) for line in sources)
    seconds = {name: [] for name in decoders}
    hyps = {}
    for _ in range(rounds):
        for name, decode in decoders.items():
            hyps[name], spent = decode(options)
            seconds[name].append(spent)
    rows = {}
    for name in decoders:
        base = hyps.get(own_float(name))
        same = None if base is None else sum(a == b for a, b in zip(hyps[name], base))
        rows[name] = {
            "bleu": round(sacrebleu_score(hyps[name], refs)["score"], 2),
            "words_per_s": round(words / min(seconds[name]), 1),
            "seconds": [round(s, 3) for s in seconds[name]],
            "equal_to_float": "" if same is None else f"{same}/{len(sources)}",
        }
        if name.startswith(CT2_PREFIX) and "float" in hyps:  # the tokenization check: same text, same model
            rows[name]["equal_to_onnxruntime_float"] = (
                f"{sum(a == b for a, b in zip(hyps[name], hyps['float']))}/{len(sources)}"
            )
    return rows


def one_line(error: Exception) -> str:
    """An error's message on one line (CTranslate2's converter lists its reasons line by line)."""
    parts = [part.strip().lstrip("- ").strip() for part in str(error).splitlines()]
    return " ".join(part for part in parts if part) or type(error).__name__


def start_ct2(a, config: Dict, sources: List[str], notes: List[str]) -> Optional[TextChild]:
    """The CTranslate2 child for ``--ctranslate2``'s checkpoint, or None (and why, in ``notes``:
    CTranslate2 missing, a checkpoint it cannot convert, a compute type this CPU lacks)."""
    reason = ct2_reference.unavailable_reason()
    if reason is None:
        try:
            model_dir = ct2_reference.convert(
                a.ctranslate2,
                a.data or a.folder,
                os.path.join(a.out, "folders"),
                config["source_lang"],
                config["target_lang"],
            )
            spm = config.get("sentencepiece_model")
            spm = os.path.join(a.folder, spm) if spm else None
            child = TextChild(model_dir, sources, a.ct2_compute_types.split(","), spm, threads=a.threads)
        except (ChildFailed, ValueError, RuntimeError, OSError, KeyError, ImportError) as e:
            reason = one_line(e)
    if reason is not None:
        notes.append(
            f"--ctranslate2 {a.ctranslate2}: {reason}; no CTranslate2 rows, the ONNX Runtime rows are measured"
        )
        return None
    notes.extend(f"CTranslate2 {compute_type}: {why}" for compute_type, why in child.errors.items())
    return child


RUNTIME_LABELS = {
    "float": "float",
    "int8-channel": "int8, one scale per output column",
    "int8-tensor": "int8, one scale per matrix",
}


def label(name: str) -> str:
    """A variant as the table names it: its engine, and its weights or compute type."""
    if name.startswith(CT2_PREFIX):
        return f"CTranslate2, compute type {name[len(CT2_PREFIX) :]}"
    return "ONNX Runtime, " + RUNTIME_LABELS.get(name, name)


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [
        f"int8 beside float: `{meta['folder']}` ({meta['kind']}), {meta['lines']} lines of `{meta['src']}`, "
        f"{meta['threads']} thread(s), fastest of {meta['rounds']} interleaved rounds; {meta['cpu']} "
        f"({', '.join(meta['cpu_isa']) or 'no listed ISA extension'}), {meta['cpus']} CPUs",
        *([""] + [f"- {note}" for note in meta["notes"]] if meta["notes"] else []),
        "",
        "| chunk size | beam | variant | BLEU | vs its float | words/s | x its float | lines equal to its float |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = next(
            (r for r in rows if r["setting"] == row["setting"] and r["variant"] == own_float(row["variant"])), None
        )
        versus = (
            ("", "")
            if base is None
            else (
                f"{row['bleu'] - base['bleu']:+.2f}",
                f"{row['words_per_s'] / base['words_per_s']:.2f}",
            )
        )
        lines.append(
            f"| {row['chunk_size']} | {row['beam']} | {label(row['variant'])} | {row['bleu']:.2f} | {versus[0]} | "
            f"{row['words_per_s']:.1f} | {versus[1]} | {row['equal_to_float']} |"
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
    p.add_argument(
        "--ctranslate2",
        metavar="CHECKPOINT",
        help="the fairseq AT checkpoint the folder was exported from: CTranslate2's rows too (chunk size 1)",
    )
    p.add_argument("--data", help="with --ctranslate2: the data-bin folder of its dictionaries (default: --folder)")
    p.add_argument("--ct2-compute-types", default="float32,int8", help="with --ctranslate2: comma-separated")
    p.add_argument("--lines", type=int, default=0, help="the first N lines only (0: all)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--out", required=True)
    return p


def read_inputs(p: argparse.ArgumentParser, a) -> tuple:
    """``(scales, sources, refs)`` of the command line; bad input is one line (``p.error``)."""
    scales = [s for s in a.scales.split(",") if s]
    unknown = sorted(set(scales) - set(INT8_SCALES))
    if unknown:
        p.error(f"--scales {', '.join(unknown)}: one of {', '.join(INT8_SCALES)}")
    if a.ctranslate2 and not os.path.isfile(a.ctranslate2):
        p.error(f"--ctranslate2 {a.ctranslate2}: no such checkpoint file")
    if a.ctranslate2 and "1" not in a.chunk_sizes.split(","):
        p.error(f"--ctranslate2 decodes left to right only: add 1 to --chunk-sizes {a.chunk_sizes}")
    sources, refs = list(read_lines(a.src)), list(read_lines(a.ref))
    if len(sources) != len(refs):
        p.error(f"--src has {len(sources)} lines and --ref {len(refs)}: they must pair line by line")
    if a.lines:
        sources, refs = sources[: a.lines], refs[: a.lines]
    return scales, sources, refs


def measure_settings(a, translators: Dict[str, Translator], child: Optional[TextChild], sources, refs) -> List[Dict]:
    """The rows of every chunk size and beam asked (CTranslate2's at chunk size 1 only)."""
    rows = []
    for k in (int(v) for v in a.chunk_sizes.split(",")):
        for beam in (int(v) for v in a.beams.split(",")):
            decoders = {name: runtime_decoder(t, sources) for name, t in translators.items()}
            if child is not None and k == 1:
                decoders.update({CT2_PREFIX + c: ct2_decoder(child, c) for c in child.loaded})
            options = {"beam": beam, "chunk_size": k, "max_len_b": a.max_len_b}
            for name, row in measure(decoders, sources, refs, options, a.rounds).items():
                engine = "ctranslate2" if name.startswith(CT2_PREFIX) else "onnxruntime"
                setting = {"setting": f"k{k}-b{beam}", "chunk_size": k, "beam": beam, "variant": name, "engine": engine}
                if engine == "ctranslate2":
                    setting["compute_type"] = name[len(CT2_PREFIX) :]
                rows.append({**setting, **row})
            print(f"[int8_quality] chunk size {k}, beam {beam}: done", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    scales, sources, refs = read_inputs(p, a)
    folders = variants(a.folder, os.path.join(a.out, "folders"), scales)
    translators = {name: Translator(folder, threads=a.threads) for name, folder in folders.items()}
    notes = []
    child = start_ct2(a, translators["float"].model.config, sources, notes) if a.ctranslate2 else None
    for note in notes:
        print(f"[int8_quality] {note}", file=sys.stderr, flush=True)
    try:
        rows = measure_settings(a, translators, child, sources, refs)
    finally:
        if child is not None:
            child.close()
    meta = {
        "folder": os.path.basename(os.path.normpath(a.folder)),
        "kind": translators["float"].model.kind,
        "src": os.path.basename(a.src),
        "lines": len(sources),
        "threads": a.threads,
        "rounds": a.rounds,
        "cpu": cpu_name(),
        "cpu_isa": cpu_isa(),
        "cpus": os.cpu_count(),
        "ctranslate2": None
        if child is None
        else {"version": child.ready["version"], "child_without_pytorch": not child.ready["torch_loaded"]},
        "notes": notes,
    }
    table = markdown(rows, meta)
    print(table)
    report = json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n"
    write_files(a.out, {"int8_quality.json": report, "int8_quality.md": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
