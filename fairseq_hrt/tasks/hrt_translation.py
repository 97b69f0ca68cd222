"""``--task hrt_translation``: translation with HRT's chunk-aware samples (SPEC section 2).

* Dictionaries get ``<mask>`` and ``<s2>``..``<s8>`` at load time, identically for training
  and inference, so AT, CMLM and HRT models on the same binarized data share a vocabulary.
* ``train_step`` builds, per batch, one autoregressive and one non-autoregressive sample per
  pair: ``round(n * p_k)`` pairs, drawn at random, give {Skip-AT, Skip-CMLM}, the others {AT, CMLM},
  with ``p_k = (t / T) ** lambda`` from the trainer's update count (so resuming continues the
  curriculum). ``--hrt-mode at`` / ``cmlm`` train the baselines with the same task.
* MixDistill: with ``--distill-data``, each pair's target is the raw reference with
  probability ``--p-raw``, else the aligned distilled one.

The task is an adapter of fairseq's hooks: the samples are built by :mod:`fairseq_hrt.chunking`,
the distilled targets read by :mod:`fairseq_hrt.data.mixdistill`, sources repaired and cut at
``--max-source-positions`` by :mod:`fairseq_hrt.data.source_input`, checkpoints checked by
:mod:`fairseq_hrt.checkpoint_checks` (their state) and :mod:`fairseq_hrt.checkpoint_files` (a
truncated file before fairseq-train restores it), ``--shortlist`` read by :mod:`fairseq_hrt.shortlist`,
``--cpu-autocast-bf16`` and ``--cpu-dropout-rng`` applied by :mod:`fairseq_hrt.tasks.cpu_training`
and ``--quantize`` by :mod:`fairseq_hrt.tasks.deferred_quantization`.
"""

import inspect
import json
import logging
from argparse import Namespace
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq.data import encoders
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics
from fairseq.tasks import FairseqTask, register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from fairseq_hrt import checkpoint_checks, checkpoint_files, chunking
from fairseq_hrt import shortlist as shortlists
from fairseq_hrt.cli_logging import RefusedOptions, install_refusal_hook
from fairseq_hrt.criterions.hrt_loss import check_mode_matches_model
from fairseq_hrt.data import mixdistill, source_input
from fairseq_hrt.generation import hypotheses, strategies
from fairseq_hrt.generation.engines import engines_help
from fairseq_hrt.generation.options import DecodingOptions, task_field
from fairseq_hrt.models import ssru_transformer, tied_layers
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.symbols import MASK_SYMBOL, MAX_CHUNK_SIZE, add_hrt_symbols, chunk_start_symbol
from fairseq_hrt.tasks.cpu_training import CPU_DROPOUT_RNG_CHOICES, CpuTraining
from fairseq_hrt.tasks.deferred_quantization import QUANTIZATIONS, DeferredQuantization

logger = logging.getLogger(__name__)

DEFAULT_P_RAW = 0.5  # MixDistill's share of raw targets when --p-raw is not given
HRT_MODES = ChoiceEnum(["hrt", "at", "cmlm"])


