"""Isolation on the record side: no value or key raises into the caller or leaves a phantom value,
and one bad key at export or reduction costs only that key (dropped, counted by reason)."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from forge_obs import Reduce, record_metric, register_reduction
from forge_obs.wire.merge import reduce_metrics_states, reduce_snapshots, snapshot_states, snapshot_values
from tests.support.helpers import RangeAccumulator, UniqAccumulator

BIG = 10**400


def _reduce(*snaps, **kw):
    return {m.key: m.value for m in reduce_snapshots(list(snaps), **kw)}


def _drops(snap):
    return dict(snap["counters"]["dropped_by_reason"])


# ------------------------------------------------------------------ values and keys never raise
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("red", ["sum", "mean", "std", "max", "min", "last", "count", "distribution"])
def test_an_int_beyond_the_float_range_becomes_inf_with_every_reduction(fresh_collector, red, sign):
    record_metric("big", sign * BIG, red)  # never raises
    record_metric("big", 1.0, red)  # the key is usable afterwards
    record_metric("other", 2.0, Reduce.SUM)
    snap = fresh_collector.snapshot(packed=True)
    assert snap["counters"]["dropped_values"] == 0
    assert snap["counters"]["values_recorded"] == 3
    assert snap["counters"]["nonfinite_values"] == (0 if red == "count" else 1)  # COUNT ignores the value
    got = _reduce(snap)
    assert got["other"] == 2.0
    v = got["big"]
    if red == "count":
        assert v == 2.0
    elif red == "distribution":
        assert v["count"] == 2 and (v["p99"] == math.inf if sign > 0 else v["p50"] == -math.inf)
    elif red == "std":
        assert not math.isfinite(v)
    elif red in ("max", "min", "last"):
        expect = {"max": max(sign * math.inf, 1.0), "min": min(sign * math.inf, 1.0), "last": 1.0}[red]
        assert v == expect
    else:
        assert v == sign * math.inf


def test_no_phantom_value_is_left_when_an_int_overflows(fresh_collector):
    record_metric("m", BIG, Reduce.MEAN)
    (st,) = snapshot_states(fresh_collector.snapshot(packed=True)).values()
    assert st["count"] == 1 and st["sum"] == math.inf  # the value itself, as inf; no 0.0 left behind


def test_inf_and_nan_with_distribution_are_kept(fresh_collector):
    for v in (1.0, 2.0, math.inf, -math.inf, math.nan):
        record_metric("d", v, "distribution")
    snap = fresh_collector.snapshot()
    assert snap["counters"]["dropped_values"] == 0 and snap["counters"]["nonfinite_values"] == 3
    (m,) = reduce_metrics_states([snap["states"]])
    assert m.value["count"] == 4 and m.value["nan"] == 1
    assert m.value["p99"] == math.inf and m.value["p50"] == pytest.approx(1.0, rel=0.01)
    # and merged across two ranks
    (m2,) = reduce_metrics_states([snap["states"], snap["states"]])
    assert m2.value["count"] == 8 and m2.value["p99"] == math.inf


class Unhashable:
    __hash__ = None


class EvilKey(str):
    def __hash__(self):
        raise RuntimeError("no hash")


class NoStr:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


@pytest.mark.parametrize("key", [["a"], {"a": 1}, {"a"}, Unhashable(), 3, None, b"k", NoStr()],
                         ids=["list", "dict", "set", "unhashable", "int", "none", "bytes", "no_str"])
def test_bad_keys_are_dropped_and_counted(fresh_collector, key):
    record_metric(key, 1.0, Reduce.MEAN)
    record_metric(key, math.nan, Reduce.SUM)
    record_metric(key, {"row": 1}, Reduce.SAMPLE)
    record_metric("good", 1.0)
    snap = fresh_collector.snapshot()
    assert list(snap["states"]) == ["good"]
    assert snap["counters"]["dropped_values"] == 3
    assert _drops(snap) == {"bad_key": 3}


def test_str_subclass_keys_are_recorded_under_the_plain_str(fresh_collector):
    import enum

    class K(str, enum.Enum):
        LOSS = "loss"

    record_metric(K.LOSS, 1.0)
    record_metric("loss", 3.0)
    record_metric(EvilKey("e"), math.nan, Reduce.SUM)  # its __hash__ raises
    snap = fresh_collector.snapshot()
    assert {type(k) for k in snap["states"]} == {str}
    assert snap["states"]["loss"]["sum"] == 4.0 and snap["states"]["loss"]["count"] == 2
    assert math.isnan(snap["states"]["e"]["sum"]) and snap["counters"]["nonfinite_values"] == 1
    assert snap["counters"]["dropped_values"] == 0


class RaisingItem:
    @property
    def item(self):
        raise RuntimeError("item property")


class RaisingGetattr:
    def __getattr__(self, name):
        raise KeyError(name)


class ItemReturnsBig:
    def item(self):
        return BIG


@pytest.mark.parametrize("value", [RaisingItem(), RaisingGetattr(), NoStr(), object()],
                         ids=["item_property", "getattr", "no_str", "object"])
def test_objects_that_raise_on_inspection_are_dropped(fresh_collector, value):
    for red in (Reduce.MEAN, "max", "distribution"):
        record_metric("v", value, red)  # never raises
    snap = fresh_collector.snapshot()
    assert snap["states"] == {} and _drops(snap) == {"bad_value": 3}


def test_an_object_whose_item_is_a_huge_int_becomes_inf(fresh_collector):
    record_metric("v", ItemReturnsBig(), Reduce.MAX)
    snap = fresh_collector.snapshot()
    assert snap["states"]["v"]["max"] == math.inf and snap["counters"]["nonfinite_values"] == 1


def test_bad_reduction_arguments_are_dropped_with_their_reason(fresh_collector):
    record_metric("r", 1.0, "no_such_reduction")
    record_metric("r", 1.0, ["mean"])
    record_metric("r", 1.0, None)
    record_metric("r", 1.0, Reduce.SUM)
    record_metric("r", 1.0, Reduce.MAX)  # mismatch within the step
    snap = fresh_collector.snapshot()
    assert snap["states"]["r"]["sum"] == 1.0
    assert _drops(snap) == {"unknown_reduction": 3, "reduction_mismatch": 1}
    assert snap["counters"]["dropped_values"] == 4


@pytest.mark.parametrize("name", ["SAMPLE", "Sample", "sample", Reduce.SAMPLE])
def test_sample_by_any_case_keeps_rows(fresh_collector, name):
    record_metric("rows", {"prompt": "1+1", "reward": 1.0}, name)
    record_metric("rows", 3, name)
    snap = fresh_collector.snapshot()
    assert snap["states"]["rows"]["rows"] == [{"prompt": "1+1", "reward": 1.0}, 3]
    assert snap["counters"]["dropped_values"] == 0




def test_a_non_numeric_custom_reduction_receives_non_numbers(fresh_collector):
    name = register_reduction("test_uniq", UniqAccumulator)
    for v in ("a", "b", "a", None, ("t",)):
        record_metric("u", v, name)
    record_metric("u2", "x", name.upper())  # names are case-insensitive
    snap = fresh_collector.snapshot()
    assert snap["counters"]["dropped_values"] == 0
    assert _reduce(snap) == {"u": 4, "u2": 1}


class RaisingAppend(RangeAccumulator):
    def append(self, v):
        if v < 0:
            raise ValueError("negative")
        super().append(v)


def test_an_accumulator_that_raises_on_append_drops_only_that_value(fresh_collector):
    name = register_reduction("test_raising_append", RaisingAppend)
    record_metric("first_bad", -1.0, name)  # would be the key's first value: no phantom key
    record_metric("k", 2.0, name)
    record_metric("k", -1.0, name)
    record_metric("k", 5.0, name)
    snap = fresh_collector.snapshot()
    assert set(snap["states"]) == {"k"} and _reduce(snap) == {"k": 3.0}
    assert _drops(snap) == {"append_error": 2}


def test_warnings_never_fail_on_keys_that_cannot_be_printed(fresh_collector, caplog, monkeypatch):
    import forge_obs.recording.collector as collector
    from forge_obs.core.warn import RateLimitedWarner

    monkeypatch.setattr(collector, "WARNER", RateLimitedWarner())  # not rate-limited by earlier tests
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        record_metric(NoStr(), 1.0)
    assert any("key" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ export: one bad key costs one key
class RaisingState(RangeAccumulator):
    def get_state(self):
        raise RuntimeError("get_state failed")


def test_a_state_that_cannot_be_exported_drops_only_its_key(fresh_collector):
    name = register_reduction("test_raising_state", RaisingState)
    record_metric("bad", 1.0, name)
    record_metric("bad", 2.0, name)
    record_metric("loss", 0.5)
    record_metric("rows", {"ok": 1}, Reduce.SAMPLE)
    for packed in (True, False):
        if packed is False:
            record_metric("bad", 1.0, name)
            record_metric("loss", 0.5)
            record_metric("rows", {"ok": 1}, Reduce.SAMPLE)
        snap = fresh_collector.snapshot(packed=packed)  # never raises
        assert "bad" not in snapshot_states(snap)
        assert _reduce(snap) == {"loss": 0.5, "rows": [{"ok": 1}]}
        assert _drops(snap) == {"export_error": 1}


def test_a_sample_row_that_cannot_be_pickled_drops_only_its_key(fresh_collector):
    import pickle

    record_metric("rows", {"lock": threading.Lock()}, Reduce.SAMPLE)
    record_metric("rows_ok", {"x": 1}, Reduce.SAMPLE)
    record_metric("loss", 0.5)
    snap = fresh_collector.snapshot(packed=True)
    pickle.dumps(snap)  # what a fetcher sends now pickles
    assert _reduce(snap) == {"loss": 0.5, "rows_ok": [{"x": 1}]}
    assert _drops(snap) == {"unpicklable": 1} and snap["counters"]["dropped_values"] == 1


def test_unpicklable_raw_values_are_dropped_when_streaming(fresh_collector):
    import pickle

    fresh_collector.set_streaming(True)
    record_metric("rows", {"lock": threading.Lock()}, Reduce.SAMPLE)
    record_metric("rows", {"x": 1}, Reduce.SAMPLE)
    record_metric("loss", 0.5)
    snap = fresh_collector.snapshot(packed=True)
    pickle.dumps(snap)
    assert [(k, v) for k, v, _ts in snap["raw"]] == [("rows", {"x": 1}), ("loss", 0.5)]
    # the reservoir held the unpicklable row: the key's state (2 rows seen) is dropped too
    assert _drops(snap) == {"unpicklable": 3}


def test_a_sum_that_overflows_within_a_rank_is_inf_and_counted_nonfinite(fresh_collector):
    record_metric("s", 1e308, Reduce.SUM)
    record_metric("s", 1e308, Reduce.SUM)
    record_metric("m", 1e308, Reduce.MEAN)
    record_metric("m", 1e308, Reduce.MEAN)
    record_metric("n", math.inf, Reduce.SUM)  # recorded non-finite: counted once, at record time
    snap = fresh_collector.snapshot(packed=True)
    assert _reduce(snap) == {"s": math.inf, "m": math.inf, "n": math.inf}
    assert snap["counters"]["nonfinite_values"] == 3


# ------------------------------------------------------------------ reduction: isolation by key
def _snap(**states):
    return {"states": states}


def test_a_sum_that_overflows_across_ranks_is_inf_and_reported():
    overflow, drops = [], []
    a = {"packed": {"sum": (["s", "ok"], [1e308, 1.0]), "mean": (["m"], [(1e308, 1)])}}
    got = _reduce(a, a, on_drop=lambda *x: drops.append(x), on_overflow=overflow.append)
    assert got == {"s": math.inf, "m": math.inf, "ok": 2.0}
    assert sorted(overflow) == ["m", "s"] and drops == []
    # a state that already was inf is not an overflow of the merge
    overflow.clear()
    assert _reduce({"packed": {"sum": (["s"], [math.inf])}}, a, on_overflow=overflow.append)["s"] == math.inf
    assert overflow == []


def test_merging_follows_ieee_never_raises():
    cases = {
        "sum": [1e308, 1e308, -1e308],  # fsum would raise OverflowError
        "mean": [(math.inf, 1), (-math.inf, 1)],  # fsum would raise ValueError
        "std": [(1, 1e308, 0.0), (1, -1e308, 0.0)],
        "max": [BIG, 1.0],  # a huge int in a foreign state
    }
    for rt, rows in cases.items():
        snaps = [{"packed": {rt: (["k"], [r])}} for r in rows]
        got = _reduce(*snaps)["k"]
        assert isinstance(got, float), rt
    assert _reduce(*[{"packed": {"max": (["k"], [r])}} for r in cases["max"]])["k"] == math.inf


def test_an_unknown_reduction_drops_only_its_key():
    drops = []
    st = {"reduction_type": "registered_only_in_the_actors", "x": 1}
    got = _reduce(_snap(c=st, ok={"reduction_type": "sum", "sum": 1.0}), _snap(c=st),
                  on_drop=lambda key, reason, n: drops.append((key, reason, n)))
    assert got == {"ok": 1.0} and drops == [("c", "unknown_reduction", 2)]


class RaisingMerge(RangeAccumulator):
    @classmethod
    def merge_states(cls, states):
        raise RuntimeError("merge failed")


def test_a_merge_that_raises_drops_only_its_key():
    name = register_reduction("test_raising_merge", RaisingMerge)
    a, b = RaisingMerge(name), RaisingMerge(name)
    a.append(1.0)
    b.append(2.0)
    drops = []
    got = _reduce(_snap(r=a.get_state(), ok={"reduction_type": "max", "max": 1.0}), _snap(r=b.get_state()),
                  on_drop=lambda key, reason, n: drops.append((key, reason, n)))
    assert got == {"ok": 1.0} and drops == [("r", "merge_error", 2)]
    # a single state is not merged: its value is computed
    assert _reduce(_snap(r=a.get_state())) == {"r": 0.0}


def test_malformed_states_drop_only_their_key():
    drops = []
    got = _reduce(_snap(a="not a dict", b={"no": "reduction"}, c={"reduction_type": "sum"}, ok={"reduction_type": "sum", "sum": 2}),
                  on_drop=lambda key, reason, n: drops.append((key, reason)))
    assert got == {"ok": 2.0}
    assert sorted(drops) == [("a", "bad_state"), ("b", "bad_state"), ("c", "bad_state")]


def test_conflicts_are_reported_to_both_callbacks():
    conflicts, drops = [], []
    got = _reduce(_snap(k={"reduction_type": "sum", "sum": 1.0}, ok={"reduction_type": "sum", "sum": 1.0}),
                  _snap(k={"reduction_type": "max", "max": 1.0}), {"packed": {"max": (["k"], [3.0])}},
                  on_conflict=lambda key, kinds: conflicts.append((key, sorted(kinds))),
                  on_drop=lambda key, reason, n: drops.append((key, reason, n)))
    assert got == {"ok": 1.0}
    assert conflicts == [("k", ["max", "sum"])] and drops == [("k", "reduction_mismatch", 3)]


def test_callbacks_that_raise_do_not_break_the_reduction():
    def boom(*a):
        raise RuntimeError("callback")

    got = _reduce(_snap(c={"reduction_type": "nope"}, ok={"reduction_type": "sum", "sum": 1.0}), on_drop=boom)
    assert got == {"ok": 1.0}


def test_per_rank_values_are_isolated_by_key_too():
    name = register_reduction("test_raising_merge2", RaisingMerge)
    bad = {"reduction_type": "missing_here"}
    values, kinds = snapshot_values({"states": {"c": bad, "ok": {"reduction_type": "sum", "sum": 1.0}}})
    assert values == {"ok": 1.0} and kinds == {"ok": "sum"}
    assert name


def test_drop_counts_merge_like_numbers():
    from forge_obs.recording.reduce import DropCounts

    a, b = DropCounts(bad_key=1), DropCounts(bad_key=2, unpicklable=1)
    assert 0 + a == {"bad_key": 1} and a + b == {"bad_key": 3, "unpicklable": 1}
    assert isinstance(0 + a, DropCounts) and a == {"bad_key": 1}  # not modified in place
    total = 0
    for c in (a, b):
        total = total + c  # how the pipeline sums counters of every rank
    assert total == {"bad_key": 3, "unpicklable": 1}


# ------------------------------------------------------------------ torchforge's state format
def test_reduce_metrics_states_reads_torchforge_states():
    states = [
        {"s": {"reduction_type": "sum", "total": 3}, "mx": {"reduction_type": "max", "max_val": 2.0},
         "mn": {"reduction_type": "min", "min_val": -1.0}, "m": {"reduction_type": "mean", "sum": 14, "count": 5},
         "sd": {"reduction_type": "std", "sum": 3.0, "sum_sq": 5.0, "count": 2}},
        {"s": {"reduction_type": Reduce.SUM, "total": 4.0}, "mx": {"reduction_type": "max", "max": 7.0},
         "mn": {"reduction_type": "min", "min_val": -3.0}, "m": {"reduction_type": "mean", "sum": 16, "count": 10},
         "sd": {"reduction_type": "std", "count": 1, "mean": 3.0, "m2": 0.0}},
    ]
    got = {m.key: m.value for m in reduce_metrics_states(states)}
    # std of 1, 2 (torchforge state) and 3 (ours): population std of [1, 2, 3]
    assert got == {"s": 7.0, "mx": 7.0, "mn": -3.0, "m": 2.0, "sd": pytest.approx(math.sqrt(2 / 3))}


def test_reduce_metrics_states_raises_on_mismatched_reductions_like_torchforge():
    with pytest.raises(ValueError, match="Mismatched reduction types for key 'k'"):
        reduce_metrics_states([{"k": {"reduction_type": "sum", "sum": 1.0}}, {"k": {"reduction_type": "max", "max": 1.0}}])


# ------------------------------------------------------------------ one write path
def test_tracer_and_device_write_through_the_collector_only():
    """Accumulator fields are written only by the accumulators themselves; the tracer and the
    device module enter values through the collector."""
    import inspect

    import forge_obs.recording.device as device
    import forge_obs.recording.tracer as tracer

    for mod in (tracer, device):
        src = inspect.getsource(mod)
        for internal in (".total", ".best", ".m2", "accumulator_for", "_make_acc", "_set_state", "_append_locked"):
            assert internal not in src, (mod.__name__, internal)


# ------------------------------------------------------------------ Tracer, @trace, timeline
class BadInt:
    def __int__(self):
        raise RuntimeError("no int")

    __index__ = __int__


def test_tracer_and_trace_never_raise_for_any_name(fresh_collector):
    from forge_obs.recording.tracer import Tracer, trace

    t = Tracer(NoStr())
    t.start()
    t.step(["a", "list"])
    t.step(NoStr())
    t.step({"a": 1})
    t.stop()
    t = Tracer(("tuple", "prefix"))
    with t:
        t.step(3)

    @trace(NoStr())
    def f(x):
        return x + 1

    assert f(1) == 2
    with trace(["list"]) as t2:
        t2.step(Unhashable())
    snap = fresh_collector.snapshot()
    assert snap["counters"]["dropped_values"] == 0
    keys = set(snap["states"])
    assert "<NoStr>/['a', 'list']/duration_avg_s" in keys and "('tuple', 'prefix')/3/duration_max_s" in keys
    assert "<NoStr>/total_duration_dist_s" in keys


def test_record_span_and_event_never_raise_and_their_records_are_written(tmp_path):
    from forge_obs.recording import timeline as tl
    from forge_obs.analysis import reader

    from forge_obs.recording.timeline import recorder

    cyc: dict = {}
    cyc["me"] = cyc
    tl.close()
    recorder.clear()  # what earlier tests traced before any configure (kept for the first run) is not this run's
    assert tl.configure(tmp_path, open_after_s=60)
    tl.set_step(BadInt())  # ignored
    tl.set_step(2)
    with tl.record_span(NoStr(), flow=NoStr(), bad=NoStr(), cyc=cyc, tup={(1, 2): "x"}, ok=1):
        tl.record_event(NoStr(), flow=Unhashable(), obj=object())
        tl.add_step_tag(NoStr())

    @tl.record_span(NoStr())
    def g():
        return 5

    assert g() == 5
    tl.record_event("after", n=1)
    tl.close()
    run = reader.scan(tmp_path)
    items = list(reader.walk(run))
    names = sorted(it[3] for it in items if it[0] in (reader.SPAN, reader.INSTANT))
    assert names == ["<NoStr>", "<NoStr>", "<NoStr>", "after"] and run.malformed == 0
    (span,) = [it for it in items if it[0] == reader.SPAN and it[7]]
    assert span[7]["a"]["ok"] == 1 and span[4] == 2


# ------------------------------------------------------------------ on real Monarch meshes
class ActorsOnlyRange(RangeAccumulator):
    """Registered in the actors' processes only (not in the controller)."""


