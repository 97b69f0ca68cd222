"""Checks that a checkpoint fits the data and model it is loaded into.

* The task state saved with every checkpoint (fairseq's ``get_checkpoint_dict`` hook): the
  dictionary fingerprint and the curriculum's schedule; on resume, data binarized with
  another dictionary is refused and a changed schedule is reported (:func:`check_resumed_state`).
* :func:`check_dictionary_when_loading`: loading weights of another dictionary into an AT
  model fails with a message about the dictionary, not about the architecture.
"""

import logging
from typing import Dict, Sequence

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.models.hrt_transformer import check_dictionary_compatible
from fairseq_hrt.symbols import dictionary_fingerprint

logger = logging.getLogger(__name__)

__all__ = ["dictionary_fingerprint", "curriculum_schedule", "check_resumed_state", "check_dictionary_when_loading"]


def curriculum_schedule(
    hrt_mode, chunk_sizes: Sequence[int], curriculum_updates: int, max_update: int, curriculum_lambda: float
) -> Dict:
    """The schedule of the chunk curriculum as a checkpoint stores it."""
    return {
        "hrt_mode": str(hrt_mode),
        "chunk_sizes": list(chunk_sizes),
        "curriculum_updates": int(curriculum_updates or max_update or 0),
        "curriculum_lambda": float(curriculum_lambda),
    }


def check_resumed_state(saved: Dict, fingerprint: str, schedule: Dict, data: str):
    """On resume: refuse data binarized with another dictionary (``saved['dictionary']`` is
    the saving run's fingerprint), and warn when the curriculum's schedule differs from the
    run that saved the checkpoint (e.g. another --max-update moves p_k = (t / T) ** lambda for
    every later update)."""
    old = saved.get("dictionary")
    if old is not None and old != fingerprint:
        raise RefusedOptions(
            f"the checkpoint being resumed was trained on data binarized with another dictionary "
            f"(fingerprint {old}, this data directory {data}: {fingerprint}). "
            "Resume with the data directory of the run that saved it, or start a new run in another "
            "--save-dir."
        )
    changed = {k: (saved[k], schedule[k]) for k in schedule if k in saved and saved[k] != schedule[k]}
    if changed:
        logger.warning(
            "resuming with another schedule than the run that saved the checkpoint: %s; p_k follows the "
            "new settings from here on",
            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
        )


def check_dictionary_when_loading(model):
    """AT models are fairseq's own ``transformer``: loading a checkpoint of another dictionary
    into one failed with "size mismatch for decoder.output_projection.weight ... please ensure
    that the architectures match", which points at the architecture. Check the dictionary
    first (one message for all models, whatever their class): a load-state-dict pre-hook of the
    model (PyTorch's hook, run before any tensor is copied; HRT and CMLM models check in their
    ``load_state_dict`` before filling the tensors an AT checkpoint lacks, then here again)."""
    model.register_load_state_dict_pre_hook(_check_dictionary_hook)


def _check_dictionary_hook(module, state_dict, prefix, *args):
    if not prefix:  # the model itself (the hook runs for it only: it is registered on it)
        check_dictionary_compatible(module, state_dict)
