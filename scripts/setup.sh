#!/usr/bin/env bash
# Create .venv and install forge-obs with the given extras (CPU torch pinned first, so nothing
# pulls a multi-GB CUDA build). Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh dev,wandb
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
