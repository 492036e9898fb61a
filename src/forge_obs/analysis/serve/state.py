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
- the latest SAMPLE rows per key, the last ``max_alerts`` alerts and the ``slowest_kept``
  slowest steps.

**The data-access interface.** The API (:mod:`.api`) reads a run only through these methods
and attributes of :class:`RunState`, so that another source of the same answers (a per-run
index) can take its place: :meth:`~RunState.update`, ``version``, ``generation``,
:meth:`~RunState.reading`, :meth:`~RunState.keys`, :meth:`~RunState.summary`,
:meth:`~RunState.dist_of`, ``distributions``, :meth:`~RunState.rank_keys`,
:meth:`~RunState.rank_labels`, :meth:`~RunState.points`, :meth:`~RunState.rank_points`,
:meth:`~RunState.csv_rows`, :meth:`~RunState.step_detail`, :meth:`~RunState.samples`,
:meth:`~RunState.sample_key_names`, :meth:`~RunState.alert_list`, :meth:`~RunState.slowest`,
:meth:`~RunState.status`, :meth:`~RunState.meta`, :meth:`~RunState.labels`,
:meth:`~RunState.x_of`, :meth:`~RunState.facts` (steps, last step, times, ranks, malformed
lines), ``run_dir`` and ``lock`` (held while answering from several of them at once).

A zoomed chart (:meth:`~RunState.points` with ``lo``/``hi``) whose held buckets are coarser than
the chart asks for is read back exactly from the step range's bytes in ``metrics.jsonl``
(:mod:`.ranges`), up to ``exact_max_bytes``; so is the CSV export.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import re
import statistics
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from forge_obs.analysis.serve.files import Confined
from forge_obs.analysis.serve.meta import controller_gone, read_meta, run_labels
from forge_obs.analysis.serve.ranges import Memo, read_rows, value_of
from forge_obs.analysis.serve.series import Buckets, merge_to
from forge_obs.core.formatting import QUANTILES, flatten, is_distribution
from forge_obs.analysis.serve.tail import Tail
from forge_obs.analysis.store import metric_row_problem

__all__ = ["ServeConfig", "RunState", "POLICY_KEY"]

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


