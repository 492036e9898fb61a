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
``/proc/self/statm`` (resident memory), one ``fstat`` of ``/proc/self/task`` (its link count is
the number of threads + 2: the kernel counts them, it does not list them), and the run-queue wait
of the threads (the kernel's ``run_delay`` in ``/proc/self/task/<tid>/schedstat``, see
:class:`ThreadDelays`): each file is opened once and read again with ``pread`` at offset 0 (the
kernel makes its text anew). Where a file is missing (not Linux, a kernel without schedstat),
its figures are left out.
"""

from __future__ import annotations

import heapq
import os
import resource
import time
from collections import deque
from itertools import repeat
from typing import Any

__all__ = ["ProcReader", "ThreadDelays", "read_fd", "open_file", "close_fd", "thread_count"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_popleft = deque.popleft


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
    sized to the host). The thread that ran the most at its last read (a loop's thread) is read
    at every call. Another whose counters moved at its last read is *hot*: the hot threads are
    read in turn, ``max_reads - cold_reads - 1`` per call (all of them at every call while they
    are that few); the others in turn, ``cold_reads`` per call. When the process used CPU time
    that the threads read do not account for (``cpu_ns``: a thread woke up, or a hot one not in
    this turn ran), more are read in the same call, those that have run the most in their life
    first (whatever their thread ids, which wrap around, and their places in the turns), until
    the CPU time is accounted for (at most ``scan_reads``), so the thread that ran is found at
    once. A thread's wait counts from when the thread list first had it (read once then, whatever
    the bound, and read first at the next call, those that have run the most first: read again at
    once it would show no change and look idle); the sum is exact at every thread's last read (a
    dead thread's wait stays counted), so a total over several intervals is exact and one
    interval may carry a waking thread's last few. The cost is bounded by ``max_reads`` reads of
    a few µs (at most ``scan_reads`` more when the busy threads changed), whatever the number of
    threads. The thread list (a directory read, the costliest part of a sample) is read again
    when the process's number of threads differs from the threads it has (``threads`` of
    :meth:`read`; at most every ``recount_s``), and every ``refresh_s`` whatever the count (a
    thread that ended and another that began in between)."""

    def __init__(self, pid: int, max_reads: int = 4, cold_reads: int = 1, scan_reads: int = 24,
                 refresh_s: float = 10.0, recount_s: float = 0.05) -> None:
        self.pid = pid
        self.max_reads, self.cold_reads, self.scan_reads, self.refresh_s = max_reads, cold_reads, scan_reads, refresh_s
        self.recount_s = recount_s
        self.state: dict[int, list] = {}  # tid -> [fd of its schedstat, run time ns, run delay ns] at its last read
        self.top: int | None = None  # the thread that ran the most at its last read: read at every call
        self.top_ran = 0  # its run time then (ns)
        self.hot: deque = deque()  # threads whose counters moved at their last read, in turn (not top)
        self.cold: deque = deque()  # the others, in turn
        self.total_ns = 0
        self.refreshed = -1e18
        self.available = os.path.exists(f"/proc/{pid}/task/{pid}/schedstat")

    @property
    def threads(self) -> int:
        return len(self.state)

    def read(self, now: float | None = None, cpu_ns: int | None = None, threads: int | None = None) -> int | None:
        """The cumulative run-queue wait (ns) of the threads, or None where the kernel has no
        schedstat. ``cpu_ns``: the process's CPU time since the previous call; ``threads``: its
        number of threads now (None: not known)."""
        if not self.available:
            return None
        now = time.monotonic() if now is None else now
        new: list = []
        since = now - self.refreshed
        if since >= self.refresh_s or (threads is not None and threads != len(self.state) and since >= self.recount_s):
            new = self._refresh()
            self.refreshed = now
        hot, cold = self.hot, self.cold
        todo = [] if self.top is None else [self.top]
        room = self.max_reads - len(todo)
        n_hot = max(0, min(len(hot), room - min(self.cold_reads, len(cold))))
        n_cold = max(0, min(len(cold), room - n_hot))
        todo += map(_popleft, repeat(hot, n_hot))
        while n_cold:
            todo.append(cold.popleft())
            n_cold -= 1
        hot_left, cold_left = len(hot), len(cold)  # not in this turn: at the fronts (read ones go behind)
        ran = self._read_all(todo)
        if cpu_ns is not None and (hot_left or cold_left):
            missing = cpu_ns - ran - max(2_000_000, cpu_ns // 4)  # a quarter (2 ms) may stay unaccounted for
            if missing > 0:  # a thread not read ran
                self._scan(missing, hot_left, cold_left)
        cold.extendleft(reversed(new))  # read first next time: a read now would show no change
        return self.total_ns

    def _scan(self, missing_ns: int, hot_left: int, cold_left: int) -> None:
        """The threads not in this turn (the first ``hot_left`` hot and ``cold_left`` cold ones),
        those that have run the most first, read until their run time covers ``missing_ns`` (the
        process's CPU time the reads so far left unaccounted for, beyond what may stay so), at
        most ``scan_reads``; the ones not read stay at the fronts of their turns."""
        hot, cold, state = self.hot, self.cold, self.state
        rest_hot = list(map(_popleft, repeat(hot, hot_left)))
        rest_cold = list(map(_popleft, repeat(cold, cold_left)))
        done = set()
        for tid in heapq.nlargest(self.scan_reads, rest_hot + rest_cold, key=lambda t: state[t][1]):
            if missing_ns <= 0:
                break
            missing_ns -= self._read_all((tid,))
            done.add(tid)
        hot.extendleft(reversed([t for t in rest_hot if t not in done]))
        cold.extendleft(reversed([t for t in rest_cold if t not in done]))

    def _read_all(self, tids: Any) -> int:
        """Read ``tids``, each back in the hot or cold turn, or pinned as :attr:`top` when it ran
        more than the pinned one (which goes back in the hot turn); a thread that is gone is
        dropped. Returns the run time they added (ns)."""
        ran = 0
        state, hot, cold, read = self.state, self.hot, self.cold, read_fd
        for tid in tids:
            st = state.get(tid)
            if st is None:
                continue
            try:
                f = read(st[0], 128).split(None, 2)
                run_ns, delay_ns = int(f[0]), int(f[1])
            except (OSError, ValueError, IndexError):
                self._drop(tid)
                continue
            if st[1] is None:  # its first read: where it starts from (its earlier wait is not this
                st[1], st[2] = run_ns, delay_ns  # interval's); in no turn yet (the caller places it)
                continue
            d = run_ns - st[1]
            moved = d or delay_ns != st[2]
            if moved:
                ran += d
                self.total_ns += delay_ns - st[2]
                st[1], st[2] = run_ns, delay_ns
            if tid == self.top:
                self.top_ran = d
            elif d > self.top_ran:
                if self.top is not None:
                    hot.append(self.top)
                self.top, self.top_ran = tid, d
            elif moved:
                hot.append(tid)
            else:
                cold.append(tid)
        return ran

    def _refresh(self) -> list:
        """The thread list read again: gone threads dropped, new ones read once (their starting
        point); returns the new ones, those that have run the most first (the caller puts them at
        the front of the cold turn)."""
        try:
            tids = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")}
        except (OSError, ValueError):
            return []
        state = self.state
        for tid in [t for t in state if t not in tids]:
            self._drop(tid)
        new = []
        for tid in sorted(tids - state.keys()):
            fd = open_file(f"/proc/{self.pid}/task/{tid}/schedstat")
            if fd is not None:
                state[tid] = [fd, None, None]
                new.append(tid)
        self._read_all(new)  # their starting points, once: their wait from now on counts
        self.hot = deque(t for t in self.hot if t in state)
        self.cold = deque(t for t in self.cold if t in state)
        return sorted((t for t in new if t in state), key=lambda t: -state[t][1])

    def _drop(self, tid: int) -> None:
        if tid == self.top:
            self.top, self.top_ran = None, 0
        st = self.state.pop(tid, None)
        if st is not None:
            close_fd(st[0])

    def close(self) -> None:
        for tid in list(self.state):
            self._drop(tid)
        self.hot, self.cold, self.top, self.top_ran = deque(), deque(), None, 0


def thread_count(fd: int) -> int | None:
    """The threads of the process whose ``/proc/<pid>/task`` directory is open as ``fd`` (None
    where the link count does not tell: a kernel that does not count them)."""
    n = os.fstat(fd).st_nlink - 2
    return n if n >= 1 else None


class ProcReader:
    """This process's cumulative counters (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.statm = open_file("/proc/self/statm")
        self.task = open_file(f"/proc/{self.pid}/task")
        self.delays = ThreadDelays(self.pid)
        self.cpu_s: float | None = None  # at the previous read

    def read(self, now: float | None = None) -> dict[str, Any]:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = ru.ru_utime + ru.ru_stime
        out: dict[str, Any] = {"cpu_s": cpu_s, "ctx_voluntary": ru.ru_nvcsw, "ctx_involuntary": ru.ru_nivcsw}
        if self.statm is not None:
            try:
                out["rss_bytes"] = int(read_fd(self.statm, 256).split(None, 2)[1]) * _PAGE
            except (OSError, ValueError, IndexError):
                pass
        threads = None
        if self.task is not None:
            try:
                threads = thread_count(self.task)
            except OSError:
                pass
        if threads is not None:
            out["threads"] = threads
        cpu_ns = None if self.cpu_s is None else int((cpu_s - self.cpu_s) * 1e9)
        self.cpu_s = cpu_s
        runq = self.delays.read(now, cpu_ns, threads)
        if runq is not None:
            out["runq_ns"] = runq
            out.setdefault("threads", self.delays.threads)
        return out

    def close(self) -> None:
        close_fd(self.statm)
        close_fd(self.task)
        self.statm = self.task = None
        self.delays.close()
