"""SPMD at TorchTitan's scale, the way users run it: a loop with no sleep under real ``torchrun``,
a rank killed (SIGKILL) or hung (SIGSTOP, then SIGCONT) among ranks started one process each
(as Slurm's srun starts them). What reached the backends is read back from ``metrics.jsonl``
and checked by arithmetic; how late each step reached them, from the ranks' own flush times
(a backend of the user's stamps each step: tests/user_scripts/spmd_stamp.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import ROOT, finish_group, run_group, start_group, stop_process

SCRIPTS = ROOT / "tests" / "user_scripts"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID", "FORGE_OBS_ROOT")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), OMP_NUM_THREADS="1", **extra)
    return env


def _rows(run_dir: Path) -> list[dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r.get("mode") == "global_reduce"]


def _shutdowns(out: str) -> dict[int, dict]:
    got = [json.loads(line.split("SHUTDOWN ", 1)[1]) for line in out.splitlines() if "SHUTDOWN {" in line]
    return {g["rank"]: g for g in got}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: where each rank runs: one node, or three nodes whose helpers form a chain (fan-in 1: the root,
#: with the logger rank and the ranks but the last two; a helper below it, with the last rank but
#: one; a helper below that, with the last rank), so that states and faults cross two helpers
NODES = {"one_node": (lambda r, world: 0, "8"),
         "three_nodes_chained": (lambda r, world: max(0, r - (world - 3)), "1")}


def _start_ranks(script: str, world: int, run_dir: Path, args: list[str], node_of=None, **env: str) -> list[subprocess.Popen]:
    """Each rank a process of its own (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, rank 0
    hosting the store), as srun starts them; ``node_of(rank)`` names its node."""
    port = str(_free_port())
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        extra = dict(env, FORGE_OBS_SPMD_NODE=f"node{node_of(r)}") if node_of else env
        procs.append(start_group([sys.executable, str(SCRIPTS / script), str(run_dir), *args], cwd=run_dir.parent,
                                 env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port, **extra)))
    return procs


def _per_rank_processes(world: int, run_dir: Path, args: list[str], nodes: str) -> list[subprocess.Popen]:
    """spmd_faults.py's ranks on the nodes ``NODES[nodes]`` names."""
    node_of, fanin = NODES[nodes]
    return _start_ranks("spmd_faults.py", world, run_dir, args, lambda r: node_of(r, world), FORGE_OBS_SPMD_FANIN=fanin)


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank still running, with what it started (its helper)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    try:
        return [finish_group(p, timeout) for p in procs]
    finally:  # a rank left running after another one timed out is ended too
        _kill(procs)


