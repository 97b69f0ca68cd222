"""The checked options of one translation call and the batches it decodes its lines in: what
:meth:`hrt_runtime.Translator.translate` and ``hrt-serve`` check before anything is read or
decoded, each refusal in one message."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from hrt_runtime.errors import Refused
from hrt_runtime.families import DESCRIPTION, HRT, MASK_PREDICT
from hrt_runtime.options import DECODING_BY_NAME, decoding_values
from hrt_runtime.search import SearchConfig, position_cap
from hrt_runtime.work import line_positions


@dataclass(frozen=True)
class CallOptions:
    """The checked options of one ``translate`` call (see :meth:`Translator.translate`)."""

    search: SearchConfig
    chunk_size: int
    b_nat: int
    batch_size: int
    iterations: int
    length_beam: int
    max_tokens: Optional[int] = None


def batches_of(sources: Sequence[Optional[np.ndarray]], options: "CallOptions") -> List[List[int]]:
    """The batches a call decodes ``sources`` in (``None``: an empty line, in none): their
    indices sorted by length (similar lengths share a batch), cut into batches of at most
    ``options.batch_size`` sentences and ``options.max_tokens`` padded source tokens (at least
    one sentence each). The service cuts a long request the same way, so its parts are the
    batches ``Translator.translate`` would make."""
    todo = sorted((i for i, s in enumerate(sources) if s is not None), key=lambda i: sources[i].size)
    batches, batch = [], []
    for i in todo:
        if batch and (
            len(batch) >= options.batch_size
            or (options.max_tokens is not None and (len(batch) + 1) * sources[i].size > options.max_tokens)
        ):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def check_min_len(min_len: int, max_len_a: float, max_len_b: int, chunk_size: int, max_positions: int):
    """Refuse ``min_len`` beyond every output's length limit before anything is read: with
    ``max_len_a`` 0 the limit does not depend on the input (fairseq's check comes per batch,
    after earlier batches were printed). Stage I at chunk size k makes at most ``max_len_b // k``
    steps, and ``min_len`` counts its steps. The message names the limit that binds: beyond the
    model's positions (:func:`position_cap`) raising ``max_len_b`` would not help."""
    if max_len_a != 0:
        return
    stage1 = SearchConfig(max_len_b=max_len_b).for_chunk_size(chunk_size)
    cap = position_cap(max_positions, chunk_size)
    at = f" at chunk size {chunk_size}" if chunk_size > 1 else ""
    if min_len > cap:
        raise Refused(
            f"min_len {min_len} > {cap}, the longest output the model's {max_positions} target positions "
            f"allow{at}; lower min_len"
        )
    if min_len > stage1.max_len_b:
        stage = f" of stage I{at} (max_len_b // {chunk_size})" if chunk_size > 1 else ""
        raise Refused(
            f"min_len {min_len} > {stage1.max_len_b}, the longest output{stage}; lower min_len or raise "
            f"max_len_b to {min_len * chunk_size}"
        )


def chunk_size_of(model, chunk_size: Optional[int]) -> int:
    """The chunk size a call decodes with: ``chunk_size`` checked against the model (``None``:
    the smallest trained one; 1: AT mode)."""
    trained = model.config["trained_chunk_sizes"]
    if chunk_size is None:
        return min(trained) if trained else 1
    chunk_size = DECODING_BY_NAME["chunk_size"].check(chunk_size)
    if chunk_size > 1 and model.kind != HRT:
        raise Refused(
            f"chunk_size {chunk_size}: this is {DESCRIPTION[model.kind]}, it has no chunk size (chunk_size 1 or None)"
        )
    if chunk_size > 1 and chunk_size not in trained:
        raise Refused(
            f"chunk_size {chunk_size}: this model was trained for chunk sizes "
            f"{', '.join(map(str, trained)) or 'none'}; use one of them, or 1 for AT mode"
        )
    return chunk_size


def call_options(model, **given) -> CallOptions:
    """The options of a call (:data:`hrt_runtime.options.DECODING`: their defaults and
    ranges), checked before anything is read or decoded (one message each; an unknown
    keyword is refused). ``max_tokens``: a batch holds at most this many source tokens (its
    sentences x the longest), as fairseq's ``--max-tokens``: memory stays bounded when lines
    are very long (``None``: only ``batch_size`` counts)."""
    v = decoding_values(**given)
    k = chunk_size_of(model, v["chunk_size"])
    if model.kind == HRT and v["b_nat"] > v["beam"]:
        raise Refused(
            f"b_nat {v['b_nat']} > beam {v['beam']}: stage II fills the top b_nat of the beam's "
            "Skip-AT hypotheses, so b_nat must be <= beam (b_at)"
        )
    if model.kind != MASK_PREDICT:  # Mask-Predict has no min_len
        check_min_len(v["min_len"], v["max_len_a"], v["max_len_b"], k, model.max_target_positions)
    search = SearchConfig(
        beam=v["beam"],
        max_len_a=v["max_len_a"],
        max_len_b=v["max_len_b"],
        min_len=v["min_len"],
        len_penalty=v["lenpen"],
        unk_penalty=v["unkpen"],
        scores=False,  # a call returns text: its greedy steps choose without the log-softmax
    )
    return CallOptions(search, k, v["b_nat"], v["batch_size"], v["iterations"], v["length_beam"], v["max_tokens"])


def positions_of(model, sources: Sequence[Optional[np.ndarray]], options: CallOptions) -> List[int]:
    """The decoder positions each encoded line may cost under ``options`` (0: an empty
    line): :func:`hrt_runtime.work.line_positions`."""
    return [
        0
        if s is None
        else line_positions(
            model.kind,
            int(s.size),
            options.search,
            options.chunk_size,
            options.b_nat,
            options.iterations,
            options.length_beam,
            model.max_target_positions,
        )
        for s in sources
    ]
