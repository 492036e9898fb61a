"""TorchTitan compatibility: ``forge_obs.titan`` has TorchTitan's structured-logger names with
their meaning, and forge-obs reads TorchTitan's own per-rank files (written here by TorchTitan's
real logger, torchtitan 0.3.0) with trace, sql and doctor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import CHILD_PATH, ROOT, run_as_user

SCRIPTS = ROOT / "tests" / "user_scripts"
NAMES = ["init_structured_logger", "log_trace_span", "log_trace_instant", "log_trace_scalar", "set_step",
         "add_step_tag", "clear_step_tags", "get_step", "get_step_tags", "get_relative_step"]


def sql(run_dir, query: str) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "sql", str(run_dir), query, "--format", "json"],
                         capture_output=True, text=True, env={"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def check_run(run_dir, ranks: list[int]) -> None:
    """What both scripts record, as forge-obs sees it."""
    spans = sql(run_dir, "SELECT rank, name, step, error FROM spans ORDER BY rank, start_us")
    want = []
    for r in ranks:
        for step in (1, 2, 3):
            want += [{"rank": r, "name": "train_step", "step": step, "error": None},
                     {"rank": r, "name": "fwd_bwd", "step": step, "error": None}]
        want.append({"rank": r, "name": "ckpt", "step": 3, "error": "ERR"})
    got = [dict(s, error="ERR" if s["error"] and "disk full" in s["error"] else s["error"]) for s in spans]
    assert got == want
    scalars = sql(run_dir, "SELECT rank, step, CAST(json_extract(attrs, '$.value') AS DOUBLE) v FROM events "
                           "WHERE name = 'train.loss' ORDER BY rank, step")
    assert scalars == [{"rank": r, "step": s, "v": 2.5 - s + r} for r in ranks for s in (1, 2, 3)]
    tags = sql(run_dir, "SELECT DISTINCT rank, name, step FROM events WHERE kind = 'tag' ORDER BY rank")
    assert tags == [{"rank": r, "name": "gc", "step": 2} for r in ranks]


def test_same_names_as_torchtitan():
    from torchtitan.observability import structured_logger as tt

    import forge_obs.titan as ours

    for name in NAMES:
        assert hasattr(tt, name) and hasattr(ours, name), name


def test_torchtitan_own_files_read_by_forge_obs(tmp_path):
    out = tmp_path / "outputs"
    for rank in (0, 1):
        run_as_user(SCRIPTS / "titan_own_logger.py", tmp_path, str(out), str(rank))
    assert len(list((out / "structured_logs").glob("trainer.global_rank_*.jsonl"))) == 2
    check_run(out, [0, 1])
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "trace", str(out), "-o", str(tmp_path / "t.json")],
                         capture_output=True, text=True, env={"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert "2 process tracks, 14 slices, 0 unfinished, 2 errors" in res.stdout
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("name") == "fwd_bwd") == 6
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "doctor", str(out)], capture_output=True, text=True,
                         env={"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0 and "no findings" in res.stdout, res.stdout + res.stderr


def test_forge_obs_titan_module_same_meaning(tmp_path):
    out = tmp_path / "outputs"
    for rank in (0, 1):
        res = run_as_user(SCRIPTS / "titan_forge_logger.py", tmp_path, str(out), str(rank))
        assert f"DONE {rank}" in res.stdout
    check_run(out, [0, 1])
    assert sql(out, "SELECT count(*) n FROM spans WHERE name = 'after_disable'") == [{"n": 0}]
    assert sql(out, "SELECT count(*) n FROM events WHERE name IN ('after_disable', 'bad')") == [{"n": 0}]
    # a run id in every row
    assert sql(out, "SELECT DISTINCT run_id FROM spans") == [{"run_id": "exp7"}]


def test_rank_filter_and_rotation(tmp_path):
    out = tmp_path / "outputs"
    for rank in (0, 1, 2, 3):
        run_as_user(SCRIPTS / "titan_forge_logger.py", tmp_path, str(out), str(rank), "every:2")
    assert sorted({r["rank"] for r in sql(out, "SELECT DISTINCT rank FROM spans")}) == [0, 2]
    rotated = tmp_path / "rotated"
    for rank in (0, 1):
        run_as_user(SCRIPTS / "titan_forge_logger.py", tmp_path, str(rotated), str(rank), "all", "0.0002")
    assert len(list((rotated / "events").glob("*.jsonl"))) > 2  # a file of ~200 bytes at most, then the next
    check_run(rotated, [0, 1])


def test_skipped_while_compiling(tmp_path, monkeypatch):
    """torch.compile cannot trace here quickly (no compiler toolchain worth the time): the
    compiling flag is what the calls read, so it is set by hand (the only mock here)."""
    import torch

    from forge_obs import titan
    from forge_obs.recording import timeline
    from forge_obs.recording.timeline import recorder

    timeline.close()
    recorder.clear()  # earlier tests' records made before any configure are not this run's
    timeline.configure(tmp_path)
    recorder.refresh_compile_check()  # what the writer does once torch is imported
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    with titan.log_trace_span("compiled"):
        titan.log_trace_instant("compiled_event")
        titan.log_trace_scalar({"compiled_scalar": 1.0})
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: False)
    with titan.log_trace_span("eager"):
        pass
    timeline.close()
    names = [r["name"] for r in sql(tmp_path, "SELECT name FROM spans UNION ALL SELECT name FROM events WHERE kind='event'")]
    assert names == ["eager"]


def test_docs_example(tmp_path):
    """docs/spmd.md's forge_obs.titan example, as a user's script."""
    import re

    block = re.findall(r"```python\n(.*?)^```", (ROOT / "docs" / "spmd.md").read_text(), re.S | re.M)[1]
    script = tmp_path / "example.py"
    script.write_text(block + "\nfrom forge_obs.recording import timeline\ntimeline.close()\n")
    run_as_user(script, tmp_path)
    out = tmp_path / "outputs"
    assert sql(out, "SELECT name, step FROM spans") == [{"name": "fwd_bwd", "step": 5}]
    ev = sql(out, "SELECT kind, name, step, attrs FROM events WHERE kind <> 'step' ORDER BY ts_us")
    assert ev == [{"kind": "tag", "name": "gc", "step": 5, "attrs": None},
                  {"kind": "event", "name": "train.loss", "step": 5, "attrs": '{"value": 2.5}'},
                  {"kind": "event", "name": "checkpoint_saved", "step": 5, "attrs": None}]
