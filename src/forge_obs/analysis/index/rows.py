"""The one place that turns what the readers yield into the index's rows: timeline items
(:func:`forge_obs.analysis.reader.read_from`) into ``spans`` / ``events`` / ``opens`` /
``lanes`` rows, and ``metrics.jsonl`` rows into ``metrics`` / ``metric_rows`` rows.

Columns are plain Python lists (:class:`Columns`), turned into a Parquet segment once per update.
"""

from __future__ import annotations

import json
import math
from typing import Any

from forge_obs.analysis.index.schema import TABLES, arrow_schema
from forge_obs.analysis.reader import INSTANT, SPAN, STEP, TAG, Stream
from forge_obs.core.identity import PARALLEL_DIMS

__all__ = ["Columns", "flow_of", "extras_of", "TimelineRows", "metric_rows", "dims_of"]

#: ``flow_t``: the type of a flow id (the span graph keeps an int apart from its text)
FLOW_STR, FLOW_INT, FLOW_OTHER = 0, 1, 2


class Columns(dict):
    """table -> the rows to write (tuples in the table's column order); :meth:`columns` turns
    them into columns when they are written."""

    def __init__(self, *tables: str) -> None:
        super().__init__({t: [] for t in tables})

    def rows(self, table: str) -> int:
        return len(self[table])

    def add(self, table: str, values: tuple) -> None:
        self[table].append(values)

    def columns(self, table: str) -> dict:
        cols = list(zip(*self[table])) or [()] * len(TABLES[table])
        return {name: list(c) for name, c in zip(TABLES[table], cols)}

    def table(self, table: str) -> Any:
        """The rows of ``table`` as an Arrow table of its schema (converted row by row, in
        Arrow: no column lists made here)."""
        import pyarrow as pa

        schema = arrow_schema(table)
        return pa.Table.from_struct_array(pa.array(self[table], type=pa.struct(list(schema))))


def flow_of(ex: dict | None) -> tuple:
    """``(flow text, flow type)`` of a record's extras: the text as the SQL views show it."""
    if not ex or "f" not in ex:
        return None, None
    f = ex["f"]
    if isinstance(f, str):
        return f, FLOW_STR
    return json.dumps(f, default=str), FLOW_INT if type(f) is int else FLOW_OTHER


_NO_EXTRAS = (None, None, None, None, None, False)


def extras_of(ex: dict | None) -> tuple:
    """``(error, flow, flow type, attrs JSON, call link, cut by shutdown)`` of a record's extras."""
    if not ex:
        return _NO_EXTRAS
    e = ex.get("e")
    flow, ft = flow_of(ex)
    attrs = json.dumps(ex["a"], default=str) if ex.get("a") else None
    p = ex.get("p")
    return (e if e is None or type(e) is str else str(e)), flow, ft, attrs, (p if type(p) is str else None), \
        ex.get("x") == "shutdown"


class TimelineRows:
    """Rows of the timeline items of one update; ``sid_of`` numbers the process sessions."""

    def __init__(self, cols: Columns, sid_of: dict) -> None:
        self.cols = cols
        self.sid_of = sid_of  # stream key -> sid
        self.lo: int | None = None  # the earliest time of a row added (raw µs)
        self._spans, self._events = cols["spans"].append, cols["events"].append

    def add(self, it: tuple, fid: int, off: int) -> None:
        k = it[0]
        if k is SPAN:
            _k, st, lane, name, step, ts, dur, ex, cpu = it
            err, flow, ft, attrs, link, cut = extras_of(ex) if ex else _NO_EXTRAS
            self._spans((self.sid_of[st.key], st.actor, lane, name, step, ts, ts + dur, dur, err, flow, ft, attrs, link,
                         cut, cpu, fid, off))
        else:
            st = it[1]
            if k is INSTANT:
                _k, _st, lane, name, step, ts, ex = it
                _e, flow, ft, attrs, link, _c = extras_of(ex) if ex else _NO_EXTRAS
                row = (lane, "event", name, step, ts, flow, ft, attrs, link)
            elif k is STEP:
                _k, _st, lane, step, ts = it
                row = (lane, "step", "step", step, ts, None, None, None, None)
            elif k is TAG:
                _k, _st, lane, step, tag, ts = it
                row = (lane, "tag", tag, step, ts, None, None, None, None)
            else:
                return
            self._events((self.sid_of[st.key], st.actor, *row, fid, off))
        if self.lo is None or ts < self.lo:
            self.lo = ts

    def lanes(self, st: Stream) -> None:
        """The labels ``st``'s records defined since the last update (then forgotten: the
        ``lanes`` table keeps them)."""
        for lane, label in st.lanes.items():
            self.cols.add("lanes", (self.sid_of[st.key], lane, str(label)))
        st.lanes = {}


def dims_of(coords: Any) -> tuple:
    """A rank's parallel coordinates, in :data:`~forge_obs.core.identity.PARALLEL_DIMS`' order."""
    if not isinstance(coords, dict):
        return _NO_DIMS
    return tuple(v if type(v := coords.get(d)) is int and -(1 << 31) < v < 1 << 31 else None for d in PARALLEL_DIMS)


_NO_DIMS = (None,) * len(PARALLEL_DIMS)


def _num(v: Any) -> "float | None":
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            return math.copysign(math.inf, v)
    return None


def metric_rows(cols: Columns, row: dict, off: int) -> None:
    """One well-formed row of ``metrics.jsonl`` (:func:`~forge_obs.analysis.store.metric_row_problem`)
    into ``metrics`` (a row per value: a reduced value, or a raw one with its own wall time) and
    ``metric_rows`` (the row itself, as ``forge-obs show`` prints it)."""
    s = row.get("source") or {}
    label = s.get("label", "global") if s else "global"
    mesh, actor = s.get("mesh"), s.get("actor")
    base = (row.get("run_id"), row["step"], row.get("mode"), None if label is None else str(label),
            None if mesh is None else str(mesh), None if actor is None else str(actor), s.get("rank"))
    wt = _num(row.get("wall_time"))
    dims = dims_of(s.get("coords")) if s else _NO_DIMS
    for key, v in (row.get("metrics") or {}).items():
        cols.add("metrics", (*base, key, _num(v), wt, *dims, off))
    for item in row.get("values") or ():
        t = _num(item[2]) if len(item) > 2 else wt
        cols.add("metrics", (*base, item[0], _num(item[1]), t, *dims, off))
    cols.add("metric_rows", (row["step"], row.get("mode"), json.dumps(row), off))
