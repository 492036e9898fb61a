"""``forge-obs doctor``: automatic findings over a run directory.

Each finding names the mesh / actor / rank and the steps:

- ``straggler``: a rank whose span durations are persistently out of line with its peers in the
  same mesh (per step and span name: robust z-score against the median and MAD of the ranks,
  > 3.5 and > 1.25x the median, in >= 60% of >= 3 comparable steps; needs >= 3 ranks).
- ``hang``: a span still open at the end of the data for far longer than that span's history
  (> ``hang_factor`` x the longest finished one of the mesh, and > ``stall_min_s``).
- ``stall``: a process that was active and went silent: no record for > max(``stall_min_s``,
  ``silence_factor`` x its mean gap between records) before the end of the data, without having
  closed its file cleanly.
- ``nonfinite``: NaN / inf metric values (per key: sources and steps).
- ``missing_ranks``: steps where ranks did not report (``missing`` in metrics.jsonl), and ranks of
  a mesh that wrote no timeline although selected.
- ``staleness``: a metric whose name contains ``staleness`` grows over the run (Theil-Sen slope
  > 0 and the last third's mean exceeds the first third's by > 1).
- ``sync_bottleneck``: a weight-sync / checkpoint / collective phase (span name matching
  ``sync_spans``, by default ``weight|sync|ckpt|checkpoint|reload|barrier``) that covers
  >= ``sync_share`` (default 50 %) of a process's active time over >= ``min_steps`` calls: the
  run is held back by moving state, not by computing. A phase that is slow on *every* rank has no
  outlier to find, so this is judged against the process's own time budget; the message adds
  how long the controller spent waiting (spans named ``*wait*``).
- ``dropped``: timeline records lost to buffer overflow.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from forge_obs.timeline import reader
from forge_obs.timeline.reader import END, INSTANT, OPEN, SPAN, STEP, TAG
from forge_obs.timeline.schema import rank_selected


@dataclass
class Finding:
    kind: str
    message: str
    mesh: str | None = None
    actor: str | None = None
    rank: int | None = None
    steps: list = field(default_factory=list)  # [first, last] or the list of steps
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: span names that move state rather than compute (``sync_bottleneck``)
DEFAULT_SYNC_SPANS = r"weight|sync|ckpt|checkpoint|reload|barrier"


def _steps_range(steps: list) -> list:
    s = sorted(x for x in steps if x is not None)
    return [s[0], s[-1]] if s else []


def diagnose(
    run_dir: "str | Path",
    stall_min_s: float = 0.5,
    hang_factor: float = 10.0,
    silence_factor: float = 20.0,
    z_threshold: float = 3.5,
    min_ratio: float = 1.25,
    persist: float = 0.6,
    min_steps: int = 3,
    sync_spans: str = DEFAULT_SYNC_SPANS,
    sync_share: float = 0.5,
) -> list[Finding]:
    """Every finding over ``run_dir`` (timeline under ``events/``, metrics in ``metrics.jsonl``)."""
    run_dir = Path(run_dir)
    findings: list[Finding] = []
    if (run_dir / "events").is_dir():
        findings += _timeline_findings(run_dir, stall_min_s, hang_factor, silence_factor, z_threshold,
                                       min_ratio, persist, min_steps, re.compile(sync_spans), sync_share)
    if (run_dir / "metrics.jsonl").exists():
        findings += _metric_findings(run_dir)
    return findings


def _timeline_findings(run_dir: Path, stall_min_s: float, hang_factor: float, silence_factor: float,
                       z_thr: float, min_ratio: float, persist: float, min_steps: int,
                       sync_re: "re.Pattern[str]", sync_share: float) -> list[Finding]:
    out: list[Finding] = []
    run = reader.scan(run_dir)
    # time budget: (stream key, span name) -> [(start, end)] of sync-like spans, and of the
    # controller's wait-like ones
    budget: dict[tuple, list] = defaultdict(list)
    budget_steps: dict[tuple, list] = defaultdict(list)
    is_sync: dict[str, bool] = {}
    # (attempt, mesh, name) -> step -> rank -> summed duration (µs)
    per_step: dict[tuple, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    longest: dict[tuple, int] = defaultdict(int)  # (attempt, mesh, name) -> longest finished span
    opens: list = []
    last_step: dict[tuple, Any] = {}
    for it in reader.walk(run):
        k = it[0]
        if k is SPAN:
            _k, st, lane, name, step, ts, dur, ex = it
            g = (st.attempt, st.mesh, name)
            if dur > longest[g]:
                longest[g] = dur
            if step is not None:
                per_step[g][step][st.key] += dur
                last_step[st.key] = step
            b = is_sync.get(name)
            if b is None:
                b = is_sync[name] = bool(sync_re.search(name))
            if b or ("wait" in name and st.header.get("ctl")):
                budget[(st.key, name)].append((ts, ts + dur))
                budget_steps[(st.key, name)].append(step)
        elif k is OPEN:
            opens.append(it)
        elif k is STEP:
            last_step[it[1].key] = it[3]
    streams = run.streams
    end_by_attempt: dict[int, int] = {}
    for st in streams.values():
        if st.last_ts is not None:
            end_by_attempt[st.attempt] = max(end_by_attempt.get(st.attempt, st.last_ts), st.last_ts)

    # ---- stragglers
    slow: dict[tuple, dict] = defaultdict(lambda: {"slow": [], "total": 0, "ratios": [], "names": set()})
    for (attempt, mesh, name), steps in per_step.items():
        for step, by_rank in steps.items():
            if len(by_rank) < 3:
                continue
            vals = list(by_rank.values())
            med = median(vals)
            mad = median(abs(v - med) for v in vals)
            scale = max(1.4826 * mad, 0.05 * med, 1.0)
            for key, d in by_rank.items():
                s = slow[(attempt, mesh, name, key)]
                s["total"] += 1
                if (d - med) / scale > z_thr and d > min_ratio * med:
                    s["slow"].append(step)
                    s["ratios"].append(d / med if med else float("inf"))
    per_rank: dict[tuple, list] = defaultdict(list)
    for (attempt, mesh, name, key), s in slow.items():
        if s["total"] >= min_steps and len(s["slow"]) >= persist * s["total"]:
            per_rank[key].append((median(s["ratios"]), name, s))
    for key, hits in per_rank.items():
        st = streams[key]
        hits.sort(key=lambda h: -h[0])
        ratio, name, s = hits[0]
        steps = sorted({x for h in hits for x in h[2]["slow"]})
        out.append(Finding(
            "straggler",
            f"{st.label} is a straggler: '{name}' takes {ratio:.1f}x the median of its {st.mesh} peers "
            f"in {len(s['slow'])}/{s['total']} steps"
            + (f" (also: {', '.join(h[1] for h in hits[1:4])})" if len(hits) > 1 else ""),
            st.mesh, st.actor or None, st.rank, _steps_range(steps),
            {"span": name, "median_ratio": round(ratio, 3), "slow_steps": len(s["slow"]), "steps_compared": s["total"],
             "spans": [h[1] for h in hits], "host": st.host, "pid": st.pid, "attempt": st.attempt},
        ))

    # ---- hangs: spans open far longer than their history
    hung_streams = set()
    for _k, st, lane, name, step, ts, ex in opens:
        end = end_by_attempt.get(st.attempt, ts)
        open_us = end - ts
        hist = longest.get((st.attempt, st.mesh, name), 0)
        limit = max(stall_min_s * 1e6, hang_factor * hist) if hist else max(stall_min_s * 1e6, 60e6)
        if open_us > limit:
            hung_streams.add(st.key)
            out.append(Finding(
                "hang",
                f"{st.label}: span '{name}' (step {step}) is still open after {open_us / 1e6:.2f}s at the end of "
                f"the data; the longest finished '{name}' in {st.mesh} took {hist / 1e6:.3f}s"
                f" (on {st.lanes.get(lane, 'track ' + str(lane))})",
                st.mesh, st.actor or None, st.rank, [step] if step is not None else [],
                {"span": name, "open_s": open_us / 1e6, "longest_finished_s": hist / 1e6, "task": st.lanes.get(lane),
                 "host": st.host, "pid": st.pid, "attempt": st.attempt},
            ))

    # ---- stalls: active, then silent (and not closed cleanly)
    for st in streams.values():
        if st.clean or st.last_ts is None or st.first_ts is None or st.records < 3 or st.key in hung_streams:
            continue
        end = end_by_attempt.get(st.attempt, st.last_ts)
        gap = (st.last_ts - st.first_ts) / max(st.records - 1, 1)
        silent = end - st.last_ts
        if silent > max(stall_min_s * 1e6, silence_factor * gap):
            ls = last_step.get(st.key)
            out.append(Finding(
                "stall",
                f"{st.label} went silent {silent / 1e6:.2f}s before the end of the data (last step {ls}) "
                f"and did not close its timeline: dead or stuck",
                st.mesh, st.actor or None, st.rank, [ls] if ls is not None else [],
                {"silent_s": silent / 1e6, "mean_gap_s": gap / 1e6, "host": st.host, "pid": st.pid, "attempt": st.attempt},
            ))

    out += _sync_findings(streams, budget, budget_steps, sync_re, sync_share, min_steps)

    # ---- dropped records
    for st in streams.values():
        if st.dropped:
            out.append(Finding("dropped", f"{st.label}: {st.dropped} timeline records were dropped (buffer overflow)",
                               st.mesh, st.actor or None, st.rank, [], {"dropped": st.dropped}))

    # ---- ranks selected but absent from the timeline
    present: dict[tuple, set] = defaultdict(set)
    meta: dict[tuple, dict] = {}
    for st in streams.values():
        if st.header.get("ctl"):
            continue
        g = (st.attempt, st.mesh)
        present[g].add(st.rank)
        m = meta.setdefault(g, {"ws": 0, "ranks": st.header.get("ranks", "all")})
        m["ws"] = max(m["ws"], int(st.header.get("ws") or 0), st.rank + 1)
    for g, ranks in present.items():
        spec = meta[g]["ranks"]
        try:
            expected = {r for r in range(meta[g]["ws"]) if rank_selected(None if spec in ("None", "all") else spec, r)}
        except ValueError:
            expected = set(range(meta[g]["ws"]))
        miss = sorted(expected - ranks)
        if miss:
            out.append(Finding("missing_ranks", f"mesh {g[1]}: ranks {miss} wrote no timeline", g[1], None, None, [],
                               {"ranks": miss, "attempt": g[0]}))
    return out


def _covered_us(intervals: list) -> int:
    """Length of the union of ``[(start, end)]`` (concurrent spans count once)."""
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


def _sync_findings(streams: dict, budget: dict, budget_steps: dict, sync_re: "re.Pattern[str]",
                   sync_share: float, min_calls: int) -> list[Finding]:
    """``sync_bottleneck``: state-moving phases that take most of a process's active time."""
    def share(key: tuple, name: str) -> float:
        st = streams[key]
        window = (st.last_ts or 0) - (st.first_ts or 0)
        return _covered_us(budget[(key, name)]) / window if window > 0 else 0.0

    waits = [(share(key, name), name) for (key, name) in budget
             if "wait" in name and streams[key].header.get("ctl")]
    wait_note = ""
    if waits:
        w, wname = max(waits)
        if w >= 0.25:
            wait_note = f"; meanwhile the controller spent {w:.0%} of its time in '{wname}'"
    out = []
    for (key, name), spans in budget.items():
        if not sync_re.search(name) or len(spans) < min_calls:
            continue
        frac = share(key, name)
        if frac < sync_share:
            continue
        st = streams[key]
        med_s = median(b - a for a, b in spans) / 1e6
        out.append(Finding(
            "sync_bottleneck",
            f"{st.label}: '{name}' takes {frac:.0%} of its time ({len(spans)} calls, median {med_s:.3f}s): "
            f"moving state, not computing, holds this process back{wait_note}",
            st.mesh, st.actor or None, st.rank, _steps_range(budget_steps[(key, name)]),
            {"span": name, "share": round(frac, 4), "calls": len(spans), "median_s": med_s,
             "host": st.host, "pid": st.pid, "attempt": st.attempt},
        ))
    return out


