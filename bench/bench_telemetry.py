"""What telemetry costs a process per step (issue 39: ≤ 50 µs, off the training thread).

    python bench/bench_telemetry.py                 # table on stdout, JSON to bench/results/telemetry.json
    python bench/bench_telemetry.py --samples 2000

Measures, in this process, the CPU time (``time.thread_time``) of one telemetry sample
(:class:`forge_obs.recording.telemetry.sampler.Sampler.sample`, what a cut's export adds) for:

- a process that is not its host's reader (its own figures: ``getrusage``, ``statm``, the
  run-queue wait of its threads), with 10 and with 100 threads (a runtime's workers, a thread
  pool sized to a big host: the reads per sample are bounded, ``ThreadDelays.max_reads``);
- the host's reader (the same, plus ``/proc/loadavg``, ``/proc/stat``, PSI), one per host.

Then the cost on the thread that asks for the cut: ``rank_cut.take`` (the swap) with telemetry
on and off (it samples nothing: sampling runs where the cut is exported), and the export of a
15-key cut with and without a sample (the baseline, measured in the same run). The figure per
sample is the median over ``--samples`` samples (the mean and p99 beside it); the machine is
shared, so the run records ``uptime``. This measures; it asserts nothing.
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


def cut_cost(n: int, keys: int = 15) -> dict:
    """The caller's cut (take) and the export of a ``keys``-key cut, telemetry on and off."""
    out = {}
    for mode in ("off", "on"):
        sampler.configure({"gpu": False, "interval_s": 0.0} if mode == "on" else False, f"bench-cut-{os.getpid()}")
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=3000)
    args = ap.parse_args()
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = {
        "rank, 10 threads": sample_cost(10, reader=False, n=args.samples),
        "rank, 100 threads": sample_cost(100, reader=False, n=args.samples),
        "host reader, 10 threads": sample_cost(10, reader=True, n=args.samples),
        "host reader, 100 threads": sample_cost(100, reader=True, n=args.samples),
    }
    cut = cut_cost(args.samples)
    print(f"telemetry cost per sample (CPU µs of the exporting thread; {os.cpu_count()} cores; {up})")
    print(f"{'process':28s} {'threads':>7s} {'median':>8s} {'mean':>8s} {'p99':>8s} {'target':>8s}")
    for name, r in rows.items():
        print(f"{name:28s} {r['threads']:7d} {r['median_us']:8.1f} {r['mean_us']:8.1f} {r['p99_us']:8.1f} "
              f"{'≤ ' + format(TARGET_US, 'g'):>8s}")
    print("\nthe cut, 15 keys (CPU µs): telemetry off (baseline, same run) -> on")
    for part, where in (("take", "the caller's thread"), ("export", "off it: fetcher / shipper")):
        off, on = cut["off"][part]["median_us"], cut["on"][part]["median_us"]
        print(f"  {part:7s} ({where:25s}) {off:8.1f} -> {on:8.1f}  (+{on - off:.1f})")
    out = ROOT / "bench" / "results" / "telemetry.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"uptime": up, "cores": os.cpu_count(), "target_us": TARGET_US, "sample": rows,
                               "cut": cut}, indent=1))
    print(f"\n-> {out}")


if __name__ == "__main__":
    main()
