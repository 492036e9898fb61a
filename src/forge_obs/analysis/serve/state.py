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
the last call (:class:`~forge_obs.analysis.serve.tail.Tail`), never the whole run again. The jobs
are split: :mod:`.held` keeps what is held of the metrics (bounded whatever the run's length),
:mod:`.readback` reads exact values back from a step range's bytes, :mod:`.status` judges where
the run stands.

**The data-access interface.** The API (:mod:`.api`) reads a run only through these methods
and attributes of :class:`RunState`: :meth:`~RunState.update`, ``version``, ``generation``,
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
(:mod:`.readback`), up to ``exact_max_bytes``; so is the CSV export.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.serve.files import Confined
from forge_obs.analysis.serve.held import Held, ServeConfig
from forge_obs.analysis.serve.readback import ReadBack
from forge_obs.analysis.serve.series import Buckets, merge_to
from forge_obs.analysis.serve.status import RunStatus
from forge_obs.analysis.serve.tail import Tail
from forge_obs.analysis.store import metric_row_problem

__all__ = ["RunState"]


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
        self.run_status = RunStatus(self.run_dir, self.files, self.cfg)
        self._clear()

    def _clear(self) -> None:
        """Nothing read yet: what :meth:`update` builds from the run's files."""
        self._dir_id = self._identity(self.run_dir)
        self.metrics = Tail(self.run_dir / "metrics.jsonl", self.cfg.read_chunk_bytes, self.files.open)
        self.alerts_tail = Tail(self.run_dir / "alerts.jsonl", opener=self.files.open)
        self.held = Held(self.cfg)
        self.readback = ReadBack(self.metrics.path, self.files, self.cfg, self.lock)
        self.alerts: deque = deque(maxlen=self.cfg.max_alerts)
        self.malformed = 0

    # what is held, under the names the API and the tests read
    series = property(lambda self: self.held.series)
    rank_series = property(lambda self: self.held.rank_series)
    distributions = property(lambda self: self.held.distributions)
    steps = property(lambda self: self.held.steps)
    last_step = property(lambda self: self.held.last_step)

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
                        self.held.add(off, row)
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

    # ------------------------------------------------------------------ data access (see the module's docstring)
    def dist_of(self, key: str) -> str | None:
        return self.held.dist_of(key)

    def meta(self) -> dict[str, Any]:
        return self.run_status.meta()

    def labels(self) -> dict[str, Any]:
        """The run's name, tags and notes (meta.json's ``name``, ``tags``, ``notes``), as text."""
        return self.run_status.labels()

    def status(self, now: float | None = None) -> dict[str, Any]:
        """Where the run stands (:meth:`.status.RunStatus.status`)."""
        return self.run_status.status(self.held, self.alerts, now)

    def stall_limit_s(self) -> float | None:
        return self.run_status.stall_limit_s(self.held)

    def step_rows(self, step: int) -> list[dict]:
        """The rows of ``step`` (every mode), read back from ``metrics.jsonl``."""
        return self.readback.step_rows(self.held, step)

    def step_detail(self, step: int) -> dict[str, Any]:
        """What the drill-down shows of ``step``: global values, per-rank values, SAMPLE rows."""
        return self.readback.step_detail(self.held, step)

    def x_of(self, axis: str):
        """step -> x for the axis ``step`` / ``wall`` (seconds since the first step) / ``policy``."""
        return self.held.x_of(axis)

    def nbytes(self) -> int:
        """Bytes of the series held (the bounded part of the state)."""
        return self.held.nbytes()

    def reading(self) -> dict[str, Any] | None:
        """How far a run being opened is read (None once it is read to its end)."""
        t = self.metrics
        if t.behind or (t.offset == 0 and t.file_size() > t.max_bytes):
            return {"bytes": t.offset, "of": max(t.size, t.file_size())}
        return None

    def facts(self) -> dict[str, Any]:
        """What the run is so far: steps, last step, first and last wall time, ranks, whether it
        has a policy version, malformed lines skipped."""
        h = self.held
        return {"steps": len(h.steps), "last_step": h.last_step, "t0": h.t0, "last_wall": h.last_wall,
                "ranks": len(h.ranks), "policy_axis": bool(h.policy_keys),
                "malformed": self.malformed + self.metrics.malformed}

    def keys(self) -> list[str]:
        """The global keys (a distribution's as ``key/p50`` ...), sorted."""
        return self.held.keys()

    def summary(self, key: str) -> dict[str, Any]:
        """A global key's points, last value, min, max, non-finite count; ``flat``: it never varied."""
        return self.held.summary(key)

    def rank_keys(self) -> list[str]:
        """The keys two or more ranks recorded, sorted."""
        return self.held.rank_keys()

    def rank_labels(self, key: str) -> list[str]:
        """The ranks that recorded ``key`` (or, for a distribution, its ``key/p50``), sorted."""
        return self.held.rank_labels(key)

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
            name = self.held.rank_name(key)
            by = self.rank_series.get(name) or {}
            held = {lb: by[lb] for lb in labels if lb in by}
        return self._points(held, n, lo, hi, "per_rank_reduce", name)

    def _points(self, held: dict[str, Buckets], n: int, lo: int | None, hi: int | None, mode: str,
                rank_key: str | None) -> tuple[dict[str, tuple[list, list]], dict[str, Any]]:
        per = max(1, n // 2)  # two points (min, max) a bucket
        with self.lock:
            merged = {k: merge_to(s, per, lo, hi) for k, s in held.items()}
            width = max((m.width for m in merged.values()), default=1)
            generation, h, rb = self.generation, self.held, self.readback
        if width > 1 and lo is not None and hi is not None:
            exact = rb.exact(h, list(held), lo, hi, per, mode, rank_key, lambda: generation == self.generation)
            if exact is not None:
                return exact
        return {k: m.points(lo, hi) for k, m in merged.items()}, {"width": width, "exact": width == 1}

    def csv_rows(self, keys: list[str], lo: int | None = None, hi: int | None = None,
                 rank_key: str | None = None) -> Iterator[list]:
        """The header, then one row per step of ``[lo, hi]`` (all steps when not given) with each
        key's exact value (``rank_key``: that key's value on each rank), read back from
        ``metrics.jsonl`` (:meth:`.readback.ReadBack.csv_rows`)."""
        return self.readback.csv_rows(self.held, keys, lo, hi, rank_key)

    def sample_key_names(self) -> list[str]:
        return sorted(self.held.sample_keys)

    def samples(self, key: str) -> tuple[int | None, list]:
        """The step of a SAMPLE key's latest rows, and those rows."""
        return self.held.sample_keys.get(key, (None, []))

    def alert_list(self) -> list[dict[str, Any]]:
        """The alerts read from ``alerts.jsonl`` (the last ``max_alerts``), in file order."""
        return list(self.alerts)

    def slowest(self, n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` steps that took longest (from the previous step's first row to their own),
        slowest first, with that time against the median of the last 1,000 steps."""
        return self.held.slowest(n)
