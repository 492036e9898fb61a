#!/usr/bin/env bash
# Install forge-obs into .venv and run the main job (the multi-mesh demo).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh ""
export MONARCH_FILE_LOG=error
.venv/bin/python -m apps.demo.main "$@"
