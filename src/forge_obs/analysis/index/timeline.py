"""The timeline read back from the index as the reader's items, per process session: what the
Perfetto export (:mod:`forge_obs.analysis.trace`) streams, filtered on steps, meshes and ranks by
DuckDB before any row reaches Python.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

from forge_obs.analysis import reader
from forge_obs.analysis.index.rows import FLOW_INT, FLOW_STR
from forge_obs.analysis.index.steps import streams_of
from forge_obs.analysis.reader import INSTANT, OPEN, SPAN, STEP, TAG

__all__ = ["sessions", "items_by_stream", "extras"]

_BATCH = 65536


def sessions(idx: Any, con: Any, keep: "Callable[[dict], bool] | None" = None) -> reader.Run:
    """The run's process sessions as a :class:`~forge_obs.analysis.reader.Run` (clock offsets and
    attempts applied, lane labels, ``first_ts``/``last_ts`` corrected), those ``keep`` accepts."""
    st = idx.manifest.state
    offsets = dict(con.execute("SELECT host, offset_us FROM _streams").fetchall())
    attempts = sorted(st.get("starts", []))
    lanes: dict = {}
    for sid, lane, label in con.execute("SELECT sid, lane, label FROM _lane_labels").fetchall():
        lanes.setdefault(sid, {})[lane] = label
    by_sid = streams_of([s for s in st.get("streams", []) if keep is None or keep(s["header"])], lanes, offsets,
                        attempts)
    run = reader.Run(idx.run_dir, {s.key: s for s in by_sid.values()}, [], offsets, attempts)
    run.by_sid = by_sid
    return run


def extras(err: Any, flow: Any, ft: Any, attrs: Any, cut: Any) -> "dict | None":
    """A record's extras (error, flow id, attributes, cut by shutdown) from a row's columns."""
    ex: dict = {}
    if attrs is not None:
        ex["a"] = json.loads(attrs)
    if flow is not None:
        ex["f"] = flow if ft == FLOW_STR else int(flow) if ft == FLOW_INT else json.loads(flow)
    if err is not None:
        ex["e"] = err
    if cut:
        ex["x"] = "shutdown"
    return ex or None


_ROWS = """
    SELECT x.sid, f.rnk, x.off, 0 AS k, x.lane, x.name, x.step, x.start + s.offset_us AS ts, x.dur, x.error, x.flow,
           x.flow_t, x.attrs, x.cut, x.cpu FROM _spans x {where_x}
    UNION ALL
    SELECT x.sid, f.rnk, x.off, CASE x.kind WHEN 'event' THEN 1 WHEN 'step' THEN 2 ELSE 3 END, x.lane, x.name, x.step,
           x.ts + s.offset_us, NULL, NULL, x.flow, x.flow_t, x.attrs, NULL, NULL FROM _events x {where_x}
    UNION ALL
    SELECT x.sid, 1 << 30, x.off, 4, x.lane, x.name, x.step, x.start + s.offset_us, NULL, NULL, x.flow, x.flow_t,
           x.attrs, NULL, NULL FROM _opens x JOIN _streams s ON s.sid = x.sid WHERE {cond}
    ORDER BY 1, 2, 3"""


def _item(st: reader.Stream, r: tuple) -> tuple:
    _sid, _rnk, _off, k, lane, name, step, ts, dur, err, flow, ft, attrs, cut, cpu = r
    if k == 0:
        return (SPAN, st, lane, name, step, ts, dur, extras(err, flow, ft, attrs, cut), cpu)
    if k == 1:
        return (INSTANT, st, lane, name, step, ts, extras(None, flow, ft, attrs, None))
    if k == 2:
        return (STEP, st, lane, step, ts)
    if k == 3:
        return (TAG, st, lane, step, name, ts)
    return (OPEN, st, lane, name, step, ts, extras(None, flow, ft, attrs, None))


def items_by_stream(con: Any, run: reader.Run, steps: "tuple | None") -> Iterator[tuple]:
    """``(stream, items)`` per process session of ``run`` (its records in reading order, its
    open spans last), keeping the records whose step is in ``steps`` (all when None)."""
    cond = "x.sid IN (SELECT unnest(?::INTEGER[]))"
    params: list = [list(run.by_sid)]
    if steps is not None:
        cond += " AND x.step BETWEEN ? AND ?"
        params += list(steps)
    where_x = f"JOIN _streams s ON s.sid = x.sid JOIN _frank f ON f.fid = x.fid WHERE {cond}"
    cur = con.execute(_ROWS.format(where_x=where_x, cond=cond), params * 3)
    sid, items = None, []
    for batch in iter(lambda: cur.fetchmany(_BATCH), []):
        for r in batch:
            if r[0] != sid:
                if items:
                    yield run.by_sid[sid], items
                sid, items = r[0], []
            items.append(_item(run.by_sid[sid], r))
    if items:
        yield run.by_sid[sid], items
