"""MixDistill's second, aligned target (SPEC section 2): the distilled (sequence-level KD)
translation of every training pair, read from ``--distill-data`` next to the raw one.

Each pair's target is later drawn from the raw reference with probability ``--p-raw``
(:func:`fairseq_hrt.chunking.mix_targets`); this module only loads and collates the
distilled targets.
"""

import logging
import os
from typing import Optional

import numpy as np
from fairseq.data import BaseWrapperDataset, data_utils

from fairseq_hrt.cli_logging import RefusedOptions

logger = logging.getLogger(__name__)


class DistilledTargetDataset(BaseWrapperDataset):
    """A :class:`LanguagePairDataset` whose samples also carry the aligned distilled target.

    The collated batch gets ``distilled_target`` (padded like ``target``, in the batch's order).
    """

    def __init__(self, pair_dataset, distilled):
        super().__init__(pair_dataset)
        self.distilled = distilled

    def __getitem__(self, index):
        item = self.dataset[index]
        item["distilled"] = self.distilled[index]
        return item

    def collater(self, samples):
        batch = self.dataset.collater(samples)
        if len(samples) == 0 or "id" not in batch:
            return batch
        by_id = {s["id"]: s["distilled"] for s in samples}
        tokens = [by_id[int(i)] for i in batch["id"]]
        batch["distilled_target"] = data_utils.collate_tokens(
            tokens, self.dataset.tgt_dict.pad(), self.dataset.tgt_dict.eos(), left_pad=False
        )
        return batch


def with_distilled_targets(
    pair_dataset,
    split: str,
    distill_data: str,
    source_lang: str,
    target_lang: str,
    tgt_dict,
    dataset_impl=None,
    p_raw: float = 0.5,
    p_raw_chunked: Optional[float] = None,
):
    """``pair_dataset`` (a split of the raw data) wrapped so that every sample also carries its
    distilled target from ``distill_data`` (binarized with the same dictionaries and split
    names). Refuses a missing or misaligned distilled set; ``p_raw`` / ``p_raw_chunked`` are
    only logged. Batches are sized by the longer of the two targets."""
    if not os.path.isdir(distill_data):
        raise RefusedOptions(
            f"--distill-data {distill_data} is not a folder; give the folder of the binarized distilled "
            "training set (fairseq-preprocess with the raw data's dictionaries)"
        )
    src, tgt = source_lang, target_lang
    candidates = [
        os.path.join(distill_data, f"{split}.{src}-{tgt}.{tgt}"),
        os.path.join(distill_data, f"{split}.{tgt}-{src}.{tgt}"),
    ]
    distilled = None
    for prefix in candidates:
        distilled = data_utils.load_indexed_dataset(prefix, tgt_dict, dataset_impl)
        if distilled is not None:
            break
    if distilled is None:
        raise RefusedOptions(
            f"--distill-data {distill_data}: no binarized distilled target "
            f"found at {candidates[0]}.{{bin,idx}} (binarize the distilled corpus with "
            "fairseq-preprocess --srcdict/--tgtdict of the raw data)"
        )
    if len(distilled) != len(pair_dataset):
        raise RefusedOptions(
            f"--distill-data {distill_data}: distilled set not aligned with raw: {prefix} has "
            f"{len(distilled)} sentences, "
            f"the raw {split} set has {len(pair_dataset)}. The distilled corpus must be a "
            "line-by-line translation of the same source file."
        )
    if p_raw_chunked is None:
        logger.info("MixDistill: %s (p_raw = %s)", prefix, p_raw)
    else:
        logger.info("MixDistill: %s (p_raw = %s, chunked pairs: %s)", prefix, p_raw, p_raw_chunked)
    # batch by the longer of the two targets so that either fits --max-tokens
    pair_dataset.tgt_sizes = np.maximum(pair_dataset.tgt_sizes, distilled.sizes)
    pair_dataset.sizes = np.vstack((pair_dataset.src_sizes, pair_dataset.tgt_sizes)).T
    return DistilledTargetDataset(pair_dataset, distilled)
