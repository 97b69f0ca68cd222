"""Decoding strategies: one interface, one registry, one factory (``--decoding``).

A strategy turns a :class:`DecodingContext` (task, models, :class:`DecodingOptions`, the
engine of ``--decoder-engine``, the shortlist) into a generator with fairseq's
``generate(models, sample, **kwargs)``. ``--decoding auto`` asks every registered strategy
whether it is the model's default; a named strategy is checked against the model and fails
with one clear message when it cannot decode it. :func:`build_generator` is the one factory:
the task, the Python API, the benchmarks and ``ddgviz`` all get their generators from it.

Registered in this package: ``beam`` and ``hrt`` (:mod:`.hrt_generator`), ``greedy-at-mode``,
``mask-predict``, and the exact parallel forms of greedy search ``pj`` / ``pgj`` / ``hgj`` and
``hrt-spec`` (:mod:`.jacobi`), each listed in :data:`STRATEGY_CATALOG` with its module, which
is imported when a run first asks for the strategy. A further strategy registers with
:func:`register_decoding` in its own module (docs/design.md).
"""

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Type

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.engines import ENGINES, DecoderEngine, engine_options_in_use, get_engine
from fairseq_hrt.generation.options import DecodingOptions
from fairseq_hrt.generation.quantize import check_quantization, is_quantized
from fairseq_hrt.generation.registry import Entry, Registry
from fairseq_hrt.models.kinds import family_of, unwrap
from fairseq_hrt.passes.search_rules import banned_symbols
from hrt_runtime.families import DESCRIPTION

logger = logging.getLogger(__name__)


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
    not (a message); ``is_default_for`` claims a model for ``--decoding auto``, where the claim
    of the highest ``priority`` wins (a specific strategy above a general one; two claims of
    one priority are an error); ``supports_shortlist``: whether its generator restricts the
    output layer to ``ctx.shortlist``'s candidates (``--shortlist`` is refused otherwise);
    ``supports_compile``: whether its search runs the lean engine's step (``--compile``);
    :meth:`uses_engine`: whether ``--decoder-engine`` runs its search."""

    name: str = ""
    summary: str = ""  # one line of --decoding's help
    priority: int = 0
    supports_shortlist: bool = False
    supports_compile: bool = False

    @classmethod
    def supports(cls, model) -> Optional[str]:
        return None

    @classmethod
    def is_default_for(cls, model) -> bool:
        return False

    @classmethod
    def uses_engine(cls, engine: DecoderEngine) -> bool:
        return True

    @classmethod
    def engine_supports_shortlist(cls, engine: DecoderEngine) -> bool:
        """Whether what this strategy runs of ``engine`` restricts the output layer to a
        shortlist's rows (``--shortlist`` with an engine that cannot is refused)."""
        return engine.supports_shortlist

    @classmethod
    def unsupported(cls, options: DecodingOptions) -> List[str]:
        """The options in use that this strategy cannot honour with any engine (flags, as
        typed); refused before the engine's, whose hint names another engine."""
        return []

    @classmethod
    def build(cls, ctx: DecodingContext):
        raise NotImplementedError


class LeftToRightDecoding(DecodingStrategy):
    """Strategies that decode left to right from ``</s>``: the models that declare it."""

    @classmethod
    def supports(cls, model):
        family = family_of(model)
        if not family.left_to_right:
            return (
                f"{DESCRIPTION[family.kind]} ({type(unwrap(model)).__name__}) has no left-to-right decoder; use "
                f"--decoding {pick_strategy('auto', model).name}"
            )
        return None


def _jacobi(name: str) -> str:
    return f"Jacobi decoding ({name}): greedy search's output in fewer decoder passes (needs --beam 1)"


STRATEGY_CATALOG = {
    "beam": Entry("fairseq_hrt.generation.hrt_generator", "left-to-right beam search (an HRT model in its AT mode)"),
    "greedy-at-mode": Entry(
        "fairseq_hrt.generation.greedy_at_mode",
        "greedy left-to-right search whatever --beam says (an HRT model in its AT mode)",
    ),
    "hgj": Entry("fairseq_hrt.generation.jacobi", _jacobi("hybrid GS-Jacobi")),
    "hrt": Entry("fairseq_hrt.generation.hrt_generator", "two-stage HRT (--decode-chunk-size, --b-nat)"),
    "hrt-spec": Entry(
        "fairseq_hrt.generation.jacobi",
        "an HRT model drafts blocks with its non-autoregressive mode and verifies them with its AT mode: "
        "AT-mode greedy output (needs --beam 1)",
    ),
    "mask-predict": Entry(
        "fairseq_hrt.generation.mask_predict",
        "Mask-Predict (cmlm_* models; --iter-decode-max-iter, --iter-decode-with-beam)",
    ),
    "pgj": Entry("fairseq_hrt.generation.jacobi", _jacobi("parallel GS-Jacobi")),
    "pj": Entry("fairseq_hrt.generation.jacobi", _jacobi("parallel Jacobi")),
}

# by name, whatever the order their modules are imported in (as the engine registry)
DECODING_STRATEGIES: Registry = Registry("decoding strategy", STRATEGY_CATALOG)


def register_decoding(name: str):
    """Register a strategy class under ``name``."""

    def register(cls):
        known = DECODING_STRATEGIES.registered(name)
        if known is not None and known is not cls:
            raise ValueError(f"decoding strategy {name!r} is already registered")
        cls.name = name
        DECODING_STRATEGIES.register(name, cls, cls)
        return cls

    return register


