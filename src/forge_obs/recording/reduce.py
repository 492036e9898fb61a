"""Reductions: mergeable accumulators, one per (process, key, step).

    >>> from forge_obs.recording.reduce import Reduce
    >>> a, b = Reduce.MEAN.accumulator_class(Reduce.MEAN), Reduce.MEAN.accumulator_class(Reduce.MEAN)
    >>> for v in (1, 2): a.append(v)
    >>> b.append(6)
    >>> cls = Reduce.MEAN.accumulator_class
    >>> cls.value_from_state(cls.merge_states([a.get_state(), b.get_state()]))
    3.0

Every accumulator turns its values into a small *state* (a plain dict that pickles cheaply) and
states merge exactly: MEAN is (sum, count), STD is (count, mean, M2) merged with Chan's formula,
so a cross-rank reduction is never a mean of means. State dicts also carry torchforge's fields
(SUM ``total``, MAX ``max_val``, MIN ``min_val``, STD ``sum``/``sum_sq``), and states with only
torchforge's fields are read too. Custom reductions register by name with
:func:`register_reduction`. This module imports neither torch nor Monarch.

Each built-in numeric reduction keeps its arithmetic in its accumulator class, once: ``append``
(one value), ``merge_rows`` (several states, as compact rows; see :data:`ROW_FIELDS`) and
``row_value`` (a row's reduced value). State dicts, packed rows, device values and per-rank
views all go through those three.

Arithmetic follows IEEE 754 and never raises: a SUM, MEAN or STD beyond the float range is
``inf``, an ``int`` beyond it is ``±inf``, ``inf - inf`` is NaN, and NaN sticks in MAX / MIN.
Every merge gives the same bits in whatever order its states come: sums are exact (``exact_fsum``),
MAX / MIN / LAST pick by a total order, STD merges its rows sorted (``_order_key``).

Nothing raises because of one key's data while reducing a step: the cross-rank merge
(:func:`forge_obs.wire.merge.reduce_snapshots`) leaves that key out and reports it to ``on_drop(key, reason, n_states)``. The reasons, also the
keys of ``counters["dropped_by_reason"]`` in a collector snapshot (see :class:`DropCounts`) and
the names of ``obs/dropped/<reason>``:

=====================  ==========================================================================
``bad_value``          not a number (or a tensor of several elements) for a numeric reduction
``bad_key``            the key is not a ``str``
``reserved_key``       the key is forge_obs's: under ``obs/`` (its own metrics; dropped where it is
                       recorded), or a name another key of the step is flattened to (``lat/p50``
                       beside a ``distribution`` or other dict-valued ``lat``; dropped at the merge)
``unknown_reduction``  the reduction is not registered (in the recording process, or in the
                       process that merges: a custom reduction registered only in the actors)
``reduction_mismatch`` the key was recorded with two reductions in one step (one rank, or across
                       ranks)
``append_error``       a (custom) accumulator raised on ``append``
``bad_row``            a SAMPLE row that contains itself (a cycle), nests deeper than Python can
                       follow, or whose keys collide once converted to ``str`` (other keys are
                       converted: ``{("a", "b"): 1}`` is kept as ``{"('a', 'b')": 1}``)
``export_error``       a (custom) accumulator's ``get_state`` raised or did not return a state dict
``unpicklable``        a state (SAMPLE rows, custom) or a streamed raw value cannot be pickled
``undecodable``        a state or raw value cannot be unpickled where it arrives (a group leader,
                       the controller): e.g. a SAMPLE row whose class only the rank can import
``bad_state``          a state that is not a dict, has no ``reduction_type`` or lacks its
                       reduction's fields
``merge_error``        merging or reducing the key's states raised
``device_error``       device (GPU) values that could not be read at the flush
``device_cap``         device values of a reduction without a device state beyond
                       :data:`forge_obs.recording.device.RAW_CAP` per key and step
=====================  ==========================================================================
"""

from __future__ import annotations

