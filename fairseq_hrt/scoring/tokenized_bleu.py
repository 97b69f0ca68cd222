"""The papers' BLEU: case-sensitive corpus BLEU on Moses-tokenized text, as multi-bleu.perl scores it.

The HRT and Mask-Predict papers (and the NAT papers before them) report BLEU computed by Moses'
``multi-bleu.perl`` on tokenized text, for En-De after fairseq's compound splitting
(``examples/scaling_nmt/scripts/compound_split_bleu.sh``). That number is not comparable with
detokenized sacreBLEU (:func:`fairseq_hrt.scoring.metrics.sacrebleu_score`, this project's
headline): it depends on the tokenizer, and splitting compounds adds easy ``##AT##-##AT##``
matches. It is computed here only to set results beside the papers' tables.

Pure functions, no files:

* :func:`moses_tokenize` -- Moses' ``tokenizer.perl -l LANG`` (its Python port, sacremoses;
  no ``-a``, XML escaping on as in tokenizer.perl; escaping maps characters one to one, so it
  does not change BLEU). sacremoses keeps tokenizer.perl's behaviour from before Moses' change
  of November 2018 (mosesdecoder#204) that splits a sentence-final period off an abbreviation
  (``... the U.S.``) unconditionally; the two differ only on lines ending in such a word.
* :func:`split_compounds` -- ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``.
* :func:`remove_romanian_diacritics` -- Sennrich's WMT16 ``normalise-romanian.py`` then
  ``remove-diacritics.py`` (s/t-cedilla to s/t-comma, then ș ț ă â î to s t a a i).
* :func:`multi_bleu` -- multi-bleu.perl's corpus BLEU of tokenized lines.
* :func:`tokenized_bleu` -- all of it, with a sentence stating what was applied.

multi-bleu.perl, what :func:`multi_bleu` reproduces: tokens are the line split at whitespace;
case-sensitive (it lowercases only with ``-lc``, not used by the papers); clipped n-gram matches
for n = 1..4 summed over the corpus; the brevity penalty ``exp(1 - r / c)`` from the corpus
lengths when c < r (with one reference, r is the reference's length); no smoothing, so BLEU is 0
when any of the four precisions is 0. That is sacreBLEU with ``tokenize='none'`` and
``smooth_method='none'``, which computes it here. One difference is left: perl splits only at
ASCII whitespace, Python also at e.g. a no-break space; Moses tokenization turns every kind of
whitespace into a space, so the two agree on what :func:`tokenized_bleu` scores.
"""

import functools
import re
from typing import Iterable, List

import sacremoses
from sacremoses import MosesTokenizer

from fairseq_hrt.scoring.metrics import sacrebleu_score

COMPOUND_MARK = "##AT##-##AT##"
# compound_split_bleu.sh's perl substitution; Python's re.sub matches left to right without
# overlap as perl's s///g does, so "a-b-c" becomes "a ##AT##-##AT## b-c" in both
_COMPOUND = re.compile(r"(\S)-(\S)")

# normalise-romanian.py (s/t with cedilla, the pre-Unicode-4 spelling, to s/t with comma below)
_RO_NORMALISE = str.maketrans({"\u015e": "\u0218", "\u015f": "\u0219", "\u0162": "\u021a", "\u0163": "\u021b"})
# remove-diacritics.py
_RO_DIACRITICS = str.maketrans(
    {
        "\u0218": "S",
        "\u0219": "s",
        "\u021a": "T",
        "\u021b": "t",
        "\u0102": "A",
        "\u0103": "a",
        "\u00c2": "A",
        "\u00e2": "a",
        "\u00ce": "I",
        "\u00ee": "i",
    }
)


@functools.lru_cache(maxsize=8)
def _tokenizer(lang: str) -> MosesTokenizer:
    # building one reads the language's non-breaking prefixes: once per language
    return MosesTokenizer(lang=lang)


def tokenizer_description(lang: str) -> str:
    """What :func:`moses_tokenize` runs, as the reports state it."""
    return f"Moses tokenizer -l {lang} (sacremoses {sacremoses.__version__}, no -a)"


