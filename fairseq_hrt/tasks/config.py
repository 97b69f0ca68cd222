"""``--task hrt_translation``'s options (:class:`HRTTranslationConfig`) and the checks of
them that need no data (:func:`checked_training_options`).

The field names are what checkpoints store (their ``cfg.task``): renaming one breaks loading
the checkpoints written before."""

import logging
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks.translation import TranslationConfig
from omegaconf import II

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.engines import engines_help
from fairseq_hrt.generation.options import task_field
from fairseq_hrt.generation.strategies import decoding_help
from fairseq_hrt.symbols import MAX_CHUNK_SIZE
from fairseq_hrt.tasks.cpu_training import CPU_DROPOUT_RNG_CHOICES
from fairseq_hrt.tasks.deferred_quantization import QUANTIZATIONS

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
    decoding: str = task_field("decoding", help=decoding_help())
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
    # checked before fairseq loads them (fairseq_hrt/compat.py), and fp16 training on the CPU refused
    path: Optional[str] = II("common_eval.path")
    fp16: bool = II("common.fp16")
    memory_efficient_fp16: bool = II("common.memory_efficient_fp16")
    cpu: bool = II("common.cpu")


def checked_training_options(cfg: HRTTranslationConfig) -> Tuple[List[int], float]:
    """``(chunk sizes, p_raw)`` of ``cfg``, after refusing the values no task can train with
    (a warning for several chunk sizes in one model)."""
    chunk_sizes = parse_chunk_sizes(cfg.chunk_sizes)
    if len(chunk_sizes) > 1 and cfg.hrt_mode == "hrt":
        logger.warning(
            "--chunk-sizes %s: one model for %d chunk sizes. The chunked pairs of every batch "
            "are shared among them, so each k gets 1/%d of the Skip-AT/Skip-CMLM samples that "
            "a model trained for it alone gets, which costs quality at every k "
            "(benchmarks/results/multi30k-study-mini-cpu/report.md). The papers train one model per k.",
            cfg.chunk_sizes,
            len(chunk_sizes),
            len(chunk_sizes),
        )
    p_raw = DEFAULT_P_RAW if cfg.p_raw is None else cfg.p_raw
    if not 0.0 <= p_raw <= 1.0:
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
    return chunk_sizes, p_raw
