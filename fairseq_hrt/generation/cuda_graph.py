"""The CUDA-graph engine (``--decoder-engine cuda-graph``): the planned passes' decoder step,
encoder and non-causal pass (:mod:`fairseq_hrt.passes`) captured once per padded shape as
CUDA graphs and replayed.

At batch 1 on a GPU a decoder step is a few hundred small kernels, and launching them from
Python costs more than running them; a replayed graph launches them all in one call. What
the lean engine already gives (``docs/design.md``, "The CUDA-graph backend"):

* :meth:`~fairseq_hrt.passes.decoder_pass.DecoderPass.static_step`, a step whose shapes do
  not depend on the step (self-attention over the whole cache, the future masked; the step
  index a tensor), so one capture serves every step;
* the self-attention caches written in place, and finished or reordered rows compacted into
  the first rows of the same buffers (``DecoderState.reorder_rows``);
* the choice made on the device, so a step hands back ``(N, top)`` arrays only.

A graph (:class:`StepGraph`) owns fixed buffers -- the tokens and step index, the logit
bias, every layer's self-attention cache and encoder keys/values, the chosen rows -- for a
:class:`GraphShape`: sentences rounded up to a power of two, rows per sentence (the beam),
cache length and source length rounded up to powers of two (at least 16), start symbol and
``top``. The backend keeps the graphs it captured (one per shape and model;
a benchmark's warm-up pays for their capture) and at each batch loads the batch's encoder
keys/values into the graph's buffers. Rows beyond the batch's are computed and never read;
their inputs are kept finite so that no NaN reaches a cache. When sentences finish and the
live ones fit a graph of half as many sentences or fewer, the live rows move into that graph
(its caches up to the current step, its encoder rows), so a large batch does not compute its
finished rows to the end.

A greedy search of at most :data:`LOOP_ROWS` sentences makes no host round trip a step
(:meth:`CudaGraphBackend.greedy_loop`, as ``ExportedModel.greedy_loop`` for ONNX Runtime): a
:class:`LoopGraph` replays :data:`LOOP_STEPS` captured static steps at a time, each feeding its
chosen token back on the device, its logit bias picked on the device from the search's three
(usual, before ``min_len``, at ``max_len``), its token and log-probability recorded; only a
one-element "every row has ended" flag comes back between replays, and the record at the end.
Larger batches, beams and shortlists get ``None``: the search makes the steps.

The encoder (:class:`EncoderRun`: the planned encoder pass,
:class:`~fairseq_hrt.passes.encoder_pass.EncoderPass`, with every decoder layer's encoder
keys/values) and the non-causal pass of HRT's stage II and Mask-Predict (:class:`ParallelRun`:
:func:`~fairseq_hrt.passes.fixed_pass.parallel_choice`, the decoder layer of the lean pass
over the folded plan, with its choice at every slot) are captured too, over padded shapes of
their own: the same functions the exported graphs are traced from.

In float32 the same tokens as ``--decoder-engine lean`` (``tests/test_cuda_graph.py``: on a
GPU, and with ``captures`` false on CPU, where the graphs' bodies run uncaptured).
"""

import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.engines import register_engine
from fairseq_hrt.generation.lean import (
    LeanEngine,
    LeanSequenceGenerator,
    TorchBackend,
    TorchEncoded,
    TorchRows,
)
from fairseq_hrt.models.kinds import family_of
from fairseq_hrt.passes.attention import attention_kernel
from fairseq_hrt.passes.decoder_pass import (
    DecoderState,
    EncoderKV,
    profiled,
    relative_buckets,
    unplanned_modules,
    weights_version,
)
from fairseq_hrt.passes.encoder_pass import EncoderPass
from fairseq_hrt.passes.fixed_pass import FixedPass, parallel_choice
from fairseq_hrt.passes.token_choice import choose
from hrt_runtime.search import position_cap

LEAST_BUCKET = 16  # the shortest cache and source lengths a graph is captured for


def bucket(n: int, least: int = 1) -> int:
    """The power of two at or above ``max(n, least)``: the sizes graphs are captured for."""
    return 1 << (max(n, least) - 1).bit_length()


def step_bucket(steps: int, cap: int) -> int:
    """The cache length of a graph for ``steps`` steps: :func:`bucket` of it, at least
    :data:`LEAST_BUCKET`, never past ``cap`` (the most steps the decoder's positions allow,
    which ``steps`` never exceeds)."""
    return max(steps, min(bucket(steps, LEAST_BUCKET), cap))


