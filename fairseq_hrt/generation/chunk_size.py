"""``--decode-chunk-size``: which chunk size k an HRT model decodes with (per batch or per
sentence)."""

from typing import Callable, List, Sequence

import numpy as np
import torch

from fairseq_hrt.cli_logging import RefusedOptions
from hrt_runtime.search import chunk_size_groups


def resolve_decode_chunk_size(option: str, trained: List[int]):
    """``--decode-chunk-size``: an int (1 = AT mode), 'auto-trained', or 'by-length'."""
    option = str(option).strip()
    if option == "auto-trained":
        if not trained:
            raise RefusedOptions(
                "this checkpoint was not trained with chunked samples (--hrt-mode hrt); "
                "decode it with --decode-chunk-size 1 (AT mode)"
            )
        return min(trained)
    if option == "by-length":
        if not trained:
            raise RefusedOptions("--decode-chunk-size by-length needs a model trained with chunk sizes")
        return ChunkSizeByLength(trained)
    try:
        k = int(option)
    except ValueError:
        raise RefusedOptions(f"--decode-chunk-size must be an integer, 'auto-trained' or 'by-length', got {option!r}")
    if k < 1:
        raise RefusedOptions(f"--decode-chunk-size must be >= 1, got {k}")
    if k > 1 and k not in trained:
        raise RefusedOptions(
            f"--decode-chunk-size {k}: this model was trained for chunk sizes {trained or 'none'}; "
            "use one of them, or 1 for AT mode"
        )
    return k


class ChunkSizeByLength:
    """Per-sentence chunk size from the source length (beyond the papers).

    Rule: sources of fewer than ``short`` tokens decode in AT mode (k = 1): their Skip-AT
    skeleton would be a couple of tokens, the saving is small and the non-causal pass has
    little context; longer sources use the smallest trained k. Measurements:
    benchmarks/results/small-converged-cpu/README.md.
    """

    def __init__(self, trained: List[int], short: int = 8):
        self.k = min(trained)
        self.short = short

    def __repr__(self):  # the chunk size as the logs name it
        return f"by-length (1 for sources under {self.short} tokens, else {self.k})"

    def __call__(self, src_lengths):
        return torch.where(src_lengths < self.short, torch.ones_like(src_lengths), torch.full_like(src_lengths, self.k))


def chunk_sizes_of(chunk_size, src_tokens, pad: int) -> List[int]:
    """Each sentence's chunk size: ``chunk_size`` an int, or a function of the source lengths
    (:class:`ChunkSizeByLength`)."""
    if callable(chunk_size):
        return [int(k) for k in chunk_size(src_tokens.ne(pad).long().sum(dim=1)).tolist()]
    return [int(chunk_size)] * src_tokens.size(0)


def decode_by_chunk_size(chunk_size, src_tokens, pad: int, decode: Callable[[int, np.ndarray], Sequence]) -> List:
    """Each sentence's hypotheses, decoded group by group of the sentences that share a chunk
    size (:func:`chunk_sizes_of`): ``decode(k, rows)`` gives the hypotheses of the batch's
    ``rows`` (an int64 array: every row in the usual case of one k) in their order."""
    results: List = [None] * src_tokens.size(0)
    for k, rows in chunk_size_groups(chunk_sizes_of(chunk_size, src_tokens, pad)):
        for i, hypos in zip(rows.tolist(), decode(k, rows)):
            results[i] = hypos
    return results
