"""A rank's snapshot on the wire: what a fetcher sends at a cut.

    >>> from forge_obs.wire.snapshot import dumps, loads
    >>> snap = {"packed": {"sum": (["a", "b"], [1.0, 2.0])}, "states": {"rows": {"reduction_type": "sample",
    ...         "rows": [{"x": 1}], "seen": 1}}, "counters": {"values_recorded": 3}}
    >>> loads(dumps(snap)) == snap
    True

``{"packed": {reduction: (keys, rows)}, "states": {key: state}, "raw": [...] | None,
"counters": {...}, "wall_time": t}``, pickled by the fetcher (:func:`dumps`) so that the
controller's inbox thread only moves bytes while a flush waits; the pipeline thread decodes it
(:func:`loads`). States that a closed cut asked for are unpickled by the inbox as they come
(:func:`opened`) when no flush waits.

The states of SAMPLE and custom reductions (which may hold any object) travel pickled one by
one (:data:`PICKLED`), and so do raw values that are not numbers (:func:`encode_raw`): a state
or value that cannot be unpickled where it arrives (an object whose class only the rank can
import) costs its key only — it is left out and reported to ``on_drop(key, "undecodable", n)`` —
and the rest of the rank's step arrives. The packed numeric rows travel as they are, and a
group's keys as one string (joined by :data:`KEY_SEP`; a group with a key that holds it travels
as a list): a rank sends the same keys step after step, and the receiver splits each string
once (:func:`decode` keeps the lists it made: every snapshot with those keys gets the same list,
which is never modified). Nothing on the wire refers to an earlier message.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

from forge_obs.core.pickling import PICKLED, pickle_value
from forge_obs.core.safe import safe_repr
from forge_obs.core.warn import WARNER

__all__ = ["dumps", "loads", "opened", "has_values", "encode", "decode", "encode_raw", "decode_raw", "pickle_value",
           "plain_counters", "PICKLED", "OnDrop", "KEY_SEP"]

#: a snapshot's field that holds the indices of the raw values pickled one by one
RAW_PICKLED = "raw_pickled"

OnDrop = Callable[[Any, str, int], None]

#: what separates a packed group's keys when they travel as one string
KEY_SEP = "\x00"
#: the key lists made from strings received (string -> list), and the strings made from key
#: lists sent (id -> (list, string): a collector exports the same list while its keys are the
#: same), at most _KEYS_MAX of each
_KEYS: dict[str, list] = {}
_JOINED: dict[int, tuple[list, str]] = {}
_KEYS_MAX = 1024


def dumps(snapshot: dict[str, Any], on_drop: OnDrop | None = None) -> bytes:
    """A snapshot as bytes, its states pickled per key (:func:`encode`), its counters as plain
    dicts (:func:`plain_counters`)."""
    return pickle_value(plain_counters(encode(snapshot, on_drop)))


def plain_counters(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` with ``counters["dropped_by_reason"]`` a plain dict (a copy where it was the
    collector's :class:`~forge_obs.recording.reduce.DropCounts`): the wire names no forge_obs
    class, and a dict subclass pickles (and unpickles) through ``copyreg``, slower than a dict."""
    counters = snapshot.get("counters")
    if type(counters) is not dict:
        return snapshot
    drops = counters.get("dropped_by_reason")
    if drops is None or type(drops) is dict:
        return snapshot
    return dict(snapshot, counters=dict(counters, dropped_by_reason=dict(drops)))


def loads(snapshot: Any, on_drop: OnDrop | None = None) -> dict[str, Any]:
    """A rank's snapshot as sent (bytes) or already in memory (a dict), decoded (:func:`decode`)."""
    if isinstance(snapshot, (bytes, bytearray, memoryview)):
        snapshot = pickle.loads(snapshot)
    return decode(snapshot, on_drop)


def opened(snapshot: Any) -> Any:
    """A snapshot as sent, unpickled once (what :func:`loads` starts with); the states pickled
    one by one stay bytes until :func:`decode`. Bytes that do not unpickle are returned as they
    came: :func:`loads` then reports them."""
    if not isinstance(snapshot, bytes):
        return snapshot
    try:
        return pickle.loads(snapshot)
    except Exception:  # noqa: BLE001 - counted where the step is assembled
        return snapshot


def encode(snapshot: dict[str, Any], on_drop: OnDrop | None = None) -> dict[str, Any]:
    """``snapshot`` with every state pickled on its own (:data:`PICKLED`; bytes already made by
    the collector's export are reused) and raw values that are not numbers too. A state or value
    that cannot be pickled is left out and reported to ``on_drop(key, "unpicklable", 1)``."""
    if snapshot.get("packed"):
        snapshot = dict(snapshot, packed=_joined_keys(snapshot["packed"]))
    states = snapshot.get("states") or {}
    raw = snapshot.get("raw")
    if not states and not snapshot.get(PICKLED):
        return snapshot
    done = snapshot.get(PICKLED) or {}
    pickled = {}
    for k, st in states.items():
        b = done.get(k)
        if b is None:
            b = _pickle_or_drop(k, st, on_drop)
            if b is None:
                continue
        pickled[k] = b
    out = dict(snapshot, states={}, **{PICKLED: pickled})
    if raw:
        out["raw"], out[RAW_PICKLED] = encode_raw(raw, on_drop, set(pickled) | set(done))
    return out


