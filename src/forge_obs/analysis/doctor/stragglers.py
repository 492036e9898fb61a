"""Stragglers and slowdowns over the timeline's per-step tables (:mod:`.tables`): one
:class:`~forge_obs.analysis.doctor.detect.GroupTracker` per (attempt, peer group, span name)
finds the out-of-line episodes, then the episodes become root events. Per rank, overlapping
out-of-line spans are one event, named by the most specific span that explains it; a rank that
waited meanwhile (in a wait span, or still running when the slow span ended) is listed under it;
slowdowns that start with it follow from it. Waits out of line with no root name the one rank
that does not wait, when it arrives at the wait late (the slow work itself has no span).

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> from forge_obs.analysis.doctor.tables import Tables
    >>> from forge_obs.analysis.doctor.stragglers import straggler_findings
    >>> t = Tables(run=None)
    >>> for step in range(12):                 # rank 1 takes 200 ms from step 4, rank 0 50 ms
    ...     t0 = step * 300_000
    ...     t.step_wall[(0, step)] = [t0, t0 + 250_000]
    ...     for rank, ms in ((0, 50), (1, 200 if step >= 4 else 50)):
    ...         t.per_step[(0, "trainer", "train")][step][rank] = [ms * 1000, t0, t0 + ms * 1000]
    >>> found, notes = straggler_findings(t, DoctorConfig(), Identities())
    >>> [(f.kind, f.where, f.onset_step, f.steps) for f in found]
    [('straggler', 'trainer/r1', 4, [4, 11])]
"""

from __future__ import annotations

from collections import defaultdict
from itertools import groupby
from statistics import median
from typing import Any, Iterable, Iterator

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import Episode, GroupTracker
from forge_obs.analysis.doctor.finding import Finding
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.doctor.tables import Tables, stream_details, stream_where

__all__ = ["straggler_findings", "arrivals", "cpu_ratio"]


def straggler_findings(t: Tables, cfg: DoctorConfig, ids: Identities) -> tuple[list[Finding], list[str]]:
    """Root events of stragglers and slowdowns; notes on roles and on what was not judged."""
    eps, roles, seen = _episodes(t, cfg)
    notes = _role_notes(t, cfg, ids, roles, seen) + _unjudged_notes(t, cfg, seen)
    found, n = _root_events(t, cfg, ids, eps)
    return found, notes + n


def _step_order(s: Any) -> tuple:
    return (not isinstance(s, (int, float)), s)


def _persistent(ep: Episode, cfg: DoctorConfig) -> bool:
    """The doctor reports an episode that held in enough steps, and in most of its steps."""
    return ep.hits >= cfg.min_episode_steps and ep.hits >= cfg.persist * ep.judged


def _track(t: Tables, cfg: DoctorConfig, attempt: int, series: Iterable, roles: bool = True,
           history: bool = True, walls: "dict | None" = None) -> GroupTracker:
    """A tracker fed ``series`` (``(step, {rank: seconds})`` in step order), each step's wall time
    its share (``walls``: :func:`_walls` of ``attempt``, when the caller has them)."""
    tr = GroupTracker(cfg, keep=True, roles=roles, history=history)
    wall = (walls if walls is not None else _walls(t, attempt)).get
    update = tr.update
    for step, values in series:
        update(step, values, wall(step))
    return tr


def _walls(t: Tables, attempt: int) -> dict:
    """step -> the wall time of the step of ``attempt`` (seconds)."""
    return {step: (w[1] - w[0]) / 1e6 for (a, step), w in t.step_wall.items() if a == attempt}


def _in_step_order(steps: dict) -> list:
    if all(type(s) is int for s in steps):  # the same order, without a key per step
        return sorted(steps)
    return sorted(steps, key=_step_order)


