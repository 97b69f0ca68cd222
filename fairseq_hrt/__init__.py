"""fairseq-hrt: Hybrid-Regressive Translation, Mask-Predict and deep-encoder/shallow-decoder
AT models as a fairseq plugin.

Load with ``--user-dir fairseq_hrt`` (path from the repository root) or with the installed
package's path (``--user-dir $(python -c 'import fairseq_hrt,os;print(os.path.dirname(fairseq_hrt.__file__))')``).
Importing is idempotent: fairseq imports user dirs several times and in every worker, and
each component registers under a fixed name only once.
"""

import sys

from fairseq_hrt import compat

# the only changes to fairseq itself, for every task (see compat's docstring)
compat.apply()

# fairseq imports a --user-dir under its directory name; when that happens before (or
# after) a regular ``import fairseq_hrt``, both names must refer to one module so that
# fairseq's registries see each component exactly once.
sys.modules.setdefault("fairseq_hrt", sys.modules[__name__])

__version__ = "0.1.0"

# components register themselves with fairseq's registries on import
from fairseq_hrt import criterions, models, tasks  # noqa: E402,F401
from fairseq_hrt.hub import from_pretrained  # noqa: E402,F401  (the Python API: see fairseq_hrt.hub)
from fairseq_hrt.scoring import signed_sacrebleu  # noqa: E402,F401  (--scoring sacrebleu_signature)
