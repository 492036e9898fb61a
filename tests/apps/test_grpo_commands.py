"""The end of a GRPO run as a new user sees it: the commands it prints work exactly as printed, in
a shell where the environment is not activated (its ``bin/`` is not on PATH), and the sample end
text in docs/grpo.md is what a run prints. The app runs as a separate process (torch generator,
a few steps); each printed command runs through bash, as typed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.project.test_readme import blocks, in_order
from tests.support.helpers import CHILD_PATH
from tests.support.children import stop_child

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)
pytest.importorskip("transformers")  # the GRPO app builds its tiny model with it
RUN_ID = re.compile(r"runs/\d{8}-\d{6}-[0-9a-f]{6}")


def _shell_env() -> dict:
    """A shell that has not activated the environment: its bin/ is not on PATH."""
    bindir = Path(sys.executable).parent.resolve()
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != bindir)
    env["PYTHONPATH"] = CHILD_PATH  # this checkout's code (CI: the editable install points here anyway)
    env["MONARCH_FILE_LOG"] = "error"
    env["BROWSER"] = "true"  # `trace --open` "opens a browser" with a command that does nothing
    return env


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("user")
    env = _shell_env()
    res = subprocess.run([sys.executable, "-m", "apps.grpo.main", "--generator", "torch", "--steps", "4",
                          "--batch-groups", "4"], cwd=cwd, env=env, capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    return cwd, env, res.stdout


def _printed_commands(stdout: str) -> list[str]:
    tail = stdout[stdout.index("[grpo] run directory:"):].splitlines()[1:]
    return [ln.strip().split("  #", 1)[0].strip() for ln in tail if ln.startswith("  ")]


def test_printed_commands_work_as_printed(grpo_run):
    cwd, env, stdout = grpo_run
    cmds = _printed_commands(stdout)
    assert [c.split()[0] if c.startswith("cat ") else c.split()[1] if not c.split()[0].endswith("python")
            else c.split()[3] for c in cmds] == ["doctor", "why", "trace", "report", "sql", "cat"], cmds
    run_dir = RUN_ID.search(stdout).group(0)
    assert (cwd / run_dir / "report.html").exists() and f"report: {run_dir}/report.html" in stdout
    for cmd in cmds:
        if "--open" in cmd:
            continue
        res = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert "Traceback" not in res.stderr and "command not found" not in res.stderr, (cmd, res.stderr)
        if " doctor " in cmd:
            assert res.returncode in (0, 1) and res.stdout.strip(), (cmd, res.stdout, res.stderr)  # 1: findings
        else:
            assert res.returncode == 0, (cmd, res.stdout, res.stderr)
        if " sql " in cmd:
            assert "train_step" in res.stdout and "median_ms" in res.stdout, res.stdout
        if " why " in cmd:
            assert res.stdout.startswith("why: 4 step(s)") and res.stdout.count("\nstep ") == 3, res.stdout
        if " report " in cmd:
            assert res.stdout.strip() == f"{run_dir}/report.html"
        if cmd.startswith("cat "):  # the live alerts of the run: one JSON object per line (none on a clean run)
            assert all(json.loads(ln)["rule"] for ln in res.stdout.splitlines() if ln.strip()), res.stdout


def test_printed_trace_open_serves_the_trace(grpo_run):
    pytest.importorskip("viztracer", reason="trace --open needs it (the grpo extra installs it)")
    cwd, env, stdout = grpo_run
    (cmd,) = [c for c in _printed_commands(stdout) if "--open" in c]
    proc = subprocess.Popen(["bash", "-c", "exec " + cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("wrote ")
        line = proc.stdout.readline()
        assert line.startswith("Perfetto UI with "), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split(": ", 1)[1].split()[0]
        run_dir = RUN_ID.search(stdout).group(0)
        with urllib.request.urlopen(url + "localtrace", timeout=30) as r:
            assert r.read() == (cwd / run_dir / "trace.json").read_bytes()
    finally:
        _out, err = stop_child(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_docs_sample_end_text_is_what_a_run_prints(grpo_run):
    _cwd, _env, stdout = grpo_run
    (sample,) = [b for b in blocks(ROOT / "docs" / "grpo.md") if b["note"] == "readme-output"]
    fo = _printed_commands(stdout)[0].split(" doctor ")[0]
    printed = RUN_ID.sub("runs/<id>", stdout.replace(fo + " ", "forge-obs ")).splitlines()
    want = RUN_ID.sub("runs/<id>", sample["body"]).splitlines()
    missing = in_order(want, printed)
    assert not missing, (missing, printed[-8:])


def test_killed_replica_is_reported_once(tmp_path):
    """A replica's process dies at step 3 of 12: the console says so once, not on every later step."""
    res = subprocess.run([sys.executable, "-m", "apps.grpo.main", "--generator", "torch", "--steps", "12",
                          "--batch-groups", "4", "--fault-kill-replica", "3", "--no-report", "--console-every", "100"],
                         cwd=tmp_path, env=_shell_env(), capture_output=True, text=True, timeout=500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    notes = [ln for ln in res.stdout.splitlines() if ln.startswith("[forge_obs] step")]
    missing = [ln for ln in notes if ": missing " in ln]
    assert len(missing) == 1 and "generator_1/" in missing[0], notes
    console = res.stdout[: res.stdout.index("[grpo] reward:")].splitlines()  # the printed commands may be longer
    long = [ln for ln in console if ln.startswith(("[step", "[forge_obs]", " ")) and len(ln) > 120]
    assert not long, long