def _durations(steps: dict) -> Iterator[tuple]:
    for step in _in_step_order(steps):
        cells = steps[step]
        if len(cells) == 1:
            for r, c in cells.items():
                yield step, {r: c[0] / 1e6}
        else:
            yield step, {r: c[0] / 1e6 for r, c in cells.items()}


def _column_durations(steps: list, ranks: list, seconds: list) -> Iterator[tuple]:
    """:func:`_durations` of one group's cells given as columns in step order
    (:attr:`~forge_obs.analysis.doctor.tables.Tables.columns`)."""
    if len(set(steps)) == len(steps):
        for step, rank, d in zip(steps, ranks, seconds):
            yield step, {rank: d}
        return
    for step, ks in groupby(range(len(steps)), key=steps.__getitem__):
        yield step, {ranks[k]: seconds[k] for k in ks}


def _episodes(t: Tables, cfg: DoctorConfig) -> tuple[list, list, dict]:
    """Every persistent episode ``(group, Episode)``, each group's roles, and per (attempt, mesh)
    the ranks and steps seen."""
    eps: list[tuple] = []
    roles: list = []
    seen: dict[tuple, tuple] = defaultdict(lambda: (set(), set()))
    walls: dict = {}
    for g in t.per_step:
        if g[0] not in walls:
            walls[g[0]] = _walls(t, g[0])
        cols = t.columns.get(g)  # the group's columns, when it has them: per_step's group not made
        if cols is not None:
            cols = [c.tolist() for c in cols]  # one group's at a time
        steps = t.per_step[g] if cols is None else None
        series = _durations(steps) if cols is None else _column_durations(*cols)
        tr = _track(t, cfg, g[0], series, roles=not cfg.wait_re.search(g[2]), walls=walls[g[0]])
        eps += [(g, ep) for ep in tr.finish() if _persistent(ep, cfg)]
        roles.append((g, tr.roles()))
        ranks, stepset = seen[(g[0], g[1])]
        if cols is None:
            stepset.update(steps)
            ranks.update(*steps.values())
        else:
            stepset.update(cols[0])
            ranks.update(cols[1])
    return eps, roles, seen


def _role_notes(t: Tables, cfg: DoctorConfig, ids: Identities, roles: list, seen: dict) -> list[str]:
    notes = []
    for (attempt, mesh, name), rs in roles:
        if len(seen[(attempt, mesh)][0]) < 2:
            continue  # a one-rank mesh: noted by _unjudged_notes
        for r, d in sorted(rs.items()):
            st = t.stream_of.get((attempt, mesh, r))
            w = stream_where(ids, st)["where"] if st else f"{mesh}/r{r}"
            notes.append(f"role: {w} alone does '{name}' ({d * 1e3:.2f} ms per step; its peers spend "
                         f"< {cfg.role_peer_max_s * 1e3:g} ms or have no such span): judged against its own "
                         "history, not as a straggler")
    return notes


def _unjudged_notes(t: Tables, cfg: DoctorConfig, seen: dict) -> list[str]:
    notes = []
    for (attempt, mesh), (ranks, steps) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        if mesh == "controller":
            continue
        if len(ranks) < 2:
            notes.append(f"straggler: {mesh} has 1 rank: no peers to compare; judged against its own history only")
        if len(steps) < cfg.fire_steps:
            notes.append(f"straggler/slowdown: {mesh} has {len(steps)} steps; at least {cfg.fire_steps} are needed "
                         "to judge")
        elif len(steps) < cfg.history_min_steps + cfg.fire_steps:
            notes.append(f"slowdown: {mesh} has {len(steps)} steps; at least {cfg.history_min_steps + cfg.fire_steps} "
                         "are needed to judge a rank against its own history")
    for (attempt, mesh), n in sorted(t.unstepped.items(), key=lambda kv: str(kv[0])):
        if (attempt, mesh) not in seen:
            notes.append(f"straggler/slowdown: the {n} spans of {mesh} carry no step (set_step is not called "
                         "there): not compared step by step")
    return notes


