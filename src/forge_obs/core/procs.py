"""What forge_obs's child processes (the live indexer, the critical-path reader) need of their
own: whether the process that started them still runs (they exit when it is gone), and SIGTERM /
SIGINT taken as a stop request.

    >>> import os, threading
    >>> from forge_obs.core.procs import StopSignals, parent_alive
    >>> parent_alive(os.getppid()), parent_alive(os.getpid())
    (True, False)
    >>> stop = threading.Event()
    >>> StopSignals(stop, install=False).wait(0.01), stop.set(), StopSignals(stop, install=False).wait(5.0)
    (False, None, True)

The signal handler only sets a flag: a handler runs between two bytecodes of whatever the main
thread does, and one that set a ``threading.Event`` deadlocked the process for good when a second
signal arrived while the first handler's ``set`` held the event's lock. :meth:`StopSignals.wait`
turns the flag into the stop request.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["parent_alive", "StopSignals"]

#: how soon a wait sees a signal's stop request
_SLICE_S = 0.25


def parent_alive(pid: int) -> bool:
    """Whether process ``pid``, this process's parent, still runs: it exists and is still this
    process's parent (once it died this process was re-parented, so another process given the
    same pid is not taken for it); one this process may not signal exists, so it counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


class StopSignals:
    """SIGTERM and SIGINT as a request to set ``stop``, taken by :meth:`wait` (see the module
    docstring). Installed only on the main thread (``install``): elsewhere :meth:`wait` waits on
    ``stop`` alone."""

    def __init__(self, stop: threading.Event, install: bool = True) -> None:
        self.stop = stop
        self.requested = False
        if install and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._request)

    def _request(self, *_args: object) -> None:  # takes no lock: see the module docstring
        self.requested = True

    def wait(self, timeout_s: float) -> bool:
        """Up to ``timeout_s``, until ``stop`` is set or a signal arrived (which sets it); returns
        whether ``stop`` is set."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self.stop.is_set():
            if self.requested:
                self.stop.set()
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.stop.wait(min(left, _SLICE_S))
        return self.stop.is_set()
