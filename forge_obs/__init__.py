"""forge_obs: experiment-scoped observability for RL pipelines on Monarch.

    from forge_obs import record_metric, Reduce
    record_metric("loss", 0.25, Reduce.MEAN)          # anywhere, any process: O(1), no I/O

The recording API (``record_metric``, ``Reduce``, ``MetricCollector``, ...) imports neither
Monarch nor torch. The actor API (``get_or_create_metric_logger``, ``GlobalLoggingActor``,
``LocalFetcherActor``) is loaded on first use and needs ``torchmonarch``.

Code written for torchforge switches by one textual change, ``forge.observability`` ->
``forge_obs``, submodules included (:mod:`forge_obs.metrics`, :mod:`forge_obs.metric_actors`,
:mod:`forge_obs.perf_tracker`, :mod:`forge_obs.utils`; ``forge.env`` -> :mod:`forge_obs.env`);
see docs/migrating-from-torchforge.md.
"""

from __future__ import annotations

from typing import Any

from forge_obs.backends.base import LoggerBackend, get_logger_backend_class, register_backend
from forge_obs.backends.record import RunContext, StepRecord
from forge_obs.core.types import BackendRole, LoggingMode, Metric
from forge_obs.recording.collector import MetricCollector, is_enabled, record_metric, set_enabled
from forge_obs.recording.reduce import MaxAccumulator, MeanAccumulator, MetricAccumulator, MinAccumulator, Reduce, StdAccumulator, SumAccumulator, register_reduction
from forge_obs.wire.merge import reduce_metrics_states

__version__ = "0.1.0"

#: names loaded on first use (the actor API needs Monarch; the tracer and the timeline are not
#: needed by every process): name -> module
_LAZY = {
    "get_or_create_metric_logger": "forge_obs.controller.client",
    "GlobalLoggingActor": "forge_obs.controller.logger",
    "LocalFetcherActor": "forge_obs.controller.fetcher",
    "ConsoleBackend": "forge_obs.backends.console",
    "WandbBackend": "forge_obs.backends.wandb",
    "Tracer": "forge_obs.recording.tracer",
    "trace": "forge_obs.recording.tracer",
    "record_span": "forge_obs.recording.timeline",
    "record_event": "forge_obs.recording.timeline",
    "set_step": "forge_obs.recording.timeline",
    "add_step_tag": "forge_obs.recording.timeline",
    "get_proc_name_with_rank": "forge_obs._compat.utils",
    # importable from here for existing code, documented in their own modules
    "JsonlBackend": "forge_obs.backends.jsonl",
    "TensorBoardBackend": "forge_obs.backends.tensorboard",
    "CountAccumulator": "forge_obs.recording.reduce",
    "LastAccumulator": "forge_obs.recording.reduce",
    "SampleAccumulator": "forge_obs.recording.reduce",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'forge_obs' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)


def __dir__() -> list[str]:
    return sorted(set(__all__) | {"__version__"})


__all__ = [
    # recording, in any process (no Monarch, no torch)
    "record_metric",
    "Reduce",
    "record_span",
    "record_event",
    "set_step",
    "add_step_tag",
    "Tracer",
    "trace",
    "set_enabled",
    "is_enabled",
    # the experiment's logger, on the controller (Monarch)
    "get_or_create_metric_logger",
    "GlobalLoggingActor",
    "LocalFetcherActor",
    # extending: backends and reductions
    "LoggerBackend",
    "register_backend",
    "get_logger_backend_class",
    "LoggingMode",
    "Metric",
    "StepRecord",
    "RunContext",
    "MetricAccumulator",
    "register_reduction",
    # torchforge's names (forge.observability -> forge_obs)
    "MetricCollector",
    "reduce_metrics_states",
    "BackendRole",
    "get_proc_name_with_rank",
    "ConsoleBackend",
    "WandbBackend",
    "MeanAccumulator",
    "SumAccumulator",
    "MaxAccumulator",
    "MinAccumulator",
    "StdAccumulator",
]
