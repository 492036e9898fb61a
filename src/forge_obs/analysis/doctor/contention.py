"""A busy host or a slow actor: the telemetry evidence (``obs/sys/...``, docs/telemetry.md) that
tells them apart, for the live alerts and the doctor.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.contention import Evidence
    >>> from forge_obs.analysis.doctor.rule_base import StepView
    >>> ev = Evidence(DoctorConfig())
    >>> src = {"host": "node0", "pid": 7, "mesh": "trainer", "rank": 1}
    >>> for step in range(10):                      # waits 0.3 s of each 0.5 s step for a CPU from step 6
    ...     ev.add(StepView(step, 0.0, per_rank={"trainer/r1": {
    ...         "obs/sys/proc/interval_s": 0.5, "obs/sys/proc/cpu_s": 0.1,
    ...         "obs/sys/proc/runq_wait_s": 0.3 if step >= 6 else 0.01,
    ...         "obs/sys/host/runnable_per_core": 3.0}}, sources={"trainer/r1": src}))
    >>> v = ev.judge("trainer/r1", 6, 9, excess_s=1.2, cpu_ratio=1.0)   # slower than before by 1.2 s
    >>> v.explained, v.host, round(v.extra_runq_s, 2)
    (True, 'node0', 1.16)
    >>> ev.judge("trainer/r1", 6, 9, excess_s=3.0, cpu_ratio=1.0).because   # a sleep: it did not wait for a CPU
    'its threads waited 1.16 s more for a CPU than its usual, for 3 s of extra time'

**The evidence** (:class:`Evidence`, fed one :class:`~forge_obs.analysis.doctor.rule_base.StepView`
at a time): per process, its samples (step, interval, CPU time, run-queue wait); per host, its
reader's samples (runnable tasks per core, CPU pressure, steal). A host sample is
*oversubscribed* when runnable tasks per core exceed ``contention_runnable``, or some task waited
for a CPU ``contention_pressure`` of the interval, or steal took ``contention_steal``.

**The verdict** (:meth:`Evidence.judge`) on a process that was slow over steps ``lo..hi`` by
``excess_s`` (its duration beyond its reference, summed over those steps): the host's, not the
actor's, when

1. its host was oversubscribed in ``contention_host_share`` of the samples of those steps (no
   host figures: its own threads waited for a CPU ``contention_pressure`` of the time);
2. the slow work took at most ``contention_cpu_ratio`` x its usual CPU time (the span's, from the
   timeline, else the process's): it waited, it did not compute more;
3. its threads waited for a CPU, beyond what its peers did in the same steps (a straggler) or
   what it did before (a slowdown), for ``contention_share`` of ``excess_s``. Without run-queue
   figures (a kernel without schedstat), only a slowdown shared by another process of the host
   passes (``shared``).

A rank slowed by a fault (a sleep, a lock, more work) on a busy host is still the actor's: its
extra time is not spent waiting for a CPU, or it is CPU work.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.rule_base import Event, KeyIndex, Rule, StepView
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.recording.telemetry.keys import HOST, PROC

__all__ = ["Evidence", "Verdict", "HostFigures", "HostContention"]

_NAN = math.nan
_IV, _CPU, _RUNQ = PROC + "interval_s", PROC + "cpu_s", PROC + "runq_wait_s"
_RPC, _PSI, _STEAL, _LOAD, _CORES = (HOST + "runnable_per_core", HOST + "cpu_pressure", HOST + "steal_share",
                                      HOST + "load1", HOST + "cores")


class _Series:
    """Parallel arrays of samples in step order (``keep``: the last samples kept, live)."""

    __slots__ = ("steps", "cols", "keep")

    def __init__(self, ncols: int, keep: int | None) -> None:
        self.steps = array("q")
        self.cols = [array("d") for _ in range(ncols)]
        self.keep = keep

    def add(self, step: int, *values: Any) -> None:
        steps = self.steps
        if steps and step <= steps[-1]:  # steps went back (a resumed run): its latest attempt
            self.clear()
        steps.append(step)
        for c, v in zip(self.cols, values):
            c.append(v if type(v) is float else (_NAN if v is None else float(v)))
        if self.keep is not None and len(steps) > 2 * self.keep:
            cut = len(steps) - self.keep
            del steps[:cut]
            for c in self.cols:
                del c[:cut]

    def clear(self) -> None:
        del self.steps[:]
        for c in self.cols:
            del c[:]

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """The samples of steps ``lo..hi``; where there is none (a process samples every few steps:
        docs/telemetry.md), the next one, which covers them (none yet, live: none)."""
        i, j = bisect_left(self.steps, lo), bisect_right(self.steps, hi)
        return (i, j) if i < j or j >= len(self.steps) else (j, j + 1)


def _total(col: array, i: int, j: int) -> float | None:
    xs = [x for x in col[i:j] if x == x]
    return sum(xs) if xs else None


@dataclass
class HostFigures:
    """A host's samples over some steps: how many, the share oversubscribed, their medians."""

    host: str
    samples: int
    oversubscribed: float
    runnable_per_core: float | None = None
    cpu_pressure: float | None = None
    steal_share: float | None = None
    load1: float | None = None
    cores: float | None = None

    def text(self) -> str:
        parts = []
        if self.runnable_per_core is not None:
            parts.append(f"{self.runnable_per_core:.1f} runnable tasks per core"
                         + (f" ({self.cores:g} cores, load {self.load1:.1f})" if self.cores and self.load1 is not None
                            else ""))
        if self.cpu_pressure is not None:
            parts.append(f"tasks waiting for a CPU {self.cpu_pressure:.0%} of the time")
        if self.steal_share:
            parts.append(f"{self.steal_share:.0%} of the CPU stolen by the hypervisor")
        return ", ".join(parts) or "no host figures"

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class Verdict:
    """Whether a slow process's extra time was its host's (see the module docstring)."""

    explained: bool
    host: str | None = None
    #: what it waited for a CPU beyond its reference, in the steps judged
    extra_runq_s: float | None = None
    excess_s: float = 0.0
    cpu_ratio: float | None = None
    figures: HostFigures | None = None
    #: why not (the first condition that failed), or None
    because: str | None = None
    details: dict = field(default_factory=dict)

    def clause(self) -> str:
        """What it waited on, for a message: ``waited 0.31 s for a CPU of its 0.25 s extra; CPU
        time 1.0x``."""
        out = []
        if self.extra_runq_s is not None:
            out.append(f"its threads waited {self.extra_runq_s:.3g} s more for a CPU than usual, for "
                       f"{self.excess_s:.3g} s of extra time")
        if self.cpu_ratio is not None:
            out.append(f"its CPU time {self.cpu_ratio:.1f}x its usual")
        return "; ".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {"explained": self.explained, "host": self.host, "excess_s": round(self.excess_s, 4),
                "extra_runq_s": None if self.extra_runq_s is None else round(self.extra_runq_s, 4),
                "cpu_ratio": self.cpu_ratio, "because": self.because,
                "host_figures": self.figures.to_dict() if self.figures else None}


