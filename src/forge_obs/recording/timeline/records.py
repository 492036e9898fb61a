"""Every timeline record, defined once: the buffer entries the hot path appends and the file
records the writer writes and the readers read (``runs/<run_id>/events/*.jsonl``, version 1).

One file per process (``<host>_<pid>_<mesh>_<rank>.jsonl``, rotated files add ``.<k>`` before
``.jsonl``). Every file starts with a header object; a header in the middle of a file starts a
new session (a restarted process that reused the pid). Then one JSON array per line, a code
first (a complete span has none: it starts with its time). Times are integer microseconds
relative to the header's ``t0`` (epoch µs), ``step`` is an int or null::

    {"h": 1, "v": 1, "run": "exp1", "start": 1.7e9, "session": "a1b2c3", "host": "node0",
     "pid": 4242, "mesh": "trainer", "actor": "TrainActor", "rank": 3, "coords": {"gpus": 3},
     "ws": 4, "ctl": false, "ranks": "all", "t0": 1763860000000000, "clk": [recv_us, ctl_us],
     "file": 0}
    ["N", 1, "train_step"]                   NameRecord: name 1 (defined once per file)
    ["L", 0, "Task-3", 1403]                 LaneRecord: track 0 = asyncio task "Task-3" (or a thread)
    [1200, 950, 0, 1, 42]                    SpanRecord: ts, dur, track, name, step
    [1200, 950, 0, 1, 42, {"f": "ep-7", "a": {"n": 4}, "e": "ValueError: x", "c": 930}]
                                             + extras: flow, attributes, error, CPU µs
    ["B", 17, 5000, 0, 1, 43]                BeginRecord: span 17 began (still open when written)
    ["E", 17, 9000]                          EndRecord: ... and ended later (extras: {"e": error},
                                             {"c": cpu_us}, or {"x": "shutdown"}: cut short by a
                                             clean close)
    ["I", 5100, 0, 2, 43, {"f": "ep-7"}]     InstantRecord: ts, track, name, step[, extras]
    ["I", 5100, 0, 3, 43, {"p": "9f3a.7"}]   "call": an endpoint call sent under the open span of
                                             track 0; the callee's top-level spans of that call
                                             carry {"p": "9f3a.7"} in their extras (the link)
    ["S", 5000, 0, 43]                       StepRecord: set_step(43)
    ["T", 5000, 0, 43, "eval"]               TagRecord: add_step_tag("eval") at step 43
    ["M", {"actor": "TrainActor"}]           MetaRecord: identity update (the actor is learnt late)
    ["D", 120]                               DroppedRecord: 120 records lost (buffer overflow)
    ["C", 1763860000000950, 1763860000000100]   ClockRecord: local receive / controller send (epoch µs)
    ["A", 9050]                              AliveRecord: the process was alive at 9050 with a
                                             span of its "B" records still open
    ["Z", 9100]                              CloseRecord: the process closed the file cleanly

A complete span is one record; a span is written as ``B`` (then ``E``) only when it stays open
longer than ``open_after_s`` or when the file is closed, so that the span a hang is stuck in is
on disk. While such a span is open, a writer pass that has nothing else to write writes ``A``:
the data of a process killed inside it reaches its last pass, so the span it died in has the
time it was open (not none). A span younger than ``open_after_s`` when the process closes its
file cleanly gets ``["E", sid, close_ts, {"x": "shutdown"}]`` right after its ``B``: the
shutdown cut it short.

**CPU time** (``"c"``): the thread CPU time (µs, never more than the span's duration) between
the span's enter and exit, for spans that read it (see :mod:`forge_obs.recording.timeline.recorder`).

The buffer entries (``*Entry``) are what the hot path appends: plain tuples laid out as these
classes say (building a named tuple costs ~0.1 µs more per record than a tuple display); the
writer reads them through the classes (``BeginEntry._make(e).sid``). :func:`decode` turns a file
record (a parsed JSON list) into its named record, or None when it is not well formed.

    >>> decode([1200, 950, 0, 1, 42])
    SpanRecord(ts=1200, dur=950, lane=0, name=1, step=42, extras=None)
    >>> SpanRecord.encode(1200, 950, 0, 1, None, {"c": 930})
    '[1200,950,0,1,null,{"c":930}]\\n'
    >>> decode(["E", 17, 9000, {"x": "shutdown"}]).extras[X_CUT] == CUT_SHUTDOWN
    True
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, NamedTuple

__all__ = [
    "NAME", "LANE", "INSTANT", "BEGIN", "END", "STEP", "TAG", "META", "DROPPED", "CLOCK", "CLOSE", "ALIVE", "CODES",
    "X_FLOW", "X_ATTRS", "X_ERROR", "X_CUT", "X_LINK", "X_CPU", "CUT_SHUTDOWN",
    "K_BEGIN", "K_END", "K_LANE", "K_STEP", "K_TAG", "K_EVENT",
    "BeginEntry", "EndEntry", "LaneEntry", "StepEntry", "TagEntry", "EventEntry",
    "SpanRecord", "BeginRecord", "EndRecord", "InstantRecord", "StepRecord", "TagRecord", "NameRecord",
    "LaneRecord", "MetaRecord", "DroppedRecord", "ClockRecord", "CloseRecord", "AliveRecord",
    "entry_kind", "decode", "dumps",
]

# ------------------------------------------------------------------ codes of the file records
NAME, LANE, INSTANT, BEGIN, END, STEP, TAG, META, DROPPED, CLOCK, CLOSE = "N", "L", "I", "B", "E", "S", "T", "M", "D", "C", "Z"
ALIVE = "A"
CODES = (NAME, LANE, INSTANT, BEGIN, END, STEP, TAG, META, DROPPED, CLOCK, CLOSE, ALIVE)

# keys of a record's extras (a dict, or absent)
X_FLOW = "f"  # the flow id (any JSON value)
X_ATTRS = "a"  # the attributes (a dict)
X_ERROR = "e"  # "ValueError: message": the span raised
X_CUT = "x"  # CUT_SHUTDOWN: a clean close cut the span short
X_LINK = "p"  # the call link: on a "call" instant, and on the callee's top-level spans
X_CPU = "c"  # thread CPU µs between the span's enter and exit
CUT_SHUTDOWN = "shutdown"

# ------------------------------------------------------------------ buffer entries (hot path -> writer)
K_BEGIN, K_END, K_LANE, K_STEP, K_TAG, K_EVENT = 1, 2, 3, 4, 5, 6
#: ``entry_kind(entry)``: the K_* of a buffer entry (its first field, in every entry)
entry_kind = itemgetter(0)


class BeginEntry(NamedTuple):
    """A span opened: ``sid`` pairs it with its end (and numbers the entries: gaps are drops)."""

    kind: int  # K_BEGIN
    sid: int
    t_ns: int  # perf_counter_ns
    lane: int
    name: str
    step: Any
    extras: "dict | None"
    cpu_ns: "int | None"  # thread_time_ns at enter (None: this span does not read it)


class EndEntry(NamedTuple):
    kind: int  # K_END
    sid: int
    t_ns: int
    error: "str | None"
    cpu_ns: "int | None"  # thread_time_ns at exit


class LaneEntry(NamedTuple):
    """A track seen for the first time in this process (an asyncio task or a thread)."""

    kind: int  # K_LANE
    lane: int
    label: str
    tid: int


class StepEntry(NamedTuple):
    kind: int  # K_STEP
    seq: int
    t_ns: int
    lane: int
    step: Any


class TagEntry(NamedTuple):
    kind: int  # K_TAG
    seq: int
    t_ns: int
    lane: int
    step: Any
    tag: str


class EventEntry(NamedTuple):
    kind: int  # K_EVENT
    seq: int
    t_ns: int
    lane: int
    name: str
    step: Any
    extras: "dict | None"


# ------------------------------------------------------------------ file records
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)  # holds no state between calls


def dumps(o: Any) -> str:
    """Compact JSON, as the records are written (anything not serialisable as its text)."""
    return _ENCODER.encode(o)


def _null(step: Any) -> Any:
    return "null" if step is None else step


class SpanRecord(NamedTuple):
    """A finished span (no code: the record starts with its time)."""

    ts: int
    dur: int
    lane: int
    name: int  # a NameRecord's id
    step: Any
    extras: "dict | None" = None

    @staticmethod
    def encode(ts: int, dur: int, lane: int, name: int, step: Any, extras: "dict | None") -> str:
        if extras:
            return f"[{ts},{dur},{lane},{name},{_null(step)},{dumps(extras)}]\n"
        return f"[{ts},{dur},{lane},{name},{_null(step)}]\n"


class BeginRecord(NamedTuple):
    sid: int
    ts: int
    lane: int
    name: int
    step: Any
    extras: "dict | None" = None
    CODE = BEGIN

    @staticmethod
    def encode(sid: int, ts: int, lane: int, name: int, step: Any, extras: "dict | None") -> str:
        tail = f",{dumps(extras)}" if extras else ""
        return f'["B",{sid},{ts},{lane},{name},{_null(step)}{tail}]\n'


class EndRecord(NamedTuple):
    sid: int
    ts: int
    extras: "dict | None" = None
    CODE = END

    @staticmethod
    def encode(sid: int, ts: int, extras: "dict | None") -> str:
        if extras:
            return f'["E",{sid},{ts},{dumps(extras)}]\n'
        return f'["E",{sid},{ts}]\n'


class InstantRecord(NamedTuple):
    ts: int
    lane: int
    name: int
    step: Any
    extras: "dict | None" = None
    CODE = INSTANT

    @staticmethod
    def encode(ts: int, lane: int, name: int, step: Any, extras: "dict | None") -> str:
        if extras:
            return f'["I",{ts},{lane},{name},{_null(step)},{dumps(extras)}]\n'
        return f'["I",{ts},{lane},{name},{_null(step)}]\n'


class StepRecord(NamedTuple):
    ts: int
    lane: int
    step: Any
    CODE = STEP

    @staticmethod
    def encode(ts: int, lane: int, step: Any) -> str:
        return f'["S",{ts},{lane},{_null(step)}]\n'


class TagRecord(NamedTuple):
    ts: int
    lane: int
    step: Any
    tag: str
    CODE = TAG

    @staticmethod
    def encode(ts: int, lane: int, step: Any, tag: str) -> str:
        return f'["T",{ts},{lane},{_null(step)},{dumps(tag)}]\n'


class NameRecord(NamedTuple):
    id: int
    name: str
    CODE = NAME

    @staticmethod
    def encode(id: int, name: str) -> str:  # noqa: A002 - the field's name
        return f'["N",{id},{dumps(name)}]\n'


class LaneRecord(NamedTuple):
    lane: int
    label: str
    tid: int = 0
    CODE = LANE

    @staticmethod
    def encode(lane: int, label: str, tid: int) -> str:
        return f'["L",{lane},{dumps(label)},{tid}]\n'


class MetaRecord(NamedTuple):
    update: dict
    CODE = META

    @staticmethod
    def encode(update: dict) -> str:
        return f'["M",{dumps(update)}]\n'


class DroppedRecord(NamedTuple):
    count: int
    CODE = DROPPED

    @staticmethod
    def encode(count: int) -> str:
        return f'["D",{count}]\n'


class ClockRecord(NamedTuple):
    recv_us: int
    ctl_us: int
    CODE = CLOCK

    @staticmethod
    def encode(recv_us: int, ctl_us: int) -> str:
        return f'["C",{int(recv_us)},{int(ctl_us)}]\n'


class CloseRecord(NamedTuple):
    ts: int
    CODE = CLOSE

    @staticmethod
    def encode(ts: int) -> str:
        return f'["Z",{ts}]\n'


class AliveRecord(NamedTuple):
    ts: int
    CODE = ALIVE

    @staticmethod
    def encode(ts: int) -> str:
        return f'["A",{ts}]\n'


# ------------------------------------------------------------------ decoding (readers)
#: ints beyond this are not what the writer writes (and would not fit the SQL views' BIGINT)
_BIG = 1 << 62


def _int(x: Any) -> bool:
    return type(x) is int and -_BIG < x < _BIG


def _step(x: Any) -> bool:
    return x is None or _int(x)


def _ex(x: Any) -> bool:
    """Extras: None, or a dict whose attributes are a dict too."""
    return x is None or (type(x) is dict and type(x.get(X_ATTRS, {})) is dict)


def _str(x: Any) -> bool:
    return type(x) is str


#: code -> (record class, number of required fields, a check per field in order)
_SHAPES: dict = {
    BEGIN: (BeginRecord, 5, (_int, _int, _int, _int, _step, _ex)),
    END: (EndRecord, 2, (_int, _int, _ex)),
    INSTANT: (InstantRecord, 4, (_int, _int, _int, _step, _ex)),
    STEP: (StepRecord, 3, (_int, _int, _step)),
    TAG: (TagRecord, 4, (_int, _int, _step, _str)),
    NAME: (NameRecord, 2, (_int, _str)),
    LANE: (LaneRecord, 2, (_int, _str, _int)),
    META: (MetaRecord, 1, (lambda x: type(x) is dict,)),
    DROPPED: (DroppedRecord, 1, (_int,)),
    CLOCK: (ClockRecord, 2, (_int, _int)),
    CLOSE: (CloseRecord, 1, (_int,)),
    ALIVE: (AliveRecord, 1, (_int,)),
}
_SPAN_SHAPE = (SpanRecord, 5, (_int, _int, _int, _int, _step, _ex))


def decode(r: Any) -> Any:
    """The named record of a parsed line (a list), or None when it is not a well-formed record
    (unknown code, too few fields, a field of the wrong type). Extra trailing fields are ignored."""
    if type(r) is not list or not r:
        return None
    k = r[0]
    if type(k) is int:
        cls, need, checks = _SPAN_SHAPE
        fields = r
    else:
        shape = _SHAPES.get(k) if type(k) is str else None
        if shape is None:
            return None
        cls, need, checks = shape
        fields = r[1:]
    n = min(len(fields), len(checks))
    if n < need or not all(checks[i](fields[i]) for i in range(n)):
        return None
    return cls(*fields[:n])
