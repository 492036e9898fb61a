"""The one JSONL line reader of the analysis side: each complete line parsed, a torn last line
skipped silently, every other bad line reported.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.jsonl"
    >>> _ = p.write_text('{"a": 1}\\nnot json\\n[2, 3]\\n7\\n{"torn": ')
    >>> bad = []
    >>> list(json_lines(p, lambda line, why: bad.append((line, why))))
    [{'a': 1}, [2, 3]]
    >>> bad
    [(2, 'not valid JSON (or not UTF-8)'), (4, 'a JSON int, not a JSON array or a JSON object')]

A writer that dies mid-line leaves a last line without its newline: that line is not an error.
Blank lines are skipped. A line holding a value followed by anything but whitespace is malformed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["NOT_JSON", "NOT_PARSED", "BLANK", "json_lines", "parse_line"]

_raw_decode = json.JSONDecoder().raw_decode

NOT_JSON = "not valid JSON (or not UTF-8)"
#: what :func:`parse_line` returns for a line that is not JSON, and for a blank line
NOT_PARSED, BLANK = object(), object()
_TYPE_NAMES = {dict: "a JSON object", list: "a JSON array"}


def json_lines(
    path: "str | Path",
    on_malformed: Callable[[int, str], None],
    types: tuple[type, ...] = (list, dict),
    check: Callable[[Any], "str | None"] | None = None,
) -> Iterator[Any]:
    """Yield the JSON value of each line of ``path`` that is one of ``types`` and that ``check``
    (which returns why a value is not well-formed, None when it is) accepts. Every other complete
    line calls ``on_malformed(line_number, why)`` (1-based) and is skipped; a torn last line is
    skipped silently. Streamed: the first values come out before the file is read."""
    with open(path, "rb") as f:
        for i, b in enumerate(f, 1):
            value = parse_line(b)
            if value is NOT_PARSED or value is BLANK:
                if value is NOT_PARSED and b.endswith(b"\n"):
                    on_malformed(i, NOT_JSON)
                continue  # else: blank, or a torn last line
            if not isinstance(value, types):
                on_malformed(i, f"a JSON {type(value).__name__}, not {' or '.join(_TYPE_NAMES.get(t, t.__name__) for t in types)}")
                continue
            if check is not None:
                why = check(value)
                if why is not None:
                    on_malformed(i, why)
                    continue
            yield value


def parse_line(b: bytes) -> Any:
    """The JSON value of one line (bytes, with or without its newline); :data:`NOT_PARSED` when
    it is not valid UTF-8 / JSON (or holds more than one value), :data:`BLANK` when it is blank."""
    try:
        s = b.decode("utf-8")
        value, end = _raw_decode(s)  # the common case, without json.loads' whitespace scans
        n = len(s)
        if end != n and not (end == n - 1 and s[end] == "\n") and s[end:].strip():
            raise ValueError("extra data after the value")
        return value
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        value = _slow_parse(b)
        return (BLANK if not b.strip() else NOT_PARSED) if value is _BAD else value


_BAD = object()


def _slow_parse(b: bytes) -> Any:
    """``json.loads`` of a line the fast path refused (leading whitespace is valid JSON)."""
    try:
        return json.loads(b.decode("utf-8")) if b.strip() else _BAD
    except (ValueError, RecursionError):
        return _BAD
