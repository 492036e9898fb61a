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
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from forge_obs.analysis import titan_logs
from forge_obs.analysis.jsonl_reader import json_lines
from forge_obs.recording.timeline.records import (  # the records' codes (R_: not this module's item kinds)
    BEGIN as R_BEGIN, CLOCK as R_CLOCK, CLOSE as R_CLOSE, DROPPED as R_DROPPED, END as R_END, INSTANT as R_INSTANT,
    LANE as R_LANE, META as R_META, NAME as R_NAME, STEP as R_STEP, TAG as R_TAG, X_ATTRS, X_CPU,
)

__all__ = ["Stream", "Run", "clean_header", "scan", "walk", "run_end"]

logger = logging.getLogger("forge_obs")

SPAN, OPEN, INSTANT, STEP, TAG, END = "span", "open", "instant", "step", "tag", "end"


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


_CLOCK_LINE = f'["{R_CLOCK}"'.encode()  # how a clock record's line starts
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
    return x is None or (type(x) is dict and type(x.get(X_ATTRS, {})) is dict)


def _record_ok(r: list) -> bool:
    """Whether a record has the shape and types :func:`walk` reads (see the schema)."""
    n = len(r)
    k = r[0]
    if type(k) is int:  # complete span: ts, dur, lane, name, step[, extras]
        return (n >= 5 and _int(k) and _int(r[1]) and _int(r[2]) and _int(r[3]) and (r[4] is None or _int(r[4]))
                and (n < 6 or _ex(r[5])))
    if k == R_NAME:
        return n >= 3 and _int(r[1]) and type(r[2]) is str
    if k == R_LANE:
        return n >= 3 and _int(r[1]) and type(r[2]) is str
    if k == R_INSTANT:
        return (n >= 5 and _int(r[1]) and _int(r[2]) and _int(r[3]) and (r[4] is None or _int(r[4]))
                and (n < 6 or _ex(r[5])))
    if k == R_BEGIN:
        return (n >= 6 and _int(r[1]) and _int(r[2]) and _int(r[3]) and _int(r[4]) and (r[5] is None or _int(r[5]))
                and (n < 7 or _ex(r[6])))
    if k == R_END:
        return n >= 3 and _int(r[1]) and _int(r[2]) and (n < 4 or _ex(r[3]))
    if k == R_STEP:
        return n >= 4 and _int(r[1]) and _int(r[2]) and (r[3] is None or _int(r[3]))
    if k == R_TAG:
        return n >= 5 and _int(r[1]) and _int(r[2]) and (r[3] is None or _int(r[3])) and type(r[4]) is str
    if k == R_META:
        return n >= 2 and type(r[1]) is dict
    if k == R_DROPPED or k == R_CLOSE:
        return n >= 2 and _int(r[1])
    if k == R_CLOCK:
        return n >= 3 and _int(r[1]) and _int(r[2])
    return False


def _lines(path: Path, run: "Run | None" = None) -> Iterator[Any]:
    """Each line of ``path`` parsed (a list record or a header dict). Lines that are not valid
    UTF-8 / JSON, or neither a list nor a dict, are counted in ``run.malformed``; a torn last
    line (the writer died mid-line) is skipped silently."""
    return json_lines(path, lambda line, why: _malformed(run, path, line, why))


def _malformed(run: "Run | None", path: Path, line: int, why: str) -> None:
    if run is None:
        return
    if not run.malformed:
        run.first_malformed = f"{path}{f':{line}' if line else ''}: {why}"
    run.malformed += 1


def _first_header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            line = f.readline()
        return clean_header(json.loads(line.decode("utf-8")))
    except (OSError, ValueError, RecursionError):
        return None


