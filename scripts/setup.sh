#!/usr/bin/env bash
# Set up gridgraph on a fresh machine: a virtualenv in .venv with the package installed.
#   scripts/setup.sh          what the demo needs (torch, networkx, msgpack, ipfshttpclient)
#   scripts/setup.sh --test   also pytest and ruff, graphviz (for gg.visualize) and Kubo
#                             (built from the Go module registry when `ipfs` is missing)
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if [ "${1:-}" = "--test" ]; then
    extras=".[test]"
else
    extras="."
fi
.venv/bin/python -m pip install --disable-pip-version-check -q -e "$extras"

if [ "${1:-}" = "--test" ]; then
    if ! command -v dot >/dev/null 2>&1; then
        echo "installing graphviz" >&2
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get update -q >/dev/null
        $SUDO apt-get install -y -q graphviz >/dev/null
    fi
    bash scripts/install_kubo.sh >/dev/null
fi
