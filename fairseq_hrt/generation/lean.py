"""The lean engine (``--decoder-engine lean``): PyTorch arithmetic under the one search of
:mod:`hrt_runtime.search`.

The search -- greedy, beam, HRT's two stages, their rules -- is written once, on numpy arrays,
in :mod:`hrt_runtime.search`, and run by every engine: ONNX Runtime (the exported graphs,
:class:`hrt_runtime.model.ExportedModel`) and this one. Here the arithmetic is the decoder's
own modules through its one :class:`~fairseq_hrt.passes.decoder_pass.DecoderPass` (so
``--quantize int8``, ``model.half()``, CUDA and ``--compile`` apply), after Amun
(Junczys-Dowmunt et al. 2016):

* self-attention keys/values live in buffers preallocated for the maximum length and written
  in place; the encoder-side keys/values are projected once per sentence and shared by its
  beam; finished sentences leave the batch and the rest are compacted in place;
* the choice is made where the logits are: a step hands the search only the chosen rows and
  their log-probabilities (``(N,)`` or ``(N, 2 x beam)`` arrays), never the logits -- on a GPU
  one small copy per step;
* with a lexical shortlist (``--shortlist``) the output layer is computed for the batch's
  candidates only (the weight rows are sliced once per batch).

:class:`TorchBackend` is the backend contract of :mod:`hrt_runtime.search` (``begin``,
``step``, ``reorder``, ``parallel``; see ``docs/design.md``); :class:`LeanSequenceGenerator`
is fairseq's generator interface over it; :class:`LeanEngine` registers them as
``--decoder-engine lean``.
"""

from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.engines import DecoderEngine, register_engine
from fairseq_hrt.generation.search_generator import SearchGenerator
from fairseq_hrt.passes.decoder_pass import DecoderState, EncoderKV, decoder_pass, profiled
from fairseq_hrt.passes.output_vocab import restricted_output_layer
from fairseq_hrt.passes.token_choice import best_allowed, choose
from hrt_runtime.model import OutputRows
from hrt_runtime.search import SearchConfig


class TorchEncoded:
    """The encoder side of a batch for :class:`TorchBackend`: the encoder output (kept for
    fairseq's callers) and every decoder layer's encoder keys/values (:class:`EncoderKV`),
    one row per sentence. ``make_encoder_out``: a backend that projects the keys/values
    without fairseq's encoder (``cuda-graph``) gives how to make the encoder output instead,
    made when a caller first reads it (HRT's rescoring, Mask-Predict's length)."""

    # length_lprobs: Mask-Predict's (B, classes)
    __slots__ = ("_encoder_out", "_make_encoder_out", "kv", "length_lprobs")

    def __init__(
        self,
        encoder_out,
        kv: EncoderKV,
        length_lprobs: Optional[np.ndarray] = None,
        make_encoder_out: Optional[Callable[[], dict]] = None,
    ):
        self._encoder_out, self._make_encoder_out = encoder_out, make_encoder_out
        self.kv, self.length_lprobs = kv, length_lprobs

    @property
    def encoder_out(self):
        if self._encoder_out is None and self._make_encoder_out is not None:
            self._encoder_out = self._make_encoder_out()
        return self._encoder_out

    @property
    def size(self) -> int:
        return self.kv.bias.size(0)

    def select(self, index) -> "TorchEncoded":
        index = torch.as_tensor(np.asarray(index, np.int64), device=self.kv.bias.device)
        return TorchEncoded(self._encoder_out, self.kv.select(index), make_encoder_out=self._make_encoder_out)


class TorchRows(OutputRows):
    """:class:`~hrt_runtime.model.OutputRows` with the ids as a tensor too (the rows the lean
    step's output layer computes)."""

    def __init__(self, ids: Optional[np.ndarray], device):
        super().__init__(ids)
        self.vocab = None if ids is None else torch.from_numpy(ids).to(device)


