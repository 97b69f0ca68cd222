"""``--task hrt_translation``: translation with HRT's chunk-aware samples (SPEC section 2).

* Dictionaries get ``<mask>`` and ``<s2>``..``<s8>`` at load time, identically for training
  and inference, so AT, CMLM and HRT models on the same binarized data share a vocabulary.
* ``train_step`` builds, per batch, one autoregressive and one non-autoregressive sample per
  pair: ``round(n * p_k)`` pairs, drawn at random, give {Skip-AT, Skip-CMLM}, the others {AT, CMLM},
  with ``p_k = (t / T) ** lambda`` from the trainer's update count (so resuming continues the
  curriculum). ``--hrt-mode at`` / ``cmlm`` train the baselines with the same task.
* MixDistill: with ``--distill-data``, each pair's target is the raw reference with
  probability ``--p-raw``, else the aligned distilled one.

The task is an adapter of fairseq's hooks, one module per concern: its options
(:mod:`~fairseq_hrt.tasks.config`), the data it reads (:mod:`~fairseq_hrt.tasks.data_loading`),
what checkpoints carry (:mod:`~fairseq_hrt.tasks.checkpoint_state`), training
(:mod:`~fairseq_hrt.tasks.training_hooks`), decoding (:mod:`~fairseq_hrt.tasks.generator_building`),
``--cpu-autocast-bf16`` and ``--cpu-dropout-rng`` (:mod:`~fairseq_hrt.tasks.cpu_training`) and
``--quantize`` (:mod:`~fairseq_hrt.tasks.deferred_quantization`). This module builds the task
and its models.
"""

from fairseq.tasks import FairseqTask, register_task
from fairseq.tasks.translation import TranslationTask

from fairseq_hrt import checkpoint_checks, compat
from fairseq_hrt.models import ssru_transformer, tied_layers
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.symbols import MASK_SYMBOL, MAX_CHUNK_SIZE, add_hrt_symbols, chunk_start_symbol
from fairseq_hrt.tasks.checkpoint_state import CheckpointState
from fairseq_hrt.tasks.config import (  # noqa: F401  (parse_chunk_sizes: imported from here too)
    HRTTranslationConfig,
    checked_training_options,
    parse_chunk_sizes,
)
from fairseq_hrt.tasks.cpu_training import CpuTraining
from fairseq_hrt.tasks.data_loading import DataLoading
from fairseq_hrt.tasks.deferred_quantization import DeferredQuantization
from fairseq_hrt.tasks.generator_building import GeneratorBuilding
from fairseq_hrt.tasks.training_hooks import TrainingHooks


@register_task("hrt_translation", dataclass=HRTTranslationConfig)
class HRTTranslationTask(DataLoading, CheckpointState, TrainingHooks, GeneratorBuilding, TranslationTask):
    cfg: HRTTranslationConfig

    def __init__(self, cfg: HRTTranslationConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        compat.refuse_unsafe_decoding_paths(getattr(cfg, "path", None))  # before fairseq-generate loads them
        self.chunk_sizes, self.p_raw = checked_training_options(cfg)
        self.mask_idx = tgt_dict.index(MASK_SYMBOL)
        self.chunk_start_idx = {k: tgt_dict.index(chunk_start_symbol(k)) for k in range(2, MAX_CHUNK_SIZE + 1)}
        self.cpu_training = CpuTraining(cfg)
        self.deferred_quantization = DeferredQuantization(cfg)

    @classmethod
    def load_dictionary(cls, filename):
        return add_hrt_symbols(super().load_dictionary(filename))

    def build_model(self, cfg, from_checkpoint=False):
        # the model's own configuration (a checkpoint's at decoding time) decides, not the
        # decoding command line's task options
        tie = bool(getattr(cfg, "decoder_tie_layers", False))
        if tie:
            tied_layers.check_tie_options(cfg)
        # FairseqTask's model: TranslationTask's build_model would also build the --eval-bleu
        # generator, before this model says which chunk sizes it trains (below)
        model = FairseqTask.build_model(self, cfg, from_checkpoint)
        family = family_of(model)
        if family.recurrent_decoder:
            mode = getattr(cfg, "hrt_mode", "at")
            if mode != "at":
                ssru_transformer.refuse_ssru_for_non_causal(
                    f"--arch {getattr(cfg, 'arch', '*_ssru')} --hrt-mode {mode}"
                )
        if tie:
            tied_layers.tie_decoder_layers(model.decoder)
        self.cpu_training.set_up_model(model, from_checkpoint)
        if not from_checkpoint and self.cfg.hrt_mode == "hrt" and family.chunk_sizes:
            model.mark_trained_chunk_sizes(self.chunk_sizes)
        checkpoint_checks.check_dictionary_when_loading(model)
        if self.cfg.eval_bleu and not from_checkpoint:
            # now that an HRT model knows its chunk sizes: it validates with HRT decoding. A model
            # loaded from a checkpoint (load_model_ensemble_and_task with the checkpoint's own
            # task) learns its chunk sizes only when its weights are loaded, after this; it is
            # loaded to decode, with the generator its decoding command builds
            self.build_validation_generator(model)
        self.deferred_quantization.model_built(model, from_checkpoint)
        return model
