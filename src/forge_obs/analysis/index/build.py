"""One update of a run's index: the bytes appended to its files since the last update become
new segments; a file that shrank or was replaced makes the update a rebuild.

What is remembered per source file (in the manifest's ``state``): its identity (inode, first
line), the byte offset after its last complete line (a torn last line is read once complete),
and the reader's state there (:class:`forge_obs.analysis.reader.Cursor`: names, session); per
process session (:class:`~forge_obs.analysis.reader.Stream`): its header, counts, the spans it
began and has not ended. A resumed job's new files are new sessions (``attempt`` tells them
apart); a TorchTitan file that changed is read again whole (its segments are replaced).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader, titan_logs
from forge_obs.analysis.index import store
from forge_obs.analysis.index.rows import Columns, TimelineRows, dims_of, extras_of, metric_rows
from forge_obs.analysis.index.workers import forked
from forge_obs.analysis.jsonl_reader import BLANK, NOT_JSON, NOT_PARSED, parse_line
from forge_obs.analysis.store import metric_row_problem

__all__ = ["Update", "APPEND_TABLES", "write_rows", "session_rows"]

logger = logging.getLogger("forge_obs")

#: rows held before they are written as segments (a large file is indexed in parts)
FLUSH_ROWS = 1_000_000
#: tables that grow by a segment per update
APPEND_TABLES = ("spans", "events", "lanes", "metrics", "metric_rows", "cells")


def _identity(path: Path) -> tuple:
    """(inode, digest of the first line): a file replaced by another has another."""
    st = path.stat()
    with open(path, "rb") as f:
        head = f.readline(4096)
    return st.st_ino, hashlib.sha1(head).hexdigest()[:16], st.st_size, st.st_mtime_ns


class Update:
    """Read what is new into ``cols`` (the rows to append) and the manifest's state."""

    def __init__(self, run_dir: Path, man: store.Manifest) -> None:
        self.run_dir = Path(run_dir)
        self.man = man
        st = man.state
        self.files: dict = st.setdefault("files", {})
        self.run = reader.Run(self.run_dir, {}, [], {}, [], controller_host=st.get("ctl_host"))
        self.run.samples = dict(st.get("samples", {}))
        self.run.starts = set(st.get("starts", []))
        self.sid_of: dict = {}
        self.sessions: list = st.setdefault("streams", [])
        for s in self.sessions:
            self._restore(s)
        self.next_sid = max(self.sid_of.values(), default=-1) + 1
        self.tag = ""  # in the names of the segments this update writes (a worker's own)
        self.flushed = False  # rows were written before the update's end (a large update)
        self.read_keys: set = set()  # the sessions whose records were read
        self.cols = Columns("spans", "events", "lanes", "metrics", "metric_rows")
        self.titan: dict[int, Columns] = {}  # fid -> rows of a TorchTitan file read again whole
        self.rebuild = False
        self.changed = False
        self.lo: int | None = None  # the earliest raw time of a new timeline row

    # ------------------------------------------------------------------ state
    def _restore(self, s: dict) -> None:
        h = s["header"]
        st = reader.Stream(key=tuple(s["key"]), header=h, actor=s["actor"], first_ts=s["first_ts"],
                           last_ts=s["last_ts"], clean=s["clean"], records=s["records"], dropped=s["dropped"],
                           clock=s.get("clock"))
        st.opens = {int(k): tuple(v) for k, v in s["opens"].items()}
        self.run.streams[st.key] = st
        self.sid_of[st.key] = s["sid"]

    def _sid(self, key: tuple) -> int:
        """The session number of stream ``key`` (the next free one for a new session)."""
        sid = self.sid_of.get(key)
        if sid is None:
            sid = self.sid_of[key] = self.next_sid
            self.next_sid += 1
        return sid

    @staticmethod
    def _state(sid: int, key: tuple, st: reader.Stream) -> dict:
        return {"sid": sid, "key": list(key), "header": st.header, "actor": st.actor, "first_ts": st.first_ts,
                "last_ts": st.last_ts, "clean": st.clean, "records": st.records, "dropped": st.dropped,
                "clock": st.clock, "opens": {str(k): list(v) for k, v in st.opens.items()}}

    def _save_streams(self) -> None:
        out = [self._state(self._sid(key), key, st) for key, st in self.run.streams.items()]
        out.sort(key=lambda s: s["sid"])
        if self.run.malformed:
            st = self.man.state
            st["first_malformed"] = st.get("first_malformed") or self.run.first_malformed
            st["malformed"] = st.get("malformed", 0) + self.run.malformed
            self.run.malformed = 0
        self.man.state["streams"] = self.sessions = out
        self.man.state["samples"] = self.run.samples
        self.man.state["starts"] = sorted(self.run.starts)
        self.man.state["ctl_host"] = self.run.controller_host

    # ------------------------------------------------------------------ the timeline
    def read_timeline(self, flush: Any = None) -> None:
        """Every event file's new complete lines, in reading order (TorchTitan files read again
        when changed); ``flush(update)`` is called whenever the rows held grow large."""
        todo = []
        for path, titan in [(p, False) for p in reader.event_files(self.run_dir)] + \
                [(p, True) for p in titan_logs.titan_files(self.run_dir)]:
            f = self._check(path, titan)
            if self.rebuild:
                return
            if f is not None:
                todo.append((f, path))
        todo.sort(key=lambda t: t[0]["order"])
        parts = _split(todo) if flush is not None else [todo]
        if len(parts) == 1:
            for f, path in todo:
                self._read_file(path, f, flush)
        else:
            self._read_parts(parts, flush)
        self._save_streams()

    def _check(self, path: Path, titan: bool) -> "dict | None":
        """The state of ``path`` when it has lines to read (None: nothing new)."""
        rel = os.path.relpath(path, self.run_dir)
        try:
            ident = _identity(path)
        except OSError:
            return None
        f = self.files.get(rel)
        if f is None:
            f = self._new_file(rel, path, ident, titan)
            if f is None:
                return None
        elif titan and (f["size"], f["mtime"]) != ident[2:]:
            self._reset_titan(f, ident)
        elif not titan and ((f["ino"], f["head"]) != ident[:2] or ident[2] < f["offset"]):
            self.rebuild = True
            return None
        if (not titan and f["offset"] < ident[2]) or (titan and f["offset"] == 0):
            return f
        return None

    def _new_file(self, rel: str, path: Path, ident: tuple, titan: bool) -> "dict | None":
        h = titan_logs.header_of(path, self.run_dir.name) if titan else reader.first_header(path)
        if h is None:
            return None  # not a timeline file (yet: its header is not complete)
        if h.get("ctl") and self.run.controller_host is None:
            self.run.controller_host = h.get("host")
        f = self.files[rel] = {"fid": len(self.files), "ino": ident[0], "head": ident[1], "size": ident[2],
                               "mtime": ident[3], "offset": 0, "names": {}, "key": None, "base": 0, "host": None,
                               "titan": titan, "order": list(reader.file_order(h, path))}
        return f

    def _reset_titan(self, f: dict, ident: tuple) -> None:
        f.update(offset=0, names={}, key=None, size=ident[2], mtime=ident[3])
        for segs in self.man.tables.values():
            self.man.garbage += [s["file"] for s in segs if s.get("src") == f["fid"]]
            segs[:] = [s for s in segs if s.get("src") != f["fid"]]
        for st in self.run.streams.values():
            if st.key[2] == Path(f["order"][-1]).name:
                st.opens, st.records, st.first_ts, st.last_ts = {}, 0, None, None

    def _read_file(self, path: Path, f: dict, flush: Any) -> None:
        cur = reader.Cursor(path, f["offset"], {int(k): v for k, v in f["names"].items()},
                            tuple(f["key"]) if f["key"] else None, f["base"], 0, f["host"])
        fid, titan = f["fid"], f["titan"]
        cols = self.titan.setdefault(fid, Columns("spans", "events", "lanes")) if titan else self.cols
        rows = TimelineRows(cols, self.sid_of)
        touched: list = []
        sid_of = self.sid_of
        spans, events = cols["spans"], cols["events"]
        n = 0
        add = rows.add
        for it in reader.read_from(self.run, cur, touched):
            if it[1].key not in sid_of:
                self._sid(it[1].key)
            add(it, fid, cur.line_off)
            n += 1
            if n & 4095 == 0 and flush is not None and not titan and len(spans) + len(events) >= FLUSH_ROWS:
                flush(self)
        for key in dict.fromkeys(touched + ([cur.key] if cur.key is not None else [])):
            self._sid(key)
            rows.lanes(self.run.streams[key])
            self.read_keys.add(key)
        f.update(offset=cur.offset, names={str(k): v for k, v in cur.names.items()},
                 key=list(cur.key) if cur.key else None, base=cur.base, host=cur.host)
        if rows.lo is not None:
            self.lo = rows.lo if self.lo is None else min(self.lo, rows.lo)
        self.changed = True

    def _read_parts(self, parts: list, flush: Any) -> None:
        """The files of each part read at once (:func:`~.workers.forked`), each part's segments
        written by its process (named with its tag); then their states merged here. A part's new
        sessions are numbered from a base of its own, above the previous part's: their order is
        the order of a read in one process."""
        base = self.next_sid

        def part(i: int) -> Any:
            def job() -> dict:
                self.tag, self.next_sid, self.read_keys = f"p{i}-", base + (i << 20), set()
                before = {t: len(segs) for t, segs in self.man.tables.items()}
                for f, path in parts[i]:
                    self._read_file(path, f, flush)
                flush(self)
                return self._part_state(parts[i], before)
            return job

        for res in forked([part(i) for i in range(len(parts))]):
            self._merge_part(res)
        self.tag = ""

    def _part_state(self, files: list, before: dict) -> dict:
        """What a part read: its files' states, its sessions', the run-wide facts, its segments."""
        run = self.run
        fids = {f["fid"] for f, _p in files}
        bad, run.malformed, run.first_malformed = [run.malformed, run.first_malformed], 0, ""  # counted at the merge
        return {"files": {rel: f for rel, f in self.files.items() if f["fid"] in fids},
                "streams": [self._state(self.sid_of[k], k, run.streams[k]) for k in self.read_keys],
                "samples": run.samples, "starts": sorted(run.starts), "malformed": bad,
                "lo": self.lo, "segments": {t: segs[before.get(t, 0):] for t, segs in self.man.tables.items()}}

    def _merge_part(self, res: dict) -> None:
        self.files.update(res["files"])
        for s in res["streams"]:
            self._restore(s)
        self.next_sid = max(self.sid_of.values(), default=-1) + 1
        for host, d in res["samples"].items():
            self.run.samples[host] = min(d, self.run.samples.get(host, d))
        self.run.starts.update(res["starts"])
        n, first = res["malformed"]
        if n and not self.run.malformed:
            self.run.first_malformed = first
        self.run.malformed += n
        if res["lo"] is not None:
            self.lo = res["lo"] if self.lo is None else min(self.lo, res["lo"])
        for t, segs in res["segments"].items():
            have = {s["file"] for s in self.man.segments(t)}
            self.man.segments(t).extend(s for s in segs if s["file"] not in have)
        self.changed = True

    # ------------------------------------------------------------------ metrics.jsonl
    def read_metrics(self) -> None:
        """``metrics.jsonl``'s new complete rows (a file that shrank or was replaced: rebuild)."""
        path = self.run_dir / "metrics.jsonl"
        try:
            ident = _identity(path)
        except OSError:
            return
        m = self.man.state.setdefault("metrics", {"ino": ident[0], "head": ident[1], "offset": 0})
        if (m["ino"], m["head"]) != ident[:2] or ident[2] < m["offset"]:
            self.rebuild = True
            return
        if ident[2] <= m["offset"]:
            return
        bad = [0, ""]
        with open(path, "rb") as fh:
            fh.seek(m["offset"])
            data = fh.read(ident[2] - m["offset"])
        end = data.rfind(b"\n") + 1
        off = m["offset"]
        for line in data[:end].splitlines(keepends=True):
            row = _metric_row(line, bad)
            if row is not None:
                metric_rows(self.cols, row, off)
            off += len(line)
        m["offset"] = off
        self.changed = True
        if bad[0]:
            m["first_malformed"] = m.get("first_malformed") or bad[1]
            m["malformed"] = m.get("malformed", 0) + bad[0]

