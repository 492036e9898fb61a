"""One SPMD session: every rank's cut and shipper, and the logger rank's assembly.

On every rank, :meth:`SpmdSession.flush` is the cut: it swaps the process's collector (O(1), the
values recorded before it are the step's) and enqueues what it took; nothing else runs on the
caller's thread. A shipper thread (which polls for cuts, so that ``flush`` wakes no thread)
exports and pickles each cut, in order, and pushes it to the logger rank (:mod:`forge_obs.spmd.transport`), or hands it over directly on the logger rank.

On the logger rank, the messages of every rank feed a :class:`~forge_obs.controller.pipeline.FlushPipeline`
(the one the Monarch controller drives): the first message of a step begins its cut, expecting
every rank; each rank's message acknowledges the cut and carries its states. The pipeline merges
each step exactly once, hands it to the backends in step order, names the ranks that did not
answer within ``timeout_s`` (``obs/missing_ranks``; not waited for again until they answer), and
puts states that arrive after their step left into the next step emitted (``obs/late_states``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.controller.startup import create_backends, make_run_dir, start_backends
from forge_obs.core.identity import ProcessIdentity, set_identity
from forge_obs.core.run import redact, release_meta_space, reserve_meta_space, write_meta
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.types import LoggingMode
from forge_obs.core.warn import WARNER
from forge_obs.recording.collector import MetricCollector
from forge_obs.wire import rank_cut

__all__ = ["SpmdSession", "STATES", "FINAL", "MESH_ID", "identity_for"]

logger = logging.getLogger("forge_obs")

#: kinds of message a rank sends the logger rank
STATES, FINAL = "S", "F"
#: the mesh id of every SPMD rank's key in the pipeline (a rank key is ``(MESH_ID, rank)``)
MESH_ID = "spmd"
#: steps whose cut number the logger rank remembers (a rank later than this is counted late)
KEEP_STEPS = 4096
#: the shipper looks for new cuts this often after one, backing off to POLL_MAX_S while there is
#: none: waking a thread from ``flush`` would cost the training thread a wake-up (~10 µs) per step
POLL_MIN_S = 0.001
POLL_MAX_S = 0.005

_COLLECTOR = MetricCollector()


def _run_coro(coro: Any) -> Any:
    """Run ``coro`` to completion from synchronous code (on a thread of its own when this thread
    already runs an event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: dict = {}

    def run() -> None:
        try:
            out["v"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["e"] = e

    t = threading.Thread(target=run, name="forge_obs-spmd-run", daemon=True)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out.get("v")


class _Assembly:
    """On the logger rank: every rank's messages, in arrival order, into the pipeline's cuts."""

    def __init__(self, pipeline: FlushPipeline, world_size: int, labels: dict[int, str]) -> None:
        self.pipeline = pipeline
        self.world_size = world_size
        self.labels = labels
        self.cv = threading.Condition()
        self.seq_of: dict[int, int] = {}  # step -> its cut
        self.last_step: int | None = None
        self.finished: set[int] = set()  # ranks whose final states arrived
        self.closed = False
        self.after_close = 0  # messages that arrived after the logger rank ended the session

    def take(self, kind: str, rank: int, step: int, ident: dict | None, data: bytes) -> None:
        key = (MESH_ID, rank)
        p = self.pipeline
        with self.cv:
            if self.closed:
                self.after_close += 1
                return
            seq = self.seq_of.get(step)
            if seq is None:
                if self.last_step is None or step > self.last_step:
                    ranks = {(MESH_ID, r): lab for r, lab in self.labels.items() if r not in self.finished or r == rank}
                    seq = self.seq_of[step] = p.begin_cut(step, None, ranks=ranks, final=kind == FINAL).seq
                    self.last_step = step
                    if len(self.seq_of) > KEEP_STEPS:
                        del self.seq_of[min(self.seq_of)]
                else:  # a step older than one begun, never begun itself: late, into the next step emitted
                    seq = 0
            if seq:
                p.ack(seq, key)
            p.states(seq, key, ident, data)
            if kind == FINAL:
                self.finished.add(rank)
                self.cv.notify_all()

    def wait_finished(self, deadline: float) -> list[int]:
        """Wait until every rank sent its final states, or is lagging (dead, hung: named missing
        already), or ``deadline``; returns the ranks that did not finish."""
        with self.cv:
            while True:
                lagging = {k[1] for k in self.pipeline.lagging if k[0] == MESH_ID}
                left = [r for r in range(self.world_size) if r not in self.finished and r not in lagging]
                now = time.monotonic()
                if not left or now >= deadline:
                    return [r for r in range(self.world_size) if r not in self.finished]
                self.cv.wait(min(0.05, deadline - now))  # lagging changes without a message here

    def close(self) -> None:
        with self.cv:
            self.closed = True


class SpmdSession:
    """What :func:`forge_obs.spmd.init` returns on every rank: ``flush(step)`` and ``shutdown()``."""

    def __init__(self, cfg: LoggerConfig, *, rank: int, world_size: int, logger_rank: int, identity: ProcessIdentity,
                 timeout_s: float, transport: Any, receiver: Any, start_time: float) -> None:
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
        self.last_step: int | None = None
        self._transport = transport
        self._receiver = receiver
        self._ident = identity.to_dict()
        self._q: collections.deque = collections.deque()
        self._put = self._q.append
        self._stop = threading.Event()  # set by shutdown: the shipper ships what is queued and ends
        self._closed = False
        self.shipped = 0
        self.ship_errors = 0
        self.ship_cpu_s = 0.0
        self.pipeline: FlushPipeline | None = None
        self._assembly: _Assembly | None = None
        self._recv_thread: threading.Thread | None = None
        self._synced = threading.Event()  # the receiver took every message queued before the logger's shutdown
        self._shipper = threading.Thread(target=self._ship, name="forge_obs-spmd-ship", daemon=True)

    # ------------------------------------------------------------ logger rank
    def start_logger(self, labels: dict[int, str]) -> None:
        """Start the backends and the pipeline (the logger rank). Raises as ``init_backends`` does."""
        cfg = self.cfg
        from forge_obs.backends.record import RunContext

        run = RunContext(run_id=self.run_id, run_dir=self.run_dir, process_name=self.identity.label,
                         config=redact(cfg.backends), start_time=self.start_time, flush_timeout_s=self.timeout_s)
        backends = create_backends(cfg.backends)
        make_run_dir(self.run_dir)
        _run_coro(start_backends(backends, run, cfg.backend_init_timeout_s))
        write_meta(self.run_dir, run_id=self.run_id, process_name=self.identity.label, config=cfg.backends,
                   start_time=self.start_time, status="running", mode="spmd", world_size=self.world_size)
        reserve_meta_space(self.run_dir)
        self.pipeline = FlushPipeline(backends, self.run_id, self.timeout_s, self.identity.label,
                                      shutdown_timeout_s=cfg.shutdown_timeout_s, queue_steps=cfg.backend_queue_steps)
        self.pipeline.start()
        self._assembly = _Assembly(self.pipeline, self.world_size, labels)
        if self._receiver is not None:
            self._recv_thread = threading.Thread(target=self._receive, name="forge_obs-spmd-recv", daemon=True)
            self._recv_thread.start()

    def _receive(self) -> None:
        from forge_obs.spmd.transport import STOP, SYNC

        while True:
            try:
                data = self._receiver.pop()
            except Exception as e:  # noqa: BLE001 - the store is gone: nothing more can arrive
                if not (self._assembly and self._assembly.closed):
                    logger.error("forge_obs.spmd: the logger rank stopped receiving: %r", e)
                return
            if data == STOP:
                return
            if data == SYNC:
                self._synced.set()
                continue
            cpu0 = time.thread_time()
            try:
                self._assembly.take(*pickle.loads(data))
            except Exception as e:  # noqa: BLE001 - one bad message costs only itself
                WARNER.warn("spmd_message", "spmd", f"forge_obs.spmd: a message could not be taken: {e!r}")
            SELF_OBS.add("inbox", time.thread_time() - cpu0)

    def streaming(self) -> bool:
        return bool(self.pipeline) and any(LoggingMode.PER_RANK_NO_REDUCE in be.modes for be in self.pipeline.backends.values())

    # ------------------------------------------------------------ every rank
    def start(self) -> None:
        self._shipper.start()

    def flush(self, step: int) -> None:
        """The cut of ``step`` on this rank: swap and enqueue, nothing else. Never blocks on other ranks."""
        if type(step) is not int:
            step = _check_step(step)
            if step is None:
                return
        if self._closed:
            WARNER.warn("spmd_closed", "flush", "forge_obs.spmd: flush() after shutdown(): ignored (the values stay recorded)")
            return
        taken = rank_cut.take(step)
        self.last_step = step
        self._put((STATES, step, taken))

    def _ship(self) -> None:
        q, stop, wait = self._q, self._stop, POLL_MIN_S
        while True:
            if not q:
                if stop.is_set():
                    return
                stop.wait(wait)
                wait = min(wait * 2, POLL_MAX_S)
                continue
            wait = POLL_MIN_S
            self._ship_one(*q.popleft())

    def _ship_one(self, kind: str, step: int, taken: Any) -> None:
        """Export, pickle and send one cut (never raises: a failure is counted and logged)."""
        cpu0 = time.thread_time()
        try:
            data = rank_cut.export(taken)
            msg = (kind, self.rank, step, self._ident, data)
            if self.is_logger:
                self._assembly.take(*msg)
            else:
                self._transport.push(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            self.shipped += 1
        except Exception as e:  # noqa: BLE001 - one step's states lost, counted and reported
            self.ship_errors += 1
            logger.error("forge_obs.spmd: rank %s could not ship step %s: %r", self.rank, step, e)
        dt = time.thread_time() - cpu0
        self.ship_cpu_s += dt
        SELF_OBS.add("export", dt)

    def shutdown(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Ship what was recorded since the last flush (as step ``last + 1``), then, on the logger
        rank, wait for every rank's final states (a rank already missing is not waited for),
        log every step and finish the backends, all within ``timeout_s`` (default: the
        session's). Returns a summary (steps logged, ranks that did not finish)."""
        if self._closed:
            return {}
        self._closed = True
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        step = 0 if self.last_step is None else self.last_step + 1
        if self.is_logger:  # before its own final states begin the last cut
            self._take_queued(deadline)
        self._put((FINAL, step, _COLLECTOR.swap()))
        self._stop.set()
        self._shipper.join(max(0.0, deadline - time.monotonic()))
        out: dict[str, Any] = {"rank": self.rank, "shipped": self.shipped, "ship_errors": self.ship_errors}
        if self.is_logger:
            out.update(self._end_logger(deadline))
        _close_timeline()
        _COLLECTOR.initialized = False
        return out

    def _take_queued(self, deadline: float) -> None:
        """Let the receiver take every message ranks queued before now (a late rank's states
        among them: it answers again, and the last cut waits for it)."""
        if self._recv_thread is None:
            return
        from forge_obs.spmd.transport import SYNC

        try:
            self._transport.push(SYNC)
            self._synced.wait(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the store is gone: nothing more can arrive
            pass

    def _end_logger(self, deadline: float) -> dict[str, Any]:
        asm, pipeline = self._assembly, self.pipeline
        unfinished = asm.wait_finished(deadline)
        asm.close()
        if self._recv_thread is not None:
            from forge_obs.spmd.transport import STOP

            try:
                self._transport.push(STOP)
                self._recv_thread.join(max(1.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a daemon thread; the store may be gone
                pass
        with asm.cv:  # states that came after their step, and after the last cut began: one more step
            if asm.last_step is not None:
                pipeline.begin_cut(asm.last_step + 1, None, ranks={}, final=True)
        left = _run_coro(pipeline.close(max(1.0, deadline - time.monotonic())))
        write_meta(self.run_dir, end_time=time.time(), status="finished", steps_logged=pipeline.steps_logged,
                   backend_errors=pipeline.backend_errors, backends=pipeline.backend_report(),
                   unfinished_backends=left, unfinished_ranks=[asm.labels.get(r, str(r)) for r in unfinished])
        release_meta_space(Path(self.run_dir))
        return {"steps_logged": pipeline.steps_logged, "unfinished_ranks": unfinished, "unfinished_backends": left,
                "late_states": pipeline.late_states, "after_close": asm.after_close}


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
