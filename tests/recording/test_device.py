"""The distribution sketch and the device-side accumulators (exercised with CPU tensors: the
logic is device-agnostic; tests/recording/test_gpu.py runs it on CUDA)."""

import math
import random
import threading

import pytest

from forge_obs.recording.reduce import Reduce, accumulator_for, register_reduction

from forge_obs.wire.merge import reduce_metrics_states
from tests.support.helpers import RangeAccumulator
from forge_obs.recording.sketch import ALPHA, DISTRIBUTION, DistributionAccumulator, quantile

torch = pytest.importorskip("torch")


def exact_quantile(xs, q):
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs) - 1e-9) - 1)]


# ------------------------------------------------------------------ sketch
@pytest.mark.parametrize("dist", ["uniform", "lognormal", "mixed_sign"])
def test_sketch_quantiles_within_relative_error(dist):
    rng = random.Random(7)
    if dist == "uniform":
        xs = [rng.uniform(1e-4, 2.0) for _ in range(20000)]
    elif dist == "lognormal":
        xs = [rng.lognormvariate(-5, 2) for _ in range(20000)]
    else:
        xs = [rng.gauss(0, 1) for _ in range(20000)] + [0.0] * 100
    a = DistributionAccumulator(DISTRIBUTION)
    for x in xs:
        a.append(x)
    v = a.get_value()
    assert v["count"] == len(xs)
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        ex = exact_quantile(xs, q)
        assert abs(v[name] - ex) <= ALPHA * abs(ex) + 1e-12, (name, v[name], ex)


def test_sketch_merge_is_exact_across_ranks():
    rng = random.Random(1)
    xs = [rng.expovariate(10) for _ in range(9000)]
    whole = DistributionAccumulator(DISTRIBUTION)
    parts = [DistributionAccumulator(DISTRIBUTION) for _ in range(3)]
    for i, x in enumerate(xs):
        whole.append(x)
        parts[i % 3].append(x)
    merged = reduce_metrics_states([{"lat": p.get_state()} for p in parts])
    assert len(merged) == 1 and merged[0].value == whole.get_value()
    st = DistributionAccumulator.merge_states([p.get_state() for p in parts])
    assert st["min"] == min(xs) and st["max"] == max(xs) and st["sum"] == pytest.approx(sum(xs))


def test_sketch_nan_counted_not_bucketed_and_empty_state():
    a = DistributionAccumulator(DISTRIBUTION)
    assert math.isnan(a.get_value()["p50"]) and a.get_value()["count"] == 0
    for x in (1.0, float("nan"), 3.0):
        a.append(x)
    v = a.get_value()
    assert v["count"] == 2 and v["nan"] == 1 and v["p99"] == pytest.approx(3.0, rel=ALPHA)


def test_sketch_bucket_cap_keeps_the_tail(monkeypatch):
    import forge_obs.recording.sketch as sk

    monkeypatch.setattr(sk, "MAX_BUCKETS", 64)
    xs = [10 ** (i / 50) for i in range(-300, 300)]  # 12 decades: ~1,400 buckets uncapped
    a = DistributionAccumulator(DISTRIBUTION)
    for x in xs:
        a.append(x)
    assert len(a.pos) <= 64
    assert a.get_value()["p99"] == pytest.approx(exact_quantile(xs, 0.99), rel=ALPHA)
    assert quantile(a.get_state(), 1.0) == max(xs)


def test_distribution_is_a_registered_reduction_usable_by_name(fresh_collector):
    from forge_obs import record_metric

    for x in range(1, 101):
        record_metric("d", float(x), "distribution")
    (m,) = reduce_metrics_states([fresh_collector.snapshot()["states"]])
    assert m.value["count"] == 100
    assert m.value["p50"] == pytest.approx(50, rel=ALPHA) and m.value["p90"] == pytest.approx(90, rel=ALPHA)
    assert accumulator_for("distribution") is DistributionAccumulator


# ------------------------------------------------------------------ device accumulators
from forge_obs.recording.device import DeviceValues  # noqa: E402


def drain(dv, accs=None):
    from forge_obs.recording.collector import Taken

    accs = {} if accs is None else accs
    counters = {"values_recorded": 0, "dropped_values": 0, "nonfinite_values": 0}
    taken = dv.swap()
    if taken is not None:
        taken.resolve_into(Taken(accs, None, counters, None))
    return {k: a.get_value() for k, a in accs.items()}, counters