def decode(snapshot: dict[str, Any], on_drop: OnDrop | None = None) -> dict[str, Any]:
    """The inverse of :func:`encode` (a snapshot that was not encoded is returned as it is): a
    state or raw value that cannot be unpickled here is left out, reported to
    ``on_drop(key, "undecodable", 1)`` with a rate-limited warning."""
    packed = snapshot.get("packed")
    if packed:
        snapshot = dict(snapshot, packed=_split_keys(packed))
    pickled = snapshot.get(PICKLED)
    if pickled is None:
        return snapshot
    states = dict(snapshot.get("states") or {})
    for k, b in pickled.items():
        if k not in states:  # a collector's own export carries both
            st = _unpickle_or_drop(k, b, on_drop)
            if st is not _UNDECODABLE:
                states[k] = st
    out = {name: v for name, v in snapshot.items() if name not in (PICKLED, RAW_PICKLED)}
    out["states"] = states
    if snapshot.get(RAW_PICKLED):
        out["raw"] = decode_raw(snapshot["raw"], snapshot[RAW_PICKLED], on_drop)
    return out


def _joined_keys(packed: dict) -> dict:
    """``{rt: (keys, rows)}`` with each list of keys as one string where no key holds
    :data:`KEY_SEP` (a group that is not such a pair is left as it is)."""
    out = {}
    for rt, group in packed.items():
        try:
            keys, rows = group
            if type(keys) is list and keys:
                hit = _JOINED.get(id(keys))
                if hit is not None and hit[0] is keys:
                    group = (hit[1], rows)
                else:
                    joined = KEY_SEP.join(keys)  # raises for a key that is not a str
                    if joined.count(KEY_SEP) == len(keys) - 1:
                        group = (joined, rows)
                        if len(_JOINED) >= _KEYS_MAX:
                            _JOINED.clear()
                        _JOINED[id(keys)] = (keys, joined)
        except Exception:  # noqa: BLE001 - sent as it is: the receiver judges it
            pass
        out[rt] = group
    return out


def _split_keys(packed: Any) -> Any:
    """The inverse of :func:`_joined_keys`; each string split once (see the module docstring)."""
    if type(packed) is not dict:
        return packed
    out = None
    for rt, group in packed.items():
        if type(group) is tuple and len(group) == 2 and type(group[0]) is str:
            joined = group[0]
            keys = _KEYS.get(joined)
            if keys is None:
                if len(_KEYS) >= _KEYS_MAX:
                    _KEYS.clear()
                keys = _KEYS[joined] = joined.split(KEY_SEP)
            if out is None:
                out = dict(packed)
            out[rt] = (keys, group[1])
    return packed if out is None else out


def encode_raw(raw: list, on_drop: OnDrop | None = None, keys: Any = None) -> tuple[list, list[int]]:
    """Raw values ``[(key, value, ts), ...]`` with each value that is not a number (of a key in
    ``keys``, or of any key when ``keys`` is None) pickled on its own; returns ``(raw, indices
    of the pickled values)``. A value that cannot be pickled is left out (``on_drop``)."""
    out = None
    idx: list[int] = []
    for i, item in enumerate(raw):
        v = item[1]
        if type(v) is float or type(v) is int or (keys is not None and item[0] not in keys):
            if out is not None:
                out.append(item)
            continue
        if out is None:
            out = list(raw[:i])
        b = _pickle_or_drop(item[0], v, on_drop)
        if b is not None:
            idx.append(len(out))
            out.append((item[0], b, item[2]))
    return (raw if out is None else out), idx


def decode_raw(raw: list, idx: list[int], on_drop: OnDrop | None = None) -> list:
    """The inverse of :func:`encode_raw`: a value that cannot be unpickled here is left out."""
    if not idx:
        return raw
    out = list(raw)
    bad = []
    for i in idx:
        key, b, ts = out[i]
        v = _unpickle_or_drop(key, b, on_drop)
        if v is _UNDECODABLE:
            bad.append(i)
        else:
            out[i] = (key, v, ts)
    for i in reversed(bad):
        del out[i]
    return out


_UNDECODABLE = object()


def _pickle_or_drop(key: Any, x: Any, on_drop: OnDrop | None) -> "bytes | None":
    try:
        return pickle_value(x)
    except Exception as e:  # noqa: BLE001 - this key's value only
        _report(key, "unpicklable", f"cannot be pickled ({safe_repr(e)})", on_drop)
        return None


def _unpickle_or_drop(key: Any, b: bytes, on_drop: OnDrop | None) -> Any:
    try:
        return pickle.loads(b)
    except Exception as e:  # noqa: BLE001 - e.g. a class only the rank can import
        _report(key, "undecodable", f"cannot be unpickled in this process ({safe_repr(e)})", on_drop)
        return _UNDECODABLE


def _report(key: Any, reason: str, why: str, on_drop: OnDrop | None) -> None:
    text = key if type(key) is str else safe_repr(key)
    WARNER.warn(reason, text, f"{text!r}: a state or value {why}; left out of the step (counted in obs/dropped_values)")
    if on_drop is not None:
        try:
            on_drop(key, reason, 1)
        except Exception:  # noqa: BLE001 - a caller's callback never breaks a decode
            pass


def has_values(snapshot: Any) -> bool:
    """Whether a snapshot (sent or decoded) carries any value or count (one that does not, e.g.
    the final states of a mesh stopped right after a flush, can be left out)."""
    try:
        snap = pickle.loads(snapshot) if isinstance(snapshot, (bytes, bytearray, memoryview)) else snapshot
    except Exception:  # noqa: BLE001 - keep what cannot be judged; the pipeline counts it
        return True
    counters = snap.get("counters") or {}
    return bool(snap.get("states") or snap.get(PICKLED) or snap.get("packed") or snap.get("raw")
                or any(counters.values()))
