"""torchforge's ``forge.observability.metric_actors``: the logger's actors and its handle.

    from forge_obs.metric_actors import get_or_create_metric_logger   # was: forge.observability.metric_actors

The actors are :mod:`forge_obs.controller.logger`'s and :mod:`forge_obs.controller.fetcher`'s; ``logger`` is the
``"forge_obs"`` logger they write to.
"""

from __future__ import annotations

import logging

from forge_obs.controller.client import get_or_create_metric_logger
from forge_obs.controller.fetcher import LocalFetcherActor
from forge_obs.controller.logger import GlobalLoggingActor
from forge_obs._compat.metrics import (
    BackendRole,
    LoggerBackend,
    LoggingMode,
    MetricCollector,
    get_logger_backend_class,
    reduce_metrics_states,
)

__all__ = [
    "get_or_create_metric_logger",
    "GlobalLoggingActor",
    "LocalFetcherActor",
    "BackendRole",
    "LoggerBackend",
    "LoggingMode",
    "MetricCollector",
    "get_logger_backend_class",
    "reduce_metrics_states",
]

logger = logging.getLogger("forge_obs")
#: torchforge's module-level cache of the logger handle (forge_obs caches in forge_obs.controller.client)
_global_logger = None