# ---------------------------------------------------------------- episodes -> root events


def _excess(ep: Episode) -> float:
    s = ep.summary()
    return (s["median_s"] or 0.0) - (s["reference_s"] or 0.0)


def _overlap(a: Episode, b: Episode, slack: int = 1) -> bool:
    try:
        return a.onset - slack <= (b.end if b.end is not None else b.onset) and b.onset - slack <= (
            a.end if a.end is not None else a.onset)
    except TypeError:
        return False


def _root_events(t: Tables, cfg: DoctorConfig, ids: Identities, eps: list) -> tuple[list[Finding], list[str]]:
    wait = {g: bool(cfg.wait_re.search(g[2])) for g, _ep in eps}
    strag = [(g, ep) for g, ep in eps if ep.kind == "straggler"]
    roots = _without_waiters(t, _rank_events([(g, ep) for g, ep in strag if not wait[g]]))
    orphans = _attach_waits(roots, [(g, ep) for g, ep in strag if wait[g]])
    out = [_straggler_finding(t, ids, r) for r in roots]
    inferred, notes = _late_arrivals(t, cfg, ids, orphans)
    out += inferred
    slow = [(g, ep) for g, ep in eps if ep.kind == "slowdown"]
    out += _slowdown_findings(t, ids, _unexplained_slowdowns(t, ids, out, slow, wait))
    return out, notes


def _rank_events(items: list) -> list[dict]:
    """Per rank, overlapping out-of-line spans are one event; its root span is the most specific
    one (the shortest) that explains at least half of the largest excess."""
    by_rank: dict[tuple, list] = defaultdict(list)
    for g, ep in items:
        by_rank[(g[0], g[1], ep.rank)].append((g, ep))
    roots = []
    for group in by_rank.values():
        group.sort(key=lambda x: x[1].onset)
        clusters: list[list] = []
        for it in group:
            c = next((c for c in clusters if any(_overlap(x[1], it[1]) for x in c)), None)
            if c is None:
                clusters.append([it])
            else:
                c.append(it)
        for c in clusters:
            top = max(_excess(ep) for _g, ep in c)
            root = min((x for x in c if _excess(x[1]) >= 0.5 * top), key=lambda x: x[1].summary()["median_s"] or 0.0)
            roots.append({"g": root[0], "ep": root[1], "also": [x for x in c if x is not root], "cons": []})
    return roots


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


def _without_waiters(t: Tables, roots: list) -> list[dict]:
    """A rank whose slow span ended while another rank waited: the waiting one is a consequence."""
    roots.sort(key=lambda r: (r["ep"].onset, -_excess(r["ep"])))
    final: list[dict] = []
    for r in roots:
        parent = next((p for p in final if p["g"][:2] == r["g"][:2] and p["ep"].rank != r["ep"].rank
                       and _overlap(p["ep"], r["ep"]) and _waits_for(t, p["g"], p["ep"], r["g"], r["ep"])), None)
        if parent is not None:
            parent["cons"].append(("waits", r["g"], r["ep"]))
        else:
            final.append(r)
    return final


def _attach_waits(roots: list, waits: list) -> dict:
    """Out-of-line waits go under the root of their mesh they overlap; the others (wait group ->
    episodes) are returned."""
    orphan: dict[tuple, list] = defaultdict(list)
    for g, ep in waits:
        parent = next((p for p in roots if p["g"][:2] == g[:2] and p["ep"].rank != ep.rank
                       and _overlap(p["ep"], ep)), None)
        if parent is not None:
            parent["cons"].append(("waits", g, ep))
        else:
            orphan[g].append(ep)
    return orphan