def moses_tokenize(lines: Iterable[str], lang: str) -> List[str]:
    """``tokenizer.perl -l lang`` of each line (sacremoses), tokens joined by single spaces."""
    tokenizer = _tokenizer(lang)
    return [tokenizer.tokenize(line, return_str=True, escape=True) for line in lines]


def split_compounds(line: str) -> str:
    """fairseq's compound splitting for En-De BLEU: ``a-b`` -> ``a ##AT##-##AT## b``."""
    return _COMPOUND.sub(r"\1 " + COMPOUND_MARK + r" \2", line)


def remove_romanian_diacritics(line: str) -> str:
    """normalise-romanian.py then remove-diacritics.py (rsennrich/wmt16-scripts)."""
    return line.translate(_RO_NORMALISE).translate(_RO_DIACRITICS)


def multi_bleu(hyps: List[str], refs: List[str]) -> dict:
    """multi-bleu.perl's corpus BLEU of tokenized ``hyps`` against one tokenized reference per line.

    Returns :func:`~fairseq_hrt.scoring.metrics.sacrebleu_score`'s dict (``score``,
    ``precisions``, ``bp``, ``sys_len``, ``ref_len``, ``signature`` with ``tok:none|smooth:none``)
    plus ``ratio`` and ``multi_bleu``: the line multi-bleu.perl prints for the same files
    (``BLEU = 27.30, 58.9/33.2/21.0/13.8 (BP=1.000, ratio=1.012, hyp_len=..., ref_len=...)``).
    Raises ``ValueError`` when the lists are empty or of different lengths.
    """
    result = sacrebleu_score(hyps, refs, tokenize="none", smooth_method="none")
    ratio = result["sys_len"] / result["ref_len"] if result["ref_len"] else 0.0
    precisions = "/".join(f"{p:.1f}" for p in result["precisions"])
    result["ratio"] = ratio
    result["multi_bleu"] = (
        f"BLEU = {result['score']:.2f}, {precisions} (BP={result['bp']:.3f}, ratio={ratio:.3f}, "
        f"hyp_len={result['sys_len']}, ref_len={result['ref_len']})"
    )
    return result


def tokenized_bleu(
    hyps: List[str],
    refs: List[str],
    lang: str,
    compound_split: bool = False,
    remove_ro_diacritics: bool = False,
) -> dict:
    """The papers' BLEU of detokenized ``hyps`` against detokenized ``refs`` in language ``lang``.

    Both sides get the same steps: Romanian diacritics removed (``remove_ro_diacritics``),
    Moses tokenization, compound splitting (``compound_split``), then :func:`multi_bleu`.
    Returns :func:`multi_bleu`'s dict plus ``tokenizer``, ``compound_split``,
    ``remove_ro_diacritics`` and ``processing``: one sentence stating all of it.
    """
    steps = []
    if remove_ro_diacritics:
        hyps = [remove_romanian_diacritics(h) for h in hyps]
        refs = [remove_romanian_diacritics(r) for r in refs]
        steps.append("Romanian diacritics removed (normalise-romanian.py + remove-diacritics.py)")
    hyps, refs = moses_tokenize(hyps, lang), moses_tokenize(refs, lang)
    steps.append(tokenizer_description(lang))
    if compound_split:
        hyps = [split_compounds(h) for h in hyps]
        refs = [split_compounds(r) for r in refs]
        steps.append(f"compounds split (a-b -> a {COMPOUND_MARK} b, fairseq's compound_split_bleu.sh)")
    else:
        steps.append("no compound splitting")
    result = multi_bleu(hyps, refs)
    result.update(
        tokenizer=tokenizer_description(lang),
        compound_split=bool(compound_split),
        remove_ro_diacritics=bool(remove_ro_diacritics),
        processing="; ".join(steps) + " on hypothesis and reference; case-sensitive multi-bleu.perl BLEU",
    )
    return result
