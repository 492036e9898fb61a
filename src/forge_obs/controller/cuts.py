"""Which ranks a cut waits for, which answered, and where states that come late go.

    >>> book = CutBook(RankBook(), flush_timeout_s=5.0)
    >>> cut = book.open(0, None, ranks={("m", 0): "m/r0", ("m", 1): "m/r1"})
    >>> book.ack(cut, ("m", 0), ())
    >>> cut.n_left, cut.closed
    (1, False)
    >>> book.ack(cut, ("m", 1), ()); book.maybe_close(cut, [])
    >>> cut.closed, cut.n_due
    (True, 2)

No threads and no lock here: :class:`~forge_obs.controller.pipeline.FlushPipeline` owns a
:class:`CutBook` and calls it under its lock. A flush is a *cut* (:meth:`CutBook.open`, numbered
by ``seq``): every expected rank acknowledges (:meth:`CutBook.ack`), then its states come
(:meth:`CutBook.receive`). The cut is closed when every expected rank acknowledged, or when its
owner closes it at its timeout. A rank's ack may declare the meshes spawned from its process
(``children``), which it cut in turn: they are expected too. Ranks that miss a cut are
*lagging*: later cuts do not wait for them until they answer again.

States that arrive after their step left (a rank that was late), and the final states of a
stopping mesh, go into the first cut still open whose ``seq`` they may belong to (never an
earlier one), or are held for the next one, so no value is lost, counted twice, or put in a step
before the flush that cut it. Group leaders (:mod:`forge_obs.controller.aggregate`) answer for
several ranks at once: their bundles count each rank as received; a group whose leader did not
deliver in time is bypassed (:meth:`CutBook.bypass`) and its ranks' resent states are taken
once. Each cut keeps two counters (acks awaited, states awaited), adjusted on every change, so
that an ack, a state or a batch costs O(its ranks), not O(the cut's ranks).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from forge_obs.core.identity import rank_label
from forge_obs.wire.messages import ChildMesh, RankKey
from forge_obs.wire.plan import BYPASS_FRACTION

__all__ = ["BUNDLED_SEQS", "BUNDLED", "RankBook", "Cut", "CutBook", "Given"]

#: cuts whose ranks taken from bundles and resends, and bypassed leaders, are remembered (a
#: member keeps what it sent its leader for 32 cuts)
BUNDLED_SEQS = 64
#: ``Cut.received`` value of a rank whose states came merged in a bundle
BUNDLED = (None, None)
#: key of a held bundle (its step left before it arrived)
_BUNDLE_KEY = ("bundle",)


@dataclass
class RankBook:
    """What the controller knows about ranks, kept across ``init_backends``/``shutdown``
    sessions: their labels and identities, the meshes each one spawned, and which are lagging
    (did not answer a cut: dead, hung or slow), so that a new session does not wait for them."""

    labels: dict = field(default_factory=dict)  # rank -> label
    identities: dict = field(default_factory=dict)  # rank -> identity it last sent
    tree: dict = field(default_factory=dict)  # rank -> ranks of the live meshes it spawned
    lagging: set = field(default_factory=set)

    def label_of(self, key: RankKey) -> str:
        """A rank's label (:func:`~forge_obs.core.identity.rank_label`); a rank never labelled
        here (it never registered) is named by its mesh id."""
        return self.labels.get(key) or rank_label(str(key[0]), "", int(key[1]))

    def note_identity(self, rank_key: RankKey, identity: dict[str, Any] | None) -> None:
        """A rank's identity, as it sent it: it names the rank from now on."""
        if identity:
            self.identities[rank_key] = identity
            if identity.get("label"):
                self.labels[rank_key] = identity["label"]


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
    waiters: list = field(default_factory=list)  # called once it closes (FlushPipeline.on_cut_closed)
    given: "Given | None" = None  # a step gathered elsewhere (FlushPipeline.submit): what it was given


