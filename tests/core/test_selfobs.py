"""forge_obs's own cost travels on its own path (forge_obs.core.selfobs), never through the user's
collector, and the controller's parts land in the step being assembled."""

from monarch.actor import Actor, endpoint, this_host

from forge_obs import Reduce, record_metric
from forge_obs.recording.collector import MetricCollector
from forge_obs.core.selfobs import CPU_PARTS, SELF_OBS
from tests.support.helpers import global_rows, start_logger


class Recorder(Actor):
    @endpoint
    async def record(self, v: float) -> None:
        record_metric("own/v", v, Reduce.SUM)


def test_the_users_collector_carries_no_self_observation():
    c = MetricCollector()
    c.reset()
    SELF_OBS.take()
    record_metric("user/x", 1.0, Reduce.SUM)
    SELF_OBS.add("inbox", 0.5)
    counters = c.swap().counters
    assert not any(k.startswith("cpu_") for k in counters), counters
    assert not hasattr(c, "add_obs_cpu")
    assert SELF_OBS.take() == {"cpu_inbox_s": 0.5}


async def test_controller_cpu_is_in_the_step_it_was_spent_for_and_ranks_send_theirs(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    mesh = this_host().spawn_procs(per_host={"procs": 2}, name="own")
    actor = mesh.spawn("Recorder", Recorder)
    try:
        for step in range(3):
            await actor.record.call(1.0)
            await mlogger.flush.call_one(step)
        await mlogger.shutdown.call_one()
    finally:
        await mesh.stop()
    rows = global_rows(tmp_path)
    assert [rows[s]["metrics"]["own/v"] for s in range(3)] == [2.0, 2.0, 2.0]
    m0 = rows[0]["metrics"]
    # the first step's cut and its acks were handled before step 0 was assembled: counted there
    assert m0["obs/cpu_flush_s"] > 0 and m0["obs/cpu_inbox_s"] > 0, m0
    # each rank's export of cut N is measured after it sent cut N, so it rides with cut N+1
    assert rows[1]["metrics"]["obs/cpu_export_s"] > 0
    for s in range(3):
        m = rows[s]["metrics"]
        parts = sum(m[f"obs/cpu_{p}_s"] for p in CPU_PARTS)
        assert abs(m["obs/cpu_s"] - parts) < 1e-9
        assert not any(k.startswith("cpu_") for k in m)
