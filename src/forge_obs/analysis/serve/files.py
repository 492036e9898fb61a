"""The files ``forge-obs serve`` reads, confined to the served root: a symbolic link that leaves it
is treated as absent.

    >>> import os, tempfile, pathlib
    >>> base = pathlib.Path(tempfile.mkdtemp())
    >>> (base / "root" / "run").mkdir(parents=True)
    >>> _ = (base / "secret").write_text("SECRET")
    >>> os.symlink(base / "secret", base / "root" / "run" / "metrics.jsonl")
    >>> root = Confined(base / "root")
    >>> root.inside(base / "root" / "run" / "metrics.jsonl"), root.escapes(base / "root" / "run")
    (False, 'metrics.jsonl')
    >>> root.open(base / "root" / "run" / "metrics.jsonl")
    Traceback (most recent call last):
    ...
    forge_obs.analysis.serve.files.OutsideRoot: metrics.jsonl links outside the served root

:meth:`Confined.open` resolves the path, refuses it when the result is not under the root, and
opens the resolved path one component at a time from the root with ``O_NOFOLLOW``: a link
swapped in between the check and the open makes the open fail, it is never followed. A link
that stays inside the root (one run's file pointing at another's) is followed.

What reads a run directory by itself (the doctor in a child process, the critical path, the
Perfetto export) is run only when :meth:`Confined.escapes` finds no link out of the root in
the run directory, and its answer is dropped when one appeared while it ran.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["Confined", "OutsideRoot"]


def _below(rel: str) -> str | None:
    """``rel`` (relative to the root) when it does not lead out of it."""
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        return None
    return rel


class OutsideRoot(OSError):
    """A path whose real location is not under the served root (an ``OSError``: callers that
    treat a missing file as absent treat this one alike)."""


class Confined:
    def __init__(self, root: "str | Path") -> None:
        self.root = os.path.realpath(root)

    def _relative(self, path: "str | Path") -> str | None:
        """``path``'s real location relative to the root, or None when it is not under it. A
        path under the root with no link among its components below the root is its own real
        location (only those components are looked at); otherwise it is resolved."""
        if os.pardir not in Path(path).parts:  # ".." lexically undone would skip the link before it
            rel = _below(os.path.relpath(os.path.abspath(path), self.root))
            if rel is not None and not self._has_link(rel):
                return rel
        return _below(os.path.relpath(os.path.realpath(path), self.root))

    def _has_link(self, rel: str) -> bool:
        cur = self.root
        for part in rel.split(os.sep):
            if part in ("", os.curdir):
                continue
            cur = os.path.join(cur, part)
            try:
                if stat.S_ISLNK(os.lstat(cur).st_mode):
                    return True
            except OSError:
                return False  # absent from here on: nothing below to follow
        return False

    def inside(self, path: "str | Path") -> bool:
        return self._relative(path) is not None

    def _refuse(self, path: "str | Path") -> OutsideRoot:
        return OutsideRoot(f"{Path(path).name} links outside the served root")

    def open(self, path: "str | Path") -> BinaryIO:
        """``path`` opened for reading in binary, when its real location is under the root."""
        rel = self._relative(path)
        if rel is None:
            raise self._refuse(path)
        parts = [p for p in rel.split(os.sep) if p not in ("", os.curdir)]
        if not parts:
            raise IsADirectoryError(str(path))
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
            ffd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        return os.fdopen(ffd, "rb")

    def stat(self, path: "str | Path") -> os.stat_result:
        """``os.stat(path)`` when its real location is under the root."""
        if not self.inside(path):
            raise self._refuse(path)
        return os.stat(path)

    def exists(self, path: "str | Path") -> bool:
        try:
            self.stat(path)
        except OSError:
            return False
        return True

    def read_bytes(self, path: "str | Path") -> bytes:
        with self.open(path) as f:
            return f.read()

    def listdir(self, path: "str | Path") -> list[Path]:
        """The entries of the directory ``path`` (none when it leaves the root), sorted by name."""
        if not self.inside(path):
            return []
        try:
            return sorted(Path(path) / n for n in os.listdir(path))
        except OSError:
            return []

    def escapes(self, run_dir: "str | Path", max_entries: int = 100_000) -> str | None:
        """The first entry of ``run_dir`` (its subdirectories included) that is a link out of
        the root, as a path relative to ``run_dir``; None when there is none."""
        run_dir = Path(run_dir)
        if not self.inside(run_dir):
            return "."
        todo, seen, walked = [run_dir], 0, set()
        while todo:
            d = todo.pop()
            real = os.path.realpath(d)
            if real in walked:  # a link to a directory already walked (or a loop)
                continue
            walked.add(real)
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                seen += 1
                if seen > max_entries:
                    return os.path.relpath(e.path, run_dir)  # too many to vouch for
                if e.is_symlink() and not self.inside(e.path):
                    return os.path.relpath(e.path, run_dir)
                if e.is_dir():  # a link to a directory inside the root: what it holds counts too
                    todo.append(Path(e.path))
        return None