def arrivals(t: Tables, g: tuple) -> Iterator[tuple]:
    """``(step, {rank: seconds})`` in step order: each rank's time from the start of its step (its
    first ``set_step`` or span of the step, whichever is first) to its entry into the span of
    group ``g`` (a wait: what a rank the others wait for did before it got there)."""
    attempt, mesh, _name = g
    names = [k for k in t.per_step if k[0] == attempt and k[1] == mesh]
    steps = t.per_step[g]
    for step in _in_step_order(steps):
        out = {}
        for r, cell in steps[step].items():
            start = t.marks.get((attempt, mesh, step, r))
            for k in names:
                c = t.per_step[k].get(step, {}).get(r)
                if c is not None and (start is None or c[1] < start):
                    start = c[1]
            out[r] = (cell[1] - start) / 1e6
        yield step, out


def _late_arrivals(t: Tables, cfg: DoctorConfig, ids: Identities, orphans: dict) -> tuple[list[Finding], list[str]]:
    """Waits out of line with no root: when every rank of the mesh but one waits, and that one
    arrives at the wait out of line with its peers (the same test as a span's duration), it is the
    straggler and its slow work has no span."""
    out, notes = [], []
    for g, w_eps in orphans.items():
        ranks = {r for s in t.per_step[g].values() for r in s}
        rest = ranks - {ep.rank for ep in w_eps}
        if len(rest) != 1:
            continue
        rank = next(iter(rest))
        tr = _track(t, cfg, g[0], arrivals(t, g), roles=False, history=False)
        late = [ep for ep in tr.finish() if ep.kind == "straggler" and ep.rank == rank and _persistent(ep, cfg)
                and any(_overlap(ep, w) for w in w_eps)]
        if late:
            out.append(_inferred_finding(t, ids, g, rank, w_eps, max(late, key=lambda e: e.hits)))
            continue
        waiting = sorted({_who(t, ids, g[0], g[1], ep.rank)[0]["where"] for ep in w_eps})
        span = ", ".join(f"{ep.onset}..{ep.end}" for ep in sorted(w_eps, key=lambda e: e.onset)[:3])
        verb = "waits" if len(waiting) == 1 else "wait"
        notes.append(f"straggler: {', '.join(waiting)} {verb} in '{g[2]}' longer than its peers (steps {span}), but "
                     f"{_who(t, ids, g[0], g[1], rank)[0]['where']}, the rank waited for, reaches '{g[2]}' no later "
                     "than its peers usually do: no straggler")
    return out, notes


def _unexplained_slowdowns(t: Tables, ids: Identities, found: list, slow: list, wait: dict) -> list:
    """A rank's own slowdown within its straggler event is part of it; a slowdown that starts with
    a root event follows from it; the rest are returned (root events of their own)."""
    rest = []
    for g, ep in slow:
        f = next((f for f in found if f.details.get("attempt") == g[0] and f.mesh == g[1] and f.rank == ep.rank
                  and f.onset_step is not None and _overlap_steps(f, ep)), None)
        if f is not None:
            if g[2] == f.details.get("span"):
                f.details["history_ratio"] = ep.summary()["median_ratio"]
            continue
        if wait[g]:
            continue  # a wait that grew without a root we can see: not a finding
        f = next((f for f in found if f.details.get("attempt") == g[0] and f.onset_step is not None
                  and f.onset_step - 1 <= ep.onset <= f.steps[-1]), None)
        if f is not None:
            f.consequences.append(_slow_consequence(t, ids, g, ep))
        else:
            rest.append((g, ep))
    return rest


def _overlap_steps(f: Finding, ep: Episode) -> bool:
    lo, hi = (f.steps[0], f.steps[-1]) if f.steps else (f.onset_step, f.onset_step)
    return ep.onset - 1 <= hi and lo - 1 <= (ep.end if ep.end is not None else ep.onset)


# ---------------------------------------------------------------- findings


