"""The doctor's rules over the timeline (``events/*.jsonl``): one pass over the records builds
per-step tables; then one function per rule.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> from forge_obs.analysis.doctor.timeline_rules import timeline_findings
    >>> findings, notes = timeline_findings("runs/does-not-exist", DoctorConfig(), Identities())
    >>> findings, notes
    ([], [])
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import Episode, GroupTracker, covered
from forge_obs.analysis.doctor.finding import Finding
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.reader import OPEN, SPAN, STEP
from forge_obs.recording.timeline.schema import rank_selected

__all__ = [
    "Tables",
    "peer_group",
    "scan",
    "straggler_findings",
    "hang_findings",
    "stall_findings",
    "sync_findings",
    "dropped_findings",
    "absent_rank_findings",
    "timeline_findings",
]


@dataclass
class Tables:
    """What one pass over the records leaves (times in epoch µs)."""

    run: Any
    #: (attempt, mesh, name) -> step -> rank -> [summed duration, first start, last end]
    per_step: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(dict)))
    #: (attempt, step) -> [first start, last end] over every span of the step
    step_wall: dict = field(default_factory=dict)
    longest: dict = field(default_factory=lambda: defaultdict(int))  # (attempt, mesh, name) -> µs
    opens: list = field(default_factory=list)
    last_step: dict = field(default_factory=dict)  # stream key -> step
    window: dict = field(default_factory=dict)  # stream key -> [start, end] without lifecycle spans
    budget: dict = field(default_factory=lambda: defaultdict(list))  # (stream key, name) -> [(start, end)]
    budget_steps: dict = field(default_factory=lambda: defaultdict(list))
    ctl_wait: dict = field(default_factory=lambda: defaultdict(list))  # (stream key, name) -> [(start, end)]
    stream_of: dict = field(default_factory=dict)  # (attempt, mesh, rank) -> Stream
    unstepped: dict = field(default_factory=lambda: defaultdict(int))  # (attempt, mesh) -> spans without a step
    end_by_attempt: dict = field(default_factory=dict)


def peer_group(st: Any) -> str:
    """The name ranks are compared under: the mesh, or, for the ranks of an SPMD job with pipeline
    stages, the mesh and the stage (``trainer[pp=1]``): ranks doing the same work (the DP, TP and
    CP ranks of one stage) are each other's peers; two stages are not."""
    coords = st.header.get("coords")
    if isinstance(coords, dict) and type(coords.get("pp")) is int:
        return f"{st.mesh}[pp={coords['pp']}]"
    return st.mesh


def scan(run_dir: Path, cfg: DoctorConfig) -> Tables:
    run = reader.scan(run_dir)
    t = Tables(run)
    peers: dict[int, str] = {}  # id(stream) -> its peer group
    lifecycle: dict[str, bool] = {}
    sync: dict[str, bool] = {}
    per_step, step_wall, longest, window = t.per_step, t.step_wall, t.longest, t.window
    life_re, sync_re = cfg.lifecycle_re, cfg.sync_re
    for it in reader.walk(run):
        k = it[0]
        if k is SPAN:
            _k, st, _lane, name, step, ts, dur, _ex, _cpu = it
            end = ts + dur
            life = lifecycle.get(name)
            if life is None:
                life = lifecycle[name] = bool(life_re.search(name))
            mesh = peers.get(id(st))
            if mesh is None:
                mesh = peers[id(st)] = peer_group(st)
            g = (st.attempt, mesh, name)
            if dur > longest[g]:
                longest[g] = dur
            if life:
                continue
            w = window.get(st.key)
            if w is None:
                window[st.key] = [ts, end]
            else:
                if ts < w[0]:
                    w[0] = ts
                if end > w[1]:
                    w[1] = end
            if step is not None:
                cell = per_step[g][step].get(st.rank)
                if cell is None:
                    per_step[g][step][st.rank] = [dur, ts, end]
                    t.stream_of[(st.attempt, mesh, st.rank)] = st
                else:
                    cell[0] += dur
                    if ts < cell[1]:
                        cell[1] = ts
                    if end > cell[2]:
                        cell[2] = end
                sw = step_wall.get((st.attempt, step))
                if sw is None:
                    step_wall[(st.attempt, step)] = [ts, end]
                else:
                    if ts < sw[0]:
                        sw[0] = ts
                    if end > sw[1]:
                        sw[1] = end
                t.last_step[st.key] = step
            elif not st.header.get("ctl"):
                t.unstepped[(st.attempt, mesh)] += 1
            s = sync.get(name)
            if s is None:
                s = sync[name] = bool(sync_re.search(name))
            if s:
                t.budget[(st.key, name)].append((ts, end))
                t.budget_steps[(st.key, name)].append(step)
            if st.header.get("ctl") and "wait" in name.lower():
                t.ctl_wait[(st.key, name)].append((ts, end))
        elif k is OPEN:
            t.opens.append(it)
        elif k is STEP:
            t.last_step[it[1].key] = it[3]
    for st in run.streams.values():
        if st.last_ts is not None:
            t.end_by_attempt[st.attempt] = max(t.end_by_attempt.get(st.attempt, st.last_ts), st.last_ts)
    return t