class Evidence:
    """Telemetry per process and host, fed step by step (see the module docstring). ``keep``:
    the samples kept per process and host (live; None: every one, the doctor)."""

    def __init__(self, cfg: DoctorConfig, keep: int | None = None) -> None:
        self.cfg = cfg
        self.keep = keep
        self.proc: dict[str, _Series] = {}  # label -> (interval, cpu, runq, steps covered)
        self.hosts: dict[str, _Series] = {}  # host -> (rpc, psi, steal, load, cores)
        self.where: dict[str, tuple] = {}  # label -> (host, pid, mesh)
        self.by_pid: dict[tuple, str] = {}  # (host, pid) -> label

    def add(self, view: StepView) -> None:
        """The telemetry of one step's per-rank values."""
        step = view.step
        if not isinstance(step, int):
            return
        proc, where = self.proc, self.where
        for label, vals in view.per_rank.items():
            iv = vals.get(_IV)
            rpc = vals.get(_RPC)
            if iv is None and rpc is None:
                continue
            w = where.get(label) or self._place(label, view)
            if iv is not None:
                s = proc.get(label)
                if s is None:
                    s = proc[label] = _Series(4, self.keep)
                last = s.steps[-1] if s.steps else step - 1
                s.add(step, iv, vals.get(_CPU), vals.get(_RUNQ), float(step - last) if step > last else 1.0)
            if rpc is not None and w[0] is not None:
                h = self.hosts.get(w[0])
                if h is None:
                    h = self.hosts[w[0]] = _Series(5, self.keep)
                h.add(step, rpc, vals.get(_PSI), vals.get(_STEAL), vals.get(_LOAD), vals.get(_CORES))

    def _place(self, label: str, view: StepView) -> tuple:
        src = view.sources.get(label) or {}
        w = self.where[label] = (src.get("host"), src.get("pid"), str(src.get("mesh") or label.split("/")[0]))
        if w[0] is not None and w[1] is not None:
            self.by_pid[(w[0], w[1])] = label
        return w

    # ------------------------------------------------------------------ queries
    def label_of(self, host: Any, pid: Any) -> str | None:
        return self.by_pid.get((host, pid))

    def host_of(self, label: str) -> str | None:
        w = self.where.get(label)
        return w[0] if w else None

    def peers_of(self, label: str) -> list[str]:
        """The other processes of its mesh that have telemetry."""
        w = self.where.get(label)
        return [lb for lb, x in self.where.items() if w and x[2] == w[2] and lb != label and lb in self.proc]

    def totals(self, label: str, lo: int, hi: int) -> tuple | None:
        """(interval s, CPU s or None, run-queue wait s or None, steps covered) of its samples of
        steps ``lo..hi`` (a sample covers the steps since the process's previous one)."""
        s = self.proc.get(label)
        if s is None:
            return None
        i, j = s.rows(lo, hi)
        if i >= j:
            return None
        iv, cpu, runq, steps = s.cols
        return sum(iv[i:j]), _total(cpu, i, j), _total(runq, i, j), sum(steps[i:j])

    def before(self, label: str, lo: int) -> tuple | None:
        """Its usual, per step: (run-queue wait s, CPU s, interval s), the medians of its
        ``history_steps`` samples before ``lo`` (None with fewer than ``history_min_steps``)."""
        s = self.proc.get(label)
        if s is None:
            return None
        i = bisect_left(s.steps, lo)
        i0 = max(0, i - self.cfg.history_steps)
        if i - i0 < self.cfg.history_min_steps:
            return None
        iv, cpu, runq, steps = s.cols

        def per_step(col: array) -> float | None:
            xs = [col[k] / steps[k] for k in range(i0, i) if col[k] == col[k]]
            return median(xs) if xs else None

        return per_step(runq), per_step(cpu), per_step(iv)

    def host_figures(self, host: str | None, lo: int, hi: int) -> HostFigures | None:
        h = self.hosts.get(host) if host is not None else None
        if h is None:
            return None
        i, j = h.rows(lo, hi)
        if i >= j:
            return None
        cfg = self.cfg
        rpc, psi, steal, load, cores = (list(c[i:j]) for c in h.cols)
        over = sum(1 for a, b, c in zip(rpc, psi, steal) if a > cfg.contention_runnable
                   or b >= cfg.contention_pressure or c >= cfg.contention_steal)

        def med(xs: list) -> float | None:
            xs = [x for x in xs if x == x]
            return median(xs) if xs else None

        return HostFigures(host, j - i, over / (j - i), med(rpc), med(psi), med(steal), med(load), med(cores))

    # ------------------------------------------------------------------ verdicts
    def judge(self, label: str, lo: int, hi: int, excess_s: float, peers: bool = False,
              cpu_ratio: float | None = None, shared: bool = False) -> Verdict:
        """Whether ``label``'s extra ``excess_s`` over steps ``lo..hi`` was its host's (module
        docstring). ``peers``: judged against the other processes of its mesh (a straggler),
        else against its own samples before ``lo`` (a slowdown); ``cpu_ratio``: the slow span's
        CPU time against its usual, where the timeline has it; ``shared``: another process of
        the host slowed down with it."""
        cfg = self.cfg
        host = self.host_of(label)
        own = self.totals(label, lo, hi)
        if own is None or own[0] <= 0:
            return Verdict(False, host, excess_s=excess_s, because="no telemetry in those steps")
        iv, cpu, runq, steps = own
        ref = self._reference(label, lo, hi, peers, steps)
        fig = self.host_figures(host, lo, hi)
        v = Verdict(False, host, excess_s=excess_s, figures=fig)
        if ref is not None and ref[0] is not None and runq is not None:
            v.extra_runq_s = runq - ref[0]
        if cpu_ratio is None and ref is not None and ref[1] and cpu is not None:  # the process's CPU instead
            cpu_ratio = round(cpu / ref[1], 3)
        v.cpu_ratio = cpu_ratio
        if fig is not None:
            busy = fig.oversubscribed >= cfg.contention_host_share
        else:
            busy = runq is not None and runq / iv >= cfg.contention_pressure
        if not busy:
            v.because = "its host was not oversubscribed in those steps"
        elif cpu_ratio is not None and cpu_ratio > cfg.contention_cpu_ratio:
            v.because = f"it used {cpu_ratio:.1f}x its usual CPU time: more work, not waiting"
        elif v.extra_runq_s is not None:
            if v.extra_runq_s < cfg.contention_share * excess_s:
                v.because = (f"its threads waited {max(v.extra_runq_s, 0.0):.3g} s more for a CPU than its "
                             f"{'peers' if peers else 'usual'}, for {excess_s:.3g} s of extra time")
        elif not shared or peers:
            v.because = "no run-queue figures, and no other process of its host slowed with it"
        v.explained = v.because is None
        return v

    def _reference(self, label: str, lo: int, hi: int, peers: bool, steps: float) -> tuple | None:
        """(run-queue wait s, CPU s) it is judged against over the steps it covers: its peers'
        medians over the same steps, or its usual per step (:meth:`before`) x ``steps``."""
        if not peers:
            b = self.before(label, lo)
            if b is None:
                return None
            return (None if b[0] is None else b[0] * steps), (None if b[1] is None else b[1] * steps)
        runqs, cpus = [], []
        for p in self.peers_of(label):
            t = self.totals(p, lo, hi)
            if t is None:
                continue
            if t[2] is not None:
                runqs.append(t[2])
            if t[1] is not None:
                cpus.append(t[1])
        if not runqs and not cpus:
            return None
        return (median(runqs) if runqs else None), (median(cpus) if cpus else None)

    def judge_drop(self, lo: int, hi: int) -> Verdict:
        """Whether a throughput drop over steps ``lo..hi`` was a host's: a process's steps took
        longer than usual (by at least a tenth of their time), and what its threads waited for a
        CPU beyond their usual covers ``contention_share`` of that, on a host oversubscribed
        then. The process that waited most names the host."""
        cfg = self.cfg
        best: tuple | None = None
        for label in self.proc:
            own, usual = self.totals(label, lo, hi), self.before(label, lo)
            if own is None or own[2] is None or usual is None or usual[0] is None or usual[2] is None:
                continue
            iv, _cpu, runq, steps = own
            extra_wall, extra_runq = iv - usual[2] * steps, runq - usual[0] * steps
            if extra_wall > 0.1 * iv and extra_runq >= cfg.contention_share * extra_wall and (
                    best is None or extra_runq > best[0]):
                best = (extra_runq, label, runq / iv, usual[0] / usual[2] if usual[2] else 0.0, extra_wall)
        if best is None:
            return Verdict(False, because="no process's steps were slower for waiting for a CPU")
        host = self.host_of(best[1])
        fig = self.host_figures(host, lo, hi)
        ok = fig is None or fig.oversubscribed >= cfg.contention_host_share
        return Verdict(ok, host, extra_runq_s=best[0], excess_s=best[4], figures=fig,
                       because=None if ok else "its host was not oversubscribed",
                       details={"label": best[1], "runq_wait_share": round(best[2], 4),
                                "usual_runq_wait_share": round(best[3], 4)})


