"""GPU checks of the tracer and device-side values (needs CUDA; does not need Monarch).

    PYTHONPATH=src:. python3 bench/gpu_check.py            # table on stdout, JSON to bench/results/

Checks, each against a naive baseline measured in the same run (what torchforge does today:
``.item()`` per tensor value, a GPU timer whose ``stop()`` synchronises):

1. sync debug: a training-like loop (matmul fwd/bwd, optimizer step) that records tensor metrics
   and runs a GPU Tracer with steps every iteration under ``torch.cuda.set_sync_debug_mode("error")``;
   a flush (``MetricCollector().snapshot()``) runs in another thread while the mode is on.
2. host syncs per iteration, counted with ``set_sync_debug_mode("warn")`` (observability only).
3. GPU timer durations vs ``torch.cuda.Event`` elapsed times measured directly around the same work.
4. latency of ``Tracer.stop()`` / ``record_metric(cuda_tensor)`` with ~50 ms of GPU work queued.
5. throughput of a 2048x2048 matmul loop with / without a per-step GPU tracer + tensor metric.
6. device values read back at flush equal the values computed on the host afterwards.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from forge_obs import Reduce, record_metric
from forge_obs.recording.collector import MetricCollector
from forge_obs.wire.merge import reduce_metrics_states
from forge_obs.recording.tracer import Tracer, _GPU

C = MetricCollector()


def values() -> dict:
    return {m.key: m.value for m in reduce_metrics_states([C.snapshot()["states"]])}


def ev() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


# ------------------------------------------------------------------ naive baselines
def naive_record(key, t, red=Reduce.MEAN):
    record_metric(key, t.item(), red)  # what a per-value .item() costs


class NaiveGpuTracer:
    """torchforge-like GPU timer: events, but stop() synchronises to read them."""

    def __init__(self, prefix):
        self.prefix = prefix

    def start(self):
        self.evs = [ev()]
        self.names = []
        self.evs[0].record()

    def step(self, name):
        e = ev()
        e.record()
        self.evs.append(e)
        self.names.append(name)

    def stop(self):
        e = ev()
        e.record()
        self.evs.append(e)
        torch.cuda.synchronize()
        for i, n in enumerate(self.names):
            record_metric(f"{self.prefix}/{n}/duration_avg_s", self.evs[i].elapsed_time(self.evs[i + 1]) / 1e3)
        record_metric(f"{self.prefix}/total_duration_avg_s", self.evs[0].elapsed_time(self.evs[-1]) / 1e3)


# ------------------------------------------------------------------ workloads
def make_model(d=2048):
    torch.manual_seed(0)
    w1 = torch.randn(d, d, device="cuda", requires_grad=True)
    w2 = torch.randn(d, d, device="cuda", requires_grad=True)
    opt = torch.optim.SGD([w1, w2], lr=1e-6)
    x = torch.randn(256, d, device="cuda")
    return w1, w2, opt, x


def train_iter(w1, w2, opt, x, observe, naive=False):
    """One training-like iteration; with ``observe`` it traces and records like a user would."""
    if observe:
        t = NaiveGpuTracer("train") if naive else Tracer("train", timer="gpu", track_memory=True)
        t.start()
    h = torch.relu(x @ w1)
    loss = (h @ w2).pow(2).mean()
    if observe:
        t.step("forward")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.linalg.vector_norm(torch.stack([w1.grad.norm(), w2.grad.norm()]))
    if observe:
        t.step("backward")
    opt.step()
    if observe:
        t.step("optim")
        rec = naive_record if naive else record_metric
        rec("loss", loss.detach())
        rec("loss_std", loss.detach(), Reduce.STD)
        rec("grad_norm_max", gn, Reduce.MAX)
        rec("grad_norm_min", gn, Reduce.MIN)
        rec("tokens", torch.tensor(256, device="cuda") if naive else x.new_full((), 256.0), Reduce.SUM)
        rec("loss_dist", loss.detach(), "distribution")
        t.stop()
    return loss, gn


def calibrate_sleep(ms: float) -> int:
    """cycles for torch.cuda._sleep that take about ``ms`` milliseconds."""
    n = 1_000_000
    for _ in range(2):  # the first launch is slower (module load)
        a, b = ev(), ev()
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
    return int(n * ms / a.elapsed_time(b))


# ------------------------------------------------------------------ checks
def check_sync_debug(iters=50):
    w1, w2, opt, x = make_model()
    for _ in range(3):
        train_iter(w1, w2, opt, x, observe=True)
    torch.cuda.synchronize()
    C.snapshot()
    _GPU.resolve_now()
    C.snapshot()
    losses, gns = [], []
    flush_err = []

    def flusher():
        try:
            C.snapshot()  # a flush from another thread while the training thread is in "error" mode
        except Exception as e:  # noqa: BLE001
            flush_err.append(repr(e))

    err = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(iters):
            loss, gn = train_iter(w1, w2, opt, x, observe=True)
            losses.append(loss.detach())
            gns.append(gn)
            if i == iters // 2:
                th = threading.Thread(target=flusher)
                th.start()
                th.join()
    except RuntimeError as e:
        err = repr(e)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # sanity: the mode does catch a naive .item()
    naive_caught = False
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses[-1].item()
    except RuntimeError:
        naive_caught = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"raised": err, "flush_in_thread_raised": flush_err or None, "naive_item_caught_by_mode": naive_caught,
            "iterations": iters}


def count_syncs(naive: bool, iters=30):
    w1, w2, opt, x = make_model()
    for _ in range(3):
        train_iter(w1, w2, opt, x, observe=True, naive=naive)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w_obs:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(iters):
                train_iter(w1, w2, opt, x, observe=True, naive=naive)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    with warnings.catch_warnings(record=True) as w_bare:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(iters):
                train_iter(w1, w2, opt, x, observe=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    n_obs = sum("synchroniz" in str(w.message) for w in w_obs)
    n_bare = sum("synchroniz" in str(w.message) for w in w_bare)
    torch.cuda.synchronize()
    _GPU.resolve_now()
    C.snapshot()
    return (n_obs - n_bare) / iters


def check_timer_agreement(reps=30):
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    C.snapshot()
    direct = []
    for i in range(reps):
        k = 1 + i % 5  # 1..5 matmuls: durations differ per rep
        t = Tracer("agree", timer="gpu")
        e0, e1 = ev(), ev()
        t.start()
        e0.record()
        for _ in range(k):
            a @ a
        e1.record()
        t.step("work")
        t.stop()
        direct.append((e0, e1))
    torch.cuda.synchronize()
    _GPU.resolve_now()
    v = values()
    d = [e0.elapsed_time(e1) / 1e3 for e0, e1 in direct]
    mean_d, max_d = statistics.fmean(d), max(d)
    mean_t, max_t = v["agree/work/duration_avg_s"], v["agree/work/duration_max_s"]
    return {
        "direct_mean_ms": mean_d * 1e3, "tracer_mean_ms": mean_t * 1e3,
        "direct_max_ms": max_d * 1e3, "tracer_max_ms": max_t * 1e3,
        "rel_diff_mean": abs(mean_t - mean_d) / mean_d, "rel_diff_max": abs(max_t - max_d) / max_d,
        "count": v["agree/work/duration_dist_s"]["count"],
    }


def check_latency(queued_ms=50.0, reps=20):
    cycles = calibrate_sleep(queued_ms)
    loss = torch.ones((), device="cuda")
    out = {"ours_stop_us": [], "ours_record_us": [], "naive_stop_us": [], "naive_record_us": [], "queued_ms": []}
    for naive in (False, True):
        for _ in range(reps):
            torch.cuda.synchronize()
            t = NaiveGpuTracer("lat") if naive else Tracer("lat", timer="gpu")
            a, b = ev(), ev()
            t.start()
            a.record()
            torch.cuda._sleep(cycles)  # ~50 ms of queued GPU work
            b.record()
            t.step("work")
            t0 = time.perf_counter()
            (naive_record if naive else record_metric)("lat_loss", loss)
            t1 = time.perf_counter()
            t.stop()
            t2 = time.perf_counter()
            pre = "naive" if naive else "ours"
            out[f"{pre}_record_us"].append((t1 - t0) * 1e6)
            out[f"{pre}_stop_us"].append((t2 - t1) * 1e6)
            b.synchronize()
            if not naive:
                out["queued_ms"].append(a.elapsed_time(b))
    torch.cuda.synchronize()
    _GPU.resolve_now()
    C.snapshot()
    summ = {k: {"p50": statistics.median(v), "max": max(v)} for k, v in out.items()}
    return summ


def matmul_loop(n, tracer: bool, metric: bool, naive=False, flusher=True, floor=None, d=2048):
    a = torch.randn(d, d, device="cuda")
    b = torch.randn(d, d, device="cuda")
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    stop = threading.Event()

    def flush_loop():  # flushes run in another thread, as the fetcher actor's do
        while not stop.wait(0.05):
            C.snapshot()

    th = threading.Thread(target=flush_loop, daemon=True)
    if flusher and (tracer or metric):
        th.start()
    rec = naive_record if naive else record_metric
    acc = torch.zeros(1, dtype=torch.float64, device="cuda")
    evs = [ev() for _ in range(3)]
    t0 = time.perf_counter()
    for i in range(n):
        if floor:  # plain torch, no forge_obs: the GPU-side floor of 3 timing events / 1 kernel
            if "events" in floor:
                evs[0].record()
            y = a @ b
            if "events" in floor:
                evs[1].record()
                evs[2].record()
            if "add" in floor:
                acc.add_(y[0, 0])
            continue
        if tracer:
            t = NaiveGpuTracer("mm") if naive else Tracer("mm", timer="gpu")
            t.start()
        y = a @ b
        if tracer:
            t.step("matmul")
        if metric:
            rec("mm/out", y[0, 0])
        if tracer:
            t.stop()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    stop.set()
    if th.is_alive():
        th.join()
    _GPU.resolve_now()
    C.snapshot()
    return n / dt


def check_throughput(n=1000, rounds=3):
    variants = {
        "ours": dict(tracer=True, metric=True),
        "naive": dict(tracer=True, metric=True, naive=True),
        "ours_tracer_only": dict(tracer=True, metric=False),
        "ours_metric_only": dict(tracer=False, metric=True),
        "ours_no_flush_thread": dict(tracer=True, metric=True, flusher=False),
        "floor_torch_3events_1add": dict(tracer=False, metric=False, floor="events+add"),
        "floor_torch_3events": dict(tracer=False, metric=False, floor="events"),
    }
    ratios: dict = {k: [] for k in variants}
    its = {}
    for _ in range(rounds):
        for k, kw in variants.items():
            bare = matmul_loop(n, False, False)
            it = matmul_loop(n // 4 if kw.get("naive") else n, **kw)
            ratios[k].append(it / bare)
            its[f"{k}_it_s"] = it
            its["bare_it_s"] = bare
    out = {f"ratio_{k}": statistics.median(v) for k, v in ratios.items()}
    out["ratios_ours"] = ratios["ours"]
    out.update(its)
    return out


def check_values(iters=40):
    """Device values read back at flush equal what the host computes afterwards."""
    C.snapshot()
    xs = [torch.randn((), device="cuda") for _ in range(iters)]
    side = torch.cuda.Stream()
    for i, x in enumerate(xs):
        if i % 2:
            with torch.cuda.stream(side):  # half of them recorded on a side stream
                side.wait_stream(torch.cuda.default_stream())
                record_metric("v/mean", x)
                record_metric("v/max", x, Reduce.MAX)
                record_metric("v/std", x, Reduce.STD)
        else:
            record_metric("v/mean", x)
            record_metric("v/max", x, Reduce.MAX)
            record_metric("v/std", x, Reduce.STD)
    got = values()
    host = [float(x) for x in xs]
    mean = sum(host) / len(host)
    std = (sum((h - mean) ** 2 for h in host) / len(host)) ** 0.5
    return {"mean_err": abs(got["v/mean"] - mean), "max_err": abs(got["v/max"] - max(host)),
            "std_err": abs(got["v/std"] - std)}


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA not available: nothing to check")
        return 0
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0]}
    res = {"info": info}
    res["sync_debug"] = check_sync_debug()
    res["syncs_per_iter_ours"] = count_syncs(naive=False)
    res["syncs_per_iter_naive"] = count_syncs(naive=True)
    res["timer_agreement"] = check_timer_agreement()
    res["latency"] = check_latency()
    res["throughput"] = check_throughput()
    res["values"] = check_values()
    lat, thr, agr = res["latency"], res["throughput"], res["timer_agreement"]
    sd = res["sync_debug"]
    rows = [
        ("sync_debug('error') loop: raised", str(sd["raised"] is not None or bool(sd["flush_in_thread_raised"])), "False",
         f"naive .item() caught: {sd['naive_item_caught_by_mode']}"),
        ("host syncs / iteration (observability)", f"{res['syncs_per_iter_ours']:.2f}", "0", f"{res['syncs_per_iter_naive']:.2f}"),
        ("GPU timer vs cuda.Event: mean rel diff", f"{agr['rel_diff_mean']:.4%}", "small",
         f"{agr['tracer_mean_ms']:.3f} vs {agr['direct_mean_ms']:.3f} ms"),
        ("GPU timer vs cuda.Event: max rel diff", f"{agr['rel_diff_max']:.4%}", "small",
         f"{agr['tracer_max_ms']:.3f} vs {agr['direct_max_ms']:.3f} ms"),
        ("Tracer(gpu).stop() p50 / max, ~50 ms queued (us)",
         f"{lat['ours_stop_us']['p50']:.1f} / {lat['ours_stop_us']['max']:.1f}", "<= 50",
         f"{lat['naive_stop_us']['p50']:.0f}"),
        ("record_metric(cuda tensor) p50 / max (us)",
         f"{lat['ours_record_us']['p50']:.1f} / {lat['ours_record_us']['max']:.1f}", "no wait",
         f"{lat['naive_record_us']['p50']:.0f}"),
        ("queued GPU work (ms)", f"{lat['queued_ms']['p50']:.1f}", "~50", ""),
        ("matmul loop throughput ratio (with/without)", f"{thr['ratio_ours']:.3f}", ">= 0.97", f"{thr['ratio_naive']:.3f}"),
        ("  ratio, tracer only / metric only / no flush thread",
         f"{thr['ratio_ours_tracer_only']:.3f} / {thr['ratio_ours_metric_only']:.3f} / {thr['ratio_ours_no_flush_thread']:.3f}", "", ""),
        ("  floor, plain torch: 3 events + 1 add_ / 3 events",
         f"{thr['ratio_floor_torch_3events_1add']:.3f} / {thr['ratio_floor_torch_3events']:.3f}", "", "(no forge_obs code)"),
        ("device values vs host (abs err mean/max/std)",
         f"{res['values']['mean_err']:.1e}/{res['values']['max_err']:.1e}/{res['values']['std_err']:.1e}", "~0", ""),
    ]
    print(f"GPU: {info['gpu']}  torch {info['torch']}  CUDA {info['cuda']}  Python {info['python']}")
    w = max(len(r[0]) for r in rows)
    print(f"{'figure'.ljust(w)} | {'ours':>22} | {'target':>8} | naive baseline (same run)")
    for name, ours, target, base in rows:
        print(f"{name.ljust(w)} | {ours:>22} | {target:>8} | {base}")
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res, default=str))
    ok = (sd["raised"] is None and not sd["flush_in_thread_raised"] and res["syncs_per_iter_ours"] == 0
          and lat["ours_stop_us"]["p50"] <= 50)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
