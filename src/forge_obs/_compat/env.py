"""torchforge's ``forge.env`` for the switches of observability: :class:`EnvVar` objects with
``.name`` and ``.get_value()``.

    >>> from forge_obs.env import FORGE_DISABLE_METRICS
    >>> FORGE_DISABLE_METRICS.name, type(FORGE_DISABLE_METRICS.get_value())
    ('FORGE_DISABLE_METRICS', <class 'bool'>)

Code that imported these from ``forge.env`` imports them from ``forge_obs.env`` (the one import
besides ``forge.observability`` that observability code and tests use). ``get_value()`` reads the
environment now. Where forge_obs reads each variable:

- ``FORGE_DISABLE_METRICS``: ``record_metric`` at import (:func:`forge_obs.set_enabled` switches
  it at run time); Tracers when created; ``get_or_create_metric_logger`` and ``init_backends`` at
  the call (no fetcher spawned, no backend started), as torchforge does.
- ``DISABLE_PERF_METRICS`` (also ``FORGE_DISABLE_PERF_METRICS``): Tracers when created,
  ``@trace`` when it decorates.
- ``METRIC_TIMER_USES_GPU``: Tracers when created, ``@trace`` when it decorates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from forge_obs.core.env import parse_flag

__all__ = ["EnvVar", "DISABLE_PERF_METRICS", "METRIC_TIMER_USES_GPU", "FORGE_DISABLE_METRICS", "all_env_vars"]


@dataclass
class EnvVar:
    """An environment variable: its name, the value when unset, what it does."""

    name: str
    default: Any
    description: str

    def get_value(self) -> Any:
        """The variable's current value, converted to the type of ``default`` (a flag is read by
        :func:`forge_obs.core.env.parse_flag`, as forge_obs itself reads it); ``default`` when unset."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        d = self.default
        if isinstance(d, bool) or self.name in _FLAGS:
            return parse_flag(raw)
        if isinstance(d, int):
            return int(raw)
        if isinstance(d, float):
            return float(raw)
        return raw


DISABLE_PERF_METRICS = EnvVar(
    "DISABLE_PERF_METRICS", False, "Tracers and @trace become no-ops (read when a Tracer is created)."
)
METRIC_TIMER_USES_GPU = EnvVar(
    "METRIC_TIMER_USES_GPU",
    None,
    "true: every Tracer times with CUDA events, false: with the CPU clock; unset: its timer argument decides.",
)
FORGE_DISABLE_METRICS = EnvVar(
    "FORGE_DISABLE_METRICS",
    False,
    "record_metric becomes a no-op (read at import; forge_obs.set_enabled at run time); "
    "get_or_create_metric_logger spawns no fetcher and init_backends starts no backend (read at the call).",
)


#: the variables read as flags although unset means "no override" (default None)
_FLAGS = {METRIC_TIMER_USES_GPU.name}


def all_env_vars() -> list[EnvVar]:
    """Every variable defined here."""
    return [v for v in globals().values() if isinstance(v, EnvVar)]