def scan(run_dir: "str | Path", keep: Callable[[dict], bool] | None = None, clocks: bool = True) -> Run:
    """Headers of every event file, per-host clock offsets and attempts (restarts).
    ``keep(header)`` drops whole processes (rank/mesh filters) before reading them."""
    run_dir = Path(run_dir)
    ev = run_dir / "events"
    extra = [d for d in titan_logs.timeline_dirs(run_dir) if d != ev]  # TorchTitan's own files, converted
    paths = sorted(ev.glob("*.jsonl")) if ev.is_dir() else []
    for d in extra:
        paths.extend(sorted(d.glob("*.jsonl")))
    streams: dict[tuple, Stream] = {}
    files: list[tuple] = []
    samples: dict[str, int] = {}
    ctl_host = None
    starts: set = set()
    for p in paths:
        h = _first_header(p)
        if h is None:
            continue
        if h.get("ctl"):
            ctl_host = h.get("host")
        if h.get("start") is not None:
            starts.add(h["start"])
        key = (h.get("host"), h.get("pid"), h.get("session"))
        if clocks and h.get("clk"):
            d = int(h["clk"][0]) - int(h["clk"][1])
            samples[h["host"]] = min(d, samples.get(h["host"], d))
        if keep is not None and not keep(h):
            continue
        st = streams.get(key)
        if st is None:
            st = streams[key] = Stream(key=key, header=h, actor=h.get("actor", ""))
        st.files.append((int(h.get("file", 0)), p))
        files.append((key, int(h.get("file", 0)), p))
    if clocks:  # later, tighter samples ("C" records) and later sessions: one cheap pass
        for key, _i, p in list(files):
            host = key[0]
            with open(p, "rb") as f:
                next(f, None)
                for line in f:
                    if line.startswith(b'{"h"'):  # a restarted process appended to this file
                        try:
                            h2 = clean_header(json.loads(line.decode("utf-8")))
                        except (ValueError, RecursionError):
                            continue
                        if h2 is None:
                            continue
                        k2 = (h2.get("host"), h2.get("pid"), h2.get("session"))
                        if h2.get("start") is not None:
                            starts.add(h2["start"])
                        if k2 not in streams and (keep is None or keep(h2)):
                            streams[k2] = Stream(key=k2, header=h2, actor=h2.get("actor", ""))
                        if h2.get("clk"):
                            d = int(h2["clk"][0]) - int(h2["clk"][1])
                            samples[host] = min(d, samples.get(host, d))
                    elif line.startswith(_CLOCK_LINE):
                        try:
                            c = json.loads(line.decode("utf-8"))
                        except (ValueError, RecursionError):
                            continue
                        if not (isinstance(c, list) and len(c) >= 3 and _int(c[1]) and _int(c[2])):
                            continue
                        d = c[1] - c[2]
                        samples[host] = min(d, samples.get(host, d))
    offsets = {h: (0 if h == ctl_host else -d) for h, d in samples.items()}
    if ctl_host is not None:
        offsets[ctl_host] = 0
    attempts = sorted(starts)
    for st in streams.values():
        st.offset_us = offsets.get(st.host, 0)
        s = st.header.get("start")
        st.attempt = attempts.index(s) if s in attempts else 0
    files.sort(key=lambda t: (t[0][0] or "", t[0][1] or 0, t[0][2] or "", t[1], str(t[2])))
    return Run(run_dir, streams, [(p, k) for k, _i, p in files], offsets, attempts, ctl_host)


