"""The runtime's refusals: input, options, folders or files it does not take.

Each says in its message what was refused and what to do, so ``hrt-translate`` and ``hrt-serve``
print it as one line (exit code 2) and ``hrt-serve`` answers it 400. Only these are turned into one
line: any other exception is a bug of the runtime (or of a library under it) and keeps its
traceback. Each is also the built-in exception it was before it had a type of its own
(``ValueError``, ``TypeError``, ``FileNotFoundError``), so a caller's ``except`` still catches it.
"""


class Refused(ValueError):
    """A value, a line of input or a folder the runtime does not take."""


class RefusedType(Refused, TypeError):
    """A value of a type the runtime does not take (an unknown keyword, a line that is not a string)."""


class RefusedMissing(Refused, FileNotFoundError):
    """A folder or a file that is not there, or not of the kind asked for (a file for a folder)."""
