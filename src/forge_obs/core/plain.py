"""Structured values (SAMPLE rows) as every backend can write them: trees of dicts with ``str``
keys, lists and tuples, with no credential in them; anything else is a leaf, kept as it is.

    >>> from forge_obs.core.plain import plain
    >>> plain({("a", "b"): 1, 2: [{None: 3}]})
    {"('a', 'b')": 1, '2': [{'None': 3}]}
    >>> plain({"prompt": "1+1", "api_key": "abc", "n": 10**5000})["api_key"]
    '***'
    >>> row = {"prompt": "1+1"}; row["self"] = row
    >>> plain(row)
    Traceback (most recent call last):
    ...
    forge_obs.core.plain.BadRow: it contains itself

No Monarch, no torch: ``record_metric`` applies :func:`plain` to every SAMPLE row it records,
so no backend, file, page or server downstream of it holds what it masks.
"""

from __future__ import annotations

import sys
from decimal import Decimal
from typing import Any

from forge_obs.core.redact import MASK, is_secret_field, redact_items, redact_key, redact_string
from forge_obs.core.safe import safe_repr, safe_str
from forge_obs.core.warn import WARNER

__all__ = ["BadRow", "JSON_INT_DIGITS", "EXACT_DECIMAL_DIGITS", "plain"]

_SCALARS = frozenset({float, bool, type(None)})
#: the most digits an int may have for JSON readers to take it as a number (Python's default
#: ``sys.get_int_max_str_digits()``, whatever this process set: the readers run elsewhere)
JSON_INT_DIGITS = sys.int_info.default_max_str_digits
#: a longer int is written as its exact decimal digits up to this many digits (their cost grows
#: with the square of their number), as its exact hexadecimal digits (``0x…``) beyond
EXACT_DECIMAL_DIGITS = 20_000
_LONG_BITS = int(JSON_INT_DIGITS * 3.32)  # fewer bits: fewer than JSON_INT_DIGITS digits


class BadRow(ValueError):
    """A value no backend can write as a tree (the reason is the message)."""


def plain(value: Any, key: Any = None) -> Any:
    """``value`` with every dict key a ``str`` (another key is converted with ``str()``) and
    redacted by :mod:`forge_obs.core.redact`'s rules (the value of a secret-looking field, a JSON
    string holding one, credential-looking text and dict keys, the argument of a secret flag
    masked), and an int longer than JSON readers take (:data:`JSON_INT_DIGITS`) as a string of
    its exact digits (warned about, naming ``key``); ``value`` itself when nothing changes (not
    copied). Raises :class:`BadRow` for a value that contains itself, nests deeper than Python
    can follow, or whose keys collide once converted (``{1: ..., "1": ...}``)."""
    try:
        return _plain(value, set(), key)
    except RecursionError:
        raise BadRow("it nests too deep") from None


def _plain(x: Any, path: set, key: Any) -> Any:
    """``path``: the ids of the containers ``x`` is inside of (a shared, non-cyclic value is fine)."""
    t = type(x)
    if t is str:
        return redact_string(x)
    if t is int:
        return x if x.bit_length() < _LONG_BITS else _long_int(x, key)
    if t in _SCALARS:
        return x
    if isinstance(x, str):  # numpy's str_, a user's str subclass: backends write it as a str
        return redact_string(str.__str__(x))
    if isinstance(x, dict):
        return _with_path(x, path, key, _plain_dict)
    if isinstance(x, (list, tuple)):
        return _with_path(x, path, key, _plain_seq)
    return x


def _long_int(x: int, key: Any) -> Any:
    """``x`` itself if JSON readers take it, else its exact digits as a string (warned)."""
    text = str(Decimal(x)) if x.bit_length() < EXACT_DECIMAL_DIGITS * 3.33 else ""
    digits = len(text) - (x < 0)
    if 0 < digits <= JSON_INT_DIGITS:
        return x
    if 0 < digits <= EXACT_DECIMAL_DIGITS:
        form = (f"{digits} digits, more than JSON readers take ({JSON_INT_DIGITS}): written as a string of its "
                "exact decimal digits")
    else:
        text = hex(x)
        form = (f"more than {EXACT_DECIMAL_DIGITS} digits: written as a string of its exact hexadecimal digits "
                "(int(s, 0) reads it back)")
    where = f"record_metric({safe_repr(key)})" if key is not None else "a value"
    WARNER.warn("long_int", safe_str(key), f"{where}: a row holds an int of {form}; the row's other fields are "
                "kept as they are")
    return text


def _with_path(x: Any, path: set, key: Any, fn: Any) -> Any:
    i = id(x)
    if i in path:
        raise BadRow("it contains itself")
    path.add(i)
    try:
        return fn(x, path, key)
    finally:
        path.discard(i)


def _plain_dict(d: dict, path: set, key: Any) -> dict:
    out = None  # a copy, made at the first key or value that changes
    for n, (k, v) in enumerate(d.items()):
        pk = redact_key(k if type(k) is str else safe_str(k), d if out is None else out)
        pv = MASK if is_secret_field(pk, v) else _plain(v, path, key)
        if out is None:
            if pk is k and pv is v:
                continue
            out = dict(list(d.items())[:n])
        if pk in out:
            raise BadRow(f"its keys collide once converted to str ({pk!r})")
        out[pk] = pv
    return d if out is None else out


def _plain_seq(s: Any, path: set, key: Any) -> Any:
    items = redact_items(s, lambda v: _plain(v, path, key))
    if all(a is b for a, b in zip(items, s)):
        return s
    return items if isinstance(s, list) else tuple(items)
