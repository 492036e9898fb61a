"""A step's values of the built-in numeric reductions as columns: lists indexed by key id.

    >>> from forge_obs.recording.reduce import Reduce
    >>> col = column_for(Reduce.MEAN)
    >>> i = col.intern("doc/loss")
    >>> col.add(i, 1.0); col.add(i, 2.0)
    >>> took = col.take()
    >>> took.keys(), took.rows(), took.data()
    (['doc/loss'], [(3.0, 2)], ([3.0], [2]))

The collector interns each key it records with a built-in numeric reduction once per run (an id
in that reduction's :class:`Column`), and keeps a step's values in lists indexed by that id:
no object per key and step, and a key's first value of a step costs what any other value costs.
The cut takes a column's lists as they are (:meth:`Column.take`, O(1) when the previous export gave
lists back), and the export reads the keys touched in the step, in the order they were first
recorded, with C-level maps rather than per key: the rows :data:`forge_obs.recording.reduce.ROW_FIELDS`
defines, as one list per field where a row has several (:meth:`ColumnTake.data`).

Each column's ``add`` is its reduction's ``append`` (:mod:`forge_obs.recording.reduce`) on the
fields of one id: ``n`` counts the step's values (0: untouched), ``a`` and ``b`` hold the row's
other fields (``sum``; ``max`` / ``min``; ``mean`` and ``m2``; ``value`` and ``ts``). A key's
first value of the step sets the fields from the reduction's empty state, so nothing of an
earlier step is ever read. ``add`` changes nothing when it raises (an ``int`` beyond the float
range raises before any field is written). No lock here: the collector calls every method but
:meth:`ColumnTake.rows` under its lock.
"""

from __future__ import annotations

import time
from typing import Any

from forge_obs.recording.reduce import Reduce, StdAccumulator

__all__ = ["Column", "ColumnTake", "column_for", "COLUMN_REDUCTIONS"]

class ColumnTake:
    """One column's values of one cut: the lists the cut took, and the ids touched."""

    __slots__ = ("column", "a", "b", "n", "touched")

    def __init__(self, column: "Column", a: list, b: list, n: list, touched: list) -> None:
        self.column, self.a, self.b, self.n, self.touched = column, a, b, n, touched

    def ids(self) -> "list | None":
        """The ids of this cut's keys, first recorded first; None when they are every id of
        the column in order (a rank that records the same keys step after step: read with
        slices, not per key)."""
        t = self.touched
        if len(t) == len(self.n) and t == self.column.every(len(t)):
            return None
        return t

    def keys(self, ids: "list | None" = ...) -> list:
        """The keys of ``ids`` (default: this cut's); for every id, the same list as the last
        cut's when no key was added (shared: never modified)."""
        ids = self.ids() if ids is ... else ids
        if ids is None:
            return self.column.key_list(len(self.n))
        return list(map(self.column.keys.__getitem__, ids))

    def rows(self, ids: "list | None" = ...) -> list:
        """The rows of ``ids`` (default: this cut's), as the reduction's ``row()``."""
        data = self.data(ids)
        return data if type(data) is list else list(zip(*data))

    def data(self, ids: "list | None" = ...) -> "list | tuple":
        """The values of ``ids`` (default: this cut's) as a packed group carries them: the rows
        of a one-field reduction (a list), or a tuple of lists, one per field, for the others
        (MEAN, STD, LAST)."""
        return self.column.data_of(self, self.ids() if ids is ... else ids)

    def find(self, key: str) -> int | None:
        """The id of ``key`` if it has values in this cut."""
        i = self.column.index.get(key)
        return i if i is not None and i < len(self.n) and self.n[i] else None

    def detach(self, i: int) -> Any:
        """Take id ``i`` out of this cut (its values move to an accumulator object); its row.
        (The rare case: it builds the cut's list of ids again.)"""
        row = self.rows([i])[0]
        self.n[i] = 0
        self.touched = [j for j in self.touched if j != i]
        return row

    def count(self) -> int:
        return len(self.touched)


class Column:
    """One built-in numeric reduction's interned keys and the current step's values."""

    __slots__ = ("reduction", "rt", "keys", "index", "a", "b", "n", "touched", "_spare", "_every", "_key_list")

    def __init__(self, reduction: Reduce) -> None:
        self.reduction = reduction
        self.rt = reduction.value
        self.keys: list[str] = []  # id -> key, append-only
        self.index: dict[str, int] = {}  # key -> id
        self.a: list = []
        self.b: list = []
        self.n: list[int] = []
        self.touched: list[int] = []  # ids with values this step, first recorded first
        self._spare: tuple | None = None  # lists an export gave back: the next take installs them
        self._every: list[int] = []  # [0, 1, ..., n - 1]
        self._key_list: list[str] = []  # the first n keys, as the last cuts exported them

    def every(self, n: int) -> list[int]:
        """``[0, 1, ..., n - 1]`` (made again only when ``n`` changes)."""
        e = self._every
        if len(e) != n:
            e = self._every = list(range(n))
        return e

    def key_list(self, n: int) -> list[str]:
        """The first ``n`` keys: the same list while ``n`` is the same (never modified)."""
        k = self._key_list
        if len(k) != n:
            k = self._key_list = self.keys[:n]
        return k

    def intern(self, key: str) -> int:
        """``key``'s id in this column (a new one on first use)."""
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.keys)
            self.keys.append(key)
            self.a.append(0.0)
            self.b.append(0.0)
            self.n.append(0)
        return i

    def add(self, i: int, v: Any) -> None:  # pragma: no cover - each reduction's
        raise NotImplementedError

    def take(self) -> ColumnTake:
        """The step's values, taken; the column starts the next step empty."""
        took = ColumnTake(self, self.a, self.b, self.n, self.touched)
        size = len(self.keys)
        spare, self._spare = self._spare, None
        if spare is not None and len(spare[2]) <= size:
            a, b, n = spare
            grow = size - len(n)
            if grow:
                a.extend([0.0] * grow)
                b.extend([0.0] * grow)
                n.extend([0] * grow)
        else:
            a, b, n = [0.0] * size, [0.0] * size, [0] * size
        self.a, self.b, self.n, self.touched = a, b, n, []
        return took

    def give_back(self, took: ColumnTake) -> None:
        """An exported cut's lists, to be the next step's (its ``n`` zeroed)."""
        took.n = [0] * len(took.n)
        self._spare = (took.a, took.b, took.n)

    def data_of(self, took: ColumnTake, ids: list) -> "list | tuple":  # pragma: no cover - each reduction's
        raise NotImplementedError

    def sum_of(self, took: ColumnTake, ids: list) -> float:
        """The plain sum of the rows' field that can exceed the float range (see
        :func:`forge_obs.recording.reduce.overflowed_keys`): finite means none did."""
        return _sum(took.a, ids)