import logging
import math
import random
import time
from enum import Enum
from fractions import Fraction
from operator import truediv
from typing import Any, Callable

from forge_obs.core.counters import add_count, add_counts
from forge_obs.core.safe import safe_repr

__all__ = [
    "Reduce",
    "MetricAccumulator",
    "MeanAccumulator",
    "SumAccumulator",
    "MaxAccumulator",
    "MinAccumulator",
    "StdAccumulator",
    "CountAccumulator",
    "LastAccumulator",
    "SampleAccumulator",
    "register_reduction",
    "reduction_names",
    "DROP_REASONS",
    "DropCounts",
    "KeyDrops",
    "ROW_CLASSES",
    "ROW_FIELDS",
    "accumulator_for",
    "adopt_reductions",
    "exact_fsum",
    "is_registered",
    "takes_numbers",
    "overflowed_keys",
    "reduction_of",
    "reduction_type_of",
    "reserved_key",
    "resolve_reduction",
    "row_state",
    "to_float",
    "user_reductions",
]

logger = logging.getLogger("forge_obs")

#: why a value or a key's states were dropped (see the module docstring)
DROP_REASONS = (
    "bad_value",
    "bad_key",
    "reserved_key",
    "unknown_reduction",
    "reduction_mismatch",
    "append_error",
    "bad_row",
    "export_error",
    "unpicklable",
    "undecodable",
    "bad_state",
    "merge_error",
    "device_error",
    "device_cap",
)

_INF = math.inf

#: the prefix of forge_obs's own metrics (``obs/values_recorded``, ...): no user key may use it
RESERVED_PREFIX = "obs/"


def reserved_key(key: str) -> "str | None":
    """Why ``key`` (a ``str``) cannot be recorded, or None: keys under :data:`RESERVED_PREFIX`
    are forge_obs's own.

        >>> reserved_key("obs/dropped_values") is not None, reserved_key("observed")
        (True, None)
    """
    if key.startswith(RESERVED_PREFIX):
        return f"keys under {RESERVED_PREFIX!r} are reserved for forge_obs's own metrics; rename it"
    return None


class DropCounts(dict):
    """``{reason: n}`` that adds like a number, so per-rank counters sum with ``+``.

        >>> 0 + DropCounts(bad_key=1) + DropCounts(bad_key=2, unpicklable=1)
        {'bad_key': 3, 'unpicklable': 1}
    """

    def add(self, reason: str, n: int = 1) -> None:
        add_count(self, reason, n)

    def __add__(self, other: Any) -> "DropCounts":
        out = DropCounts(self)
        if isinstance(other, dict):
            add_counts(out, other)
        elif other:
            return NotImplemented
        return out

    __radd__ = __add__

    def total(self) -> int:
        return sum(self.values())


class KeyDrops(dict):
    """``{reason: {key, ...}}``: the keys left out of a step while states are decoded or merged
    (on a group leader or on the controller). A key counts once per reason and step, however
    many ranks or groups held it and whichever process left it out, so that both routes count
    the same. :meth:`add` is an ``on_drop(key, reason, n_states)`` callback.

        >>> d = KeyDrops()
        >>> d.add("lat", "merge_error", 3); d.add("lat", "merge_error", 1)
        >>> d.merge({"merge_error": {"loss"}}); d.counts(), d.total()
        ({'merge_error': 2}, 2)
    """

    def add(self, key: Any, reason: str, n_states: int = 1) -> None:
        keys = self.get(reason)
        if keys is None:
            keys = self[reason] = set()
        keys.add(key)

    def merge(self, other: dict) -> None:
        for reason, keys in other.items():
            self.setdefault(reason, set()).update(keys)

    def counts(self) -> dict[str, int]:
        return {reason: len(keys) for reason, keys in self.items()}

    def total(self) -> int:
        return sum(len(keys) for keys in self.values())


