"""SQL over a run directory with embedded DuckDB: views ``metrics``, ``spans``, ``events``.

    forge-obs sql runs/exp1 "SELECT mesh, rank, avg(dur_ms) FROM spans WHERE name='train_step' GROUP BY ALL"

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(3)
    >>> with timeline.record_span("train_step"):
    ...     pass
    >>> timeline.close()
    >>> con = connect(run_dir)                    # needs duckdb: pip install 'forge-obs[timeline]'
    >>> con.execute("SELECT name, step, finished FROM spans").fetchall()
    [('train_step', 3, True)]

Views (times in epoch µs, clock-offset corrected; ``attempt`` separates restarts of a resumed run):

- ``spans``: run_id, attempt, host, pid, mesh, actor, rank, task, name, step, start_us, end_us,
  dur_us, dur_ms, finished (false: still open at the end of the data; end_us is then the end of
  the data), error, flow, attrs (JSON text)
- ``events``: run_id, attempt, host, pid, mesh, actor, rank, task, kind ('event' | 'step' |
  'tag'), name, step, ts_us, flow, attrs
- ``metrics``: run_id, step, mode, source (rank label, or 'global'), mesh, actor, rank, key,
  value (DOUBLE; NaN and ±inf preserved), wall_time
- ``critical_path``: step, seq (order on the path), mesh, actor, rank, host, pid, task, name,
  start_us, end_us, dur_ms, link ('root' | 'nested' | 'flow' | 'inferred'), wait, unfinished,
  step_ms (docs/timeline.md, "Critical path")
- ``slack``: step, mesh, actor, rank, host, pid, busy_ms, waiting_ms, idle_ms, on_path_ms, step_ms

and, last in ``spans``, ``events`` and ``metrics``, the rank's coordinates in the parallel dimensions of an SPMD job:
pp, dp_replicate, dp_shard, cp, tp (NULL where the rank has none), e.g. the slowest DP rank of
each pipeline stage: ``SELECT pp, dp_shard, avg(dur_ms) FROM spans WHERE name='train_step' GROUP BY ALL``.

The files are parsed in Python (compact records, JSON ``NaN``) into CSV in a temporary
directory and loaded with DuckDB's CSV reader.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.reader import END, INSTANT, OPEN, SPAN, STEP, TAG
from forge_obs.core.identity import PARALLEL_DIMS

__all__ = ["SPAN_COLS", "EVENT_COLS", "METRIC_COLS", "DIM_COLS", "PATH_COLS", "SLACK_COLS", "connect", "format_result"]

SPAN_COLS = {
    "run_id": "VARCHAR", "attempt": "INTEGER", "host": "VARCHAR", "pid": "BIGINT", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "task": "VARCHAR", "name": "VARCHAR", "step": "BIGINT",
    "start_us": "BIGINT", "end_us": "BIGINT", "dur_us": "BIGINT", "finished": "BOOLEAN", "error": "VARCHAR",
    "flow": "VARCHAR", "attrs": "VARCHAR",
}
EVENT_COLS = {
    "run_id": "VARCHAR", "attempt": "INTEGER", "host": "VARCHAR", "pid": "BIGINT", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "task": "VARCHAR", "kind": "VARCHAR", "name": "VARCHAR",
    "step": "BIGINT", "ts_us": "BIGINT", "flow": "VARCHAR", "attrs": "VARCHAR",
}
METRIC_COLS = {
    "run_id": "VARCHAR", "step": "BIGINT", "mode": "VARCHAR", "source": "VARCHAR", "mesh": "VARCHAR",
    "actor": "VARCHAR", "rank": "INTEGER", "key": "VARCHAR", "value": "DOUBLE", "wall_time": "DOUBLE",
}
#: the last columns of every view: the rank's coordinates in the parallel dimensions (NULL when
#: it has none: a Monarch rank, the global rows)
DIM_COLS = {d: "INTEGER" for d in PARALLEL_DIMS}
SPAN_COLS.update(DIM_COLS)
EVENT_COLS.update(DIM_COLS)
METRIC_COLS.update(DIM_COLS)


def _dims(coords: Any) -> tuple:
    """A row's parallel coordinates, in :data:`DIM_COLS`' order."""
    if not isinstance(coords, dict):
        return _NO_DIMS
    return tuple(v if type(v := coords.get(d)) is int else None for d in PARALLEL_DIMS)


_NO_DIMS = (None,) * len(PARALLEL_DIMS)

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


def _num(v: Any) -> Any:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return repr(float(v)) if isinstance(v, float) and not math.isfinite(v) else v
    return None


def _flow(ex: dict | None) -> Any:
    if ex and "f" in ex:
        f = ex["f"]
        return f if isinstance(f, str) else json.dumps(f, default=str)
    return None


def _attrs(ex: dict | None) -> Any:
    if ex and ex.get("a"):
        return json.dumps(ex["a"], default=str)
    return None


def _write_timeline(run_dir: Path, spans_csv: Path, events_csv: Path) -> None:
    run = reader.scan(run_dir)
    opens = []
    with open(spans_csv, "w", newline="", encoding="utf-8") as fs, open(events_csv, "w", newline="", encoding="utf-8") as fe:
        ws, we = csv.writer(fs), csv.writer(fe)
        ws.writerow(SPAN_COLS)
        we.writerow(EVENT_COLS)
        ident: dict = {}

        def who(st: reader.Stream) -> tuple:
            w = ident.get(id(st))
            if w is None or w[5] != st.actor:
                w = ident[id(st)] = (st.header.get("run"), st.attempt, st.host, st.pid, st.mesh, st.actor, st.rank,
                                     _dims(st.header.get("coords")))
                # (run, attempt, host, pid, mesh, actor, rank, dims) -- index 5 is the actor
            return w

        for it in reader.walk(run):
            k = it[0]
            if k is SPAN:
                _k, st, lane, name, step, ts, dur, ex, _cpu = it
                w = who(st)
                ws.writerow((*w[:7], st.lanes.get(lane, lane), name, step, ts, ts + dur, dur, True,
                             ex.get("e") if ex else None, _flow(ex), _attrs(ex), *w[7]))
            elif k is INSTANT:
                _k, st, lane, name, step, ts, ex = it
                w = who(st)
                we.writerow((*w[:7], st.lanes.get(lane, lane), "event", name, step, ts, _flow(ex), _attrs(ex), *w[7]))
            elif k is STEP:
                _k, st, lane, step, ts = it
                w = who(st)
                we.writerow((*w[:7], st.lanes.get(lane, lane), "step", "step", step, ts, None, None, *w[7]))
            elif k is TAG:
                _k, st, lane, step, tag, ts = it
                w = who(st)
                we.writerow((*w[:7], st.lanes.get(lane, lane), "tag", tag, step, ts, None, None, *w[7]))
            elif k is OPEN:
                opens.append(it)
            elif k is END:
                pass
        end = reader.run_end(run) or 0
        for _k, st, lane, name, step, ts, ex in opens:
            w = who(st)
            ws.writerow((*w[:7], st.lanes.get(lane, lane), name, step, ts, end, max(end - ts, 0), False,
                         None, _flow(ex), _attrs(ex), *w[7]))


def _write_metrics(run_dir: Path, path: Path) -> None:
    from forge_obs.analysis.store import read_jsonl

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLS)
        src = run_dir / "metrics.jsonl"
        if not src.exists():
            return
        for row in read_jsonl(src):
            s = row.get("source") or {}
            label = s.get("label", "global") if s else "global"
            base = (row.get("run_id"), row.get("step"), row.get("mode"), label, s.get("mesh"), s.get("actor"), s.get("rank"))
            wt = row.get("wall_time")
            dims = _dims(s.get("coords")) if s else _NO_DIMS
            for key, v in (row.get("metrics") or {}).items():
                w.writerow((*base, key, _num(v), wt, *dims))
            for item in row.get("values") or ():
                try:
                    key, v, t = item[0], item[1], item[2] if len(item) > 2 else wt
                except (TypeError, IndexError):
                    continue
                w.writerow((*base, key, _num(v), t, *dims))


def _write_paths(run_dir: Path, path_csv: Path, slack_csv: Path) -> None:
    """Every controller step's critical path and slack (:mod:`forge_obs.analysis.critical_path`)."""
    from forge_obs.analysis.critical_path import analyse

    with open(path_csv, "w", newline="", encoding="utf-8") as fp, open(slack_csv, "w", newline="", encoding="utf-8") as fs:
        wp, wsl = csv.writer(fp), csv.writer(fs)
        wp.writerow(PATH_COLS)
        wsl.writerow(SLACK_COLS)
        try:
            results = analyse(run_dir)
        except Exception as e:  # noqa: BLE001 - the other views stay usable; the tables stay empty
            logging.getLogger("forge_obs").warning("forge_obs: %s: no critical_path / slack tables (%s)", run_dir, e)
            results = []
        for r in results:
            step_ms = r["duration_s"] * 1e3
            for i, p in enumerate(r["path"]):
                wp.writerow((r["step"], i, p["mesh"], p["actor"], p["rank"], p["host"], p["pid"], p["task"], p["name"],
                             p["start_us"], p["end_us"], p["duration_s"] * 1e3, p["link"], p["wait"], p["unfinished"],
                             step_ms))
            for x in r["slack"]:
                wsl.writerow((r["step"], x["mesh"], x["actor"], x["rank"], x["host"], x["pid"], x["busy_s"] * 1e3,
                              x["waiting_s"] * 1e3, x["idle_s"] * 1e3, x["on_path_s"] * 1e3, step_ms))


