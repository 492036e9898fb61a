"""torchforge's ``forge.observability.metrics``, over forge_obs's own modules.

    from forge_obs.metrics import record_metric, Reduce, MetricCollector   # was: forge.observability.metrics

Every name is forge_obs's implementation itself (``forge_obs.metrics.record_metric is
forge_obs.record_metric``), so this module costs nothing at run time. It is also where
torchforge's tests patch, and those patches take effect:

- ``MetricCollector`` replaced: ``record_metric`` follows torchforge's path for as long as it is
  (``FORGE_DISABLE_METRICS`` read per call, then ``MetricCollector().push(Metric(...))`` with the
  replacement); restoring it restores the fast path.
- ``current_rank`` replaced: ``MetricCollector()`` keeps one collector per rank it returns
  (torchforge's per-rank singletons, ``MetricCollector._instances``); rank 0 is this process's.
- ``context``, ``current_rank``: Monarch's, imported when called (this module does not import
  Monarch).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from forge_obs._compat.utils import get_proc_name_with_rank
from forge_obs.backends.base import LoggerBackend, get_logger_backend_class
from forge_obs.backends.console import ConsoleBackend
from forge_obs.backends.wandb import WandbBackend
from forge_obs.core.env import env_flag
from forge_obs.core.types import BackendRole, LoggingMode, Metric
from forge_obs.recording.collector import MetricCollector, record_metric, set_record_route
from forge_obs.recording.reduce import CountAccumulator, LastAccumulator, MaxAccumulator, MeanAccumulator, MetricAccumulator, MinAccumulator, Reduce, SampleAccumulator, StdAccumulator, SumAccumulator
from forge_obs.wire.merge import reduce_metrics_states

__all__ = [
    "BackendRole",
    "LoggingMode",
    "Reduce",
    "Metric",
    "record_metric",
    "reduce_metrics_states",
    "MetricAccumulator",
    "MeanAccumulator",
    "SumAccumulator",
    "MaxAccumulator",
    "MinAccumulator",
    "StdAccumulator",
    "CountAccumulator",
    "LastAccumulator",
    "SampleAccumulator",
    "MetricCollector",
    "LoggerBackend",
    "ConsoleBackend",
    "WandbBackend",
    "get_logger_backend_class",
    "get_proc_name_with_rank",
    "current_rank",
    "context",
]


def current_rank() -> Any:
    """Monarch's ``current_rank()`` (imported on first call)."""
    from monarch.actor import current_rank as _current_rank

    return _current_rank()


def context() -> Any:
    """Monarch's ``context()`` (imported on first call)."""
    from monarch.actor import context as _context

    return _context()


_REAL = {"MetricCollector": MetricCollector, "current_rank": current_rank}


def _record_through_patch(key: str, value: Any, reduction: Any = Reduce.MEAN) -> None:
    """``record_metric`` while ``MetricCollector`` is replaced here (a test's mock): torchforge's
    record path -- ``FORGE_DISABLE_METRICS`` read per call, then
    ``MetricCollector().push(Metric(key, value, reduction))`` with the replacement."""
    if env_flag("FORGE_DISABLE_METRICS"):
        return None
    MetricCollector().push(Metric(key, value, reduction))


class _PatchPoints(types.ModuleType):
    """Assigning ``MetricCollector`` or ``current_rank`` here takes effect (see the module docstring)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "MetricCollector":
            set_record_route(None if value is _REAL["MetricCollector"] else _record_through_patch)
        elif name == "current_rank":
            _REAL["MetricCollector"]._rank_fn = None if value is _REAL["current_rank"] else value


sys.modules[__name__].__class__ = _PatchPoints
