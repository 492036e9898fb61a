"""What a cut took, as mergeable states: :func:`export_taken` (``MetricCollector.export``).

    >>> from forge_obs import record_metric, Reduce
    >>> from forge_obs.recording.collector import MetricCollector
    >>> c = MetricCollector()
    >>> record_metric("doc/export", 2.0, Reduce.SUM); record_metric("doc/export", 3.0, Reduce.SUM)
    >>> out = export_taken(c.swap(), packed=True)
    >>> keys, rows = out["packed"]["sum"]
    >>> rows[keys.index("doc/export")]
    5.0

Runs off the caller's path (a fetcher after it acknowledged its cut, the controller's worker
thread), on a :class:`~forge_obs.recording.collector.Taken`: device values are read back first
(once per device), then each key's state is exported. The built-in numeric reductions travel as
rows grouped by reduction (``packed``, see :data:`forge_obs.recording.reduce.ROW_FIELDS`); a
SAMPLE or custom reduction's state is checked one key at a time (its ``get_state`` may raise,
its rows may not pickle) and pickled here (``snapshot.PICKLED``: what it travels as). A key that
fails costs only itself, counted by reason in the Taken's counters.
"""

from __future__ import annotations

import time
from typing import Any

from forge_obs.core.pickling import PICKLED, pickle_value
from forge_obs.core.safe import safe_repr
from forge_obs.recording.reduce import ROW_FIELDS, overflowed_keys, row_state

__all__ = ["export_taken"]


def export_taken(taken: Any, packed: bool = False) -> dict[str, Any]:
    """Mergeable states of a :class:`~forge_obs.recording.collector.Taken` (device values are
    read here, once per device).

    Returns ``{"states": {key: state}, "raw": [(key, value, ts)] | None, "counters": {...},
    "wall_time": t}``. With ``packed=True`` (what fetchers send), the built-in numeric
    reductions come as ``"packed": {reduction: (keys, rows)}`` (see
    :data:`forge_obs.recording.reduce.ROW_FIELDS`) and ``"states"`` holds the others (SAMPLE, custom),
    whose pickled bytes (made checking them) are in ``snapshot.PICKLED``: what they travel as.

    Never raises: a key whose state cannot be exported (its ``get_state`` raises) or
    pickled (a SAMPLE row holding a lock) is left out, counted in ``dropped_values`` and
    ``dropped_by_reason``; every other key is exported. A SUM / MEAN / STD whose values
    added up beyond the float range is exported as ``inf`` and counted in
    ``nonfinite_values``.
    """
    if taken.device is not None:
        _resolve_device(taken)
    accs, counters = taken.accs, taken.counters
    out: dict[str, Any] = {"raw": taken.raw, "counters": counters, "wall_time": time.time()}
    states, groups, odd = _sort(accs, packed)
    if odd is not None:
        pickled: dict[str, bytes] = {}  # the check's bytes: what the states travel as
        for k in odd:
            st = _export_state(k, accs[k], taken, pickled)
            if st is not None:
                states[k] = st
        out[PICKLED] = pickled
        if taken.raw:
            out["raw"] = _picklable_raw(taken.raw, set(odd), taken)
    n = _overflows(accs, states, groups, packed, taken.nonfinite_keys)
    n += _columns(taken, states, groups, packed)
    if packed:
        out["packed"] = groups
    if n:
        counters["nonfinite_values"] = counters.get("nonfinite_values", 0) + n
    out["states"] = states
    return out


def _resolve_device(taken: Any) -> None:
    """The cut's device values, read back into its accumulators; if they cannot be, counted."""
    try:
        taken.device.resolve_into(taken)
    except Exception as e:  # noqa: BLE001 - the device's values only
        try:
            n = sum(e2.count for e2 in taken.device.entries.values())
        except Exception:  # noqa: BLE001
            n = 1
        taken.drop("device_error", n, "<device>", f"device values could not be read ({safe_repr(e)})")


