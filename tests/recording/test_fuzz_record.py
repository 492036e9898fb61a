"""Property-based fuzz of the record side, in this process (Hypothesis): generated keys, values
and reductions recorded on two "ranks" (two collector snapshots), then exported and reduced as
the pipeline does. Properties: nothing raises into the caller; every value is either kept or
dropped and counted with the reason an independent model predicts; the non-finite count is
exact; every well-formed key's reduced value equals the model's."""

from __future__ import annotations

import math
import sys
from collections import Counter

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from forge_obs import Reduce, record_metric, register_reduction  # noqa: E402
from forge_obs.recording.collector import MetricCollector  # noqa: E402
from forge_obs.wire.merge import reduce_snapshots, snapshot_states  # noqa: E402
from tests.support.helpers import UniqAccumulator  # noqa: E402




UNIQ = register_reduction("fuzz_uniq", UniqAccumulator)


class NoStr:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


class RaisingItem:
    @property
    def item(self):
        raise RuntimeError("item")


BIG = 10**400
GOOD_KEYS = ["a", "b", "c", "d", "e"]
BAD_KEYS = [1, None, ("t",), b"b", 2.5]
REDUCTIONS = [Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.STD, Reduce.COUNT, Reduce.LAST, Reduce.SAMPLE,
              "mean", "Sum", "MAX", "sample", "SAMPLE", "distribution", "Distribution", UNIQ, "FUZZ_UNIQ",
              "no_such_reduction", None, 3]
# values whose sums are exact in any order (so the reduced value is exactly the model's)
NUMBERS = st.one_of(st.integers(-1000, 1000), st.integers(-2000, 2000).map(lambda i: i / 2.0))
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, BIG, -BIG, True, False])
OTHER = st.sampled_from(["1.0", None, b"x", [1, 2], {"row": 1}, NoStr(), RaisingItem(), object()])
VALUES = st.one_of(NUMBERS, NUMBERS, SPECIAL, OTHER, NUMBERS.map(np.float32), st.integers(-5, 5).map(np.int64))
KEYS = st.one_of(st.sampled_from(GOOD_KEYS), st.sampled_from(GOOD_KEYS), st.sampled_from(BAD_KEYS))
OPS = st.lists(st.tuples(st.integers(0, 1), KEYS, VALUES, st.sampled_from(REDUCTIONS)), max_size=50)

_NAMES = {"mean": Reduce.MEAN, "sum": Reduce.SUM, "max": Reduce.MAX, "min": Reduce.MIN, "std": Reduce.STD,
          "count": Reduce.COUNT, "last": Reduce.LAST, "sample": Reduce.SAMPLE, "distribution": "distribution",
          UNIQ: UNIQ}
_NON_NUMERIC = {Reduce.SAMPLE, UNIQ}
_CONVERTS_BIG_INTS = {Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.MIN, Reduce.STD, Reduce.LAST, "distribution"}
DROP = object()


def _resolve(red):
    if isinstance(red, Reduce):
        return red
    return _NAMES.get(red.lower()) if isinstance(red, str) else None


def _number(v):
    """What the collector makes of a value for a numeric reduction (DROP: not a number)."""
    if type(v) is bool:
        return float(v)
    if isinstance(v, (np.floating, np.integer)):
        return float(v.item())
    if isinstance(v, (str, bytes, list, dict, NoStr, RaisingItem)) or v is None or type(v) is object:
        return DROP
    return v