def session_rows(state: dict) -> Columns:
    """The ``streams`` and ``opens`` tables (the process sessions, the spans begun and not ended)
    as the manifest's ``state`` has them: not stored as segments, every reader makes them from
    the manifest it reads."""
    cols = Columns("streams", "opens")
    offsets, attempts = state.get("offsets", {}), sorted(state.get("starts", []))
    last_fid = {tuple(f["key"]): f["fid"] for f in state.get("files", {}).values() if f["key"]}
    for s in state.get("streams", []):
        h, sid, key = s["header"], s["sid"], tuple(s["key"])
        host, start = h.get("host", "?"), h.get("start")
        cols.add("streams", (sid, h.get("run"), attempts.index(start) if start in attempts else 0, host,
                             int(h.get("pid", 0)), h.get("session"), h.get("mesh", "?"), s["actor"], int(h.get("rank", 0)),
                             bool(h.get("ctl")), offsets.get(host, 0), s["first_ts"], s["last_ts"], s["clean"],
                             s["records"], s["dropped"], float(start) if isinstance(start, (int, float)) else None,
                             *dims_of(h.get("coords"))))
        for n, (lane, name, step, ts, ex) in enumerate(s["opens"].values()):
            _e, flow, ft, attrs, link, _c = extras_of(ex)
            cols.add("opens", (sid, s["actor"], lane, name, step, ts, flow, ft, attrs, link, last_fid.get(key, 0), n))
    return cols


