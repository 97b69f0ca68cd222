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

import importlib as _importlib
import os as _os

# the one version of both distributions: runtime/pyproject.toml and the root's pyproject.toml read
# this file, and the root depends on exactly this hrt-runtime (tests/test_packaging.py)
with open(_os.path.join(_os.path.dirname(__file__), "VERSION"), encoding="ascii") as _f:
    __version__ = _f.read().strip()

# imported on first use (PEP 562): the commands import this package before their ``try`` can
# catch a Ctrl-C, so it must not import numpy and the model (hrt_runtime.translate_command)
_LAZY = {
    "ExportedModel": "hrt_runtime.model",
    "read_config": "hrt_runtime.model",
    "SearchConfig": "hrt_runtime.search",
    "hrt": "hrt_runtime.search",
    "left_to_right": "hrt_runtime.search",
    "Translator": "hrt_runtime.translator",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
