"""CPU overhead of the tracer, ``@trace`` and tensor-valued ``record_metric`` (no GPU needed).

    .venv/bin/python bench/bench_tracer.py            # table on stdout, JSON to bench/results/

Each figure is the minimum over 21 repeats of the mean per-call time of a tight loop (the
minimum is the least disturbed by the other processes on a shared machine). The baselines run in
the same process, same run:

- ``naive``: a straightforward tracer / decorator (f-string metric names, one ``record_metric``
  per value, a new tracer object per decorated call) -- the shape of torchforge's
  ``perf_tracker`` without its CUDA checks (torchforge itself measured ~115 us and ~57 us on
  this VM; see the issue).
- ``user .item()``: ``record_metric(key, t.item())``, converting the CPU tensor by hand.
- ``bare``: the undecorated function call / an empty loop body.

For the GPU figures (host syncs, throughput ratio) run ``bench/gpu_check.py`` on a CUDA machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import _timing
from _timing import tracer_cycle
from forge_obs import Reduce, record_metric
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording.tracer import Tracer, trace

C = MetricCollector()
N = 10_000
REPEAT = 21


def per_call_us(fn, number=N) -> float:
    return _timing.per_call_us(fn, C.reset, number, REPEAT)


# ------------------------------------------------------------------ naive baselines
class NaiveTracer:
    def __init__(self, prefix, track_memory=False, timer="cpu"):
        self.prefix = prefix

    def start(self):
        self.t0 = self.last = time.perf_counter()
        self.steps = []

    def step(self, name):
        now = time.perf_counter()
        self.steps.append((name, now - self.last))
        self.last = now

    def stop(self):
        total = time.perf_counter() - self.t0
        for name, d in self.steps:
            record_metric(f"{self.prefix}/{name}/duration_avg_s", d, Reduce.MEAN)
            record_metric(f"{self.prefix}/{name}/duration_max_s", d, Reduce.MAX)
        record_metric(f"{self.prefix}/total_duration_avg_s", total, Reduce.MEAN)
        record_metric(f"{self.prefix}/total_duration_max_s", total, Reduce.MAX)


def naive_trace(prefix):
    def deco(fn):
        def wrapper(*a, **k):
            t = NaiveTracer(prefix)
            t.start()
            try:
                return fn(*a, **k)
            finally:
                t.stop()

        return wrapper

    return deco


def reused_tracer_cycle():
    t = Tracer("bench/reused")

    def run():
        t.start()
        t.step("a")
        t.step("b")
        t.stop()

    return run


def f(x):
    return x


def main() -> int:
    import torch

    rows = []
    bare_call = per_call_us(lambda: f(1))
    empty = per_call_us(lambda: None)

    ours = per_call_us(tracer_cycle(Tracer))
    naive = per_call_us(tracer_cycle(NaiveTracer))
    rows.append(("Tracer start + 2 steps + stop (cpu)", ours, 10.0, naive, "naive tracer"))
    ours_r = per_call_us(reused_tracer_cycle())
    rows.append(("  same, one Tracer reused", ours_r, 10.0, naive, "naive tracer"))

    g_ours = trace("bench/deco")(f)
    g_naive = naive_trace("bench/deco_naive")(f)
    d_ours = per_call_us(lambda: g_ours(1)) - bare_call
    d_naive = per_call_us(lambda: g_naive(1)) - bare_call
    rows.append(("@trace on a sync function: overhead", d_ours, 5.0, d_naive, "naive decorator"))

    with_ctx = per_call_us(lambda: _ctx())
    rows.append(("with trace(...): enter + exit", with_ctx, None, None, ""))

    t = torch.tensor(1.5)
    r_ours = per_call_us(lambda: record_metric("bench/t", t))
    r_item = per_call_us(lambda: record_metric("bench/t_item", t.item()))
    rows.append(("record_metric(key, cpu_tensor)", r_ours, 1.5, r_item, "user .item()"))
    r_float = per_call_us(lambda: record_metric("bench/f", 1.5))
    rows.append(("record_metric(key, float) (reference)", r_float, None, None, ""))
    rows.append(("bare function call (reference)", bare_call, None, empty, "empty lambda"))

    print(f"forge_obs tracer benchmark  Python {platform.python_version()}  torch {torch.__version__}  "
          f"{os.cpu_count()} CPUs  (min of {REPEAT} x {N} calls, us per call)")
    hdr = f"{'figure':42} | {'ours us':>8} | {'target':>7} | {'baseline us':>11} | {'base/ours':>9} | baseline"
    print(hdr)
    print("-" * len(hdr))
    out = []
    for name, o, target, b, bname in rows:
        ratio = (b / o) if (b is not None and o > 0) else None
        print(f"{name:42} | {o:8.2f} | {('<= %.1f' % target) if target else '':>7} | "
              f"{(f'{b:.2f}' if b is not None else ''):>11} | {(f'{ratio:.1f}x' if ratio else ''):>9} | {bname}")
        out.append({"figure": name.strip(), "ours_us": o, "target_us": target, "baseline_us": b,
                    "baseline": bname, "meets_target": (o <= target) if target else None})
    res = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": out}
    d = Path(__file__).parent / "results"
    d.mkdir(exist_ok=True)
    (d / "bench_tracer.json").write_text(json.dumps(res, indent=2))
    print(f"JSON: {d / 'bench_tracer.json'}")
    return 0


def _ctx():
    with trace("bench/ctx"):
        pass


if __name__ == "__main__":
    sys.exit(main())
