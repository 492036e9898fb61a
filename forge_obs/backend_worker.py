"""One backend on a thread of its own, fed through a bounded queue of steps.

    >>> import time
    >>> from forge_obs.backend_worker import BackendWorker
    >>> from forge_obs.backends.base import LoggerBackend
    >>> class Keep(LoggerBackend):
    ...     def log_step(self, record): self.last = record
    >>> w = BackendWorker("keep", Keep({}), queue_steps=4)
    >>> w.start(); w.put("step 0")
    True
    >>> w.close(deadline=time.monotonic() + 5), w.backend.last
    (True, 'step 0')

A slow or hanging backend delays only itself: steps it cannot take because its queue is full are
dropped *for that backend* and counted (``dropped_steps``, reported once); ``close`` gives up at
its deadline and says so. Each backend still sees its steps in order. Errors are isolated and
counted, and reported once per backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from forge_obs.backends.base import LoggerBackend, call_hook
from forge_obs.collector import MetricCollector

logger = logging.getLogger("forge_obs")

__all__ = ["BackendWorker", "DEFAULT_QUEUE_STEPS"]

#: steps a backend may fall behind before new ones are dropped for it (and counted)
DEFAULT_QUEUE_STEPS = 256
_STOP = object()
_COLLECTOR = MetricCollector()


class BackendWorker:
    """Owns one backend's thread; every method is thread-safe."""

    def __init__(self, name: str, backend: LoggerBackend, queue_steps: int | None = DEFAULT_QUEUE_STEPS) -> None:
        self.name = name
        self.backend = backend
        #: None: unbounded (the local store, which must have every step)
        self.queue_steps = None if queue_steps is None else max(1, int(queue_steps))
        self._q: deque = deque()
        self._cv = threading.Condition()
        self.put_steps = 0  # steps accepted
        self.done_steps = 0  # steps it finished (or failed) logging
        self.dropped_steps = 0
        self.errors = 0
        self.last_s = 0.0  # duration of its last log_step
        self.finished = False  # finish() returned
        self.finish_error: str | None = None
        #: obs/cpu_<part>_s that this backend's CPU is counted in
        self.cpu_part = getattr(backend, "cpu_part", "backends")
        self._thread = threading.Thread(target=self._run, name=f"forge_obs-backend-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, record: Any) -> bool:
        """Queue a step; False (dropped for this backend, counted) when its queue is full."""
        with self._cv:
            if self.queue_steps is not None and len(self._q) >= self.queue_steps:
                self.dropped_steps += 1
                first = self.dropped_steps == 1
            else:
                self._q.append(record)
                self.put_steps += 1
                self._cv.notify_all()
                return True
        if first:
            logger.error(
                "forge_obs: backend %r is %d steps behind; new steps are dropped for it (counted in "
                "obs/backend_dropped_steps); the other backends get every step", self.name, self.queue_steps,
            )
        return False

    def wait_done(self, deadline: float) -> bool:
        """Wait until every step accepted so far was logged, at most until ``deadline``."""
        with self._cv:
            target = self.put_steps
            return self._cv.wait_for(lambda: self.done_steps >= target, max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Log what is queued, then ``finish()`` (see :meth:`join`)."""
        with self._cv:
            self._q.append(_STOP)
            self._cv.notify_all()

    def join(self, deadline: float) -> bool:
        """Wait for :meth:`stop` to complete, at most until ``deadline``. True if the backend
        finished in time (else its thread is left behind, a daemon)."""
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        return self.finished

    def close(self, deadline: float) -> bool:
        """:meth:`stop` then :meth:`join`."""
        self.stop()
        return self.join(deadline)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                item = self._q.popleft()
            if item is _STOP:
                break
            t0 = time.perf_counter()
            cpu0 = time.thread_time()
            try:
                call_hook(self.backend.log_step, item)
            except Exception as e:  # noqa: BLE001 - one backend never stops the others
                self.errors += 1
                if self.errors == 1:
                    logger.error("forge_obs: backend %r failed at step %s: %r (counted in obs/backend_errors)",
                                 self.name, getattr(item, "step", "?"), e)
            self.last_s = time.perf_counter() - t0
            _COLLECTOR.add_obs_cpu(self.cpu_part, time.thread_time() - cpu0)  # counted with a later step
            with self._cv:
                self.done_steps += 1
                self._cv.notify_all()
        try:
            call_hook(self.backend.finish)
        except Exception as e:  # noqa: BLE001
            self.finish_error = repr(e)
            logger.error("forge_obs: backend %r failed to finish: %r", self.name, e)
        self.finished = True