def _where(ids: Identities, st: Any) -> dict:
    return ids.of(st.mesh, st.rank, st.actor or None)


def _ident_details(st: Any) -> dict:
    return {"host": st.host, "pid": st.pid, "attempt": st.attempt}


# ---------------------------------------------------------------- stragglers and slowdowns


def _excess(ep: Episode) -> float:
    s = ep.summary()
    return (s["median_s"] or 0.0) - (s["reference_s"] or 0.0)


def straggler_findings(t: Tables, cfg: DoctorConfig, ids: Identities) -> tuple[list[Finding], list[str]]:
    notes: list[str] = []
    eps: list[tuple] = []  # (group, Episode)
    mesh_ranks: dict[tuple, set] = defaultdict(set)
    mesh_steps: dict[tuple, set] = defaultdict(set)
    roles: list = []
    for g, steps in t.per_step.items():
        attempt, mesh, name = g
        tr = GroupTracker(cfg, keep=True, roles=not cfg.wait_re.search(name))
        for step in sorted(steps, key=lambda s: (not isinstance(s, (int, float)), s)):
            by_rank = steps[step]
            sw = t.step_wall.get((attempt, step))
            step_s = (sw[1] - sw[0]) / 1e6 if sw else None
            tr.update(step, {r: c[0] / 1e6 for r, c in by_rank.items()}, step_s)
            mesh_ranks[(attempt, mesh)].update(by_rank)
            mesh_steps[(attempt, mesh)].add(step)
        for ep in tr.finish():
            if ep.hits >= cfg.min_episode_steps and ep.hits >= cfg.persist * ep.judged:
                eps.append((g, ep))
        roles.append((g, tr.roles()))
    for (attempt, mesh, name), rs in roles:
        if len(mesh_ranks[(attempt, mesh)]) < 2:
            continue  # a one-rank mesh: noted below
        for r, d in sorted(rs.items()):
            st = t.stream_of.get((attempt, mesh, r))
            w = _where(ids, st)["where"] if st else f"{mesh}/r{r}"
            notes.append(f"role: {w} alone does '{name}' ({d * 1e3:.2f} ms per step; its peers spend "
                         f"< {cfg.role_peer_max_s * 1e3:g} ms or have no such span): judged against its own "
                         "history, not as a straggler")
    # what could not be judged
    for (attempt, mesh), ranks in sorted(mesh_ranks.items(), key=lambda kv: str(kv[0])):
        if mesh == "controller":
            continue
        n_steps = len(mesh_steps[(attempt, mesh)])
        if len(ranks) < 2:
            notes.append(f"straggler: {mesh} has 1 rank: no peers to compare; judged against its own history only")
        if n_steps < cfg.fire_steps:
            notes.append(f"straggler/slowdown: {mesh} has {n_steps} steps; at least {cfg.fire_steps} are needed to judge")
        elif n_steps < cfg.history_min_steps + cfg.fire_steps:
            notes.append(f"slowdown: {mesh} has {n_steps} steps; at least {cfg.history_min_steps + cfg.fire_steps} "
                         "are needed to judge a rank against its own history")
    for (attempt, mesh), n in sorted(t.unstepped.items(), key=lambda kv: str(kv[0])):
        if (attempt, mesh) not in mesh_ranks:
            notes.append(f"straggler/slowdown: the {n} spans of {mesh} carry no step (set_step is not called "
                         "there): not compared step by step")
    return _straggler_roots(t, cfg, ids, eps), notes


