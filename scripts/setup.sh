#!/usr/bin/env bash
# Create .venv and install forge-obs with the given extras (CPU torch pinned first, so nothing
# pulls a multi-GB CUDA build). Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh dev,wandb
# Skips pip when .venv already has these extras installed from this pyproject.toml (a stamp in
# .venv records what was installed); FORGE_OBS_REINSTALL=1 installs again.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
stamp=".venv/.forge_obs_setup${extras:+_${extras//,/_}}"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/python ] && [ "${FORGE_OBS_REINSTALL:-0}" != 1 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "scripts/setup.sh: .venv is up to date for '${extras:-core}' (pyproject.toml unchanged); skipping pip"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
echo "$want" > "$stamp"
