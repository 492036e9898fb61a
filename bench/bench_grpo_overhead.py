"""Overhead of forge_obs on a real GRPO run, measured three ways in the same benchmark run.

1. **A/B**: the same run (apps/grpo, same seed and config) with observability on, and with
   ``FORGE_DISABLE_METRICS=true``, in separate processes on the same machine, alternating.
   Reports the median controller step time (one policy update: wait for a batch, train on every
   rank, publish weights, flush) after the warm-up steps, and the ratio. On a shared 2-core VM
   the same work costs 10-20 % more or less from run to run, so this cannot resolve 1 % (3 can); the
   mean of the per-pair ratios comes with its 95 % confidence interval (Student's t). The same
   pairs are also compared in CPU time: the CPU seconds (user + system, from /proc) of the app's
   process and every process below it, per measured step, on minus off, with its interval and
   as a share of the machine.
2. **Accounted**: what forge_obs itself spent per step in the "on" runs, from the run's own
   self-observation: ``obs/cpu_s`` (CPU of fetcher exports, the controller's flush / inbox /
   merge / backends, the timeline writer threads, all processes, measured with thread CPU
   clocks), plus inline work counted in the run and priced here: ``record_metric`` calls
   (``obs/values_recorded``) x the cost of one call, spans/events in the timeline x the cost of
   one, and the receiving side of the flush request each rank gets per step (an actor endpoint
   message, measured here; its sending side is in ``obs/cpu_flush_s``; both sides of the states'
   message are in ``obs/cpu_export_s`` and ``obs/cpu_inbox_s``, which counts all of the inbox
   thread's CPU).
   Reported as a share of the machine's CPU per step (cores x step time: the slowdown of a
   CPU-bound run) and of one core.
3. **On and off together** (the A/B that resolves): ``--together-pairs`` pairs of an "on" and
   an "off" run started at the same moment, so that both meet the same machine (its speed
   drifts by 10-20 % between runs here, which is what drowns the A/B above), each with
   ``--rollout-lead 0`` so that every step does the same work (one batch of rollouts, one
   update) whatever the step takes. Compared: the CPU seconds of all of each run's processes
   per measured step, and of its controller process; on - off per pair with its 95 % interval,
   as a share of the off runs' CPU per step (what a CPU-bound run slows down by), beside what
   the on run accounted for itself (2). ``--aa-pairs`` pairs of two "on" runs show the method's
   own spread, and ``--ablate VAR=VALUE`` pairs an "on" run with one that has ``VAR=VALUE``
   (``FORGE_DISABLE_TIMELINE=true``: what the timeline costs).
4. **The cut against a raw round trip**: ``--probe-runs`` more "on" runs with
   ``FORGE_OBS_PROBE_ROUND_TRIP=1``, where each flush first times a no-op endpoint call to the
   same ranks from the same controller process; the table gives, per step, the cut's wait, that
   raw round trip, their ratio and the cut's parts (``obs/cut/...``). Not part of the A/B (the
   probe adds its round trip to each step).

    python bench/bench_grpo_overhead.py                  # 3 runs each, 80 steps, vLLM when installed
    python bench/bench_grpo_overhead.py --runs 2 --steps 40 --generator torch
    python bench/bench_grpo_overhead.py --runs 3 --steps 40 --generator torch --probe-runs 1
    python bench/bench_grpo_overhead.py --runs 2 --steps 40 --generator torch --together-pairs 4

Prints tables and writes bench/results/grpo_overhead.json. Figures, never timed asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers
from _timing import pair_interval, percentile, proc_stat  # noqa: E402  (bench/, beside this script)
from forge_obs.core.env import local_socket_enabled  # noqa: E402
from forge_obs.core.selfobs import CPU_PARTS  # noqa: E402
os.environ.setdefault("MONARCH_FILE_LOG", "error")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p)


def one_run(disabled: bool, args: argparse.Namespace, root: str, i: int | str, probe: bool = False,
            lead: int | None = None, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), MONARCH_FILE_LOG="error", **(extra_env or {}))
    env.pop("FORGE_DISABLE_METRICS", None)
    env.pop("FORGE_OBS_PROBE_ROUND_TRIP", None)
    if disabled:
        env["FORGE_DISABLE_METRICS"] = "true"
    if probe:
        env["FORGE_OBS_PROBE_ROUND_TRIP"] = "1"
    run_id = f"{'probe' if probe else 'off' if disabled else 'on'}{i}"
    cmd = [sys.executable, "-m", "apps.grpo.main", "--steps", str(args.steps), "--seed", "0", "--no-report",
           "--generator", args.generator, "--run-root", root, "--run-id", run_id, "--console-every", "1000000"]
    lead = args.rollout_lead if lead is None else lead
    if lead is not None:
        cmd += ["--rollout-lead", str(lead)]
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        with CpuSampler(proc.pid) as sampler:
            returncode = proc.wait()
        if returncode != 0:
            out.seek(0), err.seek(0)
            raise SystemExit(f"run failed:\n{out.read()[-3000:]}\n{err.read()[-3000:]}")
    summary = json.loads((Path(root) / run_id / "grpo_summary.json").read_text())
    steps = summary["step_s"][args.warmup:]
    out = {"obs": not disabled, "run_id": run_id, "generator": summary["generator"], "wall_s": time.time() - t0,
           "step_s_median": statistics.median(steps), "step_s_mean": statistics.fmean(steps),
           "train_loop_s": sum(summary["step_s"]), "steps": len(summary["step_s"])}
    ends = summary.get("step_end_wall") or []
    if len(ends) > args.warmup:
        first = ends[args.warmup - 1] if args.warmup else ends[0]
        out["machine_busy"] = sampler.busy_between(first, ends[-1])
        c0, c1 = sampler.tree_cpu_at(first), sampler.tree_cpu_at(ends[-1])
        if c0 is not None and c1 is not None:  # CPU of all the run's processes per measured step
            n = len(ends) - max(args.warmup, 1)
            out["cpu_s_per_step"] = (c1[0] - c0[0]) / n
            out["controller_cpu_s_per_step"] = (c1[1] - c0[1]) / n
    if probe:
        out["cut"] = cut_parts(Path(root) / run_id, args.warmup)
    elif not disabled:
        out["accounted"] = run_counts(Path(root) / run_id, args.warmup)
    return out


def cut_parts(run_dir: Path, warmup: int) -> dict:
    """Per step after the warm-up: the raw round trip to every rank measured right before the
    cut (``probe_round_trip``) and the cut's parts (``obs/cut/...``)."""
    from forge_obs.analysis.store import read_metrics
    from forge_obs.controller.cut_timing import KEYS

    rows = [r["metrics"] for r in read_metrics(run_dir, "global_reduce") if r["step"] >= warmup]
    rows = [m for m in rows if m.get("obs/raw_round_trip_s")]
    out = {k: [m[k] for m in rows if k in m] for k in KEYS}
    out["ratio"] = [m["obs/cut/blocked_s"] / m["obs/raw_round_trip_s"] for m in rows]
    return out


