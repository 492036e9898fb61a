"""A rank's snapshot on the wire: what a fetcher sends at a cut.

    >>> from forge_obs.snapshot import snapshot_keys, snapshot_part
    >>> snap = {"packed": {"sum": (["a", "b"], [1.0, 2.0])}, "states": {"c": {"reduction_type": "sample", "rows": [], "seen": 0}}}
    >>> sorted(snapshot_keys(snap)), snapshot_part(snap, "b")
    (['a', 'b', 'c'], {'packed': {'sum': (['b'], [2.0])}})

``{"packed": {reduction: (keys, rows)}, "states": {key: state}, "raw": [...] | None,
"counters": {...}, "wall_time": t}``, pickled by the fetcher (:func:`loads` decodes it).
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["loads", "has_values", "snapshot_keys", "snapshot_part"]


def loads(snapshot: Any) -> dict[str, Any]:
    """A rank's snapshot as sent (pickled bytes) or already decoded (a dict)."""
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        return pickle.loads(snapshot)
    return snapshot


def has_values(snapshot: Any) -> bool:
    """Whether a snapshot (sent or decoded) carries any value or count (one that does not, e.g.
    the final states of a mesh stopped right after a flush, can be left out)."""
    try:
        snap = loads(snapshot)
    except Exception:  # noqa: BLE001 - keep what cannot be judged; the pipeline counts it
        return True
    counters = snap.get("counters") or {}
    return bool(snap.get("states") or snap.get("packed") or snap.get("raw") or any(counters.values()))


def snapshot_keys(snap: dict[str, Any]) -> list[str]:
    keys = list(snap.get("states") or ())
    for _rt, (ks, _rows) in (snap.get("packed") or {}).items():
        keys.extend(ks)
    return keys


def snapshot_part(snap: dict[str, Any], key: str) -> dict[str, Any]:
    """The part of ``snap`` about ``key`` (an empty dict when it has none)."""
    st = (snap.get("states") or {}).get(key)
    if st is not None:
        return {"states": {key: st}}
    for rt, (ks, rows) in (snap.get("packed") or {}).items():
        if key in ks:
            return {"packed": {rt: ([key], [rows[ks.index(key)]])}}
    return {}
