"""Source sentences as the HRT task reads them.

* Sources longer than ``--max-source-positions`` are cut there, the last token ``</s>`` (as the
  papers do with L = 200), by one function, :func:`truncate_source`, wherever a source enters:
  the data sets fairseq-generate and validation read (any split but the training set, which
  fairseq's batching already filters: :func:`truncate_split`), fairseq-interactive's lines
  (:func:`encode_interactive_lines`, which names the line) and the hub's and other Python
  callers' sentences (:func:`truncate_inference_sources`).
* fairseq-interactive's lines are repaired as :mod:`hrt_runtime.text_input` repairs input files;
  a line the tokenizer/BPE refuses is translated as an empty line.
"""

import logging
from typing import Callable, List, Sequence

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset

from hrt_runtime import text_input

logger = logging.getLogger(__name__)


def truncate_source(tokens: torch.Tensor, limit: int, eos: int) -> torch.Tensor:
    """``tokens`` (ending in ``eos``) cut at ``limit`` tokens, the last one ``eos``."""
    if tokens.numel() <= limit:
        return tokens
    return torch.cat([tokens[: limit - 1], tokens.new_tensor([eos])])


class TruncatedSource(BaseWrapperDataset):
    """A binarized source whose sentences are cut at ``limit`` tokens (:func:`truncate_source`)."""

    def __init__(self, dataset, limit: int, eos: int):
        super().__init__(dataset)
        self.limit, self.eos = limit, eos
        self._sizes = np.minimum(np.asarray(dataset.sizes), limit)

    def __getitem__(self, index):
        return truncate_source(self.dataset[index], self.limit, self.eos)

    @property
    def sizes(self):
        return self._sizes

    def size(self, index):
        return self._sizes[index]

    def num_tokens(self, index):
        return self._sizes[index]


def truncate_split(split: str, pair_dataset, limit: int, eos: int) -> int:
    """Cut the source sentences of a ``LanguagePairDataset`` longer than ``limit`` tokens, in
    place (its sizes too, which batching and fairseq's size filter read), and say how many."""
    long = int((np.asarray(pair_dataset.src_sizes) > limit).sum())
    if long:
        pair_dataset.src = TruncatedSource(pair_dataset.src, limit, eos)
        pair_dataset.src_sizes = pair_dataset.src.sizes
        tgt_sizes = pair_dataset.tgt_sizes
        pair_dataset.sizes = (
            np.vstack((pair_dataset.src_sizes, tgt_sizes)).T if tgt_sizes is not None else pair_dataset.src_sizes
        )
        logger.warning(
            "%s: %d source sentence(s) longer than --max-source-positions %d tokens were truncated",
            split,
            long,
            limit,
        )
    return long


def truncate_inference_sources(src_tokens: List[torch.Tensor], src_lengths: List[int], limit: int, eos: int) -> int:
    """Cut the sentences of ``build_dataset_for_inference``'s lists in place, and say how many."""
    truncated = 0
    for i, tokens in enumerate(src_tokens):
        if tokens.numel() > limit:
            src_tokens[i] = truncate_source(tokens, limit, eos)
            src_lengths[i] = limit
            truncated += 1
    if truncated:
        logger.warning(
            "%d input sentence(s) longer than --max-source-positions %d tokens were truncated",
            truncated,
            limit,
        )
    return truncated


def encode_interactive_lines(
    lines: Sequence[str], first_line_number: int, encode_fn: Callable[[str], str], dictionary, limit: int
) -> List[torch.Tensor]:
    """fairseq-interactive's lines as token ids, one per line: repaired, encoded, and cut at
    ``limit``, each warning with the line's number (``first_line_number`` is the first's).

    A line that cannot be encoded never ends the session: it is logged and translated as an
    empty line, so the output keeps one translation per input line.
    """
    tokens = []
    for lineno, line in enumerate(lines, start=first_line_number):
        text, problems = text_input.clean_text(line)
        if problems:
            logger.warning("input line %d: %s repaired", lineno, ", ".join(problems))
        try:
            encoded = encode_fn(text)
        except Exception as e:  # noqa: BLE001 - any tokenizer failure: report it, go on
            logger.warning(
                "input line %d could not be tokenized (%s: %s); it is translated as an empty line",
                lineno,
                type(e).__name__,
                e,
            )
            encoded = ""
        ids = dictionary.encode_line(encoded, add_if_not_exist=False).long()
        if ids.numel() > limit:  # cut here, where the line's number is known (the runtime's words)
            logger.warning(
                "input line %d: a sentence of %d tokens is truncated to the model's %d source positions",
                lineno,
                ids.numel(),
                limit,
            )
            ids = truncate_source(ids, limit, dictionary.eos())
        tokens.append(ids)
    return tokens
