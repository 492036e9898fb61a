"""Counted, rate-limited warnings: bad input is reported, never raised into the caller.

    >>> from forge_obs.core.warn import RateLimitedWarner
    >>> w = RateLimitedWarner(interval_s=60.0)
    >>> w.warn("bad_value", "loss", "value of type str dropped")  # logs once
    >>> w.warn("bad_value", "loss", "value of type str dropped")  # counted, not logged
    >>> w.suppressed[("bad_value", "loss")]
    1
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedWarner", "WARNER"]

logger = logging.getLogger("forge_obs")


class RateLimitedWarner:
    """Logs the first warning per (kind, key) at once, then at most one per ``interval_s`` with
    the number suppressed in between."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self.suppressed: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, key: str, message: str) -> None:
        now = time.monotonic()
        k = (kind, key)
        with self._lock:
            last = self._last.get(k)
            if last is not None and now - last < self.interval_s:
                self.suppressed[k] = self.suppressed.get(k, 0) + 1
                return
            n = self.suppressed.pop(k, 0)
            self._last[k] = now
        more = f" ({n} more like this since the last warning)" if n else ""
        logger.warning("forge_obs: %s%s", message, more)


WARNER = RateLimitedWarner()
