"""One backend on a thread of its own, fed through a bounded queue of steps.

    >>> import time
    >>> from forge_obs.controller.backend_worker import BackendWorker
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

Raw values streamed between flushes (:class:`~forge_obs.backends.base.StreamBatch`, for
``per_rank_no_reduce`` backends) go through the same queue, in arrival order with the steps; a
stream batch still waiting in the queue takes the next ones in (at most one waits between two
steps), and beyond :data:`STREAM_CAP` values waiting, new streamed values are dropped for that
backend and counted (``dropped_stream_values``). A backend that implements only ``log_step``
(none of ``log_stream_batch``, ``log_raw``, ``log_stream``) gets them in ``record.raw`` of the
next step instead (or in a record of their own at shutdown).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Any

from forge_obs.backends.base import LoggerBackend, StreamBatch, call_hook
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.types import LoggingMode

logger = logging.getLogger("forge_obs")

__all__ = ["BackendWorker", "BackendSet", "DEFAULT_QUEUE_STEPS"]

#: steps a backend may fall behind before new ones are dropped for it (and counted)
DEFAULT_QUEUE_STEPS = 256
#: streamed raw values that may wait for one backend before new ones are dropped for it (counted)
STREAM_CAP = 1_000_000
_STOP = object()


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
        self._put_items = 0  # steps and stream batches accepted ...
        self._done_items = 0  # ... and done
        self._in_hand = 0  # steps the thread took from the queue and has not logged yet
        self.dropped_steps = 0
        self.dropped_stream_values = 0
        self._stream_waiting = 0  # streamed values queued, not yet logged
        # a backend with only log_step: streamed values wait here for the next step's record
        self._raw_into_steps = _only_log_step(backend)
        #: the backend takes a batch of steps at once (it overrides log_steps)
        self._batches = type(backend).log_steps is not LoggerBackend.log_steps
        self._held: list = []  # (label, step, rows) entries
        self._held_sources: dict = {}
        self._run_id = ""
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
        return self.put_many([record]) == 1

    def put_many(self, records: list, wake: bool = True) -> int:
        """Queue steps, oldest first, with one wake-up of the thread (none: ``wake`` False, a
        later :meth:`wake` gives it); returns how many were queued (the others were dropped for
        this backend, counted: its queue was full)."""
        first = False
        queued = 0
        with self._cv:
            for record in records:
                self._run_id = getattr(record, "run_id", self._run_id)
                if self._held and getattr(record, "raw", None) is not None:
                    record = self._with_held(record)
                if self.queue_steps is not None and len(self._q) + self._in_hand >= self.queue_steps:
                    self.dropped_steps += 1
                    first = first or self.dropped_steps == 1
                else:
                    self._q.append(record)
                    self.put_steps += 1
                    self._put_items += 1
                    queued += 1
            if queued and wake:
                self._cv.notify_all()
        if first:
            logger.error(
                "forge_obs: backend %r is %d steps behind; new steps are dropped for it (counted in "
                "obs/backend_dropped_steps); the other backends get every step", self.name, self.queue_steps,
            )
        return queued

    def wake(self) -> None:
        with self._cv:
            if self._q:
                self._cv.notify_all()

    def put_stream(self, entries: list, sources: dict) -> bool:
        """Queue streamed raw values (``entries`` of ``(label, step, rows)``); False when they
        were dropped for this backend (over :data:`STREAM_CAP` waiting; counted, reported once)."""
        n = sum(len(rows) for _l, _s, rows in entries)
        with self._cv:
            if self._raw_into_steps:
                if self._stream_waiting + n > STREAM_CAP:
                    self.dropped_stream_values += n
                    return False
                self._stream_waiting += n
                self._held.extend(entries)
                self._held_sources.update(sources)
                return True
            if self._stream_waiting + n > STREAM_CAP:
                self.dropped_stream_values += n
                first = self.dropped_stream_values == n
            else:
                self._stream_waiting += n
                last = self._q[-1] if self._q else None
                if type(last) is StreamBatch:  # not taken yet: it takes these in
                    last.entries.extend(entries)
                    last.sources.update(sources)
                else:
                    self._q.append(StreamBatch(list(entries), dict(sources)))
                    self._put_items += 1
                    self._cv.notify_all()
                return True
        if first:
            logger.error("forge_obs: backend %r has %d streamed values waiting; new ones are dropped for it "
                         "(counted in obs/backend_dropped_stream_values)", self.name, STREAM_CAP)
        return False

    def wait_done(self, deadline: float) -> bool:
        """Wait until every step (and stream batch) accepted so far was logged, at most until ``deadline``."""
        with self._cv:
            target = self._put_items
            return self._cv.wait_for(lambda: self._done_items >= target, max(0.0, deadline - time.monotonic()))

    def _with_held(self, record: Any) -> Any:
        """``record`` (shared by every backend) with the held streamed values of its step or an
        earlier one in its ``raw`` (values streamed under a later step wait for that one's)."""
        step = getattr(record, "step", None)
        now = [e for e in self._held if step is None or e[1] <= step]
        if not now:
            return record
        later = [e for e in self._held if not (step is None or e[1] <= step)]
        raw = {label: list(rows) for label, rows in record.raw.items()}
        for label, _step, rows in reversed(now):
            raw.setdefault(label, [])
            raw[label][:0] = rows  # recorded before the step's own raw values (and in their order)
        sources = {**self._held_sources, **(record.sources or {})}
        self._stream_waiting -= sum(len(rows) for _l, _s, rows in now)
        self._held = later
        if not later:
            self._held_sources = {}
        return dataclasses.replace(record, raw=raw, sources=sources)

    def stop(self) -> None:
        """Log what is queued, then ``finish()`` (see :meth:`join`)."""
        with self._cv:
            if self._held:  # no step took them: a record of their own, under their last step
                from forge_obs.backends.record import StepRecord

                step = max(s for _l, s, _r in self._held)
                self._q.append(self._with_held(StepRecord(step=step, run_id=self._run_id, wall_time=time.time())))
                self._put_items += 1
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
                items = list(self._q)  # everything queued: steps go to the backend in batches
                self._q.clear()
                self._in_hand = sum(1 for item in items if item is not _STOP and type(item) is not StreamBatch)
                for item in items:
                    if type(item) is StreamBatch:
                        self._stream_waiting -= item.values()
            stop = False
            steps: list = []
            for item in items:
                if item is _STOP:
                    stop = True
                    break
                if type(item) is StreamBatch:
                    self._log(steps)
                    steps = []
                    self._log_stream(item)
                else:
                    steps.append(item)
            self._log(steps)
            if stop:
                break
        try:
            call_hook(self.backend.finish)
        except Exception as e:  # noqa: BLE001
            self.finish_error = repr(e)
            logger.error("forge_obs: backend %r failed to finish: %r", self.name, e)
        self.finished = True

    def _log(self, steps: list) -> None:
        """``steps`` (oldest first) to the backend: at once if it takes batches
        (:meth:`~forge_obs.backends.base.LoggerBackend.log_steps`), else one ``log_step`` each;
        a failure costs the steps it was given, and only for this backend."""
        if not steps:
            return
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        calls = [steps] if self._batches else [[r] for r in steps]
        for batch in calls:
            try:
                if self._batches:
                    call_hook(self.backend.log_steps, batch)
                else:
                    call_hook(self.backend.log_step, batch[0])
            except Exception as e:  # noqa: BLE001 - one backend never stops the others
                self.errors += len(batch)
                if self.errors == len(batch):
                    logger.error("forge_obs: backend %r failed at step %s: %r (counted in obs/backend_errors)",
                                 self.name, getattr(batch[0], "step", "?"), e)
        self.last_s = (time.perf_counter() - t0) / len(steps)
        SELF_OBS.add(self.cpu_part, time.thread_time() - cpu0)  # counted in the next step assembled
        self._done(len(steps), len(steps))

    def _log_stream(self, batch: StreamBatch) -> None:
        cpu0 = time.thread_time()
        try:
            call_hook(self.backend.log_stream_batch, batch)
        except Exception as e:  # noqa: BLE001 - one backend never stops the others
            self.errors += 1
            if self.errors == 1:
                logger.error("forge_obs: backend %r failed streaming raw values: %r (counted in obs/backend_errors)",
                             self.name, e)
        SELF_OBS.add(self.cpu_part, time.thread_time() - cpu0)
        self._done(0, 1)

    def _done(self, steps: int, items: int) -> None:
        with self._cv:
            self._in_hand -= steps
            self.done_steps += steps
            self._done_items += items
            self._cv.notify_all()


def _only_log_step(backend: LoggerBackend) -> bool:
    """Whether ``backend`` overrides ``log_step`` (or ``log_steps``) and none of the raw-value hooks."""
    cls = type(backend)
    if cls.log_step is LoggerBackend.log_step and cls.log_steps is LoggerBackend.log_steps:
        return False
    return all(getattr(cls, h) is getattr(LoggerBackend, h) for h in ("log_stream_batch", "log_raw", "log_stream"))


class BackendSet:
    """A session's backends, one :class:`BackendWorker` each; the local store (``jsonl``) is fed
    first and is never behind (its queue is unbounded)."""

    def __init__(self, backends: dict[str, LoggerBackend], queue_steps: int = DEFAULT_QUEUE_STEPS) -> None:
        order = sorted(backends, key=lambda n: n != "jsonl")
        self.workers = [BackendWorker(n, backends[n], None if n == "jsonl" else queue_steps) for n in order]
        #: whether a backend shows per-rank views (a step then carries each rank's reductions)
        self.per_rank = any(LoggingMode.PER_RANK_REDUCE in be.modes for be in backends.values())
        #: the backends raw values streamed between flushes go to at once
        self.streaming = [w for w in self.workers if LoggingMode.PER_RANK_NO_REDUCE in w.backend.modes]
        #: the most steps handed over at once: half of the smallest queue, so that a batch alone
        #: never fills a backend's queue (a backend that keeps up loses no step to batching)
        bounded = [w.queue_steps for w in self.workers if w.queue_steps is not None]
        self.batch_max = max(1, min(bounded, default=2 * DEFAULT_QUEUE_STEPS) // 2)

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def put(self, record: Any) -> None:
        """A step, to every backend's queue."""
        self.put_batch([record])

    def put_batch(self, records: list, wake: bool = True) -> None:
        """Steps, oldest first, to every backend's queue, with one wake-up of each backend's
        thread (none: ``wake`` False; :meth:`wake` then gives it)."""
        if records:
            for w in self.workers:
                w.put_many(records, wake)

    def wake(self) -> None:
        """Wake every backend that has steps queued."""
        for w in self.workers:
            w.wake()

    def put_stream(self, entries: list, sources: dict) -> None:
        """Streamed raw values, to every streaming backend's queue."""
        for w in self.streaming:
            w.put_stream(entries, sources)

    def behind(self, deadline: float) -> list[str]:
        """Wait until every backend logged what it accepted, at most until ``deadline``; the
        names of those that did not."""
        return [w.name for w in self.workers if not w.wait_done(deadline)]

    def stop(self) -> None:
        """Every backend logs its queue and finishes, all at the same time (see :meth:`join`)."""
        for w in self.workers:
            w.stop()

    def join(self, deadline: float) -> list[str]:
        """Wait for every backend to finish, at most until ``deadline``; the names of those
        that did not (left behind)."""
        finished = [w.join(deadline) for w in self.workers]
        return [w.name for w, ok in zip(self.workers, finished) if not ok]

    @property
    def errors(self) -> int:
        return sum(w.errors for w in self.workers)

    def gauges(self) -> dict[str, float]:
        """The backends' own figures a step reports: the slowest last ``log_step``, and what was
        dropped because a backend was behind."""
        ws = self.workers
        return {"obs/backend_s": max((w.last_s for w in ws), default=0.0),
                "obs/backend_errors": self.errors,
                "obs/backend_dropped_steps": sum(w.dropped_steps for w in ws),
                "obs/backend_dropped_stream_values": sum(w.dropped_stream_values for w in ws)}

    def report(self) -> dict[str, dict[str, Any]]:
        """Per backend: steps logged, dropped (queue full), errors, values it could not write, and
        the backend's own :meth:`~forge_obs.backends.base.LoggerBackend.meta_report` (for ``meta.json``)."""
        return {w.name: {"steps": w.done_steps, "dropped_steps": w.dropped_steps, "errors": w.errors,
                         **({"dropped_stream_values": w.dropped_stream_values} if w.dropped_stream_values else {}),
                         **({"skipped_values": n} if (n := getattr(w.backend, "skipped_values", 0)) else {}),
                         **({"finish_error": w.finish_error} if w.finish_error else {}),
                         **_own_report(w)} for w in self.workers}


def _own_report(w: BackendWorker) -> dict[str, Any]:
    """A backend's ``meta_report()``; nothing if it raises (or is still running: left behind)."""
    if not w.finished:
        return {}
    try:
        return dict(w.backend.meta_report() or {})
    except Exception as e:  # noqa: BLE001 - meta.json is written anyway
        logger.error("forge_obs: backend %r: meta_report() failed: %r", w.name, e)
        return {}
