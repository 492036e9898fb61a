"""The span graph of a run: every span of ``events/*.jsonl`` with its parent on its own track,
its flow, its process, and the controller's step windows.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(0)
    >>> with timeline.record_span("controller_step"):
    ...     with timeline.record_span("update"):
    ...         pass
    >>> timeline.close()
    >>> g = load(run_dir)
    >>> [(s.name, s.parent.name if s.parent else None) for s in g.spans]
    [('controller_step', None), ('update', 'controller_step')]

A *link* is what makes one span depend on another (docs/timeline.md, "Critical path"):

- **nested**: a span inside another on the same track (one thread or asyncio task) of one process;
- **flow**: spans that share a ``flow=`` id, in the order they started (a message is received
  after it is sent, whatever the clocks say);
- **call**: a span opened while a Monarch endpoint call made under another span was handled (the
  call carried the caller's context, :mod:`forge_obs.controller.call_context`): the callee's span is
  a child of the caller's span that was open on the caller's track when the call was sent;
- **inferred**: a track's top-level span in another process that ran inside a controller span
  with no other explanation for that time (the controller awaited it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.reader import INSTANT, OPEN, SPAN, STEP

__all__ = ["Span", "Graph", "Window", "load", "build", "controller_streams", "roots_between", "flow_key",
           "stream_who", "build_spans"]


class Span:
    """One span: times in epoch µs (clock-offset corrected), ``dur`` measured on one clock."""

    __slots__ = ("stream", "host", "mesh", "ctl", "lane", "name", "step", "start", "end", "dur", "flow", "unfinished",
                 "parent", "children", "waits", "index", "link", "caller", "called")

    def __init__(self, stream: reader.Stream, lane: int, name: str, step: Any, start: int, dur: int,
                 flow: Any, unfinished: bool, who: "tuple | None" = None, link: Any = None) -> None:
        self.stream, self.lane, self.name, self.step = stream, lane, name, step
        #: its stream's host, mesh and whether it is a controller's (header ``ctl``): ``who``, or read here
        self.host, self.mesh, self.ctl = who if who is not None else stream_who(stream)
        self.start, self.dur, self.end = start, dur, start + dur
        self.flow, self.unfinished = flow, unfinished
        self.parent: Span | None = None
        self.children: list[Span] = []
        self.waits = -1  # µs of its children that wait on others (computed on demand)
        self.index = 0
        self.link: Any = link  # the id of the call whose handling opened it (extras "p")
        self.caller: Span | None = None  # the span that made that call (link "call")
        self.called: list = []  # spans opened by calls made under this span

    def __repr__(self) -> str:
        return f"<{self.stream.label} {self.name} {self.start}+{self.dur}>"


@dataclass(frozen=True)
class Window:
    """A controller step: ``root`` is its top-level span (None: the window runs from its
    ``set_step`` to the next one)."""

    step: int
    start: int
    end: int
    root: Span | None
    unfinished: bool = False


@dataclass
class Graph:
    run: reader.Run
    spans: list = field(default_factory=list)  # every Span, by start
    roots: list = field(default_factory=list)  # top-level spans of their track, by end
    root_ends: list = field(default_factory=list)
    flows: dict = field(default_factory=dict)  # flow id -> [Span] by start
    windows: list = field(default_factory=list)  # [Window] by step
    end: int = 0  # last timestamp of the data
    ctl: set = field(default_factory=set)  # ids of the controller's streams

    def release(self) -> None:
        """Unlink the spans (parent and children, caller and called): the graph is then freed by
        reference counting as soon as it is dropped, also while the cyclic collector is paused
        (as it is while the index computes steps); the graph is empty afterwards."""
        for s in self.spans:
            s.parent = s.caller = None
            s.children = s.called = ()
        self.spans, self.roots, self.flows, self.windows = [], [], {}, []

    def controller(self, s: Span) -> bool:
        return id(s.stream) in self.ctl

    def is_ctl(self, st: reader.Stream) -> bool:
        return id(st) in self.ctl

    def awaits(self, s: Span) -> bool:
        """Whether ``s`` runs on a controller process (header ``ctl``): its spans await other
        processes' work, so their unexplained time may be inferred from it. A stepping rank of an
        SPMD job computes: its spans wait only on what they are linked to."""
        return s.ctl


def stream_who(st: "reader.Stream | None") -> tuple:
    """``(host, mesh, ctl)`` of a span's stream, as :class:`Span` keeps them."""
    if st is None:
        return "", None, False
    return st.host, st.mesh, bool(st.header.get("ctl"))


def flow_key(ex: Any) -> Any:
    if not ex or "f" not in ex:
        return None
    f = ex["f"]
    return f if isinstance(f, (str, int)) else repr(f)


def _link_key(ex: Any) -> Any:
    p = ex.get("p") if ex else None
    return p if type(p) is str else None


def load(run_dir: "str | Path") -> Graph:
    """One pass over the run's timeline files (the direct read, without the index): spans nested
    per track, flows, step windows. See :func:`build`."""
    run = reader.scan(run_dir)
    ctl = controller_streams(run.streams.values())
    ctl_ids = {id(st) for st in ctl}
    spans: list = []
    opens: list = []
    calls: dict[str, tuple] = {}  # link id -> (stream, lane, ts) of the "call" event
    steps: dict[int, int] = {}
    for it in reader.walk(run):
        k = it[0]
        if k is SPAN:
            _k, st, lane, name, step, ts, dur, ex, _cpu = it
            spans.append((st, lane, name, step, ts, dur, flow_key(ex), _link_key(ex)))
        elif k is INSTANT:
            if it[3] == "call" and (link := _link_key(it[6])) is not None:
                calls[link] = (it[1], it[2], it[5])
        elif k is OPEN:
            _k, st, lane, name, step, ts, ex = it
            opens.append((st, lane, name, step, ts, 0, flow_key(ex), _link_key(ex)))
        elif k is STEP and id(it[1]) in ctl_ids and it[3] is not None:
            steps.setdefault(it[3], it[4])
    return build(run, ctl, spans, opens, calls, steps, reader.run_end(run) or 0)


