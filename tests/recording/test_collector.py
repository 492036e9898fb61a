"""The hot path: exactness under concurrency, bad input, disabled mode, no heavy imports."""

import asyncio
import logging
import math
import subprocess
import sys
import threading

import numpy as np
import pytest

from forge_obs import Reduce, record_metric


def test_values_land_in_the_snapshot_and_reset(fresh_collector):
    for x in (1, 2, 3):
        record_metric("s", x, Reduce.SUM)
        record_metric("m", x, Reduce.MEAN)
    snap = fresh_collector.snapshot()
    assert snap["states"]["s"]["sum"] == 6.0
    assert snap["states"]["m"] == {"reduction_type": "mean", "sum": 6.0, "count": 3}
    assert snap["counters"]["values_recorded"] == 6
    assert fresh_collector.snapshot()["states"] == {}


def test_numpy_bool_and_tensor_values(fresh_collector):
    torch = pytest.importorskip("torch")
    record_metric("np", np.float32(1.5), Reduce.SUM)
    record_metric("np", np.int64(2), Reduce.SUM)
    record_metric("np", True, Reduce.SUM)
    record_metric("t", torch.tensor(2.5), Reduce.SUM)
    record_metric("t", torch.tensor([0.5]), Reduce.SUM)
    snap = fresh_collector.snapshot()
    assert snap["states"]["np"]["sum"] == 4.5
    assert snap["states"]["t"]["sum"] == 3.0
    assert snap["counters"]["dropped_values"] == 0


@pytest.mark.parametrize("bad", ["1.0", None, [1, 2], {"a": 1}, b"x"])
def test_bad_values_are_dropped_counted_and_warned_once(fresh_collector, caplog, bad):
    key = f"bad/{type(bad).__name__}"
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        for _ in range(50):
            record_metric(key, bad, Reduce.MEAN)  # never raises
    record_metric(key, 1.0, Reduce.MEAN)
    snap = fresh_collector.snapshot()
    assert snap["counters"]["dropped_values"] == 50
    assert snap["states"][key]["count"] == 1
    msgs = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(msgs) == 1, msgs  # rate-limited: one warning, naming the key


def test_multi_element_tensor_is_dropped(fresh_collector):
    torch = pytest.importorskip("torch")
    record_metric("vec", torch.ones(3))
    assert fresh_collector.snapshot()["counters"]["dropped_values"] == 1


def test_reduction_mismatch_drops_the_value_and_warns(fresh_collector, caplog):
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        record_metric("k", 1.0, Reduce.SUM)
        record_metric("k", 5.0, Reduce.MAX)
        record_metric("k", 2.0, Reduce.SUM)
    snap = fresh_collector.snapshot()
    assert snap["states"]["k"]["sum"] == 3.0
    assert snap["counters"]["dropped_values"] == 1
    assert any("'k'" in r.getMessage() and "MAX" in r.getMessage() for r in caplog.records)


def test_unknown_reduction_name_is_dropped(fresh_collector):
    record_metric("k", 1.0, "median")
    record_metric("k2", 1.0, "sum")  # a registered name works like Reduce.SUM
    snap = fresh_collector.snapshot()
    assert snap["counters"]["dropped_values"] == 1
    assert snap["states"]["k2"]["sum"] == 1.0


def test_nonfinite_values_are_kept_and_counted(fresh_collector):
    record_metric("loss", float("nan"))
    record_metric("loss", float("inf"))
    record_metric("loss", np.float64("-inf"))
    record_metric("loss", 1.0)
    snap = fresh_collector.snapshot()
    assert snap["states"]["loss"]["count"] == 4
    assert math.isnan(snap["states"]["loss"]["sum"])
    assert snap["counters"]["nonfinite_values"] == 3


def test_sample_rows(fresh_collector):
    record_metric("rollouts", {"prompt": "1+1", "reward": 1.0}, Reduce.SAMPLE)
    snap = fresh_collector.snapshot()
    assert snap["states"]["rollouts"]["rows"] == [{"prompt": "1+1", "reward": 1.0}]


def test_streaming_keeps_raw_values_with_timestamps(fresh_collector):
    fresh_collector.set_streaming(True)
    record_metric("x", 1.0)
    record_metric("x", 2.0)
    raw = fresh_collector.snapshot()["raw"]
    assert [(k, v) for k, v, _ in raw] == [("x", 1.0), ("x", 2.0)]
    assert raw[0][2] <= raw[1][2]


@pytest.mark.parametrize("red", [r for r in Reduce if r is not Reduce.SAMPLE])
def test_a_key_of_an_earlier_step_keeps_its_column_and_its_state(fresh_collector, red):
    """A key's first value of a later step goes to the column it was interned in on its first
    value (no accumulator object per step), and its state is what an accumulator of its
    reduction makes of the same value."""
    from forge_obs.recording.reduce import accumulator_for

    record_metric("k", 1.0, red)
    first = fresh_collector.snapshot()["states"]["k"]
    record_metric("k", 1.0, red)  # the key's first value of the next step
    assert fresh_collector._slots["k"][0] is red and "k" not in fresh_collector._accs
    made = accumulator_for(red.value)(red)
    made.append(1.0)
    second = fresh_collector.snapshot()

    def no_ts(st: dict) -> dict:
        return {k: v for k, v in st.items() if k != "ts"}

    assert no_ts(second["states"]["k"]) == no_ts(first) == no_ts(made.get_state())
    assert second["counters"]["values_recorded"] == 1


