"""One SPMD rank's session: its cut, its bounded queue, and its shipper thread.

:meth:`SpmdSession.flush` is the cut (:func:`forge_obs.wire.rank_cut.take`: the collector's
swap, O(1)) and an append to the rank's queue; nothing else runs on the caller's thread, and no
thread is woken. A shipper thread (which polls for cuts) exports and pickles each cut
(:func:`forge_obs.wire.rank_cut.export`), in order, and sends every cut queued meanwhile in one
frame to its node's helper (:mod:`forge_obs.spmd.helper`), stamped with the time of the rank's
own flush of it.

The queue is bounded (``max_queued_values``: values of the cuts not shipped yet). A flush that
finds it full holds its values back: they stay in the collector and go with the next flush that
finds room, as if this one had been skipped (the step they land in counts the flushes held
back, ``obs/held_back_flushes``, and ``meta.json`` names the rank). Nothing is dropped; the
training thread never waits.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from forge_obs.controller.config import LoggerConfig
from forge_obs.core.identity import ProcessIdentity, set_identity
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.warn import WARNER
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording import telemetry
from forge_obs.recording.timeline import follow_cut
from forge_obs.spmd.transport import Conn
from forge_obs.wire import rank_cut
from forge_obs.wire.messages import Control, Done, RankCut
from forge_obs.wire.snapshot import dumps

__all__ = ["SpmdSession", "identity_for", "MAX_QUEUED_VALUES", "POLL_MIN_S", "POLL_MAX_S"]

logger = logging.getLogger("forge_obs")

#: values (keys and raw values) of the cuts a rank has not shipped yet, at most: a flush that
#: finds this many queued holds its values back until the next one (counted)
MAX_QUEUED_VALUES = 1 << 20
#: cuts a shipper sends in one frame at most
MAX_BATCH = 4096
#: the shipper looks for new cuts this often after one, backing off to POLL_MAX_S while there is
#: none: waking a thread from ``flush`` would cost the training thread a wake-up (~10 µs) per step
POLL_MIN_S = 0.001
POLL_MAX_S = 0.005

_COLLECTOR = MetricCollector()


class SpmdSession:
    """What :func:`forge_obs.spmd.init` returns on every rank: ``flush(step)`` and ``shutdown()``."""

    def __init__(self, cfg: LoggerConfig, *, rank: int, world_size: int, logger_rank: int, identity: ProcessIdentity,
                 timeout_s: float, conn: Conn, start_time: float, helper: Any = None,
                 max_queued_values: int = MAX_QUEUED_VALUES) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.logger_rank = logger_rank
        self.is_logger = rank == logger_rank
        self.identity = identity
        self.timeout_s = timeout_s
        self.run_id = cfg.run.run_id
        self.run_dir = cfg.run.run_dir
        self.start_time = start_time
        self.max_queued_values = max_queued_values
        self.last_step: int | None = None
        self.helper = helper  # the helper process this rank started, if any (it ends on its own)
        self._conn = conn
        self._q: collections.deque = collections.deque()
        self._queued_in = 0  # values queued (the training thread's count)
        self._queued_out = 0  # values shipped or given up (the shipper's count)
        self._held = 0  # flushes held back since the last cut queued
        self._stop = threading.Event()  # set by shutdown: the shipper ships what is queued and ends
        self._closed = False
        self._done: "Done | None" = None
        self._read_lock = threading.Lock()  # the shipper reads the helper's messages, and shutdown
        self._shutdown_by = 0.0
        self.shipped = 0
        self.ship_errors = 0
        self.ship_cpu_s = 0.0
        self.held_back = 0
        self.store_ops = 0  # operations on the job's TCPStore (at init; none per step)
        self.on_shutdown: Any = None  # called once shut down (spmd.init may then be called again)
        self._shipper = threading.Thread(target=self._ship, name="forge_obs-spmd-ship", daemon=True)

    def start(self) -> None:
        self._shipper.start()

    # ------------------------------------------------------------ the training thread
    def flush(self, step: int) -> None:
        """The cut of ``step`` on this rank: swap and enqueue, nothing else. Never blocks."""
        if type(step) is not int:
            step = _check_step(step)
            if step is None:
                return
        if self._closed:
            WARNER.warn("spmd_closed", "flush", "forge_obs.spmd: flush() after shutdown(): ignored (the values stay recorded)")
            return
        self.last_step = step
        if self._queued_in - self._queued_out >= self.max_queued_values:
            self.held_back += 1
            self._held += 1
            follow_cut(step + 1)  # the timeline's steps go on; the values wait for the next flush
            return
        taken = rank_cut.take(step)
        n = 1 + taken.n_keys() + len(taken.raw or ())
        self._queued_in += n
        self._q.append((step, time.time(), taken, n, self._held, False))
        self._held = 0

    # ------------------------------------------------------------ the shipper thread
    def _ship(self) -> None:
        q, stop, wait = self._q, self._stop, POLL_MIN_S
        while True:
            if not q:
                if stop.is_set():
                    return
                self._poll()
                stop.wait(wait)
                wait = min(wait * 2, POLL_MAX_S)
                continue
            wait = POLL_MIN_S
            batch = [q.popleft() for _ in range(min(len(q), MAX_BATCH))]
            self._ship_batch(batch)

    def _ship_batch(self, batch: list) -> None:
        """Export, pickle and send ``batch`` in one frame (never raises: a cut that cannot be
        exported, or a frame the helper never gets, is counted and logged)."""
        cpu0 = time.thread_time()
        msgs = []
        for step, flushed_at, taken, _n, held, final in batch:
            try:
                data = rank_cut.export(taken)
            except Exception as e:  # noqa: BLE001 - this cut's values are lost: counted
                self.ship_errors += 1
                logger.error("forge_obs.spmd: rank %s could not export step %s: %r", self.rank, step, e)
                if not final:
                    continue
                data = _EMPTY  # the helper still learns that this rank finished
            msgs.append(RankCut(step, flushed_at, data, held, final, self._report() if final else None))
        try:
            if msgs:
                self._conn.send(msgs)
            self.shipped += len(msgs)
        except OSError as e:
            self.ship_errors += len(msgs)
            WARNER.warn("spmd_ship", "send", f"forge_obs.spmd: rank {self.rank} could not reach its node's helper: "
                        f"{e!r}; its states are lost from here on (counted in its summary)")
        self._queued_out += sum(item[3] for item in batch)
        dt = time.thread_time() - cpu0
        self.ship_cpu_s += dt
        SELF_OBS.add("export", dt)

    def _report(self) -> dict[str, Any]:
        return {"shipped": self.shipped, "ship_errors": self.ship_errors, "held_back_flushes": self.held_back,
                "shutdown_by": self._shutdown_by}

    def _poll(self) -> None:
        """What the helper sent this rank (the logger rank's end-of-session summary; spans on/off)."""
        with self._read_lock:
            try:
                msgs = self._conn.read() or []
            except OSError:
                return
        for m in msgs:
            if type(m) is Done:
                self._done = m
            elif type(m) is Control and self.rank in m.ranks:
                _spans(m.spans)

    # ------------------------------------------------------------ shutdown
    def shutdown(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Ship what was recorded since the last flush (as step ``last + 1``) and everything
        queued; on the logger rank, wait until the logger helper logged every step and finished
        the backends (ranks still out are not waited for past the time left). All within
        ``timeout_s`` (default: the session's). Returns a summary (on the logger rank: steps
        logged, ranks that did not finish, what a bound held back or dropped)."""
        if self._closed:
            return {}
        self._closed = True
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        self._shutdown_by = time.time() + timeout
        step = 0 if self.last_step is None else self.last_step + 1
        self._q.append((step, time.time(), rank_cut.take(step), 1, self._held, True))
        self._stop.set()
        self._shipper.join(max(0.0, deadline - time.monotonic()))
        out: dict[str, Any] = {"rank": self.rank, "shipped": self.shipped, "ship_errors": self.ship_errors,
                               "held_back_flushes": self.held_back}
        if self.is_logger:
            out.update(self._wait_done(deadline))
        self._conn.close()
        _close_timeline()
        telemetry.configure(False)
        _COLLECTOR.initialized = False
        if self.on_shutdown is not None:
            self.on_shutdown()
        return out

    def _wait_done(self, deadline: float) -> dict[str, Any]:
        while self._done is None:
            left = deadline - time.monotonic()
            if left <= 0 or self._conn.closed:
                logger.error("forge_obs.spmd: the logger helper did not finish within the shutdown's timeout")
                return {"logger": "did not finish within timeout_s"}
            if self._conn.wait_readable(left):
                self._poll()
        return dict(self._done.summary)


#: the states of a final cut whose export failed (counted): the helper still learns the rank finished
_EMPTY = dumps({"packed": {}, "states": {}, "counters": {}})


def _spans(on: bool) -> None:
    """Turn this rank's timeline spans on or off (the live alerts pointed at it)."""
    from forge_obs.spmd.sampling import set_spans

    set_spans(on)


def _check_step(step: Any) -> int | None:
    """``step`` as an int (a NumPy / tensor integer too), or None with a rate-limited warning."""
    try:
        if isinstance(step, bool) or int(step) != step:
            raise ValueError
        return int(step)
    except Exception:  # noqa: BLE001
        WARNER.warn("spmd_step", "flush", f"forge_obs.spmd: flush(step) needs an int step, got {step!r}; ignored")
        return None


def _close_timeline() -> None:
    try:
        from forge_obs.recording.timeline.writer import close

        close()
    except Exception:  # noqa: BLE001
        pass


def identity_for(name: str, rank: int, world_size: int, coords: dict[str, int]) -> ProcessIdentity:
    """This process's identity as SPMD rank ``rank`` (its label carries ``coords``)."""
    return set_identity(mesh=name, actor="", rank=rank, world_size=world_size, coords=dict(coords))
