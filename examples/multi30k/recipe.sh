#!/usr/bin/env bash
# The Multi30k benchmark recipe in one command (see recipe.py --help and README.md):
#   examples/multi30k/recipe.sh --profile quick|full [--out DIR] [--threads N] ...
# Runs recipe.py with $PYTHON, else the repository's .venv, else the `python` on PATH.
set -euo pipefail
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
exec "$PYTHON" "$SCRIPT_DIR/recipe.py" "$@"
