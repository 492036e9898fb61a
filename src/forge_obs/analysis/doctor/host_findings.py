"""The doctor's findings that were their host's: every straggler and slowdown is judged against
the processes' telemetry (:meth:`~forge_obs.analysis.doctor.contention.Evidence.judge`); those
its host explains become one ``host_contention`` finding per host and busy spell, with the host's
figures, and are listed under it instead of standing as an actor's fault.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.contention import Evidence
    >>> from forge_obs.analysis.doctor.host_findings import host_contention
    >>> host_contention([], Evidence(DoctorConfig()), DoctorConfig())
    ([], [])

A finding the host does not explain stays as it is; where its host was oversubscribed meanwhile
its message says why it is still the actor's (``its host node0 was busy (...), but its threads
waited 0.02 s more for a CPU than its peers, for 9.5 s of extra time``) and its details carry the
verdict (``host_contention``). The ``host_contention`` findings the replayed rules made (a
throughput drop while processes waited for a CPU) join the spell of their host they overlap.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.contention import Evidence, Verdict
from forge_obs.analysis.doctor.finding import Finding

__all__ = ["host_contention"]

_JUDGED = ("straggler", "slowdown")


def host_contention(findings: list[Finding], ev: Evidence | None, cfg: DoctorConfig) -> tuple[list[Finding], list[str]]:
    """``findings`` with those their host explains moved under ``host_contention`` findings; notes."""
    judged = [f for f in findings if f.kind in _JUDGED]
    if ev is None or not ev.proc:
        note = ("host contention: no telemetry (obs/sys/...) in metrics.jsonl: stragglers and slowdowns are not "
                "judged against their host") if judged else None
        return findings, [note] if note else []
    keep, explained, hosts = [], [], []
    for f in findings:
        if f.kind == "host_contention":
            hosts.append(f)
            continue
        v = _verdict(f, findings, ev) if f.kind in _JUDGED else None
        if v is not None and v.explained:
            explained.append((f, v))
            continue
        if v is not None:
            _note_kept(f, v, cfg)
        keep.append(f)
    made = [_host_finding(host, items, ev) for host, items in _spells(explained, ev, cfg)]
    out = keep + _join(made, [r for r in hosts if _not_an_actors(r, keep)], cfg)
    notes = [f"host contention: {len(judged)} straggler/slowdown finding(s) judged against the processes' telemetry; "
             f"{len(explained)} were their host's (listed under host_contention)"] if judged else []
    return out, notes


def _label(f: Finding, ev: Evidence, host: Any = None, pid: Any = None) -> str | None:
    d = f.details or {}
    label = ev.label_of(host if host is not None else d.get("host"), pid if pid is not None else d.get("pid"))
    if label is None and f.where in ev.where:  # a finding of the metric rules: its rank's label
        label = f.where
    return label


def _excess(f: Finding) -> float:
    d = f.details or {}
    if d.get("excess_s") is not None:
        return float(d["excess_s"])
    hits = d.get("hit_steps") or d.get("slow_steps") or 0
    return hits * max((d.get("median_s") or 0.0) - (d.get("reference_s") or 0.0), 0.0)


def _verdict(f: Finding, findings: list[Finding], ev: Evidence) -> Verdict | None:
    if not f.steps or not all(isinstance(s, int) for s in f.steps):
        return None
    lo, hi = f.steps[0], f.steps[-1]
    d = f.details or {}
    if f.kind == "straggler":
        label = _label(f, ev)
        return None if label is None else ev.judge(label, lo, hi, _excess(f), peers=True, cpu_ratio=d.get("cpu_ratio"))
    procs = d.get("processes") or [[d.get("host"), d.get("pid"), f.rank, _excess(f), d.get("cpu_ratio")]]
    verdicts = []
    for host, pid, _rank, excess, cpu in procs:
        label = _label(f, ev, host, pid)
        if label is None:
            return None
        verdicts.append(ev.judge(label, lo, hi, excess or 0.0, cpu_ratio=cpu, shared=_shared(f, label, findings, ev)))
    bad = next((v for v in verdicts if not v.explained), None)
    if bad is not None or not verdicts:
        return bad
    v = verdicts[0]
    v.excess_s = sum(x.excess_s for x in verdicts)
    if all(x.extra_runq_s is not None for x in verdicts):
        v.extra_runq_s = sum(x.extra_runq_s for x in verdicts)
    return v


def _shared(f: Finding, label: str, findings: list[Finding], ev: Evidence) -> bool:
    """Another process of ``label``'s host slowed down over the same steps (a finding of its own,
    or one listed under ``f``)."""
    host = ev.host_of(label)
    lo, hi = f.steps[0], f.steps[-1]
    others = [(g.where, g.steps) for g in findings if g is not f and g.kind in _JUDGED]
    others += [(c.get("where"), c.get("steps") or []) for c in f.consequences if c.get("kind") == "slowdown"]
    for where, steps in others:
        other = where if where in ev.where else None
        if other is None or other == label or ev.host_of(other) != host or not steps:
            continue
        if steps[0] <= hi and lo <= steps[-1]:
            return True
    return False


def _note_kept(f: Finding, v: Verdict, cfg: DoctorConfig) -> None:
    """A finding its host does not explain: the verdict in its details; where the host was busy,
    why it is still the actor's in its message."""
    f.details["host_contention"] = v.to_dict()
    fig = v.figures
    if fig is not None and fig.oversubscribed >= cfg.contention_host_share and v.because:
        f.message += f"; its host {fig.host} was busy ({fig.text()}), but {v.because}"


