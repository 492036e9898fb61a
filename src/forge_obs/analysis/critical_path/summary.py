"""A step's critical path as plain data: the path, time on it per stage, every process's busy
time and slack, the one-line answer, and what changed against the fast steps.

A *stage* is (mesh, actor, rank, span name): ``generator_1`` ``generate`` on rank 0. Every value
is JSON-serialisable (seconds as floats, times as epoch µs).
"""

from __future__ import annotations

import bisect
import statistics
from operator import attrgetter
from typing import Any

from forge_obs.analysis.critical_path.graph import Graph, Window
from forge_obs.analysis.critical_path.walk import Segment, Walker
from forge_obs.analysis.doctor.subjects import replica_family

__all__ = ["step_result", "step_tables", "stage_label", "answer", "compare", "compare_to", "medians", "fast_half",
           "median_duration", "slowest_in", "cause", "cause_index", "idle_mesh", "idle_of", "total_by", "unexplained",
           "Busy", "MEDIAN_FLOOR_SHARE", "LITTLE_EXPLAINED"]


#: the fields of a process, of a path segment, of a stage and of a process's slack, in the order
#: of the rows :func:`step_tables` returns (and of the keys of :func:`step_result`'s dicts)
_WHO = ("mesh", "actor", "rank", "host", "pid")
_SEGMENT = _WHO + ("name", "task", "step", "start_us", "end_us", "duration_s", "link", "controller", "wait",
                   "unfinished", "unexplained")
_STAGE = ("mesh", "actor", "rank", "name", "path_s", "controller", "wait", "root", "unfinished", "share")
_SLACK = _WHO + ("busy_s", "waiting_s", "idle_s", "on_path_s")


def _who(st: Any, cache: dict) -> tuple:
    """The identity fields of a stream (``cache``: id(stream) -> them, filled as they are asked)."""
    w = cache.get(id(st))
    if w is None:
        w = cache[id(st)] = (st.mesh, st.actor, st.rank, st.host, st.pid)
    return w


def stage_label(s: dict) -> str:
    """``generator_1 `generate` (rank 0)``."""
    return f"{s['mesh']} `{s['name']}` (rank {s['rank']})"


def _segments(path: list, walker: Walker) -> list:
    """The path's segments as rows of :data:`_SEGMENT`."""
    out = []
    who, is_wait = walker.who, walker.is_wait
    for seg in path:
        sp = seg.span
        st, lane = sp.stream, sp.lane
        lanes = st.lanes
        out.append((*(who.get(id(st)) or _who(st, who)), sp.name, lanes[lane] if lane in lanes else str(lane), sp.step, seg.start, seg.end,
                    (seg.end - seg.start) / 1e6, seg.link, sp.ctl or lane == -1, is_wait(sp.name), sp.unfinished,
                    seg.gap))
    return out


def _stages(segs: list, total_s: float) -> list:
    """Time on the path per stage, largest first, as rows (lists) of :data:`_STAGE`."""
    acc: dict[tuple, list] = {}
    for s in segs:
        k = (s[0], s[1], s[2], s[5])
        a = acc.get(k)
        if a is None:
            a = acc[k] = [s[0], s[1], s[2], s[5], 0.0, s[12], s[13], False, False]
        a[4] += s[10]
        a[8] |= s[14]
        a[7] |= s[11] == "root"
    out = sorted(acc.values(), key=lambda a: -a[4])
    for a in out:
        a.append(a[4] / total_s if total_s > 0 else 0.0)
    return out


def total_by(stages: list, key: str) -> dict:
    """Time on the path per value of ``key`` (``mesh``, ``name``) over ``stages``."""
    out: dict[str, float] = {}
    for a in stages:
        out[str(a[key])] = out.get(str(a[key]), 0.0) + a["path_s"]
    return out


class Busy:
    """Per process: its top-level spans by start, to measure busy time in a window fast."""

    def __init__(self, g: Graph, walker: Walker) -> None:
        self.per: dict[int, tuple] = {}
        self.streams = {}
        self.who: dict = {}
        waits, ctl = walker.waits, g.ctl
        for s in sorted(g.roots, key=attrgetter("start")):
            key = id(s.stream)
            if key in ctl:
                continue
            p = self.per.get(key)
            if p is None:
                p = self.per[key] = ([], [], [0])
                self.streams[key] = s.stream
            p[0].append(s.start)
            p[1].append((s.start, s.end, waits(s), s.dur))
            if s.dur > p[2][0]:
                p[2][0] = s.dur

    def window(self, lo: int, hi: int) -> dict:
        """stream id -> (busy µs, µs in waits) within ``[lo, hi]``."""
        out = {}
        for key, (starts, spans, longest) in self.per.items():
            a = bisect.bisect_left(starts, lo - longest[0])
            b = bisect.bisect_left(starts, hi)
            busy = waits = 0
            cur_s = cur_e = None
            for s, e, w, d in spans[a:b]:
                s, e = max(s, lo), min(e, hi)
                if e <= s:
                    continue
                waits += w * (e - s) // d if d else 0
                if cur_e is None or s > cur_e:
                    if cur_e is not None:
                        busy += cur_e - cur_s
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            if cur_e is not None:
                busy += cur_e - cur_s
            out[key] = (busy, waits)
        return out