def to_float(x: Any) -> float:
    """``float(x)`` with IEEE overflow: an ``int`` (or any number) beyond the float range is
    ``±inf`` instead of an ``OverflowError``."""
    try:
        return float(x)
    except OverflowError:
        return _INF if x > 0 else -_INF


def exact_fsum(xs: list) -> float:
    """The exact sum of ``xs`` correctly rounded (``math.fsum``), so the same in any order; with
    IEEE semantics where fsum raises: ``±inf`` for an exact sum beyond the float range (even when
    only a partial sum overflows, the total is exact), NaN for ``inf`` plus ``-inf``."""
    try:
        return math.fsum(xs)
    except (OverflowError, ValueError):
        return _exact_sum(xs)


def _exact_sum(xs: list) -> float:
    """:func:`exact_fsum` where ``math.fsum`` raises: the finite values added exactly (an ``int``
    beyond the float range counts as ``±inf``), then the infinities and NaNs."""
    total = Fraction(0)
    special = 0.0
    for x in xs:
        x = to_float(x)
        if x - x:  # inf or NaN
            special += x
        else:
            total += Fraction(x)
    return special if special else to_float(total)


def _order_key(x: Any) -> tuple:
    """A key that sorts any row field (None, NaN, ``-0.0`` before ``0.0``, ints) into one order,
    whatever order the rows came in."""
    if x is None:
        return (0, 0.0, 0.0)
    if x != x:
        return (2, 0.0, 0.0)
    return (1, x, math.copysign(1.0, x) if type(x) is float else 1.0)


def _now() -> float:
    return time.time()


class ReductionName(str):
    """A custom reduction's name, with ``.value`` as a :class:`Reduce` member has (torchforge's
    accumulators write ``self.reduction_type.value`` into their states)."""

    __slots__ = ()

    @property
    def value(self) -> str:
        return str(self)


#: the key under which a torchforge-style state keeps the states it merged
_PARTS = "states"


def _parts(state: dict[str, Any]) -> list[dict[str, Any]]:
    parts = state.get(_PARTS)
    return parts if isinstance(parts, list) and set(state) == {"reduction_type", _PARTS} else [state]