class TorchBackend:
    """A model's decoder through its :class:`DecoderPass`, as a backend of
    :mod:`hrt_runtime.search`. ``temperature``: the logits of a step are divided by it
    (``--temperature``); ``compile``: the steps run ``torch.compile``'s static step."""

    def __init__(
        self,
        model,
        tgt_dict,
        chunk_start: Optional[Dict[int, int]] = None,
        mask: Optional[int] = None,
        temperature: float = 1.0,
        compile: bool = False,
    ):
        if temperature <= 0:
            raise RefusedOptions("--temperature must be greater than 0")
        self.model = model
        self.decoder_pass = decoder_pass(model.decoder)
        self.compile = compile
        self._compiled_step = self.decoder_pass.compiled_step() if compile else None
        self.temperature = temperature
        self.pad, self.eos, self.unk, self.bos = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk(), tgt_dict.bos()
        self.mask = mask
        source = getattr(model.encoder, "dictionary", None) or tgt_dict
        self.source_eos, self.source_pad = source.eos(), source.pad()
        self.vocab_size = len(tgt_dict)
        self.max_target_positions = model.max_decoder_positions()
        self.chunk_start = dict(chunk_start or {})

    @property
    def device(self) -> torch.device:
        # read at each use: fairseq-train builds the --eval-bleu generator before the trainer
        # moves the model to the GPU, and a device taken then sent the search's tokens to the CPU
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------ helpers

    def rows(self, ids: Optional[np.ndarray]) -> TorchRows:
        return TorchRows(None if ids is None else np.asarray(ids, np.int64), self.device)

    def _bias(self, bias: np.ndarray) -> Tensor:
        """The search's logit bias as a tensor on the model's device (the search's shared, read-only
        biases are copied: one vocabulary row a step)."""
        return self._tensor(bias)

    def _tensor(self, array: np.ndarray) -> Tensor:
        # the search's arrays may be read-only (made once and shared); PyTorch warns on sharing
        # such memory, so those few (a step's tokens or bias) are copied
        array = np.ascontiguousarray(array)
        return torch.from_numpy(array if array.flags.writeable else array.copy()).to(self.device)

    def _choose(self, logits: Tensor, bias: np.ndarray, top: int):
        """``(scores, rows)`` as numpy: the ``top`` best of ``log_softmax(logits) + bias``."""
        score, row = choose(logits, self._bias(bias), top, self.temperature)
        return score.cpu().numpy(), row.cpu().numpy()

    # ------------------------------------------------------------------------ contract

    @profiled("hrt.encoder")
    def encode_fairseq(self, net_input) -> TorchEncoded:
        """A fairseq batch's ``net_input`` encoded, the encoder keys/values projected once."""
        return self.encoding(self.model.encoder.forward_torchscript(net_input))

    def encoding(self, encoder_out) -> TorchEncoded:
        """The encoding of a batch whose encoder output is given (fairseq's
        ``SequenceGenerator`` as HRT's stage I): its encoder keys/values projected once."""
        return TorchEncoded(encoder_out, self.decoder_pass.encoder(encoder_out))

    def stride_of(self, start: int) -> int:
        return self.decoder_pass.stride_of(start)

    def begin(self, encoded: TorchEncoded, rows: int, steps: int, start: int, out_rows: TorchRows) -> DecoderState:
        return self.decoder_pass.begin(
            encoded.encoder_out, rows, steps, start, vocab=out_rows.vocab, zeroed=self.compile, encoder=encoded.kv
        )

    def step(
        self, state: DecoderState, tokens: np.ndarray, step: int, logit_bias: np.ndarray, top: int = 1, scores=True
    ):
        """One step's ``(scores, rows)``, scored whatever ``scores`` says (the choice and its
        scores are one computation here, :func:`~fairseq_hrt.passes.token_choice.choose`)."""
        prev = self._tensor(tokens)
        if self._compiled_step is None:
            logits = self.decoder_pass.step(state, prev, step)
        else:
            logits = self._compiled_step(state, prev, step)
        return self._choose(logits, logit_bias, top)

    def greedy_loop(self, encoded: TorchEncoded, start: int, max_len: int, min_len: int, biases, out_rows: TorchRows):
        """No whole-search loop: the search makes the steps (a step here costs no Python run)."""
        return None

    def reorder(self, state: DecoderState, index: np.ndarray, step: int, sentences: Optional[np.ndarray] = None):
        state.reorder_rows(self._tensor(index), step)
        if sentences is not None:
            state.select_sentences(self._tensor(sentences))

    @profiled("hrt.stage2")
    def parallel(
        self,
        encoded: TorchEncoded,
        tokens: np.ndarray,
        positions: np.ndarray,
        queries: np.ndarray,
        select: np.ndarray,
        logit_bias: np.ndarray,
        out_rows: TorchRows,
    ):
        features = self.decoder_pass.non_causal(
            encoded.kv, self._tensor(tokens), self._tensor(positions), self._tensor(queries)
        )
        picked = features.reshape(-1, features.size(-1)).index_select(0, self._tensor(select))
        if out_rows.vocab is None:
            logits = self.model.decoder.output_layer(picked)
        else:
            logits = restricted_output_layer(self.model.decoder.output_projection, out_rows.vocab)(picked)
        best, row = best_allowed(logits, self._bias(logit_bias))
        return best.cpu().numpy(), row.cpu().numpy()


