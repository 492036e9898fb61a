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
from forge_obs.analysis.index.build import APPEND_TABLES, Update, session_rows, write_rows
from forge_obs.analysis.index.paths import compute_live, compute_steps
from forge_obs.analysis.index.rows import Columns
from forge_obs.analysis.index.schema import STEP_TABLES, arrow_schema
from forge_obs.analysis.index.views import STEP_INPUTS, connect, create_views

__all__ = ["update_index", "clocks", "no_gc", "MERGE_AT"]

logger = logging.getLogger("forge_obs")

#: a table's small segments are merged into one when it has this many
MERGE_AT = 8
#: segments with fewer rows than this count as small
SMALL_ROWS = 200_000
#: small segments of fewer rows than this are of the first size class
TIER_ROWS = 256


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
    """A manifest to index ``d`` anew: the segments of ``old`` are garbage, and so is every
    segment file in ``d`` when there is no ``old`` (another format's, or a crashed build's: no
    reader of this format can hold them). Segment names carry the update's number: a new one is
    never an old one's name."""
    man = store.Manifest()
    if old is not None:
        man.gen = old.gen
        man.garbage = old.garbage + [s["file"] for segs in old.tables.values() for s in segs]
        return man
    strays = sorted(p.name for p in d.glob("*.parquet"))
    man.garbage = strays
    man.gen = max((_gen_of(name) for name in strays), default=0)
    return man


def _gen_of(name: str) -> int:
    """The update number in a segment's name (``<table>-<gen>-<part>.parquet``), 0 if none."""
    parts = name.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def _flush(d: Path, man: store.Manifest) -> Any:
    def flush(up: Update) -> None:
        up.flushed = True
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


def update_index(run_dir: Path, d: Path, rebuild: bool = False, window: Any = None) -> store.Manifest:
    """Update (or, with ``rebuild``, rebuild) the index of ``run_dir`` in ``d``; its manifest.
    ``window``: the live indexer's :class:`~.window.Window`, kept from its last update (the steps
    are computed on its rows when it holds what they need)."""
    d.mkdir(parents=True, exist_ok=True)
    with store.write_lock(d), no_gc():
        old = store.Manifest.load(d)
        man = _fresh(d, old) if rebuild or old is None else old
        same = window is not None and old is not None and window.gen == old.gen and not rebuild
        up = _read(run_dir, d, man)
        if up.rebuild:  # a file shrank or was replaced: index it all again
            logger.info("forge_obs: %s: a file shrank or was replaced; rebuilding its index", run_dir)
            man = _fresh(d, man)
            up = _read(run_dir, d, man)
            same = False
        if up.changed or old is None or man is not old:
            _write(d, man, up, window, same and not up.flushed and not up.titan)
            store.collect_garbage(d, man)
            man.save(d)
            if window is not None:
                window.gen = man.gen
        else:  # nothing new: the manifest stays as it is
            man.gen -= 1
            if man.garbage:
                store.collect_garbage(d, man)
                man.save(d)
    return man


def _write(d: Path, man: store.Manifest, up: Update, window: Any = None, live: bool = False) -> None:
    """Write what the update read and compute its steps: on the rows of the live indexer's
    ``window`` when it is ``live`` (it holds what the index held after its last update) and can,
    else reading the index (and the window is read again from it)."""
    offsets, _attempts = clocks(up)
    ok = live and window.add(up.cols, man, _sid_offsets(man, up, offsets))
    write_rows(d, man, up.cols)
    for fid, cols in up.titan.items():
        write_rows(d, man, cols, src=fid)
    man.state["offsets"] = offsets
    small = session_rows(man.state)
    if not (ok and compute_live(d, man, up.lo, offsets, window, _open_rows(man, small, offsets))):
        compute_steps(d, man, up.lo, offsets)
        if window is not None:
            con = connect()
            create_views(con, d, man, STEP_INPUTS)
            window.seed(con, man)
            con.close()
    tracked = window.tracked() if window is not None else set()
    for table in APPEND_TABLES + STEP_TABLES:
        for group in _merges(man, table, tracked):
            entry, steps = _merge(d, man, table, group)
            if window is not None:  # it may still mark the merged segment's steps
                window.merged([s["file"] for s in group], entry["file"], steps)
    if window is not None:
        window.prune()


def _sid_offsets(man: store.Manifest, up: Update, offsets: dict) -> dict:
    """sid -> the clock offset of its host (µs)."""
    return {sid: offsets.get(up.run.streams[key].host, 0) for key, sid in up.sid_of.items() if key in up.run.streams}


def _open_rows(man: store.Manifest, small: Columns, offsets: dict) -> list:
    """The open spans as :meth:`.paths._Rows.graph` reads them (start corrected), in order."""
    host = {s["sid"]: s["header"].get("host", "?") for s in man.state.get("streams", [])}
    order = {f["fid"]: tuple(f["order"]) for f in man.state.get("files", {}).values()}
    rows = sorted(small["opens"], key=lambda r: (order.get(r[10]) is None, order.get(r[10], ()), r[11]))
    return [(sid, lane, name, step, start + offsets.get(host.get(sid), 0), 0, flow, ft, link)
            for sid, _a, lane, name, step, start, flow, ft, _at, link, _fid, _n in rows]


def _small(man: store.Manifest, table: str) -> list:
    return [s for s in man.segments(table) if s["rows"] < SMALL_ROWS and "src" not in s]


def _tier(rows: int) -> int:
    """A small segment's size class: a merge joins MERGE_AT segments of one class (each row is
    written again about log(SMALL_ROWS / TIER_ROWS, MERGE_AT) times, however long a live run)."""
    t, n = 0, TIER_ROWS
    while rows >= n:
        n *= MERGE_AT
        t += 1
    return t


def _merges(man: store.Manifest, table: str, tracked: "set | frozenset" = frozenset()) -> list:
    """The groups of a table's small segments to merge (the oldest MERGE_AT of a size class),
    those the live indexer's window ``tracked`` (it may mark their steps) apart from the others:
    every segment that holds a step the window may mark is one it tracks."""
    by: dict = {}
    for s in _small(man, table):
        by.setdefault((_tier(s["rows"]), s["file"] in tracked), []).append(s)
    return [segs[:MERGE_AT] for segs in by.values() if len(segs) >= MERGE_AT]


def _merge(d: Path, man: store.Manifest, table: str, small: list) -> tuple:
    """Merge segments ``small`` of ``table`` into one (by step for the per-step tables); its
    manifest entry and the steps it holds (a per-step table's; else None)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    segs = man.segments(table)
    schema = arrow_schema(table)  # a segment DuckDB wrote has its columns NOT NULL where they happen to be
    parts = []
    for s in small:
        t = store.read_segment(d, s["file"], schema)
        if s.get("skip"):  # steps computed again since: their rows are in a later segment
            t = t.filter(pc.invert(pc.is_in(t["step"], value_set=pa.array(s["skip"], pa.int64()))))
        parts.append(t)
    t = pa.concat_tables(parts)
    steps = None
    if table in STEP_TABLES:
        t = t.sort_by("step")
        steps = set(pc.unique(t["step"]).to_pylist())
    entry = store.write_arrow(d, f"{table}-{man.gen}-m{len(segs)}.parquet", t)
    if table in STEP_TABLES:
        entry["lo"] = min(s["lo"] for s in small)
        entry["hi"] = max(s["hi"] for s in small)
    man.tables[table] = [s for s in segs if s not in small] + [entry]
    man.garbage += [s["file"] for s in small]
    return entry, steps
