"""Reductions merge states exactly (never a mean of means)."""

import math
import random
import statistics

import pytest

from forge_obs import Reduce, reduce_metrics_states, register_reduction
from forge_obs.recording.reduce import resolve_reduction
from forge_obs.wire.merge import merge_states
from tests.support.helpers import RangeAccumulator


def _state(reduction, values):
    acc = reduction.accumulator_class(reduction)
    for v in values:
        acc.append(v)
    return acc.get_state()


def _reduce(reduction, *rank_values):
    (m,) = reduce_metrics_states([{"k": _state(reduction, vs)} for vs in rank_values])
    return m.value


def test_single_process_values_match_forge_doc():
    assert _reduce(Reduce.SUM, [1, 2, 3]) == 6.0
    assert _reduce(Reduce.MAX, [1, 2, 3]) == 3.0
    assert _reduce(Reduce.MEAN, [1, 2, 3]) == 2.0


def test_mean_merges_sums_and_counts_not_means():
    # rank 0: one value 10; rank 1: three values 0 -> true mean 2.5 (mean of means would be 5)
    assert _reduce(Reduce.MEAN, [10], [0, 0, 0]) == 2.5


def test_std_merged_across_ranks_equals_std_of_all_values():
    rng = random.Random(0)
    ranks = [[rng.gauss(1e6, 3.0) for _ in range(n)] for n in (1, 50, 700, 3)]
    expected = statistics.pstdev([v for r in ranks for v in r])
    assert _reduce(Reduce.STD, *ranks) == pytest.approx(expected, rel=1e-9)


def test_min_max_count_and_empty_ranks():
    assert _reduce(Reduce.MIN, [3, -1], [5]) == -1.0
    assert _reduce(Reduce.COUNT, [3, -1], [5], []) == 3.0
    assert _reduce(Reduce.MEAN, [], [4]) == 4.0


def test_nan_is_kept_by_max_min_and_mean():
    nan = float("nan")
    assert math.isnan(_reduce(Reduce.MAX, [1, nan, 2], [0]))
    assert math.isnan(_reduce(Reduce.MIN, [1], [nan]))
    assert math.isnan(_reduce(Reduce.MEAN, [1, nan]))


def test_last_is_latest_by_time_across_ranks():
    a = Reduce.LAST.accumulator_class(Reduce.LAST)
    a.append(1.0)
    b = Reduce.LAST.accumulator_class(Reduce.LAST)
    b.append(2.0)
    sa, sb = a.get_state(), b.get_state()
    sa["ts"], sb["ts"] = 200.0, 100.0  # rank a wrote later
    (m,) = reduce_metrics_states([{"k": sb}, {"k": sa}])
    assert m.value == 1.0


def test_sample_keeps_bounded_rows_and_counts_all():
    acc = Reduce.SAMPLE.accumulator_class(Reduce.SAMPLE)
    for i in range(1000):
        acc.append({"i": i})
    st = acc.get_state()
    assert len(st["rows"]) == acc.capacity and st["seen"] == 1000
    merged = merge_states([st, st])
    assert merged["seen"] == 2000 and len(merged["rows"]) == 2 * acc.capacity


def test_conflicting_reductions_for_one_key_are_reported_not_merged():
    seen = []
    out = reduce_metrics_states(
        [{"k": _state(Reduce.SUM, [1]), "ok": _state(Reduce.SUM, [1])}, {"k": _state(Reduce.MAX, [1])}],
        on_conflict=lambda key, kinds: seen.append((key, sorted(kinds))),
    )
    assert [m.key for m in out] == ["ok"]
    assert seen == [("k", ["max", "sum"])]


RangeAcc = RangeAccumulator


def test_custom_reduction_registers_by_name_and_merges():
    name = register_reduction("test_range", RangeAcc)
    assert resolve_reduction(name) == "test_range"
    a, b = RangeAcc(name), RangeAcc(name)
    for v in (3, 5):
        a.append(v)
    b.append(-1)
    (m,) = reduce_metrics_states([{"r": a.get_state()}, {"r": b.get_state()}])
    assert m.value == 6


def test_unknown_and_builtin_names_are_rejected_with_choices():
    with pytest.raises(ValueError, match="valid: .*mean"):
        resolve_reduction("median")
    with pytest.raises(ValueError, match="built-in"):
        register_reduction("sum", RangeAcc)


