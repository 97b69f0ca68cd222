"""fairseq-hrt: Hybrid-Regressive Translation, Mask-Predict and deep-encoder/shallow-decoder
AT models as a fairseq plugin.

Load with ``--user-dir fairseq_hrt`` (path from the repository root) or with the installed
package's path (``--user-dir $(python -c 'import fairseq_hrt,os;print(os.path.dirname(fairseq_hrt.__file__))')``).
Importing is idempotent: fairseq imports user dirs several times and in every worker, and
each component registers under a fixed name only once.
"""

import importlib
import os

# fairseq imports a --user-dir as a module named after its folder; under any other name than
# this package's own, its modules (which import fairseq_hrt) would register every component twice
if __name__ != "fairseq_hrt":
    raise ImportError(
        f"--user-dir {os.path.dirname(os.path.abspath(__file__))} was imported as {__name__!r}: fairseq names a "
        "user dir after its folder, and this plugin's folder must be named fairseq_hrt (pass the package's own "
        "folder, or import fairseq_hrt instead of copying it)"
    )

from fairseq_hrt import compat  # noqa: E402

# what importing the plugin changes for the whole process: fairseq checkpoints' types on PyTorch's
# allow-list of safe loading (docs/compatibility.md)
compat.register_checkpoint_types()

from hrt_runtime import __version__ as __version__  # noqa: E402,I001  (one version: runtime/hrt_runtime/VERSION)

# components register themselves with fairseq's registries on import; decoding strategies,
# engines and export are imported when a run asks for them (fairseq_hrt.generation.registry)
from fairseq_hrt import cli_logging, criterions, models, tasks  # noqa: E402,F401
from fairseq_hrt.scoring import signed_sacrebleu  # noqa: E402,F401  (--scoring sacrebleu_signature)

# under fairseq's command lines (fairseq-train/-generate/-interactive, which import the plugin by
# --user-dir), a refusal of the plugin's is one line as argparse's errors are; from Python nothing
# changes (docs/compatibility.md)
cli_logging.install_refusal_hook(cli_logging.FAIRSEQ_COMMANDS)


def __getattr__(name):
    """``fairseq_hrt.from_pretrained``, the Python API (:mod:`fairseq_hrt.hub`), imported on
    first use: a fairseq command line never needs it."""
    if name == "from_pretrained":
        return importlib.import_module("fairseq_hrt.hub").from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
