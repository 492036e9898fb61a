"""The critical path of one controller step: walk back from the step's end to its start, at each
moment into the dependency that finished last (the classic critical path of a span graph).

The walk covers ``[lo, hi]`` of a span: the dependency that ended last before ``hi`` is on the
path (covered recursively), then the walk goes on from that dependency's start; time no
dependency explains is the span's own (``self``). Dependencies, in the order they are trusted:

1. after a dependency reached by a flow (or inferred), the flow's previous point: what that
   span waited for (a rollout's ``buffer_add`` waited for its ``reference_logprobs``, ...);
2. exact links: the span's children on its own track, the spans opened by endpoint calls made
   under it (link ``call``: the call carried its context), and spans of other tracks or processes
   that share its flow id and ran within it;
3. inferred (controller spans only): a top-level span of another track or process that ran
   entirely inside a stretch of the controller span that 1. and 2. leave unexplained (or, for
   the stretch from the step's start, ended inside it: work carried over from the previous
   step), unless its flow ties it to another step's controller span that it started during, or
   a call's context ties it to its caller (an exact link is never replaced by an inferred one).

Among spans of one mesh that finished together (a collective: every rank leaves the all-reduce
at once), the one that spent least in waits (``wait_spans``) is on the path: the straggler the
others waited for. A wait span on the path (``grad_allreduce``) is on it only from the moment
the last rank of its mesh entered the same span; before that, the path runs through what that
last rank did (link ``collective``). A collective without a wait span is found the same way on
the ranks of a mesh that compute (not a controller): a span whose peers of the same name ended
with it, one of them having started later, waited inside for that peer; a stretch of a span's own
time between its children, during which a peer's span ended, waited for that peer (the last to
arrive). Either way the path goes on through the rank that entered last.

A dependency that never ended (a span left open: its process died or hangs) is on the path up
to where its waiter resumed (or the step ended), marked unfinished: what the waiter waited on.
A dependency whose process was busy, until it began, with a span of another request (its last
span, which ended at most ``tie_s`` or a quarter of its duration before, and after the waiter's
stretch began) waited for that span (link ``queued``: a blocked event loop, an actor's mailbox).

Clocks: a dependency on another host may appear to end after the span that awaited it (the
clock offsets are one-way estimates). Causality wins: the dependency is placed to end where the
waiter resumed, keeping its measured duration, so no part of the path runs backwards in time.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

from forge_obs.analysis.critical_path.graph import Graph, Span, Window, roots_between

__all__ = ["PathConfig", "Segment", "Walker"]

DEFAULT_WAIT_SPANS = (r"wait|idle|allreduce|all_reduce|allgather|all_gather|reduce_scatter|barrier|collective|recv"
                      r"|sleep|queue")


@dataclass(kw_only=True, slots=True)
class PathConfig:
    """Settings of the critical-path walk (``forge-obs why --set NAME=VALUE``)."""

    #: span names that wait on others (the doctor's ``wait_spans``): never the answer's cause
    wait_spans: str = DEFAULT_WAIT_SPANS
    #: a dependency on another host may appear to end up to this long after its waiter resumed
    #: (clock offset estimates are one-way); it is then placed to end where the waiter resumed
    skew_tol_s: float = 0.05
    #: spans of one mesh ending within this of each other ended together (a collective)
    tie_s: float = 0.002

    def __post_init__(self) -> None:
        re.compile(self.wait_spans)
        for k in ("skew_tol_s", "tie_s"):
            v = float(getattr(self, k))
            if v < 0:
                raise ValueError(f"critical path setting {k} must be >= 0, got {v!r}")
            setattr(self, k, v)


@dataclass(slots=True)
class Segment:
    """``[start, end]`` (µs, in causal order) of the path spent in ``span`` itself; ``link``:
    how the walk reached ``span`` (``root``, ``nested``, ``call``, ``flow``, ``inferred``, ``collective``);
    ``gap``: time no span explains (a waiting span's own time around the dependencies it
    awaited: work outside any span, or a message in transit)."""

    span: Span
    start: int
    end: int
    link: str
    gap: bool = False


class Walker:
    def __init__(self, g: Graph, cfg: PathConfig | None = None) -> None:
        self.g = g
        self.cfg = cfg or PathConfig()
        self.wait_re = re.compile(self.cfg.wait_spans)
        self.skew = int(self.cfg.skew_tol_s * 1e6)
        self.tie = int(self.cfg.tie_s * 1e6)
        self.used: set = set()
        self._names: dict | None = None
        self._peer_index: tuple | None = None
        self._stream_roots: dict | None = None
        self.win_lo = 0  # the start of the step being walked
        self.root: Span | None = None  # its root
        self._wait_names: dict[str, bool] = {}
        self.who: dict = {}  # id(stream) -> its identity fields (the summary's)
        #: flow -> the controller step span that carries it: a span sharing it that started
        #: during that step belongs to that step
        self.step_flows = {w.root.flow: w.root for w in g.windows if w.root is not None and w.root.flow is not None}

    # ------------------------------------------------------------------ the walk
    def path(self, w: Window) -> list:
        """The path of step window ``w``, as :class:`Segment` in time order."""
        root = w.root or self._virtual(w)
        self.used = {root}
        self.win_lo, self.root = w.start, root
        out: list = []
        self._cover(root, w.start, w.end, 0, "root", out, (root,))
        out.reverse()
        return out

    def _cover(self, node: Span, lo: int, hi: int, shift: int, link: str, out: list, anc: tuple) -> None:
        """Appends (latest first) the segments of ``[lo, hi]`` inside ``node``; ``shift`` moves the
        spans on ``node``'s host into causal order (see the module docstring)."""
        is_wait = self.is_wait(node.name)
        computes = self._computes(node)
        if node.parent is not None and is_wait:
            if self._collective(node, lo, hi, shift, link, out, anc):
                return
        elif node is not self.root and computes:
            last = self._entered_last(node, hi)
            if last is not None:
                t = self._through_peer(node, last, lo, hi, shift, link, out, anc, joined=True)
                if t > lo:
                    out.append(Segment(node, lo, t, link))
                return
        exact = self._exact(node, lo, hi, shift)
        t, chain, after = hi, None, None
        waits = node.ctl or is_wait  # its own time is waiting, not work
        deps = False
        host, tie = node.host, self.tie
        peers = computes and bool(node.children)
        while t > lo:
            d, how = self._next_dep(node, exact, chain, lo, t, shift, anc)
            q = self._blocker(after, node, anc) if after is not None else None
            d_e = (d.end + shift if d.host == host else d.end) if d is not None else 0
            q_e = (q.end + shift if q.host == host else q.end) if q is not None else 0
            # the process of the dependency just covered was busy until it started, within this stretch
            queued = q is not None and q is not d and q_e > lo and (d is None or q_e > min(d_e, t) + tie)
            if queued:
                d, how, d_e = q, "queued", q_e
            gap_lo = min(d_e, t) if d is not None else lo
            if peers and t - gap_lo > tie:
                p = self._arrived_last(node, gap_lo, t, shift, anc)
                if p is not None:  # the stretch waited for a peer rank: the path goes on through it
                    t, chain, deps = self._through_peer(node, p, lo, t, shift, link, out, anc), None, True
                    continue
            if d is None:
                break
            self.used.add(d)
            d_end = max(min(d_e, t), lo)  # the stretch's own time never starts before it
            if d.unfinished:  # never ended: on the path from its start until its waiter resumed
                d_shift = shift if d.host == host else 0
                d_start = max(d.start + d_shift, lo)
            else:
                d_start = max(d_end - d.dur, lo)
                d_shift = d_end - d.end
            if d_end < t:
                out.append(Segment(node, d_end, t, link, waits))
            self._cover(d, d_start, d_end, d_shift, how, out, anc + (d,))
            t = d_start
            deps = True
            if not queued:  # the flow of the dependency a blocker held up goes on after the blocker
                chain = d if d.flow is not None and how != "nested" else None
            after = d if how != "nested" and d.stream is not node.stream else None
        if t > lo:  # before its first dependency; a waiting span without any waited on nothing seen
            out.append(Segment(node, lo, t, link, waits and (deps or is_wait)))

    def _next_dep(self, node: Span, exact: list, chain: Span | None, lo: int, t: int, shift: int,
                  anc: tuple) -> tuple:
        """The dependency of ``node`` that ended last by ``t`` and how it is linked: the flow
        predecessor of ``chain`` (the dependency just covered), else an exact link, else (a
        controller span) an inferred one for the stretch the exact ones leave."""
        d = self._pred(chain, node, lo, t, shift, anc) if chain is not None else None
        if d is not None:
            return d, "flow"
        d = self._pick(exact, t, lo, node, shift) if exact else None
        how = "flow" if d is None else "nested" if d.parent is node or node.lane == -1 else \
            "call" if d.caller is node else "flow"
        if node.ctl:
            # after a dependency that never ended, a finished waiter went on to what it started next
            gap_lo = lo if d is None else d.start if d.unfinished and not node.unfinished else \
                min(d.end + shift if d.host == node.host else d.end, t)
            early = gap_lo <= lo <= self.win_lo + self.tie and self._steps_track(node)
            cands = self._inferred(node, max(gap_lo, lo), t, shift, anc, early)
            inf = self._pick(cands, t, lo, node, shift) if cands else None
            if inf is not None:
                d, how = inf, "inferred"
        return d, how

    def _blocker(self, after: Span, node: Span, anc: tuple) -> Span | None:
        """The last top-level span of ``after``'s process that ended before ``after`` began, if
        it ended at most ``tie_s`` (or a quarter of its own duration: the scheduling of a loaded
        host) before: the process was busy with it (one request behind another: a blocked event
        loop, an actor's mailbox), so ``after`` waited for it (link ``queued``)."""
        start, stream = after.start, after.stream
        ends, roots = self._roots_of(stream)
        a, b = bisect.bisect_left(ends, start - self.skew * 20), bisect.bisect_right(ends, start)
        best = None
        for s in roots[a:b]:
            if s.start < start and s is not after and not s.unfinished and (best is None or s.end > best.end):
                best = s
        if best is None or best in self.used or best in anc or \
                after.start - best.end > max(self.tie, best.dur // 4):
            return None
        return best

    def _roots_of(self, stream: Any) -> tuple:
        """``(ends, roots)``: the top-level spans of ``stream``, by end (in the graph's order)."""
        if self._stream_roots is None:
            acc: dict = {}
            for s in self.g.roots:
                acc.setdefault(id(s.stream), []).append(s)
            self._stream_roots = {k: ([s.end for s in v], v) for k, v in acc.items()}
        return self._stream_roots.get(id(stream), ((), ()))

    def _collective(self, node: Span, lo: int, hi: int, shift: int, link: str, out: list, anc: tuple) -> bool:
        """``node`` waits in a collective: the rank of its mesh that entered the same span last
        kept it waiting; the path goes on through what that rank did before."""
        starts, peers = self._by_name().get((node.mesh, node.name), ((), ()))
        last = None
        a, b = bisect.bisect_right(starts, node.start), bisect.bisect_right(starts, node.end)
        for p in peers[a:b]:
            if p.stream is not node.stream and node.start < p.start <= node.end and p.parent is not None \
                    and (last is None or p.start > last.start):
                last = p
        if last is None:
            return False
        p_start = min(max(last.start + (shift if last.host == node.host else 0), lo), hi)
        out.append(Segment(node, p_start, hi, link))
        if p_start > lo:
            par = last.parent
            p_shift = (shift if par.host == node.host else 0)
            self._cover(par, lo, p_start, p_shift, "collective", out, anc + (par,))
        return True

    def _by_name(self) -> dict:
        """(mesh, wait span name) -> (starts, spans) by start."""
        if self._names is None:
            acc: dict = {}
            is_wait = self.is_wait
            for s in self.g.spans:  # by start already
                if is_wait(s.name):
                    acc.setdefault((s.mesh, s.name), []).append(s)
            self._names = {k: ([s.start for s in v], v) for k, v in acc.items()}
        return self._names

    def _peers(self) -> tuple:
        """Spans of the processes of a mesh that computes (not a controller) with two or more
        processes: ((mesh, name) -> (starts, spans) by start, mesh -> (ends, spans) by end)."""
        if self._peer_index is None:
            streams: dict = {}
            for st in self.g.run.streams.values():
                if not st.header.get("ctl"):
                    streams.setdefault(st.mesh, set()).add(id(st))
            multi = {m for m, ids in streams.items() if len(ids) > 1}
            by_name: dict = {}
            by_end: dict = {}
            for s in self.g.spans:  # by start
                if s.mesh in multi and not s.ctl and s.stream is not None:
                    by_name.setdefault((s.mesh, s.name), []).append(s)
                    by_end.setdefault(s.mesh, []).append(s)
            for v in by_end.values():
                v.sort(key=lambda s: s.end)
            self._peer_index = ({k: ([s.start for s in v], v) for k, v in by_name.items()},
                                {k: ([s.end for s in v], v) for k, v in by_end.items()})
        return self._peer_index

    def _computes(self, node: Span) -> bool:
        """Whether ``node`` runs on a rank of a mesh of several processes that computes (its
        waits in collectives are waits for the rank that arrived last)."""
        if node.stream is None or node.ctl or node.lane == -1:
            return False
        return node.mesh in (self._peer_index or self._peers())[1]

    def _entered_last(self, node: Span, hi: int) -> Span | None:
        """A peer's span of ``node``'s name that started clearly later than ``node`` (by more
        than ``tie_s`` and 5 % of ``node``) and ended with it (within ``tie_s``, or a tenth of
        the difference of their starts): a collective inside made ``node`` wait for it. The
        one that started last."""
        starts, spans = (self._peer_index or self._peers())[0].get((node.mesh, node.name), ((), ()))
        lo_start = node.start + max(self.tie, node.dur // 20)
        a, b = bisect.bisect_right(starts, lo_start), bisect.bisect_right(starts, hi)
        last = None
        for p in spans[a:b]:
            if p.stream is node.stream or p.unfinished or p in self.used:
                continue
            if abs(p.end - node.end) <= max(self.tie, (p.start - node.start) // 10) and (last is None or p.start > last.start):
                last = p
        return last

    def _arrived_last(self, node: Span, lo: int, hi: int, shift: int, anc: tuple) -> Span | None:
        """The span of a peer rank of ``node`` that ended last within ``(lo + tie_s, hi]``, a
        stretch of ``node``'s own time: ``node`` waited in a collective for that rank."""
        ends, spans = (self._peer_index or self._peers())[1].get(node.mesh, ((), ()))
        a = bisect.bisect_right(ends, lo + self.tie - self.skew)
        b = bisect.bisect_right(ends, hi + self.skew)
        best, best_e = None, None
        used, host, stream = self.used, node.host, node.stream
        for p in spans[a:b]:
            if p.stream is stream or p.unfinished or p in used or p in anc:
                continue
            e = p.end + shift if p.host == host else p.end
            if lo + self.tie < e <= hi and (best is None or e > best_e or (e == best_e and p.dur > best.dur)):
                best, best_e = p, e
        return best

    def _through_peer(self, node: Span, p: Span, lo: int, t: int, shift: int, link: str, out: list, anc: tuple,
                      joined: bool = False) -> int:
        """The path of ``[lo, t]`` of ``node`` goes through peer span ``p`` (``joined``: ``p``
        ran to ``t`` with ``node``; else ``node`` waited from ``p``'s end to ``t``), then
        through what ``p``'s process did before it (its parent); returns where ``node``'s own
        walk goes on."""
        self.used.add(p)
        p_end = t if joined else min(self._end(p, node, shift), t)
        if p_end < t:
            out.append(Segment(node, p_end, t, link))
        p_shift = (shift if p.host == node.host else 0) if joined else p_end - p.end
        p_start = min(max(p.start + p_shift, lo), p_end)
        self._cover(p, p_start, p_end, p_shift, "collective", out, anc + (p,))
        t = p_start
        par = p.parent
        if par is not None and t > lo and par not in self.used:
            par_start = min(max(par.start + p_shift, lo), t)
            if par_start < t:
                self.used.add(par)
                self._cover(par, par_start, t, p_shift, "collective", out, anc + (par,))
                t = par_start
        return t

    # ------------------------------------------------------------------ dependencies
    def _end(self, s: Span, node: Span, shift: int) -> int:
        """``s``'s end in the walk's time: shifted with ``node`` when on ``node``'s host."""
        return s.end + shift if s.host == node.host else s.end

    def _tol(self, s: Span, node: Span) -> int:
        return 0 if s.host == node.host else self.skew

    def _exact(self, node: Span, lo: int, hi: int, shift: int) -> list:
        out = node.children + node.called
        if node.flow is not None:
            host, skew, stream, lane = node.host, self.skew, node.stream, node.lane
            for s in self.g.flows.get(node.flow, ()):
                if s is node or (s.stream is stream and s.lane == lane):
                    continue
                same = s.host == host
                tol = 0 if same else skew
                if s.start + (shift if not tol else 0) >= node.start + shift - tol and \
                        (s.unfinished or (s.end + shift if same else s.end) <= hi + tol):
                    out.append(s)
        return out

    def _steps_track(self, node: Span) -> bool:
        """Whether ``node`` runs on the step's own track (the step span or a span in it; for a
        step without a step span, the controller's spans in the step)."""
        r = self.root
        return node is r or (node.stream is r.stream and node.lane == r.lane) or (r.lane == -1 and node in r.children)

    def _inferred(self, node: Span, lo: int, hi: int, shift: int, anc: tuple, early: bool) -> list:
        """Top-level spans of other tracks that ran entirely inside ``(lo, hi]`` (``early``: the
        stretch starts with the step, and a span that began before it and ended inside counts
        too: work carried over from the previous step that the step found running)."""
        out = []
        skew, host, stream, lane, owners = self.skew, node.host, node.stream, node.lane, self.step_flows
        for s in roots_between(self.g, lo - skew, hi + skew):
            if s.caller is not None or (s.stream is stream and s.lane == lane) or s in anc:
                continue
            owner = owners.get(s.flow)
            if owner is not None and owner not in anc and s.start <= owner.end + (0 if s.host == owner.host else skew):
                continue  # another step's work
            if s.host == host:
                tol, e = 0, s.end + shift
            else:
                tol, e = skew, s.end
            if e <= hi + tol and e > lo and (early or s.start + (e - s.end) >= lo - tol):
                out.append(s)
        return out

    def _pred(self, d: Span, node: Span, lo: int, t: int, shift: int, anc: tuple) -> Span | None:
        """The previous point of ``d``'s flow (by start: message order) that ended after ``lo``:
        what ``d`` waited for."""
        start, end = d.start, d.end
        cands = [p for p in self.g.flows.get(d.flow, ()) if p.start < start and p.end < end and p not in anc]
        return self._pick(cands, t, lo, node, shift) if cands else None

    def _pick(self, cands: list, t: int, lo: int, node: Span, shift: int) -> Span | None:
        """The candidate that ended last by ``t`` (after ``lo``); of spans of one mesh and name
        that ended together, the one that waited least. A candidate that never ended (still open)
        is taken as running until ``t``, unless ``node`` finished and a finished candidate
        started after it: the waiter went on without it."""
        best, best_e, still = None, None, None
        used, host, t_far = self.used, node.host, t + self.skew
        for s in cands:
            if s in used:
                continue
            if s.host == host:
                e, e_hi = s.end + shift, t
            else:
                e, e_hi = s.end, t_far
            if s.unfinished:
                if s.start + (e - s.end) < t and (still is None or s.start > still.start):
                    still = s
                continue
            if e <= lo or e > e_hi:
                continue
            if best is None or e > best_e:
                best, best_e = s, e
        if still is not None and (node.unfinished or best is None or best.start <= still.start + self.tie):
            return still
        if best is None:
            return None
        name, mesh, stream, e_lo = best.name, best.mesh, best.stream, best_e - self.tie
        group = [s for s in cands if s.name == name and s.stream is not stream and s.mesh == mesh and s not in used
                 and e_lo <= (s.end + shift if s.host == host else s.end) <= (t if s.host == host else t_far)]
        if group:
            best = min([best, *group], key=self.waits)
        return best

    def waits(self, s: Span) -> int:
        """µs of ``s`` spent in spans that wait on others (``wait_spans``)."""
        w = s.waits
        if w < 0:
            w, names = 0, self._wait_names
            for c in s.children:
                wait = names.get(c.name)
                if wait is None:
                    wait = self.is_wait(c.name)
                w += c.dur if wait else self.waits(c)
            s.waits = w
        return w

    def _virtual(self, w: Window) -> Span:
        """A stand-in root for a step whose controller records no step span: its top-level
        controller spans in the window are its children."""
        ctl = next((st for st in self.g.run.streams.values() if self.g.is_ctl(st)), None)
        root = Span(ctl, -1, "step", w.step, w.start, w.end - w.start, None, w.unfinished)
        root.children = [s for s in roots_between(self.g, w.start, w.end)
                         if s.stream is ctl and s.start >= w.start]
        return root

    def is_wait(self, name: str) -> bool:
        w = self._wait_names.get(name)
        if w is None:
            w = self._wait_names[name] = bool(self.wait_re.search(name))
        return w
