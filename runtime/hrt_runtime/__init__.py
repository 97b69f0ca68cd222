"""The deployed runtime of fairseq-hrt: a folder written by ``fairseq-hrt-export`` translated with
ONNX Runtime, numpy and SentencePiece only (no PyTorch, no fairseq)::

    from hrt_runtime import Translator
    Translator("model-onnx").translate(["A man rides a bike."], beam=1)

or ``hrt-translate model-onnx < input.txt`` (a stream: ``--buffer-size`` lines at a time;
``Translator.translate_iter`` from Python), or over HTTP with ``hrt-serve model-onnx --port N``
(:mod:`hrt_runtime.serve`, ``pip install "./runtime[serve]"``). :mod:`hrt_runtime.search` is also the
search of ``--decoder-engine onnxruntime`` inside fairseq. Never imports torch, fairseq or
fairseq_hrt (docs/deploy.md).
"""

import os as _os

# the one version of both distributions: runtime/pyproject.toml and the root's pyproject.toml read
# this file, and the root depends on exactly this hrt-runtime (tests/test_packaging.py)
with open(_os.path.join(_os.path.dirname(__file__), "VERSION"), encoding="ascii") as _f:
    __version__ = _f.read().strip()

from hrt_runtime.model import ExportedModel, read_config  # noqa: F401
from hrt_runtime.search import SearchConfig, hrt, left_to_right  # noqa: F401
from hrt_runtime.translator import Translator  # noqa: F401
