"""One finding per root event: symptoms of the same process, and drops that start with another
event, are listed under the root instead of standing alone.

    >>> from forge_obs.analysis.doctor.finding import Finding
    >>> from forge_obs.analysis.doctor.roots import merge_root_events
    >>> dead = Finding("stall", "went silent", mesh="gen", rank=0, where="gen/G/r0", onset_step=6, steps=[6])
    >>> miss = Finding("missing_ranks", "did not report", mesh="gen", rank=0, where="gen/G/r0", onset_step=6,
    ...                steps=[6, 29])
    >>> [(f.kind, [c["kind"] for c in f.consequences]) for f in merge_root_events([miss, dead])]
    [('stall', ['missing_ranks'])]
"""

from __future__ import annotations

from forge_obs.analysis.doctor.finding import Finding

__all__ = ["KIND_ORDER", "merge_root_events"]

#: the order findings are printed in (most severe first)
KIND_ORDER = ["hang", "stall", "missing_ranks", "quiet_rank", "nonfinite", "straggler", "slowdown", "sync_bottleneck",
              "host_contention", "staleness", "throughput_drop", "dropped", "threshold"]
#: a process lost: what the other symptoms of the same process follow from
_LOSS = ("hang", "stall")
_SYMPTOMS = ("missing_ranks", "quiet_rank")
#: root events a throughput drop starting with them is a consequence of
_CAUSES = ("hang", "stall", "missing_ranks", "quiet_rank", "nonfinite", "straggler", "slowdown", "sync_bottleneck",
           "host_contention")


def _ranks(f: Finding) -> set:
    if f.rank is not None:
        return {f.rank}
    return set(f.details.get("ranks") or ())


def _as_consequence(f: Finding) -> dict:
    return {"kind": f.kind, "mesh": f.mesh, "actor": f.actor, "rank": f.rank, "replica": f.replica,
            "where": f.where, "steps": list(f.steps), "message": f.message}


def _same_process(a: Finding, b: Finding) -> bool:
    return a.mesh == b.mesh and bool(_ranks(a) & _ranks(b) or (not _ranks(a) and not _ranks(b)))


def _add(cause: Finding, c: dict) -> None:
    """``c`` under ``cause``, in place of the row of the same event already there (the live
    rule's row of a drop, written when it began)."""
    same = [i for i, x in enumerate(cause.consequences) if x.get("kind") == c["kind"] and x.get("where") == c["where"]
            and (x.get("steps") or [None])[0] == (c["steps"] or [None])[0]]
    if same:
        cause.consequences[same[0]] = c
    else:
        cause.consequences.append(c)


def merge_root_events(findings: list[Finding]) -> list[Finding]:
    out: list[Finding] = []
    absorbed: set = set()
    by_kind = sorted(findings, key=lambda f: KIND_ORDER.index(f.kind) if f.kind in KIND_ORDER else len(KIND_ORDER))
    for i, f in enumerate(by_kind):
        if id(f) in absorbed:
            continue
        for g in by_kind[i + 1:]:
            if id(g) in absorbed or g is f:
                continue
            if f.kind in _LOSS and g.kind in _SYMPTOMS + _LOSS and _same_process(f, g):
                absorbed.add(id(g))
                f.consequences.append(_as_consequence(g))
                f.consequences.extend(g.consequences)
                if f.onset_step is None and g.onset_step is not None:  # spans without steps: the flushes say when
                    f.onset_step, f.steps = g.onset_step, [g.onset_step]
            elif (f.kind in ("straggler", "slowdown") and g.kind == "sync_bottleneck" and _same_process(f, g)
                  and g.details.get("span") in (f.details.get("spans") or [f.details.get("span")])):
                absorbed.add(id(g))  # the slower span is what now takes that share of the time
                f.consequences.append(_as_consequence(g))
            elif f.kind in _SYMPTOMS and g.kind in _SYMPTOMS and _same_process(f, g):
                if f.kind == g.kind:  # the timeline's absent file and the flushes it missed
                    f.details.setdefault("also", []).append(g.message)
                    if g.onset_step is not None and (f.onset_step is None or g.onset_step < f.onset_step):
                        f.onset_step, f.steps = g.onset_step, g.steps
                else:
                    f.consequences.append(_as_consequence(g))
                absorbed.add(id(g))
        out.append(f)
    # a throughput drop that starts with another event follows from it
    roots = [f for f in out if f.kind in _CAUSES and f.onset_step is not None]
    final = []
    for f in out:
        if f.kind == "throughput_drop" and f.onset_step is not None:
            cause = next((r for r in roots
                          if r.onset_step - 1 <= f.onset_step <= (r.steps[-1] if r.steps else r.onset_step) + 2), None)
            if cause is not None:
                _add(cause, _as_consequence(f))
                continue
        final.append(f)
    final.sort(key=lambda f: (KIND_ORDER.index(f.kind) if f.kind in KIND_ORDER else len(KIND_ORDER),
                              f.onset_step if isinstance(f.onset_step, (int, float)) else -1, f.where or ""))
    return final
