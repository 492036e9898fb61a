"""forge_obs's own CPU cost, on its own path to the pipeline (never through the user's collector).

    >>> from forge_obs.core.selfobs import SelfObs
    >>> own = SelfObs()
    >>> own.add("export", 0.25)
    >>> own.add("export", 0.25)
    >>> own.take()
    {'cpu_export_s': 0.5}
    >>> own.take()
    {}

Each process has one :data:`SELF_OBS`. forge_obs's threads and handlers add the CPU time they
used, by part (:data:`CPU_PARTS`). A rank's fetcher takes it when it sends its states (the
snapshot's ``"self_cpu"`` field); the controller's pipeline takes its own when it assembles a
step. The pipeline reports the sum over processes as ``obs/cpu_<part>_s`` and ``obs/cpu_s``.
"""

from __future__ import annotations

import threading

from forge_obs.core.counters import add_count

__all__ = ["CPU_PARTS", "SELF_OBS", "SelfObs", "add_cpu"]

#: parts of forge_obs's own CPU (``obs/cpu_<part>_s``; ``obs/cpu_s`` is their sum)
CPU_PARTS = ("export", "timeline", "flush", "inbox", "pipeline", "backends", "alerts", "aggregate")


class SelfObs:
    """Thread-safe CPU seconds by part, taken (and reset) as one dict."""

    __slots__ = ("_lock", "_cpu_s")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cpu_s: dict[str, float] = {}

    def add(self, part: str, cpu_s: float) -> None:
        """Count ``cpu_s`` seconds of CPU under ``part`` (one of :data:`CPU_PARTS`)."""
        with self._lock:
            add_count(self._cpu_s, part, cpu_s)

    def take(self) -> dict[str, float]:
        """What was counted since the last ``take``, as ``{"cpu_<part>_s": seconds}``."""
        with self._lock:
            cpu_s, self._cpu_s = self._cpu_s, {}
        return {f"cpu_{part}_s": v for part, v in cpu_s.items()}


#: this process's own cost
SELF_OBS = SelfObs()


def add_cpu(total: dict[str, float], self_cpu: dict | None) -> None:
    """Add a rank's (or a group's) ``self_cpu`` into ``total``, part by part (what is not a
    number is left out)."""
    for part, v in (self_cpu or {}).items():
        if isinstance(v, (int, float)):
            add_count(total, part, v)