@dataclass(frozen=True)
class GraphShape:
    """What one captured graph serves: ``sentences`` (a power of two) of ``per_sentence`` rows,
    ``steps`` cache positions, ``source`` encoder positions, from ``start`` with the ``top``
    best rows of each step chosen."""

    sentences: int
    per_sentence: int
    steps: int
    source: int
    start: int
    top: int

    @property
    def rows(self) -> int:
        return self.sentences * self.per_sentence


def capture(body: Callable[[], None], device) -> "torch.cuda.CUDAGraph":
    """``body`` (reading and writing fixed buffers only) captured as a CUDA graph, after a
    warm-up on a side stream (cuBLAS workspaces, lazy kernels), as ``torch.cuda.graph`` asks."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


class Captured:
    """``body`` captured (or, ``captures`` false, run as it is at each :meth:`run`), its
    attention on ``kernel``'s kernels (:func:`~fairseq_hrt.passes.attention.attention_kernel`)."""

    def __init__(self, body: Callable[[], None], device, captures: bool, kernel: Optional[str] = None):
        def run_body():
            with attention_kernel(kernel):
                body()

        self.body = run_body
        self.graph = capture(run_body, device) if captures else None

    def run(self):
        if self.graph is None:
            self.body()
        else:
            self.graph.replay()


class DeviceBias:
    """A graph's logit bias ``(V,)`` on the device, copied from the search's array only when
    the search hands another one (its arrays are constants, made once per configuration)."""

    def __init__(self, size: int, device):
        self.tensor = torch.zeros(size, dtype=torch.float32, device=device)
        self.source = None  # the array now in the tensor (held, so its identity stays its own)

    def load(self, bias: np.ndarray):
        if bias is not self.source:
            self.tensor.copy_(torch.from_numpy(np.array(bias, np.float32)))
            self.source = bias


def cuda_graph_refusals(model) -> List[str]:
    """Why the CUDA-graph engine cannot decode ``model`` (empty: it can)."""
    reasons = []
    device = next(model.parameters()).device
    if device.type != "cuda":
        reasons.append(
            f"the model is on {device.type}, not on a CUDA device (a GPU machine, without --cpu; "
            "--decoder-engine lean decodes on CPU)"
        )
    if family_of(model).recurrent_decoder:
        reasons.append("its decoder is recurrent (SSRU): use --decoder-engine lean")
    return reasons


class StepBuffers:
    """The fixed buffers a captured decoder step reads and writes for a :class:`GraphShape`:
    every layer's self-attention cache and the encoder keys/values of its sentences, each kind
    one tensor of every layer's (``caches`` ``(2, L, rows, H, steps, d)``, ``encoder.stacked``),
    so that clearing, loading, reordering or moving them is one tensor operation (one kernel
    launch and dispatch on a GPU), not one a layer."""

    def __init__(self, backend: "CudaGraphBackend", shape: GraphShape, plan, like: EncoderKV):
        self.shape, self.temperature = shape, backend.temperature
        device, dtype = backend.device, like.keys[0].dtype
        heads, head_dim = like.keys[0].size(1), like.keys[0].size(3)
        rows, steps, sentences, source = shape.rows, shape.steps, shape.sentences, shape.source
        decoder_pass = backend.decoder_pass
        layers = len(plan.layers)

        def zeros(*size, dtype=dtype):
            return torch.zeros(*size, dtype=dtype, device=device)

        self.encoder = EncoderKV.of_stack(
            zeros(2, layers, sentences, heads, source, head_dim), zeros(sentences, 1, 1, source, dtype=torch.float32)
        )
        self.caches = zeros(2, layers, rows, heads, steps, head_dim)
        stride = decoder_pass.stride_of(shape.start)
        self.state = DecoderState(
            plan,
            self.encoder,
            list(self.caches[0].unbind(0)),
            list(self.caches[1].unbind(0)),
            [],
            decoder_pass.position_table(steps, stride, shape.start, device),
            relative_buckets(steps, stride, decoder_pass.window).to(device) if decoder_pass.relative else None,
        )
        self._static_step = decoder_pass.static_step

    def clear(self):
        """Zeros in every cache: the static step reads masked future slots, and ``0 x NaN``
        would be NaN."""
        self.caches.zero_()

    def load_encoder(self, kv: EncoderKV, sentences: int):
        """The first ``sentences`` rows of ``kv`` (of ``kv.keys[0].size(2)`` source positions)
        into the graph's encoder buffers; the graph's other sentences attend to zeros."""
        length = kv.keys[0].size(2)
        static = self.encoder.stacked
        static.zero_()
        static[:, :, :sentences, :, :length].copy_(kv.stack()[:, :, :sentences])
        bias = self.encoder.bias
        bias.zero_()
        bias[:sentences].fill_(-float("inf"))
        bias[:sentences, :, :, :length].copy_(kv.bias[:sentences])

    def reorder_rows(self, index: Tensor, step: int):
        """Row ``r`` of the caches becomes old row ``index[r]`` (positions ``0..step``), in place
        (``DecoderState.reorder_rows``, every layer at once)."""
        past = self.caches[:, :, :, :, : step + 1]
        past[:, :, : index.numel()] = past.index_select(2, index)

    def keep_sentences(self, index: Tensor):
        """The encoder rows of the sentences ``index`` moved to the first rows, in place."""
        encoder = self.encoder
        encoder.stacked[:, :, : index.numel()] = encoder.stacked.index_select(2, index)
        encoder.bias[: index.numel()] = encoder.bias.index_select(0, index)


