#!/usr/bin/env bash
# Install everything the tests need into .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev"
export MONARCH_FILE_LOG=error HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=1s
.venv/bin/python -m pytest -q -rs "$@"
