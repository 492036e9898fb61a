"""The doctor's rules over the timeline (``events/*.jsonl``): one pass over the records builds the
per-step tables (:mod:`.tables`), then one function per rule: stragglers and slowdowns
(:mod:`.stragglers`), hangs, stalls, sync bottlenecks, dropped records, ranks without a timeline.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> from forge_obs.analysis.doctor.timeline_rules import timeline_findings
    >>> findings, notes = timeline_findings("runs/does-not-exist", DoctorConfig(), Identities())
    >>> findings, notes
    ([], [])
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import covered
from forge_obs.analysis.doctor.finding import Finding
from forge_obs.analysis.doctor.stragglers import straggler_findings
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.doctor.tables import Tables, peer_group, scan, stream_details, stream_where
from forge_obs.recording.timeline.schema import DEFAULT_OPTIONS, rank_selected

__all__ = [
    "Progress",
    "writer_lag_s",
    "hang_findings",
    "stall_findings",
    "sync_findings",
    "dropped_findings",
    "absent_rank_findings",
    "timeline_findings",
]


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
        w = stream_where(ids, st)
        at = f"step {step}" if step is not None else "no step"
        msg = (f"{w['where']}: span '{name}' ({at}) is still open after {open_us / 1e6:.2f}s at the end of "
               f"the data; the longest finished '{name}' in {peer_group(st)} took {hist / 1e6:.3f}s"
               f" (on {st.lanes.get(lane, 'track ' + str(lane))})")
        f = Finding("hang", msg, steps=[step] if step is not None else [], onset_step=step,
                    details={"span": name, "open_s": open_us / 1e6, "longest_finished_s": hist / 1e6,
                             "task": st.lanes.get(lane), **stream_details(st)})
        f.set_where(w)
        for ts2, _st, lane2, name2, step2, open2, _h in items[1:]:
            f.consequences.append({"kind": "hang", **w, "steps": [step2] if step2 is not None else [], "span": name2,
                                   "message": f"'{name2}' also still open ({open2 / 1e6:.2f}s, "
                                              f"on {st.lanes.get(lane2, 'track ' + str(lane2))})"})
        out.append(f)
    return out


class Progress:
    """How far the run went on after a moment: the steps it began since, and whether every process
    that recorded since closed its file (the run ended; its data is complete). ``lag_s``: how
    stale a process's data can be while it is still being written (:func:`writer_lag_s`)."""

    def __init__(self, t: Tables, lag_s: float) -> None:
        self.lag_us = lag_s * 1e6
        starts: dict[int, list] = defaultdict(list)
        for (attempt, _step), (first, _last) in t.step_wall.items():
            starts[attempt].append(first)
        self.starts = {a: sorted(v) for a, v in starts.items()}
        self.by_end: dict[int, list] = defaultdict(list)  # attempt -> [(last record, clean)], ascending
        for st in t.run.streams.values():
            if st.last_ts is not None:
                self.by_end[st.attempt].append((st.last_ts, st.clean))
        self.clean_after: dict[int, list] = {}  # attempt -> [every stream from i on closed its file]
        for attempt, ends in self.by_end.items():
            ends.sort()
            flags, ok = [True] * (len(ends) + 1), True
            for i in range(len(ends) - 1, -1, -1):
                ok = ok and ends[i][1]
                flags[i] = ok
            self.clean_after[attempt] = flags

    def steps_since(self, attempt: int, ts: int) -> int:
        s = self.starts.get(attempt, [])
        return len(s) - bisect_right(s, ts)

    def ended_since(self, attempt: int, ts: int) -> bool:
        """Every process that recorded after ``ts`` closed its file."""
        ends = self.by_end.get(attempt, [])
        return self.clean_after.get(attempt, [True])[bisect_right(ends, (ts, True))]


