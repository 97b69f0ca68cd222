"""Corpus-level quality metrics and the speed unit used by the benchmarks.

* :func:`sacrebleu_score` -- detokenized corpus BLEU with sacreBLEU, always returned with
  its signature so that every reported number says exactly how it was computed.
* :func:`chrf_score` -- detokenized corpus chrF, with its signature.
* :func:`source_words` -- number of whitespace-separated source words; translation speed
  is reported in source words per second.
"""

from typing import Iterable, List

from sacrebleu.metrics import BLEU, CHRF


def _check_pair(hyps, refs, what="hypotheses", other="references"):
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError(f"{what} and {other} must be lists of strings, not a single string")
    hyps, refs = list(hyps), list(refs)
    if not hyps or not refs:
        raise ValueError(f"cannot score an empty corpus: got {len(hyps)} {what} and {len(refs)} {other}")
    if len(hyps) != len(refs):
        raise ValueError(
            f"number of {what} ({len(hyps)}) and {other} ({len(refs)}) differ; they must be aligned line by line"
        )
    return hyps, refs


def sacrebleu_score(hyps: List[str], refs: List[str], tokenize: str = "13a", **bleu_kwargs) -> dict:
    """Corpus BLEU of detokenized ``hyps`` against one reference per line.

    Returns a dict with:

    * ``score`` -- BLEU (0-100), float
    * ``signature`` -- sacreBLEU signature, e.g. ``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``
    * ``bleu`` -- sacreBLEU's one-line result string (``BLEU = 35.2 66.1/41.3/...``)
    * ``precisions``, ``bp``, ``sys_len``, ``ref_len``, ``tokenize``, ``n`` (segments)

    ``bleu_kwargs`` go to :class:`sacrebleu.metrics.BLEU` (e.g. ``lowercase=True``).
    Raises ``ValueError`` when the lists are empty or of different lengths.
    """
    hyps, refs = _check_pair(hyps, refs)
    bleu = BLEU(tokenize=tokenize, **bleu_kwargs)
    result = bleu.corpus_score(hyps, [refs])
    return {
        "score": float(result.score),
        "signature": str(bleu.get_signature()),
        "bleu": str(result),
        "precisions": [float(p) for p in result.precisions],
        "bp": float(result.bp),
        "sys_len": int(result.sys_len),
        "ref_len": int(result.ref_len),
        "tokenize": tokenize,
        "n": len(hyps),
    }


def chrf_score(hyps: List[str], refs: List[str]) -> dict:
    """Corpus chrF (sacreBLEU's defaults: character 6-grams, beta 2) of detokenized ``hyps``
    against one reference per line: ``{"score", "signature"}``. Reported beside BLEU, where a
    close BLEU can hide a worse translation."""
    hyps, refs = _check_pair(hyps, refs)
    chrf = CHRF()
    return {"score": float(chrf.corpus_score(hyps, [refs]).score), "signature": str(chrf.get_signature())}


def source_words(lines: Iterable[str]) -> int:
    """Number of whitespace-separated words in ``lines`` (the unit of the speed metric:
    translation speed = source words / second)."""
    if isinstance(lines, str):
        lines = [lines]
    return sum(len(line.split()) for line in lines)
