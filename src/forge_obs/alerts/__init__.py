"""Live alerts: the doctor's rules on the controller at every step, as the ``"alerts"`` backend.

    >>> from forge_obs.alerts import AlertsBackend
    >>> from forge_obs.backends.base import get_logger_backend_class
    >>> get_logger_backend_class("alerts") is AlertsBackend
    True

Configure in ``init_backends({"alerts": {...}})`` (see :mod:`forge_obs.alerts.config` and
docs/alerts.md). Nothing here imports Monarch or torch.
"""

from forge_obs.core.lazy import lazy_exports

__all__ = ["AlertsBackend", "AlertsConfig", "CriticalPathBackend", "CriticalPathOptions"]
_EXPORTS = {"AlertsBackend": "forge_obs.alerts.backend", "AlertsConfig": "forge_obs.alerts.config",
            "CriticalPathBackend": "forge_obs.alerts.path_metrics", "CriticalPathOptions": "forge_obs.alerts.path_metrics"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