def _metric_findings(run_dir: Path) -> list[Finding]:
    from forge_obs.store import read_jsonl

    out: list[Finding] = []
    bad: dict[str, dict] = defaultdict(lambda: defaultdict(list))  # key -> source -> steps
    srcinfo: dict[str, dict] = {}
    missing: dict[str, list] = defaultdict(list)
    stale: dict[str, list] = defaultdict(list)
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        step = row.get("step")
        src = row.get("source") or {}
        label = src.get("label", "global") if src else "global"
        srcinfo[label] = src
        for key, v in (row.get("metrics") or {}).items():
            if isinstance(v, float) and not math.isfinite(v):
                bad[key][label].append(step)
            if "staleness" in key and label == "global" and isinstance(v, (int, float)) and math.isfinite(v):
                stale[key].append((step, float(v)))
        for item in row.get("values") or ():
            if isinstance(item, (list, tuple)) and len(item) > 1 and isinstance(item[1], float) and not math.isfinite(item[1]):
                bad[item[0]][label].append(step)
        for m in row.get("missing") or ():
            missing[str(m)].append(step)
    for key, by_src in bad.items():
        for label, steps in by_src.items():
            s = srcinfo.get(label) or {}
            out.append(Finding(
                "nonfinite",
                f"metric '{key}' is NaN/inf on {label} in {len(steps)} step(s), first at step {min(x for x in steps if x is not None) if any(x is not None for x in steps) else '?'}",
                s.get("mesh"), s.get("actor"), s.get("rank"), _steps_range(steps), {"key": key, "source": label, "count": len(steps)},
            ))
    for label, steps in missing.items():
        mesh, _, rest = label.partition("/")
        rank = None
        tail = label.rsplit("/r", 1)
        if len(tail) == 2 and tail[1].isdigit():
            rank = int(tail[1])
        out.append(Finding("missing_ranks", f"{label} did not report in {len(steps)} step(s)", mesh or None, None, rank,
                           _steps_range(steps), {"label": label, "count": len(steps)}))
    for key, series in stale.items():
        series.sort()
        vals = [v for _s, v in series]
        n = len(vals)
        if n < 6:
            continue
        third = max(n // 3, 1)
        first, last = sum(vals[:third]) / third, sum(vals[-third:]) / third
        slope = _theil_sen([s for s, _v in series], vals)
        if slope > 0 and last - first > 1.0:
            out.append(Finding(
                "staleness",
                f"'{key}' grows over the run: {first:.2f} -> {last:.2f} (slope {slope:.3f}/step): generators fall behind the trainer",
                None, None, None, [series[0][0], series[-1][0]], {"key": key, "first_third_mean": first, "last_third_mean": last, "slope": slope},
            ))
    return out


def _theil_sen(x: list, y: list) -> float:
    n = len(x)
    step = max(1, n // 60)  # subsample long series: O((n/step)^2)
    idx = list(range(0, n, step))
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for a, i in enumerate(idx) for j in idx[a + 1:] if x[j] != x[i]]
    return median(slopes) if slopes else 0.0


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "doctor: no findings"
    lines = [f"doctor: {len(findings)} finding(s)"]
    for f in findings:
        where = "/".join(x for x in (f.mesh, f.actor, None if f.rank is None else f"r{f.rank}") if x)
        steps = ""
        if f.steps:
            steps = f" steps {f.steps[0]}..{f.steps[-1]}" if len(f.steps) > 1 else f" step {f.steps[0]}"
        lines.append(f"  [{f.kind}] {where or '-'}{steps}: {f.message}")
    return "\n".join(lines)
