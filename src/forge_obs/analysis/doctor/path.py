"""Findings cite the critical path: over a finding's steps, how much of each controller step the
process (and span) it names spent on the step's critical path (:mod:`forge_obs.analysis.critical_path`).

A straggler that is on the path in every step costs the run its excess; one that never is (the
step waited on something else meanwhile) costs nothing yet. Each cited finding gets
``critical_path`` = ``{"steps_judged", "steps_on_path", "median_path_s", "median_share",
"worst_step", "worst_share", "bounded_by"}`` and a clause at the end of its message.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from forge_obs.analysis.doctor.finding import Finding
from forge_obs.analysis.doctor.subjects import replica_family

__all__ = ["CITED_KINDS", "cite_paths"]

#: the findings about time that the path can confirm or put in proportion
CITED_KINDS = ("straggler", "slowdown", "hang", "sync_bottleneck", "stall")
#: the most steps of one finding walked (evenly spread over its steps)
MAX_STEPS = 64


def _matches(seg: dict, f: Finding, span: str | None) -> bool:
    same_family = f.kind == "sync_bottleneck" and replica_family(seg["mesh"]) == replica_family(f.mesh or "")
    if f.mesh is not None and seg["mesh"] != f.mesh and not same_family:
        return False
    if f.rank is not None and f.kind != "sync_bottleneck" and seg["rank"] != f.rank:
        return False
    return span is None or seg["name"] == span


def cite_paths(run_dir: "str | Path", findings: list, wait_spans: str) -> None:
    """Adds ``critical_path`` (and a clause in the message) to each finding of :data:`CITED_KINDS`
    that names steps the controller ran."""
    todo = [f for f in findings if f.kind in CITED_KINDS and f.steps]
    if not todo:
        return
    steps = _Paths(run_dir, wait_spans)
    if not steps.windows:
        return
    by_step = steps.windows
    for f in todo:
        lo, hi = f.steps[0], f.steps[-1]
        if f.kind in ("hang", "stall"):
            hi = max(by_step)  # the step it left unfinished
        chosen = [s for s in sorted(by_step) if lo <= s <= hi]
        if not chosen:
            continue
        if len(chosen) > MAX_STEPS:
            chosen = [chosen[round(i * (len(chosen) - 1) / (MAX_STEPS - 1))] for i in range(MAX_STEPS)]
        span = (f.details or {}).get("span")
        paths = steps.paths(chosen)
        rows = []
        for s in chosen:
            start, end = by_step[s]
            on = sum(seg["end_us"] - seg["start_us"] for seg in paths[s] if _matches(seg, f, span)) / 1e6
            rows.append((s, on, on / ((end - start) / 1e6) if end > start else 0.0))
        _cite(f, rows, paths, span)


class _Paths:
    """The controller steps (step -> (start, end)) and their critical paths (as the segments of
    the index's ``path`` table): read from the run's index when its stored paths were walked
    with ``wait_spans`` (the default), else walked here."""

    def __init__(self, run_dir: "str | Path", wait_spans: str) -> None:
        from forge_obs.analysis.critical_path.walk import PathConfig
        from forge_obs.analysis.index import available

        self.idx = self.walker = None
        if available() and wait_spans == PathConfig().wait_spans:
            from forge_obs.analysis.index import open_index

            self.idx = open_index(run_dir, update=False)
            self.con = self.idx.connect()
            rows = self.con.execute("SELECT step, start_us, end_us FROM _steps").fetchall()
            self.windows = {n: (a, b) for n, a, b in rows}
            return
        from forge_obs.analysis.critical_path.graph import load
        from forge_obs.analysis.critical_path.walk import Walker

        g = load(run_dir)
        self.walker = Walker(g, PathConfig(wait_spans=wait_spans))
        self.by_window = {w.step: w for w in g.windows}
        self.windows = {w.step: (w.start, w.end) for w in g.windows}

    def paths(self, steps: list) -> dict:
        """step -> its path's segments (dicts with ``mesh``, ``rank``, ``name``, ``start_us``, ``end_us``)."""
        if self.idx is not None:
            out: dict = {s: [] for s in steps}
            for r in self.idx.step_rows("path", min(steps), max(steps), self.con, steps=steps):
                out[r["step"]].append(r)
            return out
        return {s: [{"mesh": seg.span.stream.mesh, "rank": seg.span.stream.rank, "name": seg.span.name,
                     "start_us": seg.start, "end_us": seg.end} for seg in self.walker.path(self.by_window[s])]
                for s in steps}


def _cite(f: Finding, rows: list, paths: dict, span: str | None) -> None:
    on = [r for r in rows if r[1] > 0]
    worst = max(rows, key=lambda r: r[2])
    what = f"'{span}' of {f.where or f.mesh}" if span else (f.where or f.mesh or "it")
    cite = {"steps_judged": len(rows), "steps_on_path": len(on),
            "median_path_s": statistics.median(r[1] for r in rows), "median_share": statistics.median(r[2] for r in rows),
            "worst_step": worst[0], "worst_share": worst[2], "bounded_by": None}
    if on:
        f.message += (f"; on the critical path in {len(on)}/{len(rows)} of its steps (median "
                      f"{cite['median_path_s']:.3f} s, {100 * cite['median_share']:.0f} % of the step; step {worst[0]}: "
                      f"{100 * worst[2]:.0f} %)")
    else:
        seg = max(paths[worst[0]], key=lambda sg: sg["end_us"] - sg["start_us"])
        cite["bounded_by"] = {"mesh": seg["mesh"], "rank": seg["rank"], "name": seg["name"]}
        f.message += (f"; {what} is not on the critical path of its steps (step {worst[0]} waited longest on "
                      f"{seg['mesh']} '{seg['name']}' rank {seg['rank']})")
    f.critical_path = cite
