"""Decoding strategies: one interface, one registry, one place that picks (``--decoding``).

A strategy turns (task, models, generation options) into a generator with fairseq's
``generate(models, sample, **kwargs)``. ``--decoding auto`` asks every registered strategy
whether it is the model's default; a named strategy is checked against the model and fails
with one clear message when it cannot decode it. The pieces every generator needs -- the
hypothesis dictionary, the refusal of options it does not support, the selection of batch
rows -- live here once.

Registered in this package: ``beam`` (left-to-right beam search / greedy), ``hrt``
(two-stage HRT), ``mask-predict``, and the exact parallel forms of greedy search ``pj`` /
``pgj`` / ``hgj`` (Jacobi decoding) and ``hrt-spec`` (:mod:`fairseq_hrt.generation.jacobi`); further strategies register with
:func:`register_decoding` and need no change to the task.
"""
import copy
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Type

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

DECODING_CHOICES = ["auto", "beam", "hrt", "mask-predict", "pj", "pgj", "hgj", "hrt-spec"]
ENGINE_CHOICES = ["lean", "fairseq"]
QUANTIZE_CHOICES = ["none", "int8"]


# ------------------------------------------------------------------- shared pieces


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


def reject_unsupported_inputs(what: str, prefix_tokens=None, constraints=None, **_):
    """Generators that do not implement fairseq's --prefix-size / lexical constraints say so."""
    if prefix_tokens is not None:
        raise ValueError(f"{what} does not support --prefix-size")
    if constraints is not None:
        raise ValueError(f"{what} does not support lexical constraints")


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


def with_options(args, **overrides):
    """A copy of fairseq's generation options (Namespace, dataclass or DictConfig) with some
    values replaced; the caller's options stay as they are."""
    args = copy.deepcopy(args)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@dataclass
class SearchOptions:
    """Left-to-right search options, read from fairseq's generation options with fairseq's
    own defaults (``FairseqTask.build_generator``), so both engines obey the same values."""

    beam: int = 5
    max_len_a: float = 0.0
    max_len_b: int = 200
    min_len: int = 1
    normalize_scores: bool = True
    len_penalty: float = 1.0
    unk_penalty: float = 0.0
    temperature: float = 1.0

    @classmethod
    def from_args(cls, args) -> "SearchOptions":
        return cls(
            beam=getattr(args, "beam", 5),
            max_len_a=getattr(args, "max_len_a", 0),
            max_len_b=getattr(args, "max_len_b", 200),
            min_len=getattr(args, "min_len", 1),
            normalize_scores=not getattr(args, "unnormalized", False),
            len_penalty=getattr(args, "lenpen", 1),
            unk_penalty=getattr(args, "unkpen", 0),
            temperature=getattr(args, "temperature", 1.0),
        )


# fairseq options the lean engine does not implement, with the value that means "off"
LEAN_UNSUPPORTED = {
    "sampling": False,
    "diverse_beam_groups": -1,
    "diversity_rate": -1,
    "match_source_len": False,
    "no_repeat_ngram_size": 0,
    "constraints": None,
    "prefix_size": 0,
    "print_alignment": None,
    "score_reference": False,
    "prefix_allowed_tokens_fn": None,
}


def lean_unsupported_options_used(args) -> List[str]:
    """The flags in ``args`` that only fairseq's SequenceGenerator implements, as typed."""
    used = []
    for name, off in LEAN_UNSUPPORTED.items():
        value = getattr(args, name, off)
        if value is not None and value != off:
            used.append("--" + name.replace("_", "-"))
    return used


def check_lean_options(args):
    """One clear error for generation options that need fairseq's SequenceGenerator."""
    used = lean_unsupported_options_used(args)
    if used:
        raise ValueError(
            f"--decoder-engine lean does not support {', '.join(used)}; decode with "
            "--decoder-engine fairseq (fairseq's SequenceGenerator) for these options"
        )


# ------------------------------------------------------------------------ registry


@dataclass
class DecodingContext:
    """What a strategy may use to build its generator.

    ``fairseq_generator(models, args, **kwargs)`` is the task's stock fairseq
    ``build_generator`` (a ``SequenceGenerator`` with fairseq's search options);
    ``shortlist``: the lexical shortlist of ``--shortlist`` (:class:`fairseq_hrt.shortlist.Shortlist`)
    or ``None``.
    """

    task: object
    models: list
    args: object
    engine: str
    fairseq_generator: Callable
    shortlist: Optional[object] = None
    compile: bool = False


class DecodingStrategy:
    """A way of decoding: ``supports`` says whether it can decode a model (``None``) or why
    not (a message); ``is_default_for`` picks it under ``--decoding auto``;
    ``supports_shortlist``: whether its generator restricts the output layer to
    ``ctx.shortlist``'s candidates (``--shortlist`` is refused otherwise);
    ``uses_decoder_engine``: whether ``--decoder-engine`` picks its search;
    ``supports_compile``: whether its search runs the lean engine's step (``--compile``)."""

    name: str = ""
    supports_shortlist: bool = False
    uses_decoder_engine: bool = True
    supports_compile: bool = False

    @classmethod
    def supports(cls, model) -> Optional[str]:
        return None

    @classmethod
    def is_default_for(cls, model) -> bool:
        return False

    @classmethod
    def build(cls, ctx: DecodingContext):
        raise NotImplementedError


