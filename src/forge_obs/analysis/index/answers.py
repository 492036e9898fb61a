"""``forge-obs why`` as lookups: each step's result is read back from the per-step tables, and
its one-line answer and comparison are made against the medians of the run's fast steps, which
are computed once per index update (in DuckDB) and kept in ``index/answers.json``.

The dicts are those :func:`forge_obs.analysis.critical_path.why` has always returned.
"""

from __future__ import annotations

import json
import os
from typing import Any

from forge_obs.analysis.critical_path.summary import answer, compare_to, slowest_in, step_result, total_by
from forge_obs.analysis.doctor.subjects import replica_family

__all__ = ["why", "results", "all_results", "reference", "explain"]


def _dicts(cur: Any) -> list[dict]:
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def results(con: Any, steps: list) -> list[dict]:
    """The stored results of ``steps`` (in that order), as
    :func:`~forge_obs.analysis.critical_path.summary.step_result` made them,
    with ``cause`` and ``idle`` (no answer line yet)."""
    if not steps:
        return []
    con.execute("CREATE OR REPLACE TEMP TABLE _want AS SELECT unnest(?::BIGINT[]) AS step", [list(steps)])
    head = {r["step"]: r for r in _dicts(con.execute("SELECT * FROM _steps WHERE step IN (SELECT step FROM _want)"))}
    parts: dict[str, dict] = {}
    for table, order in (("path", "seq"), ("stages", "seq"), ("slack", "mesh, rank, host, pid")):
        by: dict[int, list] = {}
        parts[table] = by
        for r in _dicts(con.execute(f"SELECT * FROM _{table} WHERE step IN (SELECT step FROM _want) ORDER BY step, {order}")):
            by.setdefault(r.pop("step"), []).append(r)
    return [_result(head[n], parts, n) for n in steps if n in head]


def _result(h: dict, parts: dict, n: int) -> dict:
    path = [dict(p, step=p.pop("span_step")) for p in parts["path"].get(n, [])]
    for p in path:
        p.pop("seq")
    stages = [{k: v for k, v in a.items() if k != "seq"} for a in parts["stages"].get(n, [])]
    r = {"step": n, "root": h["root"], "start_us": h["start_us"], "end_us": h["end_us"], "duration_s": h["duration_s"],
         "unfinished": h["unfinished"], "path": path, "stages": stages, "by_mesh": total_by(stages, "mesh"),
         "by_name": total_by(stages, "name"), "slack": parts["slack"].get(n, [])}
    c = stages[h["cause"]] if h["cause"] is not None else None
    r["stored_cause"] = c
    r["stored_idle"] = {"mesh": h["idle_mesh"], "idle_s": h["idle_s"]} if h["idle_mesh"] is not None else None
    return r


#: the median of a group's ``path_s`` (``l``: its values sorted, ``n`` of them) as
#: :func:`statistics.median` computes it: the middle value, or the mean of the two middle ones
_MEDIAN = "CASE WHEN n % 2 = 1 THEN l[(n + 1) // 2] ELSE (l[n // 2] + l[n // 2 + 1]) / 2 END"
#: a group's sorted values and their count, sorted once
_SORTED = "list_sort(list(path_s)) AS l, count(*) AS n"