def _slack(busy: Busy, w: Window, segs: list) -> list:
    """Every process's busy, waiting, idle time and time on the path in ``w``, as rows of :data:`_SLACK`."""
    span_us = max(w.end - w.start, 0)
    on_path: dict[tuple, float] = {}
    for s in segs:
        k = (s[3], s[4], s[0], s[2])
        on_path[k] = on_path.get(k, 0.0) + s[10]
    out = []
    for key, (b, wt) in busy.window(w.start, w.end).items():
        st = busy.streams[key]
        if st.first_ts is not None and (st.first_ts > w.end or (st.last_ts or 0) < w.start):
            continue
        work = max(b - wt, 0)
        who = _who(st, busy.who)
        out.append((*who, work / 1e6, wt / 1e6, (span_us - work) / 1e6, on_path.get((who[3], who[4], who[0], who[2]), 0.0)))
    out.sort(key=lambda r: (r[0], r[2], r[3], r[4]))
    return out


def step_tables(g: Graph, walker: Walker, busy: Busy, w: Window) -> tuple:
    """:func:`step_result` as rows: ``(root name, duration_s, unfinished, path, stages, slack)``,
    the path's segments as tuples of :data:`_SEGMENT`, the stages as lists of :data:`_STAGE`,
    the slack as tuples of :data:`_SLACK` (what the index stores, without a dict per row)."""
    path: list[Segment] = walker.path(w)
    segs = _segments(path, walker)
    total_s = (w.end - w.start) / 1e6
    root = w.root.name if w.root is not None else "step"
    return (root, total_s, w.unfinished or any(s[14] for s in segs), segs, _stages(segs, total_s),
            _slack(busy, w, segs))


def step_result(g: Graph, walker: Walker, busy: Busy, w: Window) -> dict:
    """The critical path of window ``w`` and what it is made of (no answer yet: see :func:`answer`)."""
    root, total_s, unfinished, segs, stages, slack = step_tables(g, walker, busy, w)
    st = [dict(zip(_STAGE, a)) for a in stages]
    return {"step": w.step, "root": root, "start_us": w.start, "end_us": w.end, "duration_s": total_s,
            "unfinished": unfinished, "path": [dict(zip(_SEGMENT, s)) for s in segs], "stages": st,
            "by_mesh": total_by(st, "mesh"), "by_name": total_by(st, "name"),
            "slack": [dict(zip(_SLACK, r)) for r in slack]}


def _place(seg: dict) -> str:
    return f"{seg['mesh']} `{seg['name']}` (rank {seg['rank']})"


def unexplained(path: list) -> dict:
    """The time on ``path`` that no span explains (segments marked ``unexplained``: a waiting
    span's own time around what it awaited), and the stretch of it that is largest, grouped by
    the spans it lies between: ``{"total_s", "top": {"duration_s", "between", "where"} | None}``.
    ``where`` names the process when both neighbours are in one process."""
    total = 0.0
    groups: dict[tuple, list] = {}
    for i, seg in enumerate(path):
        if not seg.get("unexplained"):
            continue
        total += seg["duration_s"]
        prev = next((p for p in reversed(path[:i]) if not p.get("unexplained")), None)
        nxt = next((p for p in path[i + 1:] if not p.get("unexplained")), None)
        key = tuple(None if x is None else (x["mesh"], x["rank"], x["host"], x["pid"], x["name"]) for x in (prev, nxt))
        g = groups.setdefault(key, [0.0, prev, nxt])
        g[0] += seg["duration_s"]
    top = None
    if groups:
        dur, prev, nxt = max(groups.values(), key=lambda g: g[0])
        same = prev is not None and nxt is not None and (prev["host"], prev["pid"]) == (nxt["host"], nxt["pid"])
        if same:
            where = f"in {prev['mesh']} (rank {prev['rank']}), between `{prev['name']}` and `{nxt['name']}`"
        elif prev is not None and nxt is not None:
            where = f"between {_place(prev)} and {_place(nxt)}"
        else:
            where = f"after {_place(prev)}" if prev is not None else f"before {_place(nxt)}" if nxt is not None \
                else "in the step"
        top = {"duration_s": dur, "where": where, "process": (prev["mesh"], prev["rank"]) if same else None,
               "between": [None if x is None else {k: x[k] for k in ("mesh", "actor", "rank", "name")} for x in (prev, nxt)]}
    return {"total_s": total, "top": top}