def _cols(d: dict[str, str]) -> str:
    return "{" + ", ".join(f"'{k}': '{v}'" for k, v in d.items()) + "}"


def connect(run_dir: "str | Path", database: str = ":memory:") -> Any:
    """A DuckDB connection with views ``metrics``, ``spans``, ``events``, ``critical_path``,
    ``slack`` loaded from the run."""
    import duckdb

    run_dir = Path(run_dir)
    con = duckdb.connect(database)
    with tempfile.TemporaryDirectory(prefix="forge_obs_sql_") as tmp:
        t = Path(tmp)
        _write_timeline(run_dir, t / "spans.csv", t / "events.csv")
        _write_metrics(run_dir, t / "metrics.csv")
        _write_paths(run_dir, t / "critical_path.csv", t / "slack.csv")
        for name, cols in (("spans", SPAN_COLS), ("events", EVENT_COLS), ("metrics", METRIC_COLS),
                           ("critical_path", PATH_COLS), ("slack", SLACK_COLS)):
            p = str(t / f"{name}.csv").replace("'", "''")
            con.execute(
                f"CREATE TABLE _{name} AS SELECT * FROM read_csv('{p}', header=true, auto_detect=false, "
                f"columns={_cols(cols)}, quote='\"', escape='\"', nullstr='')"
            )
    con.execute("CREATE VIEW spans AS SELECT *, dur_us / 1000.0 AS dur_ms FROM _spans")
    con.execute("CREATE VIEW events AS SELECT * FROM _events")
    con.execute("CREATE VIEW metrics AS SELECT * FROM _metrics")
    con.execute("CREATE VIEW critical_path AS SELECT * FROM _critical_path")
    con.execute("CREATE VIEW slack AS SELECT * FROM _slack")
    return con


def format_result(cols: list[str], rows: list[tuple], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps([dict(zip(cols, r)) for r in rows], default=str)
    if fmt == "csv":
        import io

        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(cols)
        w.writerows(rows)
        return buf.getvalue().rstrip("\n")
    cells = [[("NULL" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)
