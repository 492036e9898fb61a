"""CPU cost on the caller of spans, the tracer, ``@trace`` and ``record_metric`` (no GPU needed).

    .venv/bin/python bench/bench_tracer.py            # table on stdout, JSON to bench/results/

Each figure is the minimum over 21 repeats of the mean per-call **thread CPU time**
(``time.thread_time``) of a tight loop: the cost on the caller. On a machine shared with other
jobs the wall time of a loop also counts the time the others hold the CPU (a loop of 0.9 µs
calls reads 2 µs at a load of 7 on 2 cores); the CPU time does not. The wall-clock minimum is
printed beside it. ``torch`` is imported, so the spans' compile check runs as in a training
process. The baselines run in the same process, same run:

- ``floor``: a context manager that reads ``perf_counter_ns`` twice and appends two tuples to a
  deque -- what any span that times a block and hands it to a writer must at least do;
- ``metrics-only @trace``: ``@trace`` as it was before it wrote spans (clock twice, the same
  three metric keys into the collector), so ``@trace``'s added cost per call is the difference;
- ``naive``: a straightforward tracer / decorator (f-string metric names, one ``record_metric``
  per value, a new tracer object per decorated call) -- the shape of torchforge's
  ``perf_tracker`` without its CUDA checks;
- ``user .item()``: ``record_metric(key, t.item())``, converting the CPU tensor by hand;
- ``dict accumulate``: ``d[key] = d.get(key, 0.0) + v``, the least a metric can cost;
- ``bare``: the undecorated function call.

For the GPU figures (host syncs, throughput ratio) run ``bench/gpu_check.py`` on a CUDA machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import deque
from pathlib import Path

import _timing
from _timing import tracer_cycle
from forge_obs import Reduce, record_metric
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording.sketch import DISTRIBUTION
from forge_obs.recording.timeline import recorder, record_span
from forge_obs.recording.tracer import Tracer, trace

C = MetricCollector()
N = 10_000
REPEAT = 21


def per_call_us(fn, number=N) -> tuple[float, float]:
    """(thread CPU µs, wall µs) per call: each the minimum over the repeats."""
    reset = _reset
    cpu = _timing.per_call_us(fn, reset, number, REPEAT, timer=time.thread_time)
    wall = _timing.per_call_us(fn, reset, number, REPEAT)
    return cpu, wall


def _reset() -> None:
    C.reset()
    recorder.clear()


# ------------------------------------------------------------------ baselines
_floor_buf: deque = deque(maxlen=recorder.BUFFER_CAP)
_floor_append = _floor_buf.append
_clock = time.perf_counter_ns


class FloorSpan:
    """Times a block and hands it to a buffer, nothing else."""

    __slots__ = ("name", "t0")

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        t = self.t0 = _clock()
        _floor_append((1, t, self.name))
        return self

    def __exit__(self, *exc):
        _floor_append((2, _clock()))


def floor_span() -> None:
    with FloorSpan("train_step"):
        pass
    if len(_floor_buf) > 100_000:
        _floor_buf.clear()


def metrics_only_trace(prefix):
    """@trace before it wrote spans: the clock around the call, then the total's three keys."""
    keys = tuple(f"{prefix}/total_duration_{k}" for k in ("avg_s", "max_s", "dist_s"))
    reds = (Reduce.MEAN, Reduce.MAX, DISTRIBUTION)
    record_groups, clock = C.record_groups, time.perf_counter

    def deco(fn):
        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                record_groups([(keys, clock() - t0)], reds)

        return wrapper

    return deco


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


def _span_rows() -> list:
    def top():
        with record_span("train_step"):
            pass

    outer = record_span("outer")

    def nested():
        with record_span("forward"):
            pass

    rows = []
    floor = per_call_us(floor_span)
    ours = per_call_us(top)
    rows.append(("record_span enter + exit", ours, 1.0, floor, "floor: clock x2, append x2"))
    with outer:
        rows.append(("  nested in an open span", per_call_us(nested), 1.0, floor, "floor: clock x2, append x2"))
    saved = recorder.CPU_MIN_NS
    recorder.CPU_MIN_NS = 0  # every span of this name reads the thread's CPU clock (a >= 100 µs span does)

    def with_cpu():
        with record_span("long_span"):
            pass

    try:
        rows.append(("  a span that carries its CPU time", per_call_us(with_cpu), None, ours, "record_span enter + exit"))
    finally:
        recorder.CPU_MIN_NS = saved
    rows.append(("time.thread_time_ns() (the CPU clock)", per_call_us(time.thread_time_ns), None,
                 per_call_us(time.perf_counter_ns), "perf_counter_ns()"))
    return rows


