"""Sources longer than ``--max-source-positions`` are cut there, the last token ``</s>`` (as the
papers do with L = 200): in fairseq-interactive's and the hub's input
(``build_dataset_for_inference``) and in the data sets fairseq-generate reads (any split but
the training set, which fairseq's batching already filters)."""

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset


def truncate(tokens: torch.Tensor, limit: int, eos: int) -> torch.Tensor:
    """``tokens`` (ending in ``eos``) cut at ``limit`` tokens, the last one ``eos``."""
    if tokens.numel() <= limit:
        return tokens
    return torch.cat([tokens[: limit - 1], tokens.new_tensor([eos])])


class TruncatedSource(BaseWrapperDataset):
    """A binarized source whose sentences are cut at ``limit`` tokens (:func:`truncate`)."""

    def __init__(self, dataset, limit: int, eos: int):
        super().__init__(dataset)
        self.limit, self.eos = limit, eos
        self._sizes = np.minimum(np.asarray(dataset.sizes), limit)

    def __getitem__(self, index):
        return truncate(self.dataset[index], self.limit, self.eos)

    @property
    def sizes(self):
        return self._sizes

    def size(self, index):
        return self._sizes[index]

    def num_tokens(self, index):
        return self._sizes[index]


def truncate_sources(pair_dataset, limit: int, eos: int) -> int:
    """Cut the source sentences of a ``LanguagePairDataset`` longer than ``limit`` tokens, in
    place (its sizes too, which batching and fairseq's size filter read); how many were cut."""
    long = int((np.asarray(pair_dataset.src_sizes) > limit).sum())
    if long:
        pair_dataset.src = TruncatedSource(pair_dataset.src, limit, eos)
        pair_dataset.src_sizes = pair_dataset.src.sizes
        tgt_sizes = pair_dataset.tgt_sizes
        pair_dataset.sizes = (
            np.vstack((pair_dataset.src_sizes, tgt_sizes)).T if tgt_sizes is not None else pair_dataset.src_sizes
        )
    return long