def _overlap(a: Episode, b: Episode, slack: int = 1) -> bool:
    try:
        return a.onset - slack <= (b.end if b.end is not None else b.onset) and b.onset - slack <= (
            a.end if a.end is not None else a.onset)
    except TypeError:
        return False


def _waits_for(t: Tables, root_g: tuple, root: Episode, g: tuple, ep: Episode) -> bool:
    """``ep`` (another rank) was still running when ``root``'s slow span ended, in most of the
    steps both were out of line: it waited for the root."""
    common = set(root.hit_steps) & set(ep.hit_steps)
    if not common:
        return False
    n = 0
    for s in common:
        r = t.per_step[root_g][s].get(root.rank)
        c = t.per_step[g][s].get(ep.rank)
        if r and c and c[1] <= r[2] <= c[2] + 1000:
            n += 1
    return n >= 0.5 * len(common)


def _straggler_roots(t: Tables, cfg: DoctorConfig, ids: Identities, eps: list) -> list[Finding]:
    wait = {g: bool(cfg.wait_re.search(g[2])) for g, _ep in eps}
    strag = [(g, ep) for g, ep in eps if ep.kind == "straggler"]
    slow = [(g, ep) for g, ep in eps if ep.kind == "slowdown"]
    # ---- per rank: overlapping out-of-line spans are one event; the root span is the most
    # specific one that explains at least half of the largest excess
    by_rank: dict[tuple, list] = defaultdict(list)
    for g, ep in strag:
        if not wait[g]:
            by_rank[(g[0], g[1], ep.rank)].append((g, ep))
    clusters: list[list] = []
    for _k, items in by_rank.items():
        items.sort(key=lambda x: x[1].onset)
        for it in items:
            for c in clusters:
                if c[0][0][:2] == it[0][:2] and c[0][1].rank == it[1].rank and any(_overlap(x[1], it[1]) for x in c):
                    c.append(it)
                    break
            else:
                clusters.append([it])
    roots = []
    for c in clusters:
        top = max(_excess(ep) for _g, ep in c)
        cand = [x for x in c if _excess(x[1]) >= 0.5 * top]
        root = min(cand, key=lambda x: (x[1].summary()["median_s"] or 0.0))
        roots.append({"g": root[0], "ep": root[1], "also": [x for x in c if x is not root], "cons": []})
    # ---- a rank whose slow span ended while another rank waited: the waiting one is a consequence
    roots.sort(key=lambda r: (r["ep"].onset, -_excess(r["ep"])))
    final = []
    for r in roots:
        parent = next((p for p in final if p["g"][:2] == r["g"][:2] and p["ep"].rank != r["ep"].rank
                       and _overlap(p["ep"], r["ep"]) and _waits_for(t, p["g"], p["ep"], r["g"], r["ep"])), None)
        if parent is not None:
            parent["cons"].append(("waits", r["g"], r["ep"]))
        else:
            final.append(r)
    # ---- out-of-line waits: listed under the root they wait for, or pointing at the rank that
    # does not wait (its peers wait for it in a collective)
    waits = [(g, ep) for g, ep in strag if wait[g]]
    orphan: dict[tuple, list] = defaultdict(list)
    for g, ep in waits:
        parent = next((p for p in final if p["g"][:2] == g[:2] and p["ep"].rank != ep.rank and _overlap(p["ep"], ep)), None)
        if parent is not None:
            parent["cons"].append(("waits", g, ep))
        else:
            orphan[g].append(ep)
    inferred = []
    for g, w_eps in orphan.items():
        attempt, mesh, name = g
        ranks = {r for s in t.per_step[g].values() for r in s}
        waiting = {ep.rank for ep in w_eps}
        rest = ranks - waiting
        if len(rest) == 1:
            inferred.append((g, next(iter(rest)), w_eps))
    out = [_straggler_finding(t, ids, r) for r in final]
    out += [_inferred_finding(t, ids, g, rank, w_eps) for g, rank, w_eps in inferred]
    # ---- slowdowns: a rank's own slowdown within a straggler episode is part of it; others that
    # start with a root event are consequences of it; the rest are root events of their own
    rest_slow = []
    for g, ep in slow:
        f = next((f for f in out if f.details.get("attempt") == g[0] and f.mesh == g[1] and f.rank == ep.rank
                  and f.onset_step is not None and _overlap_steps(f, ep)), None)
        if f is not None:
            if g[2] == f.details.get("span"):
                f.details["history_ratio"] = ep.summary()["median_ratio"]
            continue
        f = next((f for f in out if f.details.get("attempt") == g[0] and f.onset_step is not None
                  and f.onset_step - 1 <= ep.onset <= f.steps[-1]), None) if not wait[g] else None
        if f is None and wait[g]:
            continue  # a wait that grew without a root we can see: not a finding
        if f is not None:
            f.consequences.append(_slow_consequence(t, ids, g, ep))
            continue
        rest_slow.append((g, ep))
    out += _slowdown_findings(t, cfg, ids, rest_slow)
    return out


