"""Lexical shortlists: ``fairseq-hrt-shortlist`` builds them, ``--shortlist FILE`` decodes with one.

After Marian's CPU systems (Junczys-Dowmunt et al. 2018; WNGT 2019, "a shortlist selects the
75 most common target words and up to 75 most probable translations per input-batch word"):
for every source token the target tokens it most probably translates into, plus the most
frequent target tokens. Decoding a batch computes the output layer only for the union of the
shortlists of the batch's source tokens (plus the frequent tokens and the special symbols),
a few hundred rows instead of the whole vocabulary.

Translation scores come from the training data; no external aligner is needed:

* ``ibm1`` (default): IBM Model 1 translation probabilities ``p(t | s)`` (with a NULL source
  word), estimated by EM over all (source, target) token pairs of every sentence pair, with
  numpy bincounts. Marian's shortlists are the lexical tables of an alignment model
  (fast_align, IBM Model 2 with a diagonal prior); Model 1 is the same estimate without the
  position prior, which matters for alignments, not for *which* words translate each other.
  EM explains away frequent target words (``die``, ``.``) that co-occur with every source
  word: they end up under the source words that generate them (and in the frequent list).
* ``dice``: the Dice coefficient of sentence-level co-occurrence,
  ``2 c(s, t) / (c(s) + c(t))`` (one pass, no iterations).

The file stores the dictionary fingerprint of the data it was built from
(:func:`fairseq_hrt.symbols.dictionary_fingerprint`, also stored in checkpoints): decoding
with a shortlist of another dictionary is refused.
"""

import argparse
import logging
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from fairseq.data import Dictionary, data_utils
from torch import Tensor
from tqdm import tqdm

from fairseq_hrt.cli_logging import RefusedOptions, setup_logging
from fairseq_hrt.symbols import add_hrt_symbols, dictionary_fingerprint, hrt_symbols
from hrt_runtime import text_input

logger = logging.getLogger(__name__)

FILE_FORMAT = "fairseq-hrt-shortlist"
FILE_VERSION = 1
METHODS = ("ibm1", "dice")


# ------------------------------------------------------------------------ the shortlist


