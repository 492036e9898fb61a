"""Read ``runs/<run_id>/events/*.jsonl`` back, streaming, as normalised items.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)                # a standalone script records its timeline
    True
    >>> timeline.set_step(1)
    >>> with timeline.record_span("train_step"):
    ...     pass
    >>> timeline.close()
    >>> run = scan(run_dir)                       # headers, clock offsets, attempts (cheap pass)
    >>> [(item[3], item[4]) for item in walk(run) if item[0] is SPAN]   # one pass over every record
    [('train_step', 1)]

Items (times are epoch µs, corrected by the host's clock offset against the controller)::

    (SPAN,    stream, lane, name, step, start, dur, extras, cpu_us)
                                                                a finished span (``extras["x"] ==
                                                                 "shutdown"``: cut short by a clean
                                                                 close, ``dur`` up to the close);
                                                                 ``cpu_us``: its thread's CPU time
                                                                 (µs, ≤ ``dur``), None when the span
                                                                 did not read it
    (OPEN,    stream, lane, name, step, start, extras)          a span that never ended (yielded
                                                                 when the stream ends)
    (INSTANT, stream, lane, name, step, ts, extras)
    (STEP,    stream, lane, step, ts)
    (TAG,     stream, lane, step, tag, ts)
    (END,     stream)                                           after the stream's last record

``stream`` is a :class:`Stream` (one process session: identity, lanes, first/last timestamp,
whether it closed cleanly). Only well-formed records are yielded: a torn last line is skipped
silently; any other line that is not valid UTF-8 / JSON, or a record of the wrong shape or types
(``123``, ``null``, a short record, a string where a number belongs, a header with a bad field) is
skipped and counted in ``Run.malformed``, with one warning per :func:`walk`.

Reading is resumable: a :class:`Cursor` holds one file's position (the byte offset after its
last complete line) and what its records define (names, the current session), and
:func:`read_from` turns the complete lines after it into items, so that
:mod:`forge_obs.analysis.index` indexes a growing file from where it stopped. TorchTitan's own
``structured_logs`` files are read as timelines too (:mod:`.titan_logs`), converted in memory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from forge_obs.analysis import titan_logs
from forge_obs.analysis.jsonl_reader import BLANK, NOT_JSON, NOT_PARSED, parse_line
from forge_obs.recording.timeline import records as rec

__all__ = ["Stream", "Run", "Cursor", "clean_header", "scan", "walk", "read_from", "run_end", "file_order",
           "first_header", "event_files", "finish_clocks",
           "SPAN", "OPEN", "INSTANT", "STEP", "TAG", "END"]

logger = logging.getLogger("forge_obs")

SPAN, OPEN, INSTANT, STEP, TAG, END = "span", "open", "instant", "step", "tag", "end"

#: the record codes (defined once, in forge_obs/recording/timeline/records.py), read in this one place
_NAME, _LANE, _INSTANT, _BEGIN, _ENDED, _STEP, _TAG, _META, _DROPPED, _CLOCK, _CLOSED, _ALIVE = (
    rec.NAME, rec.LANE, rec.INSTANT, rec.BEGIN, rec.END, rec.STEP, rec.TAG, rec.META, rec.DROPPED, rec.CLOCK, rec.CLOSE,
    rec.ALIVE)
_CLOCK_LINE = f'["{rec.CLOCK}"'.encode()  # how a clock record's line starts


@dataclass
class Stream:
    key: tuple  # (host, pid, session)
    header: dict
    files: list = field(default_factory=list)
    attempt: int = 0
    offset_us: int = 0
    lanes: dict = field(default_factory=dict)  # lane -> label
    actor: str = ""
    first_ts: int | None = None
    last_ts: int | None = None
    clean: bool = False
    records: int = 0
    dropped: int = 0
    track: Any = None  # free for the consumer
    opens: dict = field(default_factory=dict)  # span id -> (lane, name, step, ts, extras): begun, not ended
    clock: int | None = None  # the smallest "local receive - controller send" of its clock samples (µs)

    @property
    def host(self) -> str:
        return self.header.get("host", "?")

    @property
    def pid(self) -> int:
        return int(self.header.get("pid", 0))

    @property
    def mesh(self) -> str:
        return self.header.get("mesh", "?")

    @property
    def rank(self) -> int:
        return int(self.header.get("rank", 0))

    @property
    def label(self) -> str:
        mid = f"/{self.actor}" if self.actor else ""
        return f"{self.mesh}{mid}/r{self.rank}"


@dataclass
class Run:
    run_dir: Path
    streams: dict  # key -> Stream
    files: list  # [(path, key)] in reading order
    offsets: dict  # host -> µs to add
    attempts: list  # distinct controller start times, ascending
    controller_host: str | None = None
    malformed: int = 0  # lines skipped by walk(): not JSON, or not a well-formed record
    first_malformed: str = ""  # where the first one is, and why
    samples: dict = field(default_factory=dict)  # host -> smallest "local receive - controller send" (µs)
    starts: set = field(default_factory=set)  # controller start times seen in headers
    keep: Any = None  # the stream filter scan() was given

    def stream_for(self, h: dict) -> "Stream | None":
        """The stream of header ``h`` (created, with its clock offset and attempt, when new);
        None when ``keep`` drops it."""
        key = (h.get("host"), h.get("pid"), h.get("session"))
        st = self.streams.get(key)
        if st is None:
            if self.keep is not None and not self.keep(h):
                return None
            st = self.streams[key] = Stream(key=key, header=h, actor=h.get("actor", ""))
            st.offset_us = self.offsets.get(st.host, 0)
            s = h.get("start")
            st.attempt = self.attempts.index(s) if s in self.attempts else 0
        return st

    def note_malformed(self, path: Any, line: int, why: str) -> None:
        if not self.malformed:
            self.first_malformed = f"{path}{f':{line}' if line else ''}: {why}"
        self.malformed += 1


@dataclass
class Cursor:
    """Where reading one file stands: the byte offset after its last complete line, the names its
    records defined, the session its next records belong to and that session's time base."""

    path: Path
    offset: int = 0
    names: dict = field(default_factory=dict)
    key: Any = None  # the current session's stream key (None: before the first header, or dropped)
    base: int = 0  # the session's t0 plus its host's clock offset
    line_off: int = 0  # the byte offset of the line being read (set by read_from)
    host: Any = None  # the host of the file's first header (its clock samples are that host's)