def print_cut_table(probes: list[dict]) -> dict:
    """The cut against the raw round trip, interleaved in the same runs, and where the cut's
    time went (medians over every measured step of the probe runs)."""
    keys = list(probes[0]["cut"])
    pooled = {k: [x for r in probes for x in r["cut"][k]] for k in keys}
    raw, cut = pooled["obs/raw_round_trip_s"], pooled["obs/cut/blocked_s"]
    print(f"\nThe cut in the app vs a raw no-op round trip to the same ranks, right before it "
          f"({len(raw)} steps of {len(probes)} run(s) with probe_round_trip)")
    print("| figure | median | p90 | target |\n|---|---|---|---|")
    print(f"| raw round trip (no-op endpoint, every mesh at once) | {statistics.median(raw) * 1e3:.2f} ms | {percentile(raw, 0.9) * 1e3:.2f} ms | |")
    print(f"| cut, caller blocked | {statistics.median(cut) * 1e3:.2f} ms | {percentile(cut, 0.9) * 1e3:.2f} ms | |")
    print(f"| cut / raw round trip, per step | {statistics.median(pooled['ratio']):.2f}x | {percentile(pooled['ratio'], 0.9):.2f}x | <= 1.3x |")
    names = {"obs/cut/send_s": "send (cast to every mesh)", "obs/cut/to_rank_s": "to the closing rank (queueing, flight)",
             "obs/cut/rank_s": "rank side (swap, ack)", "obs/cut/ack_s": "ack delivery (flight, controller runtime, inbox)",
             "obs/cut/resume_s": "inbox hop and the caller's resumption", "obs/cut/transit_s": "both flights (to_rank + ack)"}
    for k, name in names.items():
        if pooled.get(k):
            print(f"| cut part: {name} | {statistics.median(pooled[k]) * 1e3:.2f} ms | {percentile(pooled[k], 0.9) * 1e3:.2f} ms | |")
    return {"raw_round_trip_s_median": statistics.median(raw), "cut_blocked_s_median": statistics.median(cut),
            "ratio_median": statistics.median(pooled["ratio"]),
            "parts_median_s": {k: statistics.median(v) for k, v in pooled.items() if v and k.startswith("obs/cut/")}}


