"""What telemetry costs a process per step (issue 39: ≤ 50 µs, off the training thread).

    python bench/bench_telemetry.py                 # table on stdout, JSON to bench/results/telemetry.json
    python bench/bench_telemetry.py --samples 2000

Measures, in this process, the CPU time (``time.thread_time``) of one telemetry sample
(:class:`forge_obs.recording.telemetry.sampler.Sampler.sample`, what a cut's export adds) for:

- a process that is not its host's reader (its own figures: ``getrusage``, ``statm``, the
  run-queue wait of its threads), with 10 and with 100 threads (a runtime's workers, a thread
  pool sized to a big host: the reads per sample are bounded, ``ThreadDelays.max_reads``);
- the host's reader (the same, plus ``/proc/loadavg``, ``/proc/stat``, PSI), one per host.

Then the cut back to back (warm caches): ``rank_cut.take`` (the swap, on the caller's thread: it
samples nothing) and the export of a 15-key cut, telemetry off (the baseline, same run), on with
a sample at every cut, and on with the defaults (a sample every few steps).

And the cost where an app pays it (``app_shaped``): a process with 80 threads, 12 of them waking
every few ms (a runtime's workers, torch's pools), a cut every 0.1 s after a step's work that
evicts the caches, exported on a thread of its own (the fetcher): the exporting thread's CPU
time per cut and the receiving side's merge per process, off and on in alternating phases of the
same run; the mean over every cut (those with a sample and those without) is the cost per step.
As its host's reader and not. Figures are medians / means over many cuts; the machine is shared,
so the run records ``uptime`` before and after. This measures; it asserts nothing.

    python bench/bench_telemetry.py --samples 500 --app-cuts 30 --app-rounds 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from _timing import percentile  # noqa: E402
from forge_obs.recording.collector import record_metric  # noqa: E402
from forge_obs.recording.reduce import Reduce  # noqa: E402
from forge_obs.recording.telemetry import sampler  # noqa: E402
from forge_obs.recording.telemetry.options import TelemetryOptions  # noqa: E402
from forge_obs.recording.telemetry.sampler import Sampler  # noqa: E402
from forge_obs.wire import rank_cut  # noqa: E402

TARGET_US = 50.0


def _cpu_us(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        fn()
        out.append((time.thread_time_ns() - t0) / 1e3)
    return out


def _summary(xs: list[float]) -> dict:
    return {"median_us": round(statistics.median(xs), 2), "mean_us": round(statistics.fmean(xs), 2),
            "p99_us": round(percentile(xs, 0.99), 2)}


def sample_cost(threads: int, reader: bool, n: int) -> dict:
    """One sample's CPU time in a process with ``threads`` threads; ``reader``: it reads the host too."""
    stop = threading.Event()
    extra = [threading.Thread(target=stop.wait, daemon=True) for _ in range(max(0, threads - threading.active_count()))]
    for t in extra:
        t.start()
    key = f"bench-{os.getpid()}-{threads}-{reader}"
    other = None if reader else Sampler(TelemetryOptions(gpu=False, interval_s=0.0), run_key=key)
    if other is not None:
        other.sample()  # it holds the host's lease: the measured sampler is not the reader
    s = Sampler(TelemetryOptions(gpu=False, interval_s=0.0), run_key=key)
    try:
        for _ in range(20):
            s.sample()
        is_reader = s.lease is not None and s.lease.sock is not None
        costs = _cpu_us(s.sample, n)
        return {"threads": len(os.listdir("/proc/self/task")), "host_reader": is_reader,
                "thread_reads_max": s.proc.delays.max_reads, **_summary(costs)}
    finally:
        s.close()
        if other is not None:
            other.close()
        stop.set()
        for t in extra:
            t.join()


#: telemetry settings the cut is measured with: off (the baseline), a sample at every cut (its
#: cost per sample), and the default (a sample every few steps: its cost per step)
MODES = {"off": False, "on, every cut": {"gpu": False, "interval_s": 0.0}, "on, default": {"gpu": False}}


