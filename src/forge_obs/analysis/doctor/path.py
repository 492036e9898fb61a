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


def _matches(seg, f: Finding, span: str | None) -> bool:
    st = seg.span.stream
    same_family = f.kind == "sync_bottleneck" and replica_family(st.mesh) == replica_family(f.mesh or "")
    if f.mesh is not None and st.mesh != f.mesh and not same_family:
        return False
    if f.rank is not None and f.kind != "sync_bottleneck" and st.rank != f.rank:
        return False
    return span is None or seg.span.name == span


def cite_paths(run_dir: "str | Path", findings: list, wait_spans: str) -> None:
    """Adds ``critical_path`` (and a clause in the message) to each finding of :data:`CITED_KINDS`
    that names steps the controller ran."""
    todo = [f for f in findings if f.kind in CITED_KINDS and f.steps]
    if not todo:
        return
    from forge_obs.analysis.critical_path.graph import load
    from forge_obs.analysis.critical_path.walk import PathConfig, Walker

    g = load(run_dir)
    if not g.windows:
        return
    walker = Walker(g, PathConfig(wait_spans=wait_spans))
    by_step = {w.step: w for w in g.windows}
    paths: dict[int, list] = {}
    for f in todo:
        lo, hi = f.steps[0], f.steps[-1]
        if f.kind in ("hang", "stall"):
            hi = max(by_step)  # the step it left unfinished
        steps = [s for s in sorted(by_step) if lo <= s <= hi]
        if not steps:
            continue
        if len(steps) > MAX_STEPS:
            steps = [steps[round(i * (len(steps) - 1) / (MAX_STEPS - 1))] for i in range(MAX_STEPS)]
        span = (f.details or {}).get("span")
        rows = []
        for s in steps:
            if s not in paths:
                paths[s] = walker.path(by_step[s])
            w = by_step[s]
            on = sum(seg.end - seg.start for seg in paths[s] if _matches(seg, f, span)) / 1e6
            rows.append((s, on, on / ((w.end - w.start) / 1e6) if w.end > w.start else 0.0))
        _cite(f, rows, paths, span)


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
        seg = max(paths[worst[0]], key=lambda sg: sg.end - sg.start)
        sp = seg.span
        cite["bounded_by"] = {"mesh": sp.stream.mesh, "rank": sp.stream.rank, "name": sp.name}
        f.message += (f"; {what} is not on the critical path of its steps (step {worst[0]} waited longest on "
                      f"{sp.stream.mesh} '{sp.name}' rank {sp.stream.rank})")
    f.critical_path = cite