class CpuSampler:
    """Samples, ten times a second while a run goes on, how busy the machine was (/proc/stat)
    and the CPU seconds (user + system) that the run's processes have used: the app's process
    and every process below it (its Monarch procs), read from /proc/<pid>/stat."""

    PERIOD_S = 0.1
    #: every this many samples all of /proc is scanned for the run's processes; in between only
    #: theirs are read (the procs are spawned before the measured steps begin)
    RESCAN_EVERY = 10

    def __init__(self, root_pid: int | None = None) -> None:
        import threading

        self.root_pid = root_pid
        # (wall time, idle+iowait jiffies, total jiffies, CPU seconds of the run's processes, of
        # its root process)
        self.samples: list[tuple[float, int, int, float, float]] = []
        self._tree: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scan(self) -> list[int]:
        """``root_pid`` and its descendants alive now."""
        parent = {}
        for d in os.listdir("/proc"):
            st = proc_stat(int(d)) if d.isdigit() else None
            if st is not None:
                parent[int(d)] = st[0]
        tree = {self.root_pid}
        for pid in parent:  # walk up from each process: its ancestors' pids may be larger
            p, seen = pid, 0
            while p not in tree and p in parent and seen < 64:
                p, seen = parent[p], seen + 1
            if p in tree:
                tree.add(pid)
        return sorted(tree)

    def _tree_cpu_s(self) -> tuple[float, float]:
        """CPU seconds of ``root_pid`` and its descendants alive now, and of ``root_pid``."""
        if self.root_pid is None:
            return 0.0, 0.0
        if len(self.samples) % self.RESCAN_EVERY == 0:
            self._tree = self._scan()
        cpu = {pid: st[1] for pid, st in ((pid, proc_stat(pid)) for pid in self._tree) if st is not None}
        return sum(cpu.values()), cpu.get(self.root_pid, 0.0)

    def _run(self) -> None:
        while True:
            try:
                with open("/proc/stat") as f:
                    vals = [int(x) for x in f.readline().split()[1:]]
                self.samples.append((time.time(), vals[3] + vals[4], sum(vals), *self._tree_cpu_s()))
            except (OSError, ValueError, IndexError):
                return
            if self._stop.wait(self.PERIOD_S):
                return

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy_between(self, t0: float, t1: float) -> float | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (_, i0, a0, *_), (_, i1, a1, *_) = inside[0], inside[-1]
        return 1.0 - (i1 - i0) / (a1 - a0) if a1 > a0 else None

    def tree_cpu_at(self, t: float) -> tuple[float, float] | None:
        """The CPU seconds of the run's processes, and of its root process, at wall time ``t``,
        interpolated between samples."""
        for a, b in zip(self.samples, self.samples[1:]):
            if a[0] <= t <= b[0]:
                w = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 0.0
                return a[3] + (b[3] - a[3]) * w, a[4] + (b[4] - a[4]) * w
        return None


def run_counts(run_dir: Path, warmup: int) -> dict:
    """Per-step means, after the warm-up, of what forge_obs did in this run (its own metrics and
    timeline)."""
    from forge_obs.analysis import reader
    from forge_obs.analysis.store import read_metrics

    rows = [r["metrics"] for r in read_metrics(run_dir, "global_reduce") if r["step"] >= warmup]
    mean = lambda k: statistics.fmean(m.get(k, 0.0) for m in rows)  # noqa: E731
    records = 0
    for it in reader.walk(reader.scan(run_dir)):
        if it[0] in (reader.SPAN, reader.INSTANT, reader.OPEN):
            records += 1
    n_steps = max(len(read_metrics(run_dir, "global_reduce")), 1)
    return {
        "obs_cpu_s": mean("obs/cpu_s"),
        **{f"cpu_{part}_s": mean(f"obs/cpu_{part}_s") for part in CPU_PARTS},
        "values_recorded": mean("obs/values_recorded"),
        "ranks_reported": mean("obs/ranks_reported"),
        "flush_blocked_s_median": statistics.median(m.get("obs/cut/blocked_s", m.get("obs/flush_blocked_s", 0.0)) for m in rows),
        "timeline_records_per_step": records / n_steps,
    }


