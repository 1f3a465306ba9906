#!/usr/bin/env bash
# The core tests (trace, schedule, client, models) on the lowest torch that pyproject.toml
# declares, in a virtualenv of its own (.venv-lowest-torch; made once, then reused): CI runs
# the whole suite on the newest torch in .venv and these on the lowest, so the declared range
# is the tested one. Needs `scripts/setup.sh --test` first (Kubo, graphviz).
# Run it from anywhere: bash scripts/test_lowest_torch.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

# torchvision releases pair with one torch release each: 0.21 with 2.6.
TORCH=2.6.0
TORCHVISION=0.21.0
declared=$(sed -n 's/^ *"torch>=\([0-9.]*\)",*$/\1/p' pyproject.toml)
if [ "$declared.0" != "$TORCH" ] && [ "$declared" != "$TORCH" ]; then
    echo "pyproject.toml declares torch>=$declared; this script tests $TORCH: make them agree" >&2
    exit 1
fi

PYTHON="${PYTHON:-python3}"
VENV=.venv-lowest-torch
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q \
    "torch==$TORCH" "torchvision==$TORCHVISION" -e ".[test]"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH'), torch.__version__"

"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/trace tests/schedule tests/exec/client tests/exec/test_grid.py \
    tests/test_models.py tests/test_real_models.py "$@"