class StepGraph(StepBuffers):
    """One captured step (:class:`GraphShape`): the search's tokens in, its ``top`` best rows
    of each row out, a host round trip a step."""

    def __init__(self, backend: "CudaGraphBackend", shape: GraphShape, plan, like: EncoderKV):
        super().__init__(backend, shape, plan, like)
        device, rows = backend.device, shape.rows
        pin = device.type == "cuda"  # page-locked host buffers: copies to and from the GPU without staging
        # the tokens of a step, then its index: one copy from one pinned host buffer a step
        self.host_inputs = torch.full((rows + 1,), backend.pad, dtype=torch.long, pin_memory=pin)
        self.inputs = self.host_inputs.to(device)
        self.bias = DeviceBias(backend.vocab_size, device)
        # scores, then rows (exact below 2^24)
        self.out = torch.zeros(rows, 2 * shape.top, dtype=torch.float32, device=device)
        self.host_out = torch.empty(rows, 2 * shape.top, dtype=torch.float32, pin_memory=pin)
        self.graph = backend.captured(self._body)

    def _body(self):
        rows, top = self.shape.rows, self.shape.top
        logits = self._static_step(self.state, self.inputs[:rows], self.inputs[rows:])
        score, row = choose(logits, self.bias.tensor, top, self.temperature)
        self.out[:, :top].copy_(score.view(rows, top))
        self.out[:, top:].copy_(row.view(rows, top))

    def run(self, tokens: np.ndarray, step: int, logit_bias: np.ndarray, spread: int):
        """Replay for ``tokens`` ``(N,)`` at ``step``; each token fills ``spread`` consecutive
        rows (a beam's first step: one row per sentence, as the search gives it). Returns
        ``(scores, rows)``, ``(N, top)``, of the rows the search gave."""
        n, top, rows = tokens.size, self.shape.top, self.shape.rows
        host = self.host_inputs.numpy()
        host[: n * spread] = tokens if spread == 1 else np.repeat(tokens, spread)
        host[rows] = step
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        self.bias.load(logit_bias)
        self.graph.run()
        used = n * spread
        self.host_out[:used].copy_(self.out[:used])
        out = self.host_out.numpy()[:used:spread]
        return out[:, :top].copy(), out[:, top:].astype(np.int64)

    def move_into(self, smaller: "StepGraph", live: int, step: int):
        """This graph's first ``live`` sentences, their caches up to ``step``, into ``smaller``."""
        rows = live * self.shape.per_sentence
        smaller.clear()
        smaller.caches[:, :, :rows, :, : step + 1].copy_(self.caches[:, :, :rows, :, : step + 1])
        smaller.load_encoder(self.encoder, live)


# Greedy searches of at most this many sentences run as a device loop (CudaGraphBackend.greedy_loop).
# The loop computes every row to the batch's last step (finished rows are not compacted, the
# batch never moves to a graph of fewer sentences): at a few rows a GPU step is bound by its
# launches, not its rows, so finished rows cost next to nothing while the stepped search pays a
# host round trip every step; with more rows their arithmetic counts, and compaction pays more
# than the round trips. A first choice, not yet measured on a GPU (issue 87).
LOOP_ROWS = 16
# Steps a loop graph makes between reads of its "every row has ended" flag. A read waits for the
# device (one synchronisation per LOOP_STEPS steps instead of one a step), and a batch whose rows
# have all ended still makes the rest of its replay (LOOP_STEPS - 1 steps at worst, half that on
# average): fewer steps a replay waste fewer, more synchronise less. Not yet measured either.
LOOP_STEPS = 4


