"""The console scripts of the commands that need PyTorch and fairseq (``fairseq-hrt-export``,
``fairseq-hrt-shortlist``, ``fairseq-hrt-comet``), checking that they are there first.

Why: ``pip install --no-deps .`` on the machine that only translates (onnxruntime, numpy and
SentencePiece; ``hrt-translate``, ``hrt-serve``) installs these scripts too, and there they died
with ``ModuleNotFoundError: No module named 'torch'``. Now they say where they belong. This
module imports nothing of the plugin before the check (importing ``fairseq_hrt`` imports
torch and fairseq).
"""

import importlib
import importlib.util
import sys

NEEDS = ("torch", "fairseq")


def missing_packages():
    """The packages of :data:`NEEDS` that are not installed (found without importing them)."""
    return [name for name in NEEDS if importlib.util.find_spec(name) is None]


def _run(prog: str, module: str, argv=None):
    missing = missing_packages()
    if missing:
        sys.stderr.write(
            f"{prog}: this command belongs on the machine that trains (needs PyTorch and fairseq: pip install -r "
            "requirements.txt && pip install --no-deps -r requirements-fairseq.txt, see README.md's set-up); "
            f"not installed here: {', '.join(missing)}. On a machine without them, translate an exported folder "
            "with hrt-translate or hrt-serve.\n"
        )
        sys.exit(2)
    return importlib.import_module(module).cli_main(argv)


def export(argv=None):
    return _run("fairseq-hrt-export", "fairseq_hrt.export.exporter", argv)


def shortlist(argv=None):
    return _run("fairseq-hrt-shortlist", "fairseq_hrt.shortlist", argv)


def comet(argv=None):
    return _run("fairseq-hrt-comet", "fairseq_hrt.scoring.comet", argv)