class MeanColumn(Column):
    """MEAN: ``a`` the sum, ``n`` the count."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        n = self.n
        if n[i]:
            self.a[i] += v
            n[i] += 1
        else:
            self.a[i] = 0.0 + v
            n[i] = 1
            self.touched.append(i)

    def data_of(self, took: ColumnTake, ids: list) -> tuple:
        return _pick(took.a, ids), _pick(took.n, ids)


class SumColumn(MeanColumn):
    """SUM: ``a`` the sum (added as MEAN adds; only the sum travels)."""

    __slots__ = ()

    def data_of(self, took: ColumnTake, ids: list) -> list:
        return _pick(took.a, ids)


class MaxColumn(Column):
    """MAX: ``a`` the largest value (NaN sticks)."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        v += 0.0
        n = self.n
        if n[i]:
            if v > self.a[i] or v != v:
                self.a[i] = v
            n[i] += 1
        else:
            self.a[i] = v  # the empty state is -inf: every value but -inf replaces it, and -inf is -inf
            n[i] = 1
            self.touched.append(i)

    def data_of(self, took: ColumnTake, ids: list) -> list:
        return _pick(took.a, ids)

    def sum_of(self, took: ColumnTake, ids: list) -> float:
        return 0.0  # a largest value never overflows


class MinColumn(MaxColumn):
    """MIN: ``a`` the smallest value (NaN sticks)."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        v += 0.0
        n = self.n
        if n[i]:
            if v < self.a[i] or v != v:
                self.a[i] = v
            n[i] += 1
        else:
            self.a[i] = v
            n[i] = 1
            self.touched.append(i)


class StdColumn(Column):
    """STD: ``n`` the count, ``a`` the mean, ``b`` M2 (Welford, :meth:`StdAccumulator.step`)."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        n = self.n
        c = n[i]
        if c:
            _c, self.a[i], self.b[i] = StdAccumulator.step(c, self.a[i], self.b[i], v)
            n[i] = c + 1
        else:
            _c, self.a[i], self.b[i] = StdAccumulator.step(0, 0.0, 0.0, v)
            n[i] = 1
            self.touched.append(i)

    def data_of(self, took: ColumnTake, ids: list) -> tuple:
        return _pick(took.n, ids), _pick(took.a, ids), _pick(took.b, ids)

    def sum_of(self, took: ColumnTake, ids: list) -> float:
        return _sum(took.b, ids)


class CountColumn(Column):
    """COUNT: ``n`` the count."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        n = self.n
        if n[i]:
            n[i] += 1
        else:
            n[i] = 1
            self.touched.append(i)

    def data_of(self, took: ColumnTake, ids: list) -> list:
        return _pick(took.n, ids)

    def sum_of(self, took: ColumnTake, ids: list) -> float:
        return 0.0


class LastColumn(Column):
    """LAST: ``a`` the latest value, ``b`` its wall time."""

    __slots__ = ()

    def add(self, i: int, v: Any) -> None:
        self.a[i] = v + 0.0  # raises (nothing written) for an int beyond the float range
        self.b[i] = time.time()
        n = self.n
        if n[i]:
            n[i] += 1
        else:
            n[i] = 1
            self.touched.append(i)

    def data_of(self, took: ColumnTake, ids: list) -> tuple:
        return _pick(took.a, ids), _pick(took.b, ids)

    def sum_of(self, took: ColumnTake, ids: list) -> float:
        return 0.0


def _pick(values: list, ids: "list | None") -> list:
    """``values`` at ``ids`` (None: all of them, a copy)."""
    return values[:] if ids is None else list(map(values.__getitem__, ids))


def _sum(values: list, ids: "list | None") -> float:
    return sum(values if ids is None else map(values.__getitem__, ids))


_CLASSES: dict[Reduce, type[Column]] = {
    Reduce.MEAN: MeanColumn, Reduce.SUM: SumColumn, Reduce.MAX: MaxColumn, Reduce.MIN: MinColumn,
    Reduce.STD: StdColumn, Reduce.COUNT: CountColumn, Reduce.LAST: LastColumn,
}
#: the reductions kept in columns (the built-in numeric ones)
COLUMN_REDUCTIONS = frozenset(_CLASSES)


def column_for(reduction: Reduce) -> Column:
    """A new, empty column of ``reduction`` (one of :data:`COLUMN_REDUCTIONS`)."""
    return _CLASSES[reduction](reduction)

