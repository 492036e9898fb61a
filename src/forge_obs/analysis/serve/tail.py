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
(so a reader can seek back to it). A file that was replaced (another file at the path, or its
first bytes rewritten) or truncated is read again from its start, and :meth:`Tail.replaced`
says so once, so that whatever was built from the old file can be dropped first. Malformed lines are skipped and counted (``malformed``). At most ``max_bytes``
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


#: bytes at the start of the file compared at each read: a file rewritten in place differs there
HEAD_BYTES = 4096


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
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read so far
        self._head = b""  # its first bytes already consumed (up to HEAD_BYTES)
        self._replaced = False

    def replaced(self) -> bool:
        """Whether the file was replaced or truncated since the last call (checked now); the next
        :meth:`read` starts from its beginning."""
        try:
            with self.opener(self.path) as f:
                self._check(f)
        except OSError:
            pass
        out, self._replaced = self._replaced, False
        return out

    def _check(self, f: BinaryIO) -> int:
        """The size of the open file ``f``, after starting again from 0 when it is not the file
        read so far (another inode, shorter than what was read, or other first bytes)."""
        st = os.fstat(f.fileno())
        ident = (st.st_dev, st.st_ino)
        same = self._identity is None or (ident == self._identity and st.st_size >= self.offset)
        if same and self._head:
            f.seek(0)
            same = f.read(len(self._head)) == self._head
        if not same:
            self.offset, self._head = 0, b""
            self.resets += 1
            self._replaced = True
        self._identity = ident
        return st.st_size

    def read(self) -> Iterator[tuple[int, Any]]:
        """(offset, value) of each complete line written since the last call."""
        try:
            f = self.opener(self.path)
        except OSError:
            return
        with f:
            size = self._check(f)
            self.size = size
            if size == self.offset:
                return
            f.seek(self.offset)
            data = f.read(min(size - self.offset, self.max_bytes))
        if len(self._head) < HEAD_BYTES and self.offset < HEAD_BYTES:
            self._head = self._head[: self.offset] + data[: HEAD_BYTES - self.offset]
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