class Shortlist:
    """Per source token its best target tokens (``translations``: ``(source vocab, N)``, best
    first, ``-1`` where a token has fewer), and the target tokens every batch may produce
    (``always``: the frequent tokens and the special symbols)."""

    def __init__(
        self,
        translations: Tensor,
        always: Tensor,
        fingerprint: str,
        source_size: int,
        target_size: int,
        settings: Optional[Dict] = None,
    ):
        if translations.dim() != 2 or translations.size(0) != source_size:
            raise ValueError(f"shortlist table has shape {tuple(translations.shape)}, expected ({source_size}, N)")
        self.translations = translations.long()
        self.always = torch.unique(always.long())
        self.fingerprint = fingerprint
        self.source_size = source_size
        self.target_size = target_size
        self.settings = dict(settings or {})
        self._on_device: Dict[torch.device, Tuple[Tensor, Tensor]] = {}
        self.batches = 0  # candidates() calls and their total size, for reports
        self.total_candidates = 0

    def _tables(self, device) -> Tuple[Tensor, Tensor]:
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = (self.translations.to(device), self.always.to(device))
        return self._on_device[device]

    def candidates(self, src_tokens: Tensor, pad: int) -> Tensor:
        """Sorted target ids a batch with these source tokens may produce: the union of their
        shortlists, the frequent tokens and the special symbols."""
        translations, always = self._tables(src_tokens.device)
        ids = torch.unique(src_tokens)
        ids = ids[ids.ne(pad) & ids.lt(self.source_size) & ids.ge(0)]
        rows = translations.index_select(0, ids).view(-1)
        candidates = torch.unique(torch.cat([always, rows[rows.ge(0)]]))
        self.batches += 1
        self.total_candidates += candidates.numel()
        return candidates

    def mean_candidates(self) -> float:
        """Average candidate-set size of the batches decoded so far."""
        return self.total_candidates / self.batches if self.batches else 0.0

    # -------------------------------------------------------------------- file format

    def save(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(
            {
                "format": FILE_FORMAT,
                "version": FILE_VERSION,
                "dictionary": self.fingerprint,
                "source_size": self.source_size,
                "target_size": self.target_size,
                "translations": self.translations.to(torch.int32),
                "always": self.always.to(torch.int32),
                "settings": self.settings,
            },
            path,
        )

    @classmethod
    def load(cls, path: str) -> "Shortlist":
        """Read a file of :meth:`save`; a missing or garbled file gets one clear error."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--shortlist {path}: no such file (build one with fairseq-hrt-shortlist)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file: one message
            raise RefusedOptions(
                f"--shortlist {path} is not a shortlist file of fairseq-hrt-shortlist ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
            raise RefusedOptions(f"--shortlist {path} is not a shortlist file of fairseq-hrt-shortlist")
        if state.get("version") != FILE_VERSION:
            raise RefusedOptions(
                f"--shortlist {path}: file version {state.get('version')}, this code reads {FILE_VERSION}; rebuild it"
            )
        try:
            shortlist = cls(
                state["translations"],
                state["always"],
                str(state["dictionary"]),
                int(state["source_size"]),
                int(state["target_size"]),
                state.get("settings"),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RefusedOptions(f"--shortlist {path} is damaged ({type(e).__name__}: {e}); rebuild it") from None
        for name, table in (("translations", shortlist.translations), ("always", shortlist.always)):
            if table.numel() and (int(table.max()) >= shortlist.target_size or int(table.min()) < -1):
                raise RefusedOptions(f"--shortlist {path} is damaged: {name} holds ids outside the target vocabulary")
        return shortlist

    def check_dictionary(self, fingerprint: str, source_size: int, target_size: int, path: str, data: str):
        """Refuse a shortlist built for other dictionaries than the task's."""
        if fingerprint != self.fingerprint or (source_size, target_size) != (self.source_size, self.target_size):
            raise RefusedOptions(
                f"--shortlist {path} was built for another dictionary (fingerprint {self.fingerprint}, "
                f"{self.source_size} source / {self.target_size} target symbols); the data directory {data} has "
                f"fingerprint {fingerprint} ({source_size} / {target_size} symbols). Build the shortlist with "
                "fairseq-hrt-shortlist from the data directory the model was trained on."
            )


def load_for_decoding(path: str, source_dictionary, target_dictionary, fingerprint: str, data: str) -> Shortlist:
    """``--shortlist path``: the file read and checked against the dictionaries it will be used
    with (``fingerprint``: :func:`fairseq_hrt.symbols.dictionary_fingerprint` of them; ``data``:
    their data directory, for the message when they differ); logs what it holds."""
    shortlist = Shortlist.load(path)
    shortlist.check_dictionary(fingerprint, len(source_dictionary), len(target_dictionary), path, data)
    logger.info(
        "--shortlist %s: up to %s target tokens per source token, %d always (%s)",
        path,
        shortlist.settings.get("per_source", "?"),
        shortlist.always.numel(),
        ", ".join(f"{k} {v}" for k, v in shortlist.settings.items()),
    )
    return shortlist


# ------------------------------------------------------------------------ statistics


def _flatten(sentences: Sequence[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(s) for s in sentences), dtype=np.int64, count=len(sentences))
    flat = (
        np.concatenate([np.asarray(s, dtype=np.int64) for s in sentences]) if len(sentences) else np.zeros(0, np.int64)
    )
    return flat, lengths


def pair_entries(src_sents: Sequence[np.ndarray], tgt_sents: Sequence[np.ndarray], null: Optional[int] = None):
    """Every (source token, target token) pair of every sentence pair, by position.

    Returns ``(src, tgt, group)``: one entry per source position x target position of each
    sentence pair (with ``null``, every target position also pairs with that extra source id);
    ``group`` numbers the target positions of the corpus, so that the entries of one group are
    the source words that may have generated one target token (IBM Model 1's alignment sum).
    """
    if len(src_sents) != len(tgt_sents):
        raise ValueError(f"{len(src_sents)} source sentences but {len(tgt_sents)} target sentences")
    if null is not None:
        src_sents = [np.append(np.asarray(s, dtype=np.int64), null) for s in src_sents]
    src_flat, src_len = _flatten(src_sents)
    tgt_flat, tgt_len = _flatten(tgt_sents)
    src_start = np.cumsum(src_len) - src_len
    sentence_of_target = np.repeat(np.arange(len(tgt_len)), tgt_len)
    per_group = src_len[sentence_of_target]  # source positions each target position pairs with
    group = np.repeat(np.arange(len(tgt_flat)), per_group)
    group_start = np.cumsum(per_group) - per_group
    within = np.arange(len(group)) - group_start[group]
    src = src_flat[src_start[sentence_of_target][group] + within]
    return src, tgt_flat[group], group


def ibm1_table(src_sents, tgt_sents, source_size: int, target_size: int, iterations: int = 5, progress=None):
    """IBM Model 1 translation probabilities ``p(t | s)`` by EM (uniform start, NULL word).

    Returns ``(src, tgt, prob)``: the co-occurring pairs (NULL excluded) and ``p(t | s)``."""
    if iterations < 1:
        raise RefusedOptions(f"--iterations must be >= 1, got {iterations}")
    null = source_size
    src, tgt, group = pair_entries(src_sents, tgt_sents, null=null)
    keys = src * target_size + tgt
    pair_keys, pair_of_entry = np.unique(keys, return_inverse=True)
    del keys
    pair_src = pair_keys // target_size
    prob = np.ones(len(pair_keys))  # uniform start: the first E-step shares each target token equally
    n_groups = int(group.max()) + 1 if len(group) else 0
    for it in range(iterations):
        p = prob[pair_of_entry]
        norm = np.bincount(group, weights=p, minlength=n_groups)
        counts = np.bincount(pair_of_entry, weights=p / norm[group], minlength=len(pair_keys))
        totals = np.bincount(pair_src, weights=counts, minlength=source_size + 1)
        prob = counts / totals[pair_src]
        if progress is not None:
            progress(it + 1, iterations)
    real = pair_src != null
    return pair_src[real], (pair_keys % target_size)[real], prob[real]


def dice_table(src_sents, tgt_sents, source_size: int, target_size: int):
    """Dice coefficients ``2 c(s, t) / (c(s) + c(t))`` of sentence-level co-occurrence counts."""
    src, tgt, group = pair_entries(src_sents, tgt_sents)
    _, tgt_len = _flatten(tgt_sents)
    sentence = np.repeat(np.arange(len(tgt_len)), tgt_len)[group]
    span = source_size * target_size
    once = np.unique(sentence * span + src * target_size + tgt) % span  # each pair once per sentence
    pair_keys, pair_counts = np.unique(once, return_counts=True)
    src_count = _sentence_counts(src_sents, source_size)
    tgt_count = _sentence_counts(tgt_sents, target_size)
    s, t = pair_keys // target_size, pair_keys % target_size
    return s, t, 2.0 * pair_counts / (src_count[s] + tgt_count[t])


def _sentence_counts(sentences, size: int) -> np.ndarray:
    """Number of sentences each id occurs in."""
    counts = np.zeros(size, dtype=np.int64)
    for s in sentences:
        counts[np.unique(np.asarray(s, dtype=np.int64))] += 1
    return counts


def top_targets(src: np.ndarray, tgt: np.ndarray, score: np.ndarray, source_size: int, n: int) -> np.ndarray:
    """``(source_size, n)``: the ``n`` best-scored targets of every source id, best first (ties:
    the smaller id, i.e. the more frequent token in a fairseq dictionary), ``-1`` past the end."""
    if n < 1:
        raise RefusedOptions(f"--per-source must be >= 1, got {n}")
    table = np.full((source_size, n), -1, dtype=np.int64)
    if len(src) == 0:
        return table
    order = np.lexsort((tgt, -score, src))
    s, t = src[order], tgt[order]
    first = np.searchsorted(s, s, side="left")
    rank = np.arange(len(s)) - first
    keep = rank < n
    table[s[keep], rank[keep]] = t[keep]
    return table


def most_frequent(tgt_sents, target_size: int, m: int, exclude: Sequence[int] = ()) -> np.ndarray:
    """The ``m`` most frequent target ids of the corpus (ties: the smaller id), ``exclude`` left out."""
    if m < 1:
        raise RefusedOptions(f"--frequent must be >= 1, got {m}")
    flat, _ = _flatten(tgt_sents)
    counts = np.bincount(flat, minlength=target_size).astype(np.float64)
    counts[list(exclude)] = -1
    order = np.lexsort((np.arange(target_size), -counts))
    return np.array([i for i in order[:m] if counts[i] > 0], dtype=np.int64)


def special_ids(dictionary) -> List[int]:
    """fairseq's special symbols (``<s>``, ``<pad>``, ``</s>``, ``<unk>``) and the HRT task's
    (``<mask>``, ``<s2>``..): every shortlist includes them, so the decoders' rules about them
    (``</s>`` forced at the maximum length, banned symbols) behave as without a shortlist."""
    ids = set(range(dictionary.nspecial))
    ids.update(dictionary.index(s) for s in hrt_symbols() if s in dictionary.indices)
    return sorted(ids)


def build_shortlist(
    src_sents,
    tgt_sents,
    src_dict,
    tgt_dict,
    per_source: int = 75,
    frequent: int = 75,
    method: str = "ibm1",
    iterations: int = 5,
    min_score: float = 0.0,
    progress=None,
) -> Shortlist:
    """A :class:`Shortlist` from a tokenised parallel corpus (lists of id arrays, without
    ``</s>``) and its dictionaries: per source token its ``per_source`` best targets whose
    score (``p(t | s)`` or Dice) is at least ``min_score``."""
    if per_source < 1:
        raise RefusedOptions(f"--per-source must be >= 1, got {per_source}")
    if frequent < 1:
        raise RefusedOptions(f"--frequent must be >= 1, got {frequent}")
    if method not in METHODS:
        raise RefusedOptions(f"--method must be one of {METHODS}, got {method!r}")
    if not 0.0 <= min_score < 1.0:
        raise RefusedOptions(f"--min-score must be in [0, 1), got {min_score}")
    source_size, target_size = len(src_dict), len(tgt_dict)
    specials_src, specials_tgt = set(special_ids(src_dict)), special_ids(tgt_dict)
    # special symbols say nothing about translations: drop them from the statistics
    src_sents = [s[~np.isin(s, list(specials_src - {src_dict.unk()}))] for s in src_sents]
    tgt_sents = [t[~np.isin(t, specials_tgt)] for t in tgt_sents]
    if method == "ibm1":
        src, tgt, score = ibm1_table(src_sents, tgt_sents, source_size, target_size, iterations, progress)
    else:
        src, tgt, score = dice_table(src_sents, tgt_sents, source_size, target_size)
    keep = score >= min_score
    translations = top_targets(src[keep], tgt[keep], score[keep], source_size, per_source)
    always = np.concatenate([most_frequent(tgt_sents, target_size, frequent, exclude=specials_tgt), specials_tgt])
    settings = {
        "per_source": per_source,
        "frequent": frequent,
        "method": method,
        "min_score": min_score,
        "sentences": len(src_sents),
    }
    if method == "ibm1":
        settings["iterations"] = iterations
    return Shortlist(
        torch.from_numpy(translations),
        torch.from_numpy(always),
        dictionary_fingerprint(src_dict, tgt_dict),
        source_size,
        target_size,
        settings,
    )


# ------------------------------------------------------------------------------ input


def load_dictionaries(data: str, source_lang: Optional[str], target_lang: Optional[str]):
    """The dictionaries of a data directory as ``--task hrt_translation`` loads them (with the
    HRT symbols), so the fingerprint matches the task's."""
    if source_lang is None or target_lang is None:
        source_lang, target_lang = data_utils.infer_language_pair(data)
        if source_lang is None:
            raise RefusedOptions(f"{data}: could not infer the language pair; pass --source-lang and --target-lang")
    dicts = []
    for lang in (source_lang, target_lang):
        path = os.path.join(data, f"dict.{lang}.txt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no dictionary (is {data} a fairseq-preprocess output directory?)")
        dicts.append(add_hrt_symbols(Dictionary.load(path)))  # as the task loads them
    return source_lang, target_lang, dicts[0], dicts[1]


def read_binarized(data: str, split: str, source_lang: str, target_lang: str, src_dict, tgt_dict, limit: int = 0):
    """Sentences of a binarized split (``</s>`` removed) as id arrays."""
    out = []
    for lang, dictionary in ((source_lang, src_dict), (target_lang, tgt_dict)):
        dataset = None
        for pair in (f"{source_lang}-{target_lang}", f"{target_lang}-{source_lang}"):
            dataset = data_utils.load_indexed_dataset(os.path.join(data, f"{split}.{pair}.{lang}"), dictionary)
            if dataset is not None:
                break
        if dataset is None:
            raise FileNotFoundError(f"{data}: no binarized {split} set for {source_lang}-{target_lang} ({lang})")
        n = len(dataset) if not limit else min(limit, len(dataset))
        eos = dictionary.eos()
        sentences = []
        for i in _progress(range(n), f"reading {split}.{lang}"):
            ids = dataset[i].numpy().astype(np.int64)
            sentences.append(ids[:-1] if len(ids) and ids[-1] == eos else ids)
        out.append(sentences)
    return out[0], out[1]


def read_text(path: str, dictionary, limit: int = 0) -> List[np.ndarray]:
    """Sentences of a tokenised text file (pieces as the model reads them) as id arrays."""
    lines = text_input.read_lines(path)
    if limit:
        lines = lines[:limit]
    return [
        dictionary.encode_line(line, add_if_not_exist=False, append_eos=False).numpy().astype(np.int64)
        for line in _progress(lines, f"reading {os.path.basename(path)}")
    ]


def _progress(iterable, desc: str):
    return tqdm(iterable, desc=desc, unit=" sentences", mininterval=2.0, disable=not sys.stderr.isatty())


# -------------------------------------------------------------------------------- CLI


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-hrt-shortlist",
        description="Build a lexical shortlist (per source token its most probable target tokens, plus the "
        "most frequent target tokens) from a parallel training set, for decoding with --shortlist FILE.",
    )
    p.add_argument("data", help="fairseq-preprocess output directory (dictionaries, binarized splits)")
    p.add_argument("--output", "-o", required=True, help="shortlist file to write")
    p.add_argument("--source-lang", "-s", help="source language (default: inferred from the directory)")
    p.add_argument("--target-lang", "-t", help="target language (default: inferred from the directory)")
    p.add_argument("--split", default="train", help="binarized split to read (default: train)")
    p.add_argument("--source-text", help="read this tokenised source file (pieces) instead of the binarized split")
    p.add_argument("--target-text", help="read this tokenised target file (pieces), line-aligned with --source-text")
    p.add_argument(
        "--per-source", type=int, default=75, help="target tokens kept per source token, best first (Marian: 75)"
    )
    p.add_argument(
        "--frequent", type=int, default=75, help="most frequent target tokens every batch may produce (Marian: 75)"
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default="ibm1",
        help="translation score: 'ibm1' = IBM Model 1 p(t|s) by EM; 'dice' = Dice coefficient of "
        "sentence co-occurrence",
    )
    p.add_argument("--iterations", type=int, default=5, help="EM iterations of --method ibm1")
    p.add_argument(
        "--min-score",
        type=float,
        default=0.0,
        help="keep only translations scoring at least this (p(t|s) for ibm1, the coefficient for dice): "
        "rare source tokens then bring fewer unlikely targets into a batch's candidates",
    )
    p.add_argument(
        "--max-sentences",
        type=int,
        default=0,
        help="use only the first N sentence pairs (0 = all); memory grows with the sum over "
        "pairs of source length x target length",
    )
    return p


