"""The rules every search of this plugin obeys, in one place.

* :func:`banned_symbols`: the symbols a model's hypotheses never contain.
* :class:`SearchRules`: fairseq's rules of left-to-right search applied to one step's logits
  (temperature, banned symbols, ``</s>`` banned before ``--min-len`` and forced at the maximum
  length, ``--unkpen``), for the lean engine's greedy and beam search and for Jacobi
  decoding's slots; scores are log-probabilities of the chosen tokens.

The rules are applied on logits before normalising: banning and forcing commute with the
log-softmax, so only the chosen tokens are normalised (one log-sum-exp per row).
"""
import math
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from hrt_runtime.search import SearchConfig
from fairseq_hrt.generation.output_vocab import OutputVocabulary
from fairseq_hrt.models.kinds import ModelFamily, family_of


def banned_symbols(task, model) -> List[int]:
    """Symbols no hypothesis of ``model`` may contain (:func:`banned_symbols_of` its family),
    with the task's ``<mask>`` and ``<s_k>``."""
    return banned_symbols_of(family_of(model), task.target_dictionary, task.mask_idx, task.chunk_start_idx)


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


def greedy_choice(logits: Tensor, banned: Tensor):
    """``(log-probability, token)`` of the best allowed token of every row of ``logits``.

    One pass finds the row maximum, which serves both as the argmax and as the shift of the
    log-sum-exp; only rows whose maximum is a ``banned`` (``(V,)`` bool) symbol -- rare --
    are searched again with the banned symbols masked.
    """
    row_max, token = logits.max(dim=1)
    log_norm = row_max + (logits - row_max.unsqueeze(1)).exp_().sum(dim=1).log_()
    best = row_max
    redo = banned[token]
    if bool(redo.any()):
        rows = redo.nonzero().view(-1)
        masked = logits.index_select(0, rows).masked_fill_(banned, -math.inf)
        best_redo, token_redo = masked.max(dim=1)
        best, token = best.index_copy(0, rows, best_redo), token.index_copy(0, rows, token_redo)
    return best - log_norm, token


class SearchRules:
    """fairseq's search rules for one target dictionary. ``banned``: symbols never generated
    (:func:`banned_symbols`; ``<pad>`` is added). Columns of the logits are the rows of an
    :class:`OutputVocabulary` (all of the vocabulary, or a shortlist's candidates)."""

    def __init__(self, options: SearchConfig, tgt_dict, banned: Sequence[int] = (), temperature: float = 1.0):
        if temperature <= 0:
            raise ValueError("--temperature must be greater than 0")
        self.options = options
        self.temperature = temperature
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()
        self.vocab_size = len(tgt_dict)
        self.banned = torch.tensor(sorted(set(banned) | {self.pad}), dtype=torch.long)
        self.banned_with_eos = torch.tensor(sorted(set(banned) | {self.pad, self.eos}), dtype=torch.long)
        self.full_vocab = OutputVocabulary(None, self.vocab_size, self.eos, self.unk)

    def logits(self, raw: Tensor) -> Tensor:
        """A step's logits as float, divided by ``--temperature``."""
        if self.temperature != 1.0:
            raw = raw / self.temperature
        return raw.float()

    def banned_table(self, early: bool, device, out: OutputVocabulary) -> Tensor:
        """``(V,)`` bool over the rows of ``out``: the symbols banned (``</s>`` too when
        ``early``, before --min-len)."""

        def table():
            full = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            full[(self.banned_with_eos if early else self.banned).to(device)] = True
            return full if out.ids is None else full[out.ids.to(device)]

        return out.memo(("table", early, device), table)

    def masked(self, logits: Tensor, step: int, max_len: int, out: OutputVocabulary) -> Tensor:
        """The logits that may be chosen at ``step``, the others at ``-inf``."""
        if step >= max_len:
            only_eos = torch.full_like(logits, -math.inf)
            only_eos[:, out.eos] = logits[:, out.eos]
            return only_eos
        return self._allowed(logits, step < self.options.min_len, out)

    def _allowed(self, logits: Tensor, early: bool, out: OutputVocabulary) -> Tensor:
        """``logits`` with the banned symbols at ``-inf`` (``</s>`` too when ``early``) and
        ``--unkpen`` taken off ``<unk>``."""
        banned = out.memo(("banned", early, logits.device),
                          lambda: out.positions((self.banned_with_eos if early else self.banned).to(logits.device)))
        masked = logits.index_fill(1, banned, -math.inf)
        if self.options.unk_penalty and out.unk is not None:
            masked[:, out.unk] -= self.options.unk_penalty
        return masked

    def greedy(self, logits: Tensor, steps: Union[int, Tensor], max_len: int,
               out: Optional[OutputVocabulary] = None):
        """``(log-probability, row of out)`` of greedy's choice in every row of ``logits``
        (float, after :meth:`logits`). ``steps``: the step of every row (an int: all rows)."""
        out = out or self.full_vocab
        if isinstance(steps, int):
            if steps < max_len and not self.options.unk_penalty:  # the common case: one pass
                return greedy_choice(logits, self.banned_table(steps < self.options.min_len, logits.device, out))
            best, token = self.masked(logits, steps, max_len, out).max(dim=1)
            return best - torch.logsumexp(logits, dim=1), token
        early = steps < self.options.min_len
        at_max = steps >= max_len
        if not self.options.unk_penalty and not bool(early.any()) and not bool(at_max.any()):
            return greedy_choice(logits, self.banned_table(False, logits.device, out))
        masked = self._allowed(logits, False, out)
        if bool(early.any()):
            masked[early, out.eos] = -math.inf
        if bool(at_max.any()):
            eos_logit = logits[at_max, out.eos]
            masked[at_max] = -math.inf
            masked[at_max, out.eos] = eos_logit
        best, token = masked.max(dim=1)
        return best - torch.logsumexp(logits, dim=1), token