#: ints beyond this are not what the writer writes (and would not fit the SQL views' BIGINT)
_BIG = 1 << 62
#: header fields and the types they must have (a field of another type is removed)
_HEADER_TYPES: dict[str, tuple] = {
    "host": (str,), "pid": (int,), "mesh": (str,), "actor": (str,), "rank": (int,), "session": (str,),
    "run": (str,), "t0": (int,), "file": (int,), "start": (int, float), "ws": (int,), "ctl": (bool,),
}


def _int(x: Any) -> bool:
    return type(x) is int and -_BIG < x < _BIG


def clean_header(h: Any) -> "dict | None":
    """A header dict with every field of the wrong type removed (defaults apply), or None if
    ``h`` is not a header."""
    if not isinstance(h, dict) or not h.get("h"):
        return None
    bad = [k for k, types in _HEADER_TYPES.items()
           if k in h and (type(h[k]) not in types or (type(h[k]) is int and not _int(h[k])))]
    clk = h.get("clk")
    if clk is not None and not (isinstance(clk, list) and len(clk) == 2 and _int(clk[0]) and _int(clk[1])):
        bad.append("clk")
    if not bad:
        return h
    return {k: v for k, v in h.items() if k not in bad}


def _ex(x: Any) -> bool:
    """Extras: None, or a dict whose attributes (``"a"``) are a dict too."""
    return x is None or (type(x) is dict and type(x.get(rec.X_ATTRS, {})) is dict)


def _span_ok(r: list, n: int) -> bool:
    if n < 5:
        return False
    a, b, c, d, e = r[0], r[1], r[2], r[3], r[4]  # the common record, checked without a call per field
    return (type(a) is int and type(b) is int and type(c) is int and type(d) is int and -_BIG < a < _BIG
            and -_BIG < b < _BIG and -_BIG < c < _BIG and -_BIG < d < _BIG
            and (e is None or (type(e) is int and -_BIG < e < _BIG)) and (n < 6 or _ex(r[5])))


