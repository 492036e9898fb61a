"""Reductions: mergeable accumulators, one per (process, key, step).

    >>> from forge_obs.reduce import Reduce, reduce_metrics_states
    >>> a, b = Reduce.MEAN.accumulator_class(Reduce.MEAN), Reduce.MEAN.accumulator_class(Reduce.MEAN)
    >>> for v in (1, 2): a.append(v)
    >>> b.append(6)
    >>> [m.value for m in reduce_metrics_states([{"x": a.get_state()}, {"x": b.get_state()}])]
    [3.0]

Every accumulator turns its values into a small *state* (a plain dict that pickles cheaply) and
states merge exactly: MEAN is (sum, count), STD is (count, mean, M2) merged with Chan's formula,
so a cross-rank reduction is never a mean of means. Custom reductions register by name with
:func:`register_reduction`. This module imports neither torch nor Monarch.
"""

from __future__ import annotations

import math
import random
from enum import Enum
from typing import Any, Callable

from forge_obs.metric import Metric

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
    "resolve_reduction",
    "merge_states",
    "reduce_metrics_states",
    "reduce_snapshots",
    "snapshot_states",
    "snapshot_values",
    "ROW_FIELDS",
]


class MetricAccumulator:
    """Base class of an accumulator: ``append`` values, export a mergeable ``get_state``.

    Subclasses implement ``append``, ``get_state``, ``merge_states`` (classmethod: list of states
    -> one state), ``value_from_state`` (classmethod) and ``reset``. ``get_value`` and
    ``get_reduced_value_from_states`` (torchforge's names) are derived from those. The built-in
    numeric ones also export a compact ``row()`` (see :data:`ROW_FIELDS`) for the wire.
    """

    #: whether values must be numbers (False: structured rows, e.g. SAMPLE)
    numeric: bool = True

    def __init__(self, reduction: "Reduce | str") -> None:
        self.reduction = reduction
        self.reduction_type = reduction
        #: the name states carry ("mean", or a custom reduction's name)
        self.rt = reduction.value if isinstance(reduction, Reduce) else reduction
        self.reset()

    def append(self, value: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def reset(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def merge_states(cls, states: list[dict[str, Any]]) -> dict[str, Any]:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def value_from_state(cls, state: dict[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_value(self) -> Any:
        return self.value_from_state(self.get_state())

    @classmethod
    def get_reduced_value_from_states(cls, states: list[dict[str, Any]]) -> Any:
        return cls.value_from_state(cls.merge_states(states))

    def _state(self, **fields: Any) -> dict[str, Any]:
        fields["reduction_type"] = self.rt
        return fields


class SumAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.total = 0.0

    def append(self, value: float) -> None:
        self.total += value

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.rt, "sum": self.total}

    def row(self) -> float:
        return self.total

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "sum": math.fsum(s["sum"] for s in states)}

    @classmethod
    def value_from_state(cls, state):
        return float(state["sum"])


class MeanAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.total = 0.0
        self.count = 0

    def append(self, value: float) -> None:
        self.total += value
        self.count += 1

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.rt, "sum": self.total, "count": self.count}

    def row(self) -> tuple:
        return (self.total, self.count)

    @classmethod
    def merge_states(cls, states):
        return {
            "reduction_type": states[0]["reduction_type"],
            "sum": math.fsum(s["sum"] for s in states),
            "count": sum(s["count"] for s in states),
        }

    @classmethod
    def value_from_state(cls, state):
        return state["sum"] / state["count"] if state["count"] else 0.0


class MaxAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.best = -math.inf

    def append(self, value: float) -> None:
        # NaN is kept (a NaN loss is a signal): once seen it sticks, as nothing compares above it.
        if value > self.best or value != value:
            self.best = value

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.rt, "max": self.best}

    def row(self) -> float:
        return self.best

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "max": _ROWS_VALUE["max"]([s["max"] for s in states])}

    @classmethod
    def value_from_state(cls, state):
        return float(state["max"])


class MinAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.best = math.inf

    def append(self, value: float) -> None:
        if value < self.best or value != value:
            self.best = value

    def get_state(self) -> dict[str, Any]:
        return {"reduction_type": self.rt, "min": self.best}

    def row(self) -> float:
        return self.best

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "min": _ROWS_VALUE["min"]([s["min"] for s in states])}

    @classmethod
    def value_from_state(cls, state):
        return float(state["min"])