class LeftToRightDecoding(DecodingStrategy):
    """Strategies that decode left to right from ``</s>``: every model but Mask-Predict's."""

    @classmethod
    def supports(cls, model):
        if hasattr(model, "forward_length"):
            return "a Mask-Predict (cmlm_*) model has no left-to-right decoder; use --decoding mask-predict"
        return None


DECODING_STRATEGIES: Dict[str, Type[DecodingStrategy]] = {}


def register_decoding(name: str):
    def register(cls):
        if name in DECODING_STRATEGIES and DECODING_STRATEGIES[name] is not cls:
            raise ValueError(f"decoding strategy {name!r} is already registered")
        cls.name = name
        DECODING_STRATEGIES[name] = cls
        return cls

    return register


def pick_strategy(name: str, model) -> Type[DecodingStrategy]:
    """``--decoding NAME`` (``auto``: the model's default) -> the strategy class."""
    if name == "auto":
        for strategy in DECODING_STRATEGIES.values():
            if strategy.is_default_for(model):
                return strategy
        raise ValueError(f"no decoding strategy decodes a {type(model).__name__} by default")
    if name not in DECODING_STRATEGIES:
        raise ValueError(f"--decoding {name!r}: choose one of auto, {', '.join(DECODING_STRATEGIES)}")
    strategy = DECODING_STRATEGIES[name]
    reason = strategy.supports(model)
    if reason is not None:
        raise ValueError(f"--decoding {name}: {reason}")
    return strategy


def quantize_int8(model):
    """Dynamic int8 quantization of the linear layers that are called as modules.

    The encoder's self-attention projections are left in float: fairseq's
    ``MultiheadAttention`` hands their weights to ``F.multi_head_attention_forward`` on its
    fast path (full sequences, no cache), which needs float weight tensors.
    """
    if any(p.is_cuda for p in model.parameters()):
        raise ValueError(
            "--quantize int8 is dynamic int8 quantization for CPU decoding; drop it on a GPU "
            "(use --fp16 there) or decode with --cpu"
        )
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    names = {
        name: default_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not (name.startswith("encoder.") and ".self_attn." in name)
    }
    quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)
    logger.info("--quantize int8: %d linear layers quantized (dynamic int8)", len(names))
    return model


def check_shortlist_supported(strategy: Type[DecodingStrategy], engine: str):
    """``--shortlist`` restricts the output layer of the lean engine's search (AT beam/greedy,
    HRT stage I / AT mode), of HRT's stage II and of Mask-Predict; other decoders refuse it in
    one message."""
    if not strategy.supports_shortlist:
        raise ValueError(
            f"--shortlist is not supported by --decoding {strategy.name}; it restricts the output layer of "
            "left-to-right search (--decoding beam), HRT decoding (--decoding hrt) with --decoder-engine lean, "
            "and Mask-Predict"
        )
    if engine != "lean" and strategy.uses_decoder_engine:
        raise ValueError(
            "--shortlist restricts the output layer of --decoder-engine lean; fairseq's SequenceGenerator "
            "(--decoder-engine fairseq) always scores the whole vocabulary: decode with --decoder-engine lean"
        )


def check_compile_supported(strategy: Type[DecodingStrategy], engine: str, quantize: str):
    """``--compile`` compiles the lean engine's decoder step; every other combination is
    refused, all reasons in one message."""
    reasons = []
    if not strategy.supports_compile:
        reasons.append(f"--decoding {strategy.name} does not run the lean engine's step (use --decoding beam or hrt)")
    if engine != "lean":
        reasons.append("--decoder-engine fairseq runs fairseq's SequenceGenerator (use --decoder-engine lean)")
    if quantize != "none":
        reasons.append(f"--quantize {quantize} replaces the linear layers by quantized modules (drop one of the two)")
    if reasons:
        raise ValueError("--compile is not supported here: " + "; ".join(reasons))


def build_decoding(task, models, args, decoding: str, engine: str, quantize: str, fairseq_generator: Callable,
                   shortlist=None, compile: bool = False):
    """The one place that turns ``--decoding`` / ``--decoder-engine`` / ``--quantize`` /
    ``--shortlist`` / ``--compile`` into a generator."""
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"--decoder-engine must be one of {ENGINE_CHOICES}, got {engine!r}")
    strategy = pick_strategy(decoding, models[0])
    if shortlist is not None:
        check_shortlist_supported(strategy, engine)
    if compile:
        check_compile_supported(strategy, engine, quantize)
    if quantize == "int8":
        for model in models:
            quantize_int8(model)
    elif quantize != "none":
        raise ValueError(f"--quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    ctx = DecodingContext(task=task, models=models, args=args, engine=engine, fairseq_generator=fairseq_generator,
                          shortlist=shortlist, compile=compile)
    return strategy.build(ctx)