class Model:
    """The record side of one rank, written independently of the collector."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple] = {}  # key -> (reduction, [values])
        self.drops: Counter = Counter()
        self.nonfinite = 0
        self.accepted: list = []  # (key, value) in order: the raw stream

    def record(self, key, value, red):
        if type(value) not in (float, int):
            r = red if red is Reduce.SAMPLE else _resolve(red)
            if r is not None and r not in _NON_NUMERIC:
                value = _number(value)
                if value is DROP:
                    self.drops["bad_value"] += 1
                    return
        if not isinstance(key, str):
            self.drops["bad_key"] += 1
            return
        r = _resolve(red)
        if r is None:
            self.drops["unknown_reduction"] += 1
            return
        if key in self.keys and self.keys[key][0] is not r:
            self.drops["reduction_mismatch"] += 1
            return
        if r is UNIQ:
            try:
                str(value)
            except Exception:  # noqa: BLE001
                self.drops["append_error"] += 1
                return
        if type(value) is int and r in _CONVERTS_BIG_INTS and abs(value) > sys.float_info.max:
            value = math.inf if value > 0 else -math.inf
        if type(value) is float and value - value:
            self.nonfinite += 1
        self.keys.setdefault(key, (r, []))[1].append(value)
        self.accepted.append((key, value))


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _expected(r, ranks: list[list]) -> object:
    vals = [v for vs in ranks for v in vs]
    if r is Reduce.COUNT:  # counts any value (an int beyond the float range too)
        return float(len(vals))
    fl = [float(v) for v in vals] if r not in _NON_NUMERIC else vals
    if r in (Reduce.SUM, Reduce.MEAN):
        s = 0.0
        for v in fl:
            s += v
        return s if r is Reduce.SUM else s / len(fl)
    if r in (Reduce.MAX, Reduce.MIN):
        return math.nan if any(math.isnan(v) for v in fl) else (max if r is Reduce.MAX else min)(fl)
    if r is Reduce.SAMPLE:
        return vals
    if r is UNIQ:
        return len({str(v) for v in vals})
    return None  # checked separately


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, streaming=st.booleans())
def test_record_export_reduce_fuzz(ops, streaming, fresh_collector):
    c = MetricCollector()
    c.reset()
    c.set_streaming(streaming)
    snaps, models = [], []
    for rank in (0, 1):
        m = Model()
        for r, key, value, red in ops:
            if r == rank:
                record_metric(key, value, red)  # never raises
                m.record(key, value, red)
        snap = c.snapshot(packed=True)
        snaps.append(snap)
        models.append(m)
        cnt = snap["counters"]
        # every value kept or dropped, and counted with its reason
        assert dict(cnt["dropped_by_reason"]) == dict(m.drops), ops
        assert cnt["dropped_values"] == sum(m.drops.values())
        assert cnt["values_recorded"] == sum(len(vs) for _r, vs in m.keys.values())
        assert cnt["nonfinite_values"] == m.nonfinite, ops
        assert set(snapshot_states(snap)) == set(m.keys)
        if streaming:  # per_rank_no_reduce: exactly the kept values, in order
            raw = [(k, v) for k, v, _ts in snap["raw"]]
            assert len(raw) == len(m.accepted) and all(
                a[0] == b[0] and (_same(a[1], b[1]) or a[1] is b[1]) for a, b in zip(raw, m.accepted))
        else:
            assert snap["raw"] is None

    drops: list = []
    out = {x.key: x.value for x in reduce_snapshots(snaps, on_drop=lambda *a: drops.append(a))}
    keys = set(models[0].keys) | set(models[1].keys)
    conflicts = {k for k in keys if k in models[0].keys and k in models[1].keys
                 and models[0].keys[k][0] is not models[1].keys[k][0]}
    assert sorted(drops) == sorted((k, "reduction_mismatch", 2) for k in conflicts)
    assert set(out) == keys - conflicts
    for k in keys - conflicts:
        r = (models[0].keys.get(k) or models[1].keys[k])[0]
        ranks = [m.keys[k][1] for m in models if k in m.keys]
        got = out[k]
        if r is Reduce.STD:
            fl = [float(v) for vs in ranks for v in vs]
            if all(math.isfinite(v) for v in fl):
                mean = sum(fl) / len(fl)
                assert got == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in fl) / len(fl)), rel=1e-9, abs=1e-9)
            else:
                assert not math.isfinite(got)
        elif r is Reduce.LAST:
            lasts = [float(vs[-1]) for vs in ranks]
            assert any(_same(got, x) for x in lasts), (got, lasts)
        elif r == "distribution":
            fl = [float(v) for vs in ranks for v in vs]
            assert got["count"] == sum(1 for v in fl if not math.isnan(v))
            assert got.get("nan", 0) == sum(1 for v in fl if math.isnan(v))
        elif r is Reduce.SAMPLE:
            exp = _expected(r, ranks)
            assert len(got) == len(exp) and all(_same(a, b) or a is b for a, b in zip(got, exp))
        else:
            assert _same(got, _expected(r, ranks)), (k, r, got, ranks)