def cpu_ratio(t: Tables, g: tuple, ep: Episode, peers: bool) -> float | None:
    """The span's CPU time in the episode's out-of-line steps against its reference: its peers'
    that step (``peers``), else its own in the steps before the onset (``history_steps`` of
    them). None where the spans carry no CPU time. Near 1 while the wall time grew: the span
    waited, it did not compute more."""
    cells = t.cpu.get(g)
    if not cells:
        return None
    rank = ep.rank
    own = [c[rank][0] for s in ep.hit_steps if (c := cells.get(s)) is not None and rank in c]
    if peers:
        ref = [median(x[0] for r, x in c.items() if r != rank) for s in ep.hit_steps
               if (c := cells.get(s)) is not None and any(r != rank for r in c)]
    else:
        before = sorted((s for s in cells if isinstance(s, int) and s < ep.onset and rank in cells[s]))[-16:]
        ref = [cells[s][rank][0] for s in before]
    if not own or not ref or median(ref) <= 0:
        return None
    return round(median(own) / median(ref), 3)


def _who(t: Tables, ids: Identities, attempt: int, mesh: str, rank: Any) -> tuple:
    st = t.stream_of.get((attempt, mesh, rank))
    return (stream_where(ids, st) if st else ids.of(mesh, rank)), st


def _straggler_finding(t: Tables, ids: Identities, r: dict) -> Finding:
    g, ep = r["g"], r["ep"]
    attempt, mesh, name = g
    w, st = _who(t, ids, attempt, mesh, ep.rank)
    s = ep.summary()
    ratio, med, ref = s["median_ratio"] or 0.0, s["median_s"] or 0.0, s["reference_s"] or 0.0
    since = f"since step {ep.onset}" + (" (from the start)" if ep.onset == min(t.per_step[g]) else "")
    until = f", until step {ep.end}" if ep.cleared else ""
    msg = (f"{w['where']} is a straggler {since}{until}: '{name}' takes {ratio:.1f}x the median of its {mesh} "
           f"peers ({med * 1e3:.1f} ms vs {ref * 1e3:.1f} ms) in {ep.hits}/{ep.judged} steps")
    if r["also"]:
        msg += " (also slow: " + ", ".join(sorted({x[0][2] for x in r["also"]})) + ")"
    f = Finding("straggler", msg, steps=[ep.onset, ep.end], onset_step=ep.onset,
                details={"span": name, "median_ratio": ratio, "median_s": med, "reference_s": ref,
                         "slow_steps": ep.hits, "steps_compared": ep.judged,
                         "spans": [name] + sorted({x[0][2] for x in r["also"]}),
                         "excess_s": ep.excess_s(), "cpu_ratio": cpu_ratio(t, g, ep, peers=True),
                         **(stream_details(st) if st else {"attempt": attempt})})
    f.set_where(w)
    for _why, cg, cep in r["cons"]:
        f.consequences.append(_wait_consequence(t, ids, cg, cep))
    return f


def _wait_consequence(t: Tables, ids: Identities, g: tuple, ep: Episode) -> dict:
    w, _st = _who(t, ids, g[0], g[1], ep.rank)
    s = ep.summary()
    extra = (s["median_s"] or 0.0) - (s["reference_s"] or 0.0)
    return {"kind": "waits", **w, "steps": [ep.onset, ep.end], "span": g[2],
            "message": f"waits in '{g[2]}' (+{extra * 1e3:.1f} ms per step, {s['median_ratio'] or 0:.1f}x its peers)"}


def _slow_consequence(t: Tables, ids: Identities, g: tuple, ep: Episode) -> dict:
    w, _st = _who(t, ids, g[0], g[1], ep.rank)
    s = ep.summary()
    return {"kind": "slowdown", **w, "steps": [ep.onset, ep.end], "span": g[2],
            "message": f"'{g[2]}' {s['median_ratio'] or 0:.1f}x slower than its own earlier steps"}


