"""What crosses processes stays per key, on both routes (each rank to the controller, and through
a group leader with ``"aggregate": "on"``): a key the controller cannot merge or decode costs that
key only, and the step's drop counters are the same whichever route the states took."""

from __future__ import annotations

import asyncio
import sys
import time
import types

import pytest
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, record_metric, register_reduction
from forge_obs.analysis.store import read_metrics
from tests.support.helpers import RangeAccumulator, global_rows, rank_rows, start_logger


class ActorsOnlyRange(RangeAccumulator):
    """A custom reduction registered in the actors' processes only (not on the controller)."""


class Mixed(Actor):
    """Every rank: one good value, a custom reduction the controller does not know, a bad key;
    rank 0 records ``bad/mix`` as SUM, the others as MEAN (conflicting reductions across ranks)."""

    @endpoint
    async def record(self) -> None:
        rank = current_rank().rank
        record_metric("good/x", 1.0, Reduce.SUM)
        record_metric("bad/custom", float(rank), register_reduction("actors_only_range", ActorsOnlyRange))
        record_metric("bad/mix", 1.0, Reduce.SUM if rank == 0 else Reduce.MEAN)
        record_metric(("not", "a", "key"), 1.0)


async def _two_steps(tmp_path, aggregate: str, actor: type, name: str) -> dict:
    """Step 0 lets every rank say hello (its first cut takes the direct route); step 1 is the
    one measured: with ``aggregate`` "on" its states come in one bundle."""
    mlogger = await start_logger(tmp_path, {"aggregate": aggregate})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name=name)
    try:
        a = pm.spawn(name, actor)
        await mlogger.flush.call_one(0)
        await a.record.call()
        await mlogger.flush.call_one(1)
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    row = global_rows(tmp_path)[1]
    assert not row.get("missing")
    assert row["metrics"]["obs/bundles"] == (1.0 if aggregate == "on" else 0.0)
    return row["metrics"]


def _worker_only_class(module: str) -> type:
    """A class of a module that exists only in the processes that ran this (put into
    ``sys.modules``): it pickles there, by reference, and cannot be unpickled anywhere else."""
    mod = sys.modules.get(module)
    if mod is None:
        mod = sys.modules[module] = types.ModuleType(module)
        mod.Obj = type("Obj", (), {"__module__": module})
    return mod.Obj


class Opaque(Actor):
    """Rank 0 records two SAMPLE rows the controller cannot unpickle: one whose class every rank
    of the mesh can import (so a group leader decodes and merges it), one whose class only rank 0
    can (so even the leader cannot)."""

    @endpoint
    async def record(self) -> None:
        rank = current_rank().rank
        everywhere = _worker_only_class("forge_obs_test_every_worker")
        record_metric("good/x", 1.0, Reduce.SUM)
        record_metric("good/rows", {"rank": rank}, Reduce.SAMPLE)
        if rank == 0:
            record_metric("gen/opaque", {"obj": everywhere()}, Reduce.SAMPLE)
            record_metric("gen/opaque_r0", _worker_only_class("forge_obs_test_rank0_only")(), Reduce.SAMPLE)


@pytest.mark.parametrize("aggregate", ["off", "on"])
async def test_a_row_the_controller_cannot_unpickle_costs_only_its_key(tmp_path, aggregate):
    m = await _two_steps(tmp_path, aggregate, Opaque, "opaque")
    assert m["good/x"] == 2.0  # rank 0's other keys arrive, in their step
    assert sorted(r["rank"] for r in m["good/rows"]) == [0, 1]
    assert "gen/opaque" not in m and "gen/opaque_r0" not in m
    assert m["obs/dropped/undecodable"] == 2.0 and m["obs/dropped_values"] == 2.0
    ranks = {r["source"]["rank"]: r["metrics"] for r in rank_rows(tmp_path)
             if r["step"] == 1 and r["source"].get("mesh") == "opaque"}
    assert ranks[0]["good/x"] == 1.0 and ranks[1]["good/x"] == 1.0
    assert "gen/opaque" not in ranks[0]


@pytest.mark.parametrize("aggregate", ["off", "on"])
async def test_drop_counts_are_the_same_on_both_routes(tmp_path, aggregate):
    m = await _two_steps(tmp_path, aggregate, Mixed, "mixed")
    assert m["good/x"] == 2.0 and "bad/custom" not in m and "bad/mix" not in m
    # values dropped on the ranks count one each (2 bad keys); a key dropped while merging
    # counts once per step, whichever process merged it and however many ranks held it
    drops = {k: v for k, v in m.items() if k.startswith("obs/dropped/")}
    assert drops == {"obs/dropped/bad_key": 2.0, "obs/dropped/unknown_reduction": 1.0,
                     "obs/dropped/reduction_mismatch": 1.0}
    assert m["obs/dropped_values"] == 4.0
    ranks = [r for r in rank_rows(tmp_path) if r["step"] == 1 and r["source"].get("mesh") == "mixed"]
    assert sorted(r["metrics"]["good/x"] for r in ranks) == [1.0, 1.0]


async def test_a_streamed_value_the_controller_cannot_unpickle_costs_only_itself(tmp_path):
    """per_rank_no_reduce streams raw values between flushes: a row the controller cannot
    unpickle is left out (counted with the next step), the rank's other values stream and its
    step arrives (the message carrying it is not lost, nor the controller's inbox)."""
    mlogger = await start_logger(tmp_path, {"jsonl": {"logging_mode": ["global_reduce", "per_rank_no_reduce"]},
                                            "stream_interval_s": 0.05})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="opaque")
    try:
        a = pm.spawn("opaque", Opaque)
        await mlogger.flush.call_one(0)
        await a.record.call()
        streamed = lambda: [(r["source"]["rank"], k, v) for r in read_metrics(tmp_path / "t", "per_rank_no_reduce")  # noqa: E731
                            for k, v, _ts in r["values"]]
        await _wait_for(lambda: sum(k == "good/x" for _r, k, _v in streamed()) == 2)  # streamed before the flush
        await mlogger.flush.call_one(1)
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    assert sorted(streamed()) == [(0, "good/rows", {"rank": 0}), (0, "good/x", 1.0),
                                  (1, "good/rows", {"rank": 1}), (1, "good/x", 1.0)]
    row = global_rows(tmp_path)[1]
    assert not row.get("missing") and row["metrics"]["good/x"] == 2.0
    assert row["metrics"]["obs/dropped/undecodable"] == 2.0


async def _wait_for(cond, timeout_s: float = 20.0) -> None:
    """Poll ``cond`` (a file another thread writes) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