def test_packed_snapshots_reduce_exactly_like_state_dicts(fresh_collector):
    """What fetchers send (built-in reductions packed as (keys, rows), the others as state dicts)
    reduces to the same values as the state dicts, across ranks and per rank, NaN included."""
    from forge_obs import record_metric
    from forge_obs.wire.merge import reduce_snapshots, snapshot_states, snapshot_values

    register_reduction("range_packed_test", RangeAccumulator)
    rng = random.Random(7)
    kinds = [Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.STD, Reduce.COUNT, Reduce.LAST, "range_packed_test"]
    packed, plain = [], []
    for rank in range(3):
        for i, red in enumerate(kinds):
            for _ in range(rng.randint(1, 5)):
                record_metric(f"k{i}", rng.uniform(-5, 5), red)
        record_metric("only_here", float(rank), Reduce.SUM)
        if rank == 1:
            record_metric("nan_max", float("nan"), Reduce.MAX)
        snap = fresh_collector.snapshot(packed=True)
        assert "range_packed_test" not in snap["packed"] and set(snap["states"]) == {"k7"}
        packed.append(snap)
        plain.append(snapshot_states(snap))
    a = {m.key: m.value for m in reduce_snapshots(packed)}
    b = {m.key: m.value for m in reduce_metrics_states(plain)}
    assert a.keys() == b.keys() and len(a) == len(kinds) + 2
    for k in a:
        assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k], k
    assert math.isnan(a["nan_max"]) and a["only_here"] == 3.0
    # one rank's values, without Metrics
    values, rts = snapshot_values(packed[0])
    (ref,) = [{m.key: m.value for m in reduce_metrics_states([plain[0]])}]
    assert values == ref and rts["k0"] == "mean" and rts["k7"] == "range_packed_test"


# ---------------------------------------------------------------- merge order
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

_EXTREMES = [0.0, -0.0, 1.0, -1.0, 1e200, -1e200, 1e308, -1e308, 1.7976931348623157e308, 5e-324, math.inf,
             -math.inf, math.nan]
_VALUES = hst.one_of(hst.sampled_from(_EXTREMES), hst.sampled_from(_EXTREMES), hst.floats(allow_nan=True, allow_infinity=True),
                     hst.integers(-10**6, 10**6).map(float))
_RANKS = hst.lists(hst.lists(_VALUES, max_size=6), min_size=1, max_size=7)


def _bits(v):
    """A value as comparable bits: every float by its bytes (so 0.0 != -0.0), any NaN as 'nan'."""
    import struct

    if isinstance(v, float):
        return "nan" if v != v else struct.pack(">d", v)
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_bits(x) for x in v)
    return v


def _states_of(reduction, ranks):
    from forge_obs.recording.reduce import accumulator_for

    out = []
    for vs in ranks:
        acc = accumulator_for(reduction)(resolve_reduction(reduction))
        for v in vs:
            acc.append(v)
        out.append(acc.get_state())
    return out


def _last_states(ranks, stamps):
    """LAST states with chosen write times (ties included: ranks that wrote at the same time)."""
    acc = Reduce.LAST.accumulator_class(Reduce.LAST)
    out = []
    for vs, ts in zip(ranks, stamps):
        acc.load_row((vs[-1] if vs else None, ts if vs else -math.inf))
        out.append(acc.get_state())
    return out


_ORDER_FREE = ["mean", "sum", "max", "min", "std", "count", "distribution"]


@settings(max_examples=300, deadline=None)
@given(ranks=_RANKS, reduction=hst.sampled_from(_ORDER_FREE), rnd=hst.randoms(use_true_random=False))
@example(ranks=[[1e200, -1e200], [1e200]], reduction="std", rnd=random.Random(0))
@example(ranks=[[1e308], [1e308], [-1e308]], reduction="sum", rnd=random.Random(0))
@example(ranks=[[0.0], [-0.0]], reduction="distribution", rnd=random.Random(0))
def test_every_reduction_is_independent_of_merge_order(ranks, reduction, rnd):
    """The merged state and value of every built-in reduction are the same, bit for bit, in
    whatever order the ranks' states are merged: as state dicts, as packed rows at the controller,
    and inside a group bundle (forge_obs.wire.bundle) reduced at the controller. Overflow, infinities,
    NaN and signed zeros included (the STD and SUM of values beyond the float range are inf)."""
    import forge_obs.recording.sketch  # noqa: F401 - registers "distribution"
    from forge_obs.wire.bundle import bundle_snapshot, make_bundle
    from forge_obs.wire.merge import reduce_snapshots

    states = _states_of(reduction, ranks)
    snaps = [{"states": {"k": s}} for s in states]
    shuffled = list(range(len(states)))
    rnd.shuffle(shuffled)
    first = None
    for order in (range(len(states)), shuffled, range(len(states))[::-1]):
        shuffled = [states[i] for i in order]
        bundled = make_bundle({("m", i): snaps[i] for i in order})
        got = (_bits(merge_states(shuffled)), _bits(_reduce_states(shuffled)),
               _bits(reduce_snapshots([bundle_snapshot(bundled)])[0].value))
        first = first or got
        assert got == first