def test_device_accumulators_match_cpu_reductions():
    xs = [0.5, -1.25, 3.0, 2.0, 7.5]
    dv = DeviceValues()
    reds = {"mean": Reduce.MEAN, "sum": Reduce.SUM, "max": Reduce.MAX, "min": Reduce.MIN, "std": Reduce.STD,
            "count": Reduce.COUNT, "last": Reduce.LAST, "dist": DISTRIBUTION}
    for x in xs:
        for key, red in reds.items():
            assert dv.record(key, torch.tensor(x, dtype=torch.float32), red)
    got, counters = drain(dv)
    for key, red in reds.items():
        cpu = accumulator_for(red.value if isinstance(red, Reduce) else red)(red)
        for x in xs:
            cpu.append(x)
        assert got[key] == pytest.approx(cpu.get_value()), key
    assert counters["values_recorded"] == len(xs) * len(reds)
    assert drain(dv)[0] == {}  # drained: the next step starts empty


def test_device_values_merge_with_cpu_values_of_the_same_key():
    from forge_obs.recording.reduce import MeanAccumulator, StdAccumulator

    dv = DeviceValues()
    cpu_mean, cpu_std = MeanAccumulator(Reduce.MEAN), StdAccumulator(Reduce.STD)
    for x in (1.0, 2.0):
        cpu_mean.append(x)
        cpu_std.append(x)
    for x in (3.0, 10.0):
        dv.record("m", torch.tensor(x), Reduce.MEAN)
        dv.record("s", torch.tensor(x), Reduce.STD)
    got, _ = drain(dv, {"m": cpu_mean, "s": cpu_std})
    assert got["m"] == 4.0
    ref = StdAccumulator(Reduce.STD)
    for x in (1.0, 2.0, 3.0, 10.0):
        ref.append(x)
    assert got["s"] == pytest.approx(ref.get_value())


def test_device_bad_input_is_dropped_and_counted():
    from forge_obs.recording.reduce import SumAccumulator

    dv = DeviceValues()
    assert not dv.record("dev/v", torch.ones(3), Reduce.MEAN)  # not a scalar
    assert dv.record("dev/k", torch.tensor(1.0), Reduce.MEAN)
    assert not dv.record("dev/k", torch.tensor(1.0), Reduce.MAX)  # reduction mismatch within a step
    assert not dv.record("dev/k", torch.tensor(1.0), "no_such_reduction")
    assert not dv.record("dev/rows", torch.tensor(1.0), Reduce.SAMPLE)
    assert dv.record("dev/c", torch.tensor(2.0), Reduce.MEAN)
    got, counters = drain(dv, {"dev/c": SumAccumulator(Reduce.SUM)})  # CPU has "dev/c" as SUM: conflict
    assert got == {"dev/k": 1.0, "dev/c": 0.0}
    assert counters["dropped_values"] == 5 and counters["values_recorded"] == 1
    assert counters["dropped_by_reason"] == {"bad_value": 2, "reduction_mismatch": 2, "unknown_reduction": 1}


def test_device_nonfinite_values_are_kept_and_counted_per_key():
    dv = DeviceValues()
    dv.record("n", torch.tensor(float("nan")), Reduce.MEAN)
    dv.record("n", torch.tensor(1.0), Reduce.MEAN)
    dv.record("mx", torch.tensor(float("inf")), Reduce.MAX)
    got, counters = drain(dv)
    assert math.isnan(got["n"]) and got["mx"] == math.inf
    assert counters["nonfinite_values"] == 2


def test_device_custom_reduction_gets_the_values():
    Range = RangeAccumulator
    name = register_reduction("dev_range", Range)
    dv = DeviceValues()
    cpu = Range(name)
    cpu.append(-1.0)
    for x in (2.0, 5.0):
        dv.record("r", torch.tensor(x), name)
    got, _ = drain(dv, {"r": cpu})
    assert got["r"] == 6.0


def test_device_integer_and_bfloat16_values():
    dv = DeviceValues()
    for x in (1, 2, 3):
        dv.record("tok", torch.tensor(x, dtype=torch.int64), Reduce.SUM)
        dv.record("bf", torch.tensor(x, dtype=torch.bfloat16), Reduce.MAX)
    got, _ = drain(dv)
    assert got == {"tok": 6.0, "bf": 3.0}