@dataclass(frozen=True)
class Given:
    """What a step gathered elsewhere (the SPMD logger's merge tree, :meth:`FlushPipeline.submit`)
    comes with, in place of what a cut learns from its ranks."""

    missing: list  # labels of the ranks absent from the step
    late: list  # labels of the ranks named late
    reported: int  # ranks whose states of the step it holds
    obs: dict  # the step's own obs/... values (they replace the pipeline's of the same name)


class CutBook:
    """The cuts of one session, oldest first (``pending``), and the states held for a cut not
    begun yet. ``book``: what is known of ranks, across sessions; ``leader_of``: rank -> the
    rank that leads its group on the aggregated route (:mod:`forge_obs.wire.plan`)."""

    def __init__(self, book: RankBook, flush_timeout_s: float, leader_of: dict | None = None) -> None:
        self.book = book
        self.flush_timeout_s = flush_timeout_s
        self.leader_of: dict[RankKey, RankKey] = {} if leader_of is None else leader_of
        self.pending: list[Cut] = []
        self.held: list[tuple[int, RankKey, dict, Any]] = []  # (min seq, rank, identity, snapshot)
        self.begun = 0  # cuts opened (each one's seq)
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

    @property
    def lagging(self) -> set:
        return self.book.lagging

    # ------------------------------------------------------------ opening and answering
    def open(self, step: int, local: Any, ranks: dict[RankKey, str] | None = None,
             stopping: dict[RankKey, str] | None = None, final: bool = False,
             groups: dict[RankKey, list[RankKey]] | None = None, called_at: float | None = None,
             raw_round_trip_s: float | None = None) -> Cut:
        """A new cut of ``step``, pending (see :meth:`FlushPipeline.begin_cut`); ``groups``: its
        leaders' groups, bypassed if a leader has not delivered ``BYPASS_FRACTION`` of
        ``flush_timeout_s`` after it began."""
        ranks = ranks or {}
        stopping = stopping or {}
        self.begun += 1
        now = time.monotonic()
        cut = Cut(seq=self.begun, step=step, deadline=now + self.flush_timeout_s, local=local, final=final, start=now,
                  called_at=now if called_at is None else called_at, sent_at=now, raw_round_trip_s=raw_round_trip_s)
        if groups:
            cut.groups = groups
            cut.bypass_at = now + BYPASS_FRACTION * self.flush_timeout_s
        labels, lagging, tree = self.book.labels, self.lagging, self.book.tree
        labels.update(ranks)
        labels.update(stopping)
        # a stopped mesh's lagging (dead) ranks will hand nothing over: not waited for
        stopping = {k: v for k, v in stopping.items() if k not in lagging}
        cut.expected = self._with_spawned(set(ranks) | set(stopping), list(ranks))
        cut.n_left = len(cut.expected) - len(lagging & cut.expected) if lagging else len(cut.expected)
        cut.finals = set(stopping)
        for k in stopping:  # stopped meshes drop out of the tree after this cut
            tree.pop(k, None)
        self.claim_held(cut)
        self.pending.append(cut)
        return cut

    def submit(self, step: int, states: Iterable[tuple], extra: Iterable[tuple], bundles: Iterable[Any],
               given: Given, final: bool) -> Cut:
        """A step whose cut was made and gathered elsewhere, closed and pending after every cut
        begun before it (see :meth:`FlushPipeline.submit`)."""
        self.begun += 1
        now = time.monotonic()
        cut = Cut(seq=self.begun, step=step, deadline=now, local=None, final=final, closed=True, start=now,
                  called_at=now, sent_at=now, closed_at=now, given=given)
        for key, identity, snapshot in states:
            cut.received[tuple(key)] = (identity, snapshot)
        cut.extra.extend((tuple(key), identity, snapshot) for key, identity, snapshot in extra)
        cut.bundles.extend(bundles)
        self.pending.append(cut)
        return cut

    def _with_spawned(self, expected: set, todo: list) -> set:
        """``expected`` and the ranks of the meshes spawned inside the processes of ``todo``, and theirs."""
        tree = self.book.tree
        while todo:
            for child in tree.get(todo.pop(), ()):
                if child not in expected:
                    expected.add(child)
                    todo.append(child)
        return expected

    def give_up(self, cut: Cut, keys: Iterable[RankKey]) -> None:
        """An aggregator stopped waiting for ``keys``: ``cut`` does not wait for them either."""
        lagging = self.lagging
        for k in keys:
            k = tuple(k)
            if k in cut.expected and k not in cut.acked and k not in lagging and k not in cut.given_up:
                cut.given_up.add(k)
                cut.n_left -= 1

    def ack(self, cut: Cut | None, rank_key: RankKey, children: Iterable[ChildMesh]) -> None:
        """``rank_key`` swapped its collector for ``cut`` (None: a cut that is gone) and cut the
        meshes it declares."""
        self._unlag(rank_key)
        live = self._declare(cut, children)
        if children or rank_key in self.book.tree:
            self.book.tree[rank_key] = live
        if cut is not None and rank_key not in cut.acked:
            cut.acked.add(rank_key)
            if rank_key in cut.given_up:
                cut.given_up.discard(rank_key)  # already not waited for
            elif rank_key in cut.expected:
                cut.n_left -= 1
            if rank_key not in cut.received:
                cut.n_due += 1

    def _declare(self, cut: Cut | None, children: Iterable[ChildMesh]) -> list[RankKey]:
        """The ranks of the meshes an ack declares are labelled and, while ``cut`` is open,
        expected; returns those of the live ones."""
        live: list[RankKey] = []
        labels, identities, lagging = self.book.labels, self.book.identities, self.lagging
        for mesh_id, size, name, actor, stopping in children or ():
            for r in range(int(size)):
                key = (mesh_id, r)
                if key not in identities:  # a rank's own identity names it best
                    labels[key] = rank_label(name, actor, r)
                if not stopping:
                    live.append(key)
                if cut is not None and not cut.closed:
                    if key not in cut.expected:
                        cut.expected.add(key)
                        if key not in lagging and key not in cut.acked:
                            cut.n_left += 1
                    if stopping:
                        cut.finals.add(key)
        return live

    def receive(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any) -> Cut | None:
        """What ``rank_key`` took at cut ``seq``; states of a cut that left go into the next one
        open (late). Returns the cut ``seq`` if it is pending."""
        self.book.note_identity(rank_key, identity)
        cut = self.find(seq)
        if cut is not None and rank_key not in cut.received:
            self._mark_received(cut, rank_key, (identity, snapshot))
        else:  # its step already left (the rank was late): the first cut still open takes it
            self.late_states += 1
            self._place(seq + 1, rank_key, identity, snapshot)
        return cut

    def receive_resent(self, seq: int, rank_key: RankKey, identity: dict[str, Any] | None,
                       snapshot: Any) -> tuple[bool, Cut | None]:
        """A state a rank resent (its leader failed): ``(taken, cut)``; not taken (counted) when
        a bundle or an earlier resend already brought it."""
        taken = _recent_setdefault(self._taken, seq)
        if rank_key in taken:
            self.duplicates_dropped += 1
            return False, None
        taken.add(rank_key)
        return True, self.receive(seq, rank_key, identity, snapshot)

    def receive_bundle(self, seq: int, ranks: list[RankKey], bundle: Any, identities: dict | None,
                       leader: RankKey | None, current: bool = True) -> tuple[bool, Cut | None]:
        """A group's merged states of cut ``seq``: ``(taken, cut)``. Dropped (counted) from a
        leader replaced since (not ``current``) or bypassed for ``seq``; a bundle whose step
        left goes into the first cut still open after ``seq``, as late states do."""
        if not current or leader in self._bypassed.get(seq, ()):
            self.fenced_bundles += 1
            return False, None
        _recent_setdefault(self._taken, seq).update(ranks)
        for key, ident in (identities or {}).items():
            self.book.note_identity(tuple(key), ident)
        cut = self.find(seq)
        if cut is not None and cut.received.keys().isdisjoint(ranks):
            for k in ranks:
                self._mark_received(cut, k, BUNDLED)
            cut.bundles.append(bundle)
            cut.delivered.add(leader)
        else:  # its step left (a late group): the first cut still open takes it
            self.late_states += len(ranks)
            for c in self.pending:
                if c.seq >= seq + 1:
                    c.bundles.append(bundle)
                    break
            else:
                self.held.append((seq + 1, _BUNDLE_KEY, {}, bundle))
        return True, cut

    def receive_final(self, last_seq: int, rank_key: RankKey, identity: dict[str, Any] | None, snapshot: Any,
                      callbacks: list) -> None:
        """A stopping rank's last states: they answer the first pending cut after ``last_seq``
        that expects them, or go into the first one open after it."""
        self.book.note_identity(rank_key, identity)
        self._unlag(rank_key)
        for cut in self.pending:
            if cut.seq > last_seq and rank_key in cut.finals and rank_key not in cut.received:
                self.ack(cut, rank_key, ())
                self._mark_received(cut, rank_key, (identity, snapshot))
                self.maybe_close(cut, callbacks)
                return
        self._place(last_seq + 1, rank_key, identity, snapshot)

    def forget_mesh(self, mesh_id: str, callbacks: list) -> None:
        """A mesh is gone for good: no cut waits for its ranks any more."""
        tree = self.book.tree
        for tree_key in [k for k in tree if k[0] == mesh_id]:
            del tree[tree_key]
        for kids in tree.values():
            kids[:] = [k for k in kids if k[0] != mesh_id]
        self.lagging.difference_update([k for k in self.lagging if k[0] == mesh_id])
        for cut in self.pending:
            cut.expected = {k for k in cut.expected if k[0] != mesh_id}
            self._recount(cut)
            self.maybe_close(cut, callbacks)

    # ------------------------------------------------------------ closing and leaving
    def maybe_close(self, cut: Cut, callbacks: list) -> None:
        """Close ``cut`` if no ack is awaited any more."""
        if not cut.closed and cut.n_left <= 0:
            self.close(cut, callbacks)

    def close(self, cut: Cut, callbacks: list) -> None:
        """End the wait for acknowledgements: ranks that did not answer are lagging from now on;
        the cut's waiters go into ``callbacks`` (to be called outside the owner's lock)."""
        if cut.closed:
            return
        cut.closed = True
        cut.closed_at = time.monotonic()
        cut.blocked_s = cut.closed_at - cut.start
        cut.awaited = bool(cut.waiters)
        cut.late = sorted(cut.expected - self.lagging - cut.acked, key=str)
        self._lag(self._to_blame(cut.late))
        callbacks.extend(cut.waiters)
        cut.waiters.clear()

    def take_oldest(self) -> tuple[Cut, list, list, int]:
        """The oldest cut leaves: its absent ranks are blamed, held late states of earlier cuts
        join it. Returns it with its missing and late labels and the number of cuts still pending."""
        cut = self.pending.pop(0)
        absent = cut.expected - cut.received.keys()
        if cut.given is None:
            self._lag(self._to_blame(absent - self.lagging))
        keep = []
        for item in self.held:
            min_seq, key, ident, snap = item
            if min_seq > cut.seq:
                keep.append(item)
            elif key is _BUNDLE_KEY:
                cut.bundles.append(snap)
            else:
                cut.extra.append((key, ident, snap))
        self.held = keep
        if cut.given is not None:
            return cut, cut.given.missing, cut.given.late, len(self.pending)
        missing = [self.book.label_of(k) for k in sorted(absent, key=str)]
        late = [self.book.label_of(k) for k in cut.late]
        return cut, missing, late, len(self.pending)

    def exports_due(self, cut: Cut) -> list[str]:
        """Once ``cut`` closed, at most once: the meshes whose ranks' states are still due (a
        large cut's ranks hold them until asked); the cut's deadline then leaves them a timeout
        of their own."""
        if cut.exports_asked or not cut.closed:
            return []
        cut.exports_asked = True
        meshes = sorted({k[0] for k in cut.expected if k not in cut.received and k not in self.lagging})
        if meshes:  # a cut closed by its timeout has none left for them
            cut.deadline = max(cut.deadline, time.monotonic() + self.flush_timeout_s)
        return meshes

    # ------------------------------------------------------------ the aggregated route
    def exports_request(self, cut: Cut, ask: "Callable | None") -> "Callable[[], None] | None":
        """The call of ``ask(seq, meshes)`` for the meshes whose ranks' states of ``cut`` are
        still due (:meth:`exports_due`); None when there is nothing to ask or no one to ask."""
        if ask is None:
            return None
        meshes = self.exports_due(cut)
        return functools.partial(ask, cut.seq, meshes) if meshes else None

    def bypass_requests(self, now: float, ask: "Callable | None", callbacks: list) -> float:
        """The calls of ``ask(seq, ranks)`` that ask the groups of the pending cuts past their
        bypass time to resend, into ``callbacks``; returns the next bypass time."""
        asks, next_bypass = self.due_bypasses(now)
        if ask is not None:
            callbacks.extend(functools.partial(ask, seq, ranks) for seq, ranks in asks)
        return next_bypass

    def due_bypasses(self, now: float) -> tuple[list[tuple[int, dict[str, list[int]]]], float]:
        """``([(seq, ranks by mesh to ask to resend), ...], next bypass time)`` for the pending
        cuts past their bypass time."""
        asks, next_bypass = [], math.inf
        for c in self.pending:
            if c.bypass_at <= now:
                ranks = self.bypass(c)
                if ranks:
                    asks.append((c.seq, ranks))
            else:
                next_bypass = min(next_bypass, c.bypass_at)
        return asks, next_bypass

    def bypass(self, cut: Cut) -> dict[str, list[int]]:
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
            _recent_setdefault(self._bypassed, cut.seq).add(lead)
            out.setdefault(lead[0], []).extend(m[1] for m in members)
        return out

    # ------------------------------------------------------------ internals
    def find(self, seq: int) -> Cut | None:
        for cut in self.pending:
            if cut.seq == seq:
                return cut
        return None

    def claim_held(self, cut: Cut) -> None:
        """Held bundles and final states that may go into ``cut`` go there now."""
        if not self.held:
            return
        keep = []
        for item in self.held:
            min_seq, key, ident, snap = item
            if key is _BUNDLE_KEY:
                if min_seq <= cut.seq:
                    cut.bundles.append(snap)
                else:
                    keep.append(item)
            elif key in cut.finals and key not in cut.received and min_seq <= cut.seq:
                self.ack(cut, key, ())
                self._mark_received(cut, key, (ident, snap))
            else:
                keep.append(item)
        self.held = keep

    def _place(self, min_seq: int, rank_key: RankKey, identity: dict | None, snapshot: Any) -> None:
        """Into the first open cut numbered ``min_seq`` or later, or held for the next one."""
        for cut in self.pending:
            if cut.seq >= min_seq:
                cut.extra.append((rank_key, identity, snapshot))
                return
        self.held.append((min_seq, rank_key, identity or {}, snapshot))

    def _mark_received(self, cut: Cut, rank_key: RankKey, value: Any) -> None:
        if rank_key in cut.received:
            return
        cut.received[rank_key] = value
        if rank_key in cut.acked and rank_key not in self.lagging:
            cut.n_due -= 1

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

    def _lag(self, keys: list[RankKey]) -> None:
        """``keys`` become lagging: no pending cut waits for them."""
        self.lagging.update(keys)
        for c in self.pending:
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
        for c in self.pending:
            if rank_key in c.acked:
                if rank_key not in c.received:
                    c.n_due += 1
            elif rank_key in c.expected and rank_key not in c.given_up:
                c.n_left += 1


def _recent_setdefault(by_seq: dict[int, set], seq: int) -> set:
    """``by_seq[seq]``, created if needed; only the last ``BUNDLED_SEQS`` cuts are kept."""
    got = by_seq.get(seq)
    if got is None:
        got = by_seq[seq] = set()
        while len(by_seq) > BUNDLED_SEQS:
            del by_seq[min(by_seq)]
    return got