def _spells(explained: list, ev: Evidence, cfg: DoctorConfig) -> list[tuple[str, list]]:
    """Per host, the explained findings grouped into busy spells: two belong to one spell when
    they are at most ``window_steps`` apart or the host stayed oversubscribed between them."""
    by_host: dict[str, list] = defaultdict(list)
    for f, v in explained:
        by_host[v.host or "?"].append((f, v))
    out = []
    for host, items in sorted(by_host.items()):
        items.sort(key=lambda x: x[0].steps[0])
        spell = [items[0]]
        for f, v in items[1:]:
            hi = max(x[0].steps[-1] for x in spell)
            gap = ev.host_figures(host, hi + 1, f.steps[0] - 1) if f.steps[0] - hi > cfg.window_steps else None
            busy_between = gap is not None and gap.oversubscribed >= cfg.contention_host_share
            if f.steps[0] - hi <= cfg.window_steps or busy_between:
                spell.append((f, v))
            else:
                out.append((host, spell))
                spell = [(f, v)]
        out.append((host, spell))
    return out


def _as_row(f: Finding, clause: str) -> dict:
    return {"kind": f.kind, "mesh": f.mesh, "actor": f.actor, "rank": f.rank, "replica": f.replica,
            "where": f.where, "steps": list(f.steps), "span": (f.details or {}).get("span"),
            "message": f.message + (f" ({clause})" if clause else "")}


def _host_finding(host: str, items: list, ev: Evidence) -> Finding:
    lo = min(f.steps[0] for f, _v in items)
    hi = max(f.steps[-1] for f, _v in items)
    fig = ev.host_figures(host, lo, hi)
    who = ", ".join(dict.fromkeys(f"{f.where} '{(f.details or {}).get('span') or (f.details or {}).get('key')}'"
                                  for f, _v in items))
    first = items[0][1]
    msg = (f"host {host} was oversubscribed in steps {lo}..{hi}" + (f" ({fig.text()})" if fig else "")
           + f": {who} {'was' if len(items) == 1 else 'were'} slow waiting for a CPU, not for their own work "
           f"({first.clause()})")
    cons = []
    for f, v in items:
        cons.append(_as_row(f, v.clause()))
        cons += f.consequences
    out = Finding("host_contention", msg, steps=[lo, hi], onset_step=lo, consequences=cons,
                  details={"host": host, "figures": fig.to_dict() if fig else None,
                           "explained": [{"kind": f.kind, "where": f.where, **v.to_dict()} for f, v in items]})
    return out.set_where({"mesh": None, "actor": None, "rank": None, "replica": None, "where": f"host {host}"})


def _not_an_actors(r: Finding, kept: list[Finding]) -> bool:
    """A replayed ``host_contention`` finding keeps the drops that no actor's fault explains (one
    that starts with a kept straggler, slowdown, hang, ... follows from it); False when none is left."""
    roots = [f for f in kept if f.kind not in ("throughput_drop", "staleness", "threshold", "dropped")
             and isinstance(f.onset_step, int) and f.steps]
    r.consequences = [c for c in r.consequences if not any(
        isinstance((c.get("steps") or [None])[0], int) and f.onset_step - 1 <= c["steps"][0] <= f.steps[-1] + 2
        for f in roots)]
    return bool(r.consequences)


def _join(made: list[Finding], replayed: list[Finding], cfg: DoctorConfig) -> list[Finding]:
    """The replayed rules' ``host_contention`` findings join the spell of their host they overlap."""
    out = list(made)
    for r in replayed:
        host = (r.details or {}).get("host")
        lo, hi = (r.steps[0], r.steps[-1]) if r.steps else (r.onset_step, r.onset_step)
        spell = next((m for m in out if (m.details or {}).get("host") == host and m.steps and lo is not None
                      and lo <= m.steps[-1] + cfg.window_steps and m.steps[0] - cfg.window_steps <= hi), None)
        if spell is None:
            out.append(r)
            continue
        spell.consequences += r.consequences
        spell.steps = [min(spell.steps[0], lo), max(spell.steps[-1], hi)]
        spell.onset_step = spell.steps[0]
    return out