#: a timeline update that reads at least this many bytes reads its files in WORKERS processes
PARALLEL_BYTES = 16 << 20
WORKERS = 2


def _split(todo: list) -> list:
    """``todo`` (``(file state, path)`` in reading order) in contiguous parts of about as many
    bytes to read, one per worker, cut only between processes (a process's files, its later
    sessions appended to them included, stay in one part); one part when the update is small,
    on one core, or reads a TorchTitan file (read whole, in this process)."""
    size = [max(p.stat().st_size - f["offset"], 0) if not f["titan"] else 0 for f, p in todo]
    k = min(WORKERS, os.cpu_count() or 1)
    if k < 2 or sum(size) < PARALLEL_BYTES or any(f["titan"] for f, _p in todo):
        return [todo]
    parts, cur, acc, total = [], [], 0, sum(size)
    for i, (item, n) in enumerate(zip(todo, size)):
        if cur and acc >= total * len(parts + [cur]) / k and item[0]["order"][:2] != todo[i - 1][0]["order"][:2]:
            parts.append(cur)
            cur = []
        cur.append(item)
        acc += n
    parts.append(cur)
    return parts


def _metric_row(line: bytes, bad: list) -> "dict | None":
    """A well-formed row of ``metrics.jsonl``, or None (counted in ``bad`` unless blank)."""
    v = parse_line(line)
    if v is BLANK:
        return None
    why = NOT_JSON if v is NOT_PARSED else (f"a JSON {type(v).__name__}, not a JSON object" if type(v) is not dict
                                            else metric_row_problem(v))
    if why is None:
        return v
    bad[0] += 1
    bad[1] = bad[1] or why
    return None


def write_rows(d: Path, man: store.Manifest, cols: Columns, src: "int | None" = None, tag: str = "") -> None:
    """A segment per table of ``cols`` that has rows (``src``: the TorchTitan file they come from;
    ``tag``: the worker that writes them, in their names)."""
    from forge_obs.analysis.index.cells import span_cells

    for table in cols:
        if not cols.rows(table):
            continue
        t = cols.table(table)
        _append(d, man, table, t, src, tag)
        if table == "spans":  # the doctor's per-step evidence of these spans, beside them
            _append(d, man, "cells", span_cells(t), src, tag)


def _append(d: Path, man: store.Manifest, table: str, t: Any, src: "int | None", tag: str) -> None:
    segs = man.segments(table)
    num = f"{tag}{len(segs) + (0 if src is None else 1000 * (src + 1))}"
    entry = store.write_arrow(d, f"{table}-{man.gen}-{num}.parquet", t)
    if src is not None:
        entry["src"] = src
    segs.append(entry)

