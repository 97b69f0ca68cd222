"""``--quantize`` of the models the HRT task loads from a checkpoint.

fairseq-generate, fairseq-interactive and the hub build the model (where the task learns of
it) before they load its weights, and quantizing before would break loading them; they build
a generator after. So a model loaded under ``--quantize int8`` is remembered when it is built
and quantized, once, when its first generator is built
(:func:`fairseq_hrt.generation.quantize.prepare_for_decoding`).
"""

import weakref

from fairseq.dataclass import ChoiceEnum

from fairseq_hrt.generation.options import QUANTIZE_CHOICES
from fairseq_hrt.generation.quantize import prepare_for_decoding

QUANTIZATIONS = ChoiceEnum(list(QUANTIZE_CHOICES))


class DeferredQuantization:
    """The models built from a checkpoint that are yet to be quantized for decoding."""

    def __init__(self, cfg):
        self.cfg = cfg  # the task's: --quantize and --decoder-engine
        self._pending = weakref.WeakSet()

    def model_built(self, model, from_checkpoint: bool):
        """Remember a model loaded from a checkpoint under ``--quantize``: its weights come later."""
        if from_checkpoint and str(self.cfg.quantize) != "none":
            self._pending.add(model)

    def before_decoding(self, models):
        """Quantize the remembered ones among ``models``, now that their weights are loaded."""
        for model in models:
            if model in self._pending:
                self._pending.discard(model)
                self.prepare(model)

    def prepare(self, model):
        """What loading for decoding does to a model (``--quantize``)."""
        prepare_for_decoding(model, str(self.cfg.quantize), str(self.cfg.decoder_engine))