class MetricAccumulator:
    """Base class of an accumulator: ``append`` values, export a mergeable ``get_state``.

    Subclasses implement ``append``, ``get_state``, ``merge_states`` (classmethod: list of states
    -> one state), ``value_from_state`` (classmethod) and ``reset``. ``get_value`` and
    ``get_reduced_value_from_states`` (torchforge's names) are derived from those; a torchforge
    accumulator that defines ``get_value`` and ``get_reduced_value_from_states`` instead works as
    it is. Set
    ``numeric = False`` to receive any value (numbers are otherwise required and NumPy scalars
    and tensors are converted to ``float`` before ``append``).
    """

    #: whether values must be numbers (False: structured rows, e.g. SAMPLE)
    numeric: bool = True

    def __init__(self, reduction: "Reduce | str") -> None:
        self.reduction = reduction
        custom = isinstance(reduction, str) and not isinstance(reduction, Reduce)
        self.reduction_type = ReductionName(reduction) if custom else reduction
        #: the name states carry ("mean", or a custom reduction's name)
        self.rt = reduction.value if isinstance(reduction, Reduce) else str(reduction)
        self.reset()

    def append(self, value: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def merge_states(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state for ``states``. A torchforge-style class that defines only
        ``get_reduced_value_from_states`` keeps the ranks' states side by side, and its value is
        computed from all of them at once."""
        if not cls._reduces_state_lists():
            raise NotImplementedError(f"{cls.__name__} defines neither merge_states nor get_reduced_value_from_states")
        return {"reduction_type": states[0]["reduction_type"], _PARTS: [p for s in states for p in _parts(s)]}

    @classmethod
    def value_from_state(cls, state: dict[str, Any]) -> Any:
        if not cls._reduces_state_lists():
            raise NotImplementedError(f"{cls.__name__} defines neither value_from_state nor get_reduced_value_from_states")
        return cls.get_reduced_value_from_states(_parts(state))

    @classmethod
    def _reduces_state_lists(cls) -> bool:
        return cls.get_reduced_value_from_states.__func__ is not MetricAccumulator.get_reduced_value_from_states.__func__

    def get_value(self) -> Any:
        return self.value_from_state(self.get_state())

    @classmethod
    def get_reduced_value_from_states(cls, states: list[dict[str, Any]]) -> Any:
        return cls.value_from_state(cls.merge_states(states))

    def _state(self, **fields: Any) -> dict[str, Any]:
        fields["reduction_type"] = self.rt
        return fields


class RowAccumulator(MetricAccumulator):
    """A built-in numeric reduction whose state is a compact *row* (a number or a tuple of the
    fields ``fields``, in that order). The reduction's arithmetic is ``append``,
    :meth:`merge_rows` and :meth:`row_value`; everything else derives from them. ``append``
    changes nothing when it raises (an ``int`` beyond the float range raises ``OverflowError``
    before any field is written), so a rejected value leaves no trace."""

    #: the state's fields, in row order
    fields: tuple[str, ...] = ()

    def row(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_row(self, row: Any) -> None:  # pragma: no cover - abstract
        """Set the fields from ``row`` (the inverse of :meth:`row`)."""
        raise NotImplementedError

    @classmethod
    def merge_rows(cls, rows: "list | tuple") -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def row_value(cls, row: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def from_row(cls, reduction: "Reduce | str", row: Any) -> "RowAccumulator":
        acc = cls(reduction)
        acc.load_row(row)
        return acc

    def merge_row(self, row: Any) -> None:
        """Merge a row (e.g. values accumulated on a device) into this accumulator."""
        self.load_row(self.merge_rows([self.row(), row]))

    @classmethod
    def row_from_state(cls, state: dict[str, Any]) -> Any:
        f = cls.fields
        return state[f[0]] if len(f) == 1 else tuple(state[x] for x in f)

    def get_state(self) -> dict[str, Any]:
        return row_state(self.rt, self.fields, self.row())

    @classmethod
    def merge_states(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        row = cls.merge_rows([cls.row_from_state(s) for s in states])
        return row_state(reduction_type_of(states[0]), cls.fields, row)

    @classmethod
    def value_from_state(cls, state: dict[str, Any]) -> Any:
        return cls.row_value(cls.row_from_state(state))

    @classmethod
    def aligned_values(cls, cols: list) -> list:
        """The values of ``cols`` (several snapshots' rows of the same keys in the same order,
        each as a tuple of columns, one per field) merged position by position:
        ``row_value(merge_rows(...))`` of each key. A reduction may compute them column-wise,
        with the same bits; it raises where that does not hold (the caller then merges key by key)."""
        rows = [f[0] if len(f) == 1 else list(zip(*f)) for f in cols]
        rows = rows[0] if len(rows) == 1 else list(map(cls.merge_rows, zip(*rows)))
        return list(map(cls.row_value, rows))


def row_state(rt: str, fields: tuple, row: Any) -> dict[str, Any]:
    st = {fields[0]: row} if len(fields) == 1 else dict(zip(fields, row))
    st["reduction_type"] = rt
    tf = _TORCHFORGE_FIELDS.get(rt)
    if tf is not None:
        tf(st, row)
    return st


def _std_sums(st: dict[str, Any], row: Any) -> None:
    n, mean, m2 = row
    st["sum"] = mean * n
    st["sum_sq"] = m2 + n * mean * mean


#: the fields torchforge's accumulators export, added to a state dict next to ours (states are
#: read back by either name; STD is merged from count/mean/m2, which torchforge's sums derive from)
_TORCHFORGE_FIELDS: dict[str, Callable[[dict, Any], None]] = {
    "sum": lambda st, row: st.__setitem__("total", row),
    "max": lambda st, row: st.__setitem__("max_val", row),
    "min": lambda st, row: st.__setitem__("min_val", row),
    "std": _std_sums,
}


def _nan_or(pick: Callable, rows: list) -> Any:
    """``pick`` (max or min) of ``rows``, the same in any order: NaN sticks (a NaN loss is a
    signal), and of ``0.0`` and ``-0.0`` max picks ``0.0``, min ``-0.0``."""
    for v in rows:
        if v != v:
            return math.nan
    best = pick(rows)
    if best == 0 and type(best) is float:
        return pick(rows, key=_order_key)
    return best


class SumAccumulator(RowAccumulator):
    fields = ("sum",)

    def reset(self) -> None:
        self.total = 0.0

    def append(self, value: float) -> None:
        self.total += value

    def row(self) -> float:
        return self.total

    def load_row(self, row: float) -> None:
        self.total = row

    @classmethod
    def row_from_state(cls, state):
        return state["sum"] if "sum" in state else state["total"]  # torchforge: "total"

    @classmethod
    def merge_rows(cls, rows):
        return exact_fsum(rows)

    @classmethod
    def row_value(cls, row):
        return to_float(row)

    @classmethod
    def aligned_values(cls, cols):
        # math.fsum is exact_fsum where it does not raise; float() is to_float
        return list(map(float, cols[0][0] if len(cols) == 1 else map(math.fsum, zip(*[f[0] for f in cols]))))


class MeanAccumulator(RowAccumulator):
    fields = ("sum", "count")

    def reset(self) -> None:
        self.total = 0.0
        self.count = 0

    def append(self, value: float) -> None:
        self.total += value  # raises (nothing written) for an int beyond the float range
        self.count += 1

    def row(self) -> tuple:
        return (self.total, self.count)

    def load_row(self, row: tuple) -> None:
        self.total, self.count = row

    @classmethod
    def merge_rows(cls, rows):
        sums, counts = zip(*rows) if rows else ((), ())
        return (exact_fsum(sums), sum(counts))

    @classmethod
    def row_value(cls, row):
        if not row[1]:
            return 0.0
        try:
            return row[0] / row[1]
        except OverflowError:  # an int sum beyond the float range (a foreign state)
            return to_float(row[0]) / row[1]

    @classmethod
    def aligned_values(cls, cols):
        # column-wise merge_rows then row_value; a zero count or an int beyond the float range raises
        if len(cols) == 1:
            sums, counts = cols[0]
        else:
            sums = map(math.fsum, zip(*[f[0] for f in cols]))
            counts = map(sum, zip(*[f[1] for f in cols]))
        return list(map(truediv, sums, counts))


class _Extremum(RowAccumulator):
    """MAX and MIN: the row is the best value so far; ``append`` and ``merge_rows`` (the
    comparison) are each reduction's own."""

    def row(self) -> float:
        return self.best

    def load_row(self, row: float) -> None:
        self.best = row

    @classmethod
    def row_value(cls, row):
        return to_float(row)


class MaxAccumulator(_Extremum):
    fields = ("max",)

    def reset(self) -> None:
        self.best = -_INF

    def append(self, value: float) -> None:
        # ``+ 0.0``: a float (an int beyond the float range raises here, before anything is written)
        value += 0.0
        # NaN is kept (a NaN loss is a signal): once seen it sticks, as nothing compares above it.
        if value > self.best or value != value:
            self.best = value

    @classmethod
    def row_from_state(cls, state):
        return state["max"] if "max" in state else state["max_val"]  # torchforge: "max_val"

    @classmethod
    def merge_rows(cls, rows):
        return _nan_or(max, rows)


class MinAccumulator(_Extremum):
    fields = ("min",)

    def reset(self) -> None:
        self.best = _INF

    def append(self, value: float) -> None:
        value += 0.0
        if value < self.best or value != value:
            self.best = value

    @classmethod
    def row_from_state(cls, state):
        return state["min"] if "min" in state else state["min_val"]  # torchforge: "min_val"

    @classmethod
    def merge_rows(cls, rows):
        return _nan_or(min, rows)


class StdAccumulator(RowAccumulator):
    """Population standard deviation (ddof=0), Welford per value, Chan et al. across states."""

    fields = ("count", "mean", "m2")

    def reset(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def append(self, value: float) -> None:
        self.count, self.mean, self.m2 = self.step(self.count, self.mean, self.m2, value)

    @staticmethod
    def step(count: int, mean: float, m2: float, value: float) -> tuple:
        """Welford's update of the fields by one value (raises, before anything changes, for an
        int beyond the float range)."""
        n = count + 1
        delta = value - mean
        new = mean + delta / n
        if new - new:
            new = _spread_mean(mean, count, value, 1, n)
        return n, new, m2 + delta * (value - new)

    def row(self) -> tuple:
        return (self.count, self.mean, self.m2)

    def load_row(self, row: tuple) -> None:
        self.count, self.mean, self.m2 = row

    @classmethod
    def row_from_state(cls, state):
        if "m2" in state:
            return (state["count"], state["mean"], state["m2"])
        # torchforge's state: sum, sum of squares, count
        n, s, sq = state["count"], to_float(state["sum"]), to_float(state["sum_sq"])
        if not n:
            return (0, 0.0, 0.0)
        return (n, s / n, max(sq - s * s / n, 0.0))

    @classmethod
    def merge_rows(cls, rows):
        """Chan et al. (numerically stable), over the rows in one canonical order, so that the
        result is the same, bit for bit, in whatever order the states come. Finite values whose
        spread exceeds the float range give ``m2 = inf`` (never NaN)."""
        n, mean, m2 = 0, 0.0, 0.0
        for nb, mb, m2b in sorted(rows, key=_std_key):
            if not nb:
                continue
            mb = to_float(mb)
            if not n:
                n, mean, m2 = nb, mb, m2b
                continue
            delta = mb - mean
            tot = n + nb
            new = mean + delta * nb / tot
            if new - new:
                new = _spread_mean(mean, n, mb, nb, tot)
            m2 += m2b + delta * delta * n * nb / tot
            mean, n = new, tot
        return (n, mean, m2)

    @classmethod
    def row_value(cls, row):
        n, m2 = row[0], to_float(row[2])
        if not n:
            return 0.0
        v = m2 / n
        return math.sqrt(v) if v >= 0 else (v if v != v else 0.0)  # NaN stays NaN


def _std_key(row: tuple) -> tuple:
    return (row[0], _order_key(row[1]), _order_key(row[2]))


def _spread_mean(m1: float, n1: int, m2: float, n2: int, tot: int) -> float:
    """The mean of two groups (``n1`` values of mean ``m1``, ``n2`` of mean ``m2``) when the
    usual update overflowed: two finite means further apart than the float range still have a
    finite weighted mean (an infinite or NaN one stays so)."""
    return m1 * (n1 / tot) + m2 * (n2 / tot)


class CountAccumulator(RowAccumulator):
    fields = ("count",)

    def reset(self) -> None:
        self.count = 0

    def append(self, value: Any) -> None:
        self.count += 1

    def row(self) -> int:
        return self.count

    def load_row(self, row: int) -> None:
        self.count = row

    @classmethod
    def merge_rows(cls, rows):
        return sum(rows)

    @classmethod
    def row_value(cls, row):
        return float(row)

    @classmethod
    def aligned_values(cls, cols):
        return list(map(float, cols[0][0] if len(cols) == 1 else map(sum, zip(*[f[0] for f in cols]))))


class LastAccumulator(RowAccumulator):
    """The latest value by wall time (``time.time()``), across ranks too."""

    fields = ("value", "ts")

    def reset(self) -> None:
        self.last = None
        self.ts = -_INF

    def append(self, value: float) -> None:
        self.last = value + 0.0  # raises (nothing written) for an int beyond the float range
        self.ts = _now()

    def row(self) -> tuple:
        return (self.last, self.ts)

    def load_row(self, row: tuple) -> None:
        self.last, self.ts = row

    @classmethod
    def merge_rows(cls, rows):
        """The latest write; of writes at the same time, the largest value (NaN above all), so
        that the order the rows come in does not matter."""
        return max(rows, key=_last_key)

    @classmethod
    def row_value(cls, row):
        return to_float(row[0]) if row[0] is not None else math.nan


def _last_key(row: tuple) -> tuple:
    return (row[1], _order_key(row[0]))


class SampleAccumulator(MetricAccumulator):
    """Keeps structured rows (dicts), e.g. rollouts: a uniform reservoir of at most ``capacity``
    rows per step and rank, plus the count of rows seen, so nothing is silently truncated."""

    numeric = False
    capacity = 64

    def reset(self) -> None:
        self.rows: list[Any] = []
        self.seen = 0

    def append(self, value: Any) -> None:
        self.seen += 1
        if len(self.rows) < self.capacity:
            self.rows.append(value)
        else:
            j = random.randrange(self.seen)
            if j < self.capacity:
                self.rows[j] = value

    def get_state(self) -> dict[str, Any]:
        return self._state(rows=list(self.rows), seen=self.seen)

    @classmethod
    def merge_states(cls, states):
        rows: list[Any] = []
        for s in states:
            rows.extend(s["rows"])
        cap = cls.capacity * 4
        if len(rows) > cap:
            rows = random.sample(rows, cap)
        return {"reduction_type": reduction_type_of(states[0]), "rows": rows, "seen": sum(s["seen"] for s in states)}

    @classmethod
    def value_from_state(cls, state):
        return state["rows"]


class Reduce(Enum):
    """Built-in reductions. ``record_metric`` also accepts the name of a registered custom one
    (names are case-insensitive: ``"sample"``, ``"SAMPLE"``)."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    STD = "std"
    COUNT = "count"
    LAST = "last"
    SAMPLE = "sample"

    @property
    def accumulator_class(self) -> type[MetricAccumulator]:
        return _REGISTRY[self.value]


_REGISTRY: dict[str, type[MetricAccumulator]] = {
    "mean": MeanAccumulator,
    "sum": SumAccumulator,
    "max": MaxAccumulator,
    "min": MinAccumulator,
    "std": StdAccumulator,
    "count": CountAccumulator,
    "last": LastAccumulator,
    "sample": SampleAccumulator,
}
_BY_NAME: dict[str, "Reduce | str"] = {r.value: r for r in Reduce}

#: built-in reductions whose state travels as a compact row (a number or a tuple, in this order)
#: instead of a dict: ``{"mean": (keys, rows)}`` pickles and merges several times cheaper
ROW_FIELDS: dict[str, tuple[str, ...]] = {
    rt: cls.fields for rt, cls in _REGISTRY.items() if issubclass(cls, RowAccumulator)
}
#: the classes of :data:`ROW_FIELDS`
ROW_CLASSES: dict[str, type[RowAccumulator]] = {rt: _REGISTRY[rt] for rt in ROW_FIELDS}  # type: ignore[misc]


def register_reduction(name: str, accumulator_class: type[MetricAccumulator]) -> str:
    """Register a custom reduction; use the returned name as ``record_metric``'s reduction.

        >>> class Range(MetricAccumulator):
        ...     def reset(self): self.lo, self.hi = float("inf"), float("-inf")
        ...     def append(self, v): self.lo, self.hi = min(self.lo, v), max(self.hi, v)
        ...     def get_state(self): return self._state(lo=self.lo, hi=self.hi)
        ...     @classmethod
        ...     def merge_states(cls, ss): return {"reduction_type": "range",
        ...         "lo": min(s["lo"] for s in ss), "hi": max(s["hi"] for s in ss)}
        ...     @classmethod
        ...     def value_from_state(cls, s): return s["hi"] - s["lo"]
        >>> register_reduction("range", Range)
        'range'

    The class must be registered under the same name in every process, the controller's
    included: states are merged there by the class registered under the name (a name unknown
    there drops the key, counted as ``unknown_reduction``).
    """
    if not isinstance(name, str) or not name:
        raise ValueError("reduction name must be a non-empty string")
    if name in _BY_NAME and isinstance(_BY_NAME[name], Reduce):
        raise ValueError(f"{name!r} is a built-in reduction; choose another name")
    if not (isinstance(accumulator_class, type) and issubclass(accumulator_class, MetricAccumulator)):
        raise TypeError("accumulator_class must subclass forge_obs.MetricAccumulator")
    _REGISTRY[name] = accumulator_class
    _BY_NAME[name] = name
    return name


def user_reductions() -> dict[str, type[MetricAccumulator]]:
    """The reductions registered by the user's code (forge_obs's own are in every process).
    Fetchers carry them to the processes they start, so a reduction registered once in the
    controller's script can be recorded in any actor."""
    return {n: c for n, c in _REGISTRY.items() if not c.__module__.startswith("forge_obs.")}


def adopt_reductions(classes: dict[str, type[MetricAccumulator]]) -> None:
    """Register ``classes`` here unless a name is registered already (this process's own
    registration wins). Never raises: a class that does not qualify is skipped with a warning."""
    for name, cls in classes.items():
        if name in _REGISTRY:
            continue
        try:
            register_reduction(name, cls)
        except Exception as e:  # noqa: BLE001 - configuration never breaks a process
            logger.warning("forge_obs: reduction %r could not be registered here: %r", name, e)


def reduction_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reduction(reduction: "Reduce | str") -> "Reduce | str":
    """Normalise a Reduce member or a registered name (case-insensitive); raise ValueError
    listing valid names."""
    if isinstance(reduction, Reduce):
        return reduction
    if isinstance(reduction, str):
        r = _BY_NAME.get(reduction) or _BY_NAME.get(reduction.lower())
        if r is None:
            low = reduction.lower()
            r = next((v for k, v in _BY_NAME.items() if k.lower() == low), None)
        if r is not None:
            return r
    raise ValueError(f"unknown reduction {safe_repr(reduction)}; valid: {', '.join(reduction_names())}")


def accumulator_for(reduction_name: str) -> type[MetricAccumulator]:
    try:
        return _REGISTRY[reduction_name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown reduction {safe_repr(reduction_name)}; valid: {', '.join(reduction_names())}"
        ) from None


def reduction_type_of(state: Any) -> str:
    """The reduction name of a state (torchforge states may carry a ``Reduce`` member)."""
    rt = state["reduction_type"]
    return rt if type(rt) is str else getattr(rt, "value", rt)

def reduction_of(rt: str) -> "Reduce | str":
    """The Reduce member (or custom name) a state's ``reduction_type`` stands for."""
    return _BY_NAME.get(rt, rt)


def takes_numbers(reduction_name: str) -> bool:
    """Whether the named reduction's values must be numbers (False: rows, e.g. SAMPLE)."""
    return accumulator_for(reduction_name).numeric


def is_registered(reduction_name: str) -> bool:
    """Whether a reduction of that name is known in this process."""
    return reduction_name in _REGISTRY


def overflowed_keys(rt: str, keys: list, rows: list, skip: Any = ()) -> int:
    """How many rows of ``keys`` (reduction ``rt``, built-in) are non-finite, not counting the
    keys in ``skip`` (keys that had a non-finite value recorded): sums that exceeded the float
    range on the way."""
    n = 0
    if rt not in _OVERFLOWS:
        return 0
    i = _OVERFLOWS[rt]
    for k, r in zip(keys, rows):
        x = r if i is None else r[i]
        if x - x and k not in skip:
            n += 1
    return n


#: built-in reductions whose finite values can add up beyond the float range -> the row field
#: that then holds inf (None: the row is the number)
_OVERFLOWS: dict[str, int | None] = {"sum": None, "mean": 0, "std": 2}