def _reduce_states(states):
    from forge_obs.wire.merge import reduce_snapshots, snapshot_states  # noqa: F401

    (m,) = reduce_metrics_states([{"k": s} for s in states])
    return m.value


@settings(max_examples=200, deadline=None)
@given(ranks=_RANKS, data=hst.data())
def test_last_and_sample_are_independent_of_merge_order(ranks, data):
    """LAST: the latest write wins, and ranks that wrote at the same time are told apart by
    their value, not by their order. SAMPLE: the same count, and (below the reservoir's cap) the
    same rows."""
    stamps = data.draw(hst.lists(hst.sampled_from([1.0, 2.0, 3.0]), min_size=len(ranks), max_size=len(ranks)))
    states = _last_states(ranks, stamps)
    perm = data.draw(hst.permutations(range(len(states))))
    shuffled = [states[i] for i in perm]
    assert _bits(merge_states(shuffled)) == _bits(merge_states(states))
    samples = _states_of("sample", [[{"v": repr(v)} for v in vs] for vs in ranks])
    a, b = merge_states(samples), merge_states([samples[i] for i in perm])
    assert a["seen"] == b["seen"] == sum(len(vs) for vs in ranks)
    assert sorted(r["v"] for r in a["rows"]) == sorted(r["v"] for r in b["rows"])


def test_std_beyond_the_float_range_is_inf_in_any_merge_order():
    """Issue 20: ranks that recorded [1e200, -1e200] and [1e200]: their spread exceeds the float
    range, so the STD is inf whichever state comes first (it was NaN in one order); on one rank
    too ([1e308, -1e308] was 0.0)."""
    r0, r1 = _state(Reduce.STD, [1e200, -1e200]), _state(Reduce.STD, [1e200])
    for order in ([r0, r1], [r1, r0]):
        (m,) = reduce_metrics_states([{"x": s} for s in order])
        assert m.value == math.inf
    assert _reduce(Reduce.STD, [1e308, -1e308]) == math.inf
    assert _reduce(Reduce.STD, [1e308], [-1e308], [1.0], [2.0]) == math.inf


def test_sum_whose_partial_sums_overflow_is_the_exact_sum_in_any_order():
    """A SUM whose exact total is in range is that total, even when a partial sum of the order
    the ranks came in overflows; beyond the range it is inf."""
    for order in ([1e308, 1e308, -1e308], [1e308, -1e308, 1e308], [-1e308, 1e308, 1e308]):
        assert _reduce(Reduce.SUM, *[[v] for v in order]) == 1e308
    assert _reduce(Reduce.SUM, [1e308], [1e308]) == math.inf
    assert _reduce(Reduce.SUM, [1e308], [1e308], [-math.inf]) == -math.inf


@pytest.mark.parametrize("rt,want", [("max", "0.0"), ("min", "-0.0")])
def test_signed_zeros_merge_the_same_in_any_order(rt, want):
    """Rows not made by a collector (a device's, another library's) may hold -0.0: MAX of 0.0
    and -0.0 is 0.0, MIN is -0.0, in either order, directly and through a group bundle."""
    from forge_obs.wire.bundle import bundle_snapshot, make_bundle
    from forge_obs.wire.merge import reduce_snapshots

    a, b = {"packed": {rt: (["k"], [0.0])}}, {"packed": {rt: (["k"], [-0.0])}}
    for order in ([a, b], [b, a]):
        (m,) = reduce_snapshots(order)
        (mb,) = reduce_snapshots([bundle_snapshot(make_bundle(dict(enumerate(order))))])
        assert repr(m.value) == repr(mb.value) == want
