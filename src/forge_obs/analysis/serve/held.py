"""What ``forge-obs serve`` holds of a run's ``metrics.jsonl``, bounded whatever the run's length.

    >>> h = Held(ServeConfig())
    >>> for s in range(3):
    ...     h.add(40 * s, {"step": s, "mode": "global_reduce", "wall_time": 100.0 + s, "metrics": {"loss": 1.0 / (s + 1)}})
    >>> h.last_step, h.keys(), h.summary("loss")["min"]
    (2, ['loss'], 0.3333333333333333)

- each global key: a :class:`~forge_obs.analysis.serve.series.Buckets` of at most
  ``global_points`` min/max buckets (a distribution: one per quantile);
- each (key, rank): at most ``rank_points`` buckets, fewer (down to 16) when the run has so many
  (key, rank) series that ``rank_budget`` buckets would be exceeded;
- per step: its wall time, policy version and the byte range of its rows in ``metrics.jsonl``
  (:mod:`.readback` reads a step's exact values back from there);
- the latest SAMPLE rows per key and the ``slowest_kept`` slowest steps.
"""

from __future__ import annotations

import bisect
import heapq
import re
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge_obs.analysis.serve.series import Buckets
from forge_obs.core.formatting import QUANTILES, flatten, is_distribution

__all__ = ["ServeConfig", "Held", "POLICY_KEY"]

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
    #: a zoomed chart is read back exactly from metrics.jsonl when its step range spans at most
    #: this many bytes (beyond, it is drawn from the held buckets)
    exact_max_bytes: int = 64 << 20
    #: slowest steps kept (the time from the previous step's row to the step's first row)
    slowest_kept: int = 50
    #: bytes of lines whose decoded rows are kept for the last zoomed range (its charts share them)
    memo_bytes: int = 16 << 20


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Held:
    """The bounded state of one run's metrics (see the module docstring), fed row by row (:meth:`add`)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.series: dict[str, Buckets] = {}
        self.rank_series: dict[str, dict[str, Buckets]] = {}
        self.distributions: set[str] = set()
        self.sample_keys: dict[str, tuple[int, list]] = {}
        self.ranks: set[str] = set()
        self.steps: dict[int, list] = {}  # step -> [wall, policy version, first row offset, last row offset]
        self.order: list[int] = []  # the steps, sorted
        self._slow: list[tuple[float, int, int]] = []  # min-heap of (seconds, step, previous step)
        self.last_step: int | None = None
        self.t0: float | None = None
        self.last_wall: float | None = None
        self._rank_cap = cfg.rank_points
        self.policy_keys: set[str] = set()
        self._n_rank = 0

    # ------------------------------------------------------------------ feeding
    def add(self, off: int, row: dict) -> None:
        """One well-formed row of ``metrics.jsonl`` that starts at byte ``off``."""
        mode = row.get("mode", "global_reduce")
        step = row["step"]
        metrics = row.get("metrics") or {}
        if mode not in ("global_reduce", "per_rank_reduce"):  # raw values; a ``late`` row (after the run)
            return
        wall = float(row["wall_time"]) if _num(row.get("wall_time")) else None
        ent = self.steps.get(step)
        if ent is None:
            ent = self.steps[step] = [wall, None, off, off]
            self._new_step(step, wall)
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

    def _new_step(self, step: int, wall: float | None) -> None:
        """Keep the steps sorted and, for a step after the last, the time it took (from the
        previous step's first row to its own) among the slowest."""
        order = self.order
        if order and step < order[-1]:
            bisect.insort(order, step)  # a resumed run's older step
            return
        order.append(step)
        if len(order) < 2 or wall is None:
            return
        prev = order[-2]
        w0 = self.steps[prev][0]
        if w0 is None:
            return
        item = (wall - w0, step, prev)
        if len(self._slow) < self.cfg.slowest_kept:
            heapq.heappush(self._slow, item)
        else:
            heapq.heappushpop(self._slow, item)

    def _add_global(self, step: int, metrics: dict, ent: list) -> None:
        series = self.series
        for key, v in metrics.items():
            t = type(v)
            if t is float or t is int:  # the common case: a known key, not the policy version
                s = series.get(key)
                if s is not None and key not in self.policy_keys:
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
                    self.policy_keys.add(k)
                if k in self.policy_keys:
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

    def keys(self) -> list[str]:
        """The global keys (a distribution's as ``key/p50`` ...), sorted."""
        return sorted(self.series)

    def summary(self, key: str) -> dict[str, Any]:
        """A global key's points, last value, min, max, non-finite count; ``flat``: it never varied."""
        s = self.series[key]
        lo, hi = s.lo[~np.isnan(s.lo)], s.hi[~np.isnan(s.hi)]
        nonfinite = int(s.nonfinite.sum())
        last = float(s.last[-1]) if len(s) else None
        mn, mx = (float(lo.min()), float(hi.max())) if len(lo) else (None, None)
        flat = mn is not None and mn == mx and not nonfinite
        return {"key": key, "points": s.n, "last": last, "min": mn, "max": mx, "nonfinite": nonfinite,
                "flat": flat or s.n < 2}

    def rank_keys(self) -> list[str]:
        """The keys two or more ranks recorded, sorted."""
        return sorted(k for k, by in self.rank_series.items() if len(by) >= 2)

    def rank_name(self, key: str) -> str:
        """The held per-rank series of ``key``: itself, or for a distribution its ``key/p50``."""
        return key if key in self.rank_series else f"{key}/p50"

    def rank_labels(self, key: str) -> list[str]:
        """The ranks that recorded ``key`` (or, for a distribution, its ``key/p50``), sorted."""
        return sorted(self.rank_series.get(key) or self.rank_series.get(f"{key}/p50") or {})

    def x_of(self, axis: str):
        """step -> x for the axis ``step`` / ``wall`` (seconds since the first step) / ``policy``."""
        if axis == "wall":
            t0 = self.t0 or 0.0
            return lambda s: (self.steps[s][0] - t0) if s in self.steps and self.steps[s][0] is not None else None
        if axis == "policy":
            return lambda s: self.steps[s][1] if s in self.steps else None
        return lambda s: s

    def byte_span(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(offset of the first row, offset of the last row) of the steps in ``[lo, hi]``."""
        order = self.order
        i, j = bisect.bisect_left(order, lo), bisect.bisect_right(order, hi)
        if i >= j:
            return None
        ents = [self.steps[s] for s in order[i:j]]
        return min(e[2] for e in ents), max(e[3] for e in ents)

    def step_gaps(self, last: int) -> list[float]:
        """The times between the last ``last`` + 1 steps' first rows (those with a wall time)."""
        walls = [self.steps[s][0] for s in self.order[-(last + 1):]]
        return [b - a for a, b in zip(walls, walls[1:]) if a is not None and b is not None and b >= a]

    def slowest(self, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` steps that took longest (from the previous step's first row to their own),
        slowest first, with that time against the median of the last 1,000 steps."""
        gaps = self.step_gaps(1000)
        med = statistics.median(gaps) if gaps else None
        top = sorted(self._slow, reverse=True)[:n]
        return [{"step": step, "after_step": prev, "duration_s": d, "median_s": med,
                 "times_median": d / med if med else None} for d, step, prev in top]

    def nbytes(self) -> int:
        """Bytes of the series held (the bounded part of the state)."""
        n = sum(s.nbytes() for s in self.series.values())
        return n + sum(s.nbytes() for by in self.rank_series.values() for s in by.values())
