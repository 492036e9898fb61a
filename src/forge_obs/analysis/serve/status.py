"""Where a run stands, as the header of ``forge-obs serve`` shows it: ``starting``, ``running``,
``finished``, ``stalled``, ``hung`` or ``crashed``, with why.

    >>> import tempfile, pathlib
    >>> from forge_obs.analysis.serve.files import Confined
    >>> from forge_obs.analysis.serve.held import Held, ServeConfig
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> RunStatus(d, Confined(d), ServeConfig()).status(Held(ServeConfig()), [])["state"]
    'starting'
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from forge_obs.analysis.serve.files import Confined
from forge_obs.analysis.serve.held import Held, ServeConfig
from forge_obs.analysis.serve.meta import controller_gone, read_meta, run_labels

__all__ = ["RunStatus"]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class RunStatus:
    """The status of the run in ``run_dir`` (its files read through ``files``); ``meta.json``
    read again only when it changed."""

    def __init__(self, run_dir: Path, files: Confined, cfg: ServeConfig) -> None:
        self.run_dir, self.files, self.cfg = run_dir, files, cfg
        self._meta: tuple[float, dict] = (-1.0, {})
        self._gone_at: tuple[float, str | None] = (-1e9, None)

    def meta(self) -> dict[str, Any]:
        try:
            mtime = self.files.stat(self.run_dir / "meta.json").st_mtime
        except OSError:
            return {}
        if mtime != self._meta[0]:
            self._meta = (mtime, read_meta(self.run_dir, self.files))
        return self._meta[1]

    def labels(self) -> dict[str, Any]:
        """The run's name, tags and notes (meta.json's ``name``, ``tags``, ``notes``, written
        from the run config), as text; what is not there is left out."""
        return run_labels(self.meta())

    def status(self, held: Held, alerts: Any, now: float | None = None) -> dict[str, Any]:
        """``finished`` / ``starting`` / ``running`` / ``stalled`` / ``hung`` / ``crashed`` with why.

        A run is ``starting`` until its first step; it is judged ``stalled`` only once the time
        between its steps is known (two steps), as the ``stall`` alert judges it: a minute of
        start-up (meshes, models, vLLM) is not a stall."""
        now = time.time() if now is None else now
        meta = self.meta()
        st = meta.get("status")
        if st == "finished":
            return {"state": "finished", "why": "meta.json: finished"}
        firing = {a.get("id"): a for a in alerts if a.get("rule") == "stall"}
        if any(a.get("state") == "firing" for a in firing.values()):
            return {"state": "hung", "why": "a stall alert is firing (no step reached the logger)"}
        gone = self._gone() if st == "running" else None
        if gone:
            return {"state": "crashed", "why": f"meta.json says running but {gone}"}
        if not held.steps:  # no row of any step yet (a run may log per-rank rows only)
            start = meta.get("start_time")
            since = f" ({now - start:.0f}s since the run started)" if _num(start) else ""
            return {"state": "starting", "why": f"no step logged yet{since}"}
        last = self._last_activity()
        limit = self.stall_limit_s(held)
        if last is not None and limit is not None and now - last > limit:
            return {"state": "stalled", "why": f"no new step for {now - last:.0f}s (limit {limit:.0f}s)",
                    "silent_s": now - last}
        return {"state": "running" if st in (None, "running", "reconfigured") else str(st), "why": ""}

    def _gone(self) -> str | None:
        """:func:`~.meta.controller_gone`, looked at most every 5 s."""
        now = time.monotonic()
        if now - self._gone_at[0] >= 5.0:
            self._gone_at = (now, controller_gone(self.run_dir, self.files))
        return self._gone_at[1]

    def _last_activity(self) -> float | None:
        try:
            return self.files.stat(self.run_dir / "metrics.jsonl").st_mtime
        except OSError:
            return self.meta().get("start_time") if _num(self.meta().get("start_time")) else None

    def stall_limit_s(self, held: Held) -> float | None:
        """Seconds of silence after which the run is stalled: max(``stall_floor_s``,
        ``stall_factor`` x the median time between its last 31 steps); None before two steps."""
        walls = [held.steps[s][0] for s in held.order[-31:] if held.steps[s][0] is not None]
        gaps = [b - a for a, b in zip(walls, walls[1:]) if b >= a]
        if not gaps:
            return None
        return max(self.cfg.stall_floor_s, self.cfg.stall_factor * statistics.median(gaps))