def _wait_for(cond, procs: list[subprocess.Popen], what: str, timeout_s: float = 120.0) -> None:
    """Poll ``cond()`` (another process's progress); on a timeout, or a rank that ended, every
    rank is killed before the test fails."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        ended = [p.pid for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            _kill(procs)
            raise AssertionError(f"{what}: " + (f"ranks {ended} ended" if ended else "timed out"))
        time.sleep(0.01)


def _delays(run_dir: Path) -> dict[int, float]:
    """Per step: from rank 0's flush of it to its arrival at the user's backend (seconds)."""
    flushed = {int(k): v for k, v in json.loads((run_dir / "flushed.json").read_text()).items()}
    arrived = dict(map(float, line.split()) for line in (run_dir / "arrivals.txt").read_text().splitlines())
    return {s: arrived[s] - t for s, t in flushed.items() if s in arrived}


def test_fast_loop_loses_nothing_under_torchrun(tmp_path):
    """4 ranks x 10,000 steps back to back (no sleep, default timeout): every step reaches the
    backend once, in order, with every rank's tokens (1000 = 100 + 200 + 300 + 400); no rank is
    named missing; every rank finishes (meta.json); each rank's shutdown returns within the
    timeout (30 s)."""
    steps, world = 10_000, 4
    run_dir = tmp_path / "runs" / "fast"
    run_dir.parent.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--standalone",
           str(SCRIPTS / "spmd_fast.py"), str(run_dir), str(steps)]
    res = run_group(cmd, cwd=run_dir.parent, env=_env(), timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = _rows(run_dir)
    assert [r["step"] for r in got] == list(range(steps)), (len(got), got[-1]["step"] if got else None)
    bad = [r["step"] for r in got if r["metrics"].get("tokens") != 1000.0 or r.get("missing")]
    assert not bad, (len(bad), bad[:5], got[bad[0]]["metrics"].get("tokens"), got[bad[0]].get("missing"))
    assert sum(r["metrics"]["tokens"] for r in got) == 1000 * steps
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["unfinished_ranks"] == [], meta
    assert sorted(meta["finished_ranks"]) == [f"trainer/r{r}" for r in range(world)]
    downs = _shutdowns(res.stdout)
    assert sorted(downs) == list(range(world))
    assert all(d["shutdown_s"] < 30.0 for d in downs.values()), downs
    assert downs[0]["summary"]["steps_logged"] == steps


@pytest.mark.parametrize("nodes", sorted(NODES))
def test_dead_rank_costs_one_timeout_once(tmp_path, nodes):
    """4 ranks, one process each, ``timeout_s=8``; rank 2 is SIGKILLed at its step 100 (on three
    nodes, rank 2 started its node's helper, which goes on merging rank 3's node below it). Rank
    2's values are in every step up to its last one shipped, then it is named missing in every
    step; steps after that reach the backends at their normal latency (a step that waited for
    rank 2 again would be 8 s late), and the logger rank's shutdown does not wait for it."""
    world, steps, step_s, timeout_s, victim, mark = 4, 700, 0.02, 8.0, 2, 100
    run_dir = tmp_path / "runs" / "dead"
    procs = _per_rank_processes(world, run_dir, [str(steps), str(step_s), str(timeout_s), str(victim), str(mark)], nodes)
    _wait_for((run_dir / f"victim_at_{mark}").exists, procs, "the victim's mark")
    os.kill(procs[victim].pid, signal.SIGKILL)
    res = _finish(procs, 240)
    assert res[victim].returncode == -signal.SIGKILL
    assert all(r.returncode == 0 for i, r in enumerate(res) if i != victim), [r.stderr[-2000:] for r in res]
    got = _rows(run_dir)
    dead = "trainer/r2"
    assert [r["step"] for r in got][:steps] == list(range(steps))
    with_victim = [r["step"] for r in got[:steps] if not r.get("missing")]
    last = max(with_victim)
    assert last >= mark and with_victim == list(range(last + 1))  # its values up to its death, then never
    for r in got[:last + 1]:
        assert r["metrics"]["tokens"] == 1000.0, r
    for r in got[last + 1:steps]:
        assert r["missing"] == [dead] and r["metrics"]["tokens"] == 700.0, r
    delays = _delays(run_dir)
    after = [delays[s] for s in range(last + 2, steps)]
    assert statistics.median(after) < 0.5 and max(after) < timeout_s / 2, (statistics.median(after), max(after))
    downs = _shutdowns(res[0].stdout)
    assert downs[0]["shutdown_s"] < timeout_s / 2, downs
    assert downs[0]["summary"]["unfinished_ranks"] == [victim]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["unfinished_ranks"] == [dead] and dead not in meta["finished_ranks"]


@pytest.mark.parametrize("nodes", sorted(NODES))
def test_hung_rank_is_named_once_and_counted_again_when_it_comes_back(tmp_path, nodes):
    """3 ranks, ``timeout_s=3``; rank 1 (on three nodes: the middle helper's rank) is SIGSTOPped
    at its step 50, and SIGCONTinued once the
    backend logged a step naming it missing. It is named missing from then until it is back;
    what it flushed while behind reaches a later step (counted in obs/late_states), and once it
    caught up its values are in their own steps again. Over the run every value reached the
    backend once: tokens sum to 600 per step."""
    world, steps, step_s, timeout_s, victim, mark = 3, 500, 0.02, 3.0, 1, 50
    run_dir = tmp_path / "runs" / "hung"
    procs = _per_rank_processes(world, run_dir, [str(steps), str(step_s), str(timeout_s), str(victim), str(mark)], nodes)
    _wait_for((run_dir / f"victim_at_{mark}").exists, procs, "the victim's mark")
    stop_process(procs[victim].pid)
    _wait_for(lambda: any(r.get("missing") for r in _rows_if_any(run_dir)), procs, "the hung rank named missing")
    os.kill(procs[victim].pid, signal.SIGCONT)
    res = _finish(procs, 240)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = _rows(run_dir)
    hung = "trainer/r1"
    named = [r["step"] for r in got if r.get("missing") == [hung]]
    assert named and all(r.get("missing") in (None, [], [hung]) for r in got)
    back = [r["step"] for r in got if named[-1] < r["step"] < steps and not r.get("missing")]
    assert back and back[-1] == steps - 1  # present again, to the last flush
    assert any(r["metrics"].get("obs/late_states", 0) >= 1 for r in got)
    # nothing lost, nothing twice: every rank's tokens of every step, and after_last once each
    assert sum(r["metrics"].get("tokens", 0) for r in got) == 600 * steps
    assert sum(r["metrics"].get("after_last", 0) for r in got) == world
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["unfinished_ranks"] == [] and len(meta["finished_ranks"]) == world


def _rows_if_any(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, (ln for ln in lines if ln.endswith("}"))) if r.get("mode") == "global_reduce"]