class RunState:
    """One run, read from ``run_dir``; every file through ``files`` (default: confined to
    ``run_dir``; the server confines to its root)."""

    def __init__(self, run_dir: Path, config: ServeConfig | None = None, files: Confined | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = config or ServeConfig()
        self.files = files or Confined(self.run_dir)
        self.lock = threading.RLock()
        self.version = 0  # grows with each update that read something
        self.generation = 0  # grows each time the run was found replaced and is read afresh
        self._clear()

    def _clear(self) -> None:
        """Nothing read yet: what :meth:`update` builds from the run's files."""
        self._dir_id = self._identity(self.run_dir)
        self.metrics = Tail(self.run_dir / "metrics.jsonl", self.cfg.read_chunk_bytes, self.files.open)
        self.alerts_tail = Tail(self.run_dir / "alerts.jsonl", opener=self.files.open)
        self.series: dict[str, Buckets] = {}
        self.rank_series: dict[str, dict[str, Buckets]] = {}
        self.distributions: set[str] = set()
        self.sample_keys: dict[str, tuple[int, list]] = {}
        self.ranks: set[str] = set()
        self.steps: dict[int, list] = {}  # step -> [wall, policy version, first row offset, last row offset]
        self._order: list[int] = []  # the steps, sorted
        self._slow: list[tuple[float, int, int]] = []  # min-heap of (seconds, step, previous step)
        self._exact_cache: OrderedDict = OrderedDict()
        self._memo: tuple[tuple[int, int], Memo] | None = None  # the last zoomed range's decoded rows
        self.alerts: deque = deque(maxlen=self.cfg.max_alerts)
        self.last_step: int | None = None
        self.t0: float | None = None
        self.last_wall: float | None = None
        self.malformed = 0
        self._rank_cap = self.cfg.rank_points
        self._policy_keys: set[str] = set()
        self._n_rank = 0
        self._meta: tuple[float, dict] = (-1.0, {})
        self._gone_at: tuple[float, str | None] = (-1e9, None)

    def _identity(self, path: Path) -> tuple[int, int] | None:
        try:
            st = self.files.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _replaced(self) -> bool:
        """Whether the run was deleted and written again, or its files replaced or truncated,
        since the last read: its directory is another, or a tail found its file replaced."""
        dir_id = self._identity(self.run_dir)
        moved = dir_id is not None and self._dir_id is not None and dir_id != self._dir_id
        metrics, alerts = self.metrics.replaced(), self.alerts_tail.replaced()
        return moved or metrics or alerts

    # ------------------------------------------------------------------ reading
    def update(self, chunks: int | None = None, wait: bool = True) -> bool:
        """Read what was appended since the last call (at most ``chunks`` reads of
        ``Tail.max_bytes`` each; None: all of it); True when something was read. ``wait=False``
        returns at once when another thread is reading."""
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            got = False
            if self._replaced():  # a new run under the same id: nothing of the old one is kept
                self._clear()
                self.generation += 1
                got = True
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
        order = self._order
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
            mtime = self.files.stat(self.run_dir / "meta.json").st_mtime
        except OSError:
            return {}
        if mtime != self._meta[0]:
            self._meta = (mtime, read_meta(self.run_dir, self.files))
        return self._meta[1]

    def status(self, now: float | None = None) -> dict[str, Any]:
        """``finished`` / ``starting`` / ``running`` / ``stalled`` / ``hung`` / ``crashed`` with why.

        A run is ``starting`` until its first step; it is judged ``stalled`` only once the time
        between its steps is known (two steps), as the ``stall`` alert judges it: a minute of
        start-up (meshes, models, vLLM) is not a stall."""
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
        if not self.steps:  # no row of any step yet (a run may log per-rank rows only)
            start = meta.get("start_time")
            since = f" ({now - start:.0f}s since the run started)" if _num(start) else ""
            return {"state": "starting", "why": f"no step logged yet{since}"}
        last = self._last_activity()
        limit = self.stall_limit_s()
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

    def stall_limit_s(self) -> float | None:
        """Seconds of silence after which the run is stalled: max(``stall_floor_s``,
        ``stall_factor`` x the median time between its last 31 steps); None before two steps."""
        walls = [self.steps[s][0] for s in sorted(self.steps)[-31:] if self.steps[s][0] is not None]
        gaps = [b - a for a, b in zip(walls, walls[1:]) if b >= a]
        if not gaps:
            return None
        return max(self.cfg.stall_floor_s, self.cfg.stall_factor * statistics.median(gaps))

    def step_rows(self, step: int) -> list[dict]:
        """The rows of ``step`` (every mode), read back from ``metrics.jsonl``."""
        ent = self.steps.get(step)
        if ent is None:
            return []
        lo, hi = ent[2], ent[3]
        out = []
        try:
            f = self.files.open(self.metrics.path)
        except OSError:
            return []
        with f:
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

    # ------------------------------------------------------------------ data access (see the module's docstring)
    def reading(self) -> dict[str, Any] | None:
        """How far a run being opened is read (None once it is read to its end)."""
        t = self.metrics
        if t.behind or (t.offset == 0 and t.file_size() > t.max_bytes):
            return {"bytes": t.offset, "of": max(t.size, t.file_size())}
        return None

    def facts(self) -> dict[str, Any]:
        """What the run is so far: steps, last step, first and last wall time, ranks, whether it
        has a policy version, malformed lines skipped."""
        return {"steps": len(self.steps), "last_step": self.last_step, "t0": self.t0, "last_wall": self.last_wall,
                "ranks": len(self.ranks), "policy_axis": bool(self._policy_keys),
                "malformed": self.malformed + self.metrics.malformed}

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

    def rank_labels(self, key: str) -> list[str]:
        """The ranks that recorded ``key`` (or, for a distribution, its ``key/p50``), sorted."""
        return sorted(self.rank_series.get(key) or self.rank_series.get(f"{key}/p50") or {})

    def points(self, keys: list[str], n: int, lo: int | None = None, hi: int | None = None
               ) -> tuple[dict[str, tuple[list, list]], dict[str, Any]]:
        """Each of ``keys`` (those the run has) within steps ``[lo, hi]`` in at most ``n`` points
        (each bucket's minimum and maximum at their steps), and the resolution: ``width`` steps
        a point, ``exact`` when every step is its own point. A zoomed range coarser in the held
        buckets than ``n`` points is read back exactly from ``metrics.jsonl``."""
        with self.lock:
            held = {k: self.series[k] for k in keys if k in self.series}
        return self._points(held, n, lo, hi, "global_reduce", None)

    def rank_points(self, key: str, labels: list[str], n: int, lo: int | None = None, hi: int | None = None
                    ) -> tuple[dict[str, tuple[list, list]], dict[str, Any]]:
        """:meth:`points` of one key for each rank of ``labels``."""
        with self.lock:
            by = self.rank_series.get(key) or self.rank_series.get(f"{key}/p50") or {}
            name = key if key in self.rank_series else f"{key}/p50"
            held = {lb: by[lb] for lb in labels if lb in by}
        return self._points(held, n, lo, hi, "per_rank_reduce", name)

    def _points(self, held: dict[str, Buckets], n: int, lo: int | None, hi: int | None, mode: str,
                rank_key: str | None) -> tuple[dict[str, tuple[list, list]], dict[str, Any]]:
        per = max(1, n // 2)  # two points (min, max) a bucket
        with self.lock:
            merged = {k: merge_to(s, per, lo, hi) for k, s in held.items()}
            width = max((m.width for m in merged.values()), default=1)
            generation = self.generation
        if width > 1 and lo is not None and hi is not None:
            exact = self._exact(list(held), lo, hi, per, mode, rank_key, generation)
            if exact is not None:
                return exact
        return {k: m.points(lo, hi) for k, m in merged.items()}, {"width": width, "exact": width == 1}

    def _exact(self, names: list[str], lo: int, hi: int, per: int, mode: str, rank_key: str | None,
               generation: int) -> tuple[dict, dict] | None:
        """``names`` over steps ``[lo, hi]`` read back from metrics.jsonl (None: the range spans
        more than ``exact_max_bytes``, or the run was replaced meanwhile)."""
        cache_key = (tuple(names), lo, hi, per, mode, rank_key)
        with self.lock:
            span = self._byte_span(lo, hi)
            if cache_key in self._exact_cache:
                self._exact_cache.move_to_end(cache_key)
                return self._exact_cache[cache_key]
            complete = self.last_step is not None and hi < self.last_step  # no row of the range is still to come
        if span is not None and span[1] - span[0] > self.cfg.exact_max_bytes:
            return None
        out = {k: Buckets(per) for k in names}
        if span is not None:
            wanted = [rank_key] if rank_key else names
            with self.lock:
                if self._memo is None or self._memo[0] != span:
                    self._memo = (span, Memo(self.cfg.memo_bytes))
                memo = self._memo[1]
            for row in read_rows(lambda: self.files.open(self.metrics.path), span[0], span[1], wanted, mode, memo):
                step = row["step"]
                if not lo <= step <= hi:
                    continue
                if rank_key is None:
                    for k, b in out.items():
                        if (v := value_of(row["metrics"], k)) is not None:
                            b.add(step, v)
                elif (b := out.get(str((row.get("source") or {}).get("label") or "?"))) is not None:
                    if (v := value_of(row["metrics"], rank_key)) is not None:
                        b.add(step, v)
        width = max((b.width for b in out.values()), default=1)
        res = ({k: b.points(lo, hi) for k, b in out.items()}, {"width": width, "exact": width == 1, "read": True})
        with self.lock:
            if generation != self.generation:
                return None
            if complete:
                self._exact_cache[cache_key] = res
                while len(self._exact_cache) > 64:
                    self._exact_cache.popitem(last=False)
        return res

    def _byte_span(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(offset of the first row, offset of the last row) of the steps in ``[lo, hi]``."""
        order = self._order
        i, j = bisect.bisect_left(order, lo), bisect.bisect_right(order, hi)
        if i >= j:
            return None
        ents = [self.steps[s] for s in order[i:j]]
        return min(e[2] for e in ents), max(e[3] for e in ents)

    def csv_rows(self, keys: list[str], lo: int | None = None, hi: int | None = None,
                 rank_key: str | None = None) -> Iterator[list]:
        """The header, then one row per step of ``[lo, hi]`` (all steps when not given): the
        step, seconds since the run's first step, and each key's exact value (``rank_key``: that
        key's value on each rank, one column a rank), read back from ``metrics.jsonl`` in file
        order, a chunk at a time."""
        with self.lock:
            lo = self._order[0] if lo is None and self._order else lo
            hi = self._order[-1] if hi is None and self._order else hi
            span = self._byte_span(lo, hi) if lo is not None and hi is not None else None
            t0 = self.t0 or 0.0
            cols = self.rank_labels(rank_key) if rank_key else [k for k in keys if k in self.series]
        yield ["step", "wall_time_s", *cols]
        if span is None:
            return
        mode = "per_rank_reduce" if rank_key else "global_reduce"
        name = rank_key if rank_key is None or rank_key in self.rank_series else f"{rank_key}/p50"
        index = {c: i for i, c in enumerate(cols)}
        current: list | None = None
        for row in read_rows(lambda: self.files.open(self.metrics.path), span[0], span[1], [name] if rank_key else cols, mode):
            step = row["step"]
            if not lo <= step <= hi:
                continue
            if current is None or current[0] != step:
                if current is not None:
                    yield current
                wall = row.get("wall_time")
                current = [step, wall - t0 if _num(wall) else None, *([None] * len(cols))]
            if rank_key is None:
                for c, i in index.items():
                    current[2 + i] = value_of(row["metrics"], c)
            elif (i := index.get(str((row.get("source") or {}).get("label") or "?"))) is not None:
                current[2 + i] = value_of(row["metrics"], name)
        if current is not None:
            yield current

    def sample_key_names(self) -> list[str]:
        return sorted(self.sample_keys)

    def samples(self, key: str) -> tuple[int | None, list]:
        """The step of a SAMPLE key's latest rows, and those rows."""
        return self.sample_keys.get(key, (None, []))

    def alert_list(self) -> list[dict[str, Any]]:
        """The alerts read from ``alerts.jsonl`` (the last ``max_alerts``), in file order."""
        return list(self.alerts)

    def slowest(self, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` steps that took longest (from the previous step's first row to their own),
        slowest first, with that time against the median of the last 1,000 steps."""
        walls = [self.steps[s][0] for s in self._order[-1001:]]
        gaps = [b - a for a, b in zip(walls, walls[1:]) if a is not None and b is not None and b >= a]
        med = statistics.median(gaps) if gaps else None
        top = sorted(self._slow, reverse=True)[:n]
        return [{"step": step, "after_step": prev, "duration_s": d, "median_s": med,
                 "times_median": d / med if med else None} for d, step, prev in top]

    def labels(self) -> dict[str, Any]:
        """The run's name, tags and notes (meta.json's ``name``, ``tags``, ``notes``, written
        from the run config), as text; what is not there is left out."""
        return run_labels(self.meta())


def _finite(d: dict[str, float]) -> dict[str, Any]:
    """Values JSON can carry: NaN / inf as text."""
    return {k: (v if math.isfinite(v) else str(v)) for k, v in d.items()}
