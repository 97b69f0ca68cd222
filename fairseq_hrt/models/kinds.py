"""What a model is and what it allows, declared by its class: the one place every other module
reads (strategies, engines, the task, the criterion, the exporter, the benchmarks).

A model class declares a :class:`ModelFamily` with :func:`declare`; fairseq's own
``transformer`` is declared here (an AT model). The declaration belongs to that exact class:
a subclass computes what it likes, so it declares itself too, and a model whose class
declares nothing is refused by name (:func:`family_of`) -- never taken for an AT model.
"""

from dataclasses import dataclass
from typing import Dict

from fairseq.models.transformer import TransformerModel
from torch import nn

from hrt_runtime.families import AT, HRT, MASK_PREDICT  # noqa: F401  (the exported config's names)


@dataclass(frozen=True)
class ModelFamily:
    """What a model class is and allows.

    ``kind``: its name in logs and in an exported folder's ``config.json`` (``at``, ``hrt``,
    ``mask-predict``); ``left_to_right``: it decodes left to right from ``</s>`` (beam,
    greedy, Jacobi decoding); ``non_causal``: its decoder also runs one non-causal pass over
    ``<mask>`` slots (CMLM / HRT's stage II); ``chunk_sizes``: it is trained for chunk sizes
    ``k`` (Skip-AT from ``<s_k>``; ``mark_trained_chunk_sizes`` / ``get_trained_chunk_sizes``);
    ``length_predictor``: it predicts target lengths (``forward_length``); ``recurrent_decoder``:
    its decoder layers are recurrent (SSRU: causal only)."""

    kind: str
    left_to_right: bool
    non_causal: bool = False
    chunk_sizes: bool = False
    length_predictor: bool = False
    recurrent_decoder: bool = False

    def banned_by_search(self) -> bool:
        """Whether the search bans ``<mask>``, ``<s>`` and ``<s_k>`` (a model that was trained
        with them as inputs never outputs them); an AT model bans only ``<pad>``, as fairseq's
        own search does."""
        return self.non_causal or self.chunk_sizes

    def predicts_eos(self) -> bool:
        """Whether ``</s>`` is a token the model chooses (not given at a predicted length)."""
        return not self.length_predictor


AT_FAMILY = ModelFamily(AT, left_to_right=True)

FAMILIES: Dict[type, ModelFamily] = {}


def declare(family: ModelFamily):
    """Class decorator: ``cls`` is a model of ``family`` (this exact class, not its subclasses)."""

    def register(cls):
        FAMILIES[cls] = family
        return cls

    return register


declare(AT_FAMILY)(TransformerModel)  # fairseq's transformer and this plugin's at_* archs


def unwrap(model):
    """The model inside fairseq's and torch's training wrappers (``ModuleProxyWrapper``,
    ``DistributedDataParallel``: each holds it as ``.module``)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def family_of(model) -> ModelFamily:
    """The declared :class:`ModelFamily` of ``model``'s class (or of a model class); a class
    that declares none is refused by name."""
    cls = model if isinstance(model, type) else type(unwrap(model))
    found = FAMILIES.get(cls)
    if found is None:
        raise ValueError(
            f"{cls.__module__}.{cls.__name__} is not a model family of fairseq-hrt: this plugin decodes, trains and "
            f"exports the model classes that declare what they are (fairseq's transformer, "
            f"{', '.join(sorted(c.__name__ for c in FAMILIES if c is not TransformerModel))}); a new family declares "
            "itself with fairseq_hrt.models.kinds.declare (docs/design.md, 'Adding a model family')"
        )
    return found
