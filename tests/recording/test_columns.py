"""The columns (recording/columns.py) hold exactly what each reduction's accumulator holds."""

from __future__ import annotations

import math
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from forge_obs.recording.columns import COLUMN_REDUCTIONS, column_for
from forge_obs.recording.reduce import Reduce

VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 1e308, -1e308, 5e-324]),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.sampled_from([10**400, -(10**400), 2**63, -(2**53) - 1]),
)
REDUCTIONS = sorted(COLUMN_REDUCTIONS, key=lambda r: r.value)


def bits(row):
    """A row as exact bits: floats by their IEEE bytes (NaN == NaN, -0.0 != 0.0), ints as they are."""
    if type(row) is tuple:
        return tuple(bits(x) for x in row)
    if type(row) is float:
        return ("f", struct.pack("<d", row) if row == row else "nan")
    return (type(row).__name__, row)


def _feed(add, values):
    """Each value through ``add``; which ones it took (an OverflowError: not taken)."""
    taken = []
    for v in values:
        try:
            add(v)
            taken.append(True)
        except OverflowError:
            taken.append(False)
    return taken


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(VALUES, min_size=1, max_size=12), min_size=1, max_size=3), st.sampled_from(REDUCTIONS))
def test_a_column_makes_the_rows_its_accumulator_makes_step_after_step(steps, red):
    col = column_for(red)
    other = col.intern("other")  # ids are per key: another key's values never mix in
    i = col.intern("k")
    for values in steps:
        acc = red.accumulator_class(red)
        took_acc = _feed(acc.append, values)
        col.add(other, 1.0)
        took_col = _feed(lambda v: col.add(i, v), values)
        assert took_col == took_acc  # the same values rejected, nothing of them written
        took = col.take()
        keys, rows = took.keys(), took.rows()
        assert keys[0] == "other"
        if not any(took_acc):
            assert keys == ["other"]
        else:
            assert keys == ["other", "k"]
            want, got = acc.row(), rows[1]
            if red is Reduce.LAST:  # its wall time differs between the two
                want, got = want[0], got[0]
            assert bits(got) == bits(want)
        col.give_back(took)


def test_a_take_leaves_the_next_step_empty_and_reuses_the_given_back_lists():
    col = column_for(Reduce.MEAN)
    a, b = col.intern("a"), col.intern("b")
    col.add(b, 2.0)
    col.add(a, 1.0)
    first = col.take()
    assert first.keys() == ["b", "a"] and first.rows() == [(2.0, 1), (1.0, 1)]
    col.give_back(first)
    col.add(a, 5.0)
    second = col.take()
    assert col.a is first.a  # the lists given back serve the step after
    assert second.keys() == ["a"] and second.rows() == [(5.0, 1)]
    c = col.intern("c")  # a key interned after the lists were given back
    col.give_back(second)
    col.add(c, 3.0)
    assert col.take().rows() == [(3.0, 1)]


def test_a_detached_key_leaves_the_take():
    col = column_for(Reduce.SUM)
    a, b = col.intern("a"), col.intern("b")
    col.add(a, 1.0)
    col.add(b, 2.0)
    took = col.take()
    assert took.find("a") == a and took.find("zzz") is None
    assert took.detach(a) == 1.0
    assert took.find("a") is None and took.keys() == ["b"] and took.rows() == [2.0]
