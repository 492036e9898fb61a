"""The one JSONL line reader of the analysis side: each complete line parsed, a torn last line
skipped silently, every other bad line reported.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.jsonl"
    >>> _ = p.write_text('{"a": 1}\\nnot json\\n[2, 3]\\n{"torn": ')
    >>> bad = []
    >>> list(json_lines(p, lambda line, why: bad.append((line, why))))
    [(1, {'a': 1}), (3, [2, 3])]
    >>> bad
    [(2, 'not valid JSON (or not UTF-8)')]

A writer that dies mid-line leaves a last line without its newline: that line is not an error.
Blank lines are skipped. A line holding a value followed by anything but whitespace is malformed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

_raw_decode = json.JSONDecoder().raw_decode

NOT_JSON = "not valid JSON (or not UTF-8)"


def json_lines(path: "str | Path", on_malformed: Callable[[int, str], None]) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, value)`` for each line of ``path`` that holds one JSON value. A complete line that is not valid UTF-8 /
    JSON calls ``on_malformed(line_number, NOT_JSON)`` (1-based) and is skipped; a torn last line
    is skipped silently. Reading is streamed: the first values come out before the file is read."""
    raw = _raw_decode
    with open(path, "rb") as f:
        for i, b in enumerate(f, 1):
            try:
                s = b.decode("utf-8")
                value, end = raw(s)  # the common case, without json.loads' whitespace scans
                if end != len(s) and not s[end:].isspace():
                    raise ValueError("extra data after the value")
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                value = _slow_parse(b)
                if value is _BAD:
                    if b.endswith(b"\n") and b.strip():
                        on_malformed(i, NOT_JSON)
                    continue  # else: blank, or a torn last line
            yield i, value


_BAD = object()


def _slow_parse(b: bytes) -> Any:
    """``json.loads`` of a line the fast path refused (leading whitespace is valid JSON)."""
    try:
        return json.loads(b.decode("utf-8")) if b.strip() else _BAD
    except (ValueError, RecursionError):
        return _BAD
