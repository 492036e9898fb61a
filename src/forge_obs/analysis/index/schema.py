"""The index's tables: what each stores, column by column (Arrow types).

Stored tables (Parquet segments; times are *raw* epoch µs: the writer's ``t0`` plus the record's
offset, before the host's clock correction, which the views add from ``streams.offset_us`` so
that a tighter clock sample read later never rewrites a row):

- ``spans``: one row per finished span; ``sid`` is the process session (``streams``), ``fid``
  and ``off`` the source file and the byte offset of its record (the reading order);
- ``events``: instants (``kind`` ``event``), ``set_step`` (``step``) and step tags (``tag``);
- ``lanes``: each track's label (asyncio task or thread) per session;
- ``metrics``: one row per value of ``metrics.jsonl`` (as the ``metrics`` view);
- ``metric_rows``: each well-formed row of ``metrics.jsonl`` as JSON text, by ``mode``
  (``forge-obs show`` prints these);
- ``cells``: the doctor's per-step evidence, written with each segment of ``spans``
  (:mod:`forge_obs.analysis.index.cells`): its spans per session, source file, span name and
  step, their count, summed and longest duration, first start, last end, CPU time and first and
  last byte offset;
- per controller step, computed once when the step is indexed (``forge_obs.analysis.critical_path``):
  ``steps`` (its window, root span, duration, whether unfinished, the stage the answer names),
  ``path`` (its critical path's segments, in order), ``stages`` (time on the path per stage),
  ``slack`` (per process: busy, waiting, idle, on the path).

Rewritten whole at every update (small): ``streams`` (one row per process session), ``opens``
(spans begun and not ended yet).

The doctor's per-step evidence (per attempt, mesh, span name, step and rank: the summed duration
and the extent of that rank's spans) is the ``span_steps`` view over ``cells``
(:data:`EVIDENCE_COLS`): the shape the doctor's straggler, slowdown and stall rules read.
"""

from __future__ import annotations

import functools

from forge_obs.core.identity import PARALLEL_DIMS

__all__ = ["TABLES", "STEP_TABLES", "SPAN_COLS", "EVENT_COLS", "METRIC_COLS", "DIM_COLS", "PATH_COLS",
           "SLACK_COLS", "EVIDENCE_COLS", "arrow_schema"]

_I32, _I64, _F64, _STR, _BOOL, _I8 = "int32", "int64", "float64", "string", "bool", "int8"

#: stored columns of each table
TABLES: dict[str, dict[str, str]] = {
    "spans": {"sid": _I32, "actor": _STR, "lane": _I64, "name": _STR, "step": _I64, "start": _I64, "end": _I64, "dur": _I64,
              "error": _STR, "flow": _STR, "flow_t": _I8, "attrs": _STR, "link": _STR, "cut": _BOOL,
              "cpu": _I64, "fid": _I32, "off": _I64},
    "events": {"sid": _I32, "actor": _STR, "lane": _I64, "kind": _STR, "name": _STR, "step": _I64, "ts": _I64,
               "flow": _STR, "flow_t": _I8, "attrs": _STR, "link": _STR, "fid": _I32, "off": _I64},
    "opens": {"sid": _I32, "actor": _STR, "lane": _I64, "name": _STR, "step": _I64, "start": _I64,
              "flow": _STR, "flow_t": _I8, "attrs": _STR, "link": _STR, "fid": _I32, "off": _I64},
    "lanes": {"sid": _I32, "lane": _I64, "label": _STR},
    "streams": {"sid": _I32, "run_id": _STR, "attempt": _I32, "host": _STR, "pid": _I64, "session": _STR,
                "mesh": _STR, "actor": _STR, "rank": _I32, "ctl": _BOOL, "offset_us": _I64, "first_ts": _I64,
                "last_ts": _I64, "clean": _BOOL, "records": _I64, "dropped": _I64, "start": _F64,
                **{d: _I32 for d in PARALLEL_DIMS}},
    "metrics": {"run_id": _STR, "step": _I64, "mode": _STR, "source": _STR, "mesh": _STR, "actor": _STR,
                "rank": _I32, "key": _STR, "value": _F64, "wall_time": _F64, **{d: _I32 for d in PARALLEL_DIMS},
                "off": _I64},
    "metric_rows": {"step": _I64, "mode": _STR, "json": _STR, "off": _I64},
    "cells": {"sid": _I32, "fid": _I32, "name": _STR, "step": _I64, "n": _I64, "dur": _I64, "dur_max": _I64,
              "lo": _I64, "hi": _I64, "cpu": _I64, "cpu_dur": _I64, "off": _I64, "off_last": _I64},
    "steps": {"step": _I64, "root": _STR, "start_us": _I64, "end_us": _I64, "duration_s": _F64,
              "unfinished": _BOOL, "cause": _I32, "idle_mesh": _STR, "idle_s": _F64},
    "path": {"step": _I64, "seq": _I32, "mesh": _STR, "actor": _STR, "rank": _I32, "host": _STR, "pid": _I64,
             "task": _STR, "name": _STR, "span_step": _I64, "start_us": _I64, "end_us": _I64, "duration_s": _F64,
             "link": _STR, "controller": _BOOL, "wait": _BOOL, "unfinished": _BOOL, "unexplained": _BOOL},
    "stages": {"step": _I64, "seq": _I32, "mesh": _STR, "actor": _STR, "rank": _I32, "name": _STR,
               "path_s": _F64, "share": _F64, "controller": _BOOL, "wait": _BOOL, "root": _BOOL,
               "unfinished": _BOOL},
    "slack": {"step": _I64, "mesh": _STR, "actor": _STR, "rank": _I32, "host": _STR, "pid": _I64,
              "busy_s": _F64, "waiting_s": _F64, "idle_s": _F64, "on_path_s": _F64},
}
#: tables whose rows belong to a controller step (replaced when the step is computed again)
STEP_TABLES = ("steps", "path", "stages", "slack")

