"""Hypotheses in fairseq's format, and the sample pieces every generator of this package
shares: the one definition of what a generator hands back to fairseq-generate."""

from typing import Dict, List, Optional

import numpy as np
import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions


def hypothesis(tokens: Tensor, score: Tensor, positional_scores: Tensor, steps: Optional[int] = None) -> Dict:
    """One finished hypothesis in fairseq's format (no attention / alignment)."""
    hypo = {
        "tokens": tokens,
        "score": score,
        "positional_scores": positional_scores,
        "attention": None,
        "alignment": None,
    }
    if steps is not None:
        hypo["steps"] = steps
    return hypo


def to_fairseq(found, device) -> List[List[Dict]]:
    """Hypotheses of :mod:`hrt_runtime.search` (numpy) in fairseq's format, on ``device``."""

    def one(h):
        hypo = hypothesis(
            torch.from_numpy(np.asarray(h["tokens"], np.int64)).to(device),
            torch.tensor(h["score"]),
            torch.from_numpy(np.asarray(h["positional_scores"], np.float32)).to(device),
            steps=h.get("steps"),
        )
        if "stage2_confidence" in h:
            hypo["stage2_confidence"] = torch.tensor(h["stage2_confidence"])
        return hypo

    return [[one(h) for h in hypos] for hypos in found]


def reject_unsupported_inputs(what: str, prefix_tokens=None, constraints=None, **_):
    """Generators that do not implement fairseq's --prefix-size / lexical constraints say so."""
    if prefix_tokens is not None:
        raise RefusedOptions(f"{what} does not support --prefix-size")
    if constraints is not None:
        raise RefusedOptions(f"{what} does not support lexical constraints")


def select_rows(sample, rows: List[int]):
    """The sub-batch of ``sample`` with the given rows (net_input and per-row entries)."""
    index = torch.tensor(rows, dtype=torch.long, device=sample["net_input"]["src_tokens"].device)
    bsz = sample["net_input"]["src_tokens"].size(0)

    def select(value):
        if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == bsz:
            return value.index_select(0, index)
        if isinstance(value, dict):
            return {k: select(v) for k, v in value.items()}
        return value

    return {k: select(v) for k, v in sample.items()}
