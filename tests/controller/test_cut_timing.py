"""Where a cut's time goes (``obs/cut/...``) and the raw round trip it is measured against
(``probe_round_trip``), on real Monarch proc meshes: the parts are the caller's own wait, split
along the closing rank's path, and probing changes no value's step."""

import os
import signal
import time

import pytest
from monarch.actor import Actor, endpoint, this_host

from forge_obs import Reduce, record_metric
from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.fetcher import ACK_STATES_MAX_COLUMN_KEYS, ACK_STATES_MAX_VALUES

#: keys a rank records for a cut whose states it holds until the controller asks (a large cut)
LARGE = ACK_STATES_MAX_COLUMN_KEYS + 1
from forge_obs.controller.cut_timing import CLOCK_DOMAIN, breakdown
from tests.support.helpers import aggregating, global_rows, start_logger, stop_process

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


async def test_the_probe_figure_is_in_its_step_however_soon_the_cut_closes(tmp_path, monkeypatch):
    """The cut carries the probe's round trip from its start: here the step is closed and
    assembled (no rank to wait for) before start_flush returns, and still has the figure."""
    from forge_obs.controller import flush as lg
    from forge_obs.controller.pipeline import FlushPipeline

    mlogger = await start_logger(tmp_path)
    orig = FlushPipeline.begin_cut

    def begin_then_assemble(self, *a, **kw):
        cut = orig(self, *a, **kw)
        with self._cv:  # the step leaves for the backends before the caller goes on
            self._cv.wait_for(lambda: self.assembled >= cut.seq, timeout=30)
        return cut

    async def probe() -> float:
        return 0.0042

    monkeypatch.setattr(FlushPipeline, "begin_cut", begin_then_assemble)
    monkeypatch.setattr(lg, "probe_round_trip", probe)
    await lg.ProbedFlush(0)  # what `await mlogger.flush.call_one(0)` runs with "probe_round_trip"
    monkeypatch.undo()
    await mlogger.shutdown.call_one()
    assert global_rows(tmp_path)[0]["metrics"]["obs/raw_round_trip_s"] == 0.0042


class Many(Actor):
    @endpoint
    async def record(self, n: int, v: float) -> None:
        for i in range(n):
            record_metric(f"many/k{i}", v, Reduce.SUM)


@pytest.mark.parametrize("n_keys", [ACK_STATES_MAX_VALUES, ACK_STATES_MAX_VALUES + 1, ACK_STATES_MAX_COLUMN_KEYS, LARGE])
async def test_small_and_large_cuts_put_every_value_in_its_step(tmp_path, n_keys):
    """A small cut's states come with the ack; a large cut's ranks hold theirs until the cut
    closed and the controller asks: either way each step has exactly its own values, also when
    the mesh stops right after a flush and for the step of shutdown."""
    mlogger = await start_logger(tmp_path)
    pm = this_host().spawn_procs(per_host={"procs": 2})
    m = pm.spawn("Many", Many)
    for step in range(3):
        await m.record.call(n_keys, float(step + 1))
        await mlogger.flush.call_one(step)
    await m.record.call(n_keys, 10.0)
    await pm.stop()  # its last values are handed over as final states
    await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path)
    for step in range(3):
        got = rows[step]["metrics"]
        assert [got[f"many/k{i}"] for i in (0, n_keys - 1)] == [2.0 * (step + 1)] * 2, step
        assert got["obs/missing_ranks"] == 0 and got["obs/late_ranks"] == 0
    last = rows[3]["metrics"]
    assert last["many/k0"] == last[f"many/k{n_keys - 1}"] == 20.0


async def test_a_large_cut_flushed_from_synchronous_code_arrives(tmp_path):
    """``flush(...).get()`` (no event loop awaits the cut): the held states are asked for too."""
    import asyncio

    mlogger = await start_logger(tmp_path)
    pm = this_host().spawn_procs(per_host={"procs": 2})
    m = pm.spawn("Many", Many)
    await m.record.call(LARGE, 3.0)
    await asyncio.get_running_loop().run_in_executor(None, lambda: mlogger.flush.call_one(0).get())
    await mlogger.shutdown.call_one()
    await pm.stop()
    got = global_rows(tmp_path)[0]["metrics"]
    assert got["many/k0"] == got[f"many/k{LARGE - 1}"] == 6.0 and got["obs/missing_ranks"] == 0


@pytest.mark.parametrize("then", ["next_cut", "mesh_stop"])
async def test_held_states_go_before_the_next_cut_and_before_final_states(tmp_path, then):
    """Should the controller's request for a large cut's states never come, the ranks send them
    before their next acknowledgement, or with their final states when the mesh stops: the
    step still has exactly its values (nothing waits for a timeout)."""
    from forge_obs.controller.state import CONTROLLER

    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 60})
    asked: list = []
    CONTROLLER.pipeline.ask_exports = lambda seq, meshes: asked.append(seq)  # requests go nowhere
    pm = this_host().spawn_procs(per_host={"procs": 2})
    m = pm.spawn("Many", Many)
    await m.record.call(LARGE, 1.0)
    await mlogger.flush.call_one(0)
    if then == "next_cut":  # cut 1 brings cut 0's states; the shutdown's cut brings cut 1's
        await m.record.call(LARGE, 2.0)
        await mlogger.flush.call_one(1)
        t0 = time.monotonic()
        await mlogger.shutdown.call_one()
        await pm.stop()
    else:
        t0 = time.monotonic()
        await pm.stop()
        await mlogger.shutdown.call_one()
    assert time.monotonic() - t0 < 30.0  # no step waited for its timeout
    rows = global_rows(tmp_path)
    # the requests were made (and dropped here); with aggregation no rank holds its states (they
    # go to the group leader at once), and a request is made only if the bundle came after the cut closed
    assert asked or aggregating()
    assert rows[0]["metrics"]["many/k0"] == rows[0]["metrics"][f"many/k{LARGE - 1}"] == 2.0
    if then == "next_cut":
        assert rows[1]["metrics"]["many/k0"] == rows[1]["metrics"][f"many/k{LARGE - 1}"] == 4.0
    assert all(r["metrics"]["obs/missing_ranks"] == 0 and r["metrics"]["obs/late_ranks"] == 0 for r in rows.values())


class Pid(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()


async def test_held_states_of_a_cut_closed_by_its_timeout_still_arrive(tmp_path):
    """Another mesh's rank hangs, so the cut closes at its timeout with no time left: the held
    states of the ranks that acknowledged are asked for then and still land in the step."""
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 1.0})
    big = this_host().spawn_procs(per_host={"procs": 1}, name="big")
    m = big.spawn("Many", Many)
    stall = this_host().spawn_procs(per_host={"procs": 1}, name="hangs")
    pid = await stall.spawn("Pid", Pid).pid.call_one()
    await mlogger.flush.call_one(0)  # every rank's fetcher is up and answered: step 1 is the first one a rank hangs in
    await mlogger.wait_idle.call_one()
    await m.record.call(LARGE, 5.0)
    stop_process(pid)
    try:
        await mlogger.flush.call_one(1)
        await mlogger.wait_idle.call_one()
    finally:
        os.kill(pid, signal.SIGCONT)
    row = global_rows(tmp_path)[1]
    assert row["metrics"]["many/k0"] == row["metrics"][f"many/k{LARGE - 1}"] == 5.0
    assert row["missing"] == ["hangs/Pid/r0"]
    await mlogger.shutdown.call_one()
    await stall.stop()
    await big.stop()
