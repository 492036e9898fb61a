"""One incremental, columnar index per run, shared by every reader.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(3)
    >>> with timeline.record_span("train_step"):
    ...     pass
    >>> timeline.close()
    >>> idx = open_index(run_dir)                 # builds <run_dir>/index/, or brings it up to date
    >>> idx.connect().execute("SELECT name, step FROM spans").fetchall()
    [('train_step', 3)]
    >>> [r["step"] for r in idx.step_rows("steps", 3, 3)]
    [3]

The JSONL files stay the crash-safe record; the index is derived from them (Parquet segments
that DuckDB reads where they lie, and a manifest: :mod:`.store`), never needed for recording,
and rebuilt at will (``forge-obs index RUN --rebuild``). Every command opens it with
:func:`open_index`, which first indexes what was appended since the last update (each file's
indexed byte offset is remembered; a torn last line waits; a file that shrank or was replaced
is indexed again). A run directory that cannot be written is answered from a private index in
a temporary directory (or from its own index when that is up to date): nothing is written into it.

The API the other readers use (each a lookup in the index, whatever the run's length):

- :meth:`RunIndex.connect`: a DuckDB connection with the SQL views (docs/timeline.md, "Views");
- :meth:`RunIndex.step_rows`: the rows of one per-step table (``steps``, ``path``,
  ``stages``, ``slack``) for a step range;
- :meth:`RunIndex.spans`: the spans of a step range (optionally of some meshes / ranks);
- :meth:`RunIndex.metric_series`: one key's points, downsampled to at most N;
- :meth:`RunIndex.metric_rows`: the rows of ``metrics.jsonl``, in file order;
- :meth:`RunIndex.evidence`: the doctor's per-step evidence (``span_steps``);
- :func:`forge_obs.analysis.critical_path.why` / ``critical_path``: answers read from the
  stored per-step results (:mod:`.answers`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.index import store
from forge_obs.analysis.index.store import INDEX_DIR

__all__ = ["RunIndex", "open_index", "available", "has_index", "INDEX_DIR"]

logger = logging.getLogger("forge_obs")


class RunIndex:
    """An up-to-date index of one run (see the module docstring)."""

    def __init__(self, run_dir: Path, d: Path, man: store.Manifest, tmp: Any = None) -> None:
        self.run_dir, self.dir, self.manifest = run_dir, d, man
        self._tmp = tmp  # a private index's temporary directory (removed with this object)

    @property
    def gen(self) -> int:
        """How many updates wrote the index (a cache key)."""
        return self.manifest.gen

    def connect(self) -> Any:
        """A DuckDB connection with every view over the manifest's segments. The segments it
        reads stay on disk while the connection lives (it holds ``read.lock`` shared)."""
        from forge_obs.analysis.index.views import connect, create_views

        lock = store.read_lock(self.dir)
        lock.__enter__()
        man = store.Manifest.load(self.dir) or self.manifest
        con = connect()
        weakref.finalize(con, lock.__exit__, None, None, None)
        weakref.finalize(con, lambda _keep: None, self)  # a private index's directory outlives the connection
        create_views(con, self.dir, man)
        return con

    def step_rows(self, table: str, first: int, last: int, con: Any = None, steps: "list | None" = None) -> list[dict]:
        """Rows of per-step table ``table`` for steps ``first`` to ``last`` (``steps``: only
        those of them), as dicts, by step."""
        con = con or self.connect()
        order = {"path": "step, seq", "stages": "step, seq", "steps": "step"}.get(table, "step, mesh, rank, host, pid")
        where, params = "step BETWEEN ? AND ?", [first, last]
        if steps is not None:
            where, params = where + " AND step IN (SELECT unnest(?::BIGINT[]))", params + [list(steps)]
        cur = con.execute(f"SELECT * FROM _{table} WHERE {where} ORDER BY {order}", params)
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def spans(self, first: int, last: int, meshes: "list | None" = None, ranks: "list | None" = None,
              con: Any = None) -> list[dict]:
        """The spans (``spans`` view rows) tagged with a step in ``[first, last]``."""
        con = con or self.connect()
        where, params = ["step BETWEEN ? AND ?"], [first, last]
        if meshes:
            where.append("mesh IN (SELECT unnest(?::VARCHAR[]))")
            params.append(list(meshes))
        if ranks:
            where.append("rank IN (SELECT unnest(?::INTEGER[]))")
            params.append(list(ranks))
        cur = con.execute(f"SELECT * FROM spans WHERE {' AND '.join(where)} ORDER BY start_us", params)
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def metric_series(self, key: str, source: str = "global", max_points: int = 2000, con: Any = None) -> list:
        """``[(step, value, wall_time)]`` of ``key`` from ``source`` (``global`` or a rank label),
        by step; at most ``max_points``: beyond, each bucket of steps keeps its first point, its
        minimum and its maximum (a spike survives the downsampling)."""
        con = con or self.connect()
        logged = "mode IS DISTINCT FROM 'late'"  # a late row's values were logged after their step
        n = con.execute(f"SELECT count(*) FROM _metrics WHERE key = ? AND source = ? AND {logged}",
                        [key, source]).fetchone()[0]
        if n <= max_points:
            return con.execute(f"SELECT step, value, wall_time FROM _metrics WHERE key = ? AND source = ? AND {logged} "
                               "ORDER BY step, off", [key, source]).fetchall()
        buckets = max(max_points // 3, 1)
        return con.execute(
            "WITH m AS (SELECT step, value, wall_time, ntile(?) OVER (ORDER BY step, off) AS b FROM _metrics "
            f"WHERE key = ? AND source = ? AND {logged}) SELECT DISTINCT ON (step) step, value, wall_time FROM ("
            "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY b ORDER BY step) AS r1, "
            "row_number() OVER (PARTITION BY b ORDER BY value) AS r2, "
            "row_number() OVER (PARTITION BY b ORDER BY value DESC) AS r3 FROM m) WHERE r1 = 1 OR r2 = 1 OR r3 = 1) "
            "ORDER BY step", [buckets, key, source]).fetchall()

    def metric_rows(self, con: Any = None) -> Iterator[dict]:
        """Every well-formed row of ``metrics.jsonl``, in file order, as it was written (the rows
        the index was built from: ``forge_obs.analysis.store.metric_row_problem`` found nothing)."""
        import json

        cur = (con or self.connect()).execute("SELECT json FROM _metric_rows ORDER BY off")
        for batch in iter(lambda: cur.fetchmany(8192), []):
            for (text,) in batch:
                yield json.loads(text)

    def fresh(self) -> bool:
        """Whether the index holds every complete line of the run's files as they are now."""
        return _fresh(self.run_dir, store.Manifest.load(self.dir) or self.manifest)

    def summary(self) -> dict:
        """Rows per table, the index's size and its sources' (MB), whether it is private."""
        man = self.manifest
        rows = {t: sum(s["rows"] for s in segs) for t, segs in man.tables.items()}
        rows["steps"] = rows.get("steps", 0) - sum(len(s.get("skip", ())) for s in man.tables.get("steps", ()))
        size = sum((self.dir / s["file"]).stat().st_size for segs in man.tables.values() for s in segs)
        src = sum(p.stat().st_size for p in self.run_dir.glob("events/*.jsonl"))
        src += (self.run_dir / "metrics.jsonl").stat().st_size if (self.run_dir / "metrics.jsonl").exists() else 0
        opens = sum(len(s["opens"]) for s in man.state.get("streams", []))
        return {"spans": rows.get("spans", 0) + opens, "events": rows.get("events", 0),
                "metrics": rows.get("metrics", 0), "steps": rows.get("steps", 0), "index_mb": size / 1e6,
                "source_mb": src / 1e6, "private": self._tmp is not None}

    def evidence(self, con: Any = None) -> Any:
        """The doctor's per-step evidence: a DuckDB relation of ``span_steps``
        (:data:`~forge_obs.analysis.index.schema.EVIDENCE_COLS`)."""
        return (con or self.connect()).sql("SELECT * FROM span_steps")


