"""The per-step tables every timeline rule reads: per (attempt, peer group, span name), step and
rank the summed duration and first start / last end (and the CPU time of the spans that carry
it); each step's wall time; each process's active window, state-moving spans, open spans and last
step.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.tables import scan
    >>> t = scan("runs/does-not-exist", DoctorConfig())
    >>> dict(t.per_step), t.run.streams
    ({}, {})

:func:`scan` reads them from the run's index (:mod:`forge_obs.analysis.index`: aggregates that
DuckDB computes over the per-step evidence stored beside the spans, ``cells``: one row per rank,
span name and step of each segment, however many spans it has), and where the index cannot be
built here (no DuckDB or pyarrow), in one pass over the timeline records themselves: both give
the same tables (``tests/analysis/test_index.py`` and ``test_doctor_evidence.py`` compare them).
From the index, ``per_step`` is made one group at a time when a rule asks for it; the trackers
read each group's ``columns``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

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
    #: (attempt, mesh, name) -> its cells' steps, ranks and durations (s) as NumPy arrays, in step
    #: order (a step's ranks in ``per_step``'s order): ``per_step`` as the trackers read it, where
    #: the tables come from the index (else empty)
    columns: dict = field(default_factory=dict)


def peer_group(st: Any) -> str:
    """The name ranks are compared under: the mesh, or, for the ranks of an SPMD job with pipeline
    stages, the mesh and the stage (``trainer[pp=1]``): ranks doing the same work (the DP, TP and
    CP ranks of one stage) are each other's peers; two stages are not."""
    coords = st.header.get("coords")
    if isinstance(coords, dict) and type(coords.get("pp")) is int:
        return f"{st.mesh}[pp={coords['pp']}]"
    return st.mesh


def scan(run_dir: "str | Path", cfg: DoctorConfig, index: bool = True) -> Tables:
    """The tables of ``run_dir``: read from its index (brought up to date first), or with
    ``index=False`` (or without DuckDB and pyarrow) from the timeline files directly."""
    run_dir = Path(run_dir)
    if index and (run_dir / "events").is_dir():
        from forge_obs.analysis.index import available, open_index

        if available():
            return _from_index(open_index(run_dir), cfg)
    return _direct(run_dir, cfg)


def _direct(run_dir: Path, cfg: DoctorConfig) -> Tables:
    """One pass over the records of ``reader.walk``."""
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


def _from_index(idx: Any, cfg: DoctorConfig) -> Tables:
    """The tables from the index's aggregates (:class:`forge_obs.analysis.index.evidence.Evidence`),
    in the order a pass over the records builds them."""
    from forge_obs.analysis.index.evidence import Evidence

    ev = Evidence(idx, skip=lambda name: bool(cfg.lifecycle_re.search(name)))
    by = ev.run.by_sid
    t = Tables(_in_reading_order(ev.run, idx.manifest))
    group = {sid: peer_group(st) for sid, st in by.items()}
    for sid, name, dur in ev.longest():
        st = by[sid]
        g = (st.attempt, group[sid], name)
        t.longest[g] = max(t.longest[g], dur)
    _cells(t, ev.cells(group))
    t.stream_of.update(((attempt, grp, rank), by[sid]) for attempt, grp, rank, sid in ev.streams_of_cells())
    for attempt, step, lo, hi in ev.step_walls():
        t.step_wall[(attempt, step)] = [lo, hi]
    ev.drop_cells()
    for sid, lo, hi, unstepped in ev.windows():
        st = by[sid]
        t.window[st.key] = [lo, hi]
        if unstepped and not st.header.get("ctl"):
            t.unstepped[(st.attempt, group[sid])] += unstepped
    t.last_step.update((by[sid].key, step) for sid, step in ev.last_steps())
    _intervals(t, ev, cfg, group)
    t.opens = ev.opens()
    t.marks = _Marks(ev, group)
    for st in t.run.streams.values():
        if st.last_ts is not None:
            t.end_by_attempt[st.attempt] = max(t.end_by_attempt.get(st.attempt, st.last_ts), st.last_ts)
    return t


def _cells(t: Tables, cells: Iterator[tuple]) -> None:
    """``per_step`` (:class:`_Groups`), ``columns`` and ``cpu`` from the cells of each group
    (:meth:`forge_obs.analysis.index.evidence.Evidence.cells`): they come by position, so each
    group's steps and ranks are in the reader's order."""
    import numpy as np

    t.per_step = groups = _Groups()
    for key, c in cells:
        groups.cols[key] = c
        order = np.argsort(c["step"], kind="stable")
        t.columns[key] = (c["step"][order], c["rank"][order], c["dur"][order] / 1e6)
        if c["cpu"] is not None:
            cpu = t.cpu[key]
            for step, rank, us, wall in zip(c["step"].tolist(), c["rank"].tolist(), c["cpu"], c["cpu_dur"]):
                if us is not None:
                    cpu[step][rank] = [us, wall]