def parse_chunk_sizes(text: str) -> List[int]:
    """``"2"`` or ``"2,3,4"`` -> ``[2]`` / ``[2, 3, 4]``; every size must be in 2..8."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise RefusedOptions(f"--chunk-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes:
        raise RefusedOptions("--chunk-sizes is empty")
    bad = [k for k in sizes if not 2 <= k <= MAX_CHUNK_SIZE]
    if bad:
        raise RefusedOptions(
            f"--chunk-sizes {text!r}: chunked training needs every k in 2..{MAX_CHUNK_SIZE} "
            f"(got {bad}); k = 1 is plain AT, which HRT training already includes"
        )
    return sizes


@dataclass
class HRTTranslationConfig(TranslationConfig):
    hrt_mode: HRT_MODES = field(
        default="hrt",
        metadata={
            "help": "training samples: 'hrt' = {AT, CMLM} -> {Skip-AT, Skip-CMLM} with the "
            "curriculum; 'at' = AT samples only (AT baselines, e.g. --arch at_e6d1); "
            "'cmlm' = CMLM samples only (Mask-Predict baselines, --arch cmlm_*)"
        },
    )
    chunk_sizes: str = field(
        default="2",
        metadata={
            "help": "chunk size k of Skip-AT/Skip-CMLM training (2..8), one model per k as in the "
            "papers; a comma-separated list trains one model for several k, assigned to the "
            "chunked pairs of a batch in turn, so each k gets a share of the chunked samples "
            "(costs quality at every k: benchmarks/results/multi30k-study-mini-cpu/report.md)"
        },
    )
    curriculum_lambda: float = field(default=1.0, metadata={"help": "curriculum exponent: p_k = (t / T) ** lambda"})
    curriculum_updates: int = field(
        default=0,
        metadata={"help": "T of the curriculum; 0 = --max-update (the whole training run)"},
    )
    distill_data: Optional[str] = field(
        default=None,
        metadata={
            "help": "directory of a binarized distilled (sequence-level KD) copy of the "
            "training set, made with the same dictionaries and split names; enables MixDistill"
        },
    )
    # None: not given (0.5), so that --p-raw without --distill-data can be refused
    p_raw: Optional[float] = field(
        default=None,
        metadata={
            "help": "MixDistill: probability that a pair uses its raw target rather than the "
            "distilled one (1 = raw data only, 0 = distilled only; default 0.5); needs --distill-data"
        },
    )
    p_raw_chunked: Optional[float] = field(
        default=None,
        metadata={
            "help": "MixDistill for the chunked pairs (Skip-AT and Skip-CMLM samples): probability "
            "of the raw target; default: --p-raw. 0 gives Skip-AT only distilled targets, which "
            "are easier to predict without the tokens in between; needs --distill-data"
        },
    )
    cpu_autocast_bf16: bool = field(
        default=False,
        metadata={
            "help": "train on the CPU under torch.autocast(bfloat16): matrix products and attention in "
            "bfloat16, weights, optimizer state, softmax, layer norm and losses in float32 (fairseq's "
            "--bf16 means TPU, its --amp CUDA). Faster than float32 only on a CPU with AVX512-BF16 or "
            "AMX (benchmarks/results/small-converged-cpu/README.md). Training only: validation, "
            "fairseq-generate and exported models run as before"
        },
    )
    cpu_dropout_rng: CPU_DROPOUT_RNG_CHOICES = field(
        default="pcg64",
        metadata={
            "help": "how fairseq-train draws the dropout masks of tensors on the CPU: 'pcg64' (NumPy's "
            "PCG64, seeded from torch's generator at each call, so runs stay reproducible and resume "
            "alike) or 'torch' (fairseq's F.dropout, whose serial Bernoulli kernel is slower: "
            "benchmarks/results/small-converged-cpu/README.md). The same dropout, another random "
            "stream; GPU tensors always use torch's"
        },
    )
    decoder_tie_layers: bool = field(
        default=False,
        metadata={
            "help": "tie all decoder layers to one set of weights (Marian's tied students, WNGT 2019): "
            "--decoder-layers L runs the same layer L times; the checkpoint stores one copy. For every "
            "model of this task (at_*, *_ssru, hrt_*, cmlm_*)"
        },
    )
    # decoding (fairseq-generate / fairseq-interactive): default and help are DecodingOptions'
    # (one definition); --decoding's and --decoder-engine's help and names come from the
    # strategy and engine registries and are checked when the generator is built
    decoding: str = task_field("decoding", help=strategies.decoding_help())
    decoder_engine: str = task_field("decoder_engine", help=engines_help())
    quantize: QUANTIZATIONS = task_field("quantize")
    compile: bool = task_field("compile")
    shortlist: Optional[str] = task_field("shortlist")
    decode_chunk_size: str = task_field("decode_chunk_size")
    b_nat: int = task_field("b_nat")
    jacobi_block_size: Optional[int] = task_field("jacobi_block_size")
    jacobi_parallel_length: int = task_field("jacobi_parallel_length")
    hrt_refine_fraction: float = task_field("hrt_refine_fraction")
    hrt_fallback_threshold: Optional[float] = task_field("hrt_fallback_threshold")
    hrt_rescore: bool = task_field("hrt_rescore")
    onnx_model: Optional[str] = task_field("onnx_model")
    max_update: int = II("optimization.max_update")
    seed: int = II("common.seed")
    # the checkpoint fairseq-train restores, checked before it does (build_criterion)
    save_dir: str = II("checkpoint.save_dir")
    restore_file: str = II("checkpoint.restore_file")
    finetune_from_model: Optional[str] = II("checkpoint.finetune_from_model")


@register_task("hrt_translation", dataclass=HRTTranslationConfig)
class HRTTranslationTask(TranslationTask):
    cfg: HRTTranslationConfig

    def __init__(self, cfg: HRTTranslationConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self.chunk_sizes = parse_chunk_sizes(cfg.chunk_sizes)
        if len(self.chunk_sizes) > 1 and cfg.hrt_mode == "hrt":
            logger.warning(
                "--chunk-sizes %s: one model for %d chunk sizes. The chunked pairs of every batch "
                "are shared among them, so each k gets 1/%d of the Skip-AT/Skip-CMLM samples that "
                "a model trained for it alone gets, which costs quality at every k "
                "(benchmarks/results/multi30k-study-mini-cpu/report.md). The papers train one model per k.",
                cfg.chunk_sizes,
                len(self.chunk_sizes),
                len(self.chunk_sizes),
            )
        self.p_raw = DEFAULT_P_RAW if cfg.p_raw is None else cfg.p_raw
        if not 0.0 <= self.p_raw <= 1.0:
            raise RefusedOptions(f"--p-raw must be in [0, 1], got {cfg.p_raw}")
        if cfg.p_raw_chunked is not None:
            if not 0.0 <= cfg.p_raw_chunked <= 1.0:
                raise RefusedOptions(f"--p-raw-chunked must be in [0, 1], got {cfg.p_raw_chunked}")
            if not cfg.distill_data:
                raise RefusedOptions("--p-raw-chunked mixes distilled targets: it needs --distill-data")
            if cfg.hrt_mode != "hrt":
                raise RefusedOptions(
                    f"--p-raw-chunked applies to chunked pairs, which --hrt-mode {cfg.hrt_mode} has none of"
                )
        if cfg.curriculum_lambda <= 0:
            raise RefusedOptions(f"--curriculum-lambda must be > 0, got {cfg.curriculum_lambda}")
        self.mask_idx = tgt_dict.index(MASK_SYMBOL)
        self.chunk_start_idx = {k: tgt_dict.index(chunk_start_symbol(k)) for k in range(2, MAX_CHUNK_SIZE + 1)}
        self.interactive_lines_seen = 0  # line numbers in fairseq-interactive's warnings
        self.cpu_training = CpuTraining(cfg)
        self.deferred_quantization = DeferredQuantization(cfg)

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        """fairseq's. Under a command line, an option this task, its models, its criterion or its
        decoding refuse (:class:`~fairseq_hrt.cli_logging.RefusedOptions`, raised where the
        mistake is found) is one line; from Python nothing changes (:func:`install_refusal_hook`)."""
        install_refusal_hook()
        return super().setup_task(cfg, **kwargs)

    @classmethod
    def load_dictionary(cls, filename):
        return add_hrt_symbols(super().load_dictionary(filename))

    # ------------------------------------------------------------------ data

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        if split == self.cfg.train_subset:
            self.check_training_options()
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if self.cfg.distill_data and split == self.cfg.train_subset:
            self.datasets[split] = self._with_distilled_targets(split, self.datasets[split])
        elif split != self.cfg.train_subset:  # fairseq-generate's (and validation's) sources
            source_input.truncate_split(
                split, self.datasets[split], self.cfg.max_source_positions, self.source_dictionary.eos()
            )

    def check_training_options(self):
        """Options that only training reads, checked when the training set is loaded (a
        checkpoint's saved options, read again to decode, are not training's business)."""
        if self.cfg.p_raw is not None and not self.cfg.distill_data:
            raise RefusedOptions(
                f"--p-raw {self.cfg.p_raw} mixes raw and distilled targets, but there is no --distill-data: "
                "add --distill-data FOLDER or drop --p-raw"
            )

    def _with_distilled_targets(self, split, pair_dataset):
        """MixDistill: the split with its aligned distilled targets (:mod:`fairseq_hrt.data.mixdistill`)."""
        return mixdistill.with_distilled_targets(
            pair_dataset,
            split,
            self.cfg.distill_data,
            self.cfg.source_lang,
            self.cfg.target_lang,
            self.tgt_dict,
            self.cfg.dataset_impl,
            p_raw=self.p_raw,
            p_raw_chunked=self.cfg.p_raw_chunked,
        )

    # ------------------------------------------------------- checkpointed task state

    def dictionary_fingerprint(self) -> str:
        """CRC32 of the source and target symbols in order (:func:`symbols.dictionary_fingerprint`):
        two data directories binarized with different dictionaries (even of the same size) differ here."""
        return checkpoint_checks.dictionary_fingerprint(self.source_dictionary, self.target_dictionary)

    def _schedule(self) -> dict:
        return checkpoint_checks.curriculum_schedule(
            self.cfg.hrt_mode,
            self.chunk_sizes,
            self.cfg.curriculum_updates,
            self.cfg.max_update,
            self.cfg.curriculum_lambda,
        )

    def get_checkpoint_dict(self):
        """Saved with every checkpoint (fairseq's task-state hook): the dictionary fingerprint
        and the curriculum's schedule. The curriculum position itself is the trainer's update
        count, which the checkpoint restores, so p_k continues where it was."""
        return {type(self).__name__: {"dictionary": self.dictionary_fingerprint(), **self._schedule()}}

    @classmethod
    def saved_dictionary_fingerprint(cls, checkpoint: dict) -> Optional[str]:
        """The fingerprint :meth:`get_checkpoint_dict` stored in a loaded checkpoint (``None`` for
        a checkpoint of another task)."""
        return (checkpoint.get("extra_state") or {}).get(cls.__name__, {}).get("dictionary")

    def set_checkpoint_dict(self, state):
        """On resume: refuse data binarized with another dictionary, and warn when the
        curriculum's schedule differs (:func:`checkpoint_checks.check_resumed_state`)."""
        checkpoint_checks.check_resumed_state(state, self.dictionary_fingerprint(), self._schedule(), self.cfg.data)

    # ------------------------------------------------------------ training

    def build_criterion(self, cfg, from_checkpoint=False):
        """fairseq's; fairseq-train builds the criterion just before it restores its checkpoint
        (decoding builds none), so a truncated one is refused here with the --restore-file to
        use instead of PyTorch's traceback (:mod:`fairseq_hrt.checkpoint_files`)."""
        save_dir = getattr(self.cfg, "save_dir", None)
        if save_dir is not None:
            checkpoint_files.check_checkpoint_to_restore(
                save_dir, self.cfg.restore_file, getattr(self.cfg, "finetune_from_model", None)
            )
        return super().build_criterion(cfg, from_checkpoint=from_checkpoint)

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
            # TranslationTask.build_model's validation generator (fairseq-train --eval-bleu), built
            # now that an HRT model knows its chunk sizes: it validates with HRT decoding. A model
            # loaded from a checkpoint (load_model_ensemble_and_task with the checkpoint's own
            # task) learns its chunk sizes only when its weights are loaded, after this; it is
            # loaded to decode, with the generator its decoding command builds
            detok_args = json.loads(self.cfg.eval_bleu_detok_args)
            self.tokenizer = encoders.build_tokenizer(Namespace(tokenizer=self.cfg.eval_bleu_detok, **detok_args))
            self.sequence_generator = self.build_generator([model], Namespace(**json.loads(self.cfg.eval_bleu_args)))
        self.deferred_quantization.model_built(model, from_checkpoint)
        return model

    def prepare_models_for_decoding(self, models):
        """What loading for decoding does to the models (``--quantize``), for models built
        elsewhere (those this task loads from a checkpoint are prepared by :meth:`build_decoding`)."""
        for model in models:
            self.deferred_quantization.prepare(model)
        return models

    def curriculum_p_k(self, num_updates: int) -> float:
        total = self.cfg.curriculum_updates or self.cfg.max_update
        if total <= 0:
            raise RefusedOptions(
                "HRT's chunk curriculum needs the total number of updates: set --max-update (or --curriculum-updates)"
            )
        return chunking.curriculum_p_k(num_updates, total, self.cfg.curriculum_lambda)

    def chunked_rows_generator(self, sample, num_updates: int) -> torch.Generator:
        """The RNG that picks a batch's chunked pairs (:func:`chunking.chunked_rows_generator`)."""
        return chunking.chunked_rows_generator(sample["id"], self.cfg.seed, num_updates)

    def build_decoder_samples(self, sample, p_k: Optional[float], generator=None, rows_generator=None):
        """Attach ``sample['hrt']``: the decoder samples of SPEC section 2 for this batch
        (:func:`chunking.batch_decoder_samples`).

        ``p_k=None`` (validation) gives every pair all four kinds, so validation loss
        measures both decoding modes whatever the curriculum stage; ``--hrt-mode at`` /
        ``cmlm`` ignore ``p_k``.
        """
        distilled = sample.get("distilled_target")
        target, hrt = chunking.batch_decoder_samples(
            sample["target"],
            self.cfg.hrt_mode,
            p_k,
            pad=self.tgt_dict.pad(),
            eos=self.tgt_dict.eos(),
            mask=self.mask_idx,
            chunk_sizes=self.chunk_sizes,
            chunk_start=self.chunk_start_idx,
            distilled=distilled,
            p_raw=self.p_raw,
            p_raw_chunked=self.cfg.p_raw_chunked,
            generator=generator,
            rows_generator=rows_generator,
        )
        if distilled is not None:
            sample["target"] = target
        sample["hrt"] = hrt
        return sample

    def begin_epoch(self, epoch, model):
        super().begin_epoch(epoch, model)
        # fairseq-train's model, before its first update (a model built only to decode may be
        # of any architecture whatever this task's --hrt-mode)
        check_mode_matches_model(self.cfg.hrt_mode, model)
        # after --restore-file / --finetune-from-model the flags come from the checkpoint:
        # add the chunk sizes this run trains
        if self.cfg.hrt_mode == "hrt" and family_of(model).chunk_sizes:
            model.mark_trained_chunk_sizes(self.chunk_sizes)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        # fairseq passes the number of updates already done; Algorithm 1 counts t = 1..T, so
        # the last update of the run trains with p_k = 1 (every pair chunked)
        # AT-only / CMLM-only runs have no curriculum: p_k=None there, so none is logged
        p_k = self.curriculum_p_k(update_num + 1) if self.cfg.hrt_mode == "hrt" else None
        rows_generator = self.chunked_rows_generator(sample, update_num) if p_k is not None else None
        sample = self.build_decoder_samples(sample, p_k, rows_generator=rows_generator)
        with self.cpu_training.precision(model):
            return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def valid_step(self, sample, model, criterion):
        sample = self.build_decoder_samples(sample, None)
        return super().valid_step(sample, model, criterion)

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        # fairseq logs no "bleu" for a validation whose hypotheses are all empty (a model in its
        # first updates), and fairseq-train then dies with KeyError: 'bleu' under
        # --best-checkpoint-metric bleu; such a validation's BLEU is 0
        validated = any("_bleu_sys_len" in log for log in logging_outputs)
        if self.cfg.eval_bleu and validated and not any(log.get("_bleu_totals_0", 0) for log in logging_outputs):
            metrics.log_scalar("bleu", 0.0)

    # ------------------------------------------------------------ inference

    def get_batch_iterator(self, dataset, *args, **kwargs):
        """fairseq's, except that only the training set is batched in multiples of
        ``--required-batch-size-multiple``.

        fairseq 0.12's ``batch_by_size`` drops the last batch when its size is not a multiple
        of it (8 by default): ``fairseq-generate --batch-size 1`` translated 999 of 1000 test
        sentences and other batch sizes lost up to 7 without a word. The multiple only aligns
        training batches for throughput, so generation, validation and the Python API batch
        with multiple 1 and see every sentence; training keeps fairseq's batching.
        """
        bound = inspect.signature(FairseqTask.get_batch_iterator).bind(self, dataset, *args, **kwargs)
        if dataset is not self.datasets.get(self.cfg.train_subset):
            bound.arguments["required_batch_size_multiple"] = 1
        return super().get_batch_iterator(*bound.args[1:], **bound.kwargs)

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """fairseq-interactive: one line that cannot be encoded never ends the session; lines are
        repaired and cut at --max-source-positions (:func:`source_input.encode_interactive_lines`)."""
        tokens = source_input.encode_interactive_lines(
            lines, self.interactive_lines_seen + 1, encode_fn, self.source_dictionary, self.cfg.max_source_positions
        )
        self.interactive_lines_seen += len(lines)
        return tokens, [t.numel() for t in tokens]

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        """fairseq-interactive and the hub: truncate over-long sources at --max-source-positions
        (as the papers do, with L = 200) instead of failing on them."""
        source_input.truncate_inference_sources(
            src_tokens, src_lengths, self.cfg.max_source_positions, self.source_dictionary.eos()
        )
        return super().build_dataset_for_inference(src_tokens, src_lengths, constraints=constraints)

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """The generator of ``--decoding`` / ``--decoder-engine`` / ``--shortlist`` / ...: the
        task's options with the per-call ones of ``args`` (:class:`DecodingOptions`), built by
        :func:`fairseq_hrt.generation.strategies.build_generator`."""
        options = DecodingOptions.from_fairseq(self.cfg, args)
        if kwargs.get("prefix_allowed_tokens_fn") is not None:  # fairseq's hub passes it beside args
            options = options.replace(
                sequence_generator_only=(*options.sequence_generator_only, "--prefix-allowed-tokens-fn")
            )
        return self.build_decoding(models, options, self.fairseq_generator(seq_gen_cls, extra_gen_cls_kwargs, **kwargs))

    def fairseq_generator(self, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """fairseq's own ``build_generator`` (``SequenceGenerator``), as the strategies call it:
        ``(models, args, seq_gen_cls=..., extra_gen_cls_kwargs=...)``, the given values the defaults."""

        def build(models, args, seq_gen_cls=seq_gen_cls, extra_gen_cls_kwargs=extra_gen_cls_kwargs):
            return super(HRTTranslationTask, self).build_generator(
                models, args, seq_gen_cls, extra_gen_cls_kwargs, **kwargs
            )

        return build

    def build_decoding(self, models, options: DecodingOptions, fairseq_generator=None):
        """The generator of ``options`` for ``models`` (loaded for decoding). A model this task
        loaded from a checkpoint under ``--quantize int8`` is quantized here, once, before its
        first generator (:mod:`fairseq_hrt.tasks.deferred_quantization`)."""
        self.deferred_quantization.before_decoding(models)
        return strategies.build_generator(
            self,
            models,
            options,
            fairseq_generator or self.fairseq_generator(),
            shortlist=self.load_shortlist(options.shortlist),
        )

    def load_shortlist(self, path: Optional[str] = None):
        """The :class:`~fairseq_hrt.shortlist.Shortlist` of ``path`` (default ``--shortlist``;
        ``None`` without one), checked against this task's dictionaries; read once per path."""
        path = path if path is not None else getattr(self.cfg, "shortlist", None)
        if not path:
            return None
        cached = getattr(self, "_shortlist", None)
        if cached is not None and cached[0] == path:
            return cached[1]
        shortlist = shortlists.load_for_decoding(
            path, self.source_dictionary, self.target_dictionary, self.dictionary_fingerprint(), self.cfg.data
        )
        self._shortlist = (path, shortlist)
        return shortlist

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        """Empty source sentences (only </s>) get an empty translation without decoding."""
        src = sample["net_input"]["src_tokens"]
        empty = src.ne(self.source_dictionary.pad()).long().sum(dim=1) <= 1
        if not empty.any():
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)
        results = [None] * src.size(0)
        eos = self.target_dictionary.eos()
        for i in empty.nonzero().view(-1).tolist():
            results[i] = [hypotheses.hypothesis(src.new_tensor([eos]), torch.tensor(0.0), torch.zeros(1))]
        rest = (~empty).nonzero().view(-1).tolist()
        if rest:
            sub = hypotheses.select_rows(sample, rest)
            sub_prefix = prefix_tokens[rest] if prefix_tokens is not None else None
            sub_constraints = constraints[rest] if constraints is not None else None
            for i, hypos in zip(rest, super().inference_step(generator, models, sub, sub_prefix, sub_constraints)):
                results[i] = hypos
        return results
