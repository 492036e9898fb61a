"""What crosses processes stays per key, on both routes (each rank to the controller, and through
a group leader with ``"aggregate": "on"``): a key the controller cannot merge or decode costs that
key only, and the step's drop counters are the same whichever route the states took."""

from __future__ import annotations

import pytest
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, record_metric, register_reduction
from tests.helpers import RangeAccumulator, global_rows, rank_rows, start_logger


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
