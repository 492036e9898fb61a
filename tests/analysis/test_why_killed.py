"""A span left open by a process that died (SIGKILL: no end record, no clean close) is on the
step's critical path as unfinished and named as the cause: a real process, written the way users
write a script (``forge_obs.timeline`` configured on a run directory, ``set_step``,
``record_span``), killed while inside the span; ``why`` answered from the files, from the index
and by the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forge_obs.analysis.critical_path import why

ROOT = Path(__file__).resolve().parents[2]
STUCK_STEP = 5

SCRIPT = textwrap.dedent('''
    import signal, sys, time
    from forge_obs import timeline
    from forge_obs.timeline import record_span, set_step

    timeline.configure(sys.argv[1], ranks="all", open_after_s=0.0, flush_interval_s=0.05)
    for step in range(STEPS):
        set_step(step)
        with record_span("controller_step"):
            with record_span("generate"):
                time.sleep(0.02)
            if step == STEPS - 1:
                with record_span("score"):                 # never exited: the process is killed in it
                    timeline.flush()                        # its "begun" record is on disk
                    open(sys.argv[2], "w").close()          # the test may kill it now
                    while True:
                        signal.pause()
            with record_span("train"):
                time.sleep(0.05)
''').replace("STEPS", str(STUCK_STEP + 1))


def _alive_inside(run_dir: Path) -> bool:
    """Whether the child's file has an "A" record (alive, a span of its "B" records open) after
    the "B" of ``score``: the process had been inside the span a writer pass or more."""
    for f in (run_dir / "events").glob("*.jsonl"):
        lines = f.read_text().splitlines()
        begun = [i for i, x in enumerate(lines) if x.startswith('["B"')]
        if begun and any(x.startswith('["A"') for x in lines[begun[-1]:]):
            return True
    return False


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    script, run_dir, ready = tmp / "stuck.py", tmp / "run", tmp / "inside"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(ready)], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and _alive_inside(run_dir)):  # inside the span, and seen alive there
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never entered its span"
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return run_dir


def _check(r: dict) -> None:
    assert r["step"] == STUCK_STEP and r["unfinished"], r["answer"]
    on_path = [(s["name"], s["unfinished"]) for s in r["path"]]
    assert ("score", True) in on_path, r["path"]
    c = r["cause"]
    assert (c["mesh"], c["name"], c["unfinished"]) == ("controller", "score", True), r["answer"]
    assert "`score`" in r["answer"] and "unfinished" in r["answer"], r["answer"]


@pytest.mark.parametrize("index", [False, True])
def test_a_span_open_in_a_killed_process_is_the_unfinished_cause(killed_run, index):
    (r,) = why(killed_run, steps=[STUCK_STEP], index=index)["steps"]
    _check(r)


def test_the_cli_names_the_open_span_as_the_cause(killed_run):
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "why", str(killed_run), "--step", str(STUCK_STEP)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    (line,) = [x for x in res.stdout.splitlines() if x.startswith(f"step {STUCK_STEP}:")]
    assert "(unfinished" in line and "`score`" in line, res.stdout
