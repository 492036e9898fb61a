"""Bring a run's index up to date: new rows appended, steps computed, small segments merged.

Holds ``write.lock`` throughout, so two processes (two commands, ``serve`` beside ``sql``, the
live indexer) never update one index at once: the second waits, then finds little or nothing
to do. The manifest is replaced last; segments it no longer names are deleted once no reader
holds them (:mod:`.store`).
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.index import store
from forge_obs.analysis.index.build import APPEND_TABLES, Update, write_rows
from forge_obs.analysis.index.paths import compute_steps
from forge_obs.analysis.index.schema import STEP_TABLES
from forge_obs.analysis.index.views import connect

__all__ = ["update_index", "clocks", "no_gc", "MERGE_AT"]

logger = logging.getLogger("forge_obs")

#: a table's small segments are merged into one when it has this many
MERGE_AT = 8
#: segments with fewer rows than this count as small
SMALL_ROWS = 200_000


@contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: indexing (and the doctor's per-step tables) makes
    millions of objects that hold no cycles, and each collection would walk them all."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def clocks(up: Update) -> tuple[dict, list]:
    """Per-host clock offsets (µs to add: the smallest "local receive - controller send" of the
    headers' and ``C`` records' samples, negated; the controller's host 0) and the attempts
    (distinct controller start times, ascending)."""
    samples = dict(up.run.samples)
    for st in up.run.streams.values():
        if st.clock is not None:
            samples[st.host] = min(st.clock, samples.get(st.host, st.clock))
    offsets = {h: -d for h, d in samples.items()}
    if up.run.controller_host is not None:
        offsets[up.run.controller_host] = 0
    return offsets, sorted(up.run.starts)


def _fresh(d: Path, old: "store.Manifest | None") -> store.Manifest:
    man = store.Manifest()
    if old is not None:  # segment names carry the update's number: never one of the old ones
        man.gen = old.gen
        man.garbage = old.garbage + [s["file"] for segs in old.tables.values() for s in segs]
    return man


def _flush(d: Path, man: store.Manifest) -> Any:
    def flush(up: Update) -> None:
        write_rows(d, man, up.cols, tag=up.tag)
        for rows in up.cols.values():
            rows.clear()
    return flush


def _read(run_dir: Path, d: Path, man: store.Manifest) -> Update:
    man.gen += 1
    up = Update(run_dir, man)
    up.read_timeline(_flush(d, man))
    if not up.rebuild:
        up.read_metrics()
    return up


def update_index(run_dir: Path, d: Path, rebuild: bool = False) -> store.Manifest:
    """Update (or, with ``rebuild``, rebuild) the index of ``run_dir`` in ``d``; its manifest."""
    d.mkdir(parents=True, exist_ok=True)
    with store.write_lock(d), no_gc():
        old = store.Manifest.load(d)
        man = _fresh(d, old) if rebuild or old is None else old
        up = _read(run_dir, d, man)
        if up.rebuild:  # a file shrank or was replaced: index it all again
            logger.info("forge_obs: %s: a file shrank or was replaced; rebuilding its index", run_dir)
            man = _fresh(d, man)
            up = _read(run_dir, d, man)
        if up.changed or old is None or man is not old:
            _write(d, man, up)
            store.collect_garbage(d, man)
            man.save(d)
        else:  # nothing new: the manifest stays as it is
            man.gen -= 1
            if man.garbage:
                store.collect_garbage(d, man)
                man.save(d)
    return man


def _write(d: Path, man: store.Manifest, up: Update) -> None:
    write_rows(d, man, up.cols)
    for fid, cols in up.titan.items():
        write_rows(d, man, cols, src=fid)
    offsets, attempts = clocks(up)
    man.state["offsets"] = offsets
    small = up.stream_rows(offsets, attempts)
    for table in ("streams", "opens"):
        man.garbage += [s["file"] for s in man.segments(table)]
        man.tables[table] = []
    write_rows(d, man, small)
    compute_steps(d, man, up.lo, offsets)
    con = None
    for table in APPEND_TABLES + STEP_TABLES:
        if _mergeable(man, table):
            con = con or connect()
            _merge(con, d, man, table)


def _small(man: store.Manifest, table: str) -> list:
    return [s for s in man.segments(table) if s["rows"] < SMALL_ROWS and "src" not in s]


def _mergeable(man: store.Manifest, table: str) -> bool:
    return len(_small(man, table)) >= MERGE_AT


def _merge(con: Any, d: Path, man: store.Manifest, table: str) -> None:
    """Merge a table's small segments into one (DuckDB writes it, in the order of the rows: by
    step for the per-step tables)."""
    segs = man.segments(table)
    small = _small(man, table)
    name = f"{table}-{man.gen}-m{len(segs)}.parquet"
    files = ", ".join("'" + str(d / s["file"]).replace("'", "''") + "'" for s in small)
    order = " ORDER BY step" if table in STEP_TABLES else ""
    con.execute(f"COPY (SELECT * FROM read_parquet([{files}]){order}) TO '{d / ('.' + name + '.tmp')}' "
                "(FORMAT parquet, COMPRESSION zstd)")
    (d / f".{name}.tmp").replace(d / name)
    entry = {"file": name, "rows": sum(s["rows"] for s in small)}
    if table in STEP_TABLES:
        entry["lo"] = min(s["lo"] for s in small)
        entry["hi"] = max(s["hi"] for s in small)
    man.tables[table] = [s for s in segs if s not in small] + [entry]
    man.garbage += [s["file"] for s in small]
