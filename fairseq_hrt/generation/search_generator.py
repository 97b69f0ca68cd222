"""fairseq's generator interface over the one search (:mod:`hrt_runtime.search`) and a backend.

Every engine of this plugin that runs the search itself is a :class:`SearchGenerator` with its
backend: ``lean`` (:class:`~fairseq_hrt.generation.lean.TorchBackend`, the model's own
modules) and ``onnxruntime`` (:class:`hrt_runtime.model.ExportedModel`, the exported graphs).
The search -- greedy, beam, HRT's two stages, Mask-Predict -- and the way a batch is split by
chunk size are written here and there once; an engine only says how it encodes a batch.
"""

from typing import Dict, List, Optional, Sequence

import torch

from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.generation.chunk_size import decode_by_chunk_size
from fairseq_hrt.generation.hypotheses import reject_unsupported_inputs, to_fairseq
from hrt_runtime import search
from hrt_runtime.search import SearchConfig


class SearchGenerator:
    """``generate(models, sample, bos_token=...)`` as fairseq's generators: left to right
    (``chunk_size`` ``None``, or a start symbol ``bos_token`` given: HRT's stage I), HRT's two
    stages (``chunk_size`` an int, or a function of the source lengths giving each sentence's:
    ``--decode-chunk-size by-length``) with ``b_nat`` skeletons per sentence filled, or
    Mask-Predict (``iterations`` > 0, with ``length_beam``). ``banned``: symbols never generated;
    ``shortlist``: each batch decodes over its candidates only (kept as ``last_vocab``). The
    backend's encoding of the last batch is kept as ``last_encoded`` (HRT's stage II of
    :class:`~fairseq_hrt.generation.hrt_generator.HRTGenerator` reads both).

    A subclass sets :attr:`engine` (its ``--decoder-engine`` name) and implements
    :meth:`encode`."""

    engine = ""
    what = ""  # how refusals name this generator (default: "--decoder-engine ENGINE")

    def __init__(
        self,
        backend,
        tgt_dict,
        config: SearchConfig,
        banned: Sequence[int],
        shortlist=None,
        chunk_size=None,
        b_nat: int = 1,
        iterations: int = 0,
        length_beam: int = 1,
    ):
        if config.beam < 1:
            raise RefusedOptions("--beam must be >= 1")
        if chunk_size is not None:
            search.check_b_nat(config.beam, b_nat)
        self.backend = backend
        self.config = config
        self.banned = sorted(set(banned) | {tgt_dict.pad()})
        self.pad, self.eos, self.unk = tgt_dict.pad(), tgt_dict.eos(), tgt_dict.unk()  # fairseq-generate reads eos
        self.shortlist = shortlist
        self.chunk_size, self.b_nat = chunk_size, b_nat
        self.iterations, self.length_beam = iterations, length_beam  # Mask-Predict's I and l
        self.last_vocab: Optional[torch.Tensor] = None
        self.last_encoded = None
        self.on_iteration = None  # Mask-Predict: called with the first row before and after each pass

    def encode(self, net_input):
        """The backend's encoding of a fairseq batch (``length_lprobs`` set for Mask-Predict)."""
        raise NotImplementedError

    def rows_of(self, src_tokens):
        """The output rows of a batch: all, or its shortlist candidates (kept as ``last_vocab``)."""
        if self.shortlist is None:
            return self.backend.rows(None)
        self.last_vocab = self.shortlist.candidates(src_tokens, self.pad)
        return self.backend.rows(self.last_vocab.cpu().numpy())

    @torch.no_grad()
    def generate(self, models, sample, bos_token: Optional[int] = None, **kwargs) -> List[List[Dict]]:
        reject_unsupported_inputs(self.what or f"--decoder-engine {self.engine}", **kwargs)
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        encoded = self.last_encoded = self.encode(net_input)
        found = self.search_of(bos_token)(encoded, src_tokens, bos_token)
        return to_fairseq(found, src_tokens.device)

    def search_of(self, bos_token: Optional[int]):
        """The search this generator runs on a batch, ``(encoded, src_tokens, bos_token) ->
        each sentence's hypotheses``: Mask-Predict where it has iterations, left to right where
        it has no chunk size or is given a start symbol (HRT's stage I), else HRT's two stages."""
        if self.iterations:
            return self._mask_predict
        if self.chunk_size is None or bos_token is not None:
            return self._left_to_right
        return self._two_stages

    def _mask_predict(self, encoded, src_tokens, bos_token=None):
        return search.mask_predict(
            self.backend,
            encoded,
            src_tokens.cpu().numpy(),
            self.iterations,
            self.length_beam,
            self.config.max_len_a,
            self.config.max_len_b,
            self.banned,
            rows=self.rows_of(src_tokens),
            on_iteration=self.on_iteration,
        )

    def _left_to_right(self, encoded, src_tokens, bos_token=None):
        width = src_tokens.size(1)
        return search.left_to_right(
            self.backend, encoded, width, self.config, self.banned, start=bos_token, rows=self.rows_of(src_tokens)
        )

    def _two_stages(self, encoded, src_tokens, bos_token=None):
        """HRT's two stages, the batch split by chunk size; a group of part of the batch decodes
        over its own sentences' encoding and shortlist candidates."""
        width = src_tokens.size(1)  # every group keeps the batch's padded width

        def decode(k: int, index):
            part, part_src = encoded, src_tokens
            if index.size < src_tokens.size(0):
                part = encoded.select(index)
                part_src = src_tokens.index_select(0, torch.from_numpy(index).to(src_tokens.device))
            return search.hrt(
                self.backend, part, width, self.config, k, self.banned, b_nat=self.b_nat, rows=self.rows_of(part_src)
            )

        return decode_by_chunk_size(self.chunk_size, src_tokens, self.pad, decode)
