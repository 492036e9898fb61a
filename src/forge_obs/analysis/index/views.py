"""DuckDB views over the index's segments: ``spans``, ``events``, ``metrics``,
``critical_path``, ``slack`` (docs/timeline.md, "Views"), ``span_steps`` (the doctor's per-step
evidence, over the stored ``cells``), and the stored tables themselves as ``_<table>`` (``_steps``, ``_stages``, ...).

DuckDB reads the Parquet segments where they lie (projection and filter pushdown, each row
group's min/max): a query filtered on one step reads the row groups that can hold it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forge_obs.analysis.index.schema import PARALLEL_DIMS, TABLES
from forge_obs.analysis.index.store import Manifest

__all__ = ["create_views", "connect", "DUCK_TYPES", "STEP_INPUTS"]

DUCK_TYPES = {"int32": "INTEGER", "int64": "BIGINT", "float64": "DOUBLE", "string": "VARCHAR", "bool": "BOOLEAN",
              "int8": "TINYINT"}


def connect() -> Any:
    """An in-memory DuckDB connection that prints nothing (no progress bar)."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    return con


def _q(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _table(con: Any, d: Path, man: Manifest, table: str) -> None:
    if table in ("streams", "opens"):  # made from the manifest (forge_obs.analysis.index.build.session_rows)
        from forge_obs.analysis.index.build import session_rows

        cols = session_rows(man.state).columns(table)
        types = TABLES[table]
        sel = ", ".join(f'unnest(?::{DUCK_TYPES[t]}[]) AS "{c}"' for c, t in types.items())
        con.execute(f"CREATE OR REPLACE TEMP TABLE _{table} AS SELECT {sel}", [list(cols[c]) for c in types])
        return
    segs = man.tables.get(table, ())
    plain = [str(d / s["file"]) for s in segs if not s.get("skip")]
    parts = [f"SELECT * FROM read_parquet([{', '.join(_q(f) for f in plain)}])"] if plain else []
    # a per-step segment's steps computed again since (their new rows are in a later segment)
    parts += [f"SELECT * FROM read_parquet({_q(str(d / s['file']))}) WHERE step NOT IN ({', '.join(map(str, s['skip']))})"
              for s in segs if s.get("skip")]
    if parts:
        con.execute(f"CREATE OR REPLACE VIEW _{table} AS {' UNION ALL '.join(parts)}")
    else:
        cols = ", ".join(f'CAST(NULL AS {DUCK_TYPES[t]}) AS "{c}"' for c, t in TABLES[table].items())
        con.execute(f"CREATE OR REPLACE VIEW _{table} AS SELECT {cols} WHERE false")


def _dims(alias: str) -> str:
    return ", ".join(f"{alias}.{d}" for d in PARALLEL_DIMS)


#: the stored tables the per-step computation reads
STEP_INPUTS = ("spans", "events", "opens", "streams", "lanes", "steps")


def create_views(con: Any, d: Path, man: Manifest, tables: "tuple | None" = None) -> None:
    """Every view of the module docstring, on ``con`` (``tables``: only those stored tables,
    as ``_<table>``, and none of the SQL views); ``_frank`` gives each source file (fid) its
    rank in the reading order (rows sort by ``_frank.rnk``, then their byte offset)."""
    for table in tables or TABLES:
        _table(con, d, man, table)
    con.execute(f"SET VARIABLE off_hi_neg = {-max([0, *man.state.get('offsets', {}).values()])}")
    files = sorted(man.state.get("files", {}).values(), key=lambda f: f["order"])
    con.execute("CREATE OR REPLACE TEMP TABLE _frank AS SELECT unnest(?::INTEGER[]) AS fid, unnest(?::INTEGER[]) AS rnk",
                [[f["fid"] for f in files], list(range(len(files)))])
    con.execute("CREATE OR REPLACE VIEW _lane_labels AS SELECT sid, lane, max(label) AS label FROM _lanes GROUP BY ALL")
    if tables is not None:
        return
    con.execute("CREATE OR REPLACE VIEW _run_end AS SELECT max(last_ts + offset_us) AS end_us FROM _streams")
    who = ("st.run_id, st.attempt, st.host, st.pid, st.mesh, x.actor, st.rank, "
           "coalesce(l.label, CAST(x.lane AS VARCHAR)) AS task")
    joins = ("JOIN _streams st ON st.sid = x.sid LEFT JOIN _lane_labels l ON l.sid = x.sid AND l.lane = x.lane")
    con.execute(f"""CREATE OR REPLACE VIEW spans AS
        SELECT {who}, x.name, x.step, x.start + st.offset_us AS start_us, x.start + x.dur + st.offset_us AS end_us,
               x.dur AS dur_us, true AS finished, x.error, x.flow, x.attrs, {_dims('st')}, x.dur / 1000.0 AS dur_ms,
               x.cpu AS cpu_us
        FROM _spans x {joins}
        UNION ALL
        SELECT {who}, x.name, x.step, x.start + st.offset_us, e.end_us, greatest(e.end_us - x.start - st.offset_us, 0),
               false, NULL, x.flow, x.attrs, {_dims('st')}, greatest(e.end_us - x.start - st.offset_us, 0) / 1000.0,
               NULL
        FROM _opens x {joins} CROSS JOIN _run_end e""")
    con.execute(f"""CREATE OR REPLACE VIEW events AS
        SELECT {who}, x.kind, x.name, x.step, x.ts + st.offset_us AS ts_us, x.flow, x.attrs, {_dims('st')}
        FROM _events x {joins}""")
    con.execute(f"CREATE OR REPLACE VIEW metrics AS SELECT * EXCLUDE (off) FROM _metrics")
    con.execute("""CREATE OR REPLACE VIEW critical_path AS
        SELECT p.step, p.seq, p.mesh, p.actor, p.rank, p.host, p.pid, p.task, p.name, p.start_us, p.end_us,
               p.duration_s * 1e3 AS dur_ms, p.link, p.wait, p.unfinished, s.duration_s * 1e3 AS step_ms
        FROM _path p JOIN _steps s USING (step)""")
    con.execute("""CREATE OR REPLACE VIEW slack AS
        SELECT x.step, x.mesh, x.actor, x.rank, x.host, x.pid, x.busy_s * 1e3 AS busy_ms, x.waiting_s * 1e3 AS waiting_ms,
               x.idle_s * 1e3 AS idle_ms, x.on_path_s * 1e3 AS on_path_ms, s.duration_s * 1e3 AS step_ms
        FROM _slack x JOIN _steps s USING (step)""")
    con.execute(f"""CREATE OR REPLACE VIEW span_steps AS
        SELECT st.attempt, st.mesh,
               CASE WHEN st.pp IS NULL THEN st.mesh ELSE st.mesh || '[pp=' || st.pp || ']' END AS peer_group,
               x.name, x.step, st.rank, sum(x.dur) AS dur_us, min(x.lo + st.offset_us) AS start_us,
               max(x.hi + st.offset_us) AS end_us, sum(x.n)::BIGINT AS spans
        FROM _cells x JOIN _streams st ON st.sid = x.sid WHERE x.step IS NOT NULL GROUP BY ALL""")
