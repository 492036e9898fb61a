"""A rank's snapshot on the wire: what a fetcher sends at a cut.

    >>> from forge_obs.snapshot import dumps, loads
    >>> snap = {"packed": {"sum": (["a", "b"], [1.0, 2.0])}, "states": {}, "counters": {"values_recorded": 2}}
    >>> loads(dumps(snap)) == snap
    True

``{"packed": {reduction: (keys, rows)}, "states": {key: state}, "raw": [...] | None,
"counters": {...}, "wall_time": t}``, pickled by the fetcher (:func:`dumps`) so that the
controller's inbox thread only moves bytes; the pipeline thread decodes it (:func:`loads`).
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = ["dumps", "loads", "has_values"]


def dumps(snapshot: dict[str, Any]) -> bytes:
    """Pickle a snapshot: the standard pickler (fastest) for plain data, cloudpickle (what Monarch
    uses, and what :meth:`~forge_obs.collector.MetricCollector.export` checked every state with)
    for what only it can pickle, e.g. a SAMPLE row holding a lambda."""
    try:
        return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        import cloudpickle

        return cloudpickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)


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
