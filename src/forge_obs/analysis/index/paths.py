"""Which steps an update computes (again), and the span graph each batch of them is computed on.

A stored step is replaced when the update brought rows that could change it: rows that start
before its end (less :data:`~.steps.MARGIN_US`), or it was unfinished (it ends at the end of the
data, which moved), or the spans still open changed; every stored step that starts at or after
the first replaced one is replaced with it. Steps are computed in batches of about
:data:`BATCH_SPANS` spans, each on the graph of the spans that end after the batch's first step
began (with the closure of :func:`closure`) and start before its end: the memory an update needs
is a batch's, whatever the run's length.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.index import store
from forge_obs.analysis.index.build import write_rows
from forge_obs.analysis.index.schema import STEP_TABLES
from forge_obs.analysis.index.steps import MARGIN_US, StepSet, graph_from, streams_of, step_rows
from forge_obs.analysis.index.views import STEP_INPUTS, connect, create_views
from forge_obs.analysis.index.workers import forked

__all__ = ["compute_steps", "compute_live", "closure", "sessions_of", "BATCH_SPANS"]

#: about how many spans one batch of steps is computed on
BATCH_SPANS = 600_000
_NEVER = 1 << 62

_SPAN_T = "FROM _spans x JOIN _streams s ON s.sid = x.sid"
#: ``x.end + s.offset_us >= ?`` with a first test on the stored column (``_lo_end``: the bound
#: less the largest offset), which the row groups' min/max can answer without reading them
_ENDS_AFTER = "x.end >= getvariable('off_hi_neg') + ? AND x.end + s.offset_us >= ?"


def closure(con: Any, lo: int) -> int:
    """The earliest time the graph of the spans ending after ``lo`` must reach back to: the
    start of every span that contains one of them (and of theirs), and of every span still open
    that an endpoint call opened, and the time of the endpoint calls that opened them. (The graph
    holds every open span whatever ``lo``; one no call opened needs nothing before ``lo``.)"""
    op = con.execute("SELECT min(x.start + s.offset_us) FROM _opens x JOIN _streams s ON s.sid = x.sid "
                     "WHERE x.link IS NOT NULL").fetchone()[0]
    if op is not None:
        lo = min(lo, op)
    while True:
        a = con.execute(f"SELECT min(x.start + s.offset_us) {_SPAN_T} WHERE {_ENDS_AFTER} "
                        "AND x.start + s.offset_us < ?", [lo, lo, lo]).fetchone()[0]
        b = con.execute(f"SELECT min(e.ts + s.offset_us) FROM _events e JOIN _streams s ON s.sid = e.sid "
                        f"WHERE e.name = 'call' AND e.ts + s.offset_us < ? AND e.link IN "
                        f"(SELECT x.link {_SPAN_T} WHERE x.link IS NOT NULL AND {_ENDS_AFTER})",
                        [lo, lo, lo]).fetchone()[0]
        new = min([v for v in (a, b) if v is not None], default=lo)
        if new >= lo:
            return lo
        lo = new


def _state(con: Any, man: store.Manifest) -> tuple:
    end = con.execute("SELECT max(last_ts + offset_us), min(first_ts + offset_us), "
                      f"(SELECT count(*) FROM _spans) FROM _streams").fetchone()
    return end[0] or 0, end[1] or 0, end[2] or 0


def compute_steps(d: Path, man: store.Manifest, lo_raw: "int | None", offsets: dict) -> None:
    """Compute the steps the update may have changed (all of them when none is stored yet or
    a clock offset changed) and store their rows in place of the old ones."""
    con = connect()
    create_views(con, d, man, STEP_INPUTS)
    st = man.state.setdefault("path", {})
    okey = json.dumps(sorted(offsets.items()))
    opens = con.execute("SELECT x.sid, x.lane, x.name, x.start + s.offset_us FROM _opens x "
                        "JOIN _streams s ON s.sid = x.sid").fetchall()
    if not man.tables.get("steps") or st.get("offsets") != okey:
        bound = -_NEVER
    else:
        shift = min([0, *offsets.values()])
        lo = min([v for v in (None if lo_raw is None else lo_raw + shift, opens_moved(st, opens))
                  if v is not None], default=None)
        rows = con.execute("SELECT start_us FROM _steps WHERE unfinished OR end_us >= ?",
                           [_NEVER if lo is None else lo - MARGIN_US]).fetchall()
        starts = [r[0] for r in rows] + ([lo] if lo is not None else [])
        if not starts:
            return
        bound = min(starts)
    try:
        _compute(con, d, man, bound)
    except _Clash:  # a step number met again (a resumed attempt): every step is computed again
        con = connect()
        create_views(con, d, man, STEP_INPUTS)
        _compute(con, d, man, -_NEVER)
    st["offsets"], st["opens"] = okey, sorted(map(list, opens))
    st.pop("opens_lo", None)


def opens_moved(st: dict, opens: list) -> "int | None":
    """The earliest start among the spans that opened or closed since the update that stored
    ``st`` (``opens``: the open spans' sid, lane, name and corrected start, now). A span that
    stays open changes no step that ended meanwhile (it is open, and on a path, alike), so only
    the steps since one that opened or closed are computed again; a span that closed is among
    the update's new rows too."""
    was = {tuple(k) for k in st.get("opens") or ()}
    moved = was.symmetric_difference(tuple(k) for k in opens)
    return min((k[3] for k in moved), default=None)


def compute_live(d: Path, man: store.Manifest, lo_raw: "int | None", offsets: dict, win: Any, opens: list) -> bool:
    """:func:`compute_steps` on the rows of the live indexer's window (:class:`~.window.Window`;
    ``opens``: the open spans' rows, in order): the steps the update may have changed are marked
    computed again in the segments that hold them and computed from the window's rows. False
    (nothing changed) when the update needs the index: the caller computes the steps with
    :func:`compute_steps`."""
    st = man.state.setdefault("path", {})
    okey = json.dumps(sorted(offsets.items()))
    if not win.ready or not (man.tables.get("steps") or win.whole()) or st.get("offsets") != okey:
        return False
    keys = [(r[0], r[1], r[2], r[4]) for r in opens]
    shift = min([0, *offsets.values()])
    lo = min([v for v in (None if lo_raw is None else lo_raw + shift, opens_moved(st, keys))
              if v is not None], default=None)
    if lo is not None and lo - MARGIN_US <= win.pruned_end:
        return False  # a step the window no longer holds may change
    starts = [v[0] for v in win.steps.values() if v[2] or (lo is not None and v[1] >= lo - MARGIN_US)]
    starts += [lo] if lo is not None else []
    if not starts:
        return True
    before, garbage = {t: list(man.segments(t)) for t in STEP_TABLES}, list(man.garbage)
    try:
        _live_batch(d, man, min(starts), offsets, win, opens)
    except (_Clash, _NeedIndex):  # nothing of it is kept (the window is read again)
        made = {seg["file"] for t in STEP_TABLES for seg in man.segments(t)} - {seg["file"] for t in STEP_TABLES
                                                                               for seg in before[t]}
        for t in STEP_TABLES:
            man.tables[t] = before[t]
        man.garbage = garbage + sorted(made)
        return False
    st["offsets"], st["opens"] = okey, sorted(map(list, keys))
    st.pop("opens_lo", None)
    return True


class _NeedIndex(Exception):
    """The live indexer's window does not hold what an update needs (see :mod:`.window`)."""


def _live_batch(d: Path, man: store.Manifest, bound: int, offsets: dict, win: Any, opens: list) -> list:
    """Mark the stored steps that start at or after ``bound`` as computed again in the segments
    the window wrote them in (a segment left without a step is dropped) and compute them, and the
    steps after them, from the window's rows; the steps stored."""
    hits = win.take(bound)
    if hits is None:
        raise _NeedIndex()
    gone = sorted(set().union(*hits.values())) if hits else []
    dead = set()
    for t in STEP_TABLES:
        keep = []
        for seg in man.segments(t):
            hit = hits.get(seg["file"])
            if hit:
                seg = dict(seg, skip=sorted(set(seg.get("skip", ())) | hit))
                if set(seg["skip"]) >= win.segs[seg["file"]]:
                    dead.add(seg["file"])
                    continue
            keep.append(seg)
        man.tables[t] = keep
    man.garbage += sorted(dead)
    streams = man.state.get("streams", [])
    end = max((s["last_ts"] + offsets.get(s["header"].get("host", "?"), 0) for s in streams
               if s["last_ts"] is not None), default=0)
    first = min((s["first_ts"] + offsets.get(s["header"].get("host", "?"), 0) for s in streams
                 if s["first_ts"] is not None), default=0)
    run, by_sid = sessions_of(d.parent, man, win.lanes, offsets)
    src = _WindowRows(win, run, by_sid, opens, end)
    lo = max(bound, first)
    written: list = []
    done = _compute_part(src, d, man, (lo, _NEVER), end, max(end - lo + 1, 1), "", win.numbers - set(gone),
                         one_group=True, written=written)
    win.dropped(gone, dead)
    win.stored(done)
    for files, numbers in written:
        win.batch(files, numbers)
    return [n for n, *_r in done]


class _WindowRows:
    """The rows of the live indexer's window as :class:`_Rows` gives them."""

    def __init__(self, win: Any, run: Any, by_sid: dict, opens: list, end: int) -> None:
        self.win, self.run, self.by_sid, self.opens, self.end = win, run, by_sid, opens, end
        self.opens_lo = min((r[4] for r in opens if r[8] is not None), default=None)  # linked: see closure()

    def closure(self, lo: int) -> int:
        got = self.win.closure(lo, self.opens_lo)
        if got is None:
            raise _NeedIndex()
        return got

    def graph(self, lo: int, hi: int) -> Any:
        return self.win.graph(self.run, self.by_sid, self.opens, lo, hi, self.end)


class _Clash(Exception):
    """A step computed again has the number of a stored step it does not replace: the steps
    of a resumed attempt that repeats step numbers (the graph's windows are per step number,
    over every attempt), computed with the steps they share a number with."""


def _compute(con: Any, d: Path, man: store.Manifest, bound: int) -> None:
    _drop(con, d, man, bound)
    create_views(con, d, man, ("steps",))  # without the dropped segments
    stored = {r[0] for r in con.execute("SELECT step FROM _steps").fetchall()} if bound > -_NEVER else set()
    end, first, n_spans = _state(con, man)
    parts = _parts(con, max(bound, first), end, n_spans)
    if len(parts) == 1:
        _batches(d, man, parts[0], end, n_spans, con=con, clash=stored)
    else:
        con.close()  # no DuckDB open across the fork
        _in_workers(d, man, parts, end, n_spans, stored)


#: steps are computed in this many worker processes when there are at least WORKER_SPANS spans
#: per worker to compute them on (one process below that, or on one core)
WORKERS = 2
WORKER_SPANS = 400_000


def _parts(con: Any, lo: int, end: int, n_spans: int) -> list:
    """``[(lo, hi), ...]``: the time ranges whose steps each worker computes (a step belongs to
    the range its start is in), of about as many spans each."""
    todo = con.execute(f"SELECT count(*) {_SPAN_T} WHERE {_ENDS_AFTER}", [lo, lo]).fetchone()[0]
    k = min(WORKERS, os.cpu_count() or 1, max(todo // WORKER_SPANS, 1))
    if k <= 1:
        return [(lo, _NEVER)]
    qs = con.execute(f"SELECT quantile_disc(x.start + s.offset_us, ?::DOUBLE[]) {_SPAN_T} "
                     "WHERE x.start + s.offset_us >= ?", [[i / k for i in range(1, k)], lo]).fetchone()[0]
    cuts = [lo, *qs, _NEVER]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _in_workers(d: Path, man: store.Manifest, parts: list, end: int, n_spans: int, clash: set) -> None:
    """:func:`_batches` of each part at once (:func:`~.workers.forked`: each with its own
    DuckDB); their segments are added to ``man``. No DuckDB connection is open here."""
    before = {t: list(man.segments(t)) for t in STEP_TABLES}

    def part(i: int) -> Any:
        def job() -> dict:
            for t in STEP_TABLES:
                man.tables[t] = []
            _batches(d, man, parts[i], end, n_spans, tag=f"w{i}-", clash=clash)
            return {t: man.tables[t] for t in STEP_TABLES}
        return job

    try:
        out = forked([part(i) for i in range(len(parts))], passthrough=(_Clash,))
    except _Clash:
        made = [seg["file"] for t in STEP_TABLES for seg in man.tables[t] if seg not in before[t]]
        for t in STEP_TABLES:
            man.tables[t] = before[t]
        man.garbage += made
        raise
    for t in STEP_TABLES:
        man.tables[t] = before[t] + [seg for res in out for seg in res[t]]


def _drop(con: Any, d: Path, man: store.Manifest, bound: int) -> None:
    """Remove the stored steps that start at or after ``bound`` from every per-step table."""
    gone = [r[0] for r in con.execute("SELECT step FROM _steps WHERE start_us >= ?", [bound]).fetchall()]
    if not gone:
        return
    lo, hi = min(gone), max(gone)
    con.execute("CREATE TEMP TABLE _gone AS SELECT unnest(?::BIGINT[]) AS step", [gone])
    for table in STEP_TABLES:
        keep = []
        for seg in man.segments(table):
            if seg["hi"] < lo or seg["lo"] > hi:
                keep.append(seg)
                continue
            man.garbage.append(seg["file"])
            f = str(d / seg["file"]).replace("'", "''")
            cond = "step NOT IN (SELECT step FROM _gone)" + "".join(f" AND step <> {k}" for k in seg.get("skip", ()))
            n = con.execute(f"SELECT count(*) FROM read_parquet('{f}') WHERE {cond}").fetchone()[0]
            if n:
                name = f"{table}-{man.gen}-k{len(keep)}-{seg['lo']}.parquet"
                con.execute(f"COPY (SELECT * FROM read_parquet('{f}') WHERE {cond}) "
                            f"TO '{d / ('.' + name + '.tmp')}' (FORMAT parquet, COMPRESSION zstd)")
                (d / f".{name}.tmp").replace(d / name)
                lo_hi = con.execute(f"SELECT min(step), max(step) FROM read_parquet('{d / name}')").fetchone()
                keep.append({"file": name, "rows": n, "lo": lo_hi[0], "hi": lo_hi[1]})
        man.tables[table] = keep


def _batches(d: Path, man: store.Manifest, part: tuple, end: int, n_spans: int, tag: str = "",
             con: Any = None, clash: "set | None" = None) -> None:
    """Compute and store every step that starts in ``part`` (``[lo, hi)``), a batch at a time."""
    if con is None:  # a worker's: one thread (the workers use every core between them)
        con = connect()
        con.execute("SET threads = 1")
        create_views(con, d, man, STEP_INPUTS)
    first = con.execute("SELECT min(first_ts + offset_us) FROM _streams").fetchone()[0] or 0
    width = max(int((end - first) * BATCH_SPANS / max(n_spans, 1)), 1)
    _compute_part(_Rows(con, d, man, end), d, man, part, end, width, tag, clash)


def _compute_part(src: Any, d: Path, man: store.Manifest, part: tuple, end: int, width: int, tag: str,
                  clash: "set | None", one_group: bool = False, written: "list | None" = None) -> list:
    """:func:`_batches` on the rows of ``src`` (:class:`_Rows`: the index; or the live indexer's
    window). A batch's steps are stored in two segments, the finished ones and the unfinished
    ones (``one_group``: in one); ``written`` gets each segment's files and steps. The stored
    steps as ``[(step, start, end, unfinished)]``."""
    lo, stop = part
    done_steps: set = set()
    out: list = []
    while lo < stop and lo <= end:
        sel_hi, load_hi = min(lo + width, stop), lo + width
        last = load_hi >= end
        g = src.graph(src.closure(lo - MARGIN_US), load_hi + MARGIN_US)
        cand = [w for w in g.windows if lo <= w.start < sel_hi and w.step not in done_steps]
        kept = [w for w in cand if last or w.end + MARGIN_US <= load_hi]
        rest = [w.start for w in cand if not (last or w.end + MARGIN_US <= load_hi)]
        if clash and any(w.step in clash for w in cand):
            raise _Clash()
        # an unfinished step is computed again at the next update: in a segment of its own, it
        # is dropped whole then (the finished ones' segment stays as it is)
        groups = [kept] if one_group else [[w for w in kept if not w.unfinished], [w for w in kept if w.unfinished]]
        for ws in groups:
            rows = step_rows(g, ws)
            files = _store(d, man, rows, tag)
            out += [(r[0], r[2], r[3], r[5]) for r in rows.cols["steps"]]
            if written is not None and files:
                written.append((files, [r[0] for r in rows.cols["steps"]]))
        done_steps.update(w.step for w in kept)
        g.release()
        if rest and not kept:
            width *= 2  # a step longer than the batch: a wider one
            continue
        lo = min(rest) if rest else sel_hi
    return out


def _store(d: Path, man: store.Manifest, rows: StepSet, tag: str = "") -> set:
    """The segments of ``rows`` written (their files)."""
    steps = [r[0] for r in rows.cols["steps"]]
    if not steps:
        return set()
    before = {t: len(man.segments(t)) for t in STEP_TABLES}
    write_rows(d, man, rows.cols, tag=tag)
    files = set()
    for table in STEP_TABLES:
        for seg in man.segments(table)[before[table]:]:
            seg["lo"], seg["hi"] = min(steps), max(steps)
            files.add(seg["file"])
    return files


def sessions_of(run_dir: Path, man: store.Manifest, lanes: dict, offsets: dict) -> tuple:
    """``(run, by_sid)``: the manifest's sessions as streams (:func:`.steps.streams_of`) and a
    :class:`~forge_obs.analysis.reader.Run` of them (``offsets``: host -> µs)."""
    attempts = sorted(man.state.get("starts", []))
    by_sid = streams_of(man.state.get("streams", []), lanes, offsets, attempts)
    return reader.Run(run_dir, {s.key: s for s in by_sid.values()}, [], offsets, attempts), by_sid


class _Rows:
    """The rows every batch's graph is made of, read from the index (the sessions as streams, the
    reading order of the files)."""

    def __init__(self, con: Any, d: Path, man: store.Manifest, end: int) -> None:
        self.con, self.end = con, end
        offsets = dict(con.execute("SELECT host, offset_us FROM _streams").fetchall())
        lanes: dict = {}
        for sid, lane, label in con.execute("SELECT sid, lane, label FROM _lane_labels").fetchall():
            lanes.setdefault(sid, {})[lane] = label
        self.run, self.by_sid = sessions_of(d.parent, man, lanes, offsets)

    def closure(self, lo: int) -> int:
        return closure(self.con, lo)

    def graph(self, lo: int, hi: int) -> Any:
        sel = "x.sid, x.lane, x.name, x.step, x.start + s.offset_us, {dur}, x.flow, x.flow_t, x.link"
        far = self.con.execute(f"SELECT max(x.end + s.offset_us) {_SPAN_T} WHERE x.start + s.offset_us <= ? "
                               f"AND {_ENDS_AFTER}", [hi, hi, hi + 1]).fetchone()[0]
        hi = max(hi, far or hi)  # the spans inside those that reach past hi (their waits)
        spans = self.con.execute(f"SELECT {sel.format(dur='x.dur')} {_SPAN_T} JOIN _frank f ON f.fid = x.fid "
                                 f"WHERE {_ENDS_AFTER} AND x.start + s.offset_us <= ? ORDER BY f.rnk, x.off",
                                 [lo, lo, hi]).fetchall()
        opens = self.con.execute(f"SELECT {sel.format(dur='0')} FROM _opens x JOIN _streams s ON s.sid = x.sid "
                                 "LEFT JOIN _frank f ON f.fid = x.fid ORDER BY f.rnk, x.off").fetchall()
        ev = "FROM _events e JOIN _streams s ON s.sid = e.sid JOIN _frank f ON f.fid = e.fid"
        steps = self.con.execute(f"SELECT e.sid, e.step, e.ts + s.offset_us {ev} WHERE e.kind = 'step' "
                                 "AND e.ts + s.offset_us BETWEEN ? AND ? ORDER BY f.rnk, e.off", [lo, hi]).fetchall()
        calls = {link: (sid, lane, ts) for link, sid, lane, ts in self.con.execute(
            f"SELECT e.link, e.sid, e.lane, e.ts + s.offset_us {ev} WHERE e.name = 'call' AND e.kind = 'event' "
            "AND e.link IS NOT NULL AND e.ts + s.offset_us BETWEEN ? AND ? ORDER BY f.rnk, e.off", [lo, hi]).fetchall()}
        return graph_from(self.run, self.by_sid, spans, opens, calls, steps, self.end)

