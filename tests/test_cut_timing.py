"""Where a cut's time goes (``obs/cut/...``) and the raw round trip it is measured against
(``probe_round_trip``), on real Monarch proc meshes: the parts are the caller's own wait, split
along the closing rank's path, and probing changes no value's step."""

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_obs import Reduce, record_metric
from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.cut_timing import CLOCK_DOMAIN, breakdown
from tests.helpers import aggregating, global_rows, start_logger

PARTS = ("obs/cut/send_s", "obs/cut/to_rank_s", "obs/cut/rank_s", "obs/cut/ack_s", "obs/cut/resume_s")


class Worker(Actor):
    @endpoint
    async def record(self, v: float) -> None:
        record_metric("timing/v", v, Reduce.SUM)


def test_parts_add_up_to_the_wait_along_the_closing_rank():
    got = breakdown(called_at=10.0, sent_at=10.001, closed_at=10.004, resumed_at=10.0045,
                    stamp=(CLOCK_DOMAIN, 10.002, 10.0022))
    assert sum(got[k] for k in PARTS) == pytest.approx(got["obs/cut/blocked_s"]) == pytest.approx(0.0045)
    assert got["obs/cut/transit_s"] == pytest.approx(got["obs/cut/to_rank_s"] + got["obs/cut/ack_s"])


def test_a_rank_of_another_host_gives_transit_only_and_no_stamp_gives_the_wait_only():
    other = breakdown(0.0, 0.001, 0.004, 0.005, stamp=("another-boot", 123.0, 123.0005))
    assert other["obs/cut/transit_s"] == pytest.approx(0.0025) and other["obs/cut/rank_s"] == pytest.approx(0.0005)
    assert "obs/cut/to_rank_s" not in other and "obs/cut/ack_s" not in other
    timed_out = breakdown(0.0, 0.001, 10.0, None, stamp=None)
    assert timed_out == {"obs/cut/blocked_s": 10.0, "obs/cut/send_s": 0.001}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_probe_round_trip_takes_a_bool(value):
    with pytest.raises(ValueError, match="probe_round_trip must be True or False"):
        LoggerConfig.parse({"probe_round_trip": value})


def test_probe_round_trip_env_sets_the_default(monkeypatch):
    monkeypatch.setenv("FORGE_OBS_PROBE_ROUND_TRIP", "on")
    assert LoggerConfig.parse({}).probe_round_trip is True
    assert LoggerConfig.parse({"probe_round_trip": False}).probe_round_trip is False


@pytest.mark.parametrize("probe", [True, False])
async def test_each_step_has_its_cut_parts_and_the_probe_changes_no_value(tmp_path, probe):
    mlogger = await start_logger(tmp_path, {"probe_round_trip": probe})
    pm = this_host().spawn_procs(per_host={"procs": 2})
    w = pm.spawn("Worker", Worker)
    steps = 4
    for step in range(steps):
        await w.record.call(float(step + 1))
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    await pm.stop()
    rows = global_rows(tmp_path)
    assert [rows[s]["metrics"]["timing/v"] for s in range(steps)] == [2.0 * (s + 1) for s in range(steps)]
    for s in range(steps):
        m = rows[s]["metrics"]
        assert m["obs/cut/blocked_s"] >= m["obs/cut/send_s"] > 0.0
        assert ("obs/raw_round_trip_s" in m) is probe
        if probe:
            assert m["obs/raw_round_trip_s"] > 0.0
        if aggregating():  # acks come batched by a leader: no rank's stamp
            continue
        assert all(m[k] >= 0.0 for k in PARTS), m
        assert m["obs/cut/rank_s"] < m["obs/cut/blocked_s"]
        # the parts cover the wait; they exceed it only where the closing rank entered its cut
        # before every mesh was cast to (to_rank is then 0 and send overlaps it)
        assert sum(m[k] for k in PARTS) >= m["obs/cut/blocked_s"] - 1e-9
        if m["obs/cut/to_rank_s"] > 0.0:
            assert sum(m[k] for k in PARTS) == pytest.approx(m["obs/cut/blocked_s"], abs=1e-6)