def decoding_help() -> str:
    """``--decoding``'s help, from the registry."""
    return (
        "decoding strategy: 'auto' = the model's default (AT models: beam, HRT models: hrt, cmlm_* models: "
        "mask-predict); "
        + "; ".join(f"'{name}' = {DECODING_STRATEGIES.declared(name, 'summary')}" for name in DECODING_STRATEGIES)
    )


def decoding_choices() -> List[str]:
    """``--decoding``'s values: ``auto`` and every registered strategy."""
    return ["auto", *DECODING_STRATEGIES]


def pick_strategy(name: str, model) -> Type[DecodingStrategy]:
    """``--decoding NAME`` (``auto``: the model's default) -> the strategy class."""
    if name == "auto":
        return default_strategy(model)
    if name not in DECODING_STRATEGIES:
        raise RefusedOptions(f"--decoding {name!r}: choose one of {', '.join(decoding_choices())}")
    strategy = DECODING_STRATEGIES[name]
    reason = strategy.supports(model)
    if reason is not None:
        raise RefusedOptions(f"--decoding {name}: {reason}")
    return strategy


def default_strategy(model) -> Type[DecodingStrategy]:
    """The strategy of ``--decoding auto``: the claim (``is_default_for``) of the highest
    priority; two claims of that priority are refused by name."""
    claims = [s for s in DECODING_STRATEGIES.values() if s.is_default_for(model)]
    if not claims:
        raise RefusedOptions(f"no decoding strategy decodes a {type(unwrap(model)).__name__} by default")
    top = max(s.priority for s in claims)
    winners = [s.name for s in claims if s.priority == top]
    if len(winners) > 1:
        raise RefusedOptions(
            f"--decoding auto: strategies {', '.join(winners)} all claim a {type(unwrap(model)).__name__} "
            f"with priority {top}; give one of them a higher priority"
        )
    return next(s for s in claims if s.priority == top)


def check_supported(
    strategy: Type[DecodingStrategy], engine: DecoderEngine, options: DecodingOptions, models, shortlist
) -> None:
    """One clear error for each option this strategy and engine cannot honour."""
    uses_engine = strategy.uses_engine(engine)
    if shortlist is not None:
        if not strategy.supports_shortlist:
            raise RefusedOptions(
                f"--shortlist is not supported by --decoding {strategy.name}; it restricts the output layer of "
                "left-to-right search (--decoding beam), HRT decoding (--decoding hrt) with an engine that supports "
                f"it ({', '.join(n for n, e in ENGINES.items() if e.supports_shortlist)}), and Mask-Predict"
            )
        if uses_engine and not strategy.engine_supports_shortlist(engine):
            raise RefusedOptions(
                f"--shortlist restricts the output layer of --decoder-engine "
                f"{'/'.join(n for n, e in ENGINES.items() if strategy.engine_supports_shortlist(e))}; "
                f"--decoder-engine {engine.name} "
                "always scores the whole vocabulary"
            )
    if options.compile:
        reasons = []
        if not strategy.supports_compile:
            reasons.append(
                f"--decoding {strategy.name} does not run the lean engine's step (use --decoding beam or hrt)"
            )
        if not engine.supports_compile:
            reasons.append(f"--decoder-engine {engine.name} does not compile its step (use --decoder-engine lean)")
        if options.quantize != "none" or any(is_quantized(m) for m in models):
            reasons.append("--quantize int8 replaces the linear layers by quantized modules (drop one of the two)")
        if reasons:
            raise RefusedOptions("--compile is not supported here: " + "; ".join(reasons))
    if not uses_engine:
        # the strategy decodes the PyTorch model as loaded: an engine's own int8 graphs or
        # exported folder would be silently ignored
        if options.quantize != "none" and engine.quantizes_itself:
            raise RefusedOptions(
                f"--decoding {strategy.name} decodes the PyTorch model itself, "
                f"not with --decoder-engine {engine.name}, "
                f"and --decoder-engine {engine.name} --quantize {options.quantize} leaves that model in float (the "
                f"engine quantizes its own graphs): it would decode in float; use --decoder-engine lean --quantize "
                f"{options.quantize}"
            )
        own = engine_options_in_use(options)
        if own:
            raise RefusedOptions(
                f"{', '.join(own)}: an engine's own option(s); --decoding {strategy.name} does not decode with an "
                f"engine (drop {', '.join(own)})"
            )
        return
    used = strategy.unsupported(options)
    if used:
        raise RefusedOptions(f"--decoding {strategy.name} does not support {', '.join(used)} with any engine")
    used = engine.unsupported(options)
    if used:
        others = [n for n, e in ENGINES.items() if n != engine.name and not e.unsupported(options)]
        raise RefusedOptions(
            f"--decoder-engine {engine.name} does not support {', '.join(used)}; decode with "
            + (f"--decoder-engine {others[0]}" if others else "another engine")
            + " for these options"
        )


def build_generator(
    task, models, options: DecodingOptions, fairseq_generator: Optional[Callable] = None, shortlist=None
):
    """The one factory of generators (the task, the Python API, the benchmarks and ``ddgviz``):
    ``options`` (:class:`DecodingOptions`) -> the generator of its strategy and engine.
    Models are decoded as loaded (``--quantize`` applies at load time,
    :mod:`fairseq_hrt.generation.quantize`); nothing here changes them."""
    strategy = pick_strategy(options.decoding, models[0])
    engine = get_engine(options.decoder_engine)
    check_quantization(models, options.quantize, options.decoder_engine)
    check_supported(strategy, engine, options, models, shortlist)
    ctx = DecodingContext(
        task=task,
        models=models,
        options=options,
        engine=engine,
        fairseq_generator=fairseq_generator,
        shortlist=shortlist,
    )
    return strategy.build(ctx)
