"""apps/titan: TorchTitan's real trainer (torchtitan 0.3.0, llama3 debug model, CPU, gloo) under
torchrun with 2 ranks, observed with forge_obs. Per step, forge_obs's loss and grad norm equal
the values TorchTitan itself logged: its TensorBoard scalars (float32: equal after rounding
forge_obs's value to float32) and its console lines (equal to their printed digits). DP=2 with
rank 1 slowed: ``forge-obs doctor`` names trainer rank 1. PP=2: the loss lives on the last stage
only; forge_obs reduces it over the ranks that recorded it and rank 0's console shows it (where
TorchTitan's rank 0 logs its sentinel, -1)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.helpers import CHILD_PATH, ROOT, run_group

#: the interpreter the app runs with: the environment made from ``.[titan]`` alone when
#: scripts/test.sh made one (``FORGE_OBS_TITAN_PYTHON``: no vLLM there, so the extra is shown to
#: be enough for TorchTitan's own imports), else this test's
TITAN_PYTHON = os.environ.get("FORGE_OBS_TITAN_PYTHON") or sys.executable
#: forge_obs and apps/ from this checkout, in every process the tests start


def _has(python: str, module: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


needs_titan = pytest.mark.skipif(not _has(TITAN_PYTHON, "torchtitan"),
                                 reason="torchtitan is not installed (pip install -e '.[titan]')")

# TorchTitan's console line per step and rank: "step:  1  loss:  7.93539  grad_norm:  1.6779  ..."
TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*([\d.]+)")
DP_STEPS, PP_STEPS = 8, 3


def _run(tmp: Path, run_id: str, *args: str) -> tuple[Path, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID")}
    env.update(PYTHONPATH=CHILD_PATH)
    res = run_group([TITAN_PYTHON, "-m", "apps.titan.run", "--run-root", str(tmp), "--run-id", run_id, *args],
                    cwd=tmp, env=env, timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return tmp / run_id, out


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("titan"), "dp", "--steps", str(DP_STEPS), "--fault-slow-rank", "1")


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("titan"), "pp", "--pp", "2", "--steps", str(PP_STEPS))


def forge_steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["metrics"] for r in rows if r.get("mode") == "global_reduce"}


def _coords(run_dir: Path) -> set[str]:
    return {json.dumps(r["source"].get("coords"), sort_keys=True)
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("source")}


def titan_console(out: str) -> dict[int, set[tuple[str, str]]]:
    """step -> {(loss, grad_norm) as TorchTitan printed them, one per rank that logged}."""
    seen: dict[int, set] = {}
    for m in TITAN_LINE.finditer(out):
        seen.setdefault(int(m.group(1)), set()).add((m.group(2), m.group(3)))
    return seen


def titan_tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = [p for p in (run_dir / "titan" / "tb").iterdir() if p.is_dir()]
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)}
            for tag in ("loss_metrics/global_avg_loss", "grad_norm")}


def assert_equal_to_titan(run_dir: Path, out: str, steps: int) -> dict[int, dict]:
    fo = forge_steps(run_dir)
    tb = titan_tensorboard(run_dir)
    console = titan_console(out)
    assert sorted(fo) == list(range(1, steps + 1))
    assert sorted(tb["grad_norm"]) == list(range(1, steps + 1))
    for step, m in fo.items():
        # TensorBoard keeps float32: forge_obs's float64 value, rounded to float32, is that value
        assert np.float32(m["loss"]) == np.float32(tb["loss_metrics/global_avg_loss"][step]), step
        assert np.float32(m["grad_norm"]) == np.float32(tb["grad_norm"][step]), step
        # the console line of every rank that holds the loss, digit for digit
        printed = (f"{m['loss']:.5f}", f"{m['grad_norm']:.4f}")
        assert printed in console[step], (step, printed, console[step])
    return fo


@pytest.mark.skipif(TITAN_PYTHON == sys.executable, reason="scripts/test.sh makes the environment of .[titan] alone")
def test_the_titan_extra_alone_runs_the_app_without_vllm():
    """The app's environment was made from ``.[titan]`` alone: TorchTitan is there, vLLM (which
    brought triton, a module TorchTitan imports) is not; the app's tests below run there."""
    assert _has(TITAN_PYTHON, "torchtitan") and _has(TITAN_PYTHON, "triton")
    assert not _has(TITAN_PYTHON, "vllm")


@needs_titan
def test_dp2_loss_and_grad_norm_equal_torchtitans_own(dp_run):
    run_dir, out = dp_run
    fo = assert_equal_to_titan(run_dir, out, DP_STEPS)
    # both DP ranks printed the same global values; the loss falls over the run
    assert all(len(v) == 1 for v in titan_console(out).values())
    assert fo[DP_STEPS]["loss"] < fo[1]["loss"]
    # every rank's tokens: 2 ranks x 1 sequence of 128 tokens per step
    assert all(m["throughput/tokens"] == 2 * 128 for m in fo.values())


