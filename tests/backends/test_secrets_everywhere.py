"""The secrets rule end to end (issue 35): a user's script (``tests/user_scripts/secret_rows.py``,
real meshes) records SAMPLE rows holding credentials -- a secret field, a JSON string with an
Authorization header, a key in free text, a URL password, a token as a dict key -- with a token as
a dict key in its config too, into console, local store, W&B (offline) and TensorBoard. Every
place a value can surface is read back -- the console output, every file of the run (metrics.jsonl,
meta.json, W&B's offline files and its staging directory, TensorBoard's event files), report.html,
``forge-obs show`` and the serve API -- and holds no secret, while every other field of every
row is there, with the values the script computed."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.helpers import ROOT, run_as_user

SCRIPT = ROOT / "tests" / "user_scripts" / "secret_rows.py"
#: the middle part of each secret the script records (a leak of any part of one names it)
SECRET_PARTS = ("Q7xVb2LmN9pRt4Ws", "Jw3Kq8Lp2Mn7Rt5Vx9Zb", "Ab3Cd5Ef7Gh9Ij2Kl4Mn6Op", "Sq9Tz4Uy")
STEPS = 3
RANKS = 2


def _leaks(text: str) -> list[str]:
    return [s for s in SECRET_PARTS if s in text]


def _rollout(step: int, rank: int) -> dict:
    """The row generator ``rank`` records at ``step``, as every view shows it."""
    return {"prompt": f"What is {step}+{rank}?", "completion": f"It is {step + rank}.", "reward": float(step + rank),
            "api_key": "***", "request": json.dumps({"headers": {"Authorization": "***"}, "model": "qwen"}),
            "log": "called the API with ***", "by_user": {"***": rank}}


def _batch(step: int) -> dict:
    return {"step": step, "db": "postgres://rl:***@db.example.com/rl"}


def _by_prompt(rows: list) -> list:
    return sorted(rows, key=lambda r: r["prompt"])


def _cli(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


def _serve_api(root: Path, paths: list[str]) -> dict[str, dict]:
    from forge_obs.analysis.serve import ServeServer

    out = {}
    with ServeServer(root).start() as srv:
        for path in paths:
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", headers={"Host": f"127.0.0.1:{srv.port}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out[path] = json.loads(r.read())
    return out


@pytest.fixture
def secret_run(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    home = tmp_path / "wandb_home"
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline", **{v: str(home) for v in (
        "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}}
    res = run_as_user(SCRIPT, tmp_path, str(tmp_path / "runs"), env=env, timeout=300)
    run_dir = Path(json.loads(res.stdout.strip().splitlines()[-1])["run_dir"])
    return tmp_path, run_dir, res.stdout + res.stderr


def test_no_secret_reaches_any_view_and_every_other_field_does(secret_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from forge_obs.analysis.store import read_metrics
    from tests.support.wandb_reader import find_run_file, read_run

    tmp_path, run_dir, console = secret_run
    # the console: the raw rows it streamed, redacted, their other fields printed
    assert _leaks(console) == []
    assert console.count("INFO generator/rollouts: prompt=What is") == STEPS * RANKS
    assert "completion=It is 3. reward=3 api_key=*** " in console and "by_user=***=1" in console
    # the local store: every step's rows, from both ranks, exactly as the script computed them
    g = {r["step"]: r["metrics"] for r in read_metrics(run_dir, "global_reduce")}
    assert sorted(g) == list(range(STEPS))
    for s in range(STEPS):
        assert _by_prompt(g[s]["generator/rollouts"]) == [_rollout(s, r) for r in range(RANKS)]
        assert g[s]["trainer/batches"] == [_batch(s)]
        assert g[s]["generator/tokens"] == 10 + 20 and g[s]["trainer/loss"] == pytest.approx(1 / (s + 1))
    raw = [v for r in read_metrics(run_dir, "per_rank_no_reduce") for v in r["values"] if v[0] == "generator/rollouts"]
    assert _by_prompt([v[1] for v in raw]) == _by_prompt([_rollout(s, r) for s in range(STEPS) for r in range(RANKS)])
    # `forge-obs show` and the report
    shown = _cli("show", str(run_dir), "--mode", "all")
    assert _leaks(shown) == [] and "What is 2+1?" in shown
    _cli("report", str(run_dir))
    page = (run_dir / "report.html").read_text()
    assert _leaks(page) == [] and "What is 2+1?" in page and "alice" in page
    # the serve API: the run, the drill-down of the last step, the latest samples
    api = _serve_api(run_dir.parent, ["/api/runs", "/api/run?id=secrets", "/api/step?id=secrets&step=2",
                                      "/api/samples?id=secrets&k=generator/rollouts"])
    assert _leaks(json.dumps(api)) == []
    assert _by_prompt(api["/api/step?id=secrets&step=2"]["samples"]["generator/rollouts"]) == [
        _rollout(2, r) for r in range(RANKS)]
    assert _by_prompt(api["/api/samples?id=secrets&k=generator/rollouts"]["rows"]) == [_rollout(2, r) for r in range(RANKS)]
    # W&B, read back from its offline run: the config's token key masked, its tables' cells
    wb = read_run(find_run_file(run_dir / "wandb", "secrets"))
    assert wb.config["owners"] == {"***": "alice"} and wb.config["lr"] == 3e-4
    assert [h["generator/rollouts/nrows"] for h in wb.history] == [RANKS] * STEPS
    tables = sorted((run_dir / "wandb").rglob("rollouts_*.table.json"))
    assert len(tables) == STEPS
    for t in tables:
        table = json.loads(t.read_text())
        rows = [dict(zip(table["columns"], row)) for row in table["data"]]
        assert {r["api_key"] for r in rows} == {"***"} and {r["log"] for r in rows} == {"called the API with ***"}
    # TensorBoard, read back from its event files: the rows' text table
    ea = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in ea.Tensors("generator/rollouts/text_summary")]
    assert len(texts) == STEPS and "What is 2+1?" in texts[-1] and "| *** |" in texts[-1]
    # and no file anywhere -- the run, W&B's own directory, the report -- holds any part of a secret
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any("tfevents" in p.name for p in files)
    assert [(str(p), _leaks(p.read_bytes().decode("utf-8", "replace"))) for p in files
            if _leaks(p.read_bytes().decode("utf-8", "replace"))] == []