class HostContention(Rule):
    """``host_contention``: a host whose processes' slowness was waiting for a CPU. Holds the
    :class:`Evidence` (fed first at every step, before the rules that ask it) and one incident
    per host: the straggler and slowdown rules and the throughput rule :meth:`absorb` a condition
    the evidence explains (it is then reported here, under its host, and not as a straggler of
    its own), and :meth:`release` it when it clears. The incident fires with its first condition
    and resolves when its last one cleared."""

    name = "host_contention"

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 keep: int | None = 512) -> None:
        super().__init__(cfg, ids, keys)
        self.evidence = Evidence(cfg, keep=keep)
        self.incidents: dict[str, dict] = {}  # host -> {"onset", "last", "members", "seen", "figures"}
        self.host_of: dict[str, str] = {}  # condition id -> host

    def update(self, view: StepView) -> list[Event]:
        self.evidence.add(view)
        for inc in self.incidents.values():
            inc["last"] = view.step
        return []

    def absorb(self, cond: str, verdict: Verdict, what: dict, step: int, onset: int) -> list[Event]:
        """Condition ``cond`` (its id) is the host's (``verdict``); ``what``: a consequence row
        (its ``summary``: what slowed, for the message). Returns the incident's ``firing`` event
        when it opens."""
        host = verdict.host or "?"
        self.host_of[cond] = host
        inc = self.incidents.get(host)
        opened = inc is None
        if opened:
            inc = self.incidents[host] = {"onset": onset, "last": step, "members": {}, "seen": {}}
        inc["members"][cond] = what
        if cond not in inc["seen"] and len(inc["seen"]) < 64:
            inc["seen"][cond] = what
        inc["figures"] = verdict.figures or inc.get("figures")
        return [self._event(host, inc, "firing", step)] if opened else []

    def absorbed(self, cond: str) -> bool:
        return cond in self.host_of

    def release(self, cond: str, step: int) -> list[Event]:
        """Condition ``cond`` cleared; returns the incident's ``resolved`` event when it was its last."""
        host = self.host_of.pop(cond, None)
        inc = self.incidents.get(host) if host is not None else None
        if inc is None:
            return []
        inc["members"].pop(cond, None)
        inc["last"] = step
        if inc["members"]:
            return []
        del self.incidents[host]
        return [self._event(host, inc, "resolved", step)]

    def _event(self, host: str, inc: dict, state: str, step: int) -> Event:
        fig: HostFigures | None = inc.get("figures")
        seen = list(inc["seen"].values())
        what = "; ".join(m["summary"] for m in seen[:4]) + (f"; and {len(seen) - 4} more" if len(seen) > 4 else "")
        msg = (f"host {host} is oversubscribed since step {inc['onset']}"
               + (f" ({fig.text()})" if fig is not None else "")
               + f": slowed down waiting for a CPU, not by their own work: {what}")
        where = {"mesh": None, "actor": None, "rank": None, "replica": None, "where": f"host {host}"}
        details = {"host": host, "figures": fig.to_dict() if fig is not None else None,
                   "explained": [m.get("verdict") for m in seen]}
        return Event(self.name, state, f"host_contention:{host}:{inc['onset']}", step, inc["onset"], inc["last"], msg,
                     where, details, [{k: v for k, v in m.items() if k not in ("verdict", "summary")} for m in seen])

    def finish(self) -> list[Event]:
        return [self._event(h, inc, "active", inc["last"]) for h, inc in self.incidents.items()]
