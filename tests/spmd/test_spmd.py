"""SPMD mode: real torchrun process groups (gloo, CPU), the user's script in a subprocess, the
merged steps read back from the run's ``metrics.jsonl`` and checked by arithmetic."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import ROOT, finish_group, run_group, start_group

SCRIPT = ROOT / "tests" / "user_scripts" / "spmd_train.py"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID", "FORGE_OBS_ROOT")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), OMP_NUM_THREADS="1")
    return env


def _cwd(run_dir: Path) -> Path:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_dir.parent


def torchrun(nproc: int, run_dir: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           str(SCRIPT), str(run_dir), *args]
    res = run_group(cmd, cwd=_cwd(run_dir), env=_env(), timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def one_process_per_rank(nproc: int, run_dir: Path, *args: str, timeout: int = 120) -> list[subprocess.CompletedProcess]:
    """Each rank started on its own, as Slurm's srun does (no torchrun agent to stop the job
    when one rank dies): RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, rank 0 hosts the store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(nproc):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(start_group([sys.executable, str(SCRIPT), str(run_dir), *args], cwd=_cwd(run_dir), env=env))
    try:
        return [finish_group(p, timeout) for p in procs]
    finally:  # a rank left running after another one timed out is ended too
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.communicate()


def rows(run_dir: Path, mode: str = "global_reduce") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("mode") == mode]


def expected_step(step: int, ranks: list[int]) -> dict:
    """What spmd_train.py records at ``step`` on ``ranks``, reduced."""
    return {
        "loss": sum(r * 10 + step for r in ranks) / len(ranks),
        "tokens": sum(r + 1 for r in ranks),
        "peak": max(r * 100 + step for r in ranks),
    }


def check_exact(run_dir: Path, world: int, steps: int) -> list[dict]:
    got = rows(run_dir)
    # every step reaches the backend once, in order; then the shutdown's step (recorded after the last flush)
    assert [r["step"] for r in got] == list(range(steps + 1))
    for r in got[:steps]:
        m = r["metrics"]
        want = expected_step(r["step"], list(range(world)))
        for k, v in want.items():
            assert m[k] == pytest.approx(v), (r["step"], k)
        # recorded on rank 1 only (a pipeline's last stage): reduced over the ranks that recorded it
        assert m["stage_loss"] == 7 + r["step"]
        assert m["obs/missing_ranks"] == 0 and "missing" not in r
        assert m["obs/ranks_reported"] == world
    assert got[steps]["metrics"]["after_last"] == world
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_exact_steps_under_torchrun(tmp_path, world):
    steps = 40 if world == 2 else 5  # 40: the shutdown drains a backlog of steps
    run_dir = tmp_path / "runs" / f"exact{world}"
    res = torchrun(world, run_dir, "exact", str(steps))
    check_exact(run_dir, world, steps)
    # per-rank views carry each rank's coordinates in its label
    per_rank = rows(run_dir, "per_rank_reduce")
    labels = {r["source"]["label"] for r in per_rank}
    assert labels == {f"trainer/r{r}[pp={r // 2},dp_shard={r % 2}]" for r in range(world)}
    r1 = [r for r in per_rank if r["source"]["label"].startswith("trainer/r1[") and r["step"] == 2][0]
    assert r1["metrics"]["loss"] == 12 and r1["metrics"]["stage_loss"] == 9
    assert "SHUTDOWN 0" in res.stdout
    if world == 4:  # the timeline and the metrics can be grouped by the parallel coordinates
        from forge_obs.analysis.sql import connect

        con = connect(run_dir)
        spans = con.execute("SELECT pp, dp_shard, count(*), min(rank) FROM spans WHERE name = 'train_step' "
                            "GROUP BY ALL ORDER BY ALL").fetchall()
        assert spans == [(0, 0, 5, 0), (0, 1, 5, 1), (1, 0, 5, 2), (1, 1, 5, 3)]
        loss = con.execute("SELECT pp, dp_shard, avg(value) FROM metrics WHERE key = 'loss' AND mode = 'per_rank_reduce' "
                           "GROUP BY ALL ORDER BY ALL").fetchall()
        assert loss == [(p, d, (p * 2 + d) * 10 + 2.0) for p in (0, 1) for d in (0, 1)]  # mean over steps 0..4
        trace = tmp_path / "trace.json"
        subprocess.run([sys.executable, "-m", "forge_obs.cli", "trace", str(run_dir), "-o", str(trace)], env=_env(),
                       check=True, capture_output=True)
        names = sorted(e["args"]["name"].split(" (")[0] for e in json.loads(trace.read_text())["traceEvents"]
                       if e.get("name") == "process_name")
        assert names == [f"trainer r{r}[pp={r // 2},dp_shard={r % 2}]" for r in range(4)]


