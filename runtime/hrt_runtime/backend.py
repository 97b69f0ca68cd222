"""The backend contract of the one search (:mod:`hrt_runtime.search`), as ``typing.Protocol``
classes: what the search reads of a backend and of the output rows it makes, nothing else.
Three backends implement it -- :class:`~hrt_runtime.model.ExportedModel` (ONNX Runtime: the
deployed runtime and ``--decoder-engine onnxruntime``), ``fairseq_hrt.generation.lean``'s
``TorchBackend`` (the lean and fairseq engines) and ``fairseq_hrt.generation.cuda_graph``'s
``CudaGraphBackend`` -- and :class:`~hrt_runtime.work.StoppableBackend` wraps one;
``tests/test_backend_contract.py`` checks each against these classes, member by member and
parameter name by parameter name. Torch-free: the runtime imports it.

``encoded`` and ``state`` are a backend's own (its encoding of a batch, with ``size`` its
sentences and ``select(rows)``; its decoder state): the search only hands them back."""

from typing import Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np


@runtime_checkable
class Rows(Protocol):
    """The output-layer rows a batch decodes over (``rows(ids)`` of a backend): the whole
    vocabulary (``ids`` ``None``, row ``t`` is token ``t``) or a shortlist's sorted ids."""

    ids: Optional[np.ndarray]

    def to_full(self, rows: np.ndarray) -> np.ndarray:
        """Vocabulary ids of the rows ``rows``."""

    def position(self, token: int) -> Optional[int]:
        """The row of ``token`` (``None``: not among the rows)."""

    def positions(self, tokens: Sequence[int]) -> List[int]:
        """The rows of those of ``tokens`` that are among the rows."""


@runtime_checkable
class Backend(Protocol):
    """A model's decoder as the search sees it."""

    pad: int
    eos: int
    unk: int
    bos: Optional[int]
    mask: Optional[int]  # Mask-Predict's and HRT's stage II's <mask>
    source_pad: int
    source_eos: int
    vocab_size: int
    max_target_positions: int
    chunk_start: Dict[int, int]  # chunk size k -> <s_k>

    def rows(self, ids: Optional[np.ndarray]) -> Rows:
        """The output rows ``ids`` (sorted; ``None``: the whole vocabulary)."""

    def stride_of(self, start: int) -> int:
        """The position stride of a search from ``start`` (``k`` for ``<s_k>``, else 1)."""

    def begin(self, encoded, rows: int, steps: int, start: int, out_rows: Rows):
        """The decoder state of ``rows`` hypotheses of at most ``steps`` steps from ``start``."""

    def step(
        self, state, tokens: np.ndarray, step: int, logit_bias: np.ndarray, top: int = 1, scores: bool = True
    ) -> Tuple:
        """One step: ``(scores, rows)``, the ``top`` best of each row under ``logit_bias``;
        ``scores`` false (``top`` 1): the scores may be ``None`` (a backend that can choose
        without them), the rows the same."""

    def greedy_loop(
        self, encoded, start: int, max_len: int, min_len: int, biases: Sequence[np.ndarray], out_rows: Rows
    ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Every step of a greedy search at once, ``(tokens, scores)``, or ``None`` (the search
        makes the steps)."""

    def reorder(self, state, index: np.ndarray, step: int, sentences: Optional[np.ndarray] = None) -> None:
        """Row ``r`` of ``state`` becomes old row ``index[r]``; only ``sentences`` remain."""

    def parallel(
        self,
        encoded,
        tokens: np.ndarray,
        positions: np.ndarray,
        queries: np.ndarray,
        select: np.ndarray,
        logit_bias: np.ndarray,
        out_rows: Rows,
    ) -> Tuple:
        """One non-causal pass: ``(score, row)`` of the best allowed token of the slots ``select``."""


@runtime_checkable
class SourceBackend(Backend, Protocol):
    """A backend that encodes token ids itself (the runtime's :class:`~hrt_runtime.model.ExportedModel`
    and :class:`~hrt_runtime.work.StoppableBackend`; the lean engines encode fairseq batches)."""

    def encode(self, src_tokens: np.ndarray):
        """The encoding of the left-padded source token ids ``(B, S)``."""
