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
- ``span_steps``: attempt, mesh, peer_group, name, step, rank, dur_us, start_us, end_us, spans

and, last in ``spans``, ``events`` and ``metrics``, the rank's coordinates in the parallel dimensions of an SPMD job:
pp, dp_replicate, dp_shard, cp, tp (NULL where the rank has none), e.g. the slowest DP rank of
each pipeline stage: ``SELECT pp, dp_shard, avg(dur_ms) FROM spans WHERE name='train_step' GROUP BY ALL``.

The views read the run's index (:mod:`forge_obs.analysis.index`: Parquet segments that DuckDB
reads where they lie), brought up to date first: a question about one step reads the row groups
that can hold it, whatever the run's length. ``span_steps`` is the doctor's per-step evidence
(per attempt, mesh, span name, step and rank: summed duration, extent, count).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from forge_obs.analysis.index.schema import (DIM_COLS, EVENT_COLS, EVIDENCE_COLS, METRIC_COLS, PATH_COLS, SLACK_COLS,
                                             SPAN_COLS)

__all__ = ["SPAN_COLS", "EVENT_COLS", "METRIC_COLS", "DIM_COLS", "PATH_COLS", "SLACK_COLS", "EVIDENCE_COLS", "VIEWS",
           "connect", "format_result"]

#: the views a query can name
VIEWS = ("spans", "events", "metrics", "critical_path", "slack", "span_steps")


def connect(run_dir: "str | Path", database: str = ":memory:") -> Any:
    """A DuckDB connection with views ``metrics``, ``spans``, ``events``, ``critical_path``,
    ``slack``, ``span_steps`` over the run's index (updated first). ``database`` is kept for
    compatibility: the views are always on an in-memory database."""
    from forge_obs.analysis.index import open_index

    return open_index(run_dir).connect()


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