#: per record code: whether a record of that code has the shape and types the reader reads
_SHAPES: dict[str, Callable[[list, int], bool]] = {
    _NAME: lambda r, n: n >= 3 and _int(r[1]) and type(r[2]) is str,
    _LANE: lambda r, n: n >= 3 and _int(r[1]) and type(r[2]) is str,
    _INSTANT: lambda r, n: n >= 5 and _int(r[1]) and _int(r[2]) and _int(r[3]) and (r[4] is None or _int(r[4]))
    and (n < 6 or _ex(r[5])),
    _BEGIN: lambda r, n: n >= 6 and _int(r[1]) and _int(r[2]) and _int(r[3]) and _int(r[4])
    and (r[5] is None or _int(r[5])) and (n < 7 or _ex(r[6])),
    _ENDED: lambda r, n: n >= 3 and _int(r[1]) and _int(r[2]) and (n < 4 or _ex(r[3])),
    _STEP: lambda r, n: n >= 4 and _int(r[1]) and _int(r[2]) and (r[3] is None or _int(r[3])),
    _TAG: lambda r, n: n >= 5 and _int(r[1]) and _int(r[2]) and (r[3] is None or _int(r[3])) and type(r[4]) is str,
    _META: lambda r, n: n >= 2 and type(r[1]) is dict,
    _DROPPED: lambda r, n: n >= 2 and _int(r[1]),
    _CLOSED: lambda r, n: n >= 2 and _int(r[1]),
    _ALIVE: lambda r, n: n >= 2 and _int(r[1]),
    _CLOCK: lambda r, n: n >= 3 and _int(r[1]) and _int(r[2]),
}


def _record_ok(r: list) -> bool:
    """Whether a record has the shape and types :func:`walk` reads (see the schema)."""
    k = r[0]
    if type(k) is int:  # complete span: ts, dur, lane, name, step[, extras]
        return _span_ok(r, len(r))
    ok = _SHAPES.get(k) if type(k) is str else None
    return ok is not None and ok(r, len(r))