def walk(run: Run) -> Iterator[tuple]:
    """Every record of the run, normalised (see the module docstring). The records of one
    process come together; its ``OPEN`` spans and its ``END`` follow its last record.

    One function on purpose: it is the per-record loop of every view, and its lookups are bound
    once, outside the loop."""
    opens: dict[tuple, dict] = {}
    done: set = set()
    touched: list = []
    files = run.files
    for fi, (path, key) in enumerate(files):
        st = run.streams[key]
        touched.append(key)
        names: dict[int, str] = {}
        base = int(st.header.get("t0", 0)) + st.offset_us
        op = opens.setdefault(key, {})
        for r in _lines(path, run):
            if isinstance(r, list):
                if not r or not _record_ok(r):
                    _malformed(run, path, 0, f"a record of the wrong shape ({_brief(r)})")
                    continue
                k = r[0]
                st.records += 1
                if type(k) is int:  # complete span
                    ts = base + k
                    end = ts + r[1]
                    if st.first_ts is None or ts < st.first_ts:
                        st.first_ts = ts
                    if st.last_ts is None or end > st.last_ts:
                        st.last_ts = end
                    ex = r[5] if len(r) > 5 else None
                    cpu = None
                    if ex and X_CPU in ex:
                        ex, cpu = _split_cpu(ex)
                    yield (SPAN, st, r[2], names.get(r[3], "?"), r[4], ts, r[1], ex, cpu)
                    continue
                if k == R_NAME:
                    names[r[1]] = r[2]
                    continue
                if k == R_LANE:
                    st.lanes[r[1]] = r[2]
                    continue
                if k == R_INSTANT:
                    ts = base + r[1]
                    _touch(st, ts)
                    yield (INSTANT, st, r[2], names.get(r[3], "?"), r[4], ts, r[5] if len(r) > 5 else None)
                elif k == R_BEGIN:
                    ts = base + r[2]
                    _touch(st, ts)
                    op[r[1]] = (r[3], names.get(r[4], "?"), r[5], ts, r[6] if len(r) > 6 else None)
                elif k == R_END:
                    b = op.pop(r[1], None)
                    ts = base + r[2]
                    _touch(st, ts)
                    if b is not None:
                        ex = b[4]
                        cpu = None
                        if len(r) > 3 and r[3]:
                            ex = dict(ex or {}, **r[3])
                            if X_CPU in ex:
                                ex, cpu = _split_cpu(ex)
                        yield (SPAN, st, b[0], b[1], b[2], b[3], ts - b[3], ex, cpu)
                elif k == R_STEP:
                    ts = base + r[1]
                    _touch(st, ts)
                    yield (STEP, st, r[2], r[3], ts)
                elif k == R_TAG:
                    ts = base + r[1]
                    _touch(st, ts)
                    yield (TAG, st, r[2], r[3], r[4], ts)
                elif k == R_META:
                    if isinstance(r[1].get("actor"), str) and r[1]["actor"]:
                        st.actor = r[1]["actor"]
                elif k == R_DROPPED:
                    st.dropped += r[1]
                elif k == R_CLOSE:
                    _touch(st, base + r[1])
                    st.clean = True
                    continue
                st.clean = False
            elif isinstance(r, dict) and r.get("h"):
                r = clean_header(r)
                nkey = (r.get("host"), r.get("pid"), r.get("session"))
                if nkey != key:  # a restarted process appended to the same file
                    st = run.streams.get(nkey)
                    if st is None:
                        st = run.streams[nkey] = Stream(key=nkey, header=r, actor=r.get("actor", ""))
                        st.offset_us = run.offsets.get(st.host, 0)
                        s = r.get("start")
                        st.attempt = run.attempts.index(s) if s in run.attempts else 0
                    key = nkey
                    op = opens.setdefault(key, {})
                names = {}
                if r.get("actor"):
                    st.actor = r["actor"]
                base = int(r.get("t0", 0)) + st.offset_us
                touched.append(key)
            else:
                _malformed(run, path, 0, f"an object that is not a header ({_brief(r)})")
        if fi + 1 < len(files) and files[fi + 1][1] == files[fi][1]:
            continue  # the next file continues this process (rotation)
        for k in dict.fromkeys(touched):
            if k in done:
                continue
            done.add(k)
            s2 = run.streams[k]
            for _sid, b in opens.pop(k, {}).items():
                yield (OPEN, s2, b[0], b[1], b[2], b[3], b[4])
            yield (END, s2)
        touched = []
    for key, st in run.streams.items():
        if key not in done:
            yield (END, st)
    if run.malformed:
        logger.warning("forge_obs: %s: %d malformed timeline line(s) skipped (first: %s)", run.run_dir / "events",
                       run.malformed, run.first_malformed)


def _split_cpu(ex: dict) -> tuple:
    """``(extras without the CPU time, CPU µs or None when it is not an int)``."""
    cpu = ex.pop(X_CPU)
    return ex or None, cpu if _int(cpu) else None


def _brief(r: Any) -> str:
    try:
        return json.dumps(r)[:80]
    except Exception:  # noqa: BLE001
        return type(r).__name__


def _touch(st: Stream, ts: int) -> None:
    if st.first_ts is None or ts < st.first_ts:
        st.first_ts = ts
    if st.last_ts is None or ts > st.last_ts:
        st.last_ts = ts


def run_end(run: Run) -> int | None:
    """Last timestamp of the data (after :func:`walk`)."""
    ends = [s.last_ts for s in run.streams.values() if s.last_ts is not None]
    return max(ends) if ends else None