@pytest.mark.parametrize("nodes, free", [("one_node", ""), ("three_nodes_chained", "0")])
def test_a_full_queue_holds_values_back_counted_never_lost(tmp_path, nodes, free):
    """3 ranks, queues bounded at 40 values, a loop with no sleep: the shippers cannot keep up, so
    flushes hold their values back into the next flush that finds room. On three nodes (one rank
    per helper, in a chain) rank 0's queue is not bounded: it delivers every step while the
    helpers below skip most of them as a whole. Nothing is lost and nothing is missing: the ranks
    that held back are named skipped in the steps they skipped (a step every rank skipped is no
    step), and the step that got the values counts the flushes held back
    (obs/held_back_flushes), as meta.json does per rank."""
    world, steps = 3, 3000
    node_of, fanin = NODES[nodes]
    run_dir = tmp_path / "runs" / "bound"
    res = _finish(_start_ranks("spmd_bound.py", world, run_dir, [str(steps), free], lambda r: node_of(r, world),
                               FORGE_OBS_SPMD_FANIN=fanin), 240)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    got = _rows(run_dir)
    logged = [r["step"] for r in got]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # in order, once; a step every rank skipped is not one
    assert sum(r["metrics"]["tokens"] for r in got) == 600 * steps  # every value, once: 100 + 200 + 300 per step
    assert not any(r.get("missing") for r in got)
    held = sum(r["metrics"].get("obs/held_back_flushes", 0) for r in got)
    skipped = sum(r["metrics"].get("obs/skipped_ranks", 0) for r in got)
    summaries = {d["rank"]: d["summary"] for d in map(lambda x: json.loads(x.split("SHUTDOWN ", 1)[1]),
                 (line for r in res for line in r.stdout.splitlines() if "SHUTDOWN {" in line))}
    by_rank = {f"trainer/r{r}": summaries[r]["held_back_flushes"] for r in range(world) if summaries[r]["held_back_flushes"]}
    assert held >= 1 and held == sum(by_rank.values())
    assert skipped + world * (steps - len(got) + 1) == held  # a step every rank skipped counts each
    if free:  # rank 0 delivered every step: the others skipped and were named so
        assert len(got) == steps + 1 and skipped == held >= 1, (len(got), skipped, held)
    for r in got:  # a step is short by exactly the ranks that skipped it, and carries what they held back
        m = r["metrics"]
        assert m["obs/ranks_reported"] + m.get("obs/skipped_ranks", 0) == world, r
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["bounds"]["held_back_flushes"] == by_rank and meta["unfinished_ranks"] == []


def test_logger_shutdown_returns_within_its_timeout_with_a_rank_hung_for_good(tmp_path):
    """3 ranks, ``timeout_s=4``; rank 2 is SIGSTOPped at its step 30 and never resumed. The logger
    rank's shutdown returns within its timeout, naming rank 2 unfinished (so does meta.json);
    every step reached the backend."""
    world, steps, step_s, timeout_s, victim, mark = 3, 150, 0.02, 4.0, 2, 30
    run_dir = tmp_path / "runs" / "hung_for_good"
    procs = _per_rank_processes(world, run_dir, [str(steps), str(step_s), str(timeout_s), str(victim), str(mark)],
                                "one_node")
    _wait_for((run_dir / f"victim_at_{mark}").exists, procs, "the victim's mark")
    stop_process(procs[victim].pid)
    try:
        res = [finish_group(p, 120) for p in procs[:victim]]
    finally:
        _kill(procs)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    down = _shutdowns(res[0].stdout)[0]
    assert down["shutdown_s"] < timeout_s and down["summary"]["unfinished_ranks"] == [victim], down
    got = _rows(run_dir)
    assert [r["step"] for r in got][:steps] == list(range(steps))
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["unfinished_ranks"] == ["trainer/r2"] and meta["status"] == "finished"


def test_at_scale_a_sample_of_ranks_writes_spans_plus_the_ranks_alerts_point_at(tmp_path):
    """A job counted as large (FORGE_OBS_SPMD_SAMPLE_FROM=2), 4 ranks (dp_replicate = r // 2,
    dp_shard = r % 2): ranks 0 and 1 write every step's span, rank 2 none; rank 3 writes its
    spans while the live alert about its NaN loss (steps 20-59) is on, and not after."""
    world, steps = 4, 150
    run_dir = tmp_path / "runs" / "spans"
    res = _finish(_start_ranks("spmd_spans.py", world, run_dir, [str(steps)], FORGE_OBS_SPMD_SAMPLE_FROM="2"), 240)
    assert all(r.returncode == 0 for r in res), [r.stderr[-2000:] for r in res]
    from forge_obs.analysis.sql import connect

    spans = {rank: (n, lo, hi) for rank, n, lo, hi in connect(run_dir).execute(
        "SELECT rank, count(*), min(step), max(step) FROM spans WHERE name = 'train_step' GROUP BY rank").fetchall()}
    assert spans[0] == spans[1] == (steps, 0, steps - 1)
    assert 2 not in spans
    n, lo, hi = spans[3]
    assert 20 < lo and 60 <= hi < steps - 1 and n >= 20, spans[3]
    alerts = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    assert [(a["rule"], a["rank"], a["state"]) for a in alerts] == [("nonfinite", 3, "firing"), ("nonfinite", 3, "resolved")]