def _overlap_steps(f: Finding, ep: Episode) -> bool:
    lo, hi = (f.steps[0], f.steps[-1]) if f.steps else (f.onset_step, f.onset_step)
    return ep.onset - 1 <= hi and lo - 1 <= (ep.end if ep.end is not None else ep.onset)


def _straggler_finding(t: Tables, ids: Identities, r: dict) -> Finding:
    g, ep = r["g"], r["ep"]
    attempt, mesh, name = g
    st = t.stream_of.get((attempt, mesh, ep.rank))
    s = ep.summary()
    ratio, med, ref = s["median_ratio"] or 0.0, s["median_s"] or 0.0, s["reference_s"] or 0.0
    first_step = min(t.per_step[g])
    since = f"since step {ep.onset}" + (" (from the start)" if ep.onset == first_step else "")
    until = f", until step {ep.end}" if ep.cleared else ""
    w = _where(ids, st) if st else ids.of(mesh, ep.rank)
    msg = (f"{w['where']} is a straggler {since}{until}: '{name}' takes {ratio:.1f}x the median of its {mesh} "
           f"peers ({med * 1e3:.1f} ms vs {ref * 1e3:.1f} ms) in {ep.hits}/{ep.judged} steps")
    if r["also"]:
        msg += " (also slow: " + ", ".join(sorted({x[0][2] for x in r["also"]})) + ")"
    f = Finding("straggler", msg, steps=[ep.onset, ep.end], onset_step=ep.onset,
                details={"span": name, "median_ratio": ratio, "median_s": med, "reference_s": ref,
                         "slow_steps": ep.hits, "steps_compared": ep.judged,
                         "spans": [name] + sorted({x[0][2] for x in r["also"]}),
                         **(_ident_details(st) if st else {"attempt": attempt})})
    f.set_where(w)
    for _why, cg, cep in r["cons"]:
        f.consequences.append(_wait_consequence(t, ids, cg, cep))
    return f


def _wait_consequence(t: Tables, ids: Identities, g: tuple, ep: Episode) -> dict:
    st = t.stream_of.get((g[0], g[1], ep.rank))
    w = _where(ids, st) if st else ids.of(g[1], ep.rank)
    s = ep.summary()
    extra = (s["median_s"] or 0.0) - (s["reference_s"] or 0.0)
    return {"kind": "waits", **w, "steps": [ep.onset, ep.end], "span": g[2],
            "message": f"waits in '{g[2]}' (+{extra * 1e3:.1f} ms per step, {s['median_ratio'] or 0:.1f}x its peers)"}


def _slow_consequence(t: Tables, ids: Identities, g: tuple, ep: Episode) -> dict:
    st = t.stream_of.get((g[0], g[1], ep.rank))
    w = _where(ids, st) if st else ids.of(g[1], ep.rank)
    s = ep.summary()
    return {"kind": "slowdown", **w, "steps": [ep.onset, ep.end], "span": g[2],
            "message": f"'{g[2]}' {s['median_ratio'] or 0:.1f}x slower than its own earlier steps"}