@needs_titan
def test_dp2_records_the_other_keys_and_spans(dp_run):
    run_dir, out = dp_run
    fo = forge_steps(run_dir)
    for key in ("throughput/tps_per_device", "time/data_loading_s", "time/step_s", "memory/max_reserved_gib"):
        assert all(m[key] > 0 for m in fo.values()), key
    # the slowed rank's 1.5 s per batch is half of the mean over 2 ranks
    assert all(m["time/data_loading_s"] >= 0.75 for m in fo.values())
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "sql", str(run_dir),
                          "SELECT rank, name, count(*) AS n FROM spans GROUP BY rank, name ORDER BY rank, name",
                          "--format", "json"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": CHILD_PATH})
    assert res.returncode == 0, res.stderr
    n = {(r["rank"], r["name"]): r["n"] for r in json.loads(res.stdout)}
    for rank in (0, 1):
        assert n[(rank, "train_step")] == n[(rank, "forward_backward")] == n[(rank, "data_loading")] == DP_STEPS
        assert n[(rank, "checkpoint/save")] == DP_STEPS  # one call per step; a save that does work at 3, 6, 8
    # rank labels carry the coordinates in TorchTitan's parallel dimensions
    assert _coords(run_dir) == {'{"dp_replicate": 0}', '{"dp_replicate": 1}'}


@needs_titan
def test_doctor_names_the_slowed_rank(dp_run):
    run_dir, _ = dp_run
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "doctor", str(run_dir)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": CHILD_PATH})
    stragglers = [line for line in res.stdout.splitlines() if line.strip().startswith("[straggler]")]
    assert len(stragglers) == 1, res.stdout + res.stderr
    assert "trainer/r1" in stragglers[0] and "data_loading" in stragglers[0], stragglers


@needs_titan
def test_why_credits_the_collective_wait_to_the_slowed_rank(dp_run):
    """Rank 0 waits for rank 1 in TorchTitan's all-reduces (no span of ours around them): the
    slowest steps' critical path runs through rank 1's slowed data loading, never through rank
    0's own spans (`why --slowest 3` blamed rank 0's train_step / forward_backward, with rank 1
    at 0 s on the path)."""
    run_dir, _ = dp_run
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "why", str(run_dir), "--slowest", "3", "--json"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": CHILD_PATH})
    assert res.returncode == 0, res.stderr
    steps = json.loads(res.stdout)["steps"]
    assert len(steps) == 3
    for r in steps:
        c = r["cause"]
        assert (c["mesh"], c["rank"], c["name"]) == ("trainer", 1, "data_loading"), r["answer"]
        assert c["path_s"] >= 1.0, r["answer"]  # the injected 1.5 s per step, from the moment rank 0 waited
        on_r1 = sum(a["path_s"] for a in r["stages"] if a["rank"] == 1)
        assert on_r1 >= 0.6 * r["duration_s"], r["stages"]


@needs_titan
def test_pp2_real_loss_on_rank0_console(pp_run):
    run_dir, out = pp_run
    fo = assert_equal_to_titan(run_dir, out, PP_STEPS)
    console = titan_console(out)
    for step, m in fo.items():
        # TorchTitan: the last stage (rank 1) logs the loss, the first stage its sentinel -1
        assert {loss for loss, _ in console[step]} == {f"{m['loss']:.5f}", "-1.00000"}, console[step]
        assert m["loss"] > 0
    # forge_obs's console is rank 0's (the logger rank): it shows the real loss of each step
    shown = [float(v) for v in re.findall(r"^loss:\s+(\S+)$", out, re.M)]
    assert len(shown) == PP_STEPS and all(v > 0 for v in shown), shown
    # (4 significant digits printed)
    assert _coords(run_dir) == {'{"pp": 0}', '{"pp": 1}'}
    assert all(abs(v - fo[s]["loss"]) <= 5e-4 * fo[s]["loss"] for s, v in zip(range(1, PP_STEPS + 1), shown)), shown


def test_assets_are_built_here_and_the_same_every_time(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from apps.titan.assets import EOS, VOCAB_SIZE, build

    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    for rel in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "data/train.jsonl"):
        assert (a.root / rel).read_bytes() == (b.root / rel).read_bytes(), rel
    tok = Tokenizer.from_file(str(a.tokenizer_dir / "tokenizer.json"))
    assert tok.get_vocab_size() <= VOCAB_SIZE and tok.token_to_id(EOS) is not None
    docs = [json.loads(line)["text"] for line in (a.data_dir / "train.jsonl").read_text().splitlines()]
    assert len(docs) == 600 and all(d.startswith(f"Document {i}. ") for i, d in enumerate(docs))
    assert build(tmp_path / "a") == a  # a complete build is reused


def test_run_command_line():
    from apps.titan.run import parse_args, torchrun_command

    with pytest.raises(SystemExit):
        parse_args(["--nproc", "3", "--pp", "2"])  # ranks must split evenly into stages
    a = parse_args(["--pp", "2", "--", "--training.steps", "5"])
    cmd = torchrun_command(a, Path("runs/x"))
    i = cmd.index("--parallelism.data_parallel_replicate_degree")
    assert cmd[i + 1] == "1" and cmd[cmd.index("--training.local_batch_size") + 1] == "2"
    assert cmd[-2:] == ["--training.steps", "5"]  # TorchTitan's own overrides come last: they win
