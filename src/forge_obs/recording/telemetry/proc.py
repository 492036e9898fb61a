"""This process's figures: CPU time, context switches, resident memory, threads, and the time
its threads waited for a CPU. Cumulative counters; :mod:`.sampler` turns two readings into the
figures of the interval between them.

    >>> from forge_obs.recording.telemetry.proc import ProcReader
    >>> r = ProcReader()
    >>> a = r.read()
    >>> sorted(a)
    ['cpu_s', 'ctx_involuntary', 'ctx_voluntary', 'rss_bytes', 'runq_ns', 'threads']
    >>> r.read()["cpu_s"] >= a["cpu_s"]
    True
    >>> r.close()

One ``getrusage`` (CPU time and context switches of every thread), one ``pread`` of
``/proc/self/statm`` (resident memory), and the run-queue wait of the threads (the kernel's
``run_delay`` in ``/proc/self/task/<tid>/schedstat``, see :class:`ThreadDelays`): each file is
opened once and read again with ``pread`` at offset 0 (the kernel makes its text anew). Where a
file is missing (not Linux, a kernel without schedstat), its figures are left out.
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from typing import Any

__all__ = ["ProcReader", "ThreadDelays", "read_fd", "open_file", "close_fd"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_fd(fd: int, size: int = 4096) -> bytes:
    """The file open as ``fd`` from its start (a ``/proc`` file's text, made anew)."""
    return os.pread(fd, size, 0)


def open_file(path: str) -> int | None:
    """``path`` opened for reading (None where it cannot be)."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class ThreadDelays:
    """The run-queue wait of this process's threads, summed (nanoseconds, cumulative).

    A process has a few busy threads and many idle ones (a runtime's workers, a thread pool
    sized to the host). A thread whose counters moved at its last read is *hot*: the hot threads
    are read in turn, ``max_reads - cold_reads`` per call (all of them at every call while they
    are that few); the others in turn, ``cold_reads`` per call. When the process used CPU time
    that the threads read do not account for (``cpu_ns``: a thread woke up, or a hot one not in
    this turn ran), more are read in the same call, the hot ones not in the turn first, until the
    CPU time is accounted for (at most ``scan_reads``), so the thread that ran is found at once.
    A thread's wait counts from when the thread list first had it (read once then, whatever the
    bound, and read first at the next call: read again at once it would show no change and look
    idle); the sum is exact at every thread's last read (a dead thread's wait stays counted), so
    a total over several intervals is exact and one interval may carry a waking thread's last
    few. The cost is bounded by ``max_reads`` reads of a few µs (at most ``scan_reads`` more when
    the busy threads changed), whatever the number of threads. The thread list is read again every ``refresh_s``."""

    def __init__(self, pid: int, max_reads: int = 8, cold_reads: int = 2, scan_reads: int = 24,
                 refresh_s: float = 1.0) -> None:
        self.pid = pid
        self.max_reads, self.cold_reads, self.scan_reads, self.refresh_s = max_reads, cold_reads, scan_reads, refresh_s
        self.fds: dict[int, int] = {}  # tid -> fd of its schedstat
        self.last: dict[int, tuple] = {}  # tid -> (run time ns, run delay ns) at its last read
        self.hot: deque = deque()  # threads whose counters moved at their last read, in turn
        self.cold: deque = deque()  # the others, in turn
        self.total_ns = 0
        self.refreshed = -1e18
        self.available = os.path.exists(f"/proc/{pid}/task/{pid}/schedstat")

    @property
    def threads(self) -> int:
        return len(self.fds)

    def read(self, now: float | None = None, cpu_ns: int | None = None) -> int | None:
        """The cumulative run-queue wait (ns) of the threads, or None where the kernel has no
        schedstat. ``cpu_ns``: the process's CPU time since the previous call."""
        if not self.available:
            return None
        now = time.monotonic() if now is None else now
        new: list = []
        if now - self.refreshed >= self.refresh_s:
            new = self._refresh()
            self.refreshed = now
        hot, cold = self.hot, self.cold
        n_hot = min(len(hot), self.max_reads - min(self.cold_reads, len(cold)))
        todo = [hot.popleft() for _ in range(n_hot)]
        todo += [cold.popleft() for _ in range(min(len(cold), self.max_reads - len(todo)))]
        hot_left, cold_left = len(hot), len(cold)  # not in this turn: at the fronts (read ones go behind)
        ran = self._read_all(todo)
        if cpu_ns is not None:
            floor, budget = max(2_000_000, cpu_ns // 4), self.scan_reads
            while budget and cpu_ns - ran > floor and (hot_left or cold_left):  # a thread not read ran
                if hot_left:  # the hot ones first
                    tid, hot_left = hot.popleft(), hot_left - 1
                else:
                    tid, cold_left = cold.popleft(), cold_left - 1
                ran += self._read_all([tid])
                budget -= 1
        cold.extendleft(reversed(new))  # read first next time: a read now would show no change
        return self.total_ns

    def _read_all(self, tids: list) -> int:
        """Read ``tids``, each back in the hot or cold turn; returns the run time they added (ns)."""
        ran = 0
        for tid in tids:
            before = self.last.get(tid)
            moved = self._read_one(tid)
            if tid in self.fds:
                (self.hot if moved else self.cold).append(tid)
                if before is not None:
                    ran += self.last[tid][0] - before[0]
        return ran

    def _read_one(self, tid: int) -> bool:
        """Read one thread; True when its counters moved (it is hot)."""
        fd = self.fds.get(tid)
        if fd is None:
            return False
        try:
            run_ns, delay_ns = map(int, read_fd(fd, 128).split()[:2])
        except (OSError, ValueError):
            self._drop(tid)
            return False
        prev = self.last.get(tid)
        self.last[tid] = (run_ns, delay_ns)
        if prev is None:  # its first read: where it starts from (its earlier wait is not this interval's)
            return True
        self.total_ns += delay_ns - prev[1]
        return (run_ns, delay_ns) != prev

    def _refresh(self) -> list:
        """The thread list read again: gone threads dropped, new ones read once (their starting
        point); returns the new ones, oldest first (the caller puts them in the cold turn)."""
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")}
        except (OSError, ValueError):
            return []
        for tid in list(self.fds):
            if tid not in tids:
                self._drop(tid)
        new = []
        for tid in sorted(tids - self.fds.keys()):
            fd = open_file(f"/proc/{self.pid}/task/{tid}/schedstat")
            if fd is not None:
                self.fds[tid] = fd
                self._read_one(tid)  # its starting point, once: its wait from now on counts
                if tid in self.fds:
                    new.append(tid)
        self.hot = deque(t for t in self.hot if t in self.fds)
        self.cold = deque(t for t in self.cold if t in self.fds)
        return new

    def _drop(self, tid: int) -> None:
        close_fd(self.fds.pop(tid, None))
        self.last.pop(tid, None)

    def close(self) -> None:
        for tid in list(self.fds):
            self._drop(tid)
        self.hot, self.cold = deque(), deque()


class ProcReader:
    """This process's cumulative counters (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.statm = open_file("/proc/self/statm")
        self.delays = ThreadDelays(self.pid)
        self.cpu_s: float | None = None  # at the previous read

    def read(self, now: float | None = None) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out: dict[str, Any] = {"cpu_s": ru.ru_utime + ru.ru_stime, "ctx_voluntary": ru.ru_nvcsw,
                               "ctx_involuntary": ru.ru_nivcsw}
        if self.statm is not None:
            try:
                out["rss_bytes"] = int(read_fd(self.statm, 256).split()[1]) * _PAGE
            except (OSError, ValueError, IndexError):
                pass
        cpu_ns = None if self.cpu_s is None else int((out["cpu_s"] - self.cpu_s) * 1e9)
        self.cpu_s = out["cpu_s"]
        runq = self.delays.read(now, cpu_ns)
        if runq is not None:
            out["runq_ns"] = runq
            out["threads"] = self.delays.threads
        return out

    def close(self) -> None:
        close_fd(self.statm)
        self.statm = None
        self.delays.close()
