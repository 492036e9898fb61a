"""A stretch of ``metrics.jsonl`` read back exactly: a zoomed chart's finer redraw and the CSV export.

    >>> import io, json
    >>> rows = [{"step": s, "mode": m, "metrics": {"loss": s + (0.5 if m != "global_reduce" else 0), "gen/len": {"p50": s}}}
    ...         for s in range(3) for m in ("global_reduce", "per_rank_reduce")]
    >>> data = b"".join(json.dumps(r).encode() + b"\\n" for r in rows)
    >>> [(r["step"], value_of(r["metrics"], "gen/len/p50"))
    ...  for r in read_rows(lambda: io.BytesIO(data), 0, len(data) - 1, ["gen/len/p50"], "global_reduce")]
    [(0, 0.0), (1, 1.0), (2, 2.0)]

The server knows where each step's rows lie in the file (the byte offset of its first and of its
last row), so a range of steps is one seek and one read of the bytes between, never the whole
run. A line is decoded only when it holds one of the wanted keys' names (as JSON writes them), so
the per-rank rows of a global chart, or a wide global row of a per-rank chart, cost no decoding;
with a ``memo`` (line offset -> decoded row), the charts of one zoomed range share the decoding
of the rows they all hold (the wide global rows).
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO, Callable, Iterator

from forge_obs.analysis.report.data import flatten
from forge_obs.analysis.store import metric_row_problem

__all__ = ["Memo", "read_rows", "value_of", "CHUNK_BYTES"]

#: bytes read at a time (a CSV export of a whole run streams through this much memory)
CHUNK_BYTES = 4 << 20


def _names(keys: list[str]) -> list[bytes]:
    """The byte strings one of which a line holding one of ``keys`` must contain: each key, or a
    dict above it that it is flattened from (``"gen/len"`` for ``gen/len/p50``), as JSON writes
    the name (ASCII-escaped or not)."""
    out: set[bytes] = set()
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts) + 1):
            for ascii_only in (True, False):
                out.add(json.dumps("/".join(parts[:i]), ensure_ascii=ascii_only).encode("utf-8"))
    return sorted(out)


class Memo:
    """Rows already decoded, by the offset of their line, up to ``max_bytes`` of lines."""

    def __init__(self, max_bytes: int) -> None:
        self.rows: dict[int, Any] = {}
        self.left = max_bytes


def read_rows(open_file: Callable[[], BinaryIO], start: int, last: int, keys: list[str],
              mode: str, memo: Memo | None = None) -> Iterator[dict[str, Any]]:
    """The well-formed rows of ``mode`` whose lines start at byte ``start`` up to the line that
    starts at byte ``last`` (included), in file order, that may hold one of ``keys``."""
    names = _names(keys)
    with open_file() as f:
        f.seek(start)
        pos, carry = start, b""
        while pos <= last:
            data = f.read(min(CHUNK_BYTES, last + 1 - pos))
            if not data:
                break
            base = pos - len(carry)
            pos += len(data)
            lines = (carry + data).split(b"\n")
            carry = lines.pop()
            yield from _decode(base, lines, names, mode, memo)
        base = pos - len(carry)
        carry += f.readline()  # the rest of the line that starts at ``last``
        yield from _decode(base, [carry], names, mode, memo)


def _decode(base: int, lines: list[bytes], names: list[bytes], mode: str, memo: Memo | None) -> Iterator[dict[str, Any]]:
    """The rows of ``lines`` (the first at byte ``base``) that hold one of ``names``."""
    off = base
    for line in lines:
        at, off = off, off + len(line) + 1
        if not any(n in line for n in names):
            continue
        row = memo.rows.get(at, _NOT) if memo is not None else _NOT
        if row is _NOT:
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if memo is not None and memo.left >= len(line):
                memo.rows[at] = row
                memo.left -= len(line)
        if isinstance(row, dict) and row.get("mode", "global_reduce") == mode and metric_row_problem(row) is None:
            yield row


_NOT = object()


def value_of(metrics: dict[str, Any], key: str) -> float | None:
    """The number ``key`` names in a row's ``metrics``: the key itself, or a value flattened from
    a dict above it (``gen/len/p50`` from ``gen/len``'s distribution); None when it has none."""
    v = metrics.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    parts = key.split("/")
    for i in range(len(parts) - 1, 0, -1):
        base = "/".join(parts[:i])
        if isinstance(metrics.get(base), dict):
            flat: dict[str, float] = {}
            flatten(base, metrics[base], flat)
            return flat.get(key)
    return None
