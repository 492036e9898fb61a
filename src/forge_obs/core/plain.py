"""Structured values (SAMPLE rows) as every backend can write them: trees of dicts with ``str``
keys, lists and tuples; anything else is a leaf, kept as it is.

    >>> from forge_obs.core.plain import plain
    >>> plain({("a", "b"): 1, 2: [{None: 3}]})
    {"('a', 'b')": 1, '2': [{'None': 3}]}
    >>> row = {"prompt": "1+1"}; row["self"] = row
    >>> plain(row)
    Traceback (most recent call last):
    ...
    forge_obs.core.plain.BadRow: it contains itself

No Monarch, no torch: ``record_metric`` applies :func:`plain` to every SAMPLE row it records.
"""

from __future__ import annotations

from typing import Any

from forge_obs.core.safe import safe_str

__all__ = ["BadRow", "plain"]

_SCALARS = frozenset({str, int, float, bool, type(None)})


class BadRow(ValueError):
    """A value no backend can write as a tree (the reason is the message)."""


def plain(value: Any) -> Any:
    """``value`` with every dict key a ``str`` (another key is converted with ``str()``), or
    ``value`` itself when it already is one (not copied). Raises :class:`BadRow` for a value
    that contains itself, nests deeper than Python can follow, or whose keys collide once
    converted (``{1: ..., "1": ...}``)."""
    try:
        return _plain(value, set())
    except RecursionError:
        raise BadRow("it nests too deep") from None


def _plain(x: Any, path: set) -> Any:
    """``path``: the ids of the containers ``x`` is inside of (a shared, non-cyclic value is fine)."""
    if type(x) in _SCALARS:
        return x
    if isinstance(x, dict):
        return _with_path(x, path, _plain_dict)
    if isinstance(x, (list, tuple)):
        return _with_path(x, path, _plain_seq)
    return x


def _with_path(x: Any, path: set, fn: Any) -> Any:
    i = id(x)
    if i in path:
        raise BadRow("it contains itself")
    path.add(i)
    try:
        return fn(x, path)
    finally:
        path.discard(i)


def _plain_dict(d: dict, path: set) -> dict:
    out = None  # a copy, made at the first key or value that changes
    for n, (k, v) in enumerate(d.items()):
        pk = k if type(k) is str else safe_str(k)
        pv = _plain(v, path)
        if out is None:
            if pk is k and pv is v:
                continue
            out = dict(list(d.items())[:n])
        if pk in out:
            raise BadRow(f"its keys collide once converted to str ({pk!r})")
        out[pk] = pv
    return d if out is None else out


def _plain_seq(s: Any, path: set) -> Any:
    items = [_plain(v, path) for v in s]
    if all(a is b for a, b in zip(items, s)):
        return s
    return items if isinstance(s, list) else tuple(items)