def cause(r: dict) -> dict | None:
    """The stage the step waited on: the largest that is neither a wait nor the step span's own
    time, else the largest that is not a wait, else the largest."""
    st = r["stages"]
    i = cause_index([(a["root"], a["wait"]) for a in st])
    return None if i is None else st[i]


def cause_index(stages: list) -> "int | None":
    """:func:`cause`'s choice among ``stages`` (``(root, wait)`` of each, largest first): its index."""
    for i, (root, wait) in enumerate(stages):
        if not root and not wait:
            return i
    for i, (_root, wait) in enumerate(stages):
        if not wait:
            return i
    return 0 if stages else None


def _key(a: dict) -> tuple:
    return (a["mesh"], a["actor"], a["rank"], a["name"])


#: a stage whose median time on the path in the fast steps is under this share of their median
#: duration was not really on their path: no ratio is given against it (a ratio to a near-zero
#: median is no measure)
MEDIAN_FLOOR_SHARE = 0.05
#: a stage at least this many times its median grew (an answer led by unexplained time names it too)
GREW = 1.5
#: under this share of the step, an answer says plainly that its spans explain little of it
LITTLE_EXPLAINED = 0.5


def _against_median(c: dict, medians: dict, fast_median_s: "float | None") -> dict:
    """``c`` with ``median_path_s`` (its median time on the path in the fast steps: the same
    stage, else the same span name in its mesh, else in its replica family), ``ratio_to_median``
    (None when that median is under :data:`MEDIAN_FLOOR_SHARE` of the fast steps' median
    duration) and ``excess_s``."""
    med = next((medians[k][0] for k in (_key(c), (c["mesh"], None, None, c["name"]),
                                        (replica_family(c["mesh"]), None, None, c["name"])) if k in medians), 0.0)
    floor = MEDIAN_FLOOR_SHARE * fast_median_s if fast_median_s else 0.0
    ratio = c["path_s"] / med if med > 0 and med >= floor else None
    return dict(c, median_path_s=med, ratio_to_median=ratio, excess_s=c["path_s"] - med)


def _stage_text(r: dict, c: dict) -> str:
    verb = "in" if c["controller"] else "waiting on"
    text = f"{c['path_s']:.3f} s ({100 * c['share']:.0f} %) {verb} {stage_label(c)}"
    if c["unfinished"]:
        last = r["path"][-1] if r.get("path") else None
        if last is not None and last["unfinished"]:
            return text + " (unfinished: still running at the end of the data)"
        return text + " (unfinished: it never ended; the step went on without it: its process died or hung)"
    if c["ratio_to_median"] is not None:
        return text + f", {c['ratio_to_median']:.1f}x its median in the fast steps"
    if c["median_path_s"] > 0:
        return text + f", +{c['excess_s']:.3f} s over the fast steps (median {c['median_path_s']:.3f} s on their path)"
    return text + ", never on the path in the fast steps"


def answer(r: dict, medians: dict, fast_median_s: "float | None" = None) -> None:
    """Adds ``cause``, ``idle``, ``unexplained``, ``explained`` and ``answer`` (the one line) to
    step result ``r``. ``medians``: :func:`medians` of the run's fast steps, whose median
    duration is ``fast_median_s``. The line leads with the largest stretch no span explains
    when it is longer than the largest stage, and always says how much of the step the spans
    explain (``unexplained["leads"]``: the line leads with it)."""
    c = cause(r)
    u = unexplained(r.get("path") or [])
    dur = r["duration_s"]
    r["unexplained"] = u
    r["explained"] = max(0.0, 1.0 - u["total_s"] / dur) if dur > 0 else 1.0
    line = f"step {r['step']}: {dur:.3f} s" + (" (unfinished)" if r["unfinished"] else "")
    top = u["top"]
    if c is not None:
        c = _against_median(c, medians, fast_median_s)
    u["leads"] = top is not None and (c is None or top["duration_s"] > c["path_s"])
    if u["leads"]:
        pct = 100 * top["duration_s"] / dur if dur > 0 else 0.0
        line += f", {top['duration_s']:.3f} s ({pct:.0f} %) unexplained {top['where']}: no span covers it"
        if c is not None and (c["unfinished"] or c["ratio_to_median"] is None or c["ratio_to_median"] >= GREW):
            line += f"; the largest stage: {_stage_text(r, c)}"  # only a stage that changed
    elif c is not None:
        line += ", " + _stage_text(r, c)
    else:
        line += ", no span on its path"
    idle = idle_mesh(r, c["mesh"]) if c is not None else None
    if idle is not None:
        line += f"; {idle['mesh']} idle {idle['idle_s']:.3f} s"
    r["cause"], r["idle"], r["answer"] = c, idle, line + _explained_text(r["explained"])


