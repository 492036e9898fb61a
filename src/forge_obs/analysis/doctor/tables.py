"""One pass over a run's timeline records (``events/*.jsonl``) builds the per-step tables every
timeline rule reads: per (attempt, peer group, span name), step and rank the summed duration and
first start / last end (and the CPU time of the spans that carry it); each step's wall time; each
process's active window, state-moving spans, open spans and last step.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.tables import scan
    >>> t = scan("runs/does-not-exist", DoctorConfig())
    >>> dict(t.per_step), t.run.streams
    ({}, {})
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.reader import OPEN, SPAN, STEP

__all__ = ["Tables", "peer_group", "scan", "stream_where", "stream_details"]


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
    #: (attempt, peer group, step, rank) -> when the rank's first ``set_step`` of that step was recorded
    marks: dict = field(default_factory=dict)
    #: (attempt, mesh, name) -> step -> rank -> [CPU µs, wall µs] of its spans that carry their CPU time
    cpu: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(dict)))


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
    sink = _Sink(t, cfg)
    span, step_mark, opens = sink.span, sink.step_mark, t.opens
    for it in reader.walk(run):
        k = it[0]
        if k is SPAN:
            span(it)
        elif k is OPEN:
            opens.append(it)
        elif k is STEP:
            step_mark(it)
    for st in run.streams.values():
        if st.last_ts is not None:
            t.end_by_attempt[st.attempt] = max(t.end_by_attempt.get(st.attempt, st.last_ts), st.last_ts)
    return t


class _Sink:
    """What :func:`scan` does with each record; what a span's name means on its stream (its group,
    whether it is a start-up or state-moving span, a controller's wait) is learnt once."""

    def __init__(self, t: Tables, cfg: DoctorConfig) -> None:
        self.t = t
        self.life_re, self.sync_re = cfg.lifecycle_re, cfg.sync_re
        self.peers: dict[int, str] = {}  # id(stream) -> its peer group
        self.kinds: dict[tuple, tuple] = {}  # (id(stream), name) -> (group, lifecycle, sync, ctl, ctl wait)

    def group(self, st: Any) -> str:
        mesh = self.peers.get(id(st))
        if mesh is None:
            mesh = self.peers[id(st)] = peer_group(st)
        return mesh

    def kind(self, st: Any, name: str) -> tuple:
        ctl = bool(st.header.get("ctl"))
        k = self.kinds[(id(st), name)] = ((st.attempt, self.group(st), name), bool(self.life_re.search(name)),
                                          bool(self.sync_re.search(name)), ctl, ctl and "wait" in name.lower())
        return k

    def step_mark(self, it: tuple) -> None:
        _k, st, _lane, step, ts = it
        self.t.last_step[st.key] = step
        key = (st.attempt, self.group(st), step, st.rank)
        if key not in self.t.marks:
            self.t.marks[key] = ts

    def span(self, it: tuple) -> None:
        # a span row of reader.walk: (SPAN, stream, lane, name, step, start, duration, extras, cpu_us)
        st, name, step, ts, dur = it[1], it[3], it[4], it[5], it[6]
        kind = self.kinds.get((id(st), name)) or self.kind(st, name)
        g, life, sync, ctl, ctl_wait = kind
        t = self.t
        end = ts + dur
        if dur > t.longest[g]:
            t.longest[g] = dur
        if life:
            return
        _widen(t.window, st.key, ts, end)
        if step is not None:
            cell = t.per_step[g][step].get(st.rank)
            if cell is None:
                t.per_step[g][step][st.rank] = [dur, ts, end]
                t.stream_of[(st.attempt, g[1], st.rank)] = st
            else:
                cell[0] += dur
                _widen_cell(cell, ts, end)
            cpu = it[8]
            if cpu is not None:
                c = t.cpu[g][step].get(st.rank)
                if c is None:
                    t.cpu[g][step][st.rank] = [cpu, dur]
                else:
                    c[0] += cpu
                    c[1] += dur
            _widen(t.step_wall, (st.attempt, step), ts, end)
            t.last_step[st.key] = step
        elif not ctl:
            t.unstepped[(st.attempt, g[1])] += 1
        if sync:
            t.budget[(st.key, name)].append((ts, end))
            t.budget_steps[(st.key, name)].append(step)
        if ctl_wait:
            t.ctl_wait[(st.key, name)].append((ts, end))


def _widen(d: dict, key: Any, ts: int, end: int) -> None:
    """``d[key]`` = [first start, last end], widened to cover [ts, end]."""
    w = d.get(key)
    if w is None:
        d[key] = [ts, end]
    else:
        _widen_cell(w, ts, end)


def _widen_cell(w: list, ts: int, end: int) -> None:
    if ts < w[-2]:
        w[-2] = ts
    if end > w[-1]:
        w[-1] = end


def stream_where(ids: Identities, st: Any) -> dict:
    """Who a timeline stream is (mesh / actor / rank, the replica)."""
    return ids.of(st.mesh, st.rank, st.actor or None)


def stream_details(st: Any) -> dict:
    """Where a timeline stream ran: host, pid, attempt (a finding's details)."""
    return {"host": st.host, "pid": st.pid, "attempt": st.attempt}