class LoopGraph(StepBuffers):
    """A greedy search's steps on the device (:meth:`CudaGraphBackend.greedy_loop`), for a
    :class:`GraphShape` of one row per sentence and ``top`` 1: :data:`LOOP_STEPS` static steps
    captured as one graph (and one step as another, for the last steps before the maximum
    length when fewer remain), each step's token fed to the next step (rows are ids: the whole
    vocabulary is scored), its logit bias picked from the search's three by a table of the
    step index against ``min_len`` / ``max_len`` (written once a search), its token and
    log-probability recorded. Between replays only a one-element flag (every row has ended)
    comes back, and the record once at the end. Rows keep decoding after their ``</s>``, as
    ONNX Runtime's loop does: the search reads a row up to its first.

    The bookkeeping around the steps is made once a replay where it can be (the steps'
    indices, the last token kept for the next replay, the ended rows): on a GPU each tensor
    operation is a kernel in every replay."""

    def __init__(self, backend: "CudaGraphBackend", shape: GraphShape, plan, like: EncoderKV):
        super().__init__(backend, shape, plan, like)
        device, rows, steps = backend.device, shape.rows, shape.steps
        pin = device.type == "cuda"
        self.eos = backend.eos
        # the first step's index, then each step's bias (0 usual, 1 before min_len, 2 at
        # max_len: Rules.bias): one copy from one pinned host buffer a search
        self.host_settings = torch.zeros(1 + steps, dtype=torch.long, pin_memory=pin)
        self.settings = self.host_settings.to(device)
        self.step, self.which = self.settings[:1], self.settings[1:]
        self.offsets = torch.arange(LOOP_STEPS, device=device)
        self.tokens = torch.full((rows,), shape.start, dtype=torch.long, device=device)  # the next step's input
        self.ended = torch.ones(rows, dtype=torch.bool, device=device)  # rows beyond the batch's: ended
        self.all_ended = torch.zeros(1, dtype=torch.bool, device=device)
        self.biases = torch.zeros(3, backend.vocab_size, dtype=torch.float32, device=device)
        self.bias_sources: List[Optional[np.ndarray]] = [None, None, None]  # the arrays now in `biases`
        # every step's log-probability and token, each copied back once a search
        self.scores = torch.zeros(rows, steps, dtype=torch.float32, device=device)
        self.chosen = torch.zeros(rows, steps, dtype=torch.long, device=device)
        self.host_scores = torch.empty(rows, steps, dtype=torch.float32, pin_memory=pin)
        self.host_chosen = torch.empty(rows, steps, dtype=torch.long, pin_memory=pin)
        self.replay = backend.captured(lambda: self._steps(LOOP_STEPS))
        self.single = backend.captured(lambda: self._steps(1))

    def _steps(self, n: int):
        # the capture's warm-up steps from whatever index the buffers hold: the indices stay in
        # the cache (a search's own steps, up to max_len <= steps - 1, are never clamped)
        at = (self.step + self.offsets[:n]).clamp_(max=self.shape.steps - 1)
        tokens = self.tokens
        for i in range(n):
            index = at[i : i + 1]
            logits = self._static_step(self.state, tokens, index)
            bias = self.biases.index_select(0, self.which.index_select(0, index)).view(-1)
            score, tokens = choose(logits, bias, 1, self.temperature)
            tokens = tokens.view(-1)
            self.scores.index_copy_(1, index, score.view(-1, 1))
            self.chosen.index_copy_(1, index, tokens.view(-1, 1))
        self.tokens.copy_(tokens)
        self.ended |= tokens.eq(self.eos) if n == 1 else self.chosen.index_select(1, at).eq(self.eos).any(1)
        self.all_ended.copy_(self.ended.all().view(1))
        self.step.add_(n)

    def _load_biases(self, biases):
        for i, bias in enumerate(biases):
            if bias is not self.bias_sources[i]:
                self.biases[i].copy_(torch.from_numpy(np.array(bias, np.float32)))
                self.bias_sources[i] = bias

    def _load_settings(self, max_len: int, min_len: int):
        host = self.host_settings.numpy()
        host[0] = 0
        step = np.arange(self.shape.steps)
        host[1:] = np.where(step >= max_len, 2, np.where(step < min_len, 1, 0))  # Rules.bias
        self.settings.copy_(self.host_settings, non_blocking=True)

    def run(self, kv: EncoderKV, sentences: int, max_len: int, min_len: int, biases):
        """``(tokens, scores)``, ``(sentences, T)``: the steps 0.. ``T - 1`` made, every row's
        token and log-probability, ``T`` the steps up to the replay in which every row had
        ended, or ``max_len + 1``."""
        self.clear()
        self.load_encoder(kv, sentences)
        self._load_biases(biases)
        self._load_settings(max_len, min_len)
        self.tokens.fill_(self.shape.start)
        self.ended.fill_(True)
        self.ended[:sentences] = False
        total, made = max_len + 1, 0
        while made < total:
            if total - made < LOOP_STEPS:
                for _ in range(total - made):
                    self.single.run()
                made = total
                break
            self.replay.run()
            made += LOOP_STEPS
            if made < total and bool(self.all_ended):  # the one read that waits for the device
                break
        self.host_scores.copy_(self.scores)
        self.host_chosen.copy_(self.chosen)
        return self.host_chosen.numpy()[:sentences, :made].copy(), self.host_scores.numpy()[:sentences, :made].copy()


