"""The rows the live indexer keeps in memory between its updates: the spans, step marks and
endpoint calls of the last steps, so that an update computes the steps its new rows may change
without reading the index back (no DuckDB: a few milliseconds instead of about a hundred).

The answers are those of the queries of :mod:`.paths` over the whole index, on the rows the
window holds: every span that ends at or after the window's ``horizon`` and every mark and call
at or after it. :meth:`Window.closure` returns None when the graph it asks for reaches before the
horizon (a span that began long before, an endpoint call sent long before, a span still open
since long before); the update then reads the index (:func:`.paths.compute_steps`) and the window
is read again from it (:meth:`Window.seed`). Before a run's first step the window holds every
row (the first step's graph may reach back to any). A graph's rows are in the reader's order:
their file's order (:func:`forge_obs.analysis.reader.file_order`), then their byte offset.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from operator import itemgetter
from typing import Any

from forge_obs.analysis.index.steps import graph_from

__all__ = ["Window", "KEEP_STEPS"]

#: the steps whose rows the window keeps (the last ones), beyond those that may still change
KEEP_STEPS = 64
#: endpoint calls dropped from the window whose links are remembered (a span that arrives with
#: one of them needs the index: its call was sent before the horizon)
PRUNED_LINKS = 200_000
#: an index with no step yet is held whole when it has at most this many spans (else it is read
#: until its first step is stored)
SEED_ALL_SPANS = 200_000
_ALL = -(1 << 62)
_END = itemgetter(11)


class Window:
    """See the module docstring. ``ready`` once :meth:`seed` read it from the index."""

    def __init__(self) -> None:
        self.ready = False
        self.horizon = 0
        # spans by their end, marks and calls in the reading order (file order, byte offset)
        self.spans: list = []  # (order, off, sid, lane, name, step, start, dur, flow, flow_t, link, end)
        self.marks: list = []  # (order, off, sid, step, ts)
        self.calls: list = []  # (order, off, sid, lane, link, ts)
        self.links: set = set()  # the links of self.calls
        self.pruned: OrderedDict = OrderedDict()  # links of calls dropped from the window
        self.lanes: dict = {}  # sid -> {lane: label}
        self.steps: dict = {}  # step -> [start, end, unfinished]: the last steps stored (KEEP_STEPS or more)
        self.numbers: set = set()  # every step number stored
        self.pruned_end = -(1 << 62)  # the latest end of a stored step the window does not hold
        self.segs: dict = {}  # segment file -> the steps it holds: the window marks them computed again
        self.gen = -1  # the index generation the window is of

    # ------------------------------------------------------------------ filling
    def seed(self, con: Any, man: Any) -> None:
        """Read the window from the index (``con``: its stored tables as views) after an update
        that read the index: the last steps, and every row the graph of the steps after them needs."""
        from forge_obs.analysis.index.paths import closure

        self.__init__()
        rows = con.execute("SELECT step, start_us, end_us, unfinished FROM _steps ORDER BY start_us DESC LIMIT ?",
                           [KEEP_STEPS]).fetchall()
        self.numbers = {r[0] for r in con.execute("SELECT step FROM _steps").fetchall()}
        self.steps = {n: [a, b, u] for n, a, b, u in rows}
        lo = min((r[1] for r in rows), default=None)
        if lo is not None:
            self.pruned_end = con.execute("SELECT max(end_us) FROM _steps WHERE step NOT IN "
                                          "(SELECT unnest(?::BIGINT[]))", [list(self.steps)]).fetchone()[0] or -(1 << 62)
            self._adopt(man)
            self.horizon = h = closure(con, lo - 4 * _margin())
        elif con.execute("SELECT count(*) FROM _spans").fetchone()[0] <= SEED_ALL_SPANS:
            self.horizon = h = _ALL  # no step yet (a run starting): every row, the first step may need any
        else:
            return
        order = _orders(man)
        off = "s.offset_us"
        self.spans = sorted(
            ((order[fid], o, sid, lane, name, step, st, dur, flow, ft, link, st + dur) for fid, o, sid, lane, name, step, st,
             dur, flow, ft, link in con.execute(f"SELECT x.fid, x.off, x.sid, x.lane, x.name, x.step, x.start + {off}, x.dur, "
                                                f"x.flow, x.flow_t, x.link FROM _spans x JOIN _streams s ON s.sid = x.sid "
                                                f"WHERE x.end + {off} >= ?", [h]).fetchall()), key=_END)
        ev = con.execute(f"SELECT e.fid, e.off, e.sid, e.lane, e.kind, e.name, e.step, e.link, e.ts + {off} FROM _events e "
                         f"JOIN _streams s ON s.sid = e.sid WHERE e.ts + {off} >= ? AND (e.kind = 'step' OR "
                         "(e.kind = 'event' AND e.name = 'call' AND e.link IS NOT NULL))", [h]).fetchall()
        self._add_events([(order[fid], o, sid, lane, kind, name, step, link, ts) for fid, o, sid, lane, kind, name, step,
                          link, ts in ev])
        for sid, lane, label in con.execute("SELECT sid, lane, label FROM _lane_labels").fetchall():
            self.lanes.setdefault(sid, {})[lane] = label
        self.gen, self.ready = man.gen, True

    def add(self, cols: Any, man: Any, offsets: dict) -> bool:
        """The rows of one update (``cols``: :class:`~.rows.Columns`, raw times), times corrected
        by ``offsets`` (sid -> µs); False when one of them needs the index (its span's call was
        dropped from the window)."""
        order = _orders(man)
        new = [(order[fid], o, sid, lane, name, step, st + offsets[sid], dur, flow, ft, link, st + offsets[sid] + dur)
               for sid, _a, lane, name, step, st, _e, dur, _er, flow, ft, _at, link, _c, _cpu, fid, o in cols["spans"]]
        self.spans += new
        self.spans.sort(key=_END)  # the ones held are a sorted run: a merge
        self._add_events([(order[fid], o, sid, lane, kind, name, step, link, ts + offsets[sid])
                          for sid, _a, lane, kind, name, step, ts, _f, _ft, _at, link, fid, o in cols["events"]
                          if kind == "step" or (kind == "event" and name == "call" and link is not None)])
        for sid, lane, label in cols["lanes"]:
            have = self.lanes.setdefault(sid, {})
            have[lane] = max(label, have.get(lane, label))
        return not any(r[10] is not None and r[10] in self.pruned for r in new)

    def _add_events(self, rows: list) -> None:
        for o, off, sid, lane, kind, _name, step, link, ts in rows:
            if kind == "step":
                self.marks.append((o, off, sid, step, ts))
            else:
                self.calls.append((o, off, sid, lane, link, ts))
                self.links.add(link)
        self.marks.sort()
        self.calls.sort()

    def _adopt(self, man: Any) -> None:
        """The per-step segments whose steps the window holds (each alone in its step range)
        become its own: it may mark their steps computed again."""
        from forge_obs.analysis.index.schema import STEP_TABLES

        groups: dict = {}
        for t in STEP_TABLES:
            for seg in man.segments(t):
                groups.setdefault((seg["lo"], seg["hi"]), []).append(seg)
        ranges = sorted(groups)
        for i, (lo, hi) in enumerate(ranges):
            if any(a <= hi and lo <= b for a, b in ranges[:i] + ranges[i + 1:]):
                continue  # the steps of its range are not all its own
            segs = groups[(lo, hi)]
            skip = set().union(*(set(s.get("skip", ())) for s in segs))
            numbers = {n for n in self.numbers if lo <= n <= hi} - skip
            if numbers and numbers <= self.steps.keys() and all(set(s.get("skip", ())) == skip for s in segs):
                held = numbers | skip
                for s in segs:
                    self.segs[s["file"]] = held

    def take(self, bound: int) -> "dict | None":
        """Segment file -> its steps that start at or after ``bound`` (the window's segments);
        None when such a step is in none of them."""
        want = {n for n, v in self.steps.items() if v[0] >= bound}
        out = {f: held & want for f, held in self.segs.items() if held & want}
        if want - set().union(*out.values(), set()):
            return None
        return out

    def batch(self, files: set, numbers: list) -> None:
        """Segments just written (``files``) with the steps they hold."""
        held = set(numbers)
        for f in files:
            self.segs[f] = held

    def tracked(self) -> set:
        """The segment files the window may mark."""
        return set(self.segs)

    def merged(self, files: list, into: str, steps: "set | None") -> None:
        """Segments ``files`` (all tracked, or none) merged into segment ``into``, which holds
        exactly ``steps`` (it is dropped once every one of them is marked)."""
        if [self.segs.pop(f) for f in files if f in self.segs] and steps is not None:
            self.segs[into] = steps

    def stored(self, rows: list) -> None:
        """Steps just stored (``[(step, start, end, unfinished)]``)."""
        for n, a, b, u in rows:
            self.steps[n] = [a, b, u]
            self.numbers.add(n)

    def dropped(self, numbers: list, files: set) -> None:
        """Steps computed again (their old rows marked), segments dropped."""
        for n in numbers:
            self.steps.pop(n, None)
            self.numbers.discard(n)
        for f in files:
            self.segs.pop(f, None)

    def prune(self) -> None:
        """Keep the last :data:`KEEP_STEPS` steps (and any unfinished one) and the rows their
        graphs need; the horizon moves up to them."""
        keep = sorted(self.steps.items(), key=lambda kv: kv[1][0])
        old = {n for n, v in (keep[:-KEEP_STEPS] if len(keep) > KEEP_STEPS else []) if not v[2]}
        for n in old:
            self.pruned_end = max(self.pruned_end, self.steps.pop(n)[1])
        self.segs = {f: held for f, held in self.segs.items() if held & self.steps.keys()}
        if not self.steps:
            if self.whole() and len(self.spans) > SEED_ALL_SPANS:
                self.ready = False  # a long start without a step: read from the index until its first
            return
        h = min(v[0] for v in self.steps.values()) - 4 * _margin()
        if h <= self.horizon:
            return
        h = min(h, self._reach(h))
        if h <= self.horizon:
            return
        self.horizon = h
        self.spans = self.spans[self._ending(h):]
        self.marks = [r for r in self.marks if r[4] >= h]
        kept = []
        for r in self.calls:
            if r[5] >= h:
                kept.append(r)
            else:
                self.pruned[r[4]] = None
        self.calls = kept
        self.links = {r[4] for r in kept}
        while len(self.pruned) > PRUNED_LINKS:
            self.pruned.popitem(last=False)

    def _reach(self, h: int) -> int:
        """The closure of ``h`` over the rows held (the window never drops what a graph after
        ``h`` needs)."""
        got = self.closure(h, opens_lo=None, below=-(1 << 62))
        return h if got is None else got

    # ------------------------------------------------------------------ the queries of paths.py
    def closure(self, lo: int, opens_lo: "int | None", below: "int | None" = None) -> "int | None":
        """:func:`.paths.closure` over the window; None when it reaches before the horizon."""
        floor = self.horizon if below is None else below
        if opens_lo is not None:
            lo = min(lo, opens_lo)
        while True:
            if lo < floor:
                return None
            after = self.spans[self._ending(lo):]
            a = min((r[6] for r in after if r[6] < lo), default=None)
            linked = {r[10] for r in after if r[10] is not None}
            b = min((r[5] for r in self.calls if r[5] < lo and r[4] in linked), default=None)
            new = min([v for v in (a, b) if v is not None], default=lo)
            if new >= lo:
                return lo
            lo = new

    def graph(self, run: Any, by_sid: dict, opens: list, lo: int, hi: int, end: int) -> Any:
        """:meth:`.paths._Rows.graph` over the window (``opens``: the open spans' rows, in order)."""
        far = max((r[11] for r in self.spans[self._ending(hi + 1):] if r[6] <= hi), default=None)
        hi = max(hi, far or hi)
        spans = [r[2:11] for r in sorted(r for r in self.spans[self._ending(lo):] if r[6] <= hi)]
        marks = [(sid, step, ts) for _o, _off, sid, step, ts in self.marks if lo <= ts <= hi]
        calls = {link: (sid, lane, ts) for _o, _off, sid, lane, link, ts in self.calls if lo <= ts <= hi}
        return graph_from(run, by_sid, spans, opens, calls, marks, end)

    def first(self) -> int:
        return self.horizon

    def _ending(self, t: int) -> int:
        """The index of the first span held that ends at or after ``t``."""
        return bisect.bisect_left(self.spans, t, key=_END)

    def whole(self) -> bool:
        """Whether the window holds every row of the index (no step was stored yet)."""
        return self.horizon == _ALL


def _margin() -> int:
    from forge_obs.analysis.index.steps import MARGIN_US

    return MARGIN_US


def _orders(man: Any) -> dict:
    """fid -> its file's reading order (:func:`forge_obs.analysis.reader.file_order`)."""
    return {f["fid"]: tuple(f["order"]) for f in man.state.get("files", {}).values()}
