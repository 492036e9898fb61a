"""forge_obs: experiment-scoped observability for RL pipelines on Monarch.

    from forge_obs import record_metric, Reduce
    record_metric("loss", 0.25, Reduce.MEAN)          # anywhere, any process: O(1), no I/O

Every name is loaded on first use. The recording API (``record_metric``, ``Reduce``,
``MetricCollector``, ...) imports neither Monarch nor torch; the actor API
(``get_or_create_metric_logger``, ``GlobalLoggingActor``, ``LocalFetcherActor``) needs
``torchmonarch``.

Code written for torchforge switches by one textual change, ``forge.observability`` ->
``forge_obs``, submodules included (:mod:`forge_obs.metrics`, :mod:`forge_obs.metric_actors`,
:mod:`forge_obs.perf_tracker`, :mod:`forge_obs.utils`; ``forge.env`` -> :mod:`forge_obs.env`);
see docs/migrating-from-torchforge.md.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

#: every name of the facade -> the module it comes from, served on first use and then kept here
#: (:mod:`forge_obs.core.lazy`, the one way every package face is written). Nothing is imported
#: when ``forge_obs`` is, not even that module: the facade is the parent of every module, so
#: importing it takes no other module's import lock (two threads of a new process that import
#: forge_obs and one of its modules at once cannot deadlock), and the actor API (Monarch) loads
#: only where it is used.
_EXPORTS = {
    "record_metric": "forge_obs.recording.collector",
    "MetricCollector": "forge_obs.recording.collector",
    "set_enabled": "forge_obs.recording.collector",
    "is_enabled": "forge_obs.recording.collector",
    "Reduce": "forge_obs.recording.reduce",
    "register_reduction": "forge_obs.recording.reduce",
    "MetricAccumulator": "forge_obs.recording.reduce",
    "MeanAccumulator": "forge_obs.recording.reduce",
    "SumAccumulator": "forge_obs.recording.reduce",
    "MaxAccumulator": "forge_obs.recording.reduce",
    "MinAccumulator": "forge_obs.recording.reduce",
    "StdAccumulator": "forge_obs.recording.reduce",
    "reduce_metrics_states": "forge_obs.wire.merge",
    "BackendRole": "forge_obs.core.types",
    "LoggingMode": "forge_obs.core.types",
    "Metric": "forge_obs.core.types",
    "LoggerBackend": "forge_obs.backends.base",
    "get_logger_backend_class": "forge_obs.backends.base",
    "register_backend": "forge_obs.backends.base",
    "RunContext": "forge_obs.backends.record",
    "StepRecord": "forge_obs.backends.record",
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
    # modules reachable as attributes (``forge_obs.spmd.init(...)``) without importing them first
    "spmd": "forge_obs.spmd",
    "titan": "forge_obs.titan",
}


def __getattr__(name: str) -> Any:
    from forge_obs.core.lazy import export  # on first use, once forge_obs is loaded

    return export(__name__, _EXPORTS, name, globals())


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
