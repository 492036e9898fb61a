"""Environment switches, read once at import (never per call)."""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


#: ``FORGE_DISABLE_METRICS=true``: every recording call becomes a near-zero-cost no-op.
METRICS_DISABLED: bool = env_flag("FORGE_DISABLE_METRICS")
#: ``FORGE_DISABLE_PERF_METRICS=true``: tracers only become no-ops.
PERF_METRICS_DISABLED: bool = METRICS_DISABLED or env_flag("FORGE_DISABLE_PERF_METRICS")