class EncoderRun:
    """The encoder of ``sentences`` x ``length`` source tokens (a power of two of each, the
    batch's sources at the top left, ``<pad>`` around them: positions count the tokens that
    are not padding, so where the padding is changes nothing) captured with the projection of
    every decoder layer's encoder keys/values into one buffer (:meth:`EncoderPass.stacked`).
    Rows beyond the batch's hold ``</s>`` alone, a finite empty sentence."""

    def __init__(self, backend: "CudaGraphBackend", encode, sentences: int, length: int):
        device, self.pad, self.eos = backend.device, backend.source_pad, backend.source_eos
        self.tokens = torch.full((sentences, length), self.pad, dtype=torch.long, device=device)
        self.encode = encode
        with torch.no_grad():
            first = encode.stacked(self.tokens)  # the outputs' shapes and dtypes
        self.outputs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in first]  # contiguous
        self.graph = backend.captured(self._body)

    def _body(self):
        for static, value in zip(self.outputs, self.encode.stacked(self.tokens)):
            static.copy_(value)

    def __call__(self, src_tokens: Tensor) -> EncoderKV:
        """The keys/values of the batch ``src_tokens`` ``(B, S)``: copies, the next batch
        replays into the graph's buffers."""
        b, s = src_tokens.shape
        self.tokens.fill_(self.pad)
        self.tokens[:b, :s].copy_(src_tokens)
        self.tokens[b:, 0] = self.eos
        self.graph.run()
        bias, kv = self.outputs
        return EncoderKV.of_stack(kv[:, :, :b].clone(), bias[:b].clone())


