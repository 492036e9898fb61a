"""Earlier name of the actor API, kept so existing imports keep working.

    from forge_obs.logger_actors import get_or_create_metric_logger   # = forge_obs.client's

The actors live in :mod:`forge_obs.fetcher` (process side) and :mod:`forge_obs.controller`
(controller side); the user-facing handle in :mod:`forge_obs.client`.
"""

from forge_obs.client import (  # noqa: F401
    LoggerHandles,
    MetricLogger,
    attach_fetcher,
    cached_handles,
    get_or_create_metric_logger,
    set_cached_handles,
    spawn_handles_blocking,
)
from forge_obs.controller import GLOBAL_LOGGER_NAME, INBOX_NAME, GlobalLoggingActor, ObsInbox  # noqa: F401
from forge_obs.fetcher import FETCHER_NAME, LocalFetcherActor  # noqa: F401

__all__ = ["GlobalLoggingActor", "LocalFetcherActor", "get_or_create_metric_logger", "attach_fetcher", "ObsInbox"]