def _tracer_rows() -> list:
    rows = []
    bare = per_call_us(lambda: f(1))
    g_ours = trace("bench/deco")(f)
    g_metrics = metrics_only_trace("bench/deco_metrics")(f)
    g_naive = naive_trace("bench/deco_naive")(f)
    ours, metrics, naive = per_call_us(lambda: g_ours(1)), per_call_us(lambda: g_metrics(1)), per_call_us(lambda: g_naive(1))
    over = tuple(o - b for o, b in zip(ours, bare))
    rows.append(("@trace on a sync function: overhead", over, 5.0, tuple(n - b for n, b in zip(naive, bare)),
                 "naive decorator"))
    rows.append(("  added by its span (vs metrics-only @trace)", tuple(o - m for o, m in zip(ours, metrics)), 1.0,
                 None, ""))
    rows.append(("  metrics-only @trace (before spans): overhead", tuple(m - b for m, b in zip(metrics, bare)), None,
                 None, ""))
    naive_cycle = per_call_us(tracer_cycle(NaiveTracer))
    rows.append(("Tracer start + 2 steps + stop (cpu)", per_call_us(tracer_cycle(Tracer)), 10.0, naive_cycle,
                 "naive tracer"))
    rows.append(("  same, one Tracer reused", per_call_us(reused_tracer_cycle()), 10.0, naive_cycle, "naive tracer"))
    rows.append(("with trace(...): enter + exit", per_call_us(_ctx), None, None, ""))
    rows.append(("bare function call (reference)", bare, None, None, ""))
    return rows


def _metric_rows(torch) -> list:
    d: dict = {}

    def acc():
        d["bench/f"] = d.get("bench/f", 0.0) + 1.5

    t = torch.tensor(1.5)
    return [
        ("record_metric(key, float)", per_call_us(lambda: record_metric("bench/f", 1.5)), 0.418, per_call_us(acc),
         "dict accumulate"),
        ("record_metric(key, cpu_tensor)", per_call_us(lambda: record_metric("bench/t", t)), 1.5,
         per_call_us(lambda: record_metric("bench/t_item", t.item())), "user .item()"),
    ]


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    import torch

    recorder.refresh_compile_check()  # torch is imported: the spans check torch.compile as in training
    load0 = _load()
    rows = _span_rows() + _tracer_rows() + _metric_rows(torch)
    load1 = _load()
    print(f"forge_obs tracer benchmark  Python {platform.python_version()}  torch {torch.__version__}  "
          f"{os.cpu_count()} CPUs  load {load0} -> {load1}  (min of {REPEAT} x {N} calls, µs per call)")
    hdr = (f"{'figure':46} | {'cpu us':>7} | {'target':>7} | {'wall us':>7} | {'baseline cpu':>12} | "
           f"{'base/ours':>9} | baseline")
    print(hdr)
    print("-" * len(hdr))
    out = []
    for name, (o, ow), target, base, bname in rows:
        b = base[0] if base is not None else None
        ratio = (b / o) if (b is not None and o > 0) else None
        print(f"{name:46} | {o:7.3f} | {('<= %.3g' % target) if target else '':>7} | {ow:7.3f} | "
              f"{(f'{b:.3f}' if b is not None else ''):>12} | {(f'{ratio:.2f}x' if ratio else ''):>9} | {bname}")
        out.append({"figure": name.strip(), "cpu_us": o, "wall_us": ow, "target_us": target, "baseline_cpu_us": b,
                    "baseline": bname, "meets_target": (o <= target) if target else None})
    res = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "load": [load0, load1], "timer": "thread CPU time, min of repeats",
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