class StdAccumulator(MetricAccumulator):
    """Population standard deviation (ddof=0), Welford per value, Chan et al. across states."""

    def reset(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def append(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    def get_state(self) -> dict[str, Any]:
        return self._state(count=self.count, mean=self.mean, m2=self.m2)

    def row(self) -> tuple:
        return (self.count, self.mean, self.m2)

    @classmethod
    def merge_states(cls, states):
        n, mean, m2 = _chan([(s["count"], s["mean"], s["m2"]) for s in states])
        return {"reduction_type": states[0]["reduction_type"], "count": n, "mean": mean, "m2": m2}

    @classmethod
    def value_from_state(cls, state):
        return math.sqrt(state["m2"] / state["count"]) if state["count"] else 0.0


class CountAccumulator(MetricAccumulator):
    def reset(self) -> None:
        self.count = 0

    def append(self, value: Any) -> None:
        self.count += 1

    def get_state(self) -> dict[str, Any]:
        return self._state(count=self.count)

    def row(self) -> int:
        return self.count

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": states[0]["reduction_type"], "count": sum(s["count"] for s in states)}

    @classmethod
    def value_from_state(cls, state):
        return float(state["count"])


class LastAccumulator(MetricAccumulator):
    """The latest value by wall time (``time.time()``), across ranks too."""

    def reset(self) -> None:
        self.last = None
        self.ts = -math.inf

    def append(self, value: float) -> None:
        self.last = value
        self.ts = _now()

    def get_state(self) -> dict[str, Any]:
        return self._state(value=self.last, ts=self.ts)

    def row(self) -> tuple:
        return (self.last, self.ts)

    @classmethod
    def merge_states(cls, states):
        return dict(max(states, key=lambda s: s["ts"]))

    @classmethod
    def value_from_state(cls, state):
        v = state["value"]
        return float(v) if v is not None else math.nan


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
        return {"reduction_type": states[0]["reduction_type"], "rows": rows, "seen": sum(s["seen"] for s in states)}

    @classmethod
    def value_from_state(cls, state):
        return state["rows"]


def _now() -> float:
    import time

    return time.time()


class Reduce(Enum):
    """Built-in reductions. ``record_metric`` also accepts the name of a registered custom one."""

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

    The class must be importable by the same path in every process (states are merged on the
    controller by the class registered under the name there).
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


def reduction_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reduction(reduction: "Reduce | str") -> "Reduce | str":
    """Normalise a Reduce member or a registered name; raise ValueError listing valid names."""
    if isinstance(reduction, Reduce):
        return reduction
    if isinstance(reduction, str):
        r = _BY_NAME.get(reduction.lower()) or _BY_NAME.get(reduction)
        if r is not None:
            return r
    raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(reduction_names())}")


def accumulator_for(reduction_name: str) -> type[MetricAccumulator]:
    try:
        return _REGISTRY[reduction_name]
    except KeyError:
        raise ValueError(
            f"unknown reduction {reduction_name!r}; valid: {', '.join(reduction_names())}"
        ) from None


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge states of one key (all of the same reduction) into one state."""
    return accumulator_for(states[0]["reduction_type"]).merge_states(states)


# ----------------------------------------------------------------- packed states
#: built-in reductions whose state travels as a compact row (a number or a tuple, in this order)
#: instead of a dict: ``{"mean": (keys, rows)}`` pickles and merges several times cheaper
ROW_FIELDS: dict[str, tuple[str, ...]] = {
    "mean": ("sum", "count"),
    "sum": ("sum",),
    "max": ("max",),
    "min": ("min",),
    "count": ("count",),
    "std": ("count", "mean", "m2"),
    "last": ("value", "ts"),
}


def _nan_or(pick: Callable) -> Callable[[list], float]:
    def value(rows: list) -> float:
        for v in rows:
            if v != v:  # NaN sticks (a NaN loss is a signal)
                return math.nan
        return float(pick(rows))

    return value


def _chan(rows: list) -> tuple:
    """Merge (count, mean, m2) rows (Chan et al.): exact, numerically stable."""
    n, mean, m2 = 0, 0.0, 0.0
    for nb, mb, m2b in rows:
        if not nb:
            continue
        delta = mb - mean
        tot = n + nb
        mean += delta * nb / tot
        m2 += m2b + delta * delta * n * nb / tot
        n = tot
    return n, mean, m2


def _std_rows(rows: list) -> float:
    n, _mean, m2 = _chan(rows)
    return math.sqrt(m2 / n) if n else 0.0


def _last(row: tuple) -> float:
    return float(row[0]) if row[0] is not None else math.nan


#: value of one row, and of several rows merged (the arithmetic of merge_states + value_from_state)
_ROW_VALUE: dict[str, Callable[[Any], Any]] = {
    "mean": lambda r: r[0] / r[1] if r[1] else 0.0,
    "sum": float,
    "max": float,
    "min": float,
    "count": float,
    "std": lambda r: math.sqrt(r[2] / r[0]) if r[0] else 0.0,
    "last": _last,
}
_ROWS_VALUE: dict[str, Callable[[list], Any]] = {
    "mean": lambda rows: (math.fsum([r[0] for r in rows]) / c) if (c := sum([r[1] for r in rows])) else 0.0,
    "sum": lambda rows: float(math.fsum(rows)),
    "max": _nan_or(max),
    "min": _nan_or(min),
    "count": lambda rows: float(sum(rows)),
    "std": _std_rows,
    "last": lambda rows: _last(max(rows, key=lambda r: r[1])),
}


def state_to_row(state: dict[str, Any]) -> Any:
    f = ROW_FIELDS[state["reduction_type"]]
    return state[f[0]] if len(f) == 1 else tuple(state[x] for x in f)


def row_to_state(rt: str, row: Any) -> dict[str, Any]:
    f = ROW_FIELDS[rt]
    st = {f[0]: row} if len(f) == 1 else dict(zip(f, row))
    st["reduction_type"] = rt
    return st


def snapshot_states(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{key: state}`` of a (possibly packed) collector snapshot."""
    out = dict(snapshot.get("states") or {})
    for rt, (keys, rows) in (snapshot.get("packed") or {}).items():
        for k, row in zip(keys, rows):
            out[k] = row_to_state(rt, row)
    return out


def snapshot_values(snapshot: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``({key: value}, {key: reduction name})`` of one rank's snapshot (no merge)."""
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for rt, (keys, rows) in (snapshot.get("packed") or {}).items():
        values.update(zip(keys, map(_ROW_VALUE[rt], rows)))
        kinds.update(dict.fromkeys(keys, rt))
    for k, st in (snapshot.get("states") or {}).items():
        rt = st["reduction_type"]
        values[k] = accumulator_for(rt).value_from_state(st)
        kinds[k] = rt
    return values, kinds


def reduction_of(rt: str) -> "Reduce | str":
    """The Reduce member (or custom name) a state's ``reduction_type`` stands for."""
    return _BY_NAME.get(rt, rt)


def reduce_snapshots(
    snapshots: list[dict[str, Any]],
    on_conflict: Callable[[str, set[str]], None] | None = None,
    source: str | None = None,
) -> list[Metric]:
    """Merge the states of several ranks' snapshots (``{"packed": {rt: (keys, rows)}, "states":
    {key: state}}``) into one :class:`Metric` per key, sorted by key. A key recorded with
    different reductions on different ranks is left out and reported to ``on_conflict``."""
    now = _now()
    groups: dict[str, list] = {}  # key -> [reduction name, [rows or states]]
    conflicts: dict[str, set] = {}

    def add(key: str, rt: str, item: Any) -> None:
        g = groups.get(key)
        if g is None:
            groups[key] = [rt, [item]]
        elif g[0] == rt:
            g[1].append(item)
        else:
            conflicts.setdefault(key, {g[0]}).add(rt)

    for snap in snapshots:
        for rt, (keys, rows) in (snap.get("packed") or {}).items():
            for k, row in zip(keys, rows):
                add(k, rt, row)
        for k, st in (snap.get("states") or {}).items():
            rt = st["reduction_type"]
            add(k, rt, state_to_row(st) if rt in ROW_FIELDS else st)
    out: list[Metric] = []
    append = out.append
    for key in sorted(groups):
        if key in conflicts:
            if on_conflict is not None:
                on_conflict(key, conflicts[key])
            continue
        rt, items = groups[key]
        if rt in ROW_FIELDS:
            v = _ROW_VALUE[rt](items[0]) if len(items) == 1 else _ROWS_VALUE[rt](items)
        else:
            cls = accumulator_for(rt)
            v = cls.value_from_state(items[0] if len(items) == 1 else cls.merge_states(items))
        append(Metric(key, v, _BY_NAME.get(rt, rt), now, source))
    return out


def reduce_metrics_states(
    states: list[dict[str, dict[str, Any]]],
    on_conflict: Callable[[str, set[str]], None] | None = None,
    source: str | None = None,
) -> list[Metric]:
    """Reduce ``[{key: state}, ...]`` (one dict per rank) to one :class:`Metric` per key.

    A key recorded with different reductions on different ranks cannot be merged: it is left out
    and ``on_conflict(key, reductions)`` is called (the pipeline counts it in
    ``obs/dropped_values``). ``source`` labels the Metrics (per-rank views).
    """
    return reduce_snapshots([{"states": st} for st in states], on_conflict, source)
