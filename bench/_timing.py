"""Timing helpers shared by the benchmarks (bench_tracer.py, bench_vs_torchforge.py,
bench_spmd.py, bench_grpo_overhead.py, bench_cut_cpu.py).

Imports neither forge_obs nor torch, so a benchmark can set its environment first.
"""

from __future__ import annotations

import os
import statistics
import time
import timeit
from typing import Any, Callable

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def per_call_us(fn: Callable[[], Any], reset: Callable[[], Any], number: int, repeat: int,
                timer: Callable[[], float] = time.perf_counter) -> float:
    """Best over ``repeat`` loops of the mean per-call time of ``fn``, in µs (the minimum is the
    least disturbed by other processes). ``reset`` clears what ``fn`` records, before (after one
    warm-up call that creates the accumulators) and after."""
    reset()
    fn()
    best = min(timeit.repeat(fn, number=number, repeat=repeat, timer=timer)) / number * 1e6
    reset()
    return best


def tracer_cycle(tracer_cls: type) -> Callable[[], None]:
    """One Tracer lifetime: create, start, two steps, stop."""

    def run() -> None:
        t = tracer_cls("bench/tracer")
        t.start()
        t.step("a")
        t.step("b")
        t.stop()

    return run


def percentile(xs: list, q: float) -> float:
    """The ``q`` quantile of ``xs`` (0 <= q <= 1): the value at that rank, no interpolation."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds of all its threads) of process ``pid``, from
    ``/proc/<pid>/stat``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S
    except (OSError, IndexError, ValueError):
        return None


def pair_interval(pairs: list[float]) -> tuple[float, float, float]:
    """Mean of per-pair figures (on/off ratios, on - off differences) and its 95 % confidence
    interval (Student's t)."""
    mean = statistics.fmean(pairs)
    if len(pairs) < 2:
        return mean, float("nan"), float("nan")
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}.get(len(pairs) - 1, 2.0)
    half = t95 * statistics.stdev(pairs) / len(pairs) ** 0.5
    return mean, mean - half, mean + half