def first_header(path: Path) -> dict | None:
    """The cleaned header on the first line of ``path`` (None: not a timeline file, or torn)."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
        return clean_header(json.loads(line.decode("utf-8")))
    except (OSError, ValueError, RecursionError):
        return None


def file_order(h: dict, path: Path) -> tuple:
    """The reading order of a file whose first header is ``h``: by process session, then its
    rotation number (a process's records come together)."""
    return (h.get("host") or "", h.get("pid") or 0, h.get("session") or "", int(h.get("file", 0)), str(path))


def event_files(run_dir: Path) -> list[Path]:
    """The run's timeline files: ``events/*.jsonl``."""
    ev = run_dir / "events"
    return sorted(ev.glob("*.jsonl")) if ev.is_dir() else []


def _note_clock(run: Run, host: Any, d: int) -> None:
    run.samples[host] = min(d, run.samples.get(host, d))


def _note_header(run: Run, h: dict, host: Any = None) -> None:
    """A header's controller start (an attempt) and clock sample."""
    if h.get("start") is not None:
        run.starts.add(h["start"])
    if h.get("clk"):
        _note_clock(run, h.get("host") if host is None else host, int(h["clk"][0]) - int(h["clk"][1]))


def _scan_clocks(run: Run, path: Path, host: Any) -> None:
    """Later, tighter clock samples (``C`` records) and later sessions' headers of one file."""
    with open(path, "rb") as f:
        next(f, None)
        for line in f:
            if line.startswith(b'{"h"'):  # a restarted process appended to this file
                h2 = clean_header(parse_line(line))
                if h2 is not None:
                    _note_header(run, h2, host)
                    run.stream_for(h2)
            elif line.startswith(_CLOCK_LINE):
                c = parse_line(line)
                if isinstance(c, list) and len(c) >= 3 and _int(c[1]) and _int(c[2]):
                    _note_clock(run, host, c[1] - c[2])


def finish_clocks(run: Run) -> None:
    """Per-host clock offsets from the samples, attempts from the start times; applied to every
    stream."""
    run.offsets = {h: -d for h, d in run.samples.items()}
    if run.controller_host is not None:
        run.offsets[run.controller_host] = 0
    run.attempts = sorted(run.starts)
    for st in run.streams.values():
        st.offset_us = run.offsets.get(st.host, 0)
        s = st.header.get("start")
        st.attempt = run.attempts.index(s) if s in run.attempts else 0


def scan(run_dir: "str | Path", keep: Callable[[dict], bool] | None = None, clocks: bool = True) -> Run:
    """Headers of every event file, per-host clock offsets and attempts (restarts).
    ``keep(header)`` drops whole processes (rank/mesh filters) before reading them. TorchTitan's
    own files (:mod:`.titan_logs`) are streams too, read from memory; nothing is written."""
    run = Run(Path(run_dir), {}, [], {}, [], keep=keep)
    found: list[tuple] = []
    for p in event_files(run.run_dir):
        h = first_header(p)
        if h is None:
            continue
        if h.get("ctl"):
            run.controller_host = h.get("host")
        if clocks:
            _note_header(run, h)
        elif h.get("start") is not None:
            run.starts.add(h["start"])
        if run.stream_for(h) is not None:
            found.append((file_order(h, p), p, h))
    for src in titan_logs.titan_files(run.run_dir):
        h = titan_logs.header_of(src, run.run_dir.name)
        if run.stream_for(h) is not None:
            found.append((file_order(h, src), src, h))
    if clocks:
        for _o, p, h in found:
            if not titan_logs.is_titan(p):
                _scan_clocks(run, p, h.get("host"))
    finish_clocks(run)
    found.sort(key=lambda t: t[0])
    for _o, p, h in found:
        run.streams[(h.get("host"), h.get("pid"), h.get("session"))].files.append((int(h.get("file", 0)), p))
        run.files.append((p, (h.get("host"), h.get("pid"), h.get("session"))))
    return run


def walk(run: Run) -> Iterator[tuple]:
    """Every record of the run, normalised (see the module docstring). The records of one
    process come together; its ``OPEN`` spans and its ``END`` follow its last record."""
    done: set = set()
    touched: list = []
    files = run.files
    for fi, (path, _key) in enumerate(files):
        cur = Cursor(path)
        yield from read_from(run, cur, touched)
        if fi + 1 < len(files) and files[fi + 1][1] == files[fi][1]:
            continue  # the next file continues this process (rotation)
        for k in dict.fromkeys(touched):
            if k not in done:
                done.add(k)
                yield from _stream_end(run.streams[k])
        touched = []
    for key, st in run.streams.items():
        if key not in done:
            yield (END, st)
    if run.malformed:
        logger.warning("forge_obs: %s: %d malformed timeline line(s) skipped (first: %s)", run.run_dir / "events",
                       run.malformed, run.first_malformed)


def _stream_end(st: Stream) -> Iterator[tuple]:
    for _sid, b in list(st.opens.items()):
        yield (OPEN, st, b[0], b[1], b[2], b[3], b[4])
    st.opens = {}
    yield (END, st)


def read_from(run: Run, cur: Cursor, touched: list | None = None, limit: int | None = None) -> Iterator[tuple]:
    """The items of ``cur``'s file after ``cur.offset``, up to its last complete line (or
    ``limit`` bytes); ``cur`` moves past each line read. A torn last line waits: it is read once
    complete. ``touched`` collects the stream keys met."""
    if titan_logs.is_titan(cur.path):
        lines = titan_logs.timeline_lines(cur.path, run.run_dir.name) if cur.offset == 0 else iter(())
    else:
        lines = _file_lines(cur, limit)
    for raw, size in lines:
        cur.line_off = cur.offset
        cur.offset += size
        r = parse_line(raw) if type(raw) is bytes else raw
        if type(r) is list:
            if r and _record_ok(r):
                st = run.streams.get(cur.key) if cur.key is not None else None
                if st is not None and (item := _record(st, cur, r)) is not None:
                    yield item
                continue
            why = f"a record of the wrong shape ({_brief(r)})"
        elif type(r) is dict:
            if r.get("h"):
                _header(run, cur, r, touched)
                continue
            why = f"an object that is not a header ({_brief(r)})"
        elif r is BLANK:
            continue
        else:
            why = NOT_JSON if r is NOT_PARSED else f"a JSON {type(r).__name__}, not a JSON array or a JSON object"
        run.note_malformed(cur.path, 0, f"{why} (at byte {cur.line_off})")


#: bytes read from a file at a time
_CHUNK = 8 << 20


def _file_lines(cur: Cursor, limit: int | None) -> Iterator[tuple]:
    """``(line, size in bytes)`` of each complete line after ``cur.offset`` (at most ``limit``
    bytes); a torn last line (no newline yet) is left for later."""
    left = limit
    with open(cur.path, "rb") as f:
        f.seek(cur.offset)
        rest = b""
        while left is None or left > 0:
            data = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not data:
                return
            if left is not None:
                left -= len(data)
            data = rest + data
            end = data.rfind(b"\n") + 1
            rest = data[end:]
            for line in data[:end].splitlines(keepends=True):
                yield line, len(line)


def _header(run: Run, cur: Cursor, r: dict, touched: list | None) -> None:
    """A header: the file's first, or a restarted process appending to it (a new session)."""
    h = clean_header(r)
    if cur.host is None:
        cur.host = h.get("host")
    _note_header(run, h, cur.host)
    st = run.stream_for(h)
    cur.names = {}
    if st is None:
        cur.key = None
        return
    cur.key = st.key
    if h.get("actor"):
        st.actor = h["actor"]
    cur.base = int(h.get("t0", 0)) + st.offset_us
    if touched is not None:
        touched.append(st.key)


def _record(st: Stream, cur: Cursor, r: list) -> "tuple | None":
    """One well-formed record: an item, or None for a record that only changes state."""
    k = r[0]
    st.records += 1
    if type(k) is int:  # a complete span
        ts = cur.base + k
        end = ts + r[1]
        if st.first_ts is None or ts < st.first_ts:
            st.first_ts = ts
        if st.last_ts is None or end > st.last_ts:
            st.last_ts = end
        ex = r[5] if len(r) > 5 else None
        cpu = None
        if ex and rec.X_CPU in ex:
            ex, cpu = _split_cpu(ex)
        return (SPAN, st, r[2], cur.names.get(r[3], "?"), r[4], ts, r[1], ex, cpu)
    if k == _NAME:
        cur.names[r[1]] = r[2]
        return None
    if k == _LANE:
        st.lanes[r[1]] = r[2]
        return None
    st.clean = k == _CLOSED
    if k == _INSTANT:
        ts = _touch(st, cur.base + r[1])
        return (INSTANT, st, r[2], cur.names.get(r[3], "?"), r[4], ts, r[5] if len(r) > 5 else None)
    if k == _STEP:
        return (STEP, st, r[2], r[3], _touch(st, cur.base + r[1]))
    if k == _TAG:
        return (TAG, st, r[2], r[3], r[4], _touch(st, cur.base + r[1]))
    return _state_record(st, cur, r, k)


def _state_record(st: Stream, cur: Cursor, r: list, k: str) -> "tuple | None":
    """``B`` / ``E`` (an ended span is an item), ``M``, ``D``, ``Z``, ``A``, ``C``."""
    if k == _BEGIN:
        st.opens[r[1]] = (r[3], cur.names.get(r[4], "?"), r[5], _touch(st, cur.base + r[2]), r[6] if len(r) > 6 else None)
    elif k == _ENDED:
        b = st.opens.pop(r[1], None)
        ts = _touch(st, cur.base + r[2])
        if b is not None:
            ex, cpu = b[4], None
            if len(r) > 3 and r[3]:
                ex = dict(ex or {}, **r[3])
                if rec.X_CPU in ex:
                    ex, cpu = _split_cpu(ex)
            return (SPAN, st, b[0], b[1], b[2], b[3], ts - b[3], ex, cpu)
    elif k == _META:
        if isinstance(r[1].get("actor"), str) and r[1]["actor"]:
            st.actor = r[1]["actor"]
    elif k == _DROPPED:
        st.dropped += r[1]
    elif k == _CLOSED or k == _ALIVE:  # the data reaches this time
        _touch(st, cur.base + r[1])
    elif k == _CLOCK:
        st.clock = r[1] - r[2] if st.clock is None else min(st.clock, r[1] - r[2])
    return None


def _split_cpu(ex: dict) -> tuple:
    """``(extras without the CPU time, CPU µs or None when it is not an int)``."""
    cpu = ex.pop(rec.X_CPU)
    return ex or None, cpu if _int(cpu) else None


def _brief(r: Any) -> str:
    try:
        return json.dumps(r)[:80]
    except Exception:  # noqa: BLE001
        return type(r).__name__


def _touch(st: Stream, ts: int) -> int:
    if st.first_ts is None or ts < st.first_ts:
        st.first_ts = ts
    if st.last_ts is None or ts > st.last_ts:
        st.last_ts = ts
    return ts


def run_end(run: Run) -> int | None:
    """Last timestamp of the data (after :func:`walk`)."""
    ends = [s.last_ts for s in run.streams.values() if s.last_ts is not None]
    return max(ends) if ends else None
