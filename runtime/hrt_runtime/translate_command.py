"""The entry points of ``hrt-translate`` (its console script and ``python -m hrt_runtime``) and
``hrt-serve`` (its console script): the standard library only at module level.

Why a module of its own: Python imports a console script's module, and the package above it,
before it calls the function, so a Ctrl-C during the imports of numpy, the search and the
model (the command's first fraction of a second) landed outside any ``try`` and printed a
traceback. Here everything heavy is imported inside :func:`cli_main`'s ``try``, so a Ctrl-C in
any phase (imports, model load, reading, translating, writing, the last buffer after the
input ended) is one line and exit code 130, never a success. A SIGINT that the parent set to
be ignored (a background job of a non-interactive shell) stays ignored, as Python and the
shells leave it: such a process is not meant to be stopped by the terminal's Ctrl-C.
``hrt-serve`` the same until it serves; from then on SIGINT, as SIGTERM, starts its drain.
"""

import sys

from hrt_runtime.stdout import stdout_to_devnull


def _interrupted(prog: str):
    """Ctrl-C: what was printed stays printed (flushed), one line, exit code 130 (128 + SIGINT)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a reader gone, or stdout already closed: nothing to keep
        stdout_to_devnull()
    except KeyboardInterrupt:  # a second Ctrl-C while a reader that does not read holds the flush
        stdout_to_devnull()
    sys.stderr.write(f"{prog}: interrupted\n")
    sys.exit(130)


def cli_main(argv=None):
    """``hrt-translate`` (:func:`hrt_runtime.translator.command`) inside one ``try`` that also
    covers importing it."""
    try:
        from hrt_runtime.translator import command  # noqa: PLC0415 - heavy: inside the try

        command(argv)
    except KeyboardInterrupt:
        _interrupted("hrt-translate")


def serve_main(argv=None):
    """``hrt-serve`` (:func:`hrt_runtime.serve.cli_main`) inside one ``try`` that also covers
    importing it (aiohttp, the runtime) and loading the model."""
    try:
        from hrt_runtime.serve import cli_main as serve  # noqa: PLC0415 - heavy: inside the try

        serve(argv)
    except KeyboardInterrupt:
        _interrupted("hrt-serve")


if __name__ == "__main__":
    cli_main()
