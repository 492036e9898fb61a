"""The exact step cut, on real Monarch proc meshes and cold starts: a value recorded by work the
controller awaited before ``flush(step)`` is in ``step``; one recorded by work started after
``flush`` returned is in a later step — whatever the number of meshes, for actors in meshes
spawned from inside actors, and for every logging mode. (The README's "Use" example, with its
1.0 / 0.5 / 0.333, runs in tests/project/test_readme.py.)"""

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_obs import Reduce, record_metric
from forge_obs.analysis.store import read_metrics
from tests.support.helpers import aggregating, global_rows, start_logger, stop_process, until_answered

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))), MONARCH_FILE_LOG="error")
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("attempt", range(3))
def test_cold_start_multi_mesh_loop_puts_every_value_in_its_step(tmp_path, attempt):
    """2 meshes x 2 procs, fresh process each time: SUM, MAX, each rank's value and the raw
    stream of every step are exactly that step's."""
    steps = 6
    _run(["-m", "tests.support.cut_programs", "multi_mesh", str(tmp_path), str(steps)], cwd=tmp_path)
    rows = {r["step"]: r["metrics"] for r in read_metrics(tmp_path / "cut")}
    assert [rows[s]["cut/sum"] for s in range(steps)] == [40.0] * steps
    assert [rows[s]["cut/max"] for s in range(steps)] == [s * 100 + 1.0 for s in range(steps)]
    assert [rows[s]["cut/raw"] for s in range(steps)] == [float(s) for s in range(steps)]
    assert all(rows[s]["obs/missing_ranks"] == 0 for s in range(steps))
    ranks = [r for r in read_metrics(tmp_path / "cut", "per_rank_reduce") if r["source"]["mesh"] in ("m0", "m1")]
    per_rank = {(r["step"], r["source"]["label"]): r["metrics"]["cut/sum"] for r in ranks}
    assert sorted(per_rank.values()) == [10.0] * (4 * steps) and len(per_rank) == 4 * steps
    raw = [r for r in read_metrics(tmp_path / "cut", "per_rank_no_reduce")]
    per_step: dict[int, list] = {}
    for r in raw:
        per_step.setdefault(r["step"], []).extend(v for k, v, _ts in r["values"] if k == "cut/raw")
    # every raw value exactly once, in its step: 4 ranks x 1 value per step, the step's number
    assert {s: sorted(v) for s, v in per_step.items()} == {s: [float(s)] * 4 for s in range(steps)}


def test_chain_into_a_mesh_spawned_inside_an_actor_is_cut_exactly(tmp_path):
    """controller -> Relay (its mesh) -> Leaf (a mesh the Relay spawned): each step has exactly
    that step's values from both levels."""
    steps = 5
    _run(["-m", "tests.support.cut_programs", "chain", str(tmp_path), str(steps)], cwd=tmp_path)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "cut")}
    for s in range(steps):
        m = rows[s]["metrics"]
        assert (m["chain/relay"], m["chain/leaf"], m["chain/step"]) == (1.0, 2.0, float(s)), (s, m)
        assert not rows[s].get("missing")


@pytest.mark.parametrize("attempt", range(3))
def test_attach_by_hand_then_spawn_at_once(tmp_path, attempt):
    """``await get_or_create_metric_logger(proc_mesh=pm)`` followed at once by ``pm.spawn``
    (torchforge's provisioner): the child processes start cleanly and the values are in step 0."""
    out = _run(["-m", "tests.support.cut_programs", "attach_then_spawn", str(tmp_path)], cwd=tmp_path)
    assert "partially initialized module" not in out.stderr and "ImportError" not in out.stderr
    m = read_metrics(tmp_path / "cut")[0]["metrics"]
    assert m["cut/sum"] == 20.0 and m["cut/max"] == 1.0


class Stoppable(Actor):
    @endpoint
    async def record(self, v: float) -> None:
        record_metric("hang/v", v, Reduce.SUM)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


