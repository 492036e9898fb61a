"""What ``forge-obs serve`` reads from a run's index (:mod:`forge_obs.analysis.index`): a step's
critical path, its spans with their CPU time, the slowest controller steps. While a run is open
the server keeps an indexer process (:func:`forge_obs.analysis.index.live.start_indexer`) that
brings the index up to date every second, and reads the index as it left it: nothing is indexed
on the server's threads, and a step is answered within about a second of being written.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> from forge_obs.analysis.index import open_index
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(0)
    >>> with timeline.record_span("controller_step"):
    ...     pass
    >>> timeline.close()
    >>> _ = open_index(run_dir)                     # what the indexer process does
    >>> r = IndexedRun(run_dir, start=False)
    >>> [s["name"] for s in r.spans(0)["spans"]], r.critical_path(0)["available"]
    (['controller_step'], True)

Like the doctor and the Perfetto export, the index reads the run by itself: the indexer is
started, and an answer given, only while no entry of the run directory links outside the
served root. Without DuckDB and pyarrow the critical path is walked from the files (no spans,
no controller steps).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from forge_obs.analysis.serve.analyses import critical_path_at, jsonable
from forge_obs.analysis.serve.files import Confined

__all__ = ["IndexedRun", "MAX_SPANS"]

#: spans a step's drill-down lists (its longest)
MAX_SPANS = 100


class IndexedRun:
    """The index of the run in ``run_dir`` as the server reads it; ``start``: keep an indexer
    process while this object is open (:meth:`close` stops it)."""

    def __init__(self, run_dir: "str | Path", files: Confined | None = None, start: bool = True) -> None:
        from forge_obs.analysis.index import available

        self.run_dir = Path(run_dir)
        self.files = files or Confined(self.run_dir)
        self.usable = available()
        self.proc: Any = None
        self.lock = threading.Lock()  # one query at a time on the kept connection
        self._con: Any = None
        if start and self.usable:
            self._start()

    def _start(self) -> None:
        from forge_obs.analysis.index import store
        from forge_obs.analysis.index.live import start_indexer

        if store.writable(self.run_dir) and self.files.escapes(self.run_dir) is None:
            self.proc = start_indexer(self.run_dir)

    def close(self, wait: bool = True) -> None:
        """Stop the indexer (it indexes what was appended once more, then exits); ``wait=False``:
        a thread of its own waits for it (and kills it past 10 s)."""
        from forge_obs.analysis.index.live import stop_indexer

        with self.lock:
            if self._con is not None:
                self._con[1].close()
                self._con = None
        p, self.proc = self.proc, None
        if p is None:
            return
        if wait:
            stop_indexer(p, timeout_s=10.0)
        else:
            p.terminate()
            threading.Thread(target=stop_indexer, args=(p, 10.0), name="forge_obs-serve-indexer-stop", daemon=True).start()

    def _why_not(self) -> str | None:
        """Why the index may not be read now (None: it may)."""
        if not self.usable:
            return "the run's index needs DuckDB and pyarrow: pip install 'forge-obs[timeline]'"
        bad = self.files.escapes(self.run_dir)
        if bad is not None:
            return f"{bad} links outside the served root"
        from forge_obs.analysis import reader, titan_logs
        from forge_obs.analysis.index import has_index

        if not reader.event_files(self.run_dir) and not titan_logs.titan_files(self.run_dir):
            return "this run has no timeline (events/)"
        if not has_index(self.run_dir):
            return "the run's index is being built"
        return None

    def _index(self) -> Any:
        from forge_obs.analysis.index import open_index

        return open_index(self.run_dir, update=False, warn=False)

    def _connected(self) -> tuple:
        """``(index, connection)`` of the index as it is now: one connection kept per index
        generation (its views cost more than a query); call with ``self.lock`` held."""
        idx = self._index()
        if self._con is None or self._con[0].gen != idx.gen:
            if self._con is not None:
                self._con[1].close()  # its segments may go
            self._con = (idx, idx.connect())
        return self._con

    def critical_path(self, step: int) -> dict[str, Any]:
        """The step's critical path and slack, with its one-line answer (:func:`forge_obs.analysis.critical_path.why`'s
        step), as the index holds them."""
        if not self.usable:
            return critical_path_at(self.run_dir, step, self.files)
        if (why := self._why_not()) is not None:
            return {"available": False, "why": why}
        from forge_obs.analysis.index.answers import why as indexed_why

        with self.lock:
            idx, con = self._connected()
            try:
                out = {"available": True, "path": jsonable(indexed_why(idx, [step], con=con)["steps"][0])}
            except ValueError as e:
                behind = not idx.fresh()
                out = {"available": False, "why": f"step {step} is not indexed yet" if behind else str(e)}
        return self._checked(out)

    def spans(self, step: int, limit: int = MAX_SPANS) -> dict[str, Any]:
        """The step's longest spans (at most ``limit``), by start: where, name, wall and CPU time."""
        if (why := self._why_not()) is not None:
            return {"available": False, "why": why, "spans": []}
        with self.lock:
            idx, con = self._connected()
            n = con.execute("SELECT count(*) FROM spans WHERE step = ?", [step]).fetchone()[0]
            rows = con.execute("SELECT mesh, actor, rank, task, name, start_us, dur_us, cpu_us, finished FROM spans "
                               "WHERE step = ? ORDER BY dur_us DESC, start_us LIMIT ?", [step, limit]).fetchall()
        t0 = min((r[5] for r in rows), default=0)
        spans = [{"mesh": m, "actor": a, "rank": rk, "task": t, "name": nm, "start_ms": (s - t0) / 1e3, "wall_ms": d / 1e3,
                  "cpu_ms": None if c is None else c / 1e3, "finished": f} for m, a, rk, t, nm, s, d, c, f in rows]
        spans.sort(key=lambda x: x["start_ms"])
        return self._checked({"available": True, "spans": spans, "left_out": max(n - len(spans), 0),
                              "indexed": idx.fresh()})

    def slowest(self, n: int = 10) -> list | None:
        """The ``n`` slowest controller steps of the index, with their time against the median of
        the last 1,000 (None: the run has none indexed, or the index may not be read)."""
        if self._why_not() is not None:
            return None
        with self.lock:
            _idx, con = self._connected()
            top = con.execute("SELECT step, duration_s FROM _steps WHERE NOT unfinished "
                              "ORDER BY duration_s DESC, step LIMIT ?", [n]).fetchall()
            if not top:
                return None
            med = con.execute("SELECT median(duration_s) FROM (SELECT duration_s FROM _steps WHERE NOT unfinished "
                              "ORDER BY step DESC LIMIT 1000)").fetchone()[0]
        out = [{"step": s, "duration_s": d, "median_s": med, "times_median": d / med if med else None,
                "source": "controller step"} for s, d in top]
        return out if self.files.escapes(self.run_dir) is None else None

    def state(self) -> dict[str, Any] | None:
        """How far the index is (``gen``: its updates, ``steps``: controller steps with their
        critical path, ``fresh``: every complete line of the run indexed); None without one."""
        if self._why_not() is not None:
            return None
        from forge_obs.analysis.index import store

        man = store.Manifest.load(store.index_dir(self.run_dir))
        if man is None:
            return None
        idx = self._index()
        steps = sum(s["rows"] - len(s.get("skip", ())) for s in man.tables.get("steps", []))
        return {"gen": man.gen, "steps": steps, "fresh": idx.fresh()}

    def _checked(self, out: dict) -> dict:
        """``out``, unless an entry of the run directory links outside the root by now."""
        bad = self.files.escapes(self.run_dir)
        if bad is not None:
            return {"available": False, "why": f"{bad} links outside the served root", "spans": []}
        return out