def _columns(taken: Any, states: dict, groups: dict, packed: bool) -> int:
    """The columns' keys and rows (``packed``: into ``groups``; else as states), read once for
    all of a column's keys; each column's lists are given back for a later step. Returns how
    many rows are non-finite without a non-finite value recorded (sums beyond the float range)."""
    n = 0
    for took in taken.cols:
        col = took.column
        ids = took.ids()
        if ids is not None and not ids:  # every key of it moved to an accumulator object (detach)
            col.give_back(took)
            continue
        keys, data = took.keys(ids), took.data(ids)
        rows = data if type(data) is list else None
        total = col.sum_of(took, ids)
        if total - total:  # some row is inf or NaN: which of them overflowed
            rows = took.rows(ids)
            n += overflowed_keys(col.rt, keys, rows, taken.nonfinite_keys)
        if not packed and rows is None:
            rows = took.rows(ids)
        col.give_back(took)
        if packed:
            g = groups.get(col.rt)
            if g is None:
                groups[col.rt] = (keys, data)  # field columns travel as they are (no row objects)
            else:  # objects' rows of the same reduction came first (keys beyond the columns)
                g[0].extend(keys)
                g[1].extend(data if type(data) is list else zip(*data))
        else:
            fields = ROW_FIELDS[col.rt]
            for k, row in zip(keys, rows):
                states[k] = row_state(col.rt, fields, row)
    taken.cols = ()
    return n


def _sort(accs: dict, packed: bool) -> tuple[dict, dict, list | None]:
    """``(states, groups, odd)``: the built-in numeric reductions' states (``packed``: their rows,
    grouped by reduction: ``{rt: ([key, ...], [row, ...])}``), and the keys of the others (SAMPLE,
    custom), to be checked one by one (None when there are none)."""
    states: dict[str, Any] = {}
    groups: dict[str, tuple[list, list]] = {}
    odd: list | None = None
    for k, a in accs.items():
        try:
            rt = a.rt
            if packed:
                g = groups.get(rt)
                if g is not None:
                    row = a.row()
                    g[0].append(k)
                    g[1].append(row)
                    continue
                if rt in ROW_FIELDS:
                    groups[rt] = ([k], [a.row()])
                    continue
            elif rt in ROW_FIELDS:
                states[k] = a.get_state()
                continue
        except Exception:  # noqa: BLE001 - e.g. a custom class without .rt: checked below
            pass
        if odd is None:
            odd = []
        odd.append(k)
    return states, groups, odd


def _overflows(accs: dict, states: dict, groups: dict, packed: bool, skip: Any) -> int:
    """How many built-in states are non-finite without a non-finite value recorded (``skip``):
    sums that exceeded the float range on the way."""
    n = 0
    if packed:
        for rt, (keys, rows) in groups.items():
            n += overflowed_keys(rt, keys, rows, skip)
    else:
        for k, st in states.items():
            rt = st.get("reduction_type")
            if rt in ROW_FIELDS:
                n += overflowed_keys(rt, [k], [accs[k].row()], skip)
    return n


def _values_in(acc: Any) -> int:
    """How many values an accumulator holds, as far as it tells (for drop counts), else 1."""
    for attr in ("seen", "count"):
        n = getattr(acc, attr, None)
        if type(n) is int and n > 0:
            return n
    return 1


def _export_state(key: str, acc: Any, taken: Any, pickled: dict[str, bytes]) -> dict | None:
    """``acc``'s state, its bytes put in ``pickled``; None when it cannot be exported or pickled
    (counted)."""
    try:
        st = acc.get_state()
        if not isinstance(st, dict) or "reduction_type" not in st:
            raise TypeError(f"get_state() returned {type(st).__name__}, not a state dict with a reduction_type")
    except Exception as e:  # noqa: BLE001 - this key only
        taken.drop("export_error", _values_in(acc), key, f"{type(acc).__name__}.get_state failed: {safe_repr(e)}")
        return None
    try:
        pickled[key] = pickle_value(st)
    except Exception as e:  # noqa: BLE001 - e.g. a SAMPLE row holding a lock
        taken.drop("unpicklable", _values_in(acc), key, f"its state cannot be pickled ({safe_repr(e)})")
        return None
    return st


def _picklable_raw(raw: list, keys: set, taken: Any) -> list:
    """``raw`` without the values of ``keys`` (SAMPLE / custom) that cannot be pickled."""
    out = []
    for item in raw:  # (key, value, wall time)
        key, value = item[0], item[1]
        if key in keys and type(value) is not float and type(value) is not int:
            try:
                pickle_value(value)
            except Exception as e:  # noqa: BLE001
                taken.drop("unpicklable", 1, key, f"a raw value cannot be pickled ({safe_repr(e)})")
                continue
        out.append(item)
    return out