def _inferred_finding(t: Tables, ids: Identities, g: tuple, rank: Any, w_eps: list) -> Finding:
    attempt, mesh, name = g
    st = t.stream_of.get((attempt, mesh, rank))
    w = _where(ids, st) if st else ids.of(mesh, rank)
    onset = min(ep.onset for ep in w_eps)
    end = max(ep.end for ep in w_eps)
    ratio = median(ep.summary()["median_ratio"] or 0 for ep in w_eps)
    msg = (f"{w['where']} is a straggler since step {onset}: its {mesh} peers wait for it in '{name}' "
           f"({ratio:.1f}x longer than it does); the slow work itself has no span")
    f = Finding("straggler", msg, steps=[onset, end], onset_step=onset,
                details={"span": name, "inferred_from_waits": True, "median_ratio": ratio,
                         **(_ident_details(st) if st else {"attempt": attempt})})
    f.set_where(w)
    for ep in w_eps:
        f.consequences.append(_wait_consequence(t, ids, g, ep))
    return f


def _slowdown_findings(t: Tables, cfg: DoctorConfig, ids: Identities, eps: list) -> list[Finding]:
    # every rank of a mesh slowing down in the same span at the same time: one event of the mesh
    groups: dict[tuple, list] = defaultdict(list)
    for g, ep in eps:
        groups[g].append(ep)
    events = []  # (g, [episodes], mesh_wide)
    for g, lst in groups.items():
        ranks = {r for s in t.per_step[g].values() for r in s}
        lst.sort(key=lambda e: e.onset)
        used: set = set()
        for ep in lst:
            if id(ep) in used:
                continue
            same = [e for e in lst if id(e) not in used and abs(e.onset - ep.onset) <= 1]
            for e in same:
                used.add(id(e))
            events.append((g, same, len(ranks) >= 2 and {e.rank for e in same} >= ranks))
    # events that start together: the most specific non-controller one is the root
    events.sort(key=lambda e: min(x.onset for x in e[1]))
    clusters: list[list] = []
    for ev in events:
        on = min(x.onset for x in ev[1])
        for c in clusters:
            if c[0][0][0] == ev[0][0] and abs(min(x.onset for x in c[0][1]) - on) <= 1:
                c.append(ev)
                break
        else:
            clusters.append([ev])
    out = []
    for c in clusters:
        def key(ev):
            g, lst, _wide = ev
            return (g[1] == "controller", min(e.summary()["median_s"] or 0 for e in lst))
        top = max(_excess(e) for ev in c for e in ev[1])
        cand = [ev for ev in c if max(_excess(e) for e in ev[1]) >= 0.5 * top] or c
        root = min(cand, key=key)
        f = _slowdown_finding(t, ids, root)
        for ev in c:
            if ev is root:
                continue
            for e in ev[1]:
                f.consequences.append(_slow_consequence(t, ids, ev[0], e))
        out.append(f)
    return out


def _slowdown_finding(t: Tables, ids: Identities, ev: tuple) -> Finding:
    g, lst, wide = ev
    attempt, mesh, name = g
    ep = lst[0]
    s = ep.summary()
    onset = min(e.onset for e in lst)
    end = max(e.end for e in lst)
    if wide:
        w = ids.of(mesh, None)
        w["where"] += " (every rank)"
        who = f"{w['where']}"
    else:
        st = t.stream_of.get((attempt, mesh, ep.rank))
        w = _where(ids, st) if st else ids.of(mesh, ep.rank)
        who = w["where"]
    until = f", until step {end}" if all(e.cleared for e in lst) else ""
    msg = (f"{who}: '{name}' slowed down since step {onset}{until}: {(s['median_s'] or 0) * 1e3:.1f} ms, "
           f"{s['median_ratio'] or 0:.1f}x its own earlier steps ({(s['reference_s'] or 0) * 1e3:.1f} ms) "
           f"in {ep.hits}/{ep.judged} steps")
    f = Finding("slowdown", msg, steps=[onset, end], onset_step=onset,
                details={"span": name, "median_ratio": s["median_ratio"], "median_s": s["median_s"],
                         "reference_s": s["reference_s"], "ranks": sorted(e.rank for e in lst), "attempt": attempt})
    return f.set_where(w)


# ---------------------------------------------------------------- hangs, stalls, sync, drops