def _fresh(run_dir: Path, man: "store.Manifest | None") -> bool:
    """Whether ``man`` indexes every complete line of ``run_dir``'s files as they are now."""
    if man is None:
        return False
    from forge_obs.analysis import reader, titan_logs

    files = man.state.get("files", {})
    paths = reader.event_files(run_dir) + titan_logs.titan_files(run_dir)
    if len(paths) != len(files):
        return False
    for p in paths:
        f = files.get(os.path.relpath(p, run_dir))
        if f is None or (p.stat().st_size != f["size"] if f["titan"] else p.stat().st_size > f["offset"]):
            return False
    m = run_dir / "metrics.jsonl"
    return not m.exists() or m.stat().st_size <= man.state.get("metrics", {}).get("offset", -1)


def available() -> bool:
    """Whether the index can be built here: DuckDB and pyarrow are installed (``pip install
    'forge-obs[timeline]'``). Without them ``why``, ``trace``, ``report`` and ``show`` read the
    files directly, as before the index."""
    import importlib.util

    return importlib.util.find_spec("duckdb") is not None and importlib.util.find_spec("pyarrow") is not None


def has_index(run_dir: "str | Path") -> bool:
    """Whether ``run_dir`` has an index of this format (built, or kept by the live indexer):
    ``open_index(run_dir, update=False)`` then reads it without indexing anything."""
    return store.Manifest.load(store.index_dir(Path(run_dir))) is not None