def test_device_records_from_many_threads_are_exact():
    dv = DeviceValues()
    one = torch.tensor(1.0)

    def work():
        for _ in range(500):
            dv.record("n", one, Reduce.SUM)
            dv.record("mean", one, Reduce.MEAN)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    got, counters = drain(dv)
    assert got == {"n": 2000.0, "mean": 1.0} and counters["values_recorded"] == 4000


def test_collector_snapshot_drains_device_values(fresh_collector):
    """Device values taken at the collector's swap are read at its export."""
    from forge_obs import record_metric

    dv = fresh_collector.device_values()
    record_metric("loss", 1.0)
    dv.record("loss", torch.tensor(3.0), Reduce.MEAN)
    snap = fresh_collector.snapshot()
    assert snap["states"]["loss"]["sum"] == 4.0 and snap["states"]["loss"]["count"] == 2
    assert snap["counters"]["values_recorded"] == 2


def test_cpu_tensor_record_metric_reads_the_value(fresh_collector):
    from forge_obs import record_metric

    record_metric("dev/cpu_t", torch.tensor(2.5))
    record_metric("dev/cpu_t", torch.tensor([1.5]))
    record_metric("dev/cpu_t", torch.ones(2))  # dropped: not a scalar
    snap = fresh_collector.snapshot()
    assert snap["states"]["dev/cpu_t"]["sum"] == 4.0 and snap["counters"]["dropped_values"] == 1


def test_record_metric_routes_non_cpu_tensors_to_the_device_path(fresh_collector):
    """A non-CPU tensor never reaches .item(): it goes to forge_obs.recording.device (here a 'meta' tensor,
    which has no data: the flush cannot read it and drops it, counted, without failing)."""
    from forge_obs import record_metric

    record_metric("meta", torch.ones((), device="meta"))
    record_metric("meta_count", torch.ones((), device="meta"), Reduce.COUNT)  # host-side state only
    record_metric("cpu", 1.0)
    snap = fresh_collector.snapshot()
    assert set(snap["states"]) == {"cpu", "meta_count"}
    assert snap["states"]["meta_count"]["count"] == 1
    assert snap["counters"]["dropped_values"] == 1 and snap["counters"]["values_recorded"] == 2


def test_device_values_without_device_state_are_capped_per_step(monkeypatch):
    import forge_obs.recording.device as device

    monkeypatch.setattr(device, "RAW_CAP", 3)
    dv = DeviceValues()
    for x in range(5):
        dv.record("lat", torch.tensor(float(x + 1)), DISTRIBUTION)
    got, counters = drain(dv)
    assert got["lat"]["count"] == 3 and got["lat"]["p99"] == pytest.approx(3.0, rel=ALPHA)
    assert counters["dropped_values"] == 2 and counters["values_recorded"] == 3


def test_gpu_timings_enter_the_cut_through_the_collector():
    """The GPU tracer's pending timings (taken at the cut by a device hook) are added at export
    through ``Taken.add``. CUDA events cannot run here: stand-ins with CUDA's event API."""
    from forge_obs.recording.collector import Taken
    from forge_obs.recording.tracer import _GpuTimings

    class Event:
        def __init__(self, t_ms):
            self.t_ms = t_ms

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t_ms - self.t_ms

        def query(self):
            return True

    timings = _GpuTimings()
    dv = DeviceValues()
    dv.add_hook(timings)
    with timings._lock:  # what Tracer.stop() queues (without starting the poller thread)
        timings._pending.append(("gpu/step", ["fwd"], [Event(0.0), Event(2.0), Event(5.0)], 0))
    taken = dv.swap()
    accs, counters = {}, {"values_recorded": 0, "dropped_values": 0}
    taken.resolve_into(Taken(accs, None, counters, None))
    got = {k: a.get_value() for k, a in accs.items()}
    assert got["gpu/step/fwd/duration_avg_s"] == 0.002 and got["gpu/step/total_duration_max_s"] == 0.005
    assert got["gpu/step/total_duration_dist_s"]["count"] == 1
    assert counters["values_recorded"] == 6 and counters["dropped_values"] == 0