# ------------------------------------------------------------------ unit costs, measured here
def unit_costs() -> dict:
    """CPU of one record_metric, one span (with extras, inline part), one Monarch port message."""
    import timeit

    setup = "from forge_obs import record_metric, Reduce"
    rec = min(timeit.repeat("record_metric('trainer/loss', 0.5, Reduce.MEAN)", setup=setup, number=200_000, repeat=5)) / 200_000
    from forge_obs.recording import timeline as tl

    with tempfile.TemporaryDirectory() as d:
        tl.configure(d, flush_interval_s=3600.0)  # the writer's own work is in obs/cpu_timeline_s
        span_setup = "from forge_obs.recording.timeline import record_span"
        stmt = "with record_span('generate', flow='episode-1', replica=0):\n    pass"
        span = min(timeit.repeat(stmt, setup=span_setup, number=20_000, repeat=5)) / 20_000
        tl.close()
    return {"record_metric_s": rec, "span_s": span, **_message_costs()}


def _message_costs(n: int = 2000) -> dict:
    """CPU of one flush request (an actor endpoint message) at each end, idle burn subtracted."""
    import asyncio

    from monarch.actor import Actor, endpoint, this_host

    class Sink(Actor):
        def __init__(self) -> None:
            self.n = 0

        @endpoint
        async def flush(self, step: int) -> None:  # what a fetcher's flush request costs to take
            self.n += 1

        @endpoint
        async def cpu(self) -> tuple:
            return time.process_time(), self.n

    async def run() -> dict:
        pm = this_host().spawn_procs(per_host={"procs": 1}, name="msgcost")
        sink = pm.spawn("sink", Sink)
        c0, (k0, _) = time.process_time(), await sink.cpu.call_one()
        t0 = time.perf_counter()
        for _ in range(n):
            sink.flush.broadcast(7)
        while (await sink.cpu.call_one())[1] < n:
            await asyncio.sleep(0.05)  # few polls: each is a round trip of its own
        elapsed = time.perf_counter() - t0
        c1, (k1, _) = time.process_time(), await sink.cpu.call_one()
        await asyncio.sleep(elapsed)  # idle baseline over the same time: what both processes burn anyway
        c2, (k2, _) = time.process_time(), await sink.cpu.call_one()
        await pm.stop()
        return {"message_endpoint_send_s": max((c1 - c0) - (c2 - c1), 0.0) / n,
                "message_endpoint_recv_s": max((k1 - k0) - (k2 - k1), 0.0) / n}

    return asyncio.run(run())


def cpu_pairs(rows: list[dict], med_on: float) -> dict | None:
    """The A/B in CPU time: CPU seconds of all the run's processes per measured step, on minus
    off for each pair of runs, its mean with a 95 % interval, and that as a share of the
    machine's CPU per step (cores x the median step of the 'on' runs)."""
    on = [r.get("cpu_s_per_step") for r in rows if r["obs"]]
    off = [r.get("cpu_s_per_step") for r in rows if not r["obs"]]
    diffs = [a - b for a, b in zip(on, off) if a is not None and b is not None]
    if not diffs:
        return None
    mean, lo, hi = pair_interval(diffs)
    machine = (os.cpu_count() or 1) * med_on
    print(f"  CPU of all the run's processes per step: on {', '.join(f'{x * 1e3:.1f}' for x in on if x is not None)} ms; "
          f"off {', '.join(f'{x * 1e3:.1f}' for x in off if x is not None)} ms")
    print(f"  on - off per pair: {', '.join(f'{d * 1e3:+.2f}' for d in diffs)} ms; mean {mean * 1e3:+.2f} ms, "
          f"95 % CI [{lo * 1e3:+.2f}, {hi * 1e3:+.2f}] ms = {100 * mean / machine:+.2f} % of the machine "
          f"[{100 * lo / machine:+.2f}, {100 * hi / machine:+.2f}] %")
    return {"on_s": on, "off_s": off, "diff_s": diffs, "mean_s": mean, "ci95_s": [lo, hi],
            "machine_share": mean / machine, "machine_share_ci95": [lo / machine, hi / machine]}


