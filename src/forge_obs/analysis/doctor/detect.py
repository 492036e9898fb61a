"""Incremental detectors shared by ``forge-obs doctor`` (replayed over a finished run) and the live
``"alerts"`` backend (fed one step at a time). Each keeps bounded state and says when a condition
starts (``onset``) and ends (``clear``).

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.detect import GroupTracker
    >>> t = GroupTracker(DoctorConfig())
    >>> for step in range(8):                      # rank 1 three times slower from step 2
    ...     changes = t.update(step, {0: 0.010, 1: 0.030 if step >= 2 else 0.010}, step_s=0.04)
    ...     for c in changes:
    ...         print(step, c.kind, c.state, "rank", c.rank, "since step", c.onset)
    5 straggler onset rank 1 since step 2

The straggler test works from 2 ranks up: at each step a rank's duration is compared with a
reference, the larger of the median of the *other* ranks of its mesh that step (for 2 ranks: the
other one) and the median of their usual durations (each rank's last ``history_steps`` durations
in line with its peers): a peer that happened to be quick is no evidence. It is out of line when
it is ``straggler_ratio`` x that and longer by ``min_excess_s`` and by ``min_step_share`` of the
step; the condition starts when that holds in ``fire_steps`` (4) of the last ``window_steps`` (5)
steps, and, once on, holds while the rank is ``straggler_ratio`` x the *smaller* of the two and
still longer than its peers by the minimum (hysteresis: peers slowed too at some steps, by a busy
host, do not end it). Its onset moves back over the steps just before it where the rank was
already at the level of the condition and longer than its peers (a peer's slow first step does
not hide a fault from step 0).
Each rank is also compared with its own rolling baseline (``slowdown``). A rank that does a span
its peers do not do (they spend < ``role_peer_max_s`` on it, or lack it) from its first steps has
a *role*: it is never a straggler for that span, only judged against its own history. A rank
without one is judged at every step once that is decided, also at the steps where its peers
happened to spend under ``role_peer_max_s``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, NamedTuple

from forge_obs.analysis.doctor.config import DoctorConfig

__all__ = [
    "fmedian",
    "Persistence",
    "History",
    "median_without",
    "Change",
    "Episode",
    "GroupTracker",
    "covered",
    "theil_sen",
    "growth",
]

#: ratios kept per episode for its summary (the doctor; live trackers keep none)
_MAX_KEPT = 4096


def fmedian(xs: Any) -> float:
    """Median of a small collection (``statistics.median`` costs several µs more per call)."""
    s = sorted(xs)
    n = len(s)
    m = n // 2
    return s[m] if n % 2 else (s[m - 1] + s[m]) / 2


class Persistence:
    """Starts when ``fire`` of the last ``window`` judged steps hit; ends when at most ``clear`` do.
    ``onset`` is the first hit of the window that started it, not counting a lone hit that a miss
    follows, nor (given ``level``, a hit's payload -> its size) leading hits smaller than
    ``lead_share`` x the median size of the window's hits: one noisy step just before the
    condition began is not its start. Given ``back`` (a step's payload and the payloads of the
    window's hits from the onset on -> whether the condition held there too), the onset then
    moves back over the steps just before it that ``back`` accepts (they count as hits): a hit
    that looked small, or a miss, because the reference was high that step."""

    __slots__ = ("fire", "clear", "recent", "hits", "active", "onset", "level", "lead_share", "back")

    def __init__(self, fire: int, window: int, clear: int, level: Any = None, lead_share: float = 0.0,
                 back: Any = None) -> None:
        self.fire, self.clear = fire, clear
        self.level, self.lead_share, self.back = level, lead_share, back
        self.recent: deque = deque(maxlen=window)
        self.hits = 0
        self.active = False
        self.onset: Any = None

    def update(self, step: Any, hit: bool, payload: Any = None) -> str | None:
        rec = self.recent
        if self.hits and len(rec) == rec.maxlen and rec[0][1]:
            self.hits -= 1
        rec.append((step, hit, payload))
        if hit:
            self.hits += 1
        elif not self.active:
            return None
        if not self.active:
            if self.hits >= self.fire:
                self.active = True
                self.onset = self._start()
                return "onset"
        elif self.hits <= self.clear:
            self.active = False
            return "clear"
        return None

    def _start(self) -> Any:
        rec = self.recent
        i = self._first_sustained_hit()
        if self.back is not None:
            hits = [p for _s, h, p in list(rec)[i:] if h]
            while i > 0 and rec[i - 1][2] is not None and self.back(rec[i - 1][2], hits):
                i -= 1
                if not rec[i][1]:  # the condition held there: a hit of its window
                    rec[i] = (rec[i][0], True, rec[i][2])
                    self.hits += 1
        return rec[i][0]

    def _first_sustained_hit(self) -> int:
        rec = self.recent
        floor = None
        if self.level is not None and self.lead_share > 0:
            floor = self.lead_share * fmedian([self.level(p) for _s, h, p in rec if h])
        for i, (_s, h, p) in enumerate(rec):
            if h and (i + 1 == len(rec) or rec[i + 1][1]) and (floor is None or self.level(p) >= floor):
                return i
        return len(rec) - 1

    def window_hits(self) -> list:
        """The window's hits from ``onset`` on (the ones before it were not the condition)."""
        on = self.onset
        return [(s, p) for s, h, p in self.recent if h and (on is None or not _before(s, on))]


def _before(a: Any, b: Any) -> bool:
    try:
        return a < b
    except TypeError:
        return False


def _second(kv: tuple) -> Any:
    return kv[1]


def _excess_of(payload: tuple) -> float:
    """A straggler / slowdown hit's size: its duration minus its reference, in seconds."""
    return payload[1] - payload[2]


class History:
    """A rolling baseline: the median of the last ``size`` normal values (once ``min_n`` are in),
    recomputed after every ``every`` new values (a median of 16 moves little per value)."""

    __slots__ = ("values", "min_n", "every", "_base", "_adds")

    def __init__(self, size: int, min_n: int, every: int = 4) -> None:
        self.values: deque = deque(maxlen=size)
        self.min_n = min_n
        self.every = every
        self._base: float | None = None
        self._adds = 0

    def baseline(self) -> float | None:
        if len(self.values) < self.min_n:
            return None
        if self._base is None or self._adds >= self.every:
            self._base = fmedian(self.values)
            self._adds = 0
        return self._base

    def add(self, v: float) -> None:
        self.values.append(v)
        self._adds += 1

    def reset(self) -> None:
        self.values.clear()
        self._base = None
        self._adds = 0


def median_without(vals: list, i: int) -> float:
    """Median of sorted ``vals`` without the element at index ``i`` (``len(vals) >= 2``)."""
    m = len(vals) - 1
    h = m // 2
    a = vals[h if h < i else h + 1] if m % 2 else None
    if a is not None:
        return a
    lo, hi = h - 1, h
    return (vals[lo if lo < i else lo + 1] + vals[hi if hi < i else hi + 1]) / 2


class Change(NamedTuple):
    kind: str  # "straggler" | "slowdown"
    state: str  # "onset" | "clear"
    rank: Any
    step: Any
    onset: Any
    info: dict


@dataclass
class Episode:
    """One out-of-line period of one rank (summary for the doctor)."""

    kind: str
    rank: Any
    onset: Any
    end: Any = None
    hits: int = 0
    judged: int = 0
    ratios: list = field(default_factory=list)
    values: list = field(default_factory=list)
    refs: list = field(default_factory=list)
    hit_steps: list = field(default_factory=list)
    cleared: bool = False

    def add(self, step: Any, payload: tuple) -> None:
        self.hits += 1
        self.end = step
        if len(self.ratios) < _MAX_KEPT:
            r, d, ref = payload[:3]
            self.ratios.append(r)
            self.values.append(d)
            self.refs.append(ref)
            self.hit_steps.append(step)

    def excess_s(self, last: int | None = None) -> float:
        """Seconds its out-of-line steps (the ``last`` ones, or all) took beyond their reference,
        summed (scaled up from the hits it kept when it kept fewer than it had)."""
        kept = [v - r for v, r in zip(self.values, self.refs)]
        if last is not None:
            return sum(kept[-last:])
        return sum(kept) * (self.hits / len(kept)) if kept else 0.0

    def summary(self) -> dict:
        return {
            "median_ratio": round(median(self.ratios), 3) if self.ratios else None,
            "median_s": median(self.values) if self.values else None,
            "reference_s": median(self.refs) if self.refs else None,
            "hit_steps": self.hits,
            "steps_judged": self.judged,
        }


class _Rank:
    __slots__ = ("peer", "usual", "hist", "hist_p", "seen", "role_like", "role", "ep", "hep", "last")

    def __init__(self, cfg: DoctorConfig, back: Any) -> None:
        self.peer = Persistence(cfg.fire_steps, cfg.window_steps, cfg.clear_steps, _excess_of, cfg.onset_share, back)
        #: its durations at the steps it was not out of line against its peers: its peers' reference
        self.usual = History(cfg.history_steps, cfg.history_min_steps)
        self.hist = History(cfg.history_steps, cfg.history_min_steps)
        self.hist_p = Persistence(cfg.fire_steps, cfg.window_steps, cfg.clear_steps, _excess_of, cfg.onset_share)
        self.seen = 0
        self.role_like = 0
        self.role: bool | None = None
        self.ep: Episode | None = None
        self.hep: Episode | None = None
        self.last: float = 0.0


def _at_level(lead_share: float) -> Any:
    """``Persistence.back`` of a straggler: a step just before its onset belongs to it when the
    rank was slower than its peers that step by the minimum excess and took at least
    ``lead_share`` x the median duration of the window's hits (its peers were slow too that step:
    the first step of a run, a busy host)."""

    def back(miss: tuple, hits: list) -> bool:
        return miss[3] and miss[1] >= lead_share * fmedian([h[1] for h in hits])

    return back


class GroupTracker:
    """One span name (or duration metric) of one mesh: ``update(step, {rank: seconds}, step_s)``
    per step in step order; returns the :class:`Change` s of that step. ``keep=True`` (the doctor)
    keeps every finished :class:`Episode` in ``episodes``; ``roles=False`` (waits: one rank waiting
    while its peers do not is what a straggler causes) never classifies a rank as having a role;
    ``history=False`` (live, slowdowns off) skips the comparison with the rank's own history."""

    def __init__(self, cfg: DoctorConfig, keep: bool = False, roles: bool = True, history: bool = True) -> None:
        self.cfg = cfg
        self.keep = keep
        self.history = history
        self.role_max = cfg.role_peer_max_s if roles else -1.0
        self.ranks: dict[Any, _Rank] = {}
        self.episodes: list[Episode] = []
        self.max_ranks = 0
        self.steps = 0
        self.peer_steps = 0  # steps where >= 2 ranks could be compared
        self._back = _at_level(cfg.onset_share)

    @property
    def idle(self) -> bool:
        """No rank of the group is out of line now."""
        return not any(st.ep is not None or st.hep is not None for st in self.ranks.values())

    def settled(self, n: int) -> bool:
        """Every rank seen is past its role decision (so skipping a step changes no role)."""
        return len(self.ranks) >= n and all(st.role is not None for st in self.ranks.values())

    def current(self, rank: Any, kind: str, step: Any) -> Change | None:
        """The ``onset`` :class:`Change` of ``rank``'s episode of ``kind`` still on at ``step``
        (None: none is on)."""
        st = self.ranks.get(rank)
        ep = None if st is None else (st.ep if kind == "straggler" else st.hep)
        return None if ep is None else Change(kind, "onset", rank, step, ep.onset, _info(ep, None))

    def episode(self, rank: Any, kind: str) -> Episode | None:
        """``rank``'s episode of ``kind`` still on (None: none is)."""
        st = self.ranks.get(rank)
        return None if st is None else (st.ep if kind == "straggler" else st.hep)

    def roles(self) -> dict:
        """rank -> its typical duration, for ranks classified as doing this work alone."""
        return {r: st.last for r, st in self.ranks.items() if st.role}

    def update(self, step: Any, values: dict, step_s: float | None = None) -> list[Change]:
        n = len(values)
        self.steps += 1
        if n > self.max_ranks:
            self.max_ranks = n
        need = self.cfg.min_excess_s
        if step_s:
            share = self.cfg.min_step_share * step_s
            if share > need:
                need = share
        if not self.history and self._quiet(values, need, n):
            return []
        if n == 1:  # no peers: only the role count and the rank's own history move
            for rank, d in values.items():
                return self._alone(rank, step, d, need)
        if n == 2:  # sorted by duration (one comparison, as sorted() makes); each one's peer is the other
            self.peer_steps += 1
            items = list(values.items())
            if items[1][1] < items[0][1]:
                items.reverse()
            (r0, v0), (r1, v1) = items
            s0, s1 = self.ranks.get(r0), self.ranks.get(r1)
            b0 = None if s0 is None else s0.usual.baseline()
            b1 = None if s1 is None else s1.usual.baseline()
            refs = ((v1, b1), (v0, b0))  # as _references
        else:
            if n >= 2:
                self.peer_steps += 1
            items = sorted(values.items(), key=_second)
            refs = self._references(items)
        out: list[Change] = []
        ranks = self.ranks
        for (rank, d), (ref_now, usual) in zip(items, refs):
            st = ranks.get(rank)
            if st is None:
                st = ranks[rank] = _Rank(self.cfg, self._back)
            st.seen += 1
            st.last = d
            ch = self._against_peers(st, rank, step, d, ref_now, usual, need)
            if ch:
                out += ch
            if self.history:
                ch = self._against_history(st, rank, step, d, need)
                if ch:
                    out += ch
        return out

    def _alone(self, rank: Any, step: Any, d: float, need: float) -> list[Change]:
        """:meth:`update` of a step with one rank: :meth:`_against_peers` without a reference
        (the step counts towards a role; the value is one of its usual ones)."""
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[rank] = _Rank(self.cfg, self._back)
        st.seen += 1
        st.last = d
        if st.role is None:
            st.role_like += self.role_max >= 0
            if st.seen >= self.cfg.fire_steps:
                st.role = st.role_like == st.seen
        st.usual.add(d)
        return self._against_history(st, rank, step, d, need) if self.history else []

    def _quiet(self, values: dict, need: float, n: int) -> bool:
        """Nothing can be out of line (every value under ``need``) and nothing is on: the step is
        skipped, and the windows and usual durations restart (earlier hits no longer count:
        stricter than judging this step as a miss)."""
        if max(values.values(), default=0.0) >= need or not self.idle or not self.settled(n):
            return False
        for st in self.ranks.values():
            if st.peer.hits:
                st.peer.recent.clear()
                st.peer.hits = 0
            if st.usual.values:
                st.usual.reset()
        return True

    def _references(self, items: list) -> list:
        """Per rank, in ``items`` order (sorted by duration): (the median of the other ranks at this
        step, the median of their usual durations or None); (None, None) without peers."""
        n = len(items)
        if n < 2:
            return [(None, None)] * n
        ranks = self.ranks
        base = [st.usual.baseline() if (st := ranks.get(r)) is not None else None for r, _v in items]
        if n == 2:  # each one's peer is the other
            return [(items[1][1], base[1]), (items[0][1], base[0])]
        vals = [v for _r, v in items]
        known = sorted(b for b in base if b is not None)
        everyone = fmedian(known) if known else None
        out = []
        for i, b in enumerate(base):
            if b is None:
                usual = everyone
            else:
                usual = median_without(known, bisect_left(known, b)) if len(known) >= 2 else None
            out.append((median_without(vals, i), usual))
        return out

    def _against_peers(self, st: _Rank, rank: Any, step: Any, d: float, ref_now: float | None,
                       usual: float | None, need: float) -> list[Change]:
        """Straggler. To start, the reference is the larger of its peers' median this step and their
        usual durations (a step where the peers were quick is no evidence); once on, the smaller
        (a step where they were slow too does not end it)."""
        cfg = self.cfg
        if ref_now is None:
            role_like = self.role_max >= 0
        else:
            role_like = ref_now <= self.role_max and d > self.role_max and d > cfg.straggler_ratio * ref_now
        if st.role is None:
            st.role_like += role_like
            if st.seen >= cfg.fire_steps:
                st.role = st.role_like == st.seen
        # a step like a role's is judged once the rank is known to have none (its peers' work
        # was merely quick that step); until then (its first ``fire_steps``) it is not
        if ref_now is None or st.role is True or (st.role is None and role_like):
            st.usual.add(d)
            return []
        p = st.peer
        ref = ref_now if usual is None else (min(ref_now, usual) if p.active else max(ref_now, usual))
        slower = d - ref_now >= need
        hit = slower and d >= cfg.straggler_ratio * ref and d - ref >= need
        payload = (d / ref if ref > 0 else float("inf"), d, ref, slower)
        if not hit:
            st.usual.add(d)
        ch = p.update(step, hit, payload)
        if ch is None and st.ep is None:
            return []
        return self._advance(st, "straggler", rank, step, hit, payload if hit else None, ch)

    def _against_history(self, st: _Rank, rank: Any, step: Any, d: float, need: float) -> list[Change]:
        """Slowdown: the rank against its own rolling baseline (a value under ``need`` cannot
        exceed anything by ``need``)."""
        h = st.hist
        if d < need:
            out: list[Change] = []
            if len(h.values) >= h.min_n:
                ch = st.hist_p.update(step, False)
                if ch is not None or st.hep is not None:
                    out = self._advance(st, "slowdown", rank, step, False, None, ch)
            h.add(d)
            return out
        base = h.baseline()
        if base is None:
            h.add(d)
            return []
        hit = d >= self.cfg.history_ratio * base and d - base >= need
        payload = (d / base if base > 0 else float("inf"), d, base) if hit else None
        if not hit:
            h.add(d)
        ch = st.hist_p.update(step, hit, payload)
        if ch is None and st.hep is None:
            return []
        return self._advance(st, "slowdown", rank, step, hit, payload, ch)

    def _advance(self, st: _Rank, kind: str, rank: Any, step: Any, hit: bool, payload: Any,
                 change: str | None) -> list[Change]:
        attr = "ep" if kind == "straggler" else "hep"
        ep: Episode | None = getattr(st, attr)
        p = st.peer if kind == "straggler" else st.hist_p
        if change == "onset":
            ep = Episode(kind, rank, p.onset)
            for s, pl in p.window_hits():
                ep.add(s, pl)
            ep.judged = sum(1 for s, _h, _p in p.recent if s >= ep.onset)
            setattr(st, attr, ep)
            return [Change(kind, "onset", rank, step, ep.onset, _info(ep, payload))]
        if ep is None:
            return []
        ep.judged += 1
        if hit:
            ep.add(step, payload)
        if change == "clear":
            ep.cleared = True
            setattr(st, attr, None)
            if self.keep:
                self.episodes.append(ep)
            return [Change(kind, "clear", rank, step, ep.onset, _info(ep, payload))]
        return []

    def finish(self) -> list[Episode]:
        """Episodes still open at the end of the data join ``episodes``; returns them all."""
        for st in self.ranks.values():
            for attr in ("ep", "hep"):
                ep = getattr(st, attr)
                if ep is not None:
                    self.episodes.append(ep)
                    setattr(st, attr, None)
        return self.episodes


def _info(ep: Episode, payload: Any) -> dict:
    d = ep.summary()
    if payload is not None:
        d["ratio"], d["value_s"], d["reference_s_now"] = payload[:3]
    d["last_hit_step"] = ep.end
    return d


# ---------------------------------------------------------------- shares and growth


def covered(intervals: list) -> float:
    """Length of the union of ``[(start, end)]`` (concurrent intervals count once)."""
    total, cur_s, cur_e = 0, None, None
    for a, b in sorted(intervals):
        if cur_e is None or a > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = a, b
        elif b > cur_e:
            cur_e = b
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def theil_sen(x: list, y: list) -> float:
    """Median of pairwise slopes (subsampled to ~60 points: O(60^2))."""
    n = len(x)
    step = max(1, n // 60)
    idx = list(range(0, n, step))
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for a, i in enumerate(idx) for j in idx[a + 1:] if x[j] != x[i]]
    return median(slopes) if slopes else 0.0


def growth(steps: list, vals: list, min_rise: float) -> dict | None:
    """``{"first", "last", "slope"}`` when the series grows: its last third's mean exceeds its
    first third's by more than ``min_rise`` and the Theil-Sen slope is positive; else None.
    Needs >= 6 points."""
    n = len(vals)
    if n < 6 or max(vals) - min(vals) <= min_rise:  # the thirds' means cannot differ by more
        return None
    third = n // 3
    first = sum(vals[:third]) / third
    last = sum(vals[-third:]) / third
    if last - first <= min_rise:
        return None
    slope = theil_sen(steps, vals)
    if slope <= 0:
        return None
    return {"first": first, "last": last, "slope": slope}
