"""Run directories written in the documented on-disk formats (``events/*.jsonl`` schema v1,
``metrics.jsonl``) with planted faults, for doctor and alert tests that need exact timings.

    write_timeline(run_dir, {"trainer": 2}, steps=40, spans=lambda mesh, rank, step: [("train", 0.01)])
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable

T0_US = 1_763_860_000_000_000
START = 1_763_860_000.0

SpanFn = Callable[[str, int, int], "list[tuple[str, float]]"]


def _header(mesh: str, rank: int, ws: int, actor: str, pid: int, ctl: bool = False) -> dict:
    return {"h": 1, "v": 1, "run": "t", "start": START, "session": f"s{pid}", "host": "node0", "pid": pid,
            "mesh": mesh, "actor": actor, "rank": rank, "coords": {"procs": rank}, "ws": ws, "ctl": ctl,
            "ranks": "all", "t0": T0_US, "file": 0}


def write_timeline(run_dir: Path, meshes: dict[str, int], steps: int, spans: SpanFn, *,
                   gap_s: float = 0.002, startup_s: float = 0.0, wait_s: Callable[[int], float] | None = None,
                   actors: dict[str, str] | None = None, open_at: dict | None = None,
                   dead: dict | None = None, coords: "Callable[[str, int], dict] | None" = None,
                   writing: bool = False, unwritten_s: dict | None = None) -> None:
    """One file per (mesh, rank) plus the controller's. Every step starts when the slowest rank of
    the previous one ended (+ ``gap_s``); a rank's spans run back to back from the step's start.

    ``spans(mesh, rank, step)`` -> ``[(name, seconds), ...]`` or ``(name, seconds, cpu_seconds)``
    (the span's CPU time, as a span that reads its thread's clock records it; a ``None`` name:
    time the rank spends without a span); ``wait_s(step)``: the controller's
    ``wait_for_batch`` at the start of its ``controller_step`` (concurrent with the ranks' work); ``startup_s``: a one-off ``startup`` span on
    the controller before step 0; ``open_at[(mesh, rank)] = (step, name)``: that span never ends
    and the process writes nothing after it; ``dead[(mesh, rank)] = step``: the process stops
    writing at that step without closing its file. ``coords(mesh, rank)``: the rank's coordinates
    in the header (default ``{"procs": rank}``). ``writing``: the run is still being written (no
    process has closed its file yet); ``unwritten_s[(mesh, rank)] = s``: that process's records of
    the last ``s`` seconds are not on disk yet (its writer's next pass has not run)."""
    ev = Path(run_dir) / "events"
    ev.mkdir(parents=True, exist_ok=True)
    actors = actors or {}
    open_at = open_at or {}
    dead = dead or {}
    streams: dict[tuple, dict] = {}
    pid = 100
    for mesh, n in meshes.items():
        for r in range(n):
            pid += 1
            streams[(mesh, r)] = {"h": _header(mesh, r, n, actors.get(mesh, mesh.capitalize()), pid), "lines": [],
                                  "names": {}, "stopped": False}
            if coords is not None:
                streams[(mesh, r)]["h"]["coords"] = coords(mesh, r)
    ctl = {"h": _header("controller", 0, 1, "", 1, ctl=True), "lines": [], "names": {}, "stopped": False}

    def name_id(s: dict, name: str) -> int:
        if name not in s["names"]:
            s["names"][name] = len(s["names"]) + 1
            s["lines"].append(["N", s["names"][name], name])
        return s["names"][name]

    for s in [*streams.values(), ctl]:
        s["lines"].append(["L", 0, "main", 1])
    t = 0
    if startup_s:
        ctl["lines"].append([0, int(startup_s * 1e6), 0, name_id(ctl, "startup"), None])
        t = int(startup_s * 1e6) + 1000
    for step in range(steps):
        start = t
        end = start
        ctl["lines"].append(["S", start, 0, step])
        w = int((wait_s(step) if wait_s else 0.0) * 1e6)
        for (mesh, r), s in streams.items():
            if s["stopped"]:
                continue
            if dead.get((mesh, r)) == step:
                s["stopped"] = True
                continue
            s["lines"].append(["S", start, 0, step])
            ts = start
            for name, sec, *cpu in spans(mesh, r, step):
                if name is None:
                    ts += max(1, int(sec * 1e6))
                    continue
                if open_at.get((mesh, r)) == (step, name):
                    s["lines"].append(["B", 1, ts, 0, name_id(s, name), step])
                    s["stopped"] = True
                    break
                d = max(1, int(sec * 1e6))
                s["lines"].append([ts, d, 0, name_id(s, name), step] + ([{"c": int(cpu[0] * 1e6)}] if cpu else []))
                ts += d
            end = max(end, ts)
        end += int(gap_s * 1e6)
        wid = name_id(ctl, "wait_for_batch")
        sid = name_id(ctl, "controller_step")
        if w:
            ctl["lines"].append([start, w, 0, wid, step])
        ctl["lines"].append([start, end - start, 0, sid, step])
        t = end
    for s in [*streams.values(), ctl]:
        if not s["stopped"] and not writing:
            s["lines"].append(["Z", t])
    for key, lag_s in (unwritten_s or {}).items():
        s = streams[key] if key in streams else ctl
        s["lines"] = [x for x in s["lines"] if not _written_after(x, t - int(lag_s * 1e6))]
    for (mesh, r), s in [*streams.items(), (("controller", 0), ctl)]:
        path = ev / f"node0_{s['h']['pid']}_{mesh}_{r}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in [s["h"], *s["lines"]]))


def write_startup(run_dir: Path, seconds: float, started: dict[str, int], ws: dict[str, int]) -> None:
    """A run in its start-up, still being written (the GRPO app's first minute): the controller
    made a call and opened its ``startup`` span at 0; the processes of ``started`` (mesh -> ranks
    started, out of ``ws[mesh]``) opened their files one after another over ``seconds``, each
    recording ``set_step(0)``; the other ranks have not started yet."""
    ev = Path(run_dir) / "events"
    ev.mkdir(parents=True, exist_ok=True)
    files = {"controller_0": [_header("controller", 0, 1, "", 1, ctl=True), ["L", 0, "Task-1", 1], ["N", 1, "call"],
                              ["I", 1000, 0, 1, None, {"p": "c.1"}], ["N", 2, "startup"], ["B", 1, 900, 0, 2, None]]}
    procs = [(mesh, r) for mesh, n in started.items() for r in range(n)]
    for i, (mesh, r) in enumerate(procs):
        h = _header(mesh, r, ws[mesh], "", 101 + i)
        h["t0"] = T0_US + int(seconds * 1e6 * (i + 1) / len(procs))
        files[f"{mesh}_{r}"] = [h, ["L", 0, "Task-6", 1], ["S", 0, 0, 0]]
    for name, lines in files.items():
        (ev / f"node0_{lines[0]['pid']}_{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _written_after(rec: list, cut_us: int) -> bool:
    """A record that ends (a span) or happens (a step mark) after ``cut_us``."""
    if type(rec[0]) is int:
        return rec[0] + rec[1] > cut_us
    return rec[0] == "S" and rec[1] > cut_us


def write_metrics(run_dir: Path, steps: int, sources: list[dict], values: Callable[[dict, int], dict],
                  missing: Callable[[int], list] | None = None, wall: Callable[[int], float] | None = None) -> None:
    """``metrics.jsonl``: per step, one per_rank_reduce row per source (``values(source, step)``,
    skipped when empty) and the global row (mean over the sources that reported the key).
    ``wall(step)``: the step's wall time (default: one second per step)."""
    rows = []
    for step in range(steps):
        t = wall(step) if wall is not None else START + step
        acc: dict[str, list] = {}
        per = []
        for src in sources:
            v = values(src, step)
            if not v:
                continue
            per.append({"run_id": "t", "step": step, "mode": "per_rank_reduce", "wall_time": t,
                        "source": src, "metrics": v})
            for k, x in v.items():
                acc.setdefault(k, []).append(x)
        g = {k: (math.nan if any(isinstance(x, float) and math.isnan(x) for x in xs) else sum(xs) / len(xs))
             for k, xs in acc.items()}
        row: dict[str, Any] = {"run_id": "t", "step": step, "mode": "global_reduce", "wall_time": t,
                               "metrics": g}
        m = missing(step) if missing else []
        if m:
            row["missing"] = m
        rows.append(row)
        rows.extend(per)
    with open(Path(run_dir) / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def source(mesh: str, rank: int, actor: str = "", pid: int = 0) -> dict:
    label = f"{mesh}/{actor}/r{rank}" if actor else f"{mesh}/r{rank}"
    return {"host": "node0", "pid": pid or 200 + rank, "mesh": mesh, "actor": actor, "rank": rank,
            "coords": {"procs": rank}, "world_size": 0, "label": label}


class BusyDP:
    """A 2-rank data-parallel trainer on a host shared with other jobs, shaped after the GRPO
    app's clean runs (2 cores, load 4-10): each rank's ``forward_backward`` takes 40-64 ms (its
    shard); every 45-130 steps, for 5-12 steps, one rank runs at 0.4-0.7x and the other at
    1.0-1.3x (the scheduler favours one); a rank is descheduled for 40-140 ms at 4 % of its steps;
    the rank that arrives first waits in ``grad_allreduce`` for the other (+2-10 ms). Planted:
    ``slow_rank`` takes ``slow_s`` longer from ``slow_from``; ``extra[(rank, step)] = s`` adds ``s``
    to one rank's step (a busy host); ``quick_at_end``: rank 0 is the favoured one for that many
    last steps."""

    def __init__(self, steps: int, seed: int = 0, *, slow_rank: int | None = None, slow_from: int = 0,
                 slow_s: float = 0.5, extra: dict | None = None, quick_at_end: int = 0, starve: dict | None = None,
                 spell: dict | None = None, cpu_fault: dict | None = None) -> None:
        rnd = random.Random(seed)
        self.fb = {(r, s): rnd.uniform(0.040, 0.064) for r in (0, 1) for s in range(steps)}
        self.work = {k: 0.6 * v for k, v in self.fb.items()}  # its CPU time; the rest: waiting for a CPU
        self.sleep = {(slow_rank, s): slow_s for s in range(slow_from, steps)} if slow_rank is not None else {}
        s = rnd.randrange(10, 60)
        while s < steps:
            r, n = rnd.randrange(2), rnd.randrange(5, 13)
            self._favour(rnd, r, range(s, min(s + n, steps)))
            s += n + rnd.randrange(40, 120)
        self._favour(rnd, 0, range(max(0, steps - quick_at_end), steps))
        for key in self.fb:
            if rnd.random() < 0.04:
                self.fb[key] += rnd.uniform(0.04, 0.14)
            if slow_rank == key[0] and key[1] >= slow_from:
                self.fb[key] += slow_s
        for key, sec in (extra or {}).items():
            self.fb[key] += sec
        self.tail = {(r, s): rnd.uniform(0.002, 0.010) for r in (0, 1) for s in range(steps)}
        self.opt = {(r, s): rnd.uniform(0.008, 0.012) for r in (0, 1) for s in range(steps)}
        self.spell = dict(spell or {})
        for key, factor in (starve or {}).items():  # the rank waits for a CPU: wall x factor, same work
            self.fb[key] *= factor
        for (r, st), factor in [((r, st), f) for st, f in self.spell.items() for r in (0, 1) if st < steps]:
            self.fb[(r, st)] *= factor  # the host's spell: every rank waits for a CPU
        for key, factor in (cpu_fault or {}).items():  # more work: wall and CPU time x factor
            self.fb[key] += self.work[key] * (factor - 1)
            self.work[key] *= factor

    def _favour(self, rnd: random.Random, rank: int, steps: range) -> None:
        for k in steps:
            self.fb[(rank, k)] *= rnd.uniform(0.4, 0.7)
            self.fb[(1 - rank, k)] *= rnd.uniform(1.0, 1.3)

    def wait_s(self, rank: int, step: int) -> float:
        return max(self.fb[(0, step)], self.fb[(1, step)]) - self.fb[(rank, step)] + self.tail[(rank, step)]

    def spans(self, mesh: str, rank: int, step: int) -> list:
        return [("batch_creation", 0.0005), ("forward_backward", self.fb[(rank, step)]),
                ("grad_allreduce", self.wait_s(rank, step)), ("optimizer_step", self.opt[(rank, step)])]

    def step_s(self, step: int) -> float:
        return max(sum(d for _n, d in self.spans("trainer", r, step)) for r in (0, 1)) + 0.06

    def spans_cpu(self, mesh: str, rank: int, step: int) -> list:
        """:meth:`spans` with their CPU time: ``forward_backward`` computes for ``work`` and waits
        for a CPU the rest (a planted sleep: neither), the all-reduce waits, the optimizer computes."""
        k = (rank, step)
        return [("batch_creation", 0.0005, 0.0004), ("forward_backward", self.fb[k], self.work[k]),
                ("grad_allreduce", self.wait_s(rank, step), 0.0002), ("optimizer_step", self.opt[k], 0.9 * self.opt[k])]

    def runq_s(self, rank: int, step: int) -> float:
        """The time rank ``rank``'s process waited for a CPU at ``step``: its forward-backward's wall
        time beyond its work and any planted sleep, and a tenth of its optimizer step."""
        k = (rank, step)
        return max(self.fb[k] - self.work[k] - self.sleep.get(k, 0.0), 0.0) + 0.1 * self.opt[k]

    def telemetry(self, rank: int, step: int) -> dict:
        """The rank process's ``obs/sys/proc/...`` values at ``step`` (as the fetcher samples them)."""
        k = (rank, step)
        return proc_telemetry(self.step_s(step), self.work[k] + 0.9 * self.opt[k] + 0.001, self.runq_s(rank, step))

    def metrics(self, rank: int, step: int) -> dict:
        """The rank's duration metrics at ``step``, as the GRPO trainer records them."""
        d = dict(self.spans("trainer", rank, step))
        return {"span/batch_creation/duration_s": d["batch_creation"],
                "span/forward_backward/duration_s": d["forward_backward"],
                "trainer/step_s": sum(d.values()), "trainer/idle_s": 0.06}


def proc_telemetry(interval_s: float, cpu_s: float, runq_s: float, rss_gb: float = 1.5, threads: int = 12) -> dict:
    """A process's ``obs/sys/proc/...`` values of one sample (docs/telemetry.md)."""
    return {"obs/sys/proc/interval_s": interval_s, "obs/sys/proc/cpu_s": cpu_s,
            "obs/sys/proc/cpu_util": cpu_s / interval_s,
            "obs/sys/proc/runq_wait_s": runq_s, "obs/sys/proc/runq_wait_share": runq_s / interval_s,
            "obs/sys/proc/rss_gb": rss_gb, "obs/sys/proc/threads": float(threads),
            "obs/sys/proc/ctx_voluntary": 40.0, "obs/sys/proc/ctx_involuntary": 5.0 + 200 * runq_s}


def host_telemetry(runnable_per_core: float, cpu_pressure: float, steal: float = 0.0, cores: int = 2) -> dict:
    """The host reader's ``obs/sys/host/...`` values of one sample."""
    return {"obs/sys/host/cores": float(cores), "obs/sys/host/runnable": runnable_per_core * cores,
            "obs/sys/host/runnable_per_core": runnable_per_core, "obs/sys/host/load1": runnable_per_core * cores,
            "obs/sys/host/cpu_util": min(1.0, 0.5 + cpu_pressure), "obs/sys/host/steal_share": steal,
            "obs/sys/host/cpu_pressure": cpu_pressure, "obs/sys/host/memory_pressure": 0.0,
            "obs/sys/host/memory_full_pressure": 0.0, "obs/sys/host/io_pressure": 0.01}


#: the timeline's pids of write_timeline({"trainer": 2}, ...) and its controller's
TRAINER_PID = {0: 101, 1: 102}
CONTROLLER_SOURCE = {"host": "node0", "pid": 1, "mesh": "controller", "actor": "", "rank": 0, "ctl": True,
                     "label": "controller"}


_COUNTERS = ("obs/sys/proc/interval_s", "obs/sys/proc/cpu_s", "obs/sys/proc/runq_wait_s",
             "obs/sys/proc/ctx_voluntary", "obs/sys/proc/ctx_involuntary")
_SHARES = ("obs/sys/host/cpu_util", "obs/sys/host/steal_share", "obs/sys/host/cpu_pressure",
           "obs/sys/host/memory_pressure", "obs/sys/host/memory_full_pressure", "obs/sys/host/io_pressure")


def covering_sample(per_step: list[dict]) -> dict:
    """One sample that covers the steps of ``per_step`` (each step's figures, oldest first), as a
    process that samples every few steps records it at the last of them: counters summed, shares
    of the interval weighted by each step's time, gauges at the sample."""
    out = dict(per_step[-1])
    walls = [d.get("obs/sys/proc/interval_s", 0.0) for d in per_step]
    for k in _COUNTERS:
        if k in out:
            out[k] = sum(d[k] for d in per_step)
    for k in _SHARES:
        if k in out:
            out[k] = sum(d[k] * w for d, w in zip(per_step, walls)) / sum(walls)
    iv = out["obs/sys/proc/interval_s"]
    out["obs/sys/proc/cpu_util"] = out["obs/sys/proc/cpu_s"] / iv
    out["obs/sys/proc/runq_wait_share"] = out["obs/sys/proc/runq_wait_s"] / iv
    return out


def write_busy_run(run_dir: Path, dp: BusyDP, steps: int, *, busy: Callable[[int], bool] = lambda s: True,
                   telemetry: bool = True, seed: int = 1, sample_every: int = 1) -> None:
    """A 2-rank data-parallel run of ``dp`` (its spans with their CPU time, its controller) and its
    ``metrics.jsonl``: per rank the GRPO trainer's duration metrics, and with ``telemetry`` the
    processes' and the host's samples (``busy(step)``: the host shared with other jobs then:
    3-7 runnable tasks per core, tasks waiting for a CPU 40-90 % of the time; else 0.5-1.0 and
    0-5 %); a global ``trainer/tokens_per_s``. ``sample_every``: every process samples at the
    steps that are multiples of it (docs/telemetry.md: a stride), each sample covering the
    steps since the previous one; the other steps carry no telemetry."""
    write_timeline(run_dir, {"trainer": 2}, steps, dp.spans_cpu)
    rnd = random.Random(seed)
    host = {s: (rnd.uniform(3.0, 7.0), rnd.uniform(0.4, 0.9)) if busy(s)
            else (rnd.uniform(0.5, 1.0), rnd.uniform(0.0, 0.05)) for s in range(steps)}
    srcs = [source("trainer", r, "Trainer", TRAINER_PID[r]) for r in (0, 1)] + [CONTROLLER_SOURCE]

    def sampled(src: dict, step: int) -> dict:
        if src.get("ctl"):
            return proc_telemetry(dp.step_s(step), 0.004, 0.002 + 0.003 * host[step][1])
        tel = dp.telemetry(src["rank"], step)
        return {**tel, **host_telemetry(*host[step])} if src["rank"] == 0 else tel

    def values(src: dict, step: int) -> dict:
        tel: dict = {}
        if telemetry and step % sample_every == 0:
            tel = covering_sample([sampled(src, s) for s in range(max(0, step - sample_every + 1), step + 1)])
        if src.get("ctl"):
            return {"trainer/tokens_per_s": 2000.0 / dp.step_s(step), **tel}
        return {**dp.metrics(src["rank"], step), **tel}

    walls = [START]
    for step in range(steps):
        walls.append(walls[-1] + dp.step_s(step))
    write_metrics(run_dir, steps, srcs, values, wall=lambda step: walls[step + 1])
