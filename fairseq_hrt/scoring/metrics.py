"""Corpus-level quality metrics and the speed unit used by the benchmarks.

* :func:`sacrebleu_score` -- detokenized corpus BLEU with sacreBLEU, always returned with
  its signature so that every reported number says exactly how it was computed.
* :func:`chrf_score` -- detokenized corpus chrF, with its signature.
* :func:`paired_bleu_difference` -- BLEU(a) - BLEU(b) on one test set with its paired-bootstrap
  95 % interval: whether a test set of this size can tell the two systems apart;
  :func:`mean_paired_bleu_difference`, the same for a mean over pairs (seeds).
* :func:`source_words` -- number of whitespace-separated source words; translation speed
  is reported in source words per second.
"""

from typing import Iterable, List, Sequence, Tuple

import numpy as np
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


def paired_bleu_difference(
    hyps: List[str], baseline: List[str], refs: List[str], samples: int = 1000, seed: int = 12345
) -> dict:
    """``BLEU(hyps) - BLEU(baseline)`` (detokenized, sacreBLEU's defaults) with its 95 %
    paired-bootstrap interval (Koehn, 2004): ``samples`` resamples of the test sentences with
    replacement, the same resample for both systems, each corpus BLEU recomputed from
    sacreBLEU's own per-sentence statistics, as ``sacrebleu --paired-bs`` does. sacreBLEU's
    test gives a p-value for "no difference"; a target of the form "within 0.3 BLEU" needs the
    interval of the difference itself, which sacreBLEU does not report.

    Returns ``{"difference", "ci95": [low, high], "pairs": 1, "samples", "seed", "signature"}``;
    ``seed`` fixes the resamples, so the same outputs give the same interval.
    """
    return mean_paired_bleu_difference([(hyps, baseline)], refs, samples, seed)


def mean_paired_bleu_difference(
    pairs: Sequence[Tuple[List[str], List[str]]], refs: List[str], samples: int = 1000, seed: int = 12345
) -> dict:
    """The mean over ``pairs`` ``(hyps, baseline)`` of ``BLEU(hyps) - BLEU(baseline)``, with
    the 95 % paired-bootstrap interval of that mean (:func:`paired_bleu_difference` for one
    pair): every system of every pair is resampled with the same sentences, as a seed mean of
    the same test set is. The interval is the test set's sampling noise; the spread between the
    pairs (seeds) is in the pairs themselves."""
    if not pairs:
        raise ValueError("no pair of systems to compare")
    if samples < 1:
        raise ValueError(f"samples must be positive, got {samples}")
    for hyps, baseline in pairs:
        _, refs = _check_pair(hyps, refs)
        _check_pair(baseline, refs, "baseline hypotheses")
    bleu = BLEU()
    # the statistics sacrebleu.significance resamples (per sentence: lengths and n-gram
    # matches/totals); a corpus BLEU is computed from their sum
    stats = [
        [np.asarray(bleu._extract_corpus_statistics(list(h), [refs]), dtype=np.float64) for h in pair] for pair in pairs
    ]

    def corpus(summed: np.ndarray) -> float:
        return float(bleu._compute_score_from_stats(list(summed)).score)

    difference = float(np.mean([corpus(a.sum(0)) - corpus(b.sum(0)) for a, b in stats]))
    n = len(refs)
    # a bootstrap resample as how often each sentence is drawn: counts @ stats is its sum
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=samples).astype(np.float64)
    diffs = np.zeros(samples)
    for a, b in stats:
        diffs += [corpus(x) - corpus(y) for x, y in zip(counts @ a, counts @ b)]
    low, high = np.quantile(diffs / len(stats), [0.025, 0.975])
    return {
        "difference": difference,
        "ci95": [float(low), float(high)],
        "pairs": len(stats),
        "samples": samples,
        "seed": seed,
        "signature": str(bleu.get_signature()),
    }


def source_words(lines: Iterable[str]) -> int:
    """Number of whitespace-separated words in ``lines`` (the unit of the speed metric:
    translation speed = source words / second)."""
    if isinstance(lines, str):
        lines = [lines]
    return sum(len(line.split()) for line in lines)
