#!/usr/bin/env bash
# Install everything the tests need into .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev"
# headless Chromium (Debian package) for the report test; that test skips when it is missing
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
    || echo "scripts/test.sh: could not install chromium; the report browser test will skip" >&2
fi
export MONARCH_FILE_LOG=error HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=1s
.venv/bin/python -m pytest -q -rs "$@"