def hang_findings(t: Tables, cfg: DoctorConfig, ids: Identities) -> list[Finding]:
    by_stream: dict[tuple, list] = defaultdict(list)
    for _k, st, lane, name, step, ts, _ex in t.opens:
        end = t.end_by_attempt.get(st.attempt, ts)
        open_us = end - ts
        hist = t.longest.get((st.attempt, peer_group(st), name), 0)
        limit = max(cfg.stall_min_s * 1e6, cfg.hang_factor * hist) if hist else max(cfg.stall_min_s * 1e6, 60e6)
        if open_us > limit:
            by_stream[st.key].append((ts, st, lane, name, step, open_us, hist))
    out = []
    for _key, items in by_stream.items():
        items.sort(key=lambda x: x[0])
        ts, st, lane, name, step, open_us, hist = items[0]
        w = _where(ids, st)
        at = f"step {step}" if step is not None else "no step"
        msg = (f"{w['where']}: span '{name}' ({at}) is still open after {open_us / 1e6:.2f}s at the end of "
               f"the data; the longest finished '{name}' in {peer_group(st)} took {hist / 1e6:.3f}s"
               f" (on {st.lanes.get(lane, 'track ' + str(lane))})")
        f = Finding("hang", msg, steps=[step] if step is not None else [], onset_step=step,
                    details={"span": name, "open_s": open_us / 1e6, "longest_finished_s": hist / 1e6,
                             "task": st.lanes.get(lane), **_ident_details(st)})
        f.set_where(w)
        for ts2, _st, lane2, name2, step2, open2, _h in items[1:]:
            f.consequences.append({"kind": "hang", **w, "steps": [step2] if step2 is not None else [], "span": name2,
                                   "message": f"'{name2}' also still open ({open2 / 1e6:.2f}s, "
                                              f"on {st.lanes.get(lane2, 'track ' + str(lane2))})"})
        out.append(f)
    return out


def stall_findings(t: Tables, cfg: DoctorConfig, ids: Identities, hung: set) -> list[Finding]:
    out = []
    for st in t.run.streams.values():
        if st.clean or st.last_ts is None or st.first_ts is None or st.records < 3 or st.key in hung:
            continue
        end = t.end_by_attempt.get(st.attempt, st.last_ts)
        gap = (st.last_ts - st.first_ts) / max(st.records - 1, 1)
        silent = end - st.last_ts
        if silent > max(cfg.stall_min_s * 1e6, cfg.silence_factor * gap):
            ls = t.last_step.get(st.key)
            w = _where(ids, st)
            last = f"last step {ls}" if ls is not None else "its records carry no step"
            f = Finding("stall", f"{w['where']} went silent {silent / 1e6:.2f}s before the end of the data ({last}) "
                                 "and did not close its timeline: dead or stuck",
                        steps=[ls] if ls is not None else [], onset_step=ls,
                        details={"silent_s": silent / 1e6, "mean_gap_s": gap / 1e6, **_ident_details(st)})
            out.append(f.set_where(w))
    return out