def test_a_known_key_with_another_reduction_or_a_huge_int_takes_the_full_path(fresh_collector):
    record_metric("k", 1.0, Reduce.SUM)
    record_metric("big", 1, Reduce.SUM)
    fresh_collector.snapshot()
    fresh_collector.set_streaming(True)
    record_metric("k", 5.0, Reduce.MAX)  # another step may use another reduction
    record_metric("k", 2.0, Reduce.SUM)  # ... and then this step's first one holds
    record_metric("big", 10**400, Reduce.SUM)  # beyond the float range: +inf, counted
    snap = fresh_collector.snapshot()
    assert snap["states"]["k"]["reduction_type"] == "max" and snap["states"]["k"]["max"] == 5.0
    assert snap["states"]["big"]["sum"] == math.inf
    assert snap["counters"]["dropped_values"] == 1 and snap["counters"]["nonfinite_values"] == 1
    assert [(k, v) for k, v, _ in snap["raw"]] == [("k", 5.0), ("big", math.inf)]


def test_a_str_subclass_key_equal_to_a_known_key_is_recorded_under_the_plain_str(fresh_collector):
    """A key equal to a known one but of a str subclass (a str Enum) takes the full path, which
    records it under the plain str, also in a step after the plain key was known."""
    import enum

    class K(str, enum.Enum):
        LOSS = "loss"

    record_metric("loss", 1.0)
    fresh_collector.snapshot()
    record_metric(K.LOSS, 2.0)  # the first value of this step: under "loss", never under K.LOSS
    record_metric("loss", 4.0)
    snap = fresh_collector.snapshot()
    assert {type(k) for k in snap["states"]} == {str}
    assert snap["states"]["loss"]["sum"] == 6.0 and snap["states"]["loss"]["count"] == 2


def test_the_keys_in_columns_are_bounded(fresh_collector, monkeypatch):
    from forge_obs.recording import collector

    monkeypatch.setattr(collector, "KNOWN_KEYS_MAX", len(fresh_collector._slots) + 3)
    for i in range(10):
        record_metric(f"unique/{i}", float(i), Reduce.SUM)
    assert sum(k.startswith("unique/") for k in fresh_collector._slots) == 3
    states = fresh_collector.snapshot()["states"]
    assert {k: st["sum"] for k, st in states.items() if k.startswith("unique/")} == {f"unique/{i}": float(i) for i in range(10)}


def test_threads_and_tasks_lose_nothing_while_snapshots_run(fresh_collector):
    n_threads, per_thread = 4, 50_000
    totals = []
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            totals.append(fresh_collector.snapshot()["states"].get("n", {"sum": 0.0})["sum"])

    def writer():
        for _ in range(per_thread):
            record_metric("n", 1, Reduce.SUM)

    async def tasks():
        async def one():
            for i in range(per_thread):
                record_metric("n", 1, Reduce.SUM)
                if i % 1000 == 0:
                    await asyncio.sleep(0)

        await asyncio.gather(*(one() for _ in range(2)))

    f = threading.Thread(target=flusher)
    f.start()
    ws = [threading.Thread(target=writer) for _ in range(n_threads)]
    for w in ws:
        w.start()
    asyncio.run(tasks())
    for w in ws:
        w.join()
    stop.set()
    f.join()
    totals.append(fresh_collector.snapshot()["states"].get("n", {"sum": 0.0})["sum"])
    assert len(totals) > 2  # snapshots really ran concurrently
    assert sum(totals) == (n_threads + 2) * per_thread


def _run(code: str, **env: str) -> str:
    import os

    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, check=True).stdout


def test_import_and_record_without_monarch_or_torch():
    out = _run(
        "import sys\n"
        "sys.modules['monarch'] = None  # importing Monarch would now fail\n"
        "from forge_obs import record_metric, Reduce, MetricCollector\n"
        "record_metric('x', 2, Reduce.SUM)\n"
        "print(MetricCollector().snapshot()['states']['x']['sum'], 'torch' in sys.modules)\n"
    )
    assert out.split() == ["2.0", "False"]


def test_disabled_env_makes_record_metric_a_noop():
    out = _run(
        "from forge_obs import record_metric, MetricCollector\n"
        "record_metric('x', 2)\n"
        "print(len(MetricCollector().snapshot()['states']))\n",
        FORGE_DISABLE_METRICS="true",
    )
    assert out.strip() == "0"


def test_a_snapshot_on_the_wire_carries_its_counts_as_plain_data(fresh_collector):
    """The counters a cut sends name no forge_obs class (a dict subclass pickles through
    copyreg, slower than a dict, at every cut of every rank); they read back equal."""
    from forge_obs.wire.snapshot import dumps, loads

    record_metric("loss", 1.0, Reduce.MEAN)
    record_metric(7, 1.0, Reduce.MEAN)  # a bad key: dropped, counted by reason
    snap = fresh_collector.snapshot(packed=True)
    assert type(snap["counters"]["dropped_by_reason"]) is not dict  # the collector's own type
    data = dumps(snap)
    assert b"forge_obs" not in data
    back = loads(data)["counters"]
    assert type(back["dropped_by_reason"]) is dict and back["dropped_by_reason"] == dict(snap["counters"]["dropped_by_reason"])
    assert back["dropped_values"] == 1 and sum(back["dropped_by_reason"].values()) == 1