async def test_a_hung_rank_costs_one_timeout_then_flush_does_not_wait_for_it(tmp_path):
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 2.0})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="stall")
    a = pm.spawn("Stoppable", Stoppable)
    await mlogger.flush.call_one(0)  # every rank's fetcher is up and answered: step 1 is the first one it hangs in
    await mlogger.wait_idle.call_one()
    await a.record.call(1.0)
    pid1 = await a.slice(procs=1).pid.call_one()
    stop_process(pid1)
    try:
        t0 = time.monotonic()
        await mlogger.flush.call_one(1)  # waits for rank 1's acknowledgement: one timeout
        first_s = time.monotonic() - t0
        await a.slice(procs=0).record.call_one(1.0)
        t0 = time.monotonic()
        await mlogger.flush.call_one(2)  # rank 1 is lagging: not waited for again
        second_s = time.monotonic() - t0
    finally:
        os.kill(pid1, signal.SIGCONT)
    await a.slice(procs=1).pid.call_one()  # rank 1 answers again (and took the old cuts) ...
    await until_answered("stall/Stoppable/r1")  # ... and the controller took its late answers
    await mlogger.flush.call_one(3)
    await mlogger.shutdown.call_one()
    await pm.stop()
    rows = global_rows(tmp_path)
    assert 2.0 <= first_s < 2.0 + 2.0 and second_s < 1.5, (first_s, second_s)
    # with aggregation rank 1 led the pair: rank 0, asked to resend its answer directly, is not late
    assert rows[1]["late"] == ["stall/Stoppable/r1"] and rows[1]["metrics"]["obs/late_ranks"] == 1
    assert rows[1]["metrics"]["hang/v"] == 1.0  # rank 1's value missed step 1's cut ...
    if aggregating():  # ... rank 0 leads from step 2 (rank 1, resumed, may answer step 2 through it in time)
        assert rows[2].get("missing", []) in ([], ["stall/Stoppable/r1"])
        assert sum(r["metrics"].get("hang/v", 0.0) for r in rows.values()) == 3.0  # nothing lost
        return
    # steps leave in order: step 2 may be assembled after rank 1 resumed and answered cut 2 too
    # (then it is not missing there)
    if rows[2].get("missing"):
        assert rows[2]["missing"] == ["stall/Stoppable/r1"] and "late" not in rows[2]
    # ... and arrives with the first step still being assembled when rank 1 resumed (2 or 3): once
    assert rows[2]["metrics"]["hang/v"] in (1.0, 2.0)
    assert sum(r["metrics"].get("hang/v", 0.0) for r in rows.values()) == 3.0  # nothing lost
    assert rows[3]["metrics"]["obs/missing_ranks"] == 0


async def test_a_quiet_mesh_stopped_between_sessions_is_not_waited_for_by_the_next(tmp_path):
    """A mesh that recorded nothing since its last flush and stopped after shutdown hands over
    empty final states while no session runs; the next session's first cut, which expects them,
    takes them at once instead of waiting a timeout and naming its ranks missing."""
    for run_id, value in (("a", 1.0), ("b", 2.0)):
        mlogger = await start_logger(tmp_path, {"flush_timeout_s": 30.0}, run_id=run_id)
        pm = this_host().spawn_procs(per_host={"procs": 2}, name="quiet")
        a = pm.spawn("Stoppable", Stoppable)
        await a.record.call(value)
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
        await pm.stop()  # nothing recorded since step 0: empty final states, with no session running
    row = global_rows(tmp_path, "b")[0]
    assert row["metrics"]["hang/v"] == 4.0
    assert not row.get("missing") and not row.get("late"), row
    assert row["metrics"]["obs/flush_blocked_s"] < 15.0  # not the 30 s timeout


@pytest.mark.parametrize("bad", ["abc", None, 1.5, 2**70, -1, True])
async def test_flush_rejects_a_step_that_is_not_a_non_negative_int(tmp_path, bad):
    mlogger = await start_logger(tmp_path, {})
    record_metric("x", 1.0)
    with pytest.raises((TypeError, ValueError), match="global_step"):
        await mlogger.flush.call_one(bad)
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    assert global_rows(tmp_path)[0]["metrics"]["x"] == 1.0  # nothing was taken by the bad call


def test_no_library_module_imports_through_the_root_package():
    """``from forge_obs import x`` inside the library waits for the root package's import lock;
    when two actors of a fresh process import forge_obs at once, that deadlocks and Python hands
    out a partially initialised module (ImportError in the child). Library modules import their
    siblings by full path."""
    offenders = []
    for path in sorted((ROOT / "src" / "forge_obs").rglob("*.py")) + sorted((ROOT / "src" / "provisioner_hooks").rglob("*.py")):
        if path == ROOT / "src" / "forge_obs" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            through_root = (isinstance(node, ast.ImportFrom) and node.module == "forge_obs") or (
                isinstance(node, ast.Import) and any(a.name.startswith("forge_obs") for a in node.names)
            )
            if through_root:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


async def test_flush_with_metrics_disabled_is_a_silent_no_op(tmp_path, monkeypatch, caplog):
    """FORGE_DISABLE_METRICS=true: init_backends starts nothing and every flush returns at once,
    without a warning per step (the GRPO app flushes every step either way)."""
    import logging

    from forge_obs import get_or_create_metric_logger

    monkeypatch.setenv("FORGE_DISABLE_METRICS", "true")
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "off"}})
    assert info["run_dir"] is None
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        for step in range(3):
            await mlogger.flush.call_one(step)
    assert [r.getMessage() for r in caplog.records if "flush" in r.getMessage()] == []
    assert not (tmp_path / "off").exists()
