"""One bad value, rank or backend never costs anything else — on real Monarch meshes: a key that
cannot be merged or pickled drops only itself (counted by reason), and a hanging or slow backend
delays only itself (the local store goes on; shutdown returns within its timeout)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_obs import LoggerBackend, MetricAccumulator, Reduce, record_metric, register_backend, register_reduction
from tests.support.helpers import RangeAccumulator, global_rows, rank_rows, start_logger


class ActorOnlyRange(RangeAccumulator):
    """A custom reduction registered in the actors' processes only (not on the controller)."""


class BrokenState(MetricAccumulator):
    """A custom accumulator whose state cannot be exported."""

    def reset(self):
        self.n = 0

    def append(self, v):
        self.n += 1

    def get_state(self):
        raise RuntimeError("cannot export this state")

    @classmethod
    def merge_states(cls, states):
        return states[0]

    @classmethod
    def value_from_state(cls, s):
        return 0.0


register_reduction("broken_state", BrokenState)


class Bad(Actor):
    @endpoint
    async def record(self, what: str) -> None:
        from monarch.actor import current_rank

        rank = current_rank().rank
        record_metric("iso/ok", 1.0, Reduce.SUM)
        if what == "overflow":
            record_metric("iso/big", 1e308, Reduce.SUM)
        elif what == "unknown_reduction":
            from forge_obs.recording.reduce import reduction_names

            if "actor_only_range" not in reduction_names():
                register_reduction("actor_only_range", ActorOnlyRange)
            record_metric("iso/range", float(rank), "actor_only_range")
        elif what == "unpicklable" and rank == 0:
            record_metric("iso/rollout", {"prompt": "1+1", "lock": threading.Lock()}, Reduce.SAMPLE)
            record_metric("iso/rollout_ok", {"prompt": "2+2"}, Reduce.SAMPLE)
        elif what == "broken_state" and rank == 0:
            record_metric("iso/broken", 1.0, "broken_state")


@pytest.mark.parametrize(
    "what, reason",
    [("unknown_reduction", "unknown_reduction"), ("unpicklable", "unpicklable"), ("broken_state", "export_error")],
)
async def test_a_key_that_cannot_be_reduced_or_sent_costs_only_itself(tmp_path, what, reason):
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 10.0})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="iso")
    a = pm.spawn("Bad", Bad)
    await a.record.call(what)
    record_metric("iso/controller", 3.0, Reduce.SUM)
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    await pm.stop()
    row = global_rows(tmp_path)[0]
    m = row["metrics"]
    assert m["iso/ok"] == 2.0 and m["iso/controller"] == 3.0  # every other key of every rank arrived
    assert not row.get("missing")
    assert m["obs/dropped_values"] >= 1 and m[f"obs/dropped/{reason}"] >= 1, m
    if what == "unpicklable":
        assert "iso/rollout_ok" in m  # the same rank's other SAMPLE key arrived
    ranks = [r for r in rank_rows(tmp_path) if r["step"] == 0 and r["source"].get("mesh") == "iso"]
    assert sorted(r["metrics"]["iso/ok"] for r in ranks) == [1.0, 1.0]


async def test_a_sum_beyond_the_float_range_becomes_inf_and_the_step_arrives(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="ovf")
    await pm.spawn("Bad", Bad).record.call("overflow")
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    await pm.stop()
    m = global_rows(tmp_path)[0]["metrics"]
    assert m["iso/ok"] == 2.0
    assert m["iso/big"] == math.inf  # IEEE: 1e308 + 1e308 overflows to inf, kept


class Hang(LoggerBackend):
    """Hangs in log_step (sync or async) from its second step on, or in finish."""

    release = threading.Event()
    seen: list = []

    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.where = self.config.get("where", "log_step")

    def log_step(self, record):
        Hang.seen.append(record.step)
        if self.where == "log_step" and record.step >= 1:
            Hang.release.wait(120)

    def finish(self):
        if self.where == "finish":
            Hang.release.wait(120)


class AsyncHang(LoggerBackend):
    async def log_step(self, record):
        if record.step >= 1:
            await asyncio.get_running_loop().run_in_executor(None, Hang.release.wait, 120)


register_backend("test_hang", Hang)
register_backend("test_async_hang", AsyncHang)


@pytest.mark.parametrize("backend, where", [("test_hang", "log_step"), ("test_async_hang", "log_step"), ("test_hang", "finish")])
async def test_a_hanging_backend_delays_only_itself_and_shutdown_returns(tmp_path, backend, where):
    Hang.release.clear()
    Hang.seen = []
    mlogger = await start_logger(tmp_path, {backend: {"where": where} if backend == "test_hang" else {},
                                            "shutdown_timeout_s": 2.0})
    try:
        for step in range(4):
            record_metric("hang/x", step, Reduce.SUM)
            await mlogger.flush.call_one(step)  # never blocked by the backend
        # the local store has every step while the backend hangs
        deadline = time.monotonic() + 30
        while len(global_rows(tmp_path)) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling the store for a condition, with a deadline
        assert sorted(global_rows(tmp_path)) == [0, 1, 2, 3]
        t0 = time.monotonic()
        await mlogger.shutdown.call_one()
        shutdown_s = time.monotonic() - t0
    finally:
        Hang.release.set()
    assert shutdown_s < 2.0 + 3.0, shutdown_s
    assert [global_rows(tmp_path)[s]["metrics"]["hang/x"] for s in range(4)] == [0.0, 1.0, 2.0, 3.0]
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert meta["unfinished_backends"] == [backend] and meta["status"] == "finished"


class Gate(LoggerBackend):
    gate = threading.Event()

    def log_step(self, record):
        Gate.gate.wait(120)


register_backend("test_gate_iso", Gate)


async def test_a_backend_that_falls_behind_has_steps_dropped_for_it_only_and_counted(tmp_path, caplog):
    Gate.gate.clear()
    mlogger = await start_logger(tmp_path, {"test_gate_iso": {}, "backend_queue_steps": 2, "shutdown_timeout_s": 5.0})
    try:
        for step in range(8):
            record_metric("q/x", 1.0, Reduce.SUM)
            await mlogger.flush.call_one(step)
        deadline = time.monotonic() + 30
        while len(global_rows(tmp_path)) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        Gate.gate.set()
    await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path)
    assert sorted(rows) == list(range(8))  # the store has every step
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    dropped = meta["backends"]["test_gate_iso"]["dropped_steps"]
    assert dropped >= 1 and meta["backends"]["test_gate_iso"]["steps"] + dropped == 8
    assert meta["backends"]["jsonl"]["dropped_steps"] == 0
    assert rows[7]["metrics"]["obs/backend_dropped_steps"] >= 1
    assert sum("test_gate_iso" in r.getMessage() and "behind" in r.getMessage() for r in caplog.records) == 1
