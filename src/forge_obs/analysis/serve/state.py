"""One run directory as the server holds it: read incrementally, bounded in memory.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "mode": "global_reduce", "wall_time": 100.0 + s, "metrics": {"trainer/loss": 1.0 / (s + 1)}}
    ...         for s in range(3)]
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> st = RunState(d)
    >>> st.update(), st.last_step, sorted(st.series)
    (True, 2, ['trainer/loss'])
    >>> st.step_detail(1)["global"]["trainer/loss"]
    0.5

:meth:`RunState.update` reads what was appended to ``metrics.jsonl`` and ``alerts.jsonl`` since
the last call (:class:`~forge_obs.analysis.serve.tail.Tail`), never the whole run again. What is
held per run is bounded whatever the run's length:

- each global key: a :class:`~forge_obs.analysis.serve.series.Buckets` of at most
  ``global_points`` min/max buckets (a distribution: one per quantile);
- each (key, rank): at most ``rank_points`` buckets, fewer (down to 16) when the run has so many
  (key, rank) series that ``rank_budget`` buckets would be exceeded;
- per step: its wall time, policy version and the byte range of its rows in ``metrics.jsonl``
  (a step's exact values, per-rank values and SAMPLE rows are read back from there on demand);
- the latest SAMPLE rows per key and the last ``max_alerts`` alerts.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_obs.core.formatting import QUANTILES, flatten, is_distribution
from forge_obs.analysis.serve.series import Buckets
from forge_obs.analysis.serve.tail import Tail
from forge_obs.analysis.store import metric_row_problem

__all__ = ["ServeConfig", "RunState", "POLICY_KEY", "read_meta"]

#: a global key whose value is the policy version (the x axis "policy version")
POLICY_KEY = re.compile(r"(^|/)(policy_version|policy_age_version|weights?_version)$")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    #: buckets kept per global key (about one per pixel of a wide chart)
    global_points: int = 1024
    #: buckets kept per (key, rank), at most
    rank_points: int = 256
    #: buckets kept over every (key, rank) series of a run; past it each series keeps fewer
    rank_budget: int = 1 << 21
    #: SAMPLE rows kept per key (the latest step's)
    sample_rows: int = 200
    #: alerts kept per run (the latest)
    max_alerts: int = 2000
    #: a running run whose last step is older than max(stall_floor_s, stall_factor x its median
    #: time between steps) is shown as stalled (the ``stall`` alert's rule)
    stall_floor_s: float = 5.0
    stall_factor: float = 10.0
    #: bytes a step's rows may span in metrics.jsonl when read back for the drill-down
    max_step_bytes: int = 64 << 20
    #: bytes read per chunk (requests are answered between chunks while a large run is read)
    read_chunk_bytes: int = 2 << 20


def read_meta(run_dir: Path) -> dict[str, Any]:
    try:
        meta = json.loads((run_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class RunState:
    def __init__(self, run_dir: Path, config: ServeConfig | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = config or ServeConfig()
        self.lock = threading.RLock()
        self.metrics = Tail(self.run_dir / "metrics.jsonl", self.cfg.read_chunk_bytes)
        self.alerts_tail = Tail(self.run_dir / "alerts.jsonl")
        self.series: dict[str, Buckets] = {}
        self.rank_series: dict[str, dict[str, Buckets]] = {}
        self.distributions: set[str] = set()
        self.sample_keys: dict[str, tuple[int, list]] = {}
        self.ranks: set[str] = set()
        self.steps: dict[int, list] = {}  # step -> [wall, policy version, first row offset, last row offset]
        self.alerts: deque = deque(maxlen=self.cfg.max_alerts)
        self.last_step: int | None = None
        self.t0: float | None = None
        self.last_wall: float | None = None
        self.version = 0  # grows with each update that read something
        self.malformed = 0
        self._rank_cap = self.cfg.rank_points
        self._policy_keys: set[str] = set()
        self._n_rank = 0
        self._meta: tuple[float, dict] = (-1.0, {})
        self._gone_at: tuple[float, str | None] = (-1e9, None)

    # ------------------------------------------------------------------ reading
    def update(self, chunks: int | None = None, wait: bool = True) -> bool:
        """Read what was appended since the last call (at most ``chunks`` reads of
        ``Tail.max_bytes`` each; None: all of it); True when something was read. ``wait=False``
        returns at once when another thread is reading."""
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            got = False
            n_chunks = 0
            while True:
                n = 0
                for off, row in self.metrics.read():
                    n += 1
                    if isinstance(row, dict) and metric_row_problem(row) is None:
                        self._add(off, row)
                    else:
                        self.malformed += 1
                got = got or n > 0
                n_chunks += 1
                if not self.metrics.behind or (chunks is not None and n_chunks >= chunks):
                    break
            for _off, a in self.alerts_tail.read():
                if isinstance(a, dict):
                    self.alerts.append(a)
                    got = True
            if got:
                self.version += 1
            return got
        finally:
            self.lock.release()

    def _add(self, off: int, row: dict) -> None:
        mode = row.get("mode", "global_reduce")
        step = row["step"]
        metrics = row.get("metrics") or {}
        if mode == "per_rank_no_reduce":
            return
        wall = float(row["wall_time"]) if _num(row.get("wall_time")) else None
        ent = self.steps.get(step)
        if ent is None:
            ent = self.steps[step] = [wall, None, off, off]
        else:
            ent[2], ent[3] = min(ent[2], off), max(ent[3], off)
            if ent[0] is None:
                ent[0] = wall
        if wall is not None:
            self.t0 = wall if self.t0 is None else min(self.t0, wall)
            self.last_wall = wall if self.last_wall is None else max(self.last_wall, wall)
        if mode == "global_reduce":
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self._add_global(step, metrics, ent)
        elif mode == "per_rank_reduce":
            self._add_rank(step, str((row.get("source") or {}).get("label") or "?"), metrics)

    def _add_global(self, step: int, metrics: dict, ent: list) -> None:
        series = self.series
        for key, v in metrics.items():
            t = type(v)
            if t is float or t is int:  # the common case: a known key, not the policy version
                s = series.get(key)
                if s is not None and key not in self._policy_keys:
                    s.add(step, float(v))
                    continue
            if isinstance(v, list):
                if v and all(isinstance(r, dict) for r in v):
                    self.sample_keys[key] = (step, v[-self.cfg.sample_rows:])
                continue
            if is_distribution(v):
                self.distributions.add(key)
            flat: dict[str, float] = {}
            flatten(key, v, flat)
            for k, x in flat.items():
                s = self.series.get(k)
                if s is None:
                    s = self.series[k] = Buckets(self.cfg.global_points)
                s.add(step, x)
                if s.n == 1 and POLICY_KEY.search(k):
                    self._policy_keys.add(k)
                if k in self._policy_keys:
                    ent[1] = x

    def _add_rank(self, step: int, label: str, metrics: dict) -> None:
        self.ranks.add(label)
        rank_series = self.rank_series
        for key, v in metrics.items():
            t = type(v)
            if t is float or t is int:  # the common case
                by = rank_series.get(key)
                s = by.get(label) if by is not None else None
                if s is not None:
                    s.add(step, float(v))
                    continue
            if is_distribution(v):  # per rank: the median is the line worth comparing
                v, key = v["p50"], f"{key}/p50"
            flat: dict[str, float] = {}
            flatten(key, v, flat)
            for k, x in flat.items():
                by = self.rank_series.get(k)
                if by is None:
                    by = self.rank_series[k] = {}
                s = by.get(label)
                if s is None:
                    s = by[label] = Buckets(self._rank_cap)
                    self._n_rank += 1
                    self._rebudget()
                s.add(step, x)

    def _rebudget(self) -> None:
        """Fewer buckets per (key, rank) series once their number would exceed ``rank_budget``."""
        cap = self._rank_cap
        while cap > 16 and self._n_rank * cap > self.cfg.rank_budget:
            cap //= 2
        if cap != self._rank_cap:
            self._rank_cap = cap
            for by in self.rank_series.values():
                for s in by.values():
                    s.compact(cap)

    # ------------------------------------------------------------------ views
    def dist_of(self, key: str) -> str | None:
        base, _, leaf = key.rpartition("/")
        return base if base in self.distributions and leaf in (*QUANTILES, "count") else None

    def meta(self) -> dict[str, Any]:
        try:
            mtime = os.stat(self.run_dir / "meta.json").st_mtime
        except OSError:
            return {}
        if mtime != self._meta[0]:
            self._meta = (mtime, read_meta(self.run_dir))
        return self._meta[1]

    def status(self, now: float | None = None) -> dict[str, Any]:
        """``finished`` / ``running`` / ``stalled`` / ``hung`` / ``crashed`` with why."""
        now = time.time() if now is None else now
        meta = self.meta()
        st = meta.get("status")
        if st == "finished":
            return {"state": "finished", "why": "meta.json: finished"}
        firing = {a.get("id"): a for a in self.alerts if a.get("rule") == "stall"}
        if any(a.get("state") == "firing" for a in firing.values()):
            return {"state": "hung", "why": "a stall alert is firing (no step reached the logger)"}
        gone = self._gone() if st == "running" else None
        if gone:
            return {"state": "crashed", "why": f"meta.json says running but {gone}"}
        last = self._last_activity()
        limit = self.stall_limit_s()
        if last is not None and now - last > limit:
            return {"state": "stalled", "why": f"no new step for {now - last:.0f}s (limit {limit:.0f}s)",
                    "silent_s": now - last}
        return {"state": "running" if st in (None, "running", "reconfigured") else str(st), "why": ""}

    def _gone(self) -> str | None:
        """:func:`_controller_gone`, looked at most every 5 s."""
        now = time.monotonic()
        if now - self._gone_at[0] >= 5.0:
            self._gone_at = (now, _controller_gone(self.run_dir))
        return self._gone_at[1]

    def _last_activity(self) -> float | None:
        try:
            return os.stat(self.run_dir / "metrics.jsonl").st_mtime
        except OSError:
            return self.meta().get("start_time") if _num(self.meta().get("start_time")) else None

    def stall_limit_s(self) -> float:
        walls = [self.steps[s][0] for s in sorted(self.steps)[-31:] if self.steps[s][0] is not None]
        gaps = [b - a for a, b in zip(walls, walls[1:]) if b >= a]
        med = statistics.median(gaps) if gaps else 0.0
        return max(self.cfg.stall_floor_s, self.cfg.stall_factor * med)

    def step_rows(self, step: int) -> list[dict]:
        """The rows of ``step`` (every mode), read back from ``metrics.jsonl``."""
        ent = self.steps.get(step)
        if ent is None:
            return []
        lo, hi = ent[2], ent[3]
        out = []
        with open(self.metrics.path, "rb") as f:
            f.seek(lo)
            data = f.read(min(hi - lo, self.cfg.max_step_bytes))
            data += f.readline()
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict) and row.get("step") == step and metric_row_problem(row) is None:
                out.append(row)
        return out

    def step_detail(self, step: int) -> dict[str, Any]:
        """What the drill-down shows of ``step``: global values, per-rank values, SAMPLE rows."""
        glob: dict[str, Any] = {}
        ranks: dict[str, dict[str, Any]] = {}
        samples: dict[str, list] = {}
        missing: list = []
        for row in self.step_rows(step):
            metrics = row.get("metrics") or {}
            if row.get("mode") == "global_reduce":
                missing = row.get("missing") or missing
                for key, v in metrics.items():
                    if isinstance(v, list):
                        samples[key] = v[: self.cfg.sample_rows]
                    else:
                        flatten(key, v, glob)
            elif row.get("mode") == "per_rank_reduce":
                flat: dict[str, float] = {}
                for key, v in metrics.items():
                    flatten(key, v, flat)
                ranks.setdefault(str((row.get("source") or {}).get("label") or "?"), {}).update(flat)
        ent = self.steps.get(step) or [None, None]
        return {"step": step, "wall_time": ent[0], "policy_version": ent[1], "global": _finite(glob),
                "ranks": {k: _finite(v) for k, v in ranks.items()}, "samples": samples, "missing": missing}

    def x_of(self, axis: str):
        """step -> x for the axis ``step`` / ``wall`` (seconds since the first step) / ``policy``."""
        if axis == "wall":
            t0 = self.t0 or 0.0
            return lambda s: (self.steps[s][0] - t0) if s in self.steps and self.steps[s][0] is not None else None
        if axis == "policy":
            return lambda s: self.steps[s][1] if s in self.steps else None
        return lambda s: s

    def nbytes(self) -> int:
        """Bytes of the series held (the bounded part of the state)."""
        n = sum(s.nbytes() for s in self.series.values())
        return n + sum(s.nbytes() for by in self.rank_series.values() for s in by.values())


def _finite(d: dict[str, float]) -> dict[str, Any]:
    """Values JSON can carry: NaN / inf as text."""
    return {k: (v if math.isfinite(v) else str(v)) for k, v in d.items()}


def _controller_gone(run_dir: Path) -> str | None:
    """Why the controller that writes ``run_dir`` is known to be gone (the latest controller
    header of its timeline names a pid on this host that no longer exists), else None."""
    ev = run_dir / "events"
    if not ev.is_dir():
        return None
    host = socket.gethostname()
    latest: dict | None = None
    for p in sorted(ev.glob("*.jsonl"))[:4096]:
        try:
            with open(p, "rb") as f:
                h = json.loads(f.readline())
        except (OSError, ValueError):
            continue
        if isinstance(h, dict) and h.get("ctl") and isinstance(h.get("pid"), int):
            if latest is None or (_num(h.get("start")) and h["start"] > (latest.get("start") or 0)):
                latest = h
    if latest is None or latest.get("host") != host:
        return None  # another host's process: not judged
    try:
        os.kill(latest["pid"], 0)
    except ProcessLookupError:
        return f"its controller process {latest['pid']} is gone"
    except OSError:
        return None
    return None
