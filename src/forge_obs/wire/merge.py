"""The one exact cross-rank merge: states of every rank (or group) of a step merged per key
into values, for the global view and per rank. Each reduction's arithmetic is its accumulator's
(:mod:`forge_obs.recording.reduce`); this module groups the states by key, calls the merges,
and sets aside what cannot be merged (a key recorded with two reductions, a malformed state, a
reduction unknown here), counted by reason. Pure functions: no Monarch, no threads.

    >>> from forge_obs.wire.merge import reduce_metrics_states
    >>> [(m.key, m.value) for m in reduce_metrics_states([{"loss": {"reduction_type": "mean", "sum": 3.0, "count": 2}},
    ...                                                   {"loss": {"reduction_type": "mean", "sum": 1.0, "count": 2}}])]
    [('loss', 1.0)]
"""

from __future__ import annotations

import logging
import time
from itertools import repeat
from typing import Any, Callable

from forge_obs.core.safe import safe_repr
from forge_obs.core.types import Metric
from forge_obs.recording.reduce import (
    ROW_CLASSES,
    ROW_FIELDS,
    Reduce,
    accumulator_for,
    is_registered,
    reduction_of,
    reduction_type_of,
    row_state,
)

__all__ = [
    "Grouper",
    "merge_states",
    "state_to_row",
    "row_to_state",
    "reduce_snapshots",
    "reduce_metrics_states",
    "snapshot_states",
    "merge_snapshots",
    "without_keys",
    "snapshot_values",
    "rows_of",
]

logger = logging.getLogger("forge_obs")

def rows_of(data: Any) -> Any:
    """A packed group's rows: ``data`` as it is (a list of rows), or its field columns (a tuple
    of lists, one per field: how a collector exports MEAN, STD and LAST) zipped into rows."""
    return zip(*data) if type(data) is tuple else data