def together(args: argparse.Namespace, root: str, tag: str, settings: tuple[bool, bool],
             extra_env: tuple[dict | None, dict | None] = (None, None), first: int = 0) -> list[dict]:
    """Two runs started at the same moment (``settings``: disabled or not, for each; each with
    its ``extra_env``), each with ``--rollout-lead`` ``args.concurrent_lead``: both see the same
    machine, for the same time. Run ``first`` is started first (callers alternate it: the run
    started second was seen to pay for it, by up to several ms of CPU per step)."""
    import threading

    out: list = [None, None]
    errors: list[str] = []

    def go(k: int) -> None:
        try:
            out[k] = one_run(settings[k], args, root, f"{tag}{'ab'[k]}", lead=args.concurrent_lead, extra_env=extra_env[k])
        except BaseException as e:  # noqa: BLE001 - a thread swallows SystemExit: report it here
            errors.append(f"{tag}{'ab'[k]}: {e}")

    threads = [threading.Thread(target=go, args=(k,)) for k in (first, 1 - first)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return out


def paired(pairs: list[list[dict]]) -> dict:
    """a - b per pair of runs in CPU seconds per measured step, of all processes and of the
    controller process, each with its mean and 95 % interval."""
    out = {}
    for name, key in (("", "cpu_s_per_step"), ("controller_", "controller_cpu_s_per_step")):
        diffs = [a[key] - b[key] for a, b in pairs]
        mean, lo, hi = pair_interval(diffs) if diffs else (float("nan"),) * 3
        out.update({f"{name}diff_s": diffs, f"{name}mean_s": mean, f"{name}ci95_s": [lo, hi]})
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:+.1f}"


def print_together(pairs: list[list[dict]], aa: list[list[dict]], lead: int) -> dict:
    """The A/B in CPU time with each on/off pair running together: on - off CPU of all the
    run's processes (and of the controller's) per measured step, with its 95 % interval, beside
    what the on run accounted for itself; A/A pairs (both on) show the method's own spread."""
    print(f"\nThe A/B in CPU time, each on/off pair started together (--rollout-lead {lead}: every step "
          f"generates one batch and trains on it); CPU per measured step, ms")
    print("| pair | on: all processes (controller) | off: all processes (controller) | on - off: all (controller) "
          "| accounted in the on run |\n|---|---|---|---|---|")
    d = paired(pairs)
    acc = [on["accounted"]["obs_cpu_s"] for on, _off in pairs]
    for i, (on, off) in enumerate(pairs):
        print(f"| {i} | {on['cpu_s_per_step'] * 1e3:.1f} ({on['controller_cpu_s_per_step'] * 1e3:.1f}) | "
              f"{off['cpu_s_per_step'] * 1e3:.1f} ({off['controller_cpu_s_per_step'] * 1e3:.1f}) | "
              f"{_ms(d['diff_s'][i])} ({_ms(d['controller_diff_s'][i])}) | {acc[i] * 1e3:.1f} |")
    (lo, hi), (clo, chi) = d["ci95_s"], d["controller_ci95_s"]
    base = statistics.fmean(off["cpu_s_per_step"] for _on, off in pairs)
    print(f"| **mean [95 % CI]** | | | **{_ms(d['mean_s'])} [{_ms(lo)}, {_ms(hi)}]** "
          f"({_ms(d['controller_mean_s'])} [{_ms(clo)}, {_ms(chi)}]) | {statistics.fmean(acc) * 1e3:.1f} |")
    print(f"| **share of the off runs' CPU per step (target < 1 %)** | | | **{100 * d['mean_s'] / base:+.2f} % "
          f"[{100 * lo / base:+.2f}, {100 * hi / base:+.2f}]** | |")
    aa_diffs = paired(aa)["diff_s"]
    if aa_diffs:
        print(f"| A/A (both on), a - b | | | {', '.join(_ms(x) for x in aa_diffs)} | |")
    return {"lead": lead, "pairs": [[on, off] for on, off in pairs], **d, "accounted_s": acc,
            "off_cpu_s_per_step": base, "share": d["mean_s"] / base, "share_ci95": [lo / base, hi / base],
            "aa_diff_s": aa_diffs}


