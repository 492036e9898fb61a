"""A researcher with only W&B finds the culprit: the GRPO app runs with planted faults and W&B
offline, and each fault's culprit is read back from **W&B's own run files only** (the offline
run's ``.wandb`` file and its ``files/`` tables, tests/support/wandb_reader.py): nothing else of
the run directory is read.

Two runs, each with faults that do not hide one another: (A) a slow trainer rank, a NaN loss, a
slow weight sync on the replicas and a replica killed mid-run (a dead rank); (B) a stalled
replica and a slow replay buffer. What is looked at is what docs/backends.md ("What to open in
W&B") tells a researcher to open: the ``doctor/findings`` table (live) and the run summary's
``doctor/final_findings`` table, the ``critical_path`` section's charts and its
``critical_path/slow_steps`` table."""

from __future__ import annotations

import statistics

import pytest

from tests.apps.test_grpo import run_grpo
from tests.support.wandb_reader import find_run_files, read_run, tables

pytestmark = [pytest.mark.timeout(900)]
pytest.importorskip("transformers")
pytest.importorskip("wandb")


def wandb_run(run_dir):
    (path,) = [p for p in find_run_files(run_dir / "wandb") if p.name == f"run-{run_dir.name}.wandb"]
    run = read_run(path)
    assert run.complete, path
    return run, tables(run)


def findings(t: dict) -> list[dict]:
    """The rows of the live findings table and of the final doctor's (the run summary)."""
    return t.get("doctor/findings", []) + t.get("summary:doctor/final_findings", [])


def culprits(rows: list[dict], rules: tuple, mesh: str, stage: "str | None" = None, rank: "int | None" = None) -> list:
    """The findings rows of one of ``rules`` whose culprit is ``mesh`` (a replica: its mesh),
    ``rank`` and ``stage``; each must carry its steps and the commands that show it."""
    out = [r for r in rows if r["rule"] in rules and r["mesh"] == mesh and (stage is None or r["stage"] == stage)
           and (rank is None or r["rank"] == rank)]
    for r in out:
        assert r["steps"] and r["why"].split()[1] == "why" and "--critical-path" in r["trace"], r
        assert mesh in r["culprit"], r
    return out


def path_series(run, key: str) -> dict[int, float]:
    """``critical_path/<key>`` by the step it describes (its ``critical_path/step`` axis)."""
    return {int(h["critical_path/step"]): h[key] for h in run.history if key in h and "critical_path/step" in h}


def test_slow_rank_nan_slow_sync_and_dead_replica_are_named_in_wandb(tmp_path):
    run_dir = run_grpo(tmp_path, "dashA", "--generator", "torch", "--steps", "12", "--batch-groups", "3",
                       "--fault-slow-trainer-rank", "1", "--fault-slow-trainer-s", "0.3", "--fault-slow-trainer-from", "3",
                       "--fault-nan-loss", "6", "--fault-slow-weight-sync", "0.5", "--fault-kill-replica", "8",
                       "--wandb", "--no-report", WANDB_SILENT="true")
    run, t = wandb_run(run_dir)
    rows = findings(t)
    # the slow trainer rank: rank 1's forward_backward, and it bounded the steps' critical path
    assert culprits(rows, ("straggler",), "trainer", "forward_backward", rank=1), rows
    fb = path_series(run, "critical_path/path_s/trainer/forward_backward")  # over the ranks
    assert sorted(fb)[:3] == [0, 1, 2] and len(fb) >= 10, fb  # every step's path, on its own axis
    assert max(fb[s] for s in fb if s >= 4) >= 0.25, fb
    # the NaN loss, on the trainer
    assert culprits(rows, ("nonfinite",), "trainer", "trainer/loss"), rows
    # the slow weight sync, on a replica
    assert [r for r in rows if r["rule"] == "sync_bottleneck" and r["mesh"].startswith("generator_")
            and r["stage"] == "weights_load"], rows
    # the dead replica: the last one (replica 1) stopped answering
    dead = culprits(rows, ("missing_ranks", "stall"), "generator_1")
    assert dead and all(r["replica"] == 1 for r in dead), rows
    # the summary names them in one line
    for name in ("straggler: trainer/", "nonfinite: trainer/", "generator_1/"):
        assert name in run.summary["doctor/culprits"], run.summary["doctor/culprits"]


def test_stalled_replica_and_slow_buffer_are_named_in_wandb(tmp_path):
    run_dir = run_grpo(tmp_path, "dashB", "--generator", "torch", "--steps", "12", "--batch-groups", "3",
                       "--fault-stall-replica", "4", "--fault-slow-buffer", "0.4", "--fault-slow-buffer-from", "6",
                       "--wandb", "--no-report", WANDB_SILENT="true")
    run, t = wandb_run(run_dir)
    rows = findings(t)
    # the stalled replica: its span never ended (final doctor) / it went quiet (live)
    stalled = culprits(rows, ("hang", "quiet_rank", "missing_ranks", "stall"), "generator_1")
    assert stalled and all(r["replica"] == 1 for r in stalled), rows
    # the slow buffer: on the critical path of the slow steps, named in their rows
    slow = t["critical_path/slow_steps"]
    named = [r for r in slow if r["culprit"] == "buffer/r0 buffer_sample"]
    assert len(named) >= 2 and all(r["step"] >= 6 for r in named), slow
    for r in named:
        assert r["mesh"] == "buffer" and r["stage"] == "buffer_sample" and f"--step {r['step']}" in r["why"], r
        assert "waiting on buffer `buffer_sample` (rank 0)" in r["answer"], r
    bs = path_series(run, "critical_path/path_s/buffer/buffer_sample")
    # (a stage gets its key when it first is one of a step's largest: before, it is not on the path)
    assert statistics.median(bs[s] for s in bs if s >= 6) >= 0.3 > max(bs.get(s, 0.0) for s in (0, 2, 3)), bs
