"""Helpers for tests that run the whole pipeline on real Monarch meshes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from pathlib import Path
from typing import Any

from forge_obs.recording.reduce import MetricAccumulator
from forge_obs.analysis.store import read_metrics


class RangeAccumulator(MetricAccumulator):
    """A custom reduction for tests: max - min, merged exactly."""

    def reset(self):
        self.lo, self.hi = float("inf"), float("-inf")

    def append(self, v):
        self.lo, self.hi = min(self.lo, v), max(self.hi, v)

    def get_state(self):
        return self._state(lo=self.lo, hi=self.hi)

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "lo": min(s["lo"] for s in states),
                "hi": max(s["hi"] for s in states)}

    @classmethod
    def value_from_state(cls, s):
        return s["hi"] - s["lo"]


class UniqAccumulator(MetricAccumulator):
    """A custom non-numeric reduction for tests: the number of distinct ``str(value)``."""

    numeric = False

    def reset(self):
        self.seen = set()

    def append(self, v):
        self.seen.add(str(v))

    def get_state(self):
        return self._state(seen=sorted(self.seen))

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "seen": sorted({x for s in states for x in s["seen"]})}

    @classmethod
    def value_from_state(cls, s):
        return len(s["seen"])


async def start_logger(tmp_path: Path, config: dict[str, Any] | None = None, run_id: str = "t", **run: Any):
    """A fresh GlobalLoggingActor session writing to ``tmp_path/<run_id>``."""
    import provisioner_hooks
    from forge_obs import get_or_create_metric_logger
    from forge_obs.recording.collector import MetricCollector

    provisioner_hooks.install()
    MetricCollector().reset()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    cfg = dict(config or {})
    cfg.setdefault("run", {"root": str(tmp_path), "id": run_id, **run})
    await mlogger.init_backends.call_one(cfg)
    return mlogger


async def until_answered(label: str, timeout_s: float = 30.0) -> None:
    """Wait until the controller (this process) no longer takes the rank ``label`` for lagging:
    it missed a cut, came back, and its late answer was taken, so the next cut waits for it."""
    from forge_obs.controller.logger import _STATE

    def lags() -> bool:
        p = _STATE.pipeline
        return p is not None and any(p.label_of(k) == label for k in list(p.lagging))

    deadline = time.monotonic() + timeout_s
    while lags():
        assert time.monotonic() < deadline, f"{label} still lagging after {timeout_s} s"
        await asyncio.sleep(0.01)


def aggregating() -> bool:
    """Whether this run forces the aggregated route (``FORGE_OBS_AGGREGATE=on``: every mesh's
    ranks on a host answer through one leader, its highest live rank)."""
    return os.environ.get("FORGE_OBS_AGGREGATE") == "on"


def global_rows(tmp_path: Path, run_id: str = "t") -> dict[int, dict[str, Any]]:
    """step -> global metrics, from the JSONL store."""
    return {r["step"]: r for r in read_metrics(tmp_path / run_id, "global_reduce")}


def rank_rows(tmp_path: Path, run_id: str = "t") -> list[dict[str, Any]]:
    return read_metrics(tmp_path / run_id, "per_rank_reduce")


ROOT = Path(__file__).resolve().parents[2]


def user_env(env: dict | None = None) -> dict:
    """The environment a user's script runs with: forge_obs from this checkout, no forge_obs
    switch inherited from the test process unless ``env`` sets it."""
    full = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID", "FORGE_OBS_ROOT")}
    full.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), MONARCH_FILE_LOG="error", **(env or {}))
    return full


def start_group(cmd: list, **kw: Any) -> subprocess.Popen:
    """``cmd`` started in a process group of its own (text output captured), so that
    :func:`finish_group` can end it and every process it started (torchrun's workers, mesh procs)."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def finish_group(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; past ``timeout``, kill its whole process group (nothing is left running
    after the test) and raise ``subprocess.TimeoutExpired``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_group(cmd: list, timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` whose timeout also ends
    every process ``cmd`` started."""
    return finish_group(start_group(cmd, **kw), timeout)


def run_as_user(script: "str | Path", cwd: Path, *args: str, env: dict | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess:
    """``python script *args`` as a user runs it: a fresh process in ``cwd`` (not the repository,
    so nothing of the script is importable by its children), forge_obs from this checkout, and no
    forge_obs switch inherited from the test process unless ``env`` sets it. Fails the test with
    the output's tail when the script fails."""
    res = run_group([sys.executable, str(script), *args], cwd=cwd, env=user_env(env), timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def stop_process(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` only queues the
    signal: until one of the process's threads takes it, the others run on, and on a loaded
    machine one of them may still take a cut and answer it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s}s"
        time.sleep(0.001)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True  # gone
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # this thread ended
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True
