"""The heap given back to the system after big work (a large or stopped batch, a big body), so
that the service's resident memory returns near its size at rest: glibc keeps freed pages
otherwise, and ONNX Runtime's arena is off (:mod:`hrt_runtime.sessions`)."""

import ctypes
import functools


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    """glibc's ``malloc_trim`` (``None`` where there is no glibc: nothing to do there)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """The heap's free pages back to the system (every arena's: threads' too)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