class BadValues:
    """An actor whose ranks record what the issue measured: an unpicklable SAMPLE row (rank 0),
    a finite 1e308 SUM (every rank: the merge overflows), an int beyond the float range as MAX,
    and a custom reduction the controller does not know."""

    @staticmethod
    def record(rank: int) -> None:
        name = register_reduction("actors_only_range", ActorsOnlyRange)
        if rank == 0:
            record_metric("bad/rows", {"lock": threading.Lock()}, Reduce.SAMPLE)
        record_metric("bad/big_sum", 1e308, Reduce.SUM)
        record_metric("bad/huge_max", BIG, Reduce.MAX)
        record_metric("bad/custom", float(rank), name)
        record_metric("good/loss", float(rank + 1))
        record_metric(["not", "a", "key"], 1.0)


async def test_bad_values_on_real_ranks_cost_only_their_keys(tmp_path):
    from monarch.actor import Actor, current_rank, endpoint, this_host

    from tests.support.helpers import global_rows, start_logger

    class Recorder(Actor):
        @endpoint
        async def record(self) -> None:
            BadValues.record(current_rank().rank)

    mlogger = await start_logger(tmp_path)
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="bad")
    try:
        await pm.spawn("Recorder", Recorder).record.call()
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    (row,) = global_rows(tmp_path).values()
    m = row["metrics"]
    assert row["step"] == 0 and not row.get("missing")
    assert m["good/loss"] == 1.5  # both ranks' values arrive, rank 0's too
    assert m["bad/big_sum"] == math.inf and m["bad/huge_max"] == math.inf
    assert "bad/rows" not in m and "bad/custom" not in m
    # each rank: one bad key; rank 0: the unpicklable row; every rank: the huge int (non-finite)
    assert m["obs/dropped_values"] >= 2 + 1
    assert m["obs/nonfinite_values"] >= 2
