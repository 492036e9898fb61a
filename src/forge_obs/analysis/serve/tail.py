"""Read a growing JSONL file incrementally: only the bytes written since the last read.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> _ = p.write_text('{"step": 0}\\n{"step": 1')
    >>> t = Tail(p)
    >>> [(off, row["step"]) for off, row in t.read()]     # the torn last line waits
    [(0, 0)]
    >>> with open(p, "a") as f:
    ...     _ = f.write('}\\n')
    >>> [(off, row["step"]) for off, row in t.read()]
    [(12, 1)]

A line is yielded once, when its line end has been written, with the byte offset it starts at
(so a reader can seek back to it). A file that shrank (replaced or truncated) is read again
from its start. Malformed lines are skipped and counted (``malformed``). At most ``max_bytes``
are read per call, so a first read of a large file is spread over calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

__all__ = ["Tail"]

_decode = json.JSONDecoder().raw_decode


def _open_binary(path: Path) -> BinaryIO:
    return open(path, "rb")


class Tail:
    def __init__(self, path: Path, max_bytes: int = 2 << 20, opener: Callable[[Path], BinaryIO] = _open_binary) -> None:
        self.path = path
        self.opener = opener
        self.offset = 0  # bytes consumed: the start of the first line not yet yielded
        self.max_bytes = max_bytes
        self.malformed = 0
        self.size = 0
        self.resets = 0
        self._more = False

    def read(self) -> Iterator[tuple[int, Any]]:
        """(offset, value) of each complete line written since the last call."""
        try:
            f = self.opener(self.path)
        except OSError:
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset:  # truncated or replaced: start again
                self.offset = 0
                self.resets += 1
            self.size = size
            if size == self.offset:
                return
            f.seek(self.offset)
            data = f.read(min(size - self.offset, self.max_bytes))
        self._more = len(data) >= self.max_bytes  # a full chunk: more may follow
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) >= self.max_bytes:  # one line longer than a read: skipped
                self.offset += len(data)
                self.malformed += 1
            return
        base = self.offset
        self.offset = base + end + 1
        pos = 0
        for line in data[: end + 1].split(b"\n")[:-1]:
            off = base + pos
            pos += len(line) + 1
            if not line.strip():
                continue
            try:
                s = line.decode("utf-8")
                value, n = _decode(s)
                if s[n:].strip():
                    raise ValueError("extra data")
            except (ValueError, RecursionError):
                try:
                    value = json.loads(line)
                except (ValueError, RecursionError):
                    self.malformed += 1
                    continue
            yield off, value

    def file_size(self) -> int:
        """The file's size now (0 when it does not exist or its opener refuses it)."""
        try:
            with self.opener(self.path) as f:
                return os.fstat(f.fileno()).st_size
        except OSError:
            return 0

    @property
    def behind(self) -> bool:
        """Whether the last call stopped at ``max_bytes`` with more written (a large file's first
        read): call again."""
        return self._more and self.size > self.offset
