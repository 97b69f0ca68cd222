"""The output-layer rows a batch decodes over when a lexical shortlist restricts them
(:mod:`fairseq_hrt.shortlist`): mapping between row indices and vocabulary ids, and the
rows of an output projection."""

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fairseq_hrt.cli_logging import RefusedOptions


def output_rows(projection: nn.Module, ids: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """The rows ``ids`` of an output projection's weight and bias, as float tensors.

    An int8-quantized projection (``--quantize int8``) is dequantized: the restricted product
    is small, and Marian likewise runs it in 32-bit."""
    weight = projection.weight
    bias = projection.bias
    if callable(weight):  # torch.ao dynamic quantized Linear: weight() / bias() methods
        weight, bias = weight().dequantize(), bias()
    if not isinstance(weight, Tensor):
        raise RefusedOptions(f"--shortlist cannot restrict an output layer of type {type(projection).__name__}")
    return weight.index_select(0, ids), (bias.index_select(0, ids) if bias is not None else None)


def restricted_output_layer(projection: nn.Module, ids: Tensor) -> Callable[[Tensor], Tensor]:
    """``features -> logits`` over the rows ``ids`` of an output projection only (the rows
    are sliced once, here, for every call that follows)."""
    weight, bias = output_rows(projection, ids)
    return lambda features: F.linear(features, weight, bias)


def positions_in(ids: Tensor, tokens: Tensor) -> Tensor:
    """Indices into the sorted ``ids`` of those of ``tokens`` that occur in it."""
    tokens = tokens.to(ids.device)
    i = torch.searchsorted(ids, tokens).clamp_(max=ids.numel() - 1)
    return i[ids[i].eq(tokens)]


class OutputLayer:
    """A decoder's output layer over the rows a batch decodes over (``vocab``, sorted ids;
    ``None``: the whole vocabulary, as ``decoder.output_layer``) with ``banned`` symbols never
    chosen: the best allowed token of every feature vector, the one choice of the
    non-autoregressive passes (HRT's stage II, Mask-Predict, ``hrt-spec``'s drafts).
    A shortlist's weight rows are sliced once, here."""

    def __init__(self, decoder, banned: Tensor, vocab: Optional[Tensor] = None):
        self.vocab = vocab
        if vocab is None:
            self.project = decoder.output_layer
            self.banned = banned
        else:
            self.project = restricted_output_layer(decoder.output_projection, vocab)
            self.banned = positions_in(vocab, banned)

    def best(self, features: Tensor) -> Tuple[Tensor, Tensor]:
        """``(log-probability, token id)`` of the best allowed token of every vector of
        ``features`` (``(..., C)``); log-probabilities are normalised over the rows."""
        lprobs = F.log_softmax(self.project(features).float(), dim=-1)
        lprobs[..., self.banned.to(lprobs.device)] = -math.inf
        best, token = lprobs.max(dim=-1)
        return best, (token if self.vocab is None else self.vocab[token])