def controller_streams(streams: Any) -> list:
    """The streams whose steps are the steps: the controller's (header ``ctl``); without one (a
    plain script, an SPMD job launched by torchrun) the first rank 0's."""
    streams = list(streams)
    ctl = [st for st in streams if st.header.get("ctl")]
    if not ctl and streams:
        ctl = [min(streams, key=lambda st: (st.rank, st.attempt, st.mesh, st.host or "", st.pid))]
    return ctl


def build(run: reader.Run, ctl: list, spans: list, opens: list, calls: dict, steps: dict, end: int) -> Graph:
    """The graph of ``spans`` and ``opens`` (``(stream, lane, name, step, start, dur, flow key,
    call link)``, in reading order; an open span runs to ``end``, the last timestamp of the
    data), ``calls`` (link id -> (stream, lane, ts)) and ``steps`` (the controller's step ->
    the time of its first ``set_step``). :func:`load` and the index
    (:mod:`forge_obs.analysis.index`) both build it here."""
    who: dict = {}
    made = []
    add = made.append
    for st, lane, name, step, ts, dur, flow, link in spans:
        w = who.get(id(st))
        if w is None:
            w = who[id(st)] = stream_who(st)
        add(Span(st, lane, name, step, ts, max(dur, 0), flow, False, w, link))
    return build_spans(run, ctl, made, opens, calls, steps, end)


def build_spans(run: reader.Run, ctl: list, spans: list, opens: list, calls: dict, steps: dict, end: int) -> Graph:
    """:func:`build` of finished spans already made (:class:`Span`, in reading order; the list
    becomes the graph's)."""
    g = Graph(run=run, spans=spans)
    g.ctl = {id(st) for st in ctl}
    g.end = end
    for st, lane, name, step, ts, _d, flow, link in opens:
        spans.append(Span(st, lane, name, step, ts, max(end - ts, 0), flow, True, None, link))
    _nest(g)
    _calls(g, calls)
    for s in g.spans:
        if s.flow is not None:
            g.flows.setdefault(s.flow, []).append(s)
    g.windows = _windows(g, steps)
    return g


_START, _END = attrgetter("start"), attrgetter("end")


def _nest(g: Graph) -> None:
    """Parents per (process, track): a span's parent is the innermost span that contains it."""
    g.spans.sort(key=_END, reverse=True)  # by start, then by end, latest first (two stable sorts)
    g.spans.sort(key=_START)
    stacks: dict[tuple, list] = {}
    roots = g.roots
    for i, s in enumerate(g.spans):
        s.index = i
        key = (id(s.stream), s.lane)
        stack = stacks.get(key)
        if stack is None:
            stack = stacks[key] = []
        while stack and ((top := stack[-1]).end < s.end or (top.end <= s.start and top.dur > 0)):
            stack.pop()
        if stack:
            s.parent = top = stack[-1]
            top.children.append(s)
        else:
            roots.append(s)
        stack.append(s)
    g.roots.sort(key=_END)
    g.root_ends = [s.end for s in g.roots]


def _calls(g: Graph, calls: dict) -> None:
    """Each span opened by a linked call gets its caller: the innermost span open on the
    caller's track when the call was sent (an exact link; none if no span contains the send)."""
    linked = [s for s in g.spans if s.link is not None and s.link in calls]
    if not linked:
        return
    tracks: dict[tuple, list] = {}
    for s in g.spans:  # by start
        tracks.setdefault((id(s.stream), s.lane), []).append(s)
    starts = {k: [s.start for s in v] for k, v in tracks.items()}
    for s in linked:
        st, lane, ts = calls[s.link]
        key = (id(st), lane)
        if key not in tracks:
            continue
        i = bisect.bisect_right(starts[key], ts) - 1
        c = tracks[key][i] if i >= 0 else None
        while c is not None and c.end < ts:
            c = c.parent
        if c is not None and c is not s:
            s.caller = c
            c.called.append(s)


def _windows(g: Graph, steps: dict[int, int]) -> list:
    """Per controller step: its longest top-level controller span tagged with the step (when it
    covers at least half of the time from the step's ``set_step`` to the next one, if any), else
    that time."""
    best: dict[int, Span] = {}
    for s in g.roots:
        if s.step is None or not g.controller(s):
            continue
        b = best.get(s.step)
        if b is None or s.dur > b.dur:
            best[s.step] = s
    out = []
    order = sorted(set(best) | set(steps))
    nxt: dict[int, Any] = {}  # step -> the set_step time of the next step that has one
    following = None
    for n in reversed(order):
        nxt[n] = following
        if n in steps:
            following = steps[n]
    for n in order:
        r = best.get(n)
        nx = nxt[n]
        if r is not None and (n not in steps or nx is None or 2 * r.dur >= nx - steps[n]):
            out.append(Window(n, r.start, r.end, r, r.unfinished))
        elif n in steps:
            out.append(Window(n, steps[n], nx if nx is not None else g.end, None, nx is None))
    return out


def roots_between(g: Graph, lo: int, hi: int) -> list:
    """Top-level spans that end in ``(lo, hi]``, by end."""
    a = bisect.bisect_right(g.root_ends, lo)
    b = bisect.bisect_right(g.root_ends, hi)
    return g.roots[a:b]