def cli_main(argv: Optional[List[str]] = None) -> int:
    setup_logging()
    args = get_parser().parse_args(argv)
    try:
        for name in ("per_source", "frequent", "iterations"):
            if getattr(args, name) < 1:
                raise RefusedOptions(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.max_sentences < 0:
            raise RefusedOptions(f"--max-sentences must be >= 0, got {args.max_sentences}")
        if bool(args.source_text) != bool(args.target_text):
            raise RefusedOptions("--source-text and --target-text go together")
        src_lang, tgt_lang, src_dict, tgt_dict = load_dictionaries(args.data, args.source_lang, args.target_lang)
        start = time.time()
        if args.source_text:
            src = read_text(args.source_text, src_dict, args.max_sentences)
            tgt = read_text(args.target_text, tgt_dict, args.max_sentences)
            if len(src) != len(tgt):
                raise RefusedOptions(f"{args.source_text} has {len(src)} lines, {args.target_text} {len(tgt)}")
        else:
            src, tgt = read_binarized(args.data, args.split, src_lang, tgt_lang, src_dict, tgt_dict, args.max_sentences)
        logger.info(
            "%d sentence pairs (%s-%s), %d source / %d target symbols",
            len(src),
            src_lang,
            tgt_lang,
            len(src_dict),
            len(tgt_dict),
        )

        def em_progress(done, total):
            logger.info("IBM Model 1: EM iteration %d/%d", done, total)

        shortlist = build_shortlist(
            src,
            tgt,
            src_dict,
            tgt_dict,
            args.per_source,
            args.frequent,
            args.method,
            args.iterations,
            args.min_score,
            progress=em_progress,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"fairseq-hrt-shortlist: error: {e}", file=sys.stderr)
        return 1
    shortlist.save(args.output)
    filled = (shortlist.translations >= 0).sum(dim=1).float()
    logger.info(
        "wrote %s (dictionary %s): %d source tokens x up to %d targets (mean %.1f), %d tokens always, %.1fs",
        args.output,
        shortlist.fingerprint,
        shortlist.source_size,
        args.per_source,
        float(filled[filled > 0].mean()),
        shortlist.always.numel(),
        time.time() - start,
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
