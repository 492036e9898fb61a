"""Reductions merge states exactly (never a mean of means)."""

import math
import random
import statistics

import pytest

from forge_obs import Reduce, reduce_metrics_states, register_reduction
from forge_obs.reduce import merge_states, resolve_reduction
from tests.helpers import RangeAccumulator


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
    from forge_obs.reduce import reduce_snapshots, snapshot_states, snapshot_values

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
