"""Decoding strategies: one interface, one registry, one factory (``--decoding``).

A strategy turns a :class:`DecodingContext` (task, models, :class:`DecodingOptions`, the
engine of ``--decoder-engine``, the shortlist) into a generator with fairseq's
``generate(models, sample, **kwargs)``. ``--decoding auto`` asks every registered strategy
whether it is the model's default; a named strategy is checked against the model and fails
with one clear message when it cannot decode it. :func:`build_generator` is the one factory:
the task, the Python API, the benchmarks and ``ddgviz`` all get their generators from it.
The pieces every generator needs -- the hypothesis dictionary, the refusal of inputs it does
not support, the selection of batch rows -- live here once.

Registered in this package: ``beam`` and ``hrt`` (:mod:`.hrt_generator`), ``greedy-at-mode``,
``mask-predict``, and the exact parallel forms of greedy search ``pj`` / ``pgj`` / ``hgj`` and
``hrt-spec`` (:mod:`.jacobi`). A further strategy registers with :func:`register_decoding` in
its own module of this package (docs/design.md).
"""
import copy
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Type

import torch
from torch import Tensor

from fairseq_hrt.generation.engines import ENGINES, DecoderEngine, get_engine
from fairseq_hrt.generation.options import DecodingOptions, SearchOptions  # noqa: F401  (SearchOptions: re-exported)
from fairseq_hrt.generation.quantize import check_quantization, is_quantized
from fairseq_hrt.generation.search_rules import banned_symbols
from fairseq_hrt.models.kinds import is_mask_predict

logger = logging.getLogger(__name__)

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


def to_fairseq(found, device) -> List[List[Dict]]:
    """Hypotheses of :mod:`hrt_runtime.search` (numpy) in fairseq's format, on ``device``."""
    import numpy as np

    def one(h):
        hypo = hypothesis(torch.from_numpy(np.asarray(h["tokens"], np.int64)).to(device), torch.tensor(h["score"]),
                          torch.from_numpy(np.asarray(h["positional_scores"], np.float32)).to(device), steps=h.get("steps"))
        if "stage2_confidence" in h:
            hypo["stage2_confidence"] = torch.tensor(h["stage2_confidence"])
        return hypo

    return [[one(h) for h in hypos] for hypos in found]


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


# ------------------------------------------------------------------------ registry


@dataclass
class DecodingContext:
    """What a strategy may use to build its generator: the task (dictionaries, special
    symbols), the models, the :class:`DecodingOptions`, the engine of ``--decoder-engine``
    (:mod:`fairseq_hrt.generation.engines`), the lexical shortlist of ``--shortlist``
    (:class:`fairseq_hrt.shortlist.Shortlist`, or ``None``) and ``fairseq_generator(models,
    args, **kwargs)``, the task's stock fairseq ``build_generator`` (a ``SequenceGenerator``
    with fairseq's search options)."""

    task: object
    models: list
    options: DecodingOptions
    engine: DecoderEngine
    fairseq_generator: Optional[Callable] = None
    shortlist: Optional[object] = None

    @property
    def model(self):
        return self.models[0]

    def banned(self) -> List[int]:
        return banned_symbols(self.task, self.models[0])


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
        if is_mask_predict(model):
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


def decoding_choices() -> List[str]:
    """``--decoding``'s values: ``auto`` and every registered strategy."""
    return ["auto", *DECODING_STRATEGIES]


def pick_strategy(name: str, model) -> Type[DecodingStrategy]:
    """``--decoding NAME`` (``auto``: the model's default) -> the strategy class."""
    if name == "auto":
        for strategy in DECODING_STRATEGIES.values():
            if strategy.is_default_for(model):
                return strategy
        raise ValueError(f"no decoding strategy decodes a {type(model).__name__} by default")
    if name not in DECODING_STRATEGIES:
        raise ValueError(f"--decoding {name!r}: choose one of {', '.join(decoding_choices())}")
    strategy = DECODING_STRATEGIES[name]
    reason = strategy.supports(model)
    if reason is not None:
        raise ValueError(f"--decoding {name}: {reason}")
    return strategy


def check_supported(strategy: Type[DecodingStrategy], engine: DecoderEngine, options: DecodingOptions, models,
                    shortlist) -> None:
    """One clear error for each option this strategy and engine cannot honour."""
    if shortlist is not None:
        if not strategy.supports_shortlist:
            raise ValueError(
                f"--shortlist is not supported by --decoding {strategy.name}; it restricts the output layer of "
                "left-to-right search (--decoding beam), HRT decoding (--decoding hrt) with an engine that supports "
                f"it ({', '.join(n for n, e in ENGINES.items() if e.supports_shortlist)}), and Mask-Predict"
            )
        if strategy.uses_decoder_engine and not engine.supports_shortlist:
            raise ValueError(
                f"--shortlist restricts the output layer of --decoder-engine "
                f"{'/'.join(n for n, e in ENGINES.items() if e.supports_shortlist)}; --decoder-engine {engine.name} "
                "always scores the whole vocabulary"
            )
    if options.compile:
        reasons = []
        if not strategy.supports_compile:
            reasons.append(f"--decoding {strategy.name} does not run the lean engine's step (use --decoding beam or hrt)")
        if not engine.supports_compile:
            reasons.append(f"--decoder-engine {engine.name} does not compile its step (use --decoder-engine lean)")
        if options.quantize != "none" or any(is_quantized(m) for m in models):
            reasons.append("--quantize int8 replaces the linear layers by quantized modules (drop one of the two)")
        if reasons:
            raise ValueError("--compile is not supported here: " + "; ".join(reasons))
    if options.quantize != "none" and not engine.supports_int8:
        raise ValueError(f"--decoder-engine {engine.name} does not run int8-quantized models (--quantize)")
    if strategy.uses_decoder_engine:
        used = engine.unsupported(options)
        if used:
            others = [n for n, e in ENGINES.items() if n != engine.name and not e.unsupported(options)]
            raise ValueError(
                f"--decoder-engine {engine.name} does not support {', '.join(used)}; decode with "
                + (f"--decoder-engine {others[0]}" if others else "another engine") + " for these options"
            )


def build_generator(task, models, options: DecodingOptions, fairseq_generator: Optional[Callable] = None,
                    shortlist=None):
    """The one factory of generators (the task, the Python API, the benchmarks and ``ddgviz``):
    ``options`` (:class:`DecodingOptions`) -> the generator of its strategy and engine.
    Models are decoded as loaded (``--quantize`` applies at load time,
    :mod:`fairseq_hrt.generation.quantize`); nothing here changes them."""
    strategy = pick_strategy(options.decoding, models[0])
    engine = get_engine(options.decoder_engine)
    check_quantization(models, options.quantize, options.decoder_engine)
    check_supported(strategy, engine, options, models, shortlist)
    ctx = DecodingContext(task=task, models=models, options=options, engine=engine,
                          fairseq_generator=fairseq_generator, shortlist=shortlist)
    return strategy.build(ctx)