def _fields(data: Any, n_fields: int, n: int) -> tuple:
    """A packed group's ``n`` rows as ``n_fields`` columns; ValueError if they are not that."""
    if type(data) is not tuple:
        data = (data,) if n_fields == 1 else (tuple(zip(*data)) if n else ((),) * n_fields)
    if len(data) != n_fields or any(len(f) != n for f in data):
        raise ValueError("rows of another shape")
    return data


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge states of one key (all of the same reduction) into one state."""
    return accumulator_for(reduction_type_of(states[0])).merge_states(states)


def state_to_row(state: dict[str, Any]) -> Any:
    return ROW_CLASSES[reduction_type_of(state)].row_from_state(state)


def row_to_state(rt: str, row: Any) -> dict[str, Any]:
    return row_state(rt, ROW_FIELDS[rt], row)


def _finite_rows(rows: list) -> bool:
    for r in rows:
        for x in r if type(r) is tuple else (r,):
            if type(x) is float and x - x:
                return False
    return True


def _call(cb: Callable | None, *args: Any) -> None:
    if cb is None:
        return
    try:
        cb(*args)
    except Exception:  # noqa: BLE001 - a caller's callback never breaks a reduction
        logger.debug("forge_obs: reduction callback %r failed", cb, exc_info=True)


_warned: set[tuple[str, str]] = set()


def _warn_drop(key: Any, reason: str, err: Any = None) -> None:
    k = (reason, key if type(key) is str else safe_repr(key))
    if k in _warned or len(_warned) > 10_000:
        return
    _warned.add(k)
    more = f": {safe_repr(err)}" if err is not None else ""
    logger.warning("forge_obs: %r dropped from the step (%s%s; counted in obs/dropped_values)", k[1], reason, more)


class Grouper:
    """The states of each key across snapshots: ``key -> [reduction name, items]``, items being
    rows (built-in reductions) or state dicts. Malformed states and conflicting reductions are
    set aside, per key."""

    def __init__(self) -> None:
        self.groups: dict[Any, list] = {}
        self.conflicts: dict[Any, list] = {}  # key -> [set of reduction names, states not grouped]
        self.bad: dict[Any, list] = {}  # key -> [reason, n, error]

    def add(self, key: Any, rt: str, item: Any) -> None:
        g = self.groups.get(key)
        if g is None:
            self.groups[key] = [rt, [item]]
        elif g[0] == rt:
            g[1].append(item)
        else:
            self._conflict(key, g[0], rt)

    def _conflict(self, key: Any, rt0: str, rt: str) -> None:
        c = self.conflicts.get(key)
        if c is None:
            c = self.conflicts[key] = [{rt0}, 0]
        c[0].add(rt)
        c[1] += 1

    def n_states(self, key: Any) -> int:
        g, c, b = self.groups.get(key), self.conflicts.get(key), self.bad.get(key)
        return (len(g[1]) if g else 0) + (c[1] if c else 0) + (b[1] if b else 0)

    def set_aside(self, key: Any, reason: str, err: Any = None) -> None:
        b = self.bad.get(key)
        if b is None:
            self.bad[key] = [reason, 1, err]
        else:
            b[1] += 1

    def add_snapshot(self, snap: Any) -> None:
        if not isinstance(snap, dict):
            return
        groups = self.groups
        for rt, group in (snap.get("packed") or {}).items():
            try:
                keys, data = group
                for k, row in zip(keys, rows_of(data)):  # self.add, inlined: the bulk of a merge
                    g = groups.get(k)
                    if g is None:
                        groups[k] = [rt, [row]]
                    elif g[0] == rt:
                        g[1].append(row)
                    else:
                        self._conflict(k, g[0], rt)
            except Exception as e:  # noqa: BLE001 - not what a collector exports: skip the group
                logger.warning("forge_obs: a malformed packed group %r was skipped: %r", rt, e)
        for k, st in (snap.get("states") or {}).items():
            self.add_state(k, st)

    def add_state(self, k: Any, st: Any) -> None:
        try:
            rt = reduction_type_of(st)
            hash(rt)
        except Exception as e:  # noqa: BLE001
            self.set_aside(k, "bad_state", e)
            return
        cls = ROW_CLASSES.get(rt) if type(rt) is str else None
        if cls is None:
            self.add(k, rt, st)
            return
        try:
            row = cls.row_from_state(st)
        except Exception as e:  # noqa: BLE001 - a state without its fields
            self.set_aside(k, "bad_state", e)
            return
        self.add(k, rt, row)

    def keys(self) -> list:
        ks = set(self.groups)
        if self.bad:
            ks |= set(self.bad)
        try:
            return sorted(ks)
        except TypeError:  # keys of several types (never from a collector)
            return sorted(ks, key=safe_repr)


def _value(rt: str, items: list) -> Any:
    """The reduced value of one key's items (rows or states). Raises ValueError for a reduction
    not registered here, anything for a failing merge."""
    cls = ROW_CLASSES.get(rt)
    if cls is not None:
        return cls.row_value(items[0] if len(items) == 1 else cls.merge_rows(items))
    cls = accumulator_for(rt)
    return cls.value_from_state(items[0] if len(items) == 1 else cls.merge_states(items))


def _reduce_groups(
    gr: Grouper,
    on_conflict: Callable | None,
    on_drop: Callable | None,
    on_overflow: Callable | None,
    source: str | None,
) -> list[Metric]:
    now = time.time()
    out: list[Metric] = []
    append = out.append
    groups, conflicts, bad = gr.groups, gr.conflicts, gr.bad
    fns: dict[str, tuple] = {rt: (c.row_value, c.merge_rows) for rt, c in ROW_CLASSES.items()}
    odd = bool(conflicts or bad)
    for key in gr.keys():
        if odd and (key in bad or key in conflicts):
            b = bad.get(key)
            reason = b[0] if b is not None else "reduction_mismatch"
            if b is None:
                _warn_drop(key, reason, f"recorded as {', '.join(sorted(map(str, conflicts[key][0])))}")
                _call(on_conflict, key, conflicts[key][0])
            else:
                _warn_drop(key, reason, b[2])
            _call(on_drop, key, reason, gr.n_states(key))
            continue
        rt, items = groups[key]
        try:
            f = fns.get(rt)
            if f is None:
                v = _value(rt, items)
            elif len(items) == 1:
                v = f[0](items[0])
            else:
                v = f[0](f[1](items))
                if type(v) is float and v - v and _finite_rows(items):
                    _call(on_overflow, key)  # finite states whose merge exceeds the float range
        except Exception as e:  # noqa: BLE001 - one key's failure never costs the others
            reason = "unknown_reduction" if not is_registered(rt) else "merge_error"
            _warn_drop(key, reason, e)
            _call(on_drop, key, reason, len(items))
            continue
        append(Metric(key, v, reduction_of(rt), now, source))
    return out


def reduce_snapshots(
    snapshots: list[dict[str, Any]],
    on_conflict: Callable[[str, set[str]], None] | None = None,
    source: str | None = None,
    *,
    on_drop: Callable[[str, str, int], None] | None = None,
    on_overflow: Callable[[str], None] | None = None,
) -> list[Metric]:
    """Merge the states of several ranks' snapshots (``{"packed": {rt: (keys, rows)}, "states":
    {key: state}}``) into one :class:`Metric` per key, sorted by key. Never raises because of
    the data: a key whose states cannot be reduced is left out and reported to
    ``on_drop(key, reason, n_states)`` (reasons: see the module docstring); a key recorded with
    different reductions on different ranks is also reported to ``on_conflict(key, reductions)``.
    ``on_overflow(key)``: the merge of finite states exceeded the float range (the value is
    ``±inf`` and kept). ``source`` labels the Metrics (per-rank views)."""
    aligned = _reduce_aligned(snapshots, on_overflow, source)
    if aligned is not None:
        return aligned
    gr = Grouper()
    for snap in snapshots:
        gr.add_snapshot(snap)
    return _reduce_groups(gr, on_conflict, on_drop, on_overflow, source)


def _aligned_groups(snapshots: list) -> list[tuple[str, list, list[list]]] | None:
    """``[(reduction name, keys, [each snapshot's rows])]`` when every snapshot holds only packed
    rows of built-in reductions, each the same keys in the same order (ranks that run the same
    code), and each key once in one reduction; else None."""
    first = snapshots[0] if snapshots else None
    packed = first.get("packed") if type(first) is dict else None
    if not packed or type(packed) is not dict:
        return None
    out = []
    for rt, group in packed.items():
        if rt not in ROW_CLASSES or type(group) is not tuple or len(group) != 2:
            return None
        keys = group[0]
        n_fields = len(ROW_FIELDS[rt])
        cols = []
        for snap in snapshots:
            p = snap.get("packed") if type(snap) is dict and not snap.get("states") else None
            g = p.get(rt) if type(p) is dict and len(p) == len(packed) else None
            if type(g) is not tuple or len(g) != 2 or (g[0] is not keys and g[0] != keys):
                return None
            try:
                cols.append(_fields(g[1], n_fields, len(keys)))
            except Exception:  # noqa: BLE001 - rows of another shape: key by key
                return None
        out.append((rt, keys, cols))
    if _key_order([keys for _rt, keys, _cols in out]) is None:
        return None  # a key twice (a bundle's partial merges) or under two reductions: key by key
    return out


def _reduce_aligned(snapshots: list, on_overflow: Callable | None, source: str | None) -> list[Metric] | None:
    """:func:`reduce_snapshots` of snapshots that :func:`_aligned_groups` accepts, key by key
    with the same merges in the same snapshot order, so the same Metrics; merged column-wise,
    without grouping each row by its key. None for any other snapshots, or if a row cannot be
    reduced: the general path then reduces them (and sets aside what it must)."""
    groups = _aligned_groups(snapshots)
    if groups is None:
        return None
    now = time.time()
    out: list[Metric] = []
    overflows: list = []  # finite states whose merge exceeds the float range
    try:
        for rt, keys, cols in groups:
            values = ROW_CLASSES[rt].aligned_values(cols)
            if len(cols) > 1:
                total = sum(values)
                if total - total:  # some value is inf or NaN: did finite states make it so?
                    nonfinite = [i for i, v in enumerate(values) if type(v) is float and v - v]
                    overflows.extend(keys[i] for i in nonfinite if _finite_rows([tuple(f[i] for f in c) for c in cols]))
            out.extend(map(Metric, keys, values, repeat(reduction_of(rt)), repeat(now), repeat(source)))
        order = _key_order([keys for _rt, keys, _cols in groups])
        if order:
            out = list(map(out.__getitem__, order))
    except Exception:  # noqa: BLE001 - e.g. a malformed row: the general path, key by key
        return None
    for key in sorted(overflows):
        _call(on_overflow, key)
    return out


#: what _key_order found for key lists seen before (as snapshot.decode shares them): their
#: identities -> (the lists, the answer), at most _ORDERS_MAX of them
_ORDERS: dict[tuple, tuple] = {}
_ORDERS_MAX = 256


def _key_order(key_lists: list[list]) -> "list[int] | None | tuple":
    """For the keys of ``key_lists`` taken one list after the other: None if a key is there
    twice; else the order that sorts them (``()`` when they are sorted already). Computed once
    for the same lists (by identity)."""
    ident = tuple(map(id, key_lists))
    hit = _ORDERS.get(ident)
    if hit is None or any(a is not b for a, b in zip(hit[0], key_lists)):
        keys = [k for ks in key_lists for k in ks]
        if len(set(keys)) != len(keys):
            order = None
        else:
            order = sorted(range(len(keys)), key=keys.__getitem__)
            order = () if order == list(range(len(order))) else order
        if len(_ORDERS) >= _ORDERS_MAX:
            _ORDERS.clear()
        hit = _ORDERS[ident] = (key_lists, order)
    return hit[1]


def reduce_metrics_states(
    states: list[dict[str, dict[str, Any]]],
    on_conflict: Callable[[str, set[str]], None] | None = None,
    source: str | None = None,
    *,
    on_drop: Callable[[str, str, int], None] | None = None,
    on_overflow: Callable[[str], None] | None = None,
) -> list[Metric]:
    """Reduce ``[{key: state}, ...]`` (one dict per rank) to one :class:`Metric` per key
    (torchforge's function; its state fields are read too: ``total``, ``max_val``, ``min_val``,
    STD as ``sum``/``sum_sq``/``count``).

    A key recorded with different reductions on different ranks raises ``ValueError``, as in
    torchforge, unless ``on_conflict`` is given: then the key is left out and
    ``on_conflict(key, reductions)`` is called. Any other key that cannot be reduced is left out
    with a warning and reported to ``on_drop`` (see :func:`reduce_snapshots`).
    """
    gr = Grouper()
    for st in states:
        for k, s in (st or {}).items():
            gr.add_state(k, s)
    if on_conflict is None and gr.conflicts:
        key = next(k for k in gr.keys() if k in gr.conflicts)
        first, *others = sorted(map(str, gr.conflicts[key]))
        raise ValueError(f"Mismatched reduction types for key '{key}': {first} vs {others[0]}")
    return _reduce_groups(gr, on_conflict, on_drop, on_overflow, source)


def snapshot_states(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{key: state}`` of a (possibly packed) collector snapshot."""
    out = dict(snapshot.get("states") or {})
    for rt, (keys, data) in (snapshot.get("packed") or {}).items():
        fields = ROW_FIELDS[rt]
        for k, row in zip(keys, rows_of(data)):
            out[k] = row_state(rt, fields, row)
    return out


def merge_snapshots(
    snapshots: list[dict[str, Any]], on_drop: Callable[[str, str, int], None] | None = None
) -> dict[str, Any]:
    """One snapshot (``{"states": {...}}``) of several snapshots of the same rank (e.g. its
    step's states plus late ones). Never raises: a key that cannot be merged is left out and
    reported to ``on_drop(key, reason, n_states)``, as in :func:`reduce_snapshots`."""
    gr = Grouper()
    for snap in snapshots:
        gr.add_snapshot(snap)
    states: dict[str, Any] = {}
    for key in gr.keys():
        if key in gr.bad or key in gr.conflicts:
            b = gr.bad.get(key)
            reason = b[0] if b is not None else "reduction_mismatch"
            _warn_drop(key, reason, b[2] if b is not None else None)
            _call(on_drop, key, reason, gr.n_states(key))
            continue
        rt, items = gr.groups[key]
        try:
            cls = ROW_CLASSES.get(rt)
            if cls is not None:
                states[key] = row_state(rt, cls.fields, items[0] if len(items) == 1 else cls.merge_rows(items))
            else:
                states[key] = items[0] if len(items) == 1 else accumulator_for(rt).merge_states(items)
        except Exception as e:  # noqa: BLE001
            reason = "unknown_reduction" if not is_registered(rt) else "merge_error"
            _warn_drop(key, reason, e)
            _call(on_drop, key, reason, len(items))
    return {"states": states}


def without_keys(snapshot: dict[str, Any], keys: Any) -> dict[str, Any]:
    """``snapshot`` (packed and/or states) without the values of ``keys``."""
    packed = {}
    for rt, (ks, data) in (snapshot.get("packed") or {}).items():
        kept = [(k, r) for k, r in zip(ks, rows_of(data)) if k not in keys]
        packed[rt] = ([k for k, _r in kept], [r for _k, r in kept])
    states = {k: st for k, st in (snapshot.get("states") or {}).items() if k not in keys}
    return dict(snapshot, packed=packed, states=states)


def snapshot_values(
    snapshot: dict[str, Any], on_drop: Callable[[str, str, int], None] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``({key: value}, {key: reduction name})`` of one rank's snapshot (no merge). A key whose
    value cannot be computed is left out (and reported to ``on_drop``)."""
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for rt, (keys, data) in (snapshot.get("packed") or {}).items():
        rv = ROW_CLASSES[rt].row_value
        rows = list(rows_of(data))
        try:
            values.update(zip(keys, map(rv, rows)))
        except Exception:  # noqa: BLE001 - rows not made by a collector: one by one below
            for k, row in zip(keys, rows):
                try:
                    values[k] = rv(row)
                except Exception as e:  # noqa: BLE001
                    _warn_drop(k, "merge_error", e)
                    _call(on_drop, k, "merge_error", 1)
                    continue
                kinds[k] = rt
            continue
        kinds.update(dict.fromkeys(keys, rt))
    for k, st in (snapshot.get("states") or {}).items():
        gr = Grouper()
        gr.add_state(k, st)
        b = gr.bad.get(k)
        if b is not None:
            _warn_drop(k, b[0], b[2])
            _call(on_drop, k, b[0], 1)
            continue
        rt, items = gr.groups[k]
        try:
            values[k] = _value(rt, items)
        except Exception as e:  # noqa: BLE001
            reason = "unknown_reduction" if not is_registered(rt) else "merge_error"
            _warn_drop(k, reason, e)
            _call(on_drop, k, reason, 1)
            continue
        kinds[k] = rt
    return values, kinds