class ParallelRun:
    """One non-causal pass (HRT's stage II, Mask-Predict's iterations) of ``rows`` x ``width``
    tokens, ``queries`` columns read, over ``source`` encoder positions, captured with its
    choice at every ``(row, query)`` slot (:func:`parallel_choice`): the search's
    slots are picked from the copy that comes back. Tokens, positions and query columns travel
    in one copy from one page-locked buffer; padded slots hold ``<pad>`` (masked as keys), padded
    rows ``</s>`` first, padded queries column 0."""

    def __init__(self, backend: "CudaGraphBackend", fixed, rows: int, width: int, queries: int, like: EncoderKV):
        device, self.pad, self.eos = backend.device, backend.pad, backend.eos
        pin = device.type == "cuda"
        self.rows, self.width, self.queries = rows, width, queries
        self.host = torch.zeros(2 * rows * width + queries, dtype=torch.long, pin_memory=pin)
        self.inputs = self.host.to(device)
        cells = rows * width
        self.tokens = self.inputs[:cells].view(rows, width)
        self.positions = self.inputs[cells : 2 * cells].view(rows, width)
        self.columns = self.inputs[2 * cells :]
        self.select = torch.arange(rows * queries, device=device)
        self.bias = DeviceBias(backend.vocab_size, device)
        _, heads, source, head_dim = like.keys[0].shape
        self.encoder = EncoderKV.of_stack(
            torch.zeros(2, len(like.keys), rows, heads, source, head_dim, dtype=like.keys[0].dtype, device=device),
            torch.zeros(rows, 1, 1, source, dtype=torch.float32, device=device),
        )
        self.fixed = fixed
        self.out = torch.zeros(rows * queries, 2, dtype=torch.float32, device=device)  # score, row
        self.host_out = torch.empty(rows * queries, 2, dtype=torch.float32, pin_memory=pin)
        host = self.host.numpy()
        host[:cells] = self.pad
        host[:cells:width] = self.eos
        self.inputs.copy_(self.host)
        self.graph = backend.captured(self._body)

    def _body(self):
        score, row = parallel_choice(
            self.fixed, self.tokens, self.positions, self.columns, self.select, self.bias.tensor, self.encoder
        )
        self.out[:, 0].copy_(score)
        self.out[:, 1].copy_(row)

    def __call__(self, kv: EncoderKV, tokens, positions, queries, select, logit_bias):
        n, t = tokens.shape
        q, cells = queries.size, self.rows * self.width
        host = self.host.numpy()
        grid = host[:cells].reshape(self.rows, self.width)
        grid[:n] = self.pad
        grid[:n, :t] = tokens
        grid[n:, 0] = self.eos
        grid = host[cells : 2 * cells].reshape(self.rows, self.width)
        grid[:n] = 0
        grid[:n, :t] = positions
        host[2 * cells :] = 0
        host[2 * cells : 2 * cells + q] = queries
        self.inputs.copy_(self.host, non_blocking=True)
        self.encoder.stacked[:, :, :n].copy_(kv.stack())
        self.encoder.bias[:n].copy_(kv.bias)
        self.bias.load(logit_bias)
        self.graph.run()
        self.host_out.copy_(self.out)
        out = self.host_out.numpy()
        select = np.asarray(select, np.int64)
        slots = (select // q) * self.queries + select % q
        return out[slots, 0].copy(), out[slots, 1].astype(np.int64)


class GraphState:
    """A batch on the CUDA-graph backend: its graph (chosen at the first step, when ``top`` is
    known), its live sentences, and ``spread`` (rows of the graph per row of the search: the
    beam before the first reorder, else 1)."""

    def __init__(self, encoded: TorchEncoded, rows: int, steps: int, start: int):
        self.kv = encoded.kv
        self.sentences = encoded.size
        self.per_sentence = max(1, rows // max(1, self.sentences))
        self.steps, self.start = steps, start
        self.graph: Optional[StepGraph] = None
        self.spread = 1


class CudaGraphBackend(TorchBackend):
    """:class:`~fairseq_hrt.generation.lean.TorchBackend` whose steps replay captured CUDA
    graphs (see the module's docstring), as do its encoder and non-causal passes (the planned
    passes' functions, captured). ``captures`` false (a subclass's): the graphs' bodies run as they are, on any
    device, with the same buffers and bookkeeping (what the tests check without a GPU)."""

    captures = True

    def __init__(self, model, tgt_dict, chunk_start=None, mask=None, temperature: float = 1.0, compile=False):
        reasons = cuda_graph_refusals(model) if self.captures else []
        reasons += ["--compile (the graph is the step)"] if compile else []
        if reasons:
            raise RefusedOptions("--decoder-engine cuda-graph cannot decode here: " + "; ".join(reasons))
        super().__init__(model, tgt_dict, chunk_start, mask, temperature)
        self._graphs: Dict[GraphShape, StepGraph] = {}
        self._loops: Dict[GraphShape, LoopGraph] = {}  # greedy searches' loops (per_sentence and top 1)
        self._encoders: Dict[Tuple[int, int], EncoderRun] = {}
        self._parallel: Dict[Tuple[int, int, int, int], ParallelRun] = {}
        self._modules: Dict[str, object] = {}  # the encoder's and the non-causal pass's planned passes
        self._weights = None  # what the graphs were made of: the decoder's plan, the model's weights_version
        self.capture_seconds = 0.0  # spent making graphs (their buffers, warm-up and capture)
        self.loop_runs = 0  # greedy searches made by a device loop (greedy_loop not None)
        # greedy searches of at most this many sentences run as a device loop (0: none, every step a
        # round trip: the benchmark's same-run row without the loop)
        self.loop_rows = LOOP_ROWS
        # the kernels of the graphs' attention: None, written out; "fused", one
        # scaled_dot_product_attention (passes/attention.py), the benchmark's cuda-graph-fused row
        self.attention_kernel: Optional[str] = None

    def captured(self, body: Callable[[], None]) -> Captured:
        """``body`` captured with this backend's device and attention kernel."""
        return Captured(body, self.device, self.captures, self.attention_kernel)

    @property
    def graphs(self) -> int:
        """How many graphs this backend has made (and keeps): steps, greedy loops, encoders,
        non-causal passes."""
        return len(self._graphs) + len(self._loops) + len(self._encoders) + len(self._parallel)

    def _current(self, every_parameter: bool = False):
        """The decoder's plan, after dropping every graph if the weights changed since they were
        made (they read the old tensors, or copies of them): the plan is made again when the
        decoder's weights change; ``every_parameter`` (once a batch, at its encoding) also
        compares the whole model's :func:`weights_version` (the encoder's weights)."""
        plan = self.decoder_pass.plan()
        version = None
        if every_parameter or self._weights is None:
            version = weights_version(self.model)
        known_plan, known_version = self._weights or (None, None)
        if plan is not known_plan or (version is not None and version != known_version):
            self._graphs.clear()
            self._loops.clear()
            self._encoders.clear()
            self._parallel.clear()
            self._modules.clear()
        self._weights = (plan, version if version is not None else known_version)
        return plan

    def _made(self, table: dict, key, make):
        found = table.get(key)
        if found is None:
            started = time.perf_counter()
            found = table[key] = make()
            self.capture_seconds += time.perf_counter() - started
        return found

    def _graph(self, shape: GraphShape, like: EncoderKV) -> StepGraph:
        plan = self._folded_plan()
        return self._made(self._graphs, shape, lambda: StepGraph(self, shape, plan, like))

    def _folded_plan(self):
        """The decoder's plan with the queries' scaling in their projections' weights (the
        non-causal pass's :class:`FixedPass`, made again with the graphs when the weights
        change): a captured step makes no scaling kernel (two a layer)."""
        self._current()
        return self._module("parallel").plan

    def _module(self, name: str):
        """The model's :class:`EncoderPass` (``"encoder"``) or the :class:`FixedPass` that
        :func:`parallel_choice` runs (``"parallel"``), or ``None`` where the planned passes do
        not know its encoder (its eager encoder runs then)."""
        if name not in self._modules:
            if name == "encoder":
                known = not unplanned_modules(self.model.encoder, "encoder")
                self._modules[name] = EncoderPass(self.model) if known else None
            else:
                self._modules[name] = FixedPass(self.model, self.max_target_positions)
        return self._modules[name]

    @profiled("hrt.encoder")
    def encode_fairseq(self, net_input) -> TorchEncoded:
        """The batch's encoder keys/values from a captured encoder (:class:`EncoderRun`); the
        fairseq encoder output is made only if a caller reads it."""
        self._current(every_parameter=True)
        encode = self._module("encoder")
        if encode is None:
            return super().encode_fairseq(net_input)
        src_tokens = net_input["src_tokens"]
        b, s = src_tokens.shape
        key = (bucket(b), bucket(s, LEAST_BUCKET))
        run = self._made(self._encoders, key, lambda: EncoderRun(self, encode, *key))
        return TorchEncoded(
            None, run(src_tokens), make_encoder_out=lambda: self.model.encoder.forward_torchscript(net_input)
        )

    @profiled("hrt.stage2")
    def parallel(self, encoded, tokens, positions, queries, select, logit_bias, out_rows):
        """One non-causal pass and its choice, replayed (:class:`ParallelRun`)."""
        if out_rows.vocab is not None or np.asarray(queries).size == 0:
            return super().parallel(encoded, tokens, positions, queries, select, logit_bias, out_rows)
        self._current()
        kv = encoded.kv
        rows, width = np.asarray(tokens).shape
        key = (bucket(rows), bucket(width, LEAST_BUCKET), bucket(np.asarray(queries).size, 8), kv.keys[0].size(2))
        run = self._made(self._parallel, key, lambda: ParallelRun(self, self._module("parallel"), *key[:3], kv))
        return run(kv, np.asarray(tokens), np.asarray(positions), np.asarray(queries), select, logit_bias)

    def begin(self, encoded: TorchEncoded, rows: int, steps: int, start: int, out_rows: TorchRows) -> GraphState:
        if out_rows.vocab is not None:
            raise RefusedOptions("--decoder-engine cuda-graph always scores the whole vocabulary (no --shortlist)")
        return GraphState(encoded, rows, steps, start)

    def step(self, state: GraphState, tokens: np.ndarray, step: int, logit_bias: np.ndarray, top: int = 1, scores=True):
        """One replayed step's ``(scores, rows)``, scored whatever ``scores`` says (the captured
        choice has them)."""
        graph = state.graph
        if graph is None:
            shape = self._shape(state.sentences, state.per_sentence, state.steps, state.kv, state.start, top)
            graph = state.graph = self._graph(shape, state.kv)
            graph.clear()
            graph.load_encoder(state.kv, state.sentences)
        elif top != graph.shape.top:
            raise ValueError(f"a batch's steps changed their number of candidates ({graph.shape.top} -> {top})")
        n = np.asarray(tokens).size
        if n == state.sentences * graph.shape.per_sentence:
            state.spread = 1
        elif n == state.sentences:  # a beam's first step: one row per sentence
            state.spread = graph.shape.per_sentence
        else:
            raise ValueError(f"{n} rows for {state.sentences} sentences of {graph.shape.per_sentence} rows each")
        scores, rows = graph.run(np.asarray(tokens, np.int64), step, logit_bias, state.spread)
        return (scores[:, 0], rows[:, 0]) if top == 1 else (scores, rows)

    def _shape(self, sentences: int, per_sentence: int, steps: int, kv: EncoderKV, start: int, top: int):
        """The :class:`GraphShape` that serves a batch of ``sentences`` (``kv``) of ``steps`` steps."""
        cap = position_cap(self.max_target_positions, self.stride_of(start)) + 1
        source = bucket(kv.keys[0].size(2), LEAST_BUCKET)
        return GraphShape(bucket(sentences), per_sentence, step_bucket(steps, cap), source, start, top)

    def greedy_loop(self, encoded: TorchEncoded, start: int, max_len: int, min_len: int, biases, out_rows: TorchRows):
        """A greedy search's every step on the device (:class:`LoopGraph`): ``(tokens, scores)``,
        ``(N, T)``, as ``ExportedModel.greedy_loop``; ``None`` above ``loop_rows``
        (:data:`LOOP_ROWS`) sentences or for a shortlist (the search then makes the steps, with
        the same result)."""
        n = encoded.size
        if out_rows.vocab is not None or n > self.loop_rows:
            return None
        plan = self._folded_plan()
        shape = self._shape(n, 1, max_len + 1, encoded.kv, start, 1)
        loop = self._made(self._loops, shape, lambda: LoopGraph(self, shape, plan, encoded.kv))
        self.loop_runs += 1
        return loop.run(encoded.kv, n, max_len, min_len, biases)

    def reorder(self, state: GraphState, index: np.ndarray, step: int, sentences: Optional[np.ndarray] = None):
        graph = state.graph
        index = np.asarray(index, np.int64) * state.spread  # the search's rows -> the graph's
        state.spread = 1
        graph.reorder_rows(self._tensor(index), step)
        if sentences is None:
            return
        live = len(sentences)
        graph.keep_sentences(self._tensor(np.asarray(sentences, np.int64)))
        state.sentences = live
        if live and bucket(live) < graph.shape.sentences:
            state.graph = self._moved(graph, live, step)

    def _moved(self, graph: StepGraph, live: int, step: int) -> StepGraph:
        """The graph of fewer sentences holding ``graph``'s first ``live`` sentences (their
        caches up to ``step``): a batch whose sentences finish stops computing their rows."""
        smaller = self._graph(replace(graph.shape, sentences=bucket(live)), graph.encoder)
        graph.move_into(smaller, live, step)
        return smaller


class CudaGraphSequenceGenerator(LeanSequenceGenerator):
    """:class:`~fairseq_hrt.generation.lean.LeanSequenceGenerator` over :class:`CudaGraphBackend`."""

    engine = "cuda-graph"
    backend_class = CudaGraphBackend


@register_engine("cuda-graph")
class CudaGraphEngine(LeanEngine):
    """The lean engine with its step, encoder and non-causal pass replayed as CUDA graphs (a GPU
    only; a model elsewhere is refused by :class:`CudaGraphBackend`)."""

    supports_shortlist = False
    supports_compile = False
    warms_up_per_shape = True
    generator_class = CudaGraphSequenceGenerator
