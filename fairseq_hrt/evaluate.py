"""One report of a test set's translation quality: today's metrics and the papers' BLEU beside them.

    python -m fairseq_hrt.evaluate --hyp H --ref R --src S --target-lang de [--compound-split]
        [--remove-ro-diacritics] [--comet-model DIR] [--json OUT.json]

``--hyp``, ``--ref`` and ``--src`` are detokenized text, one sentence per line, aligned line by
line. The report holds:

* sacreBLEU with its signature -- the headline, comparable across papers that quote sacreBLEU
  (:func:`fairseq_hrt.scoring.metrics.sacrebleu_score`);
* the papers' tokenized BLEU (:mod:`fairseq_hrt.scoring.tokenized_bleu`): multi-bleu.perl on
  Moses-tokenized text, with what was applied before it stated (compound splitting for En-De
  with ``--compound-split``, Romanian diacritics removed with ``--remove-ro-diacritics``; both
  only for this number, never for the others);
* chrF with its signature;
* COMET from a local model (``--comet-model``, or ``$COMET_MODEL``), or ``COMET: not available
  (...)``: weights are never downloaded (:mod:`fairseq_hrt.scoring.comet`).

Files of different lengths, or an empty one, stop it with one line naming them before anything is
scored. ``--json`` also writes every number and signature to a file. Exit status: 0; 1 when the
files cannot be scored or COMET failed with a model given (the other metrics are still reported).
"""

import argparse
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional

from fairseq_hrt.scoring.comet import CometUnavailable, comet_score
from fairseq_hrt.scoring.metrics import chrf_score, sacrebleu_score
from fairseq_hrt.scoring.tokenized_bleu import tokenized_bleu
from hrt_runtime.text_input import read_lines

PROG = "python -m fairseq_hrt.evaluate"


class EvaluationInputError(ValueError):
    """Files that cannot be scored together; the message is one line saying what to do."""


def check_line_counts(lines: Dict[str, List[str]], paths: Dict[str, str]):
    """Raise :class:`EvaluationInputError` when a file is empty or the files differ in length."""
    empty = [name for name, text in lines.items() if not text]
    if empty:
        names = ", ".join(f"--{name} {paths[name]}" for name in empty)
        raise EvaluationInputError(
            f"{names} {'is' if len(empty) == 1 else 'are'} empty: nothing to score; "
            "decode the test set again (or point to the file that holds it)"
        )
    counts = {name: len(text) for name, text in lines.items()}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"--{name} {paths[name]} has {n} lines" for name, n in counts.items())
        raise EvaluationInputError(
            f"the files differ in length ({listing}); they must be aligned line by line: decode the whole test "
            "set again, with the source file whose reference is given"
        )


def _comet(
    srcs: List[str], hyps: List[str], refs: List[str], model: Optional[str], encoder: Optional[str], gpus: int
) -> dict:
    try:
        result = comet_score(srcs, hyps, refs, model_path=model, encoder_path=encoder, gpus=gpus)
    except CometUnavailable as e:
        return {"available": False, "score": None, "reason": str(e)}
    except (RuntimeError, ValueError) as e:  # a model given that does not load or score
        return {"available": True, "score": None, "error": f"{type(e).__name__}: {e}"}
    return {
        "available": True,
        "score": result["score"],
        "model": result["model"],
        "encoder": result["encoder"],
        "n": result["n"],
    }


def evaluate(
    hyps: List[str],
    refs: List[str],
    srcs: List[str],
    target_lang: str,
    compound_split: bool = False,
    remove_ro_diacritics: bool = False,
    comet_model: Optional[str] = None,
    comet_encoder: Optional[str] = None,
    comet_gpus: int = 0,
) -> dict:
    """Every metric of the report as one dict (what ``--json`` writes, less the file names)."""
    sacrebleu = sacrebleu_score(hyps, refs)
    return {
        "segments": len(hyps),
        "target_lang": target_lang,
        "sacrebleu": {key: sacrebleu[key] for key in ("score", "signature", "bleu")},
        "tokenized_bleu": {
            key: value
            for key, value in tokenized_bleu(
                hyps, refs, target_lang, compound_split=compound_split, remove_ro_diacritics=remove_ro_diacritics
            ).items()
            if key not in ("bleu", "tokenize", "n")  # sacreBLEU's own names for what multi_bleu states
        },
        "chrf": chrf_score(hyps, refs),
        "comet": _comet(srcs, hyps, refs, comet_model, comet_encoder, comet_gpus),
    }


