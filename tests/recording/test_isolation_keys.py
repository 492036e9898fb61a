"""Keys and strings: every kind of string is treated the same way, and the names forge_obs
writes itself (``obs/…``, the names a dict-valued key such as a distribution is flattened to)
are reserved: a user value under one is dropped, counted by reason, never overwritten or
written twice in a step."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from forge_obs import Reduce, record_metric
from tests.support.helpers import global_rows, start_logger


def _drops(snap):
    return dict(snap["counters"]["dropped_by_reason"])


@pytest.mark.parametrize("value", ["1.5", np.str_("1.5"), b"1.5", np.bytes_(b"1.5")],
                         ids=["str", "np.str_", "bytes", "np.bytes_"])
def test_every_kind_of_string_is_dropped_for_a_numeric_reduction(fresh_collector, value):
    for red in (Reduce.MEAN, Reduce.SUM, "distribution"):
        record_metric("v", value, red)
    snap = fresh_collector.snapshot()
    assert snap["states"] == {} and _drops(snap) == {"bad_value": 3}


def test_every_kind_of_string_is_kept_as_a_sample_row(fresh_collector):
    record_metric("rows", "1.5", Reduce.SAMPLE)
    record_metric("rows", np.str_("2.5"), Reduce.SAMPLE)
    rows = fresh_collector.snapshot()["states"]["rows"]["rows"]
    assert rows == ["1.5", "2.5"] and all(isinstance(r, str) for r in rows)


def test_keys_under_obs_are_reserved_and_dropped_with_a_counted_warning(fresh_collector, caplog):
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        record_metric("obs/dropped_values", 5.0, Reduce.SUM)
        record_metric("obs/mine", 1.0)
        record_metric("obs/mine", 2.0)
        record_metric("observed", 3.0)  # only the "obs/" prefix is reserved
    snap = fresh_collector.snapshot()
    assert set(snap["states"]) == {"observed"}
    assert _drops(snap) == {"reserved_key": 3} and snap["counters"]["dropped_values"] == 3
    assert "'obs/mine'" in caplog.text and "reserved" in caplog.text


async def test_a_user_key_under_obs_never_overwrites_forge_obs_own(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    record_metric("obs/dropped_values", 100.0, Reduce.SUM)
    record_metric("obs/values_recorded", 100.0, Reduce.SUM)
    record_metric("x", 1.0, Reduce.SUM)
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    m = global_rows(tmp_path)[0]["metrics"]
    assert m["x"] == 1.0
    assert m["obs/values_recorded"] == 1.0  # forge_obs's own count: the one value recorded
    assert m["obs/dropped_values"] == 2.0 and m["obs/dropped/reserved_key"] == 2.0


def test_device_values_under_obs_are_reserved_too():
    torch = pytest.importorskip("torch")
    from forge_obs.recording.collector import Taken
    from forge_obs.recording.device import DeviceValues

    dv = DeviceValues()
    assert not dv.record("obs/gpu", torch.tensor(1.0), Reduce.MEAN)
    assert dv.record("gpu", torch.tensor(2.0), Reduce.MEAN)
    accs, counters = {}, {"values_recorded": 0, "dropped_values": 0}
    dv.swap().resolve_into(Taken(accs, None, counters, None))
    assert {k: a.get_value() for k, a in accs.items()} == {"gpu": 2.0}
    assert counters["dropped_by_reason"] == {"reserved_key": 1} and counters["dropped_values"] == 1


class Latency:
    """Every rank: ``lat`` as a distribution (flattened to lat/p50, lat/p90, lat/p99, lat/count
    by W&B and TensorBoard), and the user's own ``lat/p50`` and ``lat/count``."""

    @staticmethod
    def record(rank: int) -> None:
        for v in (1.0, 2.0, 3.0):
            record_metric("lat", v * (rank + 1), "distribution")
        record_metric("lat/p50", 100.0)
        record_metric("lat/count", 7.0, Reduce.SUM)
        record_metric("lat/mean", 5.0)  # no distribution field is called "mean": kept


async def test_a_key_equal_to_a_flattened_name_is_dropped_once_and_counted(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    from monarch.actor import Actor, current_rank, endpoint, this_host
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.support.helpers import rank_rows

    class Rec(Actor):
        @endpoint
        async def record(self) -> None:
            Latency.record(current_rank().rank)

    modes = ["global_reduce", "per_rank_reduce"]
    mlogger = await start_logger(tmp_path, {"tensorboard": {"logging_mode": modes}})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="lat")
    try:
        with caplog.at_level(logging.WARNING, logger="forge_obs"):
            await pm.spawn("Rec", Rec).record.call()
            await mlogger.flush.call_one(0)
            await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    m = global_rows(tmp_path)[0]["metrics"]
    assert m["lat"]["count"] == 6 and m["lat/mean"] == 5.0
    assert "lat/p50" not in m and "lat/count" not in m
    assert m["obs/dropped/reserved_key"] == 2.0 and m["obs/dropped_values"] == 2.0
    assert "'lat/p50'" in caplog.text and "rename" in caplog.text
    for r in rank_rows(tmp_path):
        if r["source"].get("mesh") == "lat":
            assert "lat/p50" not in r["metrics"] and r["metrics"]["lat/mean"] == 5.0
    ea = EventAccumulator(str(tmp_path / "t" / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    # one point per tag and step: the distribution's
    assert [(e.step, e.value) for e in ea.Scalars("lat/count")] == [(0, 6.0)]
    assert len(ea.Scalars("lat/p50")) == 1 and ea.Scalars("lat/p50")[0].value < 10
    rank_tags = [t for t in ea.Tags()["scalars"] if t.endswith("/lat/count")]
    assert len(rank_tags) == 2 and all(len(ea.Scalars(t)) == 1 for t in rank_tags)