def _warn(run_dir: Path, man: store.Manifest) -> None:
    """One warning per source the index skipped malformed lines of (every time it is opened:
    what the files hold does not change because they were indexed before)."""
    st = man.state
    if st.get("malformed"):
        logger.warning("forge_obs: %s: %d malformed timeline line(s) skipped (first: %s)", run_dir / "events",
                       st["malformed"], st.get("first_malformed"))
    m = st.get("metrics") or {}
    if m.get("malformed"):
        logger.warning("forge_obs: %s: %d malformed line(s) skipped (first: %s)", run_dir / "metrics.jsonl",
                       m["malformed"], m.get("first_malformed"))


def open_index(run_dir: "str | Path", update: bool = True, rebuild: bool = False, warn: bool = True) -> RunIndex:
    """The index of ``run_dir``, brought up to date first (``update``; ``rebuild``: from
    scratch). A run directory that cannot be written gets a private index in a temporary
    directory, unless its own index is up to date. ``warn``: log the malformed lines skipped."""
    idx = _open(Path(run_dir), update, rebuild)
    if warn:
        _warn(idx.run_dir, idx.manifest)
    return idx


def _open(run_dir: Path, update: bool, rebuild: bool) -> RunIndex:
    d = store.index_dir(run_dir)
    if store.writable(run_dir):
        man = None if update or rebuild else store.Manifest.load(d)
        if man is None:  # the updater (and what it imports) only when it runs
            from forge_obs.analysis.index.updater import update_index

            man = update_index(run_dir, d, rebuild)
        return RunIndex(run_dir, d, man)
    own = store.Manifest.load(d) if d.is_dir() else None
    if own is not None and not rebuild and _fresh(run_dir, own):
        return RunIndex(run_dir, d, own)
    from forge_obs.analysis.index.updater import update_index

    tmp = tempfile.TemporaryDirectory(prefix="forge_obs_index_")
    man = update_index(run_dir, Path(tmp.name) / INDEX_DIR, rebuild=True)
    return RunIndex(run_dir, Path(tmp.name) / INDEX_DIR, man, tmp)