def print_ablations(ablations: dict[str, list[list[dict]]]) -> dict:
    """What one part costs: pairs run together of an "on" run and an "on" run with ``VAR=VALUE``
    (e.g. ``FORGE_DISABLE_TIMELINE=true``); on - ablated CPU per measured step, 95 % interval."""
    out = {}
    for setting, pairs in ablations.items():
        d = out[setting] = paired(pairs)
        (lo, hi), (clo, chi) = d["ci95_s"], d["controller_ci95_s"]
        print(f"| on - on with {setting} | {', '.join(_ms(x) for x in d['diff_s'])} ms | "
              f"mean {_ms(d['mean_s'])} [{_ms(lo)}, {_ms(hi)}] ms | "
              f"controller {_ms(d['controller_mean_s'])} [{_ms(clo)}, {_ms(chi)}] ms |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per setting (alternating on/off)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    ap.add_argument("--generator", default="auto")
    ap.add_argument("--probe-runs", type=int, default=1,
                    help="extra runs with probe_round_trip: the cut against a raw round trip (not in the A/B)")
    ap.add_argument("--rollout-lead", type=int, default=None,
                    help="the app's --rollout-lead: rollouts for at most this many batches ahead of training")
    ap.add_argument("--together-pairs", type=int, default=3,
                    help="on/off pairs run at the same time: the A/B in CPU time that resolves")
    ap.add_argument("--aa-pairs", type=int, default=1, help="pairs of 'on' runs run at the same time (A/A)")
    ap.add_argument("--ablate", action="append", default=[], metavar="VAR=VALUE",
                    help="also pairs run together of an 'on' run and one with this environment variable "
                         "(e.g. FORGE_DISABLE_TIMELINE=true): what that part costs (repeatable)")
    ap.add_argument("--ablate-pairs", type=int, default=3, help="pairs per --ablate setting")
    ap.add_argument("--concurrent-lead", type=int, default=0,
                    help="the app's --rollout-lead in the pairs run together (fixed work per step)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpo_overhead.json"))
    args = ap.parse_args()
    for setting in args.ablate:
        if "=" not in setting or not setting.split("=", 1)[0]:
            ap.error(f"--ablate takes VAR=VALUE (e.g. FORGE_DISABLE_TIMELINE=true), not {setting!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as root:
        for i in range(args.runs):
            for disabled in (False, True) if i % 2 == 0 else (True, False):
                r = one_run(disabled, args, root, i)
                rows.append(r)
                print(f"  run {r['run_id']:>5}: median step {r['step_s_median'] * 1e3:7.1f} ms  "
                      f"mean {r['step_s_mean'] * 1e3:7.1f} ms  ({r['wall_s']:.0f}s wall)", flush=True)
        probes = [one_run(False, args, root, i, probe=True) for i in range(args.probe_runs)]
        both = [together(args, root, f"t{i}", (False, True), first=i % 2) for i in range(args.together_pairs)]
        aa = [together(args, root, f"aa{i}", (False, False), first=i % 2) for i in range(args.aa_pairs)]
        ablations = {setting: [together(args, root, f"x{k}p{i}", (False, False), (None, dict([setting.split("=", 1)])),
                                        first=i % 2)
                               for i in range(args.ablate_pairs)] for k, setting in enumerate(args.ablate)}
    on = [r["step_s_median"] for r in rows if r["obs"]]
    off = [r["step_s_median"] for r in rows if not r["obs"]]
    med_on, med_off = statistics.median(on), statistics.median(off)
    ratio = med_on / med_off
    print()
    print(f"GRPO step time, {rows[0]['generator']} generator, {args.steps} steps x {args.runs} runs each "
          f"(first {args.warmup} steps left out), {os.cpu_count()} cores")
    print(f"  {'setting':<34}{'median step (ms)':>18}{'runs (ms)':>30}")
    print(f"  {'observability on':<34}{med_on * 1e3:>18.1f}{', '.join(f'{x * 1e3:.0f}' for x in on):>30}")
    print(f"  {'FORGE_DISABLE_METRICS=true':<34}{med_off * 1e3:>18.1f}{', '.join(f'{x * 1e3:.0f}' for x in off):>30}")
    pairs = [a["step_s_median"] / b["step_s_median"] for a, b in zip(
        [r for r in rows if r["obs"]], [r for r in rows if not r["obs"]])]
    mean_pair, lo, hi = pair_interval(pairs)
    print(f"  ratio on/off: {ratio:.3f}  (overhead {100 * (ratio - 1):+.1f} %); "
          f"per pair: {', '.join(f'{p:.3f}' for p in pairs)}; mean of pairs {mean_pair:.3f}, "
          f"95 % CI [{lo:.3f}, {hi:.3f}]")
    busy = [r["machine_busy"] for r in rows if r.get("machine_busy") is not None]
    if busy:
        print(f"  machine busy during the measured steps: {', '.join(f'{100 * b:.0f} %' for b in busy)}")
    cpu_ab = cpu_pairs(rows, med_on)

    costs = unit_costs()
    acc = {k: statistics.fmean(r["accounted"][k] for r in rows if r["obs"]) for k in rows[0]["accounted"]}
    cores = os.cpu_count() or 1
    parts = [
        ("forge_obs threads and exports (obs/cpu_s, all processes)", acc["obs_cpu_s"],
         " + ".join(f"{part} {acc['cpu_' + part + '_s'] * 1e3:.2f}" for part in CPU_PARTS) + " ms"),
        ("record_metric calls", acc["values_recorded"] * costs["record_metric_s"],
         f"{acc['values_recorded']:.0f} x {costs['record_metric_s'] * 1e6:.2f} us"),
        ("spans and events (inline part)", acc["timeline_records_per_step"] * costs["span_s"],
         f"{acc['timeline_records_per_step']:.1f} x {costs['span_s'] * 1e6:.2f} us"),
    ]
    if not local_socket_enabled():  # the app's ranks are on this host: on the socket a cut's receiving end is in obs/cpu_inbox_s
        parts.append(("flush requests, receiving end (Monarch endpoint message)",
                      acc["ranks_reported"] * costs["message_endpoint_recv_s"],
                      f"{acc['ranks_reported']:.0f} ranks x {costs['message_endpoint_recv_s'] * 1e6:.0f} us"))
    total = sum(p[1] for p in parts)
    machine_share = total / (cores * med_on)
    core_share = total / med_on
    crit_share = acc["flush_blocked_s_median"] / med_on
    print(f"\nAccounted: what forge_obs spends per step of the 'on' runs (median step {med_on * 1e3:.1f} ms, {cores} cores)")
    print("| part | CPU per step | how |\n|---|---|---|")
    for name, v, how in parts:
        print(f"| {name} | {v * 1e3:.2f} ms | {how} |")
    print(f"| **total** | **{total * 1e3:.2f} ms** | |")
    print(f"| share of the machine's CPU per step (target < 1 %) | **{100 * machine_share:.2f} %** | total / ({cores} cores x step) |")
    print(f"| share of one core | {100 * core_share:.2f} % | total / step |")
    print(f"| on the controller's critical path (flush blocked, median) | {acc['flush_blocked_s_median'] * 1e3:.2f} ms = {100 * crit_share:.2f} % | |")
    cut_table = print_cut_table(probes) if probes else None
    together_table = print_together(both, aa, args.concurrent_lead) if both else None
    if ablations:
        print("\nParts, each measured by pairs run together (CPU of all processes per measured step)")
        print("| setting | on - that, per pair | mean [95 % CI] | of it, the controller process |\n|---|---|---|---|")
    ablation_table = print_ablations(ablations)
    out = {"benchmark": "grpo_overhead", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
           "cores": os.cpu_count(), "steps": args.steps, "warmup": args.warmup, "runs": rows,
           "median_step_s_on": med_on, "median_step_s_off": med_off, "ratio": ratio, "pair_ratios": pairs,
           "overhead_pct": 100 * (ratio - 1), "unit_costs": costs, "accounted_per_step": acc,
           "accounted_total_s": total, "accounted_machine_share": machine_share, "accounted_core_share": core_share,
           "critical_path_share": crit_share, "pair_mean": mean_pair, "pair_ci95": [lo, hi], "cpu_ab": cpu_ab,
           "cut_vs_raw": cut_table, "together": together_table, "ablations": ablation_table,
           "probe_runs": probes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