def _explained_text(frac: float) -> str:
    if frac < LITTLE_EXPLAINED:
        return (f"; its spans explain only {100 * frac:.0f} % of the step (the rest is time no span covers: "
                "work outside spans, or waits the timeline cannot see)")
    return f"; its spans explain {100 * frac:.0f} % of the step"


def idle_mesh(r: dict, skip: str) -> dict | None:
    """The mesh (other than the cause's) that did the most work in the step, with its idle time
    (its least idle rank's): what the slow stage kept waiting."""
    got = idle_of([(s["mesh"], s["idle_s"], s["busy_s"]) for s in r["slack"]], skip)
    return None if got is None else {"mesh": got[0], "idle_s": got[1]}


def idle_of(slack: list, skip: str) -> "tuple | None":
    """:func:`idle_mesh` over ``slack`` (``(mesh, idle_s, busy_s)`` of each process): ``(mesh, idle_s)``."""
    idle: dict[str, float] = {}
    work: dict[str, float] = {}
    for mesh, idle_s, busy_s in slack:
        if mesh == skip:
            continue
        idle[mesh] = min(idle.get(mesh, idle_s), idle_s)
        work[mesh] = work.get(mesh, 0.0) + busy_s
    if not work:
        return None
    mesh = max(work, key=lambda m: work[m])
    return (mesh, idle[mesh]) if idle[mesh] > 0 else None


def medians(results: list) -> dict:
    """stage key -> (median seconds on the path over the steps of ``results`` it is on, how many)."""
    keys: dict[tuple, list] = {}
    for r in results:
        for a in r["stages"]:
            for k in (_key(a), (a["mesh"], None, None, a["name"]), (replica_family(a["mesh"]), None, None, a["name"])):
                keys.setdefault(k, []).append(a["path_s"])
    return {k: (statistics.median(v), len(v)) for k, v in keys.items()}


def compare(r: dict, fast: list, top: int = 3) -> dict:
    """What changed on ``r``'s path against the ``fast`` steps: the stages whose path time grew
    most over their median there."""
    med = statistics.median(f["duration_s"] for f in fast) if fast else None
    return compare_to(r, medians(fast) if fast else {}, len(fast), med, top)


def compare_to(r: dict, ref: dict, fast_steps: int, fast_median_s: "float | None", top: int = 3) -> dict:
    """:func:`compare` against ``ref`` (:func:`medians` of ``fast_steps`` steps whose median
    duration is ``fast_median_s``)."""
    mine = {_key(a): a for a in r["stages"]}
    rows = []
    for k in set(k for k in ref if k[1] is not None) | set(mine):
        now = mine[k]["path_s"] if k in mine else 0.0
        was, n = ref.get(k, (0.0, 0))
        rows.append({"mesh": k[0], "actor": k[1], "rank": k[2], "name": k[3], "step_s": now, "fast_s": was,
                     "fast_steps_on_path": n, "delta_s": now - was})
    rows.sort(key=lambda x: (-x["delta_s"], _stage_order(x)))  # ties in one order, whatever the set's
    return {"fast_steps": fast_steps, "fast_median_s": fast_median_s,
            "grew": [x for x in rows[:top] if x["delta_s"] > 0],
            "shrank": sorted((x for x in rows if x["delta_s"] < 0),
                             key=lambda x: (x["delta_s"], _stage_order(x)))[:top]}


def _stage_order(x: dict) -> tuple:
    """A stage's place among stages that changed as much: by mesh, actor, rank, span name."""
    return (str(x["mesh"]), str(x["actor"]), -1 if x["rank"] is None else x["rank"], str(x["name"]))


def median_duration(results: list) -> "float | None":
    """The median duration of step results ``results`` (None without any)."""
    durs = sorted(r["duration_s"] for r in results)
    if not durs:
        return None
    k = len(durs)
    return durs[k // 2] if k % 2 else (durs[k // 2 - 1] + durs[k // 2]) / 2


def fast_half(results: list) -> list:
    """The finished step results whose duration is at most their lower median: the steps a slow
    one is compared against."""
    done = [r for r in results if not r["unfinished"]]
    if not done:
        return []
    cut = sorted(r["duration_s"] for r in done)[(len(done) - 1) // 2]
    return [r for r in done if r["duration_s"] <= cut]


def slowest_in(results: list, first_step: int, last_step: int) -> "dict | None":
    """The slowest of step results ``results`` in ``[first_step, last_step]`` with its answer,
    judged against the fast half of those before it (of all of them when none is before); None
    when none is inside. What a live alert cites."""
    inside = [r for r in results if first_step <= r["step"] <= last_step]
    if not inside:
        return None
    before = [r for r in results if r["step"] < first_step] or results
    r = max(inside, key=lambda r: r["duration_s"])
    fast = fast_half(before)
    answer(r, medians(fast), median_duration(fast))
    return r
