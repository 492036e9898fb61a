"""Controller side of a flush: cuts, step assembly and the hand-off to backends, in one object.

    >>> import asyncio
    >>> from forge_obs.controller.pipeline import FlushPipeline
    >>> from forge_obs.backends.base import LoggerBackend
    >>> seen = []
    >>> class Keep(LoggerBackend):
    ...     def log_step(self, record): seen.append(record.global_dict())
    >>> async def demo():
    ...     p = FlushPipeline(backends={"keep": Keep({})}, run_id="doc", flush_timeout_s=5)
    ...     p.start()
    ...     cut = p.begin_cut(0, local=None, ranks={("m1", 0): "m/r0"})
    ...     p.ack(cut.seq, ("m1", 0), ())
    ...     p.states(cut.seq, ("m1", 0), {"label": "m/r0"}, {"states": {"x": {"reduction_type": "sum", "sum": 2.0}}})
    ...     await p.drain()
    >>> asyncio.run(demo())
    >>> seen[0]["x"]
    2.0

No Monarch here: the controller's inbox (:mod:`forge_obs.controller.inbox`) and the SPMD logger
rank feed this. A flush is a *cut* (``begin_cut``, numbered by ``seq``): every expected rank
swaps its collector and acknowledges (``ack``), then sends the states it took (``states``). The
cut is closed when every expected rank acknowledged, or ``flush_timeout_s`` after it began;
``flush`` returns then. Which ranks a cut waits for, and where late and final states go, is
:mod:`forge_obs.controller.cuts`; how a cut becomes a step, :mod:`forge_obs.controller.assembly`.

Steps leave in the order their cuts began. A step waits for the states of every rank that
acknowledged its cut, or until its deadline. Assembly runs in one worker thread
(``forge_obs-backends``), each backend on a thread of its own
(:mod:`forge_obs.controller.backend_worker`).

Group leaders (``"aggregate"``, :mod:`forge_obs.controller.aggregate`) answer for several ranks at once:
``ack_batch`` acknowledges each of them (and names those the leader gave up on), ``bundle``
counts each as received and carries their states merged; ``states_resent`` takes a state a
member resent after its leader failed, unless a bundle already brought it. A cut that knows its
groups (``begin_cut(groups=...)``) asks, through ``ask_resend``, the ranks of each group whose
leader has not delivered its bundle ``BYPASS_FRACTION`` of ``flush_timeout_s`` after it began to
resend directly, and drops that leader's bundles of the cut.

Raw values a rank streams between flushes (``stream``: ``per_rank_no_reduce``, under the rank's
predicted step) skip the assembly: they go to the streaming backends' queues at once. When the
step that then takes the rank's states is not the predicted one, the step's
``obs/stream_step_mismatch`` counts the values streamed under the prediction.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Iterable

from forge_obs.backends.base import LoggerBackend
from forge_obs.controller.assembly import StepAssembler
from forge_obs.controller.backend_worker import DEFAULT_QUEUE_STEPS, BackendSet
from forge_obs.controller.cuts import Cut, CutBook, Given, RankBook
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.types import Metric
from forge_obs.recording.reduce import KeyDrops, Reduce
from forge_obs.wire.messages import ChildMesh, RankKey
from forge_obs.wire.snapshot import decode_raw, opened

__all__ = ["RESUME_GRACE_S", "DEFAULT_BATCH_S", "FlushPipeline", "StepWorker"]

logger = logging.getLogger("forge_obs")

#: how long the worker lets a flush that waited for a cut resume before merging its step
RESUME_GRACE_S = 0.002
#: what :meth:`StepWorker._await_step` returns when requests are to be sent before it waits on,
#: and when, not to block, it would wait
_AGAIN = object()
_NOT_READY = object()
#: how long the worker lets pass, once a cut is ready, before it hands the steps ready by then to
#: the backends (``backend_batch_s``)
DEFAULT_BATCH_S = 0.5


class FlushPipeline:
    """Cuts, step assembly and backend I/O in one worker thread; every public method is
    thread-safe (Monarch runs each actor on its own thread and loop; the inbox drains its port
    on a thread of its own).

    Collaborators, all optional: ``book`` (what is known of ranks, kept across sessions);
    ``leader_of`` (rank -> its group's leader on the aggregated route, :mod:`forge_obs.wire.plan`);
    ``ask_resend(seq, {mesh_id: [rank, ...]})``: ask those ranks to resend their answer to cut
    ``seq`` directly; ``ask_exports(seq, [mesh_id, ...])``: cut ``seq`` closed, ask those
    meshes' ranks for the states they hold for it (large cuts,
    :meth:`~forge_obs.controller.fetcher.LocalFetcherActor.export`), once per cut. Both are
    called outside the lock, on the worker thread or the resumed flush's."""

    def __init__(
        self,
        backends: dict[str, LoggerBackend],
        run_id: str,
        flush_timeout_s: float = 10.0,
        process_name: str = "Controller",
        book: RankBook | None = None,
        shutdown_timeout_s: float = 30.0,
        queue_steps: int = DEFAULT_QUEUE_STEPS,
        *,
        leader_of: dict[RankKey, RankKey] | None = None,
        ask_resend: Callable[[int, dict[str, list[int]]], None] | None = None,
        ask_exports: Callable[[int, list[str]], None] | None = None,
        batch_s: float = DEFAULT_BATCH_S,
    ) -> None:
        self.backends = backends
        self.run_id = run_id
        self.flush_timeout_s = flush_timeout_s
        self.process_name = process_name
        self.shutdown_timeout_s = shutdown_timeout_s
        self.book = book if book is not None else RankBook()
        self.ask_resend = ask_resend
        self.ask_exports = ask_exports
        self.outputs = BackendSet(backends, queue_steps)
        self.cuts = CutBook(self.book, flush_timeout_s, leader_of)  # guarded by _cv
        self.assembler = StepAssembler(run_id, process_name, self.book, self.outputs.per_rank)
        self._lock = threading.RLock()  # guards the cuts and the counters below
        self._cv = threading.Condition(self._lock)  # callers waiting on a cut or on the steps
        self._closing = False
        self.assembled = 0  # cuts taken off the queue (a step handed to the backends, or none)
        self.steps_logged = 0  # steps handed to the backends
        #: streamed values that could not be decoded, counted with the next step assembled
        self._stream_drops = KeyDrops()
        self.worker = StepWorker(self, batch_s)
        self._worker = self.worker.thread

    # ------------------------------------------------------------ what it knows
    @property
    def lagging(self) -> set:
        return self.book.lagging

    @property
    def need_per_rank(self) -> bool:
        """Whether a backend shows per-rank views (aggregated groups then carry each rank's states)."""
        return self.outputs.per_rank

    @property
    def late_states(self) -> int:
        return self.cuts.late_states

    @property
    def backend_errors(self) -> int:
        return self.outputs.errors

    def backend_report(self) -> dict[str, dict[str, Any]]:
        """Per backend: what it logged, dropped and failed (see :meth:`BackendSet.report`)."""
        return self.outputs.report()

    def label_of(self, key: RankKey) -> str:
        return self.book.label_of(key)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.outputs.start()
        self._worker.start()

    async def drain(self, timeout_s: float | None = None) -> list[str]:
        """Wait until every begun step was assembled (each waits at most its deadline) and
        reached every backend; a backend still busy after ``timeout_s`` (default:
        ``shutdown_timeout_s``) is not waited for. Returns the names of those backends."""
        with self._cv:
            target = self.cuts.begun
        timeout = self.shutdown_timeout_s if timeout_s is None else timeout_s
        return await asyncio.get_running_loop().run_in_executor(None, self._wait_logged, target, timeout)

    def _wait_logged(self, target: int, timeout_s: float) -> list[str]:
        with self._cv:
            self.worker.hurry(True)  # no batch waits for its time meanwhile
            try:
                self._cv.wait_for(lambda: self.assembled >= target or not self._worker.is_alive())
            finally:
                self.worker.hurry(False)
        return self.outputs.behind(time.monotonic() + timeout_s)

    async def close(self, timeout_s: float | None = None) -> list[str]:
        """Assemble every begun step, then let every backend log what it has queued and finish,
        waiting for the backends at most ``timeout_s`` (default: ``shutdown_timeout_s``) in all.
        Returns the names of the backends that did not finish."""
        timeout = self.shutdown_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            self._closing = True  # the worker assembles what is begun (each waits at most its deadline), then ends
            self._cv.notify_all()
            self.worker.cv.notify()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._worker.join)
        deadline = time.monotonic() + timeout
        self.outputs.stop()
        unfinished = await loop.run_in_executor(None, self.outputs.join, deadline)
        if unfinished:
            logger.error("forge_obs: backend(s) %s did not finish within shutdown_timeout_s=%gs; left behind",
                         ", ".join(unfinished), timeout)
        return unfinished

    # ------------------------------------------------------------ cuts
    def begin_cut(
        self,
        step: int,
        local: Any,
        ranks: dict[RankKey, str] | None = None,
        stopping: dict[RankKey, str] | None = None,
        final: bool = False,
        groups: dict[RankKey, list[RankKey]] | None = None,
        called_at: float | None = None,
        raw_round_trip_s: float | None = None,
    ) -> Cut:
        """Open the cut of ``step``. ``ranks``: the live ranks it is cast to (key -> label);
        ``stopping``: ranks of meshes stopped since the last cut, whose final states answer it.
        The ranks their processes spawned (declared in earlier acks) are expected too.
        ``groups``: leader -> its group's ranks, for the ranks that answer through a leader (a
        group whose leader has not delivered the cut's bundle ``BYPASS_FRACTION`` of
        ``flush_timeout_s`` after it began is asked to resend directly). ``raw_round_trip_s``: the
        probe's round trip measured just before (``obs/raw_round_trip_s`` of the step)."""
        callbacks: list = []
        with self._cv:
            cut = self.cuts.open(step, local, ranks, stopping, final, groups if self.ask_resend is not None else None,
                                 called_at, raw_round_trip_s)
            self.cuts.maybe_close(cut, callbacks)
            if cut.closed or cut.groups:
                # the worker learns of other cuts when they close or when its idle wait ends,
                # which is before their deadline (a wake-up now would compete with the cast)
                self._notify()
        _run(callbacks)
        return cut

    def submit(self, step: int, *, states: Iterable[tuple] = (), extra: Iterable[tuple] = (),
               bundles: Iterable[Any] = (), reported: int, missing: Iterable[str] = (), late: Iterable[str] = (),
               final: bool = False, obs: dict[str, float] | None = None) -> Cut:
        """A step whose cut was made and gathered elsewhere (the SPMD logger's merge tree): built
        and handed to the backends after every cut begun before it, as a cut's step is, without
        waiting for anything. ``states`` / ``extra``: ``(rank_key, identity, snapshot)`` of single
        ranks, the step's own / joining it late; ``bundles``: merged groups
        (:mod:`forge_obs.wire.bundle`); the rest is a :class:`~forge_obs.controller.cuts.Given`."""
        given = Given(list(missing), list(late), int(reported), dict(obs or {}))
        with self._cv:
            cut = self.cuts.submit(step, states, extra, bundles, given, final)
            self._notify()
        return cut

    def ack(self, seq: int, rank_key: RankKey, children: Iterable[ChildMesh] = (), stamp: Any = None,
            states: tuple | None = None) -> None:
        """A rank swapped its collector for cut ``seq`` (and cut the meshes it declares);
        ``stamp``: its :func:`~forge_obs.controller.cut_timing.rank_stamp`; ``states``:
        ``(identity, snapshot)`` when its states came with the ack (as :meth:`states` takes them)."""
        self.ack_batch(seq, [(rank_key, children)], states={tuple(rank_key): states} if states else None, stamp=stamp)

    def ack_batch(self, seq: int, items: Iterable[tuple], given_up: Iterable[RankKey] = (),
                  states: dict[RankKey, tuple] | None = None, stamp: Any = None) -> None:
        """Each rank of ``items`` (``(rank_key, children)`` pairs) acknowledged cut ``seq``; the
        ranks of ``given_up`` did not (their aggregator stopped waiting for them): the cut does
        not wait for them any more and names them late when it closes; ``states``: rank ->
        ``(identity, snapshot)`` that came with the acks, taken once a flush waiting for the acks
        was woken; ``stamp``: the acks' :func:`~forge_obs.controller.cut_timing.rank_stamp`, if
        they carried one. O(len(items)) whatever the cut's size."""
        callbacks: list = []
        cuts = self.cuts
        with self._cv:
            cut = cuts.find(seq)
            if cut is not None and not cut.closed:
                cuts.give_up(cut, given_up)
            acked = False
            for rank_key, children in items:
                cuts.ack(cut, tuple(rank_key), children)
                acked = True
            if cut is not None:
                if acked and not cut.closed:
                    cut.stamp = stamp
                cuts.claim_held(cut)
                cuts.maybe_close(cut, callbacks)
            if not states:
                self._wake(cut)
        _run(callbacks)
        if states:
            with self._cv:
                for k, (identity, snapshot) in states.items():
                    cut = cuts.receive(seq, k, identity, snapshot)
                self._wake(cut)

    def states(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> None:
        """What a rank took at cut ``seq``. States that a closed cut asked for are unpickled here
        as they come, while no flush waits, so that the step's assembly, once the last of them
        came, does not unpickle them all."""
        if isinstance(snapshot, bytes) and self._open_now(seq):
            snapshot = opened(snapshot)
        with self._cv:
            cut = self.cuts.receive(seq, tuple(rank_key), identity, snapshot)
            self._wake(cut)

    def states_resent(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> None:
        """States a rank sent to an aggregator that was replaced or is gone, sent again: taken if
        this rank's states of cut ``seq`` did not arrive yet, dropped (counted) otherwise."""
        with self._cv:
            taken, cut = self.cuts.receive_resent(seq, tuple(rank_key), identity, snapshot)
            if taken:
                self._wake(cut)

    def bundle(self, seq: int, ranks: Iterable[RankKey], bundle: Any, identities: dict | None = None,
               leader: RankKey | None = None, current: bool = True) -> None:
        """The merged states of the group ``ranks`` for cut ``seq`` (:mod:`forge_obs.wire.bundle`;
        pickled bytes are decoded by the worker), from ``leader``: each rank counts as received; a
        bundle whose step already left goes into the first cut still open after ``seq``, as late
        states do. A bundle of a leader replaced since (not ``current``: its members resent their
        states) or bypassed for ``seq`` (its ranks were asked to resend) is dropped, counted in
        ``fenced_bundles``. ``identities``: the ranks' identities that changed since their last bundle."""
        ranks = [tuple(k) for k in ranks]
        leader = tuple(leader) if leader is not None else None
        with self._cv:
            taken, cut = self.cuts.receive_bundle(seq, ranks, bundle, identities, leader, current)
            if taken:
                self._wake(cut)

    def stream(self, rank_key: RankKey | None, label: str, step: int, rows: list, pickled: list = ()) -> None:
        """Raw values a rank streamed between flushes (``per_rank_no_reduce``), under its predicted
        step: handed to the streaming backends' queues at once, in arrival order. ``pickled``: the
        indices of values pickled one by one (:func:`forge_obs.wire.snapshot.encode_raw`); one that
        cannot be decoded here is left out, counted with the next step assembled."""
        if not rows or not self.outputs.streaming:
            return
        if pickled:
            lost = KeyDrops()
            rows = decode_raw(rows, pickled, lost.add)
            if lost:
                with self._cv:
                    self._stream_drops.merge(lost)
        ident = (self.book.identities.get(tuple(rank_key)) if rank_key is not None else None) or {}
        self.outputs.put_stream([(label, step, rows)], {label: dict(ident, label=label)})

    def final(self, last_seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: dict[str, Any]) -> None:
        """A stopping rank's last states: recorded after cut ``last_seq`` (the last it took)."""
        callbacks: list = []
        with self._cv:
            self.cuts.receive_final(last_seq, tuple(rank_key), identity, snapshot, callbacks)
            self._notify()
        _run(callbacks)

    def forget_mesh(self, mesh_id: str) -> None:
        """A mesh is gone for good: no cut waits for its ranks any more."""
        callbacks: list = []
        with self._cv:
            self.cuts.forget_mesh(mesh_id, callbacks)
            self._notify()
        _run(callbacks)

    # ------------------------------------------------------------ the flush's wait
    def close_cut(self, cut: Cut) -> None:
        """End the wait for acknowledgements (the flush timed out): ranks that did not answer
        are lagging from now on."""
        callbacks: list = []
        with self._cv:
            self.cuts.close(cut, callbacks)
            self._notify()
        _run(callbacks)

    def on_cut_closed(self, cut: Cut, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread) once ``cut`` is closed; at once if it is."""
        with self._cv:
            if not cut.closed:
                cut.waiters.append(callback)
                return
        callback()

    def wait_cut(self, cut: Cut, timeout: float | None = None) -> bool:
        """Block until ``cut`` is closed (threads that cannot await); True if it closed."""
        with self._cv:
            return self._cv.wait_for(lambda: cut.closed, timeout)

    def resumed(self, cut: Cut) -> None:
        """The flush that waited for ``cut`` has resumed (the worker let it run first)."""
        with self._cv:
            cut.resumed = True
            cut.resumed_at = time.monotonic()
            self.worker.wake()  # it asks for a large cut's states, or ends its grace period

    def request_exports(self, cut: Cut) -> None:
        """Once ``cut`` closed: ask the meshes whose ranks' states are still due for them (a
        large cut's ranks hold them until then). At most once per cut; nothing if all came."""
        with self._cv:
            call = self.cuts.exports_request(cut, self.ask_exports)
        if call is not None:
            call()

    def _open_now(self, seq: int) -> bool:
        """Whether states of cut ``seq`` may be unpickled now: it asked for them, and no cut is
        open (a waiting flush has the inbox thread's time for its acks)."""
        with self._cv:
            cut = self.cuts.find(seq)
            return cut is not None and cut.exports_asked and all(c.closed for c in self.cuts.pending)

    def _gauges(self) -> dict[str, float]:
        """The pipeline's own figures a step reports (:data:`forge_obs.controller.assembly.GAUGES`)."""
        cuts = self.cuts
        return {**self.outputs.gauges(), "obs/late_states": cuts.late_states,
                "obs/fenced_bundles": cuts.fenced_bundles, "obs/duplicates_dropped": cuts.duplicates_dropped}

    def _notify(self) -> None:
        """Under the lock: wake the callers waiting on a cut or on the steps, and the worker
        (unless it waits out a batch)."""
        self._cv.notify_all()
        self.worker.wake()

    def _wake(self, cut: Cut | None) -> None:
        """Wake the worker and cut waiters only when this may complete something: a closed cut
        whose states are all in, a cut that just closed, or a message for a cut that is gone. A
        wake-up per message would cost the controller a thread switch each for nothing."""
        if cut is None or (cut.closed and cut.n_due <= 0) or cut is not self.cuts.pending[0]:
            self._notify()
        elif cut.closed and not cut.woke and not cut.awaited:  # an awaited one: when resumed
            cut.woke = True  # FlushWait.wait_cut and the worker's grace period
            self._notify()


class StepWorker:
    """The pipeline's worker thread (``forge_obs-backends``): it takes the cuts in the order they
    began, each once it is complete or past its deadline, assembles their steps and hands them
    to the backends. With ``batch_s`` > 0 it hands them over in batches: once a cut is ready it
    lets ``batch_s`` pass (woken only by ``hurry`` or the pipeline's close), then assembles
    every cut ready by then, one after the other, and hands their steps to each backend at once
    (one wake-up of each backend thread per batch). A step reaches the backends at most
    ``batch_s`` after its cut was complete; a cut is still taken only when complete, and each
    step keeps exactly its own values. Everything here runs under the pipeline's lock but the
    assembly and the hand-over."""

    def __init__(self, pipeline: "FlushPipeline", batch_s: float) -> None:
        self.p = pipeline
        self.batch_s = max(0.0, float(batch_s))
        self.cv = threading.Condition(pipeline._lock)  # the worker's own wake-ups
        self.lingering = False  # waiting out a batch: the pipeline's events do not wake it
        self.hurrying = 0  # callers waiting for every begun step (drain): no batch waits for its time
        self.thread = threading.Thread(target=self.run, name="forge_obs-backends", daemon=True)

    def wake(self) -> None:
        """Under the lock: something may have completed a cut (not heard while lingering)."""
        if not self.lingering:
            self.cv.notify()

    def hurry(self, on: bool) -> None:
        """Under the lock: a caller waits for every begun step (``on``), or stopped waiting."""
        self.hurrying += 1 if on else -1
        self.cv.notify()

    def run(self) -> None:
        more = False  # the last batch was full: cuts were left ready, no time to wait
        while True:
            item = self._next_step()
            if item is None:
                break
            items = [item]
            if self.batch_s > 0:
                if not more:
                    self._linger(time.monotonic() + self.batch_s)
                items.extend(self._ready_steps(self.p.outputs.batch_max - 1))
            more = len(items) >= self.p.outputs.batch_max
            self._assemble(items)

    def _assemble(self, items: list) -> None:
        """Each step assembled and queued for every backend (a step's own figures see what
        the earlier ones of the batch did), then every backend woken once."""
        p = self.p
        logged = 0
        for cut, missing, late, pending in items:
            cpu0 = time.thread_time()
            try:
                t0 = time.perf_counter()
                with p._lock:
                    drops, p._stream_drops = p._stream_drops, KeyDrops()
                record = p.assembler.build(cut, missing, late, pending, drops, p._gauges)
                if record is not None:
                    record.global_metrics.append(Metric("obs/merge_s", time.perf_counter() - t0, Reduce.MAX))
                    p.outputs.put_batch([record], wake=False)
                    logged += 1
            except Exception:  # noqa: BLE001 - a bug here must not stop later steps
                logger.exception("forge_obs: step %s could not be assembled", cut.step)
            finally:
                SELF_OBS.add("pipeline", time.thread_time() - cpu0)
        cpu0 = time.thread_time()
        p.outputs.wake()
        SELF_OBS.add("pipeline", time.thread_time() - cpu0)
        with p._lock:
            p.steps_logged += logged
            p.assembled += len(items)
            p._cv.notify_all()

    def _linger(self, until: float) -> None:
        """Wait until ``until``, the pipeline's close, or a caller that waits for every step."""
        p = self.p
        with p._lock:
            self.lingering = True
            try:
                while not p._closing and not self.hurrying and (left := until - time.monotonic()) > 0:
                    self.cv.wait(left)
            finally:
                self.lingering = False

    def _ready_steps(self, limit: int) -> list:
        """The cuts ready now (complete, or past their deadline), oldest first, taken: at most
        ``limit`` of them."""
        out: list = []
        while len(out) < limit:
            callbacks: list = []
            try:
                with self.p._lock:
                    item = self._await_step(callbacks, block=False)
            finally:
                _run(callbacks)
            if item is None or item is _NOT_READY:
                return out
            if item is not _AGAIN:
                out.append(item)
        return out

    def _next_step(self) -> "tuple[Cut, list, list, int] | None":
        """Block until the oldest cut is closed and its states are in, or it is past its
        deadline; None when closing. Meanwhile, groups of any pending cut whose leader did not
        deliver in time are asked to resend (:meth:`CutBook.bypass`)."""
        while True:
            callbacks: list = []
            try:
                with self.p._lock:
                    item = self._await_step(callbacks)
            finally:
                _run(callbacks)
            if item is not _AGAIN:
                return item

    def _await_step(self, callbacks: list, block: bool = True) -> "tuple[Cut, list, list, int] | None | object":
        """:meth:`_next_step` under the lock; ``_AGAIN`` when ``callbacks`` hold requests to
        send first; ``_NOT_READY`` (not ``block``) when it would wait."""
        p = self.p
        cuts = p.cuts
        while True:
            if not cuts.pending:
                if p._closing or not block:
                    return None
                self.cv.wait(p.flush_timeout_s)  # a cut begun meanwhile is due no earlier
                continue
            now = time.monotonic()
            next_bypass = cuts.bypass_requests(now, p.ask_resend, callbacks)
            if callbacks:
                return _AGAIN
            cut = cuts.pending[0]
            timeout = cut.deadline - now
            wait = min(timeout, next_bypass - now)
            if not cut.closed:
                if timeout > 0:
                    if not block:
                        return _NOT_READY
                    self.cv.wait(wait)
                    continue
                cuts.close(cut, callbacks)
            waited = not cut.awaited or cut.resumed or now >= cut.start + cut.blocked_s + RESUME_GRACE_S
            if not cut.exports_asked and waited:
                call = cuts.exports_request(cut, p.ask_exports)  # a flush that awaited it asks as it resumes
                if call is not None:
                    callbacks.append(call)
                    return _AGAIN
            if cut.n_due > 0 and timeout > 0:
                if not block:
                    return _NOT_READY
                self.cv.wait(wait)
                continue
            # let the flush that waited for this cut resume before merging (it needs the GIL for
            # microseconds; merging may hold it for milliseconds), and ask for held states
            grace = cut.start + cut.blocked_s + RESUME_GRACE_S - now
            if cut.awaited and not cut.resumed and grace > 0:
                if not block:
                    return _NOT_READY
                self.cv.wait(grace)
                continue
            return cuts.take_oldest()


def _run(callbacks: list) -> None:
    """Call cut-closed callbacks outside the pipeline's lock (they wake other threads' loops)."""
    for cb in callbacks:
        try:
            cb()
        except Exception:  # noqa: BLE001 - a waiter that went away never breaks a cut
            logger.debug("forge_obs: a cut waiter failed", exc_info=True)
