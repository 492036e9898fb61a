"""The doctor's per-step evidence stored in the index (``cells``, forge_obs.analysis.index.cells):
written with every segment of spans, it adds up to the spans it stands for however the run was
indexed (in parts, live, torn lines, merged segments), and the doctor reads it to the same
tables and findings as a pass over the files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from forge_obs.analysis.index import open_index

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

#: per (session, file, name, step): count, summed and longest duration, first start, last end,
#: summed CPU time, the wall time of the spans with CPU time, first and last byte offset
_FROM_CELLS = ("SELECT sid, fid, name, step, sum(n), sum(dur), max(dur_max), min(lo), max(hi), sum(cpu), sum(cpu_dur), "
               "min(off), max(off_last) FROM _cells GROUP BY ALL")
_FROM_SPANS = ("SELECT sid, fid, name, step, count(*), sum(dur), max(dur), min(start), max(start + dur), sum(cpu), "
               "sum(dur) FILTER (WHERE cpu IS NOT NULL), min(off), max(off) FROM _spans GROUP BY ALL")

#: the ``span_steps`` view as it was before the cells: aggregated over every span
_SPAN_STEPS = """SELECT st.attempt, st.mesh,
    CASE WHEN st.pp IS NULL THEN st.mesh ELSE st.mesh || '[pp=' || st.pp || ']' END, x.name, x.step, st.rank, sum(x.dur),
    min(x.start + st.offset_us), max(x.start + x.dur + st.offset_us), count(*)
    FROM _spans x JOIN _streams st ON st.sid = x.sid WHERE x.step IS NOT NULL GROUP BY ALL"""


def layered_spans(slow_rank: int = 2, from_step: int = 8):
    """Many spans of one name per rank and step (a layer each), CPU time on some of them only
    (the first two layers, and not on rank 1's at odd steps), a rank that becomes slow."""
    def spans(mesh, rank, step):
        slow = 3.0 if rank == slow_rank and step >= from_step else 1.0
        layers = [("layer", 0.002 * slow, 0.0015 * slow) if i < 2 and (rank != 1 or step % 2 == 0)
                  else ("layer", 0.002 * slow) for i in range(5)]
        return layers + [(None, 0.001), ("optimizer_step", 0.003 + 0.0001 * ((rank + step) % 3), 0.002)]
    return spans


def _written(tmp: Path) -> dict:
    from tests.support.doctor_runs import write_timeline

    write_timeline(tmp, {"trainer": 3}, 30, layered_spans())
    return {p.name: p.read_bytes() for p in (tmp / "events").glob("*.jsonl")}


def _rows(con, sql: str) -> list:
    return sorted(con.execute(sql).fetchall(), key=repr)


@pytest.mark.parametrize("how,rounds", [("", 1), ("", 11), ("live", 11), ("parallel", 3)])
def test_stored_cells_add_up_to_the_spans_and_the_doctor_reads_them_as_the_files(tmp_path, how, rounds):
    from forge_obs.analysis.doctor import diagnose_run
    from forge_obs.analysis.index import build
    from tests.analysis.test_index import _grow, assert_same_doctor

    full = _written(tmp_path / "src")
    run_dir = tmp_path / "run"
    (run_dir / "events").mkdir(parents=True)
    was, build.PARALLEL_BYTES = build.PARALLEL_BYTES, 0 if how == "parallel" else build.PARALLEL_BYTES
    try:
        _grow(run_dir, {run_dir / "events" / n: b for n, b in full.items()}, random.Random(rounds), rounds,
              live=how == "live")
        idx = open_index(run_dir)
    finally:
        build.PARALLEL_BYTES = was
    con = idx.connect()
    cells, spans = _rows(con, _FROM_CELLS), _rows(con, _FROM_SPANS)
    assert cells == spans
    view = "SELECT attempt, mesh, peer_group, name, step, rank, dur_us, start_us, end_us, spans FROM span_steps"
    assert _rows(con, view) == _rows(con, _SPAN_STEPS)
    assert con.execute("SELECT count(*) FROM _cells").fetchone()[0] < con.execute("SELECT count(*) FROM _spans").fetchone()[0]
    assert any(r[9] is None for r in spans) and any(r[9] is not None for r in spans)  # CPU time on some only
    assert_same_doctor(run_dir)
    found = diagnose_run(run_dir).findings
    assert [(f.kind, f.where) for f in found if f.kind == "straggler"] == [("straggler", "trainer/Trainer/r2")]
    assert found[0].details["cpu_ratio"] == pytest.approx(3.0, rel=0.05)  # read from the cells' CPU time


def test_an_index_of_the_format_before_the_cells_is_built_again(tmp_path):
    """An index written before the cells were stored has none: it is rebuilt, not read as a run
    without spans."""
    import json

    from forge_obs.analysis.doctor import tables
    from forge_obs.analysis.doctor.config import DoctorConfig
    from forge_obs.analysis.index import store

    _written(tmp_path)
    idx = open_index(tmp_path)
    man = json.loads((idx.dir / "manifest.json").read_text())
    man["format"] = store.FORMAT - 1
    del man["tables"]["cells"]
    (idx.dir / "manifest.json").write_text(json.dumps(man))
    old_files = {s["file"] for segs in man["tables"].values() for s in segs}
    (idx.dir / "spans-7-0.parquet").write_bytes(b"a segment a crashed build left, in no manifest")
    t = tables.scan(tmp_path, DoctorConfig())
    assert {g[2] for g in t.per_step} == {"layer", "optimizer_step", "controller_step"}
    con = open_index(tmp_path).connect()
    assert con.execute("SELECT sum(n) FROM _cells").fetchone()[0] == con.execute("SELECT count(*) FROM _spans").fetchone()[0]
    # the old index's segments, and those of no manifest, are deleted; the new ones never reuse their names
    now = {s["file"] for segs in store.Manifest.load(idx.dir).tables.values() for s in segs}
    assert {p.name for p in idx.dir.glob("*.parquet")} == now and not now & (old_files | {"spans-7-0.parquet"})