def cut_cost(n: int, keys: int = 15) -> dict:
    """The caller's cut (take) and the export of a ``keys``-key cut, back to back (warm caches),
    for each of :data:`MODES`."""
    out = {}
    for mode, opts in MODES.items():
        sampler.configure(opts, f"bench-cut-{os.getpid()}")
        takes, exports = [], []
        for step in range(n):
            for k in range(keys):
                record_metric(f"bench/k{k}", float(step), Reduce.MEAN)
            t0 = time.thread_time_ns()
            taken = rank_cut.take(step)
            t1 = time.thread_time_ns()
            rank_cut.export(taken)
            t2 = time.thread_time_ns()
            del taken  # freed here, not inside the next timed take
            takes.append((t1 - t0) / 1e3)
            exports.append((t2 - t1) / 1e3)
        out[mode] = {"take": _summary(takes), "export": _summary(exports)}
    sampler.configure(False)
    return out


_SINK: list = []


def _busy_worker(stop: threading.Event, period_s: float) -> None:
    """A runtime's worker (Monarch's, torch's pools): wakes up every ``period_s``, works a little."""
    while not stop.wait(period_s):
        _SINK.append(sum(range(300)))
        if len(_SINK) > 1000:
            _SINK.clear()


def _step_work(buf: bytearray, junk: list) -> None:
    """A step's own work between two cuts: a sweep over ~48 MB (a copy between two halves of
    ``buf``) and Python objects, so that the export meets cold caches as in an app's process."""
    half = len(buf) // 2
    buf[:half] = buf[half:]
    n = 0
    for d in junk:
        for v in d.values():
            n += v
    _SINK.append(n)