def _first_sentence(message: str) -> str:
    # the COMET reasons end with a long how-to (kept in full in the JSON)
    return message.split(". ")[0].rstrip(".")


def format_report(report: dict) -> str:
    """The text table printed by the command."""
    tok = report["tokenized_bleu"]
    comet = report["comet"]
    if comet["score"] is not None:
        comet_line = f"{comet['score']:.4f}  model: {comet['model']}"
    elif not comet["available"]:
        comet_line = (
            f"not available ({_first_sentence(comet['reason'])}; give a local model with --comet-model DIR, "
            "docs/measuring.md)"
        )
    else:
        comet_line = f"failed ({comet['error']})"
    files = report.get("files", {})
    rows = [
        f"{report['segments']} segments, target language {report['target_lang']}"
        + (f"; hyp {files['hyp']}, ref {files['ref']}" if files else ""),
        f"sacreBLEU       {report['sacrebleu']['score']:6.2f}  {report['sacrebleu']['signature']}",
        f"tokenized BLEU  {tok['score']:6.2f}  {tok['multi_bleu']}",
        f"                        the papers' BLEU, not comparable with sacreBLEU: {tok['processing']}",
        f"chrF            {report['chrf']['score']:6.2f}  {report['chrf']['signature']}",
        f"COMET           {comet_line}",
    ]
    return "\n".join(rows)


def _write_json_atomic(path: str, report: dict):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".evaluate-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="sacreBLEU (headline) with its signature, the papers' tokenized BLEU, chrF and COMET of one test "
        "set; detokenized files, one sentence per line.",
    )
    parser.add_argument("--hyp", required=True, metavar="FILE", help="system translations (detokenized)")
    parser.add_argument("--ref", required=True, metavar="FILE", help="references (detokenized)")
    parser.add_argument("--src", required=True, metavar="FILE", help="source sentences (for COMET)")
    parser.add_argument(
        "--target-lang", required=True, metavar="LANG", help="target language code, for the Moses tokenizer (de, ro)"
    )
    parser.add_argument(
        "--compound-split",
        action="store_true",
        help="tokenized BLEU only: split hyphenated compounds (a-b -> a ##AT##-##AT## b) as the En-De papers do",
    )
    parser.add_argument(
        "--remove-ro-diacritics",
        action="store_true",
        help="tokenized BLEU only: normalise and remove Romanian diacritics on both sides first, as the En-Ro NAT "
        "papers do (WMT16 scripts of Sennrich et al.); needs --target-lang ro",
    )
    parser.add_argument(
        "--comet-model", metavar="DIR", help="a local COMET model directory or .ckpt (default: $COMET_MODEL)"
    )
    parser.add_argument(
        "--comet-encoder", metavar="DIR", help="its encoder's config + tokenizer files (default: $COMET_ENCODER)"
    )
    parser.add_argument("--comet-gpus", type=int, default=0, choices=(0, 1), help="COMET on CPU (0) or one GPU (1)")
    parser.add_argument("--json", metavar="OUT.json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.remove_ro_diacritics and args.target_lang != "ro":
        parser.error(f"--remove-ro-diacritics is for Romanian targets (--target-lang ro), got {args.target_lang}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = {"hyp": args.hyp, "ref": args.ref, "src": args.src}
    try:
        for name, path in paths.items():
            if not os.path.isfile(path):
                raise EvaluationInputError(f"--{name} {path} does not exist")
        lines = {name: read_lines(path) for name, path in paths.items()}
        check_line_counts(lines, paths)
    except EvaluationInputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    report = {
        "files": {name: os.path.abspath(path) for name, path in paths.items()},
        **evaluate(
            lines["hyp"],
            lines["ref"],
            lines["src"],
            args.target_lang,
            compound_split=args.compound_split,
            remove_ro_diacritics=args.remove_ro_diacritics,
            comet_model=args.comet_model,
            comet_encoder=args.comet_encoder,
            comet_gpus=args.comet_gpus,
        ),
    }
    print(format_report(report), flush=True)
    if args.json:
        _write_json_atomic(args.json, report)
    return 1 if report["comet"].get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
