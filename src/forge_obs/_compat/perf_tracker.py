"""torchforge's ``forge.observability.perf_tracker``, over :mod:`forge_obs.recording.tracer`.

    from forge_obs.perf_tracker import Tracer, trace      # was: forge.observability.perf_tracker

Also ``_TimerCPU`` / ``_TimerCUDA`` (torchforge's timer classes, ``TimerCPU`` / ``TimerCUDA`` here) and the names its tests patch:
replacing ``forge_obs.perf_tracker.record_metric`` (``monkeypatch.setattr`` / ``mock.patch``)
routes every Tracer's and ``@trace``'s values through the replacement, one call per value as
torchforge's Tracer makes them (``forge_obs.recording.tracer.set_record_hook``); forge_obs's extra
``…_dist_s`` keys still go to the collector. Restoring the original restores the fast path.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from forge_obs._compat.env import DISABLE_PERF_METRICS, FORGE_DISABLE_METRICS, METRIC_TIMER_USES_GPU
from forge_obs.recording.collector import record_metric
from forge_obs.recording.reduce import Reduce
from forge_obs.recording.tracer import TimerCPU, TimerCUDA, Tracer, set_record_hook, trace

__all__ = ["Tracer", "trace", "record_metric", "Reduce", "TimerCPU", "TimerCUDA", "DISABLE_PERF_METRICS",
           "FORGE_DISABLE_METRICS", "METRIC_TIMER_USES_GPU"]

# torchforge's names of its timer classes (``from forge_obs.perf_tracker import _TimerCPU``)
_TimerCPU = TimerCPU
_TimerCUDA = TimerCUDA

_RECORD_METRIC = record_metric


class _PatchPoints(types.ModuleType):
    """Assigning ``record_metric`` here reroutes the tracer (see the module docstring)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "record_metric":
            set_record_hook(None if value is _RECORD_METRIC else value)


sys.modules[__name__].__class__ = _PatchPoints
