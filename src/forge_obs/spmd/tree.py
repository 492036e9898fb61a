"""Which step a node helper hands on, when, and who is absent: the bookkeeping of one helper of
an SPMD job's merge tree (no I/O, no threads: :mod:`forge_obs.spmd.helper` feeds it).

    >>> t = Tree(local_ranks=[0, 1], children={}, timeout_s=10.0, root=True)
    >>> t.cut(0, step=5, flushed_at=100.0, data=b"r0")
    >>> t.ready(now=100.1, horizon=100.1)          # rank 1 not in yet, 10 s to go
    []
    >>> t.cut(1, step=5, flushed_at=100.2, data=b"r1")
    >>> [(s.step, s.n_ranks, sorted(s.missing)) for s in t.ready(now=100.3, horizon=100.3)]
    [(5, 2, [])]
    >>> t.cut(0, step=6, flushed_at=101.0, data=b"r0")
    >>> [(s.step, sorted(s.missing), sorted(s.late)) for s in t.ready(now=111.5, horizon=111.5)]
    [(6, [1], [1])]
    >>> t.cut(0, step=7, flushed_at=112.0, data=b"r0")  # rank 1 is lagging: not waited for
    >>> [(s.step, sorted(s.missing), sorted(s.late)) for s in t.ready(now=112.0, horizon=112.0)]
    [(7, [1], [])]

A helper's *sources* are its node's ranks (one cut per step each) and its child helpers (one
*main piece* per step each: their subtree's cuts merged, naming the subtree's ranks that are
not in it). A step is begun by the first cut or piece of it; it is *due* from every source
that is not lagging, gone or finished. It is handed on, in step order, once nothing is due, or:

- by a helper that has a parent: ``deadline_fraction`` x ``timeout_s`` after the step's first
  flush (on its own clock): it sends its main piece without the sources still due, which are
  lagging from then on (not waited for until they deliver again). Their cuts, when they come,
  go up as later pieces of the step; the root decides who is missing.
- by the root (the logger helper): once its *horizon* is ``timeout_s`` past the step's first
  flush. The horizon is the time before which every cut the ranks shipped has been read (by
  this helper, or by the helper below that reports it): a rank is named missing only when it
  did not ship the step within ``timeout_s`` of the step's flush, never because a helper read
  late. Ranks named missing are lagging: later steps do not wait for them until a cut of theirs
  arrives (a rank that comes back is counted again). A rank whose connection closed (its
  process ended) is named missing at once, in every later step.

A rank that flushes a later step without an earlier one *skipped* it: its values are in the
later step, and it is neither awaited nor missing in the skipped one, whatever the order its
cuts and the others' are read in (the step begun before or after its later cut, its connection
closed since or not). A child that delivers a later step first names its ranks the same way:
the ranks in that piece skipped the step; those absent from it are awaited (a later piece of
the step counts them in it, once; one of a later step, or a later main piece with them in it,
names them skipped). So every step a helper hands on accounts for each rank below it once: in
it, skipped, missing, or finished before it. Cuts of a step already handed on are *late*: a
helper sends them up as a later piece of their step (before its main pieces of later steps);
the root puts them into the next step it emits (counted, never dropped, never twice).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["Tree", "Step", "Late", "DEADLINE_FRACTION"]

#: a helper with a parent sends a step's main piece this fraction of ``timeout_s`` after its
#: first flush at the latest, so that what it has reaches the root within the root's timeout
DEADLINE_FRACTION = 0.5


@dataclass(slots=True)
class _Source:
    """One source of a helper: a rank of its node (``rank``) or a child helper (``child``)."""

    key: tuple  # ("rank", r) | ("child", index)
    ranks: frozenset  # the ranks it answers for
    last_step: "int | None" = None  # the latest step it delivered (main)
    lagging: bool = False
    gone: bool = False
    final_step: "int | None" = None  # a rank: the step of its final cut
    done: set = field(default_factory=set)  # a child: ranks of its subtree that finished
    done_at: dict = field(default_factory=dict)  # ... and the step of their final cut
    # a child: ranks absent from its latest main piece -> the latest step a later piece of theirs
    # was of (None: none since)
    behind: dict = field(default_factory=dict)


@dataclass(slots=True)
class Step:
    """One step at a helper: what its sources delivered so far, and (once handed on) who is not
    in it. ``cuts``: ``(rank, data)`` of the node's ranks; ``pieces``: child pieces' bundles."""

    step: int
    t0: float  # the earliest flush of the step among what arrived
    due: set  # keys of the sources awaited
    delivered: set = field(default_factory=set)  # keys of the sources whose cut / main piece is in
    skipped_src: set = field(default_factory=set)  # keys of sources that flushed a later step first
    cuts: list = field(default_factory=list)
    pieces: list = field(default_factory=list)
    n_ranks: int = 0
    absent: set = field(default_factory=set)  # ranks children's main pieces lack (minus later pieces)
    skipped: set = field(default_factory=set)  # ranks that skipped the step
    got: set = field(default_factory=set)  # ranks of children's later pieces of the step
    held_back: int = 0
    finished: list = field(default_factory=list)
    reports: dict = field(default_factory=dict)
    nbytes: int = 0
    # set when handed on
    missing: set = field(default_factory=set)  # ranks not in it (a parent's piece: its absent)
    late: set = field(default_factory=set)  # ranks named missing for the first time (the root)
    early: bool = False  # handed on before its time: a memory bound was reached
    late_in: list = field(default_factory=list)  # the root: late cuts / pieces that join this step
    late_ranks: int = 0  # ... and how many ranks' states they carry


@dataclass(slots=True)
class Late:
    """Cuts or pieces of a step already handed on (a helper's later piece of that step)."""

    step: int
    t0: float
    cuts: list = field(default_factory=list)
    pieces: list = field(default_factory=list)
    ranks: set = field(default_factory=set)
    n_ranks: int = 0
    held_back: int = 0
    finished: list = field(default_factory=list)
    reports: dict = field(default_factory=dict)
    nbytes: int = 0


class Tree:
    """The bookkeeping of one helper (see the module docstring). ``local_ranks``: its node's
    ranks; ``children``: child helper index -> the ranks of its subtree; ``root``: the logger
    helper (it names ranks missing; the others hand steps up)."""

    def __init__(self, *, local_ranks: Iterable[int], children: dict[int, Iterable[int]], timeout_s: float,
                 root: bool, deadline_fraction: float = DEADLINE_FRACTION, max_pending_bytes: int = 1 << 28) -> None:
        self.timeout_s = float(timeout_s)
        self.root = root
        self.wait_s = self.timeout_s * (1.0 if root else deadline_fraction)
        self.max_pending_bytes = max_pending_bytes
        self.sources: dict[tuple, _Source] = {}
        for r in local_ranks:
            self.sources[("rank", int(r))] = _Source(("rank", int(r)), frozenset([int(r)]))
        for i, ranks in children.items():
            self.sources[("child", int(i))] = _Source(("child", int(i)), frozenset(int(r) for r in ranks))
        self.ranks = frozenset().union(*(s.ranks for s in self.sources.values())) if self.sources else frozenset()
        self.pending: dict[int, Step] = {}  # step -> Step, not handed on yet
        self._order: list[int] = []  # the pending steps, a heap (the oldest first)
        self.last_out: "int | None" = None  # the latest step handed on
        self.late: dict[int, Late] = {}  # a parent's later pieces, by step, to send
        self.late_root: list = []  # the root: late cuts / pieces for the next step emitted
        self.late_root_ranks = 0
        self.lagging: set = set()  # the root: ranks named missing, not answered since
        self.gone: set = set()  # ranks whose process ended without its final cut
        self.finished: dict[int, int] = {}  # rank -> the step of its final cut (every rank below)
        self.pending_bytes = 0
        self.with_absent: set = set()  # pending steps that await ranks children's pieces lack
        self.counts = {"late_states": 0, "early_steps": 0}

    # ------------------------------------------------------------ what arrives
    def cut(self, rank: int, *, step: int, flushed_at: float, data: bytes, held_back: int = 0, final: bool = False,
            report: "dict | None" = None) -> None:
        """A cut of the node's rank ``rank``."""
        src = self.sources[("rank", rank)]
        self._unlag(src, (rank,))
        self._skips(src, step)
        if final:
            src.final_step = step
            self.finished[rank] = step
            self._leave(src, after=step)
        st = self._step_for(src, step, flushed_at)
        if st is None:  # late
            late = self._late(step, flushed_at)
            late.cuts.append((rank, data))
            self._late_add(late, (rank,), 1, held_back, [rank] if final else [], {rank: report} if final else {},
                           len(data))
            return
        st.delivered.add(src.key)
        st.due.discard(src.key)
        st.cuts.append((rank, data))
        st.n_ranks += 1
        st.held_back += held_back
        if final:
            st.finished.append(rank)
            st.reports[rank] = report
        self._grow(st, len(data))

    def piece(self, child: int, p: Any) -> None:
        """A child helper's :class:`~forge_obs.wire.messages.Piece`."""
        src = self.sources[("child", child)]
        for r in p.finished:
            src.done.add(r)
            src.done_at[r] = p.step
            self.finished[r] = p.step
        if not p.main:
            self._extra(src, p, tuple(p.ranks))
            return
        self._unlag(src, [r for r in self.lagging if r in src.ranks and r not in p.absent and r not in p.skipped]
                    if self.lagging else ())
        src.behind = {r: src.behind.get(r) for r in p.absent}
        self._seen(p.step, lambda r: r in src.ranks and r not in src.behind)
        self._skips(src, p.step)
        st = self._step_for(src, p.step, p.flushed_at)
        if st is None:  # its step left here already: a later piece of it
            ranks = tuple(r for r in src.ranks if r not in p.absent and r not in p.skipped
                          and not (r in src.done_at and src.done_at[r] < p.step))
            self._extra(src, p, ranks)
            return
        st.delivered.add(src.key)
        st.due.discard(src.key)
        self._take_piece(st, p)
        self._await(st, p.absent)
        st.skipped.update(p.skipped)

    def status(self, child: int, gone: Iterable[int]) -> None:
        """A child helper names ranks of its subtree whose process ended."""
        gone = [r for r in gone if r not in self.gone]
        if gone:
            self.gone.update(gone)
            self.lagging.difference_update(gone)

    def rank_gone(self, rank: int) -> None:
        """The node's rank ``rank`` closed its connection (its process ended)."""
        src = self.sources[("rank", rank)]
        src.gone = True
        if src.final_step is None:
            self.gone.add(rank)
            self.lagging.discard(rank)
        self._leave(src)

    def child_gone(self, child: int) -> None:
        """A child helper closed its connection: ranks of its subtree that did not finish are gone."""
        src = self.sources[("child", child)]
        src.gone = True
        self.gone.update(r for r in src.ranks if r not in src.done)
        self.lagging.difference_update(src.ranks)
        self._leave(src)

    # ------------------------------------------------------------ what leaves
    def ready(self, now: float, horizon: float) -> list[Step]:
        """The steps to hand on now, in step order: complete ones, and those past their time
        (the root: by ``horizon``; a helper with a parent: by ``now``), or the oldest ones while
        the pending states exceed ``max_pending_bytes``."""
        out = []
        clock = horizon if self.root else now
        while self.pending:
            st = self.pending[self._order[0]]
            if self._complete(st):
                out.append(self._hand_on(st, timed_out=False))
            elif clock >= st.t0 + self.wait_s:
                out.append(self._hand_on(st, timed_out=True))
            elif self.pending_bytes > self.max_pending_bytes:
                self.counts["early_steps"] += 1
                st.early = True
                out.append(self._hand_on(st, timed_out=False))
            else:
                break
        return out

    def drain(self) -> list[Step]:
        """Every pending step, handed on as it is (the session ends: nothing more will come)."""
        out = [self._hand_on(self.pending[s], timed_out=False) for s in sorted(self.pending)]
        self._order.clear()
        if self.root and self.late_root:  # late states and nothing after them: one more step
            last = self.last_out if self.last_out is not None else 0
            st = Step(step=last + 1, t0=0.0, due=set())
            self.last_out = last + 1
            self._attach_late(st)
            out.append(st)
        return out

    def take_late(self) -> list[Late]:
        """A helper with a parent: the later pieces to send (by step)."""
        out = [self.late[s] for s in sorted(self.late)]
        self.late.clear()
        return out

    def next_due(self) -> "float | None":
        """When the oldest pending step is due to leave (its clock's time), if any is pending."""
        if not self.pending:
            return None
        return self.pending[self._order[0]].t0 + self.wait_s

    def done(self) -> bool:
        """Every source finished or is gone, and nothing is pending."""
        return not self.pending and all(s.gone or s.final_step is not None for s in self.sources.values()
                                        if s.key[0] == "rank") and all(s.gone for s in self.sources.values()
                                                                       if s.key[0] == "child")

    def waiting(self) -> list[int]:
        """The ranks whose final cut did not arrive and whose process did not end."""
        return sorted(r for r in self.ranks if r not in self.finished and r not in self.gone)

    # ------------------------------------------------------------ internals
    def _step_for(self, src: _Source, step: int, flushed_at: float) -> "Step | None":
        """The pending step ``step`` (begun now if it is new), or None when it is late here."""
        src.last_step = step if src.last_step is None else max(src.last_step, step)
        st = self.pending.get(step)
        if st is not None:
            if flushed_at < st.t0:
                st.t0 = flushed_at
            return st
        if self.last_out is not None and step <= self.last_out:
            return None
        return self._begin(step, flushed_at, src)

    def _begin(self, step: int, flushed_at: float, src: "_Source | None" = None) -> Step:
        due = {k for k, s in self.sources.items() if self._owes(s, step)}
        st = self.pending[step] = Step(step=step, t0=flushed_at, due=due)
        heapq.heappush(self._order, step)
        for s in self.sources.values():  # delivered a later step first: skipped this one (as in _skips),
            if s is not src and s.last_step is not None and s.last_step > step:  # gone since or not
                self._skip_src(st, s)
        return st

    def _owes(self, s: _Source, step: int) -> bool:
        if s.lagging or s.gone:
            return False
        if s.final_step is not None and s.final_step < step:
            return False
        if s.key[0] == "child" and s.ranks and s.ranks <= (s.done | self.gone):
            return False
        return s.last_step is None or s.last_step < step

    def _skips(self, src: _Source, step: int) -> None:
        """``src`` delivers ``step``: pending earlier steps it did not deliver, it skipped (all of
        them when ``step`` is its first delivery: its cuts / pieces arrive in step order)."""
        last = src.last_step
        if (last is not None and step <= last + 1) or not self.pending:
            return
        if last is None:
            last = min(self.pending) - 1
        for s in (range(last + 1, step) if step - last < len(self.pending) else sorted(self.pending)):
            st = self.pending.get(s)
            if st is not None and last < s < step and src.key not in st.delivered:
                st.due.discard(src.key)
                self._skip_src(st, src)

    def _skip_src(self, st: Step, src: _Source) -> None:
        """``src`` delivered a later step than ``st`` first. A rank: it skipped ``st``. A child:
        its ranks in its first main piece after ``st`` skipped it (had one of them flushed ``st``,
        the child would have begun ``st``); those absent from that piece are awaited, unless a later
        piece of theirs since was of a later step (skipped) or of ``st`` (delivered). Which of the
        child's ranks skipped is settled when ``st`` leaves (:meth:`_skipped_of`)."""
        st.skipped_src.add(src.key)
        if src.key[0] == "rank":
            st.skipped.update(src.ranks)
            return
        self._await(st, [r for r, last in src.behind.items() if last is None or last < st.step])

    def _await(self, st: Step, ranks: Iterable[int]) -> None:
        st.absent.update(ranks)
        if st.absent:
            self.with_absent.add(st.step)

    def _seen(self, step: int, delivered) -> None:
        """Ranks of a child (``delivered(rank)``) delivered ``step``: in the pending steps before
        it that await them, they skipped (a child hands its pieces on in step order, later
        pieces first, so a cut of theirs of those steps would have come before)."""
        for s in [s for s in self.with_absent if s < step]:
            st = self.pending[s]
            moved = {r for r in st.absent if delivered(r)}
            if moved:
                st.absent -= moved
                st.skipped |= moved
                if not st.absent:
                    self.with_absent.discard(s)

    def _skipped_of(self, st: Step) -> set:
        """The ranks of children that skipped ``st`` as a whole: neither awaited nor in it."""
        out = set()
        for k in st.skipped_src:
            if k[0] == "child":
                src = self.sources[k]
                out.update(r for r in src.ranks if r not in st.absent and r not in st.got
                           and not (r in src.done_at and src.done_at[r] < st.step))
        return out

    def _leave(self, src: _Source, after: "int | None" = None) -> None:
        """``src`` will deliver nothing (more) for the pending steps (after ``after``)."""
        for s, st in self.pending.items():
            if after is None or s > after:
                st.due.discard(src.key)

    def _unlag(self, src: _Source, ranks: Iterable[int]) -> None:
        src.lagging = False
        if self.lagging:
            self.lagging.difference_update(ranks)

    def _take_piece(self, st: Any, p: Any) -> None:
        st.pieces.append(p.bundle)
        st.n_ranks += p.n_ranks
        st.held_back += p.held_back
        st.finished.extend(p.finished)
        st.reports.update(p.reports)
        if p.flushed_at < st.t0:
            st.t0 = p.flushed_at
        if isinstance(st, Step):
            self._grow(st, len(p.bundle))

    def _extra(self, src: _Source, p: Any, ranks: tuple) -> None:
        """Ranks of a child's subtree that came after its main piece (``ranks``)."""
        if self.lagging:
            self.lagging.difference_update(ranks)
        for r in ranks:
            if r in src.behind:
                last = src.behind[r]
                src.behind[r] = p.step if last is None else max(last, p.step)
        self._seen(p.step, set(ranks).__contains__)
        st = self.pending.get(p.step)
        if st is None and (self.last_out is None or p.step > self.last_out):
            st = self._begin(p.step, p.flushed_at)  # not begun here yet: it is begun by this piece
        if st is not None:
            self._take_piece(st, p)
            st.absent.difference_update(ranks)
            st.got.update(ranks)
            return
        late = self._late(p.step, p.flushed_at)
        late.pieces.append(p.bundle)
        self._late_add(late, ranks, p.n_ranks, p.held_back, list(p.finished), dict(p.reports), len(p.bundle))

    def _late(self, step: int, flushed_at: float) -> Late:
        late = self.late.get(step)
        if late is None:
            late = self.late[step] = Late(step=step, t0=flushed_at)
        return late

    def _late_add(self, late: Late, ranks: Iterable[int], n: int, held_back: int, finished: list, reports: dict,
                  nbytes: int) -> None:
        late.ranks.update(ranks)
        late.n_ranks += n
        late.held_back += held_back
        late.finished.extend(finished)
        late.reports.update(reports)
        late.nbytes += nbytes
        if self.root:  # into the next step emitted
            self.counts["late_states"] += n
            self.late_root.append(self.late.pop(late.step))
            self.late_root_ranks += n

    def _grow(self, st: Step, nbytes: int) -> None:
        st.nbytes += nbytes
        self.pending_bytes += nbytes

    def _complete(self, st: Step) -> bool:
        if st.due:
            return False
        if not self.root or not st.absent:
            return True
        return st.absent <= (self.lagging | self.gone | self._done_before(st.step, st.absent))

    def _done_before(self, step: int, ranks: set) -> set:
        fin = self.finished
        return {r for r in ranks if r in fin and fin[r] < step}

    def _hand_on(self, st: Step, timed_out: bool) -> Step:
        """``st`` leaves: who is not in it; sources it waited for in vain are lagging."""
        del self.pending[st.step]
        self.with_absent.discard(st.step)
        if self._order and self._order[0] == st.step:
            heapq.heappop(self._order)
        self.pending_bytes -= st.nbytes
        self.last_out = st.step if self.last_out is None else max(self.last_out, st.step)
        missing = set(st.absent)
        for k, s in self.sources.items():
            if k in st.delivered or k in st.skipped_src:
                continue
            if k[0] == "rank":
                if s.final_step is None or s.final_step >= st.step:
                    missing.update(s.ranks)
            else:
                missing.update(r for r in s.ranks if not (r in s.done_at and s.done_at[r] < st.step))
            if timed_out and k in st.due:
                s.lagging = True
        st.skipped |= self._skipped_of(st)
        st.skipped -= st.got
        missing -= st.skipped
        missing -= self._done_before(st.step, missing)
        if self.root:
            if not st.early:
                st.late = missing - self.lagging - self.gone
                self.lagging |= st.late
            self._attach_late(st)
        st.missing = missing
        return st

    def _attach_late(self, st: Step) -> None:
        st.late_in, self.late_root = self.late_root, []
        st.late_ranks, self.late_root_ranks = self.late_root_ranks, 0