class _Groups(Mapping):
    """``per_step`` read from the index: (attempt, mesh, name) -> step -> rank -> [summed
    duration, first start, last end], each group's made from its cells' columns when it is first
    asked for (the trackers read ``columns``: most groups are never made)."""

    def __init__(self) -> None:
        self.cols: dict = {}
        self.made: dict = {}

    def __getitem__(self, key: Any) -> dict:
        per = self.made.get(key)
        if per is None:
            per = self.made[key] = _per_step(self.cols[key])
        return per

    def __iter__(self) -> Iterator:
        return iter(self.cols)

    def __len__(self) -> int:
        return len(self.cols)


def _per_step(c: dict) -> dict:
    """step -> rank -> [summed duration, first start, last end] of one group's cells, steps and
    ranks inserted in the order of the cells."""
    steps, ranks = c["step"].tolist(), c["rank"].tolist()
    vals = map(list, zip(c["dur"].tolist(), c["lo"].tolist(), c["hi"].tolist()))
    per: dict = defaultdict(dict)
    if len(set(steps)) == len(steps):  # one rank a step: each step's dict at once
        per.update({step: {rank: v} for step, rank, v in zip(steps, ranks, vals)})
        return per
    for step, rank, v in zip(steps, ranks, vals):
        by_rank = per.get(step)
        if by_rank is None:
            per[step] = {rank: v}
        else:
            by_rank[rank] = v
    return per


def _intervals(t: Tables, ev: Any, cfg: DoctorConfig, group: dict) -> None:
    """The state-moving spans (``sync_spans``) and the controller's waits, span by span."""
    sync = [n for n in ev.names if cfg.sync_re.search(n)]
    waits = [n for n in ev.names if "wait" in n.lower()]
    ctl = [sid for sid, st in ev.run.by_sid.items() if st.header.get("ctl")]
    by = ev.run.by_sid
    for sid, name, lo, hi, step in ev.intervals(sync) if sync else ():
        key = (by[sid].key, name)
        t.budget[key].append((lo, hi))
        t.budget_steps[key].append(step)
    for sid, name, lo, hi, _step in ev.intervals(waits, ctl) if waits and ctl else ():
        t.ctl_wait[(by[sid].key, name)].append((lo, hi))


class _Marks(dict):
    """(attempt, peer group, step, rank) -> the time of that rank's first ``set_step`` of the
    step, read from the index one (attempt, peer group) at a time, when first asked for."""

    def __init__(self, ev: Any, group: dict) -> None:
        super().__init__()
        self.ev = ev
        self.sids: dict[tuple, list] = defaultdict(list)
        for sid, st in ev.run.by_sid.items():
            self.sids[(st.attempt, group[sid])].append(sid)
        self.group = group

    def _load(self, part: tuple) -> None:
        sids = self.sids.pop(part, None)
        if not sids:
            return
        by = self.ev.run.by_sid
        first: dict = {}
        for sid, step, ts, pos in sorted(self.ev.marks(sids), key=lambda r: r[3]):
            st = by[sid]
            first.setdefault((st.attempt, self.group[sid], step, st.rank), ts)
        self.update(first)

    def get(self, key: Any, default: Any = None) -> Any:
        self._load(key[:2])
        return dict.get(self, key, default)

    def all(self) -> dict:
        """Every mark (all read from the index)."""
        for part in list(self.sids):
            self._load(part)
        return dict(self)


def _in_reading_order(run: Any, man: Any) -> Any:
    """``run`` with its streams in the order :func:`forge_obs.analysis.reader.scan` meets them:
    the sessions that begin a file, by file name; TorchTitan's files' next; the sessions a
    restarted process appended to a file last."""
    files = sorted(man.state.get("files", {}).items())
    first = [tuple(f["order"][:3]) for _rel, f in files if not f["titan"]]
    first += [tuple(f["order"][:3]) for _rel, f in files if f["titan"]]
    rank = {k: i for i, k in enumerate(dict.fromkeys(first))}
    streams = sorted(run.streams.values(), key=lambda st: (rank.get(st.key, len(rank)),))
    run.streams = {st.key: st for st in streams}
    return run


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