def sync_findings(t: Tables, cfg: DoctorConfig, ids: Identities) -> tuple[list[Finding], list[str]]:
    """A state-moving span covering >= ``sync_share`` of its process's active time (start-up and
    teardown spans excluded from that time)."""
    streams = t.run.streams

    def share(key: tuple, intervals: list) -> float:
        w = t.window.get(key)
        span = (w[1] - w[0]) if w else 0
        return covered(intervals) / span if span > 0 else 0.0

    notes = []
    waits = [(share(key, iv), name) for (key, name), iv in t.ctl_wait.items()]
    wait_share, wait_name = max(waits) if waits else (0.0, None)
    hits = []
    for (key, name), spans in t.budget.items():
        if len(spans) < cfg.min_calls:
            continue
        frac = share(key, spans)
        if frac >= cfg.sync_share:
            hits.append((frac, key, name, spans))
    if hits and not waits:
        notes.append("sync_bottleneck: the controller has no span named *wait*: how long it waited is not known")
    # one event per span name and replicated mesh: the process it holds back most is the root
    groups: dict[tuple, list] = defaultdict(list)
    for h in hits:
        st = streams[h[1]]
        rep = ids.replica(st.mesh)
        base = st.mesh.rsplit("_", 1)[0] if rep is not None else st.mesh
        groups[(st.attempt, base, h[2])].append(h)
    out = []
    for _g, hs in groups.items():
        hs.sort(key=lambda h: -h[0])
        frac, key, name, spans = hs[0]
        st = streams[key]
        w = _where(ids, st)
        med_s = median(b - a for a, b in spans) / 1e6
        clause = ""
        if wait_name is not None and wait_share >= 0.1:
            clause = f"; meanwhile the controller spent {wait_share:.0%} of its time in '{wait_name}'"
        msg = (f"{w['where']}: '{name}' takes {frac:.0%} of its time ({len(spans)} calls, median {med_s:.3f}s): "
               f"moving state, not computing, holds this process back{clause}")
        steps = sorted(s for s in t.budget_steps[(key, name)] if s is not None)
        f = Finding("sync_bottleneck", msg, steps=[steps[0], steps[-1]] if steps else [],
                    onset_step=steps[0] if steps else None,
                    details={"span": name, "share": round(frac, 4), "calls": len(spans), "median_s": med_s,
                             "controller_wait_share": round(wait_share, 4), "controller_wait_span": wait_name,
                             **_ident_details(st)})
        f.set_where(w)
        for frac2, key2, _n, spans2 in hs[1:]:
            w2 = _where(ids, streams[key2])
            f.consequences.append({"kind": "sync_bottleneck", **w2, "steps": [], "span": name,
                                   "message": f"'{name}' also takes {frac2:.0%} of its time ({len(spans2)} calls)"})
        out.append(f)
    return out, notes


def dropped_findings(t: Tables, ids: Identities) -> list[Finding]:
    out = []
    for st in t.run.streams.values():
        if st.dropped:
            w = _where(ids, st)
            out.append(Finding("dropped", f"{w['where']}: {st.dropped} timeline records were dropped (buffer overflow)",
                               details={"dropped": st.dropped, **_ident_details(st)}).set_where(w))
    return out


def absent_rank_findings(t: Tables, ids: Identities) -> list[Finding]:
    """Ranks of a mesh that were selected but wrote no timeline."""
    present: dict[tuple, set] = defaultdict(set)
    meta: dict[tuple, dict] = {}
    for st in t.run.streams.values():
        if st.header.get("ctl"):
            continue
        g = (st.attempt, st.mesh)
        present[g].add(st.rank)
        m = meta.setdefault(g, {"ws": 0, "ranks": st.header.get("ranks", "all")})
        m["ws"] = max(m["ws"], int(st.header.get("ws") or 0), st.rank + 1)
    out = []
    for g, ranks in present.items():
        spec = meta[g]["ranks"]
        try:
            expected = {r for r in range(meta[g]["ws"]) if rank_selected(None if spec in ("None", "all") else spec, r)}
        except ValueError:
            expected = set(range(meta[g]["ws"]))
        for r in sorted(expected - ranks):
            w = ids.of(g[1], r)
            out.append(Finding("missing_ranks", f"{w['where']} wrote no timeline (selected, never started or died "
                                                "before its first record)",
                               details={"ranks": [r], "attempt": g[0], "timeline": True}).set_where(w))
    return out


def timeline_findings(run_dir: "str | Path", cfg: DoctorConfig, ids: Identities) -> tuple[list[Finding], list[str]]:
    run_dir = Path(run_dir)
    if not (run_dir / "events").is_dir():
        return [], []
    t = scan(run_dir, cfg)
    for st in t.run.streams.values():
        ids.learn({"mesh": st.mesh, "actor": st.actor, "rank": st.rank, "host": st.host, "pid": st.pid})
    notes: list[str] = []
    out, n = straggler_findings(t, cfg, ids)
    notes += n
    hangs = hang_findings(t, cfg, ids)
    hung = {(f.details["host"], f.details["pid"]) for f in hangs}
    out += hangs
    out += stall_findings(t, cfg, ids, {k for k in t.run.streams if (k[0], k[1]) in hung})
    s, n = sync_findings(t, cfg, ids)
    out += s
    notes += n
    out += dropped_findings(t, ids)
    out += absent_rank_findings(t, ids)
    return out, notes