def app_shaped(threads: int, busy: int, period_s: float, cuts: int, rounds: int, keys: int = 15,
               interval_s: float | None = None, reader: bool = False) -> dict:
    """The whole cost of telemetry per cut in a process shaped like an app's: ``threads``
    threads, ``busy`` of them waking up every few ms between cuts (a runtime's workers), a cut
    every ``period_s`` after a step's work (cold caches), exported on a thread of its own (the
    fetcher). Telemetry off and on (``interval_s``: None, the default) in alternating phases of
    ``cuts`` cuts (``rounds`` each), the first cuts of each phase left out (a new sampler's first
    reads). Per cut: the exporting thread's CPU time of ``rank_cut.export`` and, on the receiving
    side, of decoding the bytes and reducing 8 of them (what the controller's merge costs per
    process); the mean over all cuts (those that sample and those that do not) is the cost per step.
    ``reader``: the process is its host's reader (else another sampler holds the host's lease)."""
    import queue

    from forge_obs.wire.merge import reduce_snapshots
    from forge_obs.wire.snapshot import loads

    stop = threading.Event()
    n_new = max(0, threads - threading.active_count() - 1)
    extra = [threading.Thread(target=_busy_worker, args=(stop, 0.002 + 0.001 * (i % 7)), daemon=True)
             if i < busy else threading.Thread(target=stop.wait, daemon=True) for i in range(n_new)]
    for t in extra:
        t.start()
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def exporter() -> None:  # the fetcher's thread
        while (taken := todo.get()) is not None:
            t0 = time.thread_time_ns()
            data = rank_cut.export(taken)
            t1 = time.thread_time_ns()
            reduce_snapshots([loads(data) for _ in range(8)])
            t2 = time.thread_time_ns()
            done.put(((t1 - t0) / 1e3, (t2 - t1) / 8e3, len(loads(data)["packed"])))

    ex = threading.Thread(target=exporter, daemon=True)
    ex.start()
    key = f"bench-app-{os.getpid()}-{reader}"
    holder = None if reader else Sampler(TelemetryOptions(gpu=False, interval_s=0.0), run_key=key)
    if holder is not None:
        holder.sample()  # it holds the host's lease: the measured process is not the reader
    buf = bytearray(96 << 20)
    junk = [{str(i * j): i for i in range(2000)} for j in range(100)]
    res: dict = {"off": {"export": [], "merge": []}, "on": {"export": [], "merge": [], "sampled": [], "not_sampled": []}}
    step = 0
    try:
        for _ in range(rounds):
            for mode in ("off", "on"):
                opts = {"gpu": False} if interval_s is None else {"gpu": False, "interval_s": interval_s}
                sampler.configure(opts if mode == "on" else False, key)
                for i in range(cuts):
                    t_end = time.monotonic() + period_s
                    _step_work(buf, junk)
                    for k in range(keys):
                        record_metric(f"bench/k{k}", float(step), Reduce.MEAN)
                    todo.put(rank_cut.take(step))
                    exp_us, merge_us, groups = done.get()
                    step += 1
                    if i >= 3:
                        res[mode]["export"].append(exp_us)
                        res[mode]["merge"].append(merge_us)
                        if mode == "on":
                            res["on"]["sampled" if groups > 1 else "not_sampled"].append(exp_us)
                    time.sleep(max(0.0, t_end - time.monotonic()))
    finally:
        sampler.configure(False)
        if holder is not None:
            holder.close()
        todo.put(None)
        ex.join()
        stop.set()
        for t in extra:
            t.join()
    out = {"threads": threads, "busy": busy, "period_s": period_s, "interval_s": interval_s, "host_reader": reader}
    for mode, r in res.items():
        out[mode] = {part: _summary(xs) for part, xs in r.items() if xs}
    out["per_step_us"] = round(sum(out["on"][p]["mean_us"] - out["off"][p]["mean_us"] for p in ("export", "merge")), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--app-cuts", type=int, default=60, help="cuts per phase of the app-shaped case")
    ap.add_argument("--app-rounds", type=int, default=3, help="off/on phases of the app-shaped case")
    args = ap.parse_args()
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = {
        "rank, 10 threads": sample_cost(10, reader=False, n=args.samples),
        "rank, 100 threads": sample_cost(100, reader=False, n=args.samples),
        "host reader, 10 threads": sample_cost(10, reader=True, n=args.samples),
        "host reader, 100 threads": sample_cost(100, reader=True, n=args.samples),
    }
    cut = cut_cost(args.samples)
    app = {}
    for name, interval_s, reader in (("rank, a sample at every cut", 0.0, False),
                                     ("rank, default interval_s", None, False),
                                     ("host reader, a sample at every cut", 0.0, True),
                                     ("host reader, default interval_s", None, True)):
        app[name] = app_shaped(80, 12, 0.1, args.app_cuts, args.app_rounds, interval_s=interval_s, reader=reader)
    up_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"telemetry cost per sample (CPU µs of the exporting thread; {os.cpu_count()} cores; {up})")
    print(f"{'process':28s} {'threads':>7s} {'median':>8s} {'mean':>8s} {'p99':>8s} {'target':>8s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['threads']:7d} {r['median_us']:8.1f} {r['mean_us']:8.1f} {r['p99_us']:8.1f} "
              f"{'≤ ' + format(TARGET_US, 'g'):>8s}")
    print("\nthe cut back to back, 15 keys (CPU µs, median / mean): telemetry off (baseline, same run) -> on")
    for part, where in (("take", "the caller's thread"), ("export", "off it: fetcher / shipper")):
        off = cut["off"][part]
        line = " ".join(f"| {m}: {cut[m][part]['median_us']:.1f} / {cut[m][part]['mean_us']:.1f} "
                        f"(+{cut[m][part]['mean_us'] - off['mean_us']:.1f})" for m in MODES if m != "off")
        print(f"  {part:7s} ({where:25s}) off {off['median_us']:.1f} / {off['mean_us']:.1f} {line}")
    print("\napp-shaped process: 80 threads (12 waking every 2-8 ms), a cut every 0.1 s after a step's work "
          "(cold caches), exported on a thread of its own; CPU µs per cut, mean over every cut, off -> on "
          f"(phases alternate; {up_end})")
    print(f"{'process':36s} {'export off':>10s} {'export on':>10s} {'merge +':>8s} {'per step':>9s} {'target':>8s}")
    for name, r in app.items():
        merge = r["on"]["merge"]["mean_us"] - r["off"]["merge"]["mean_us"]
        print(f"{name:36s} {r['off']['export']['mean_us']:10.1f} {r['on']['export']['mean_us']:10.1f} "
              f"{merge:8.1f} {r['per_step_us']:9.1f} {'≤ ' + format(TARGET_US, 'g'):>8s}")
    out = ROOT / "bench" / "results" / "telemetry.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"uptime": up, "uptime_end": up_end, "cores": os.cpu_count(), "target_us": TARGET_US,
                               "sample": rows, "cut": cut, "app_shaped": app}, indent=1))
    print(f"\n-> {out}")


if __name__ == "__main__":
    main()
