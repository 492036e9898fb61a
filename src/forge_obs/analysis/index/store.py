"""The index's files: immutable Parquet segments, a manifest naming them, and two locks.

    <run_dir>/index/
      manifest.json          what is indexed: per source file its byte offset and the reader's
                             state there, per table its segments; replaced atomically
      <table>-<gen>-<n>.parquet   a segment: rows of one table (never changed once written)
      write.lock             held (exclusive) by the one process that updates the index
      read.lock              held (shared) by readers while they query; a segment dropped by
                             an update is deleted only when no reader holds it

A reader takes ``read.lock`` shared, reads the manifest, and queries the segments it names:
an update running meanwhile writes new segments and a new manifest beside them, and leaves
the segments it dropped (compacted, replaced) in the manifest's ``garbage`` list until it can
take ``read.lock`` exclusively (without waiting). So a query never sees a half-written
segment or a deleted one, and two updaters never interleave.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["INDEX_DIR", "FORMAT", "Manifest", "index_dir", "writable", "read_lock", "write_lock",
           "write_segment", "write_arrow", "read_segment", "collect_garbage"]

#: the index's directory inside a run directory
INDEX_DIR = "index"
#: the manifest's format; an index of another format is rebuilt
FORMAT = 4


def index_dir(run_dir: Path) -> Path:
    return Path(run_dir) / INDEX_DIR


def writable(run_dir: Path) -> bool:
    """Whether the index of ``run_dir`` can be written (the run directory or its index is writable)."""
    d = index_dir(run_dir)
    if d.is_dir():
        return os.access(d, os.W_OK)
    return os.access(run_dir, os.W_OK)


class Manifest:
    """What the index holds: ``state`` (the reader's, per source file), ``tables`` (table ->
    [segment entries]), ``gen`` (how many updates wrote it), ``garbage`` (segments to delete)."""

    def __init__(self, data: dict | None = None) -> None:
        data = data or {}
        self.gen: int = data.get("gen", 0)
        self.state: dict = data.get("state", {})
        self.tables: dict[str, list] = data.get("tables", {})
        self.garbage: list = data.get("garbage", [])

    @classmethod
    def load(cls, d: Path) -> "Manifest | None":
        try:
            data = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(data) if isinstance(data, dict) and data.get("format") == FORMAT else None

    def save(self, d: Path) -> None:
        tmp = d / f".manifest.{os.getpid()}.tmp"
        data = {"format": FORMAT, "gen": self.gen, "state": self.state, "tables": self.tables, "garbage": self.garbage}
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, d / "manifest.json")

    def segments(self, table: str) -> list[dict]:
        return self.tables.setdefault(table, [])

    def files(self, d: Path, table: str) -> list[str]:
        return [str(d / s["file"]) for s in self.tables.get(table, ())]


@contextmanager
def _flock(path: Path, mode: int, wait: bool = True) -> Iterator[bool]:
    """``flock`` of ``path`` (created if missing and possible); yields whether it is held. A
    lock file that cannot be opened (a read-only run directory) holds nothing: nobody can write
    there either."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield False
            return
    try:
        try:
            fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def read_lock(d: Path) -> Any:
    """Held (shared) while the segments a manifest names are queried."""
    return _flock(d / "read.lock", fcntl.LOCK_SH)


def write_lock(d: Path, wait: bool = True) -> Any:
    """Held (exclusive) while the index is updated."""
    return _flock(d / "write.lock", fcntl.LOCK_EX, wait)


#: a segment of fewer rows is written without compression or dictionaries (a live update's few
#: rows: half the CPU; such segments are merged, compressed, soon)
SMALL_SEGMENT_ROWS = 4096


def write_segment(d: Path, table: str, gen: int, n: Any, columns: dict, schema: Any) -> dict:
    """Write one segment (a ``.tmp`` renamed into place); its manifest entry."""
    import pyarrow as pa

    return write_arrow(d, f"{table}-{gen}-{n}.parquet", pa.Table.from_pydict(columns, schema=schema))


def write_arrow(d: Path, name: str, t: Any) -> dict:
    """Write Arrow table ``t`` as segment ``name``; its manifest entry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # no min/max for floating columns: Arrow leaves NaN out of them, and DuckDB then takes
    # isnan() to be false everywhere in the row group
    stats = [f.name for f in t.schema if not pa.types.is_floating(f.type)]
    small = t.num_rows < SMALL_SEGMENT_ROWS  # a live update's: written plainly, compressed when merged
    tmp = d / f".{name}.tmp"
    if small:  # encoded in memory, written at once
        buf = pa.BufferOutputStream()
        pq.write_table(t, buf, compression="none", use_dictionary=False, write_statistics=stats)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(buf.getvalue())
            while data:
                data = data[os.write(fd, data):]
            st = os.fstat(fd)
        finally:
            os.close(fd)
    else:
        with open(tmp, "wb") as f:
            pq.write_table(t, f, compression="zstd", row_group_size=256 * 1024, write_statistics=stats)
        st = os.stat(tmp)
    os.replace(tmp, d / name)
    _remember(d / name, t, st)
    return {"file": name, "rows": t.num_rows}


#: the segments of fewer rows than this that this process wrote are kept in memory (up to
#: KEPT_ROWS rows in all, the latest): a merge of small segments (the live indexer's) reads them there
KEEP_ROWS = 32_768
KEPT_ROWS = 250_000
_kept: "OrderedDict[str, tuple]" = OrderedDict()  # path -> (Arrow table, (inode, size, mtime))
_kept_rows = [0]


def _remember(path: Path, t: Any, st: os.stat_result) -> None:
    if t.num_rows >= KEEP_ROWS:
        return
    _forget(str(path))
    _kept[str(path)] = (t, (st.st_ino, st.st_size, st.st_mtime_ns))
    _kept_rows[0] += t.num_rows
    while _kept_rows[0] > KEPT_ROWS:
        _forget(next(iter(_kept)))


def _forget(path: str) -> "tuple | None":
    got = _kept.pop(path, None)
    if got is not None:
        _kept_rows[0] -= got[0].num_rows
    return got


def read_segment(d: Path, name: str, schema: Any) -> Any:
    """Segment ``name`` as an Arrow table of ``schema`` (the copy this process kept when it wrote
    it and the file is still that one; else read); it is not kept any longer (it is being merged)."""
    import pyarrow.parquet as pq

    path = d / name
    got = _forget(str(path))
    if got is not None:
        st = os.stat(path)
        if got[1] == (st.st_ino, st.st_size, st.st_mtime_ns) and got[0].schema.equals(schema):
            return got[0]
    return pq.ParquetFile(path).read().cast(schema)


def collect_garbage(d: Path, man: Manifest) -> None:
    """Delete the segments ``man`` dropped, when no reader holds ``read.lock`` (else later)."""
    if not man.garbage:
        return
    with _flock(d / "read.lock", fcntl.LOCK_EX, wait=False) as held:
        if not held:
            return
        for name in man.garbage:
            _forget(str(d / name))
            try:
                (d / name).unlink()
            except FileNotFoundError:
                pass
        man.garbage = []
