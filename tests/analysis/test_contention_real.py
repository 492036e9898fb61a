"""A real run beside busy processes on the same machine (issue 39): tests/user_scripts/busy_host.py
(2 trainer ranks on a Monarch mesh, a fixed amount of CPU work per step, the live alerts on)
while CPU hogs started here (2 per core, stopped by SIGKILL) take the machine from step 15 to
step 45. The clean run carries no finding and no alert about an actor; a rank that sleeps 0.3 s
more per step from step 10 (a slow rank, the planted fault) is named by the doctor and the live
alerts, busy host or not. The telemetry that decides it is the run's own (obs/sys/...)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_obs.analysis.doctor import diagnose_run, format_findings
from tests.support.helpers import finish_group, start_group, user_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "user_scripts" / "busy_host.py"
ACTOR_KINDS = {"straggler", "slowdown", "hang", "stall", "sync_bottleneck", "quiet_rank", "missing_ranks"}
HOGS = (15, 45)  # the steps the hogs run between
HOGS_PER_CORE = 4

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="telemetry is read from Linux's /proc")


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_bytes().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


def _hogs_during(proc: subprocess.Popen, metrics: Path, timeout_s: float) -> list[int]:
    """Start the hogs when the run logged step HOGS[0] and SIGKILL them at HOGS[1] (or when the
    run ends); returns the steps they started and stopped at."""
    hogs: list[subprocess.Popen] = []
    marks: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            step = _last_step(metrics)
            if not hogs and not marks and step >= HOGS[0]:
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                        for _ in range(HOGS_PER_CORE * (os.cpu_count() or 1))]
                marks.append(step)
            elif hogs and step >= HOGS[1]:
                break
            time.sleep(0.05)
        marks.append(_last_step(metrics))
    finally:
        for h in hogs:
            os.killpg(h.pid, signal.SIGKILL)
            h.wait(10)
    return marks


def run_beside_hogs(tmp_path: Path, run_id: str, *args: str, steps: int = 60, hogs: bool = True,
                    env: dict | None = None) -> tuple[Path, list[int]]:
    root = tmp_path / "runs"
    proc = start_group([sys.executable, str(SCRIPT), str(root), run_id, "--steps", str(steps), *args],
                       cwd=tmp_path, env=user_env(env))
    marks = _hogs_during(proc, root / run_id / "metrics.jsonl", timeout_s=240) if hogs else []
    res = finish_group(proc, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / run_id, marks


def alerts(run: Path) -> list[dict]:
    p = run / "alerts.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_a_clean_run_beside_busy_processes_names_no_actor(tmp_path):
    run, marks = run_beside_hogs(tmp_path, "clean")
    d = diagnose_run(run)
    about_actors = [f for f in d.findings if f.kind in ACTOR_KINDS]
    assert about_actors == [], format_findings(d.findings, d.notes) + f"\nhogs at steps {marks}"
    assert not [a for a in alerts(run) if a["rule"] in ACTOR_KINDS], alerts(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ranks = {r["source"]["label"] for r in rows if r.get("mode") == "per_rank_reduce"
             and "obs/sys/proc/runq_wait_s" in r["metrics"]}
    assert {"Controller", "mesh/Trainer/r0", "mesh/Trainer/r1"} <= ranks  # the run's own telemetry decided it
    assert any("obs/sys/host/runnable_per_core" in r["metrics"] for r in rows if r.get("mode") == "per_rank_reduce")
    # the hogs bit: the trainer ranks waited for a CPU a larger share of their steps while they ran
    share = {(r["step"], r["source"]["label"]): r["metrics"]["obs/sys/proc/runq_wait_share"] for r in rows
             if r.get("mode") == "per_rank_reduce" and "Trainer" in r["source"]["label"]
             and "obs/sys/proc/runq_wait_share" in r["metrics"]}
    during = statistics.median(v for (s, _lb), v in share.items() if marks[0] + 2 <= s <= marks[1])
    before = statistics.median(v for (s, _lb), v in share.items() if 2 <= s < marks[0])
    assert during > before, (before, during, marks)


def test_telemetry_off_with_one_switch(tmp_path):
    """FORGE_OBS_TELEMETRY=off: the same run records no obs/sys/... key (and its steps, values and
    counts are the user's only)."""
    run, _ = run_beside_hogs(tmp_path, "off", steps=4, hogs=False, env={"FORGE_OBS_TELEMETRY": "off"})
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 1, 2, 3]
    assert not any(k.startswith("obs/sys/") for r in rows for k in (r.get("metrics") or {}))
    # per step: 2 ranks x (loss, forward_backward's duration) + the controller's samples_per_s
    assert [r["metrics"]["obs/values_recorded"] for r in rows if r["mode"] == "global_reduce"] == [5.0] * 4


def test_a_slow_rank_beside_busy_processes_is_named(tmp_path):
    run, marks = run_beside_hogs(tmp_path, "fault", "--fault-rank", "1", "--fault-from", "10", "--fault-s", "0.3")
    d = diagnose_run(run)
    named = [f for f in d.findings if f.kind == "straggler" and f.rank == 1]
    assert named and named[0].onset_step <= 12, format_findings(d.findings, d.notes) + f"\nhogs at steps {marks}"
    assert not [f for f in d.findings if f.kind in ACTOR_KINDS and f.rank == 0], format_findings(d.findings)
    fired = [a for a in alerts(run) if a["state"] == "firing" and a["rule"] == "straggler"]
    assert fired and fired[0]["rank"] == 1, alerts(run)
