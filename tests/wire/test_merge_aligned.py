"""The column-wise merge of aligned snapshots (every rank the same keys, in the same order: ranks
running the same code) gives exactly what the key-by-key merge gives: the same Metrics, bit for
bit, the same overflow reports, and whatever it cannot take goes the general way (conflicts,
malformed rows, states)."""

from __future__ import annotations

import math
import struct

import pytest

from forge_obs.recording.reduce import ROW_CLASSES, ROW_FIELDS, Reduce
from forge_obs.wire import merge as M


def _rows(rt: str, per_key_values: list[list[float]]) -> list:
    """The rows real accumulators of ``rt`` hold after appending each key's values."""
    out = []
    for values in per_key_values:
        acc = ROW_CLASSES[rt](rt)
        for v in values:
            acc.append(v)
        out.append(acc.row())
    return out


def _general(snaps: list) -> tuple[list, list, list]:
    """The key-by-key path: what reduce_snapshots did for every input before."""
    drops, overflows = [], []
    gr = M.Grouper()
    for s in snaps:
        gr.add_snapshot(s)
    out = M._reduce_groups(gr, None, lambda *a: drops.append(a), overflows.append, "src")
    return out, drops, overflows


def _public(snaps: list) -> tuple[list, list, list]:
    drops, overflows = [], []
    out = M.reduce_snapshots(snaps, on_drop=lambda *a: drops.append(a), on_overflow=overflows.append, source="src")
    return out, drops, overflows


def _bits(v):
    """A float's bits; NaN as one value (CPython's own float paths may give either sign: when
    both operands are NaN, which one's sign the sum carries is not specified)."""
    if type(v) is float:
        return "nan" if v != v else struct.pack("<d", v)
    return v


def _same(a: list, b: list) -> None:
    assert [(m.key, _bits(m.value), m.reduction, m.source) for m in a] == \
        [(m.key, _bits(m.value), m.reduction, m.source) for m in b]


VALUES = [0.1, 0.2, 0.3, -0.0, 0.0, 1e308, 1e308, -5.5, 7, 3, math.inf, -math.inf, math.nan, 1e-300, 2.5]


def _aligned(n_ranks: int, n_keys: int, rts: tuple[str, ...]) -> list[dict]:
    snaps = []
    for r in range(n_ranks):
        packed = {}
        for j, rt in enumerate(rts):
            keys = [f"{rt}/k{i}" for i in range(n_keys)]
            vals = [[VALUES[(i * 7 + r * 3 + j + t) % len(VALUES)] for t in range(1 + (i + r) % 3)] for i in range(n_keys)]
            if rt == "last":
                packed[rt] = (keys, [(v[0], 1000.0 + r + (i % 4) * 0.5) for i, v in enumerate(vals)])
            else:
                packed[rt] = (keys, _rows(rt, vals))
            if rt in ("sum", "mean"):  # finite on every rank, beyond the float range merged
                packed[rt][0].append(f"{rt}/big")
                packed[rt][1].append(_rows(rt, [[1e308]])[0])
        snaps.append({"packed": packed, "states": {}, "counters": {}})
    return snaps


@pytest.mark.parametrize("n_ranks", [1, 2, 4, 8])
def test_aligned_merge_is_the_key_by_key_merge_bit_for_bit(n_ranks):
    snaps = _aligned(n_ranks, 60, tuple(ROW_FIELDS))
    assert M._aligned_groups(snaps) is not None  # the column-wise path takes these
    fast, general = _public(snaps), _general(snaps)
    _same(fast[0], general[0])
    assert fast[1] == general[1] == []
    assert fast[2] == general[2]
    if n_ranks > 1:
        assert {"mean/big", "sum/big"} <= set(fast[2])  # finite sums beyond the float range, reported
    assert len(fast[0]) == 60 * len(ROW_FIELDS) + 2
    assert [m.key for m in fast[0]] == sorted(m.key for m in fast[0])


def test_the_arithmetic_of_an_aligned_merge():
    keys = ["loss", "tokens"]
    snaps = [{"packed": {"mean": (keys, [(3.0, 2), (10.0, 5)])}}, {"packed": {"mean": (keys, [(1.0, 2), (20.0, 5)])}}]
    out = M.reduce_snapshots(snaps)
    assert [(m.key, m.value, m.reduction) for m in out] == [("loss", 1.0, Reduce.MEAN), ("tokens", 3.0, Reduce.MEAN)]


def _keys_under_two_reductions() -> list[dict]:
    return [{"packed": {"sum": (["a", "b"], [1.0, 2.0]), "max": (["b"], [5.0])}}] * 2


def _other_order() -> list[dict]:
    return [{"packed": {"sum": (["a", "b"], [1.0, 2.0])}}, {"packed": {"sum": (["b", "a"], [3.0, 4.0])}}]


def _a_rank_without_a_key() -> list[dict]:
    return [{"packed": {"sum": (["a", "b"], [1.0, 2.0])}}, {"packed": {"sum": (["a"], [4.0])}}]


def _with_states() -> list[dict]:
    return [{"packed": {"sum": (["a"], [1.0])}, "states": {"s": {"reduction_type": "sum", "sum": 2.0}}},
            {"packed": {"sum": (["a"], [1.0])}}]


def _malformed_row() -> list[dict]:
    return [{"packed": {"mean": (["a", "b"], [(1.0, 1), (2.0,)])}}, {"packed": {"mean": (["a", "b"], [(1.0, 1), (2.0, 1)])}}]


def _a_key_twice() -> list[dict]:  # a group bundle's partial merges of one key
    return [{"packed": {"mean": (["k", "k"], [(1e308, 2), (1.7976931348623157e308, 0)])}}]


def _unknown_reduction() -> list[dict]:
    return [{"packed": {"nope": (["a"], [1.0])}}] * 2


@pytest.mark.parametrize("make", [_keys_under_two_reductions, _other_order, _a_rank_without_a_key, _with_states,
                                  _malformed_row, _a_key_twice, _unknown_reduction])
def test_what_is_not_aligned_goes_the_general_way(make):
    snaps = make()
    fast, general = _public(snaps), _general(snaps)
    _same(fast[0], general[0])
    assert fast[1] == general[1]
    assert fast[2] == general[2]


def test_conflicts_and_malformed_rows_are_still_set_aside():
    out, drops, _ = _public(_keys_under_two_reductions())
    assert [m.key for m in out] == ["a"] and drops == [("b", "reduction_mismatch", 4)]
    out, drops, _ = _public(_malformed_row())
    assert [(m.key, m.value) for m in out] == [("a", 1.0)] and [d[:2] for d in drops] == [("b", "merge_error")]
    out, _, _ = _public(_a_key_twice())
    assert [(m.key, m.value) for m in out] == [("k", math.inf)]  # one value, the partial merges merged
