"""The rules every search of this plugin obeys, in one place.

* :func:`banned_symbols`: the symbols a model's hypotheses never contain.
* :class:`SearchRules`: the one search's rules (:mod:`hrt_runtime.search`: temperature, banned
  symbols, ``</s>`` banned before ``--min-len`` and forced at the maximum length, ``--unkpen``,
  as three additive biases) on torch logits whose rows may each be at their own step, for
  Jacobi decoding's slots; scores are log-probabilities of the chosen tokens.
"""

from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.kinds import ModelFamily, family_of
from fairseq_hrt.passes.token_choice import choose
from hrt_runtime.model import OutputRows
from hrt_runtime.search import SearchConfig, rules_of


def banned_symbols(task, model) -> List[int]:
    """Symbols no hypothesis of ``model`` may contain (:func:`banned_symbols_of` its family),
    with the task's ``<mask>`` and ``<s_k>`` (fairseq's own ``translation`` task has neither: its
    AT models ban ``<pad>`` alone)."""
    mask, chunk_start = getattr(task, "mask_idx", None), getattr(task, "chunk_start_idx", {})
    return banned_symbols_of(family_of(model), task.target_dictionary, mask, chunk_start)


def banned_symbols_of(family: ModelFamily, tgt_dict, mask: int, chunk_start: Dict[int, int]) -> List[int]:
    """``<pad>`` always; ``<mask>`` and the start symbols ``<s>``, ``<s_k>`` too for a model
    trained with them as inputs (:meth:`ModelFamily.banned_by_search`: no stage produces them);
    ``</s>`` too where it is given at a predicted length (Mask-Predict). AT models ban only
    ``<pad>``, as fairseq's own search does."""
    banned = {tgt_dict.pad()}
    if family.banned_by_search():
        banned |= {mask, tgt_dict.bos(), *chunk_start.values()}
    if not family.predicts_eos():
        banned.add(tgt_dict.eos())
    return sorted(banned)


def bias_at(steps: Tensor, max_len, min_len, usual: Tensor, early: Tensor, final: Tensor) -> Tensor:
    """:meth:`hrt_runtime.search.Rules.bias` in torch, for a step (a scalar: ``(V,)``; ``(N,
    1)``: ``(N, V)``) that may be a traced value: ``final`` at ``max_len`` and after, ``early``
    before ``min_len``, else ``usual`` (Jacobi decoding's slots, the exported greedy loop)."""
    return torch.where(steps >= max_len, final, torch.where(steps < min_len, early, usual))


class SearchRules:
    """The one search's rules (:func:`hrt_runtime.search.rules_of`: the usual bias, the one
    before ``--min-len`` with ``</s>`` banned too, the one at the maximum length that leaves
    only ``</s>``; ``--unkpen`` and the banned symbols in them) on a step's torch logits, where
    every row may be at its own step: Jacobi decoding's slots. The choice is the lean
    engine's (:meth:`~fairseq_hrt.generation.lean.TorchBackend.step`): the best of ``logits +
    bias``, scored by its log-softmax. ``banned``: symbols never generated (``<pad>`` is
    added); ``rows``: the output rows the logits' columns are (default all, or a shortlist's
    :class:`hrt_runtime.model.OutputRows`)."""

    def __init__(self, config: SearchConfig, tgt_dict, banned: Sequence[int] = (), temperature: float = 1.0):
        if temperature <= 0:
            raise RefusedOptions("--temperature must be greater than 0")
        self.config = config
        self.temperature = temperature
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.vocab_size = len(tgt_dict)
        self.banned = sorted(set(banned) | {self.pad})
        self._tables: Dict = {}

    def logits(self, raw: Tensor) -> Tensor:
        """A step's logits as float, divided by ``--temperature``."""
        if self.temperature != 1.0:
            raw = raw / self.temperature
        return raw.float()

    def table(self, rows: OutputRows, device) -> Tensor:
        """``(3, V)``: the usual, early and final biases over ``rows`` (made once per rows and device)."""
        key = (None if rows.ids is None else rows.ids.tobytes(), str(device))
        found = self._tables.get(key)
        if found is None:
            size = self.vocab_size if rows.ids is None else rows.ids.size
            rules = rules_of(self.config, self.eos, self.unk, self.banned, rows, size)
            if len(self._tables) > 16:
                self._tables.clear()
            found = self._tables[key] = torch.from_numpy(np.stack([rules.usual, rules.early, rules.final])).to(device)
        return found

    def greedy(self, logits: Tensor, steps: Union[int, Tensor], max_len: int, rows: Optional[OutputRows] = None):
        """``(log-probability, row of rows)`` of greedy's choice in every row of ``logits``
        (float, after :meth:`logits`). ``steps``: the step of every row (an int: all rows)."""
        usual, early, final = self.table(rows or OutputRows(None), logits.device)
        steps = torch.as_tensor(steps, device=logits.device)
        bias = bias_at(steps.unsqueeze(-1), max_len, self.config.min_len, usual, early, final)
        return choose(logits, bias, 1)
