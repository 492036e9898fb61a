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

from tests.helpers import ROOT

SCRIPT = ROOT / "tests" / "user_scripts" / "spmd_train.py"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID", "FORGE_OBS_ROOT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _cwd(run_dir: Path) -> Path:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_dir.parent


def torchrun(nproc: int, run_dir: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           str(SCRIPT), str(run_dir), *args]
    res = subprocess.run(cmd, cwd=_cwd(run_dir), env=_env(), capture_output=True, text=True, timeout=timeout)
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
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), *args], cwd=_cwd(run_dir), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


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
    run_dir = tmp_path / "runs" / f"exact{world}"
    res = torchrun(world, run_dir, "exact", "5")
    check_exact(run_dir, world, 5)
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