# ----------------------------------------------------------------------------- generator


class LeanSequenceGenerator(SearchGenerator):
    """The one search (:class:`SearchGenerator`) over the model's :class:`TorchBackend`, for one
    model. ``compile``: the steps run ``torch.compile``'s static step (``--compile``);
    ``chunk_start`` / ``mask``: an HRT model's start symbols and ``<mask>`` (HRT's two stages
    with ``chunk_size``)."""

    engine = "lean"
    backend_class = TorchBackend  # an engine with its own backend of the lean step subclasses both

    def __init__(
        self,
        model,
        tgt_dict,
        config: SearchConfig,
        banned: Sequence[int] = (),
        shortlist=None,
        compile: bool = False,
        chunk_start: Optional[Dict[int, int]] = None,
        mask: Optional[int] = None,
        chunk_size=None,
        b_nat: int = 1,
        temperature: float = 1.0,
    ):
        backend = self.backend_class(model, tgt_dict, chunk_start, mask, temperature, compile)
        super().__init__(backend, tgt_dict, config, banned, shortlist, chunk_size, b_nat)
        self.model = model
        self.decoder_pass = backend.decoder_pass  # the decoder's one pass

    def encode(self, net_input) -> TorchEncoded:
        return self.backend.encode_fairseq(net_input)


@register_engine("lean")
class LeanEngine(DecoderEngine):
    """This plugin's step loop: preallocated caches, finished sentences leave the batch,
    top-k on the logits, lexical shortlists, ``--compile``."""

    supports_shortlist = True
    supports_compile = True
    generator_class = LeanSequenceGenerator  # its backend: generator_class.backend_class

    def unsupported(self, options):
        return list(options.sequence_generator_only) + super().unsupported(options)

    def backend(self, ctx):
        return self.generator_class.backend_class(
            ctx.model, ctx.task.target_dictionary, ctx.task.chunk_start_idx, ctx.task.mask_idx
        )

    def left_to_right(self, ctx, config, banned):
        if len(ctx.models) != 1:
            raise RefusedOptions(f"--decoder-engine {self.name} decodes a single model (no ensembles)")
        return self.generator_class(
            ctx.models[0],
            ctx.task.target_dictionary,
            config,
            banned,
            shortlist=ctx.shortlist,
            compile=ctx.options.compile,
            temperature=ctx.options.temperature,
        )

    def two_stage(self, ctx, chunk_size):
        """HRT's two stages in the one search (:mod:`hrt_runtime.search`); the stage-II options
        beyond the papers and ``--print-step`` are :class:`HRTGenerator`'s (``None``)."""
        options = ctx.options
        if options.stage2_options_used() or options.print_step:
            return None
        if len(ctx.models) != 1:
            raise RefusedOptions(f"--decoder-engine {self.name} decodes a single model (no ensembles)")
        task = ctx.task
        return self.generator_class(
            ctx.models[0],
            task.target_dictionary,
            options.search_config,
            ctx.banned(),
            shortlist=ctx.shortlist,
            compile=options.compile,
            chunk_start=task.chunk_start_idx,
            mask=task.mask_idx,
            chunk_size=chunk_size,
            b_nat=options.b_nat,
            temperature=options.temperature,
        )