def test_slow_rank_does_not_block_the_flush(tmp_path):
    """Rank 1 waits, before its step 2, until rank 0 has gone through every flush: a flush that
    waited for rank 1 would never return (the job would hang). Every step is still exact."""
    run_dir = tmp_path / "runs" / "slow"
    torchrun(2, run_dir, "slow", "6")
    check_exact(run_dir, 2, 6)


def test_dead_rank_is_named_and_later_steps_still_logged(tmp_path):
    run_dir = tmp_path / "runs" / "kill"
    res = one_process_per_rank(2, run_dir, "kill", "6")
    assert res[1].returncode == 1 and res[0].returncode == 0, res[0].stderr[-3000:]
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(7))
    dead = "trainer/r1[pp=0,dp_shard=1]"
    for r in got[:3]:  # both ranks
        assert r["metrics"]["loss"] == expected_step(r["step"], [0, 1])["loss"]
        assert r["metrics"]["obs/missing_ranks"] == 0
    for r in got[3:6]:  # rank 1 is gone: named, its values absent, later steps still logged
        assert r["missing"] == [dead], r
        assert r["metrics"]["obs/missing_ranks"] == 1
        assert r["metrics"]["loss"] == r["step"] and r["metrics"]["tokens"] == 1
        assert "stage_loss" not in r["metrics"]
    assert got[6]["metrics"]["after_last"] == 1
    assert "'unfinished_ranks': [1]" in res[0].stdout


def _doc_block(n: int) -> str:
    import re

    return re.findall(r"```python\n(.*?)^```", (ROOT / "docs" / "spmd.md").read_text(), re.S | re.M)[n]


def test_docs_example_under_torchrun(tmp_path):
    """docs/spmd.md's set-up example, copied into a file as a user would, under torchrun."""
    import re

    script = tmp_path / "train.py"
    script.write_text(_doc_block(0))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(script)]
    res = run_group(cmd, cwd=tmp_path, env=_env(), timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    def values(key):
        return [float(v) for v in re.findall(rf"^{re.escape(key)}:\s*(\S+)$", res.stdout, re.M)]

    assert values("loss") == [1.5, 2.5, 3.5]
    assert values("tokens") == [200, 200, 200]
    assert values("stage_loss") == [0.0, 0.5, 1.0]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and len(list((runs[0] / "events").glob("*.jsonl"))) == 2  # one timeline per rank


def test_late_states_are_counted_and_kept(tmp_path):
    """Rank 1 flushes step 2 only after rank 0's backends logged step 2 without it: step 2 names
    it missing, its late states are counted (obs/late_states) and join a later step; over the
    run every value is logged exactly once."""
    run_dir = tmp_path / "runs" / "late"
    torchrun(2, run_dir, "late", "6")
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(7))
    assert got[2]["missing"] == ["trainer/r1[pp=0,dp_shard=1]"]
    assert got[2]["metrics"]["tokens"] == 1 and got[2]["metrics"]["loss"] == 2
    assert got[-1]["metrics"]["obs/late_states"] >= 1
    late_steps = [r for r in got[3:] if "stage_loss" in r["metrics"] and r["metrics"]["tokens"] > 3]
    assert late_steps  # rank 1's step 2 went into a later step, never an earlier one
    assert sum(r["metrics"].get("tokens", 0) for r in got) == 6 * (1 + 2)  # nothing lost, nothing twice
    assert sum(r["metrics"].get("after_last", 0) for r in got) == 2


def test_one_process_mistakes_and_switch(tmp_path):
    """Without torchrun (one rank): config mistakes raise at init naming the valid choices; a
    step that is not an int is ignored with a warning; FORGE_DISABLE_METRICS turns it off."""
    from tests.support.helpers import run_as_user

    script = tmp_path / "one.py"
    script.write_text('''
import os
from forge_obs import Reduce, record_metric, spmd
for bad, kw in (({"nope": {}}, {}), ({"console": {"logging_mode": "bogus"}}, {}), ({}, {"timeout_s": 0})):
    try:
        spmd.init(bad, **kw)
    except ValueError as e:
        print("RAISED", str(e).replace(chr(10), " ")[:200])
obs = spmd.init({"console": {"logging_mode": "global_reduce"}}, run_dir="run")
record_metric("loss", 2.0, Reduce.MEAN)
obs.flush("three")
obs.flush(3)
record_metric("loss", 4.0, Reduce.MEAN)
print("SUMMARY", obs.shutdown())
''')
    res = run_as_user(script, tmp_path)
    raised = [line for line in res.stdout.splitlines() if line.startswith("RAISED")]
    assert len(raised) == 3 and "valid" in raised[1] and "timeout_s" in raised[2], res.stdout
    assert "nope" in raised[0]
    assert "needs an int step" in res.stderr
    got = rows(tmp_path / "run")
    assert [(r["step"], r["metrics"]["loss"]) for r in got] == [(3, 2.0), (4, 4.0)]
    off = run_as_user(script, tmp_path, env={"FORGE_DISABLE_METRICS": "true"})
    assert "SUMMARY {}" in off.stdout