def stall_findings(t: Tables, cfg: DoctorConfig, ids: Identities, hung: set,
                   progress: Progress) -> tuple[list[Finding], list[str]]:
    """A process that was active (>= 3 records) and went silent before the end of the data
    without closing its file, for more than max(``stall_min_s``, ``silence_factor`` x its mean gap
    between records). While the run is still being written (a process that recorded since has not
    closed its file), only after the run began ``stall_steps`` steps since and more than the
    writers' lag (``progress.lag_us``) went by, and never inside a span still open (busy; a
    hang when too long): the start-up, a long step and the writers' lag are not stalls."""
    busy = {it[1].key for it in t.opens}
    out, waiting = [], []
    for st in t.run.streams.values():
        if st.clean or st.last_ts is None or st.first_ts is None or st.records < 3 or st.key in hung:
            continue
        gap = (st.last_ts - st.first_ts) / max(st.records - 1, 1)
        silent = t.end_by_attempt.get(st.attempt, st.last_ts) - st.last_ts
        if silent <= max(cfg.stall_min_s * 1e6, cfg.silence_factor * gap):
            continue
        if not progress.ended_since(st.attempt, st.last_ts):
            if silent <= progress.lag_us:
                continue
            n = progress.steps_since(st.attempt, st.last_ts)
            if st.key in busy or n < cfg.stall_steps:
                why = "in an open span" if st.key in busy else f"{n} step(s) begun since"
                waiting.append(f"{stream_where(ids, st)['where']} silent {silent / 1e6:.1f}s, {why}")
                continue
        out.append(_stall(t, ids, st, silent, gap))
    notes = []
    if waiting:
        notes.append("stall: not judged yet (the run is still being written): " + "; ".join(sorted(waiting)[:4])
                     + (f"; and {len(waiting) - 4} more" if len(waiting) > 4 else "")
                     + f" (judged once the run began {cfg.stall_steps} steps since, outside an open span)")
    return out, notes


def _stall(t: Tables, ids: Identities, st: Any, silent: float, gap: float) -> Finding:
    ls = t.last_step.get(st.key)
    w = stream_where(ids, st)
    last = f"last step {ls}" if ls is not None else "its records carry no step"
    f = Finding("stall", f"{w['where']} went silent {silent / 1e6:.2f}s before the end of the data ({last}) "
                         "and did not close its timeline: dead or stuck",
                steps=[ls] if ls is not None else [], onset_step=ls,
                details={"silent_s": silent / 1e6, "mean_gap_s": gap / 1e6, **stream_details(st)})
    return f.set_where(w)


def writer_lag_s(run_dir: Path) -> float:
    """How stale the data of a process that is still writing can be: four passes of its timeline
    writer (``flush_interval_s`` from the run's ``meta.json``, else the default; a busy host
    delays a pass), plus ``open_after_s`` (a span open that long is written as open)."""
    opts = {}
    try:
        cfg = json.loads((run_dir / "meta.json").read_text()).get("config")
        got = cfg.get("timeline") if isinstance(cfg, dict) else None
        opts = got if isinstance(got, dict) else {}
    except (OSError, ValueError, AttributeError):
        pass
    vals = []
    for k in ("flush_interval_s", "open_after_s"):
        v = opts.get(k, DEFAULT_OPTIONS[k])
        vals.append(float(v) if isinstance(v, (int, float)) and v >= 0 else DEFAULT_OPTIONS[k])
    return 4 * vals[0] + vals[1]


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
        w = stream_where(ids, st)
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
                             **stream_details(st)})
        f.set_where(w)
        for frac2, key2, _n, spans2 in hs[1:]:
            w2 = stream_where(ids, streams[key2])
            f.consequences.append({"kind": "sync_bottleneck", **w2, "steps": [], "span": name,
                                   "message": f"'{name}' also takes {frac2:.0%} of its time ({len(spans2)} calls)"})
        out.append(f)
    return out, notes


def dropped_findings(t: Tables, ids: Identities) -> list[Finding]:
    out = []
    for st in t.run.streams.values():
        if st.dropped:
            w = stream_where(ids, st)
            out.append(Finding("dropped", f"{w['where']}: {st.dropped} timeline records were dropped (buffer overflow)",
                               details={"dropped": st.dropped, **stream_details(st)}).set_where(w))
    return out


def absent_rank_findings(t: Tables, cfg: DoctorConfig, ids: Identities, progress: Progress) -> list[Finding]:
    """Ranks of a mesh that were selected but wrote no timeline, once the run ended or began
    ``stall_steps`` steps (a rank still starting is not absent)."""
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
        if not progress.ended_since(g[0], -1) and progress.steps_since(g[0], -1) < cfg.stall_steps:
            continue
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
    progress = Progress(t, writer_lag_s(run_dir))
    s, n = stall_findings(t, cfg, ids, {k for k in t.run.streams if (k[0], k[1]) in hung}, progress)
    out += s
    notes += n
    s, n = sync_findings(t, cfg, ids)
    out += s
    notes += n
    out += dropped_findings(t, ids)
    out += absent_rank_findings(t, cfg, ids, progress)
    return out, notes