#: the SQL views' columns (docs/timeline.md, "Views"); the last ones of spans, events and
#: metrics are the rank's coordinates in the parallel dimensions (NULL where it has none)
DIM_COLS = {d: "INTEGER" for d in PARALLEL_DIMS}
SPAN_COLS = {
    "run_id": "VARCHAR", "attempt": "INTEGER", "host": "VARCHAR", "pid": "BIGINT", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "task": "VARCHAR", "name": "VARCHAR", "step": "BIGINT",
    "start_us": "BIGINT", "end_us": "BIGINT", "dur_us": "BIGINT", "finished": "BOOLEAN", "error": "VARCHAR",
    "flow": "VARCHAR", "attrs": "VARCHAR", **DIM_COLS, "dur_ms": "DOUBLE", "cpu_us": "BIGINT",
}
EVENT_COLS = {
    "run_id": "VARCHAR", "attempt": "INTEGER", "host": "VARCHAR", "pid": "BIGINT", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "task": "VARCHAR", "kind": "VARCHAR", "name": "VARCHAR",
    "step": "BIGINT", "ts_us": "BIGINT", "flow": "VARCHAR", "attrs": "VARCHAR", **DIM_COLS,
}
METRIC_COLS = {
    "run_id": "VARCHAR", "step": "BIGINT", "mode": "VARCHAR", "source": "VARCHAR", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "key": "VARCHAR", "value": "DOUBLE", "wall_time": "DOUBLE", **DIM_COLS,
}
#: ``critical_path``: one row per segment of a controller step's critical path, in time order
PATH_COLS = {
    "step": "BIGINT", "seq": "INTEGER", "mesh": "VARCHAR", "actor": "VARCHAR", "rank": "INTEGER", "host": "VARCHAR",
    "pid": "BIGINT", "task": "VARCHAR", "name": "VARCHAR", "start_us": "BIGINT", "end_us": "BIGINT",
    "dur_ms": "DOUBLE", "link": "VARCHAR", "wait": "BOOLEAN", "unfinished": "BOOLEAN", "step_ms": "DOUBLE",
}
#: ``slack``: per controller step and process, its busy, waiting and idle time and its time on the path
SLACK_COLS = {
    "step": "BIGINT", "mesh": "VARCHAR", "actor": "VARCHAR", "rank": "INTEGER", "host": "VARCHAR", "pid": "BIGINT",
    "busy_ms": "DOUBLE", "waiting_ms": "DOUBLE", "idle_ms": "DOUBLE", "on_path_ms": "DOUBLE", "step_ms": "DOUBLE",
}
#: ``span_steps``: the doctor's per-step evidence, per attempt, mesh (the peer group: the mesh,
#: and the pipeline stage of an SPMD rank), span name, step and rank
EVIDENCE_COLS = {
    "attempt": "INTEGER", "mesh": "VARCHAR", "peer_group": "VARCHAR", "name": "VARCHAR", "step": "BIGINT",
    "rank": "INTEGER", "dur_us": "BIGINT", "start_us": "BIGINT", "end_us": "BIGINT", "spans": "BIGINT",
}


@functools.lru_cache(maxsize=None)
def arrow_schema(table: str):
    """The Arrow schema of stored table ``table`` (one object per table: Arrow schemas are immutable)."""
    import pyarrow as pa

    return pa.schema([(name, pa.bool_() if typ == "bool" else getattr(pa, typ)()) for name, typ in TABLES[table].items()])