def _inferred_finding(t: Tables, ids: Identities, g: tuple, rank: Any, w_eps: list, late: Episode) -> Finding:
    attempt, mesh, name = g
    w, st = _who(t, ids, attempt, mesh, rank)
    end = max([late.end] + [ep.end for ep in w_eps])
    ratio = median(ep.summary()["median_ratio"] or 0 for ep in w_eps)
    a = late.summary()
    msg = (f"{w['where']} is a straggler since step {late.onset}: its {mesh} peers wait for it in '{name}' "
           f"({ratio:.1f}x longer than it does), and it gets there {a['median_ratio']:.1f}x later into its step "
           f"than its peers ({a['median_s'] * 1e3:.1f} ms vs {a['reference_s'] * 1e3:.1f} ms); "
           "the slow work itself has no span")
    f = Finding("straggler", msg, steps=[late.onset, end], onset_step=late.onset,
                details={"span": name, "inferred_from_waits": True, "median_ratio": ratio,
                         "arrival_ratio": a["median_ratio"], "arrival_s": a["median_s"],
                         "arrival_reference_s": a["reference_s"],
                         **(stream_details(st) if st else {"attempt": attempt})})
    f.set_where(w)
    for ep in w_eps:
        f.consequences.append(_wait_consequence(t, ids, g, ep))
    return f


def _slowdown_findings(t: Tables, ids: Identities, eps: list) -> list[Finding]:
    """Slowdowns of the same span on every rank of a mesh at once are one event of the mesh;
    events that start together are one cluster whose root is the most specific event that is not
    the controller's (the others are listed under it)."""
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
            used.update(id(e) for e in same)
            events.append((g, same, len(ranks) >= 2 and {e.rank for e in same} >= ranks))
    events.sort(key=lambda e: min(x.onset for x in e[1]))
    clusters: list[list] = []
    for ev in events:
        on = min(x.onset for x in ev[1])
        c = next((c for c in clusters if c[0][0][0] == ev[0][0] and abs(min(x.onset for x in c[0][1]) - on) <= 1),
                 None)
        if c is None:
            clusters.append([ev])
        else:
            c.append(ev)
    return [_slowdown_cluster(t, ids, c) for c in clusters]


def _slowdown_cluster(t: Tables, ids: Identities, c: list) -> Finding:
    def key(ev: tuple) -> tuple:
        g, lst, _wide = ev
        return (g[1] == "controller", min(e.summary()["median_s"] or 0 for e in lst))

    top = max(_excess(e) for ev in c for e in ev[1])
    root = min([ev for ev in c if max(_excess(e) for e in ev[1]) >= 0.5 * top] or c, key=key)
    f = _slowdown_finding(t, ids, root)
    for ev in c:
        if ev is not root:
            f.consequences += [_slow_consequence(t, ids, ev[0], e) for e in ev[1]]
    return f


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
    else:
        w, _st = _who(t, ids, attempt, mesh, ep.rank)
    until = f", until step {end}" if all(e.cleared for e in lst) else ""
    msg = (f"{w['where']}: '{name}' slowed down since step {onset}{until}: {(s['median_s'] or 0) * 1e3:.1f} ms, "
           f"{s['median_ratio'] or 0:.1f}x its own earlier steps ({(s['reference_s'] or 0) * 1e3:.1f} ms) "
           f"in {ep.hits}/{ep.judged} steps")
    procs = [[*(stream_details(st)[k] for k in ("host", "pid")), e.rank, e.excess_s(), cpu_ratio(t, g, e, peers=False)]
             for e in lst if (st := t.stream_of.get((attempt, mesh, e.rank))) is not None]
    f = Finding("slowdown", msg, steps=[onset, end], onset_step=onset,
                details={"span": name, "median_ratio": s["median_ratio"], "median_s": s["median_s"],
                         "reference_s": s["reference_s"], "ranks": sorted(e.rank for e in lst), "attempt": attempt,
                         "excess_s": sum(e.excess_s() for e in lst), "processes": procs})
    return f.set_where(w)