def _compute_reference(con: Any) -> dict:
    """The fast half of the finished steps (duration at most the lower median) and the median
    time on the path of every stage key over them, as
    :func:`~forge_obs.analysis.critical_path.summary.medians` takes them: per stage, per mesh and
    span name, per replica family and span name (a mesh that is its own family counts twice
    there)."""
    done = sorted(r[0] for r in con.execute("SELECT duration_s FROM _steps WHERE NOT unfinished").fetchall())
    if not done:
        return {"fast_steps": 0, "fast_median_s": None, "medians": []}
    cut = done[(len(done) - 1) // 2]
    fast = [x for x in done if x <= cut]
    k = len(fast)
    fast_med = fast[k // 2] if k % 2 else (fast[k // 2 - 1] + fast[k // 2]) / 2
    meshes = [r[0] for r in con.execute("SELECT DISTINCT mesh FROM _stages").fetchall()]
    con.execute("CREATE OR REPLACE TEMP TABLE _fam AS SELECT unnest(?::VARCHAR[]) AS mesh, unnest(?::VARCHAR[]) AS fam",
                [meshes, [replica_family(m) for m in meshes]])
    con.execute("CREATE OR REPLACE TEMP TABLE _fast AS SELECT a.mesh, a.actor, a.rank, a.name, a.path_s, _fam.fam "
                "FROM _stages a JOIN _fam USING (mesh) "
                "WHERE a.step IN (SELECT step FROM _steps WHERE NOT unfinished AND duration_s <= ?)", [cut])
    rows = con.execute(f"SELECT mesh, actor, rank, name, {_MEDIAN}, n FROM (SELECT mesh, actor, rank, name, {_SORTED} "
                       "FROM _fast GROUP BY ALL)").fetchall()
    rows += con.execute(f"SELECT k, NULL, NULL, name, {_MEDIAN}, n FROM (SELECT k, name, {_SORTED} FROM ("
                        "SELECT mesh AS k, name, path_s FROM _fast UNION ALL SELECT fam, name, path_s FROM _fast) "
                        "GROUP BY k, name)").fetchall()
    return {"fast_steps": k, "fast_median_s": fast_med, "medians": [list(r) for r in rows]}


def reference(idx: Any, con: Any) -> tuple[dict, int, Any]:
    """``(medians, fast steps, their median duration)``, cached per index update."""
    path = idx.dir / "answers.json"
    try:
        data = json.loads(path.read_text())
        if data.get("gen") != idx.gen:
            raise ValueError
    except (OSError, ValueError):
        data = dict(_compute_reference(con), gen=idx.gen)
        try:
            tmp = idx.dir / f".answers.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only index: computed again next time
    med = {}
    for k1, k2, k3, k4, m, n in data["medians"]:
        med[(k1, k2, k3, k4)] = (m, n)
    return med, data["fast_steps"], data["fast_median_s"]


def why(idx: Any, steps: "list | None" = None, slowest: "int | None" = None, con: Any = None) -> dict:
    """:func:`forge_obs.analysis.critical_path.why` over the index ``idx`` (``con``: a connection
    of it, :meth:`~forge_obs.analysis.index.RunIndex.connect`)."""
    con = con or idx.connect()
    durs = sorted(r[0] for r in con.execute("SELECT duration_s FROM _steps").fetchall())
    if steps is not None:
        want = list(steps)
        have = {r[0] for r in con.execute("SELECT step FROM _steps WHERE step IN (SELECT unnest(?::BIGINT[]))",
                                          [want]).fetchall()}
        missing = [s for s in want if s not in have]
        if missing:
            lo_hi = con.execute("SELECT min(step), max(step) FROM _steps").fetchone()
            span = f"{lo_hi[0]}..{lo_hi[1]}" if durs else "none"
            raise ValueError(f"step {missing[0]} has no controller step in {idx.run_dir} (steps: {span})")
    else:
        want = [r[0] for r in con.execute("SELECT step FROM _steps ORDER BY unfinished DESC, duration_s DESC, step "
                                          "LIMIT ?", [max(int(slowest or 1), 1)]).fetchall()]
    chosen = results(con, want)
    med, n_fast, fast_med = reference(idx, con)
    for r in chosen:
        r.pop("stored_cause"), r.pop("stored_idle")
        answer(r, med, fast_med)
        r["compare"] = compare_to(r, med, n_fast, fast_med)
    return {"run_dir": str(idx.run_dir), "steps_total": len(durs),
            "median_step_s": durs[(len(durs) - 1) // 2] if durs else None, "steps": chosen}


def all_results(idx: Any, first: "int | None" = None, last: "int | None" = None) -> list[dict]:
    """Every stored step's result in ``[first, last]`` with its answer line (no comparison): what
    :func:`forge_obs.analysis.critical_path.analyse` returns."""
    con = idx.connect()
    lo, hi = first if first is not None else -(1 << 62), last if last is not None else 1 << 62
    want = [r[0] for r in con.execute("SELECT step FROM _steps WHERE step BETWEEN ? AND ? ORDER BY step",
                                      [lo, hi]).fetchall()]
    out = results(con, want)
    med, _n, fast_med = reference(idx, con)
    for r in out:
        r.pop("stored_cause"), r.pop("stored_idle")
        answer(r, med, fast_med)
    return out


def explain(idx: Any, first_step: int, last_step: int, history: int = 32) -> "dict | None":
    """:func:`forge_obs.analysis.critical_path.explain` over the index ``idx``: the slowest
    finished step stored in ``[first_step, last_step]`` with its answer, judged against the fast
    half of the (up to) ``history`` stored steps before it. None when none of those steps is
    stored yet. Reads the steps it needs, whatever the run's length."""
    con = idx.connect()
    want = [r[0] for r in con.execute("SELECT step FROM _steps WHERE step BETWEEN ? AND ? AND NOT unfinished "
                                      "ORDER BY step", [first_step - history, last_step]).fetchall()]
    got = results(con, want)
    for r in got:
        r.pop("stored_cause"), r.pop("stored_idle")
    return slowest_in(got, first_step, last_step)
