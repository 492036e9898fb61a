"""Controller side of a flush: cuts, step assembly, reduction, hand-off to backends.

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

No Monarch here: the controller actors feed this from the inbox's port. A flush is a *cut*
(``begin_cut``, numbered by ``seq``): every expected rank swaps its collector and acknowledges
(``ack``), then sends the states it took (``states``). The cut is closed when every expected
rank acknowledged, or ``flush_timeout_s`` after it began; ``flush`` returns then. A rank's ack
may declare the meshes spawned from its process (``children``), which it cut in turn: they are
expected too. Ranks that miss a cut are *lagging*: later cuts do not wait for them until they
answer again, and they are reported as missing in every step they are absent from.

Steps leave in the order their cuts began. A step waits for the states of every rank that
acknowledged its cut, or until its deadline. States that arrive after their step left (a rank
that was late), and the final states of a stopping mesh, go into the first cut still open whose
``seq`` they may belong to (never an earlier one), so no value is lost, counted twice, or put in
a step before the flush that cut it. Reduction runs in one worker thread, each backend on a
thread of its own (:mod:`forge_obs.controller.backend_worker`).

Group leaders (``"aggregate"``, :mod:`forge_obs.controller.aggregate`) answer for several ranks at once:
``ack_batch`` acknowledges each of them (and names those the leader gave up on), ``bundle``
counts each as received and carries their states merged; ``states_resent`` takes a state a
member resent after its leader failed, unless a bundle already brought it. A cut that knows its
groups (``begin_cut(groups=...)``) asks, through ``ask_resend``, the ranks of each group whose
leader has not delivered its bundle ``BYPASS_FRACTION`` of ``flush_timeout_s`` after it began to
resend directly, and drops that leader's bundles of the cut. Each cut keeps two
counters (acks awaited, states awaited), adjusted on every change, so that an ack, a state or a
batch costs O(its ranks), not O(the cut's ranks).

Raw values a rank streams between flushes (``stream``: ``per_rank_no_reduce``, under the rank's
predicted step) skip the assembly: they go to the streaming backends' queues at once. When the
step that then takes the rank's states is not the predicted one, the step's
``obs/stream_step_mismatch`` counts the values streamed under the prediction.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from forge_obs.backends.base import LoggerBackend, flattened_clashes
from forge_obs.backends.record import RankViews, StepRecord
from forge_obs.controller.backend_worker import DEFAULT_QUEUE_STEPS, BackendWorker
from forge_obs.controller.cut_timing import breakdown
from forge_obs.core.counters import add_count, add_counts
from forge_obs.core.identity import rank_label
from forge_obs.core.selfobs import CPU_PARTS, SELF_OBS, add_cpu
from forge_obs.core.types import LoggingMode, Metric
from forge_obs.core.warn import WARNER
from forge_obs.recording.collector import MetricCollector, Taken
from forge_obs.recording.reduce import KeyDrops, Reduce
from forge_obs.wire.bundle import loads_bundle
from forge_obs.wire.merge import merge_snapshots, reduce_snapshots, without_keys
from forge_obs.wire.plan import BYPASS_FRACTION
from forge_obs.wire.snapshot import decode_raw, loads, opened

__all__ = ["RankKey", "ChildMesh", "BUNDLED_SEQS", "RESUME_GRACE_S", "RankBook", "Cut", "FlushPipeline"]

logger = logging.getLogger("forge_obs")

RankKey = tuple  # (mesh_id, rank)
#: a mesh declared in an ack: (mesh_id, size, mesh name, actor label, stopping)
ChildMesh = tuple

_COLLECTOR = MetricCollector()
_COUNTERS = ("values_recorded", "dropped_values", "nonfinite_values", "stream_overflow", "stream_step_mismatch")
#: cuts whose ranks taken from bundles and resends, and bypassed leaders, are remembered (a
#: member keeps what it sent its leader for 32 cuts)
BUNDLED_SEQS = 64
#: how long the worker lets a flush that waited for a cut resume before merging its step
RESUME_GRACE_S = 0.002


@dataclass
class RankBook:
    """What the controller knows about ranks, kept across ``init_backends``/``shutdown``
    sessions: their labels and identities, the meshes each one spawned, and which are lagging
    (did not answer a cut: dead, hung or slow), so that a new session does not wait for them."""

    labels: dict = field(default_factory=dict)  # rank -> label
    identities: dict = field(default_factory=dict)  # rank -> identity it last sent
    tree: dict = field(default_factory=dict)  # rank -> ranks of the live meshes it spawned
    lagging: set = field(default_factory=set)


@dataclass
class Cut:
    """One flush: which ranks it waits for, which answered, and what they sent."""

    seq: int
    step: int
    deadline: float
    local: Any  # the controller's own Taken (exported by the worker) or a snapshot dict
    final: bool = False
    expected: set = field(default_factory=set)  # ranks that should take part
    finals: set = field(default_factory=set)  # ranks of stopping meshes: their final states are their answer
    acked: set = field(default_factory=set)
    received: dict = field(default_factory=dict)  # rank_key -> (identity, snapshot) of this cut
    extra: list = field(default_factory=list)  # (rank_key, identity, snapshot) late or final ones
    closed: bool = False
    late: list = field(default_factory=list)  # ranks that missed the cut (set when it closes)
    start: float = 0.0  # time.monotonic() when it began
    awaited: bool = False  # someone was waiting when it closed ...
    resumed: bool = False  # ... and has resumed since
    blocked_s: float = 0.0  # from begin to close: how long an awaiting flush blocks
    bundles: list = field(default_factory=list)  # merged states of groups of ranks (forge_obs.wire.bundle)
    given_up: set = field(default_factory=set)  # expected ranks an aggregator stopped waiting for
    groups: dict = field(default_factory=dict)  # leader -> its group's ranks (the aggregated route's)
    delivered: set = field(default_factory=set)  # leaders whose bundle of this cut was taken
    bypass_at: float = math.inf  # then groups whose leader did not deliver are asked to resend directly
    # kept by every change of acked / received / lagging / expected / given_up, so that each
    # check is O(1): n_left = expected, not lagging, not acked, not given up (acks awaited);
    # n_due = acked, not lagging, not received (states awaited)
    n_left: int = 0
    n_due: int = 0
    woke: bool = False  # the worker was woken once for this closed cut
    # where the caller's wait went (forge_obs.controller.cut_timing), time.monotonic()
    called_at: float = 0.0  # flush called
    sent_at: float = 0.0  # every mesh cast to
    closed_at: float = 0.0  # the last awaited ack taken, or the timeout
    resumed_at: float | None = None  # the awaiting caller resumed
    stamp: Any = None  # the closing rank's cut_timing.rank_stamp
    raw_round_trip_s: float | None = None  # the probe's raw round trip just before the cut
    exports_asked: bool = False  # the ranks holding their states for this cut were asked for them
    # a step gathered elsewhere (FlushPipeline.submit): (missing labels, late labels, ranks
    # reported, the step's own obs/... values)
    given: "tuple | None" = None
    _waiters: list = field(default_factory=list)


class FlushPipeline:
    """Cuts, step assembly and backend I/O in one worker thread; every public method is
    thread-safe (Monarch runs each actor on its own thread and loop; the inbox drains its port
    on a thread of its own)."""

    def __init__(
        self,
        backends: dict[str, LoggerBackend],
        run_id: str,
        flush_timeout_s: float = 10.0,
        process_name: str = "Controller",
        book: RankBook | None = None,
        shutdown_timeout_s: float = 30.0,
        queue_steps: int = DEFAULT_QUEUE_STEPS,
    ) -> None:
        self.backends = backends
        self.shutdown_timeout_s = shutdown_timeout_s
        # one thread and bounded queue per backend; the local store (jsonl) is fed first
        order = sorted(backends, key=lambda n: n != "jsonl")
        self.workers = [BackendWorker(n, backends[n], None if n == "jsonl" else queue_steps) for n in order]
        self.run_id = run_id
        self.flush_timeout_s = flush_timeout_s
        self.process_name = process_name
        self.book = book if book is not None else RankBook()
        self.labels: dict[RankKey, str] = self.book.labels
        self.identities: dict[RankKey, dict[str, Any]] = self.book.identities
        self.tree: dict[RankKey, list[RankKey]] = self.book.tree
        self._pending: list[Cut] = []
        self._held: list[tuple[int, RankKey, dict, dict]] = []  # (min seq, rank, identity, snapshot)
        self._cv = threading.Condition()  # guards everything above and the counters below
        self._closing = False
        self._seq = 0
        self._begun = 0
        self.assembled = 0  # cuts taken off the queue (a step handed to the backends, or none)
        self.steps_logged = 0  # steps handed to the backends
        self.late_states = 0
        self.fenced_bundles = 0  # bundles from a replaced or bypassed leader: dropped (its members resent their states)
        self.duplicates_dropped = 0  # resent states the controller already had
        # cut seq -> ranks whose states came in a bundle or were resent, for the last BUNDLED_SEQS
        # cuts: a state a member resends (its leader was replaced, is gone, or was bypassed) is
        # dropped if the controller already has it
        self._taken: dict[int, set] = {}
        # cut seq -> leaders bypassed for it (their members were asked to resend): their bundles
        # of that cut are dropped, so each member's states count once, from its resend
        self._bypassed: dict[int, set] = {}
        #: ``ask_resend(seq, {mesh_id: [rank, ...]})``: ask those ranks to resend their answer to
        #: cut ``seq`` directly (set by the controller; called on the worker thread, outside the lock)
        self.ask_resend: Callable[[int, dict[str, list[int]]], None] | None = None
        #: ``ask_exports(seq, [mesh_id, ...])``: cut ``seq`` closed, ask those meshes' ranks for
        #: the states they hold for it (large cuts, :meth:`LocalFetcherActor.export`); called
        #: once per cut, outside the lock, by the resumed flush or else the worker
        self.ask_exports: Callable[[int, list[str]], None] | None = None
        #: streamed values that could not be decoded, counted with the next step assembled
        self._stream_drops = KeyDrops()
        #: rank -> the rank that leads its group on the aggregated route (forge_obs.wire.plan)
        self.leader_of: dict[RankKey, RankKey] = {}
        self._worker = threading.Thread(target=self._work, name="forge_obs-backends", daemon=True)
        # per-rank reductions are only computed when some backend shows per-rank views
        self._need_per_rank = any(LoggingMode.PER_RANK_REDUCE in be.modes for be in backends.values())
        # raw values streamed between flushes go to these at once
        self._stream_workers = [w for w in self.workers if LoggingMode.PER_RANK_NO_REDUCE in w.backend.modes]

    @property
    def lagging(self) -> set:
        return self.book.lagging

    @property
    def need_per_rank(self) -> bool:
        """Whether a backend shows per-rank views (aggregated groups then carry each rank's states)."""
        return self._need_per_rank

    # ------------------------------------------------------------ lifecycle
    def label_of(self, key: RankKey) -> str:
        """A rank's label (:func:`~forge_obs.core.identity.rank_label`); a rank never labelled
        here (it never registered) is named by its mesh id."""
        return self.labels.get(key) or rank_label(str(key[0]), "", int(key[1]))

    def start(self) -> None:
        for w in self.workers:
            w.start()
        self._worker.start()

    async def drain(self, timeout_s: float | None = None) -> list[str]:
        """Wait until every begun step was assembled (each waits at most its deadline) and
        reached every backend; a backend still busy after ``timeout_s`` (default:
        ``shutdown_timeout_s``) is not waited for. Returns the names of those backends."""
        with self._cv:
            target = self._begun
        timeout = self.shutdown_timeout_s if timeout_s is None else timeout_s
        return await asyncio.get_running_loop().run_in_executor(None, self._wait_logged, target, timeout)

    def _wait_logged(self, target: int, timeout_s: float) -> list[str]:
        with self._cv:
            self._cv.wait_for(lambda: self.assembled >= target or not self._worker.is_alive())
        deadline = time.monotonic() + timeout_s
        return [w.name for w in self.workers if not w.wait_done(deadline)]

    async def close(self, timeout_s: float | None = None) -> list[str]:
        """Assemble every begun step, then let every backend log what it has queued and finish,
        waiting for the backends at most ``timeout_s`` (default: ``shutdown_timeout_s``) in all.
        Returns the names of the backends that did not finish."""
        timeout = self.shutdown_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            self._closing = True  # the worker assembles what is begun (each waits at most its deadline), then ends
            self._cv.notify_all()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._worker.join)
        deadline = time.monotonic() + timeout
        for w in self.workers:  # every backend logs its queue and finishes at the same time
            w.stop()
        finished = await loop.run_in_executor(None, lambda: [w.join(deadline) for w in self.workers])
        unfinished = [w.name for w, ok in zip(self.workers, finished) if not ok]
        if unfinished:
            logger.error("forge_obs: backend(s) %s did not finish within shutdown_timeout_s=%gs; left behind",
                         ", ".join(unfinished), timeout)
        return unfinished

    @property
    def backend_errors(self) -> int:
        return sum(w.errors for w in self.workers)

    def backend_report(self) -> dict[str, dict[str, Any]]:
        """Per backend: steps logged, dropped (queue full), errors, values it could not write, and
        the backend's own :meth:`~forge_obs.backends.base.LoggerBackend.meta_report` (for ``meta.json``)."""
        return {w.name: {"steps": w.done_steps, "dropped_steps": w.dropped_steps, "errors": w.errors,
                         **({"dropped_stream_values": w.dropped_stream_values} if w.dropped_stream_values else {}),
                         **({"skipped_values": n} if (n := getattr(w.backend, "skipped_values", 0)) else {}),
                         **({"finish_error": w.finish_error} if w.finish_error else {}),
                         **_own_report(w)} for w in self.workers}

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
        ranks = ranks or {}
        stopping = stopping or {}
        callbacks: list = []
        with self._cv:
            self._seq += 1
            now = time.monotonic()
            called = now if called_at is None else called_at
            cut = Cut(seq=self._seq, step=step, deadline=now + self.flush_timeout_s, local=local, final=final, start=now,
                      called_at=called, sent_at=now, raw_round_trip_s=raw_round_trip_s)
            if groups and self.ask_resend is not None:
                cut.groups = groups
                cut.bypass_at = now + BYPASS_FRACTION * self.flush_timeout_s
            self.labels.update(ranks)
            self.labels.update(stopping)
            # a stopped mesh's lagging (dead) ranks will hand nothing over: not waited for
            stopping = {k: v for k, v in stopping.items() if k not in self.lagging}
            expected = set(ranks) | set(stopping)
            todo = list(ranks)
            while todo:  # meshes spawned from inside those processes, and theirs
                for child in self.tree.get(todo.pop(), ()):
                    if child not in expected:
                        expected.add(child)
                        todo.append(child)
            cut.expected = expected
            cut.n_left = len(expected) - len(self.lagging & expected) if self.lagging else len(expected)
            cut.finals = set(stopping)
            for k in stopping:  # stopped meshes drop out of the tree after this cut
                self.tree.pop(k, None)
            self._claim_held(cut)
            self._pending.append(cut)
            self._begun += 1
            self._maybe_close(cut, callbacks)
            if cut.closed or cut.groups:
                # the worker learns of other cuts when they close or when its idle wait ends,
                # which is before their deadline (a wake-up now would compete with the cast)
                self._cv.notify_all()
        _run(callbacks)
        return cut

    def submit(self, step: int, *, states: Iterable[tuple] = (), extra: Iterable[tuple] = (),
                  bundles: Iterable[Any] = (), reported: int, missing: Iterable[str] = (), late: Iterable[str] = (),
                  final: bool = False, obs: dict[str, float] | None = None) -> Cut:
        """A step whose cut was made and gathered elsewhere (the SPMD logger's merge tree): built
        and handed to the backends after every cut begun before it, as a cut's step is, without
        waiting for anything. ``states``: ``(rank_key, identity, snapshot)`` of single ranks;
        ``extra``: the same, for states that join this step late (merged with the rank's own);
        ``bundles``: merged groups (:mod:`forge_obs.wire.bundle`); ``reported``: how many ranks'
        states of the step they hold; ``missing`` / ``late``: labels of the ranks absent / named
        late; ``obs``: ``obs/...`` values of the step's own (they replace the pipeline's of the
        same name); ``final``: as :meth:`begin_cut`'s."""
        with self._cv:
            self._seq += 1
            now = time.monotonic()
            cut = Cut(seq=self._seq, step=step, deadline=now, local=None, final=final, closed=True, start=now,
                      called_at=now, sent_at=now, closed_at=now,
                      given=(list(missing), list(late), int(reported), dict(obs or {})))
            for key, identity, snapshot in states:
                cut.received[tuple(key)] = (identity, snapshot)
            cut.extra.extend((tuple(key), identity, snapshot) for key, identity, snapshot in extra)
            cut.bundles.extend(bundles)
            self._pending.append(cut)
            self._begun += 1
            self._cv.notify_all()
        return cut

    def ack(self, seq: int, rank_key: RankKey, children: Iterable[ChildMesh] = (), stamp: Any = None,
            states: tuple | None = None) -> None:
        """A rank swapped its collector for cut ``seq`` (and cut the meshes it declares);
        ``stamp``: its :func:`~forge_obs.controller.cut_timing.rank_stamp`; ``states``:
        ``(identity, snapshot)`` when its states came with the ack (as :meth:`states` takes them)."""
        self.ack_batch(seq, [(rank_key, children, stamp)], states={tuple(rank_key): states} if states else None)

    def ack_batch(self, seq: int, items: Iterable[tuple], given_up: Iterable[RankKey] = (),
                  states: dict[RankKey, tuple] | None = None) -> None:
        """Each rank of ``items`` (``(rank_key, children[, stamp])``) acknowledged cut ``seq``; the ranks of
        ``given_up`` did not (their aggregator stopped waiting for them): the cut does not wait for
        them any more and names them late when it closes; ``states``: rank -> ``(identity,
        snapshot)`` that came with the acks, taken once a flush waiting for the acks was woken.
        O(len(items)) whatever the cut's size."""
        callbacks: list = []
        with self._cv:
            cut = self._find(seq)
            if cut is not None and not cut.closed:
                for k in given_up:
                    k = tuple(k)
                    if k in cut.expected and k not in cut.acked and k not in self.lagging and k not in cut.given_up:
                        cut.given_up.add(k)
                        cut.n_left -= 1
            for item in items:
                self._ack_locked(cut, tuple(item[0]), item[1])
                if cut is not None and not cut.closed:
                    cut.stamp = item[2] if len(item) > 2 else None
            if cut is not None:
                if self._held:
                    self._claim_held(cut)
                self._maybe_close(cut, callbacks)
            if not states:
                self._wake(cut)
        _run(callbacks)
        if states:
            with self._cv:
                for k, (identity, snapshot) in states.items():
                    cut = self._states(seq, k, identity, snapshot)
                self._wake(cut)

    def states(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> None:
        """What a rank took at cut ``seq``. States that a closed cut asked for are unpickled here
        as they come, while no flush waits, so that the step's assembly, once the last of them
        came, does not unpickle them all."""
        if isinstance(snapshot, bytes) and self._open_now(seq):
            snapshot = opened(snapshot)
        with self._cv:
            cut = self._states(seq, tuple(rank_key), identity, snapshot)
            self._wake(cut)

    def states_resent(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> None:
        """States a rank sent to an aggregator that was replaced or is gone, sent again: taken if
        this rank's states of cut ``seq`` did not arrive yet, dropped (counted) otherwise."""
        rank_key = tuple(rank_key)
        with self._cv:
            taken = self._taken_of(seq)
            if rank_key in taken:
                self.duplicates_dropped += 1
                return
            taken.add(rank_key)
            cut = self._states(seq, rank_key, identity, snapshot)
            self._wake(cut)

    def bundle(self, seq: int, ranks: Iterable[RankKey], bundle: Any, identities: dict | None = None,
               leader: RankKey | None = None) -> None:
        """The merged states of the group ``ranks`` for cut ``seq`` (:mod:`forge_obs.wire.bundle`;
        pickled bytes are decoded by the worker), from ``leader``: each rank counts as received; a
        bundle whose step already left goes into the first cut still open after ``seq``, as late
        states do. A bundle of a leader bypassed for ``seq`` is dropped (``fenced_bundles``): its
        ranks were asked to resend. ``identities``: the ranks' identities that changed since their
        last bundle."""
        ranks = [tuple(k) for k in ranks]
        leader = tuple(leader) if leader is not None else None
        with self._cv:
            if leader in self._bypassed.get(seq, ()):
                self.fenced_bundles += 1
                return
            self._taken_of(seq).update(ranks)
            for key, ident in (identities or {}).items():
                self._note_identity(tuple(key), ident)
            cut = self._find(seq)
            if cut is not None and cut.received.keys().isdisjoint(ranks):
                for k in ranks:
                    self._mark_received(cut, k, _BUNDLED)
                cut.bundles.append(bundle)
                cut.delivered.add(leader)
            else:  # its step left (a late group): the first cut still open takes it
                self.late_states += len(ranks)
                for c in self._pending:
                    if c.seq >= seq + 1:
                        c.bundles.append(bundle)
                        break
                else:
                    self._held.append((seq + 1, _BUNDLE_KEY, {}, bundle))
            self._wake(cut)

    def stream(self, rank_key: RankKey | None, label: str, step: int, rows: list, pickled: list = ()) -> None:
        """Raw values a rank streamed between flushes (``per_rank_no_reduce``), under its predicted
        step: handed to the streaming backends' queues at once, in arrival order. ``pickled``: the
        indices of values pickled one by one (:func:`forge_obs.wire.snapshot.encode_raw`); one that
        cannot be decoded here is left out, counted with the next step assembled."""
        if not rows or not self._stream_workers:
            return
        if pickled:
            lost = KeyDrops()
            rows = decode_raw(rows, pickled, lost.add)
            if lost:
                with self._cv:
                    self._stream_drops.merge(lost)
        ident = (self.identities.get(tuple(rank_key)) if rank_key is not None else None) or {}
        ident = dict(ident, label=label)
        entries = [(label, step, rows)]
        for w in self._stream_workers:
            w.put_stream(entries, {label: ident})

    def final(self, last_seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: dict[str, Any]) -> None:
        """A stopping rank's last states: recorded after cut ``last_seq`` (the last it took)."""
        rank_key = tuple(rank_key)
        callbacks: list = []
        with self._cv:
            self._note_identity(rank_key, identity)
            self._unlag(rank_key)
            for cut in self._pending:
                if cut.seq > last_seq and rank_key in cut.finals and rank_key not in cut.received:
                    self._ack_locked(cut, rank_key, ())
                    self._mark_received(cut, rank_key, (identity, snapshot))
                    self._maybe_close(cut, callbacks)
                    break
            else:
                self._place(last_seq + 1, rank_key, identity, snapshot)
            self._cv.notify_all()
        _run(callbacks)

    def forget_mesh(self, mesh_id: str) -> None:
        """A mesh is gone for good: no cut waits for its ranks any more."""
        callbacks: list = []
        with self._cv:
            for tree_key in [k for k in self.tree if k[0] == mesh_id]:
                del self.tree[tree_key]
            for kids in self.tree.values():
                kids[:] = [k for k in kids if k[0] != mesh_id]
            self.lagging.difference_update([k for k in self.lagging if k[0] == mesh_id])
            for cut in self._pending:
                cut.expected = {k for k in cut.expected if k[0] != mesh_id}
                self._recount(cut)
                self._maybe_close(cut, callbacks)
            self._cv.notify_all()
        _run(callbacks)

    def close_cut(self, cut: Cut) -> None:
        """End the wait for acknowledgements (the flush timed out): ranks that did not answer
        are lagging from now on."""
        callbacks: list = []
        with self._cv:
            self._close(cut, callbacks)
            self._cv.notify_all()
        _run(callbacks)

    def on_cut_closed(self, cut: Cut, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread) once ``cut`` is closed; at once if it is."""
        with self._cv:
            if not cut.closed:
                cut._waiters.append(callback)
                return
        callback()

    def resumed(self, cut: Cut) -> None:
        """The flush that waited for ``cut`` has resumed (the worker let it run first)."""
        with self._cv:
            cut.resumed = True
            cut.resumed_at = time.monotonic()
            self._cv.notify_all()

    def request_exports(self, cut: Cut) -> None:
        """Once ``cut`` closed: ask the meshes whose ranks' states are still due for them (a
        large cut's ranks hold them until then). At most once per cut; nothing if all came."""
        with self._cv:
            call = self._exports_call(cut)
        if call is not None:
            call()

    def _exports_call(self, cut: Cut) -> "Callable[[], None] | None":
        if cut.exports_asked or not cut.closed or self.ask_exports is None:
            return None
        cut.exports_asked = True
        meshes = sorted({k[0] for k in cut.expected if k not in cut.received and k not in self.lagging})
        if not meshes:
            return None
        # the states asked for now have a timeout of their own: a cut closed by its timeout
        # has none left for them
        cut.deadline = max(cut.deadline, time.monotonic() + self.flush_timeout_s)
        return functools.partial(self.ask_exports, cut.seq, meshes)

    def wait_cut(self, cut: Cut, timeout: float | None = None) -> bool:
        """Block until ``cut`` is closed (threads that cannot await); True if it closed."""
        with self._cv:
            return self._cv.wait_for(lambda: cut.closed, timeout)

    def known_ranks(self) -> int:
        with self._cv:
            return len(self.labels)

    # ------------------------------------------------------------ internals (under self._cv)
    def _taken_of(self, seq: int) -> set:
        """The ranks whose states of cut ``seq`` came in a bundle or a resend (the last
        ``BUNDLED_SEQS`` cuts are remembered)."""
        return _recent(self._taken, seq)

    def _bypass(self, cut: Cut) -> dict[str, list[int]]:
        """The groups of ``cut`` whose leader did not deliver its bundle while some of their ranks
        are awaited: from now on that leader's bundles of the cut are dropped. Returns their
        ranks (leader included) by mesh, to be asked to resend directly."""
        cut.bypass_at = math.inf
        out: dict[str, list[int]] = {}
        lag, received, expected = self.lagging, cut.received, cut.expected
        for lead, members in cut.groups.items():
            if lead in cut.delivered:
                continue
            if all(m in received or m in lag or m not in expected for m in members):
                continue
            _recent(self._bypassed, cut.seq).add(lead)
            out.setdefault(lead[0], []).extend(m[1] for m in members)
        return out

    def _open_now(self, seq: int) -> bool:
        """Whether states of cut ``seq`` may be unpickled now: it asked for them, and no cut is
        open (a waiting flush has the inbox thread's time for its acks)."""
        with self._cv:
            cut = self._find(seq)
            return cut is not None and cut.exports_asked and all(c.closed for c in self._pending)

    def _find(self, seq: int) -> Cut | None:
        for cut in self._pending:
            if cut.seq == seq:
                return cut
        return None

    def _note_identity(self, rank_key: RankKey, identity: dict[str, Any] | None) -> None:
        if identity:
            self.identities[rank_key] = identity
            if identity.get("label"):
                self.labels[rank_key] = identity["label"]

    def _recount(self, cut: Cut) -> None:
        """Both counters from scratch: O(ranks), only when a mesh is forgotten."""
        lag = self.lagging
        cut.n_left = sum(1 for k in cut.expected if k not in lag and k not in cut.acked and k not in cut.given_up)
        cut.n_due = sum(1 for k in cut.acked if k not in lag and k not in cut.received)

    def _to_blame(self, missed: Iterable[RankKey]) -> list[RankKey]:
        """Of the ranks that missed a cut, those that become lagging: not a member whose group
        leader missed it too (its answer waited in the leader's queue; the next plan gives the
        group another leader, and later cuts still wait for the member)."""
        missed = list(missed)
        lead = self.leader_of
        if not lead:
            return missed
        out = set(missed)
        lagging = self.lagging
        return [k for k in missed if (ld := lead.get(k)) is None or ld == k or (ld not in out and ld not in lagging)]

    def _lagged(self, keys: Iterable[RankKey]) -> None:
        """``keys`` just became lagging (already in self.lagging): no pending cut waits for them."""
        for c in self._pending:
            for k in keys:
                if k in c.acked:
                    if k not in c.received:
                        c.n_due -= 1
                elif k in c.expected and k not in c.given_up:
                    c.n_left -= 1

    def _unlag(self, rank_key: RankKey) -> None:
        """A lagging rank answered: the cuts that expect it wait for it again."""
        if rank_key not in self.lagging:
            return
        self.lagging.discard(rank_key)
        for c in self._pending:
            if rank_key in c.acked:
                if rank_key not in c.received:
                    c.n_due += 1
            elif rank_key in c.expected and rank_key not in c.given_up:
                c.n_left += 1

    def _ack_locked(self, cut: Cut | None, rank_key: RankKey, children: Iterable[ChildMesh]) -> None:
        self._unlag(rank_key)
        live: list[RankKey] = []
        for mesh_id, size, name, actor, stopping in children or ():
            for r in range(int(size)):
                key = (mesh_id, r)
                if key not in self.identities:  # a rank's own identity names it best
                    self.labels[key] = rank_label(name, actor, r)
                if not stopping:
                    live.append(key)
                if cut is not None and not cut.closed:
                    if key not in cut.expected:
                        cut.expected.add(key)
                        if key not in self.lagging and key not in cut.acked:
                            cut.n_left += 1
                    if stopping:
                        cut.finals.add(key)
        if children or rank_key in self.tree:
            self.tree[rank_key] = live
        if cut is not None and rank_key not in cut.acked:
            cut.acked.add(rank_key)
            if rank_key in cut.given_up:
                cut.given_up.discard(rank_key)  # already not waited for
            elif rank_key in cut.expected:
                cut.n_left -= 1
            if rank_key not in cut.received:
                cut.n_due += 1

    def _mark_received(self, cut: Cut, rank_key: RankKey, value: Any) -> None:
        if rank_key in cut.received:
            return
        cut.received[rank_key] = value
        if rank_key in cut.acked and rank_key not in self.lagging:
            cut.n_due -= 1

    def _wake(self, cut: Cut | None) -> None:
        """Wake the worker and cut waiters only when this may complete something: a closed cut
        whose states are all in, a cut that just closed, or a message for a cut that is gone. A
        wake-up per message would cost the controller a thread switch each for nothing."""
        if cut is None or (cut.closed and cut.n_due <= 0) or cut is not self._pending[0]:
            self._cv.notify_all()
        elif cut.closed and not cut.woke and not cut.awaited:  # an awaited one: when resumed
            cut.woke = True  # FlushWait.wait_cut and the worker's grace period
            self._cv.notify_all()

    def _claim_held(self, cut: Cut) -> None:
        """Held bundles and final states that may go into ``cut`` go there now."""
        keep = []
        for item in self._held:
            min_seq, key, ident, snap = item
            if key is _BUNDLE_KEY:
                if min_seq <= cut.seq:
                    cut.bundles.append(snap)
                else:
                    keep.append(item)
            elif key in cut.finals and key not in cut.received and min_seq <= cut.seq:
                self._ack_locked(cut, key, ())
                self._mark_received(cut, key, (ident, snap))
            else:
                keep.append(item)
        self._held = keep

    def _states(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> Cut | None:
        self._note_identity(rank_key, identity)
        cut = self._find(seq)
        if cut is not None and rank_key not in cut.received:
            self._mark_received(cut, rank_key, (identity, snapshot))
        else:  # its step already left (the rank was late): the first cut still open takes it
            self.late_states += 1
            self._place(seq + 1, rank_key, identity, snapshot)
        return cut

    def _place(self, min_seq: int, rank_key: RankKey, identity: dict | None, snapshot: dict) -> None:
        """Into the first open cut numbered ``min_seq`` or later, or held for the next one."""
        for cut in self._pending:
            if cut.seq >= min_seq:
                cut.extra.append((rank_key, identity, snapshot))
                return
        self._held.append((min_seq, rank_key, identity or {}, snapshot))

    def _maybe_close(self, cut: Cut, callbacks: list) -> None:
        if not cut.closed and cut.n_left <= 0:
            self._close(cut, callbacks)

    def _close(self, cut: Cut, callbacks: list) -> None:
        if cut.closed:
            return
        cut.closed = True
        cut.closed_at = time.monotonic()
        cut.blocked_s = cut.closed_at - cut.start
        cut.awaited = bool(cut._waiters)
        cut.late = sorted(cut.expected - self.lagging - cut.acked, key=str)
        newly = self._to_blame(cut.late)
        self.lagging.update(newly)
        self._lagged(newly)
        callbacks.extend(cut._waiters)
        cut._waiters.clear()

    def _next_step(self) -> "tuple[Cut, list, list, int] | None":
        """Block until the oldest cut is closed and its states are in, or it is past its
        deadline; None when closing. Meanwhile, groups of any pending cut whose leader did not
        deliver in time are asked to resend (:meth:`_bypass`)."""
        while True:
            callbacks: list = []
            try:
                with self._cv:
                    item = self._await_step(callbacks)
            finally:
                _run(callbacks)
            if item is not _AGAIN:
                return item

    def _await_step(self, callbacks: list) -> "tuple[Cut, list, list, int] | None | object":
        """:meth:`_next_step` under the lock; ``_AGAIN`` when ``callbacks`` hold resend requests
        to send first."""
        while True:
            if not self._pending:
                if self._closing:
                    return None
                self._cv.wait(self.flush_timeout_s)  # a cut begun meanwhile is due no earlier
                continue
            now = time.monotonic()
            next_bypass = self._due_bypasses(now, callbacks)
            if callbacks:
                return _AGAIN
            cut = self._pending[0]
            timeout = cut.deadline - now
            wait = min(timeout, next_bypass - now)
            if not cut.closed:
                if timeout > 0:
                    self._cv.wait(wait)
                    continue
                self._close(cut, callbacks)
            waited = not cut.awaited or cut.resumed or now >= cut.start + cut.blocked_s + RESUME_GRACE_S
            if not cut.exports_asked and waited:
                call = self._exports_call(cut)  # a flush that awaited it asks as it resumes
                if call is not None:
                    callbacks.append(call)
                    return _AGAIN
            if cut.n_due > 0 and timeout > 0:
                self._cv.wait(wait)
                continue
            # let the flush that waited for this cut resume before merging (it needs
            # the GIL for microseconds; merging may hold it for milliseconds)
            grace = cut.start + cut.blocked_s + RESUME_GRACE_S - now
            if cut.awaited and not cut.resumed and grace > 0:
                self._cv.wait(grace)
                continue
            return self._take_step()

    def _due_bypasses(self, now: float, callbacks: list) -> float:
        """Resend requests, into ``callbacks``, for the pending cuts past their bypass time;
        returns the next bypass time."""
        next_bypass = math.inf
        for c in self._pending:
            if c.bypass_at <= now:
                ranks = self._bypass(c)
                if ranks and self.ask_resend is not None:
                    callbacks.append(functools.partial(self.ask_resend, c.seq, ranks))
            else:
                next_bypass = min(next_bypass, c.bypass_at)
        return next_bypass

    def _take_step(self) -> "tuple[Cut, list, list, int]":
        """The oldest cut leaves: its absent ranks are blamed, held late states of earlier cuts
        join it. Returns it with its missing and late labels and the cuts still pending."""
        cut = self._pending.pop(0)
        absent = cut.expected - cut.received.keys()
        if cut.given is None:
            newly = self._to_blame(absent - self.lagging)
            self.lagging.update(newly)
            self._lagged(newly)
        extra = list(cut.extra)
        keep = []
        for item in self._held:
            min_seq, key, ident, snap = item
            if min_seq > cut.seq:
                keep.append(item)
            elif key is _BUNDLE_KEY:
                cut.bundles.append(snap)
            else:
                extra.append((key, ident, snap))
        self._held = keep
        if cut.given is None:
            missing = [self.label_of(k) for k in sorted(absent, key=str)]
            late = [self.label_of(k) for k in cut.late]
        else:
            missing, late = cut.given[0], cut.given[1]
        cut.extra = extra
        return cut, missing, late, len(self._pending)

    # ------------------------------------------------------------ worker thread
    def _work(self) -> None:
        while True:
            item = self._next_step()
            if item is None:
                break
            p, missing, late, pending = item
            cpu0 = time.thread_time()
            try:
                t0 = time.perf_counter()
                record = self._build(p, missing, late, pending)
                if record is not None:
                    record.global_metrics.append(Metric("obs/merge_s", time.perf_counter() - t0, Reduce.MAX))
                    for w in self.workers:
                        w.put(record)
                    self.steps_logged += 1
            except Exception:  # noqa: BLE001 - a bug here must not stop later steps
                logger.exception("forge_obs: step %s could not be assembled", p.step)
            finally:
                SELF_OBS.add("pipeline", time.thread_time() - cpu0)
                with self._cv:
                    self.assembled += 1
                    self._cv.notify_all()

    def _build(self, p: Cut, missing: list, late: list, pending: int) -> StepRecord | None:
        drops = KeyDrops()  # keys left out after leaving their rank (here or on a leader)
        with self._cv:
            drops.merge(self._stream_drops)
            self._stream_drops.clear()
        on_drop = drops.add
        entries = self._decoded_entries(p, drops)
        bundles = self._decoded_bundles(p, drops)
        tally = _Tally(p.step)
        by_label: dict[str, list[dict]] = {}  # rank label -> its snapshots (the step's own, late/final ones)
        sources: dict[str, dict] = {}
        for ident, snap in entries:
            label = ident.get("label") or str(ident)
            by_label.setdefault(label, []).append(snap)
            sources[label] = ident
            tally.add(snap)
        rank_snaps, raw = _rank_snapshots(by_label, on_drop)
        global_snaps = list(rank_snaps.values())
        conflict_keys = self._add_bundles(bundles, tally, drops, global_snaps, rank_snaps, raw, sources)
        overflows: list[str] = []
        global_metrics = reduce_snapshots(global_snaps, on_drop=on_drop, on_overflow=overflows.append)
        if conflict_keys:  # recorded with two reductions in some group: dropped everywhere, as within a rank
            global_metrics = [m for m in global_metrics if m.key not in conflict_keys]
            for k in conflict_keys:
                drops.add(k, "reduction_mismatch")
        clashes = flattened_clashes(global_metrics)
        if clashes:
            global_metrics, rank_snaps = _without_clashes(clashes, global_metrics, rank_snaps, drops)
        # per-rank Metrics are built only if a backend reads them (JSONL reads plain values)
        per_rank = RankViews(rank_snaps) if self._need_per_rank else {}
        if p.final and not global_snaps and not raw:
            return None  # nothing was recorded after the last flush
        tally.overflows = len(overflows)
        obs = self._obs_metrics(p, tally, drops, len(missing), len(late), pending, len(bundles))
        global_metrics.extend(Metric(k, float(v), Reduce.SUM) for k, v in obs.items())
        return StepRecord(step=p.step, run_id=self.run_id, wall_time=time.time(), global_metrics=global_metrics,
                          per_rank=per_rank, raw=raw, sources=sources, missing=missing, late=late)

    def _decoded_bundles(self, p: Cut, drops: KeyDrops) -> list[dict]:
        """The step's bundles, decoded; one that cannot be is counted, the other groups arrive."""
        bundles = []
        for i, b in enumerate(p.bundles):
            try:
                bundles.append(loads_bundle(b, drops.add))
            except Exception as e:  # noqa: BLE001 - counted; the other groups arrive
                logger.error("forge_obs: a bundle for step %s could not be decoded: %r", p.step, e)
                drops.add(("bundle", i), "undecodable")
        return bundles

    def _add_bundles(self, bundles: list[dict], tally: "_Tally", drops: KeyDrops, global_snaps: list,
                     rank_snaps: dict, raw: dict, sources: dict) -> set:
        """Add each group's merge (:mod:`forge_obs.wire.bundle`) to the step; returns the keys a
        group saw recorded with two reductions."""
        conflict_keys: set = set()
        for b in bundles:
            merged = b["merged"]
            if merged.get("packed") or merged.get("states"):
                global_snaps.append(merged)
            tally.add(merged, b.get("streamed", ()))
            conflict_keys.update(b["conflicts"])
            drops.merge(b["drops"])
            for key, vals in (b.get("raw") or {}).items():
                raw.setdefault(self.label_of(tuple(key)), []).extend(vals)
            if self._need_per_rank:  # per-rank views: each rank's own snapshot, batched
                for key in b["ranks"]:
                    ident = self.identities.get(tuple(key))
                    if ident:
                        sources[self.label_of(tuple(key))] = ident
                for key, snap in (b.get("per_rank") or {}).items():
                    label = self.label_of(tuple(key))
                    rank_snaps[label] = merge_snapshots([rank_snaps[label], snap], drops.add) if label in rank_snaps else snap
        return conflict_keys

    def _obs_metrics(self, p: Cut, tally: "_Tally", drops: KeyDrops, missing: int, late: int, pending: int,
                     bundles: int) -> dict[str, float]:
        """The step's ``obs/...`` keys: forge_obs's own view of the step."""
        c, own_cpu = tally.counters, tally.own_cpu
        by_reason = add_counts(dict(tally.rank_drops), drops.counts())
        return {
            "obs/values_recorded": c["values_recorded"],
            "obs/dropped_values": c["dropped_values"] + drops.total(),
            **{f"obs/dropped/{reason}": n for reason, n in sorted(by_reason.items()) if n},
            "obs/nonfinite_values": c["nonfinite_values"] + tally.overflows,
            "obs/stream_overflow": c["stream_overflow"],
            "obs/stream_step_mismatch": c["stream_step_mismatch"],
            # forge_obs's own CPU, all processes, up to this step's assembly
            "obs/cpu_s": sum(own_cpu.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS),
            **{f"obs/cpu_{part}_s": own_cpu.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS},
            "obs/flush_blocked_s": p.blocked_s,
            "obs/backend_s": max((w.last_s for w in self.workers), default=0.0),
            "obs/pending_steps": pending,
            "obs/missing_ranks": missing,
            "obs/late_ranks": late,
            "obs/late_states": self.late_states,
            "obs/backend_errors": self.backend_errors,
            "obs/backend_dropped_steps": sum(w.dropped_steps for w in self.workers),
            "obs/backend_dropped_stream_values": sum(w.dropped_stream_values for w in self.workers),
            "obs/ranks_reported": len(p.received) if p.given is None else p.given[2],
            "obs/bundles": bundles,
            "obs/fenced_bundles": self.fenced_bundles,
            "obs/duplicates_dropped": self.duplicates_dropped,
            **breakdown(p.called_at, p.sent_at, p.closed_at, p.resumed_at, p.stamp),
            **({} if p.raw_round_trip_s is None else {"obs/raw_round_trip_s": p.raw_round_trip_s}),
            **({} if p.given is None else p.given[3]),
        }

    def _decoded_entries(self, p: Cut, drops: KeyDrops) -> list[tuple[dict, dict]]:
        """(identity, snapshot) of every rank in the step, decoded here (snapshots travel
        pickled); one that cannot be decoded is counted and left out, the others arrive."""
        raw_entries = []
        local = p.local
        if isinstance(local, Taken):
            try:
                local = _COLLECTOR.export(local, packed=True)
            except Exception as e:  # noqa: BLE001 - the controller's own values; the ranks' still arrive
                logger.error("forge_obs: the controller's values of step %s could not be exported: %r", p.step, e)
                for k in local.accs:
                    drops.add(k, "export_error")
                local = None
        if local is not None:
            raw_entries.append(({"label": self.process_name, "mesh": self.process_name, "rank": 0}, local))
        raw_entries.extend(v for v in p.received.values() if v is not _BUNDLED)
        for key, ident, snap in p.extra:
            raw_entries.append((ident or self.identities.get(key) or {"label": self.labels.get(key, str(key))}, snap))
        entries = []
        for ident, snap in raw_entries:
            try:
                entries.append((ident or {}, loads(snap, drops.add)))
            except Exception as e:  # noqa: BLE001
                logger.error("forge_obs: states of %s for step %s could not be decoded: %r",
                             (ident or {}).get("label"), p.step, e)
                drops.add(("states", (ident or {}).get("label")), "undecodable")
        return entries

#: ``received`` value of a rank whose states came merged in a bundle
_BUNDLED = (None, None)
#: what :meth:`FlushPipeline._await_step` returns when requests are to be sent before it waits on
_AGAIN = object()
#: key of a held bundle (its step left before it arrived)
_BUNDLE_KEY = ("bundle",)


class _Tally:
    """What a step's snapshots count: their counters (numbers by name), the values the ranks
    dropped (by reason), forge_obs's own CPU (this process's so far, plus each snapshot's)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.rank_drops: dict[str, int] = {}
        self.own_cpu: dict[str, float] = SELF_OBS.take()  # read now, not a step later
        self.overflows = 0

    def add(self, snap: dict, streamed: Iterable = ()) -> None:
        """A snapshot's (or a bundle's merged) counters and CPU; ``streamed``: a group's
        ``(values streamed early, under step)`` pairs."""
        counters = snap.get("counters") or {}
        for early, step in streamed:  # raw values streamed under a predicted step: was it this one?
            if early and step != self.step:
                self.counters["stream_step_mismatch"] += early
        early = counters.get("streamed_early")
        if early and counters.get("streamed_step") != self.step:
            self.counters["stream_step_mismatch"] += early
        for k, v in counters.items():
            if k in ("streamed_early", "streamed_step"):
                continue
            if isinstance(v, dict):  # dropped_by_reason
                add_counts(self.rank_drops, v)
            elif isinstance(v, (int, float)):
                add_count(self.counters, k, v)
        add_cpu(self.own_cpu, snap.get("self_cpu"))


def _rank_snapshots(by_label: dict[str, list[dict]], on_drop: Any) -> tuple[dict[str, dict], dict[str, list]]:
    """Each rank's snapshots of the step merged into one (``label -> snapshot``, ranks that
    recorded nothing left out), and their raw values (``label -> [(key, value, ts)]``)."""
    rank_snaps: dict[str, dict] = {}
    raw: dict[str, list] = {}
    for label, snaps in by_label.items():
        for snap in snaps:
            if snap.get("raw"):
                raw.setdefault(label, []).extend(snap["raw"])
        snap = snaps[0] if len(snaps) == 1 else merge_snapshots(snaps, on_drop)
        if snap.get("states") or snap.get("packed"):
            rank_snaps[label] = snap
    return rank_snaps, raw


def _own_report(w: BackendWorker) -> dict[str, Any]:
    """A backend's ``meta_report()``; nothing if it raises (or is still running: left behind)."""
    if not w.finished:
        return {}
    try:
        return dict(w.backend.meta_report() or {})
    except Exception as e:  # noqa: BLE001 - meta.json is written anyway
        logger.error("forge_obs: backend %r: meta_report() failed: %r", w.name, e)
        return {}


def _recent(by_seq: dict[int, set], seq: int) -> set:
    """``by_seq[seq]``, created if needed; only the last ``BUNDLED_SEQS`` cuts are kept."""
    got = by_seq.get(seq)
    if got is None:
        got = by_seq[seq] = set()
        while len(by_seq) > BUNDLED_SEQS:
            del by_seq[min(by_seq)]
    return got


def _without_clashes(clashes: dict[str, str], metrics: list, rank_snaps: dict, drops: KeyDrops) -> tuple[list, dict]:
    """The step without the keys equal to a name another key is flattened to (``lat/p50``
    beside a distribution ``lat``): reserved, so that no backend writes two values under one
    name. Each is counted once (``reserved_key``), with a rate-limited warning."""
    for key, parent in clashes.items():
        drops.add(key, "reserved_key")
        WARNER.warn("reserved_key", key, f"{key!r} is a name {parent!r} is written under ({parent!r} is a dict, e.g. a "
                    f"distribution: {parent}/<field>); dropped from the step (counted in obs/dropped_values): rename it")
    metrics = [m for m in metrics if m.key not in clashes]
    return metrics, {label: without_keys(snap, clashes) for label, snap in rank_snaps.items()}


def _run(callbacks: list) -> None:
    """Call cut-closed callbacks outside the pipeline's lock (they wake other threads' loops)."""
    for cb in callbacks:
        try:
            cb()
        except Exception:  # noqa: BLE001 - a waiter that went away never breaks a cut
            logger.debug("forge_obs: a cut waiter failed", exc_info=True)
