"""SPMD mode: what the training thread pays, what the background shipping costs, how soon a step
reaches rank 0's backends, and TorchTitan's structured logger beside ``forge_obs.titan``.

    .venv/bin/python bench/bench_spmd.py [--nproc 2] [--steps 300]   # table on stdout, JSON to bench/results/

It runs itself under ``torchrun --standalone`` (gloo, CPU). Each rank records ``KEYS`` values
per step (MEAN / SUM / MAX keys), calls ``obs.flush(step)``, then idles ``--step-ms`` (the
device's part of a training step, 20 ms by default: the CPU is free meanwhile); a
``dist.barrier()`` before each flush (the benchmark's, not forge_obs's) lines the ranks up so
that rank 0's latency to its backends is the pipeline's, not a rank's lag. Figures (medians
unless said otherwise):

- ``flush on the training thread``: one ``obs.flush(step)`` call (target <= 50 us); beside it,
  in the same run, the collector's swap alone in the same loop (the floor of any exact cut) and
  a gloo ``dist.barrier()`` (the floor of any flush that synchronises ranks);
- ``shipping CPU per step``: the shipper thread's CPU (export + pickle + push) per step, per rank;
- ``step at rank 0's backends``: from rank 0's ``flush(step)`` to the step's ``log_step`` on a
  backend (merge of every rank included), median and p99;
- ``transport``: one ~4 KB message rank 1 -> rank 0 over the job's TCPStore queue (push, pop)
  and over a separate gloo group (send / recv), the two candidates;
- ``span`` / ``scalar``: TorchTitan 0.3.0's ``log_trace_span`` (enter + exit) and
  ``log_trace_scalar`` (one scalar), writing their JSONL, beside ``forge_obs.titan``'s, in the
  same process (minimum over repeats of the mean per call).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _timing import percentile  # bench/, beside this script
from forge_obs.backends.base import LoggerBackend

KEYS = 20
MSG_BYTES = 4096


class StampBackend(LoggerBackend):
    """Notes when each step reaches it (rank 0's clock)."""

    arrivals: dict = {}

    def log_step(self, record) -> None:
        StampBackend.arrivals[record.step] = time.perf_counter()


def worker(steps: int, out: Path, step_ms: float) -> None:
    import torch.distributed as dist

    from forge_obs import Reduce, record_metric, spmd

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    obs = spmd.init({"bench_spmd:StampBackend": {}, "jsonl": None, "run": {"root": str(out / "runs")}},
                    coords={"dp_shard": rank}, timeout_s=30.0)
    flush_us, barrier_us, sent = [], [], {}
    for step in range(steps):
        for k in range(KEYS):
            record_metric(f"k{k}", float(rank + step + k), (Reduce.MEAN, Reduce.SUM, Reduce.MAX)[k % 3])
        t0 = time.perf_counter()
        dist.barrier()
        t1 = time.perf_counter()
        obs.flush(step)
        t2 = time.perf_counter()
        sent[step] = t2
        barrier_us.append((t1 - t0) * 1e6)
        flush_us.append((t2 - t1) * 1e6)
        time.sleep(step_ms / 1000)  # the device's part of the step (the CPU idles)
    swap_us = _swap_alone(steps, step_ms)
    transport = _transport(rank, world)
    summary = obs.shutdown()
    res = {"rank": rank, "flush_us": statistics.median(flush_us), "flush_p99_us": percentile(flush_us, 0.99),
           "barrier_us": statistics.median(barrier_us), "swap_alone_us": swap_us, "ship_cpu_us_per_step": obs.ship_cpu_s / max(1, obs.shipped) * 1e6,
           "transport": transport, "summary": {k: v for k, v in summary.items() if k != "unfinished_backends"}}
    if rank == 0:
        import bench_spmd  # the module the backend was created from (this file runs as __main__)

        arrivals = bench_spmd.StampBackend.arrivals
        lat = [(arrivals[s] - sent[s]) * 1e3 for s in sent if s in arrivals]
        res.update(steps_at_backend=len(lat), backend_ms=statistics.median(lat), backend_p99_ms=percentile(lat, 0.99))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _swap_alone(steps: int, step_ms: float) -> float:
    """The same loop with the collector's swap alone in place of ``flush`` (the floor of any
    exact cut; its values are dropped): median µs."""
    import torch.distributed as dist

    from forge_obs import Reduce, record_metric
    from forge_obs.recording.collector import MetricCollector

    c = MetricCollector()
    rank = dist.get_rank()
    xs = []
    for step in range(steps):
        for k in range(KEYS):
            record_metric(f"k{k}", float(rank + step + k), (Reduce.MEAN, Reduce.SUM, Reduce.MAX)[k % 3])
        dist.barrier()
        t1 = time.perf_counter()
        c.swap()
        xs.append((time.perf_counter() - t1) * 1e6)
        time.sleep(step_ms / 1000)
    return statistics.median(xs)


def _transport(rank: int, world: int, n: int = 300) -> dict:
    """One MSG_BYTES message rank 1 -> rank 0: TCPStore queue vs a separate gloo group."""
    import torch
    import torch.distributed as dist

    from forge_obs.spmd.transport import StoreTransport, store_endpoint

    out: dict = {}
    host, port = store_endpoint()
    t = StoreTransport(host, port, "forge_obs/bench", 60.0)
    data = b"x" * MSG_BYTES
    dist.barrier()
    if rank == 1:
        t0 = time.perf_counter()
        for _ in range(n):
            t.push(data)
        out["store_push_us"] = (time.perf_counter() - t0) / n * 1e6
    elif rank == 0:
        t0 = time.perf_counter()
        for _ in range(n):
            t.pop()
        out["store_pop_us"] = (time.perf_counter() - t0) / n * 1e6
    group = dist.new_group(backend="gloo")
    buf = torch.zeros(MSG_BYTES, dtype=torch.uint8)
    dist.barrier()

    def run() -> None:
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 1:
                dist.send(buf, 0, group=group)
            elif rank == 0:
                dist.recv(buf, 1, group=group)
        out["gloo_p2p_us"] = (time.perf_counter() - t0) / n * 1e6

    th = threading.Thread(target=run)  # from a background thread, as the shipper would
    th.start()
    th.join()
    dist.barrier()
    return out


def titan_costs(tmp: Path) -> dict:
    """TorchTitan's structured logger's span / scalar cost beside forge_obs.titan's (same process)."""
    import timeit

    from torchtitan.observability import structured_logger as tt

    from forge_obs import titan as ours
    from forge_obs.recording import timeline

    tt.init_structured_logger(source="bench", output_dir=str(tmp / "tt"), rank=0)
    ours.init_structured_logger(source="bench", output_dir=str(tmp / "ours"), rank=0)
    tt.set_step(1)
    ours.set_step(1)

    def span(mod):
        def f():
            with mod.log_trace_span("fwd"):
                pass
        return f

    def scalar(mod):
        return lambda: mod.log_trace_scalar({"loss": 1.5})

    res = {}
    for name, fn in (("span", span), ("scalar", scalar)):
        for who, mod in (("torchtitan", tt), ("forge_obs", ours)):
            number = 2000
            res[f"{name}_{who}_us"] = min(timeit.repeat(fn(mod), number=number, repeat=7)) / number * 1e6
            timeline.flush()
    timeline.close()
    return res


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=20.0)
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent / "src"), str(here.parent)]), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--standalone",
               str(Path(__file__).resolve()), "--worker", str(args.steps), str(tmp), str(args.step_ms)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(args.nproc)]
        titan = titan_costs(tmp)
    r0, r1 = ranks[0], ranks[1]
    rows = [
        ("flush on the training thread (median, rank 0)", f"{r0['flush_us']:.1f} us", "<= 50 us",
         f"collector swap alone {r0['swap_alone_us']:.1f} us; gloo barrier {r0['barrier_us']:.0f} us"),
        ("flush p99 (rank 0)", f"{r0['flush_p99_us']:.1f} us", "", ""),
        ("shipping CPU per step (rank 1 / rank 0)", f"{r1['ship_cpu_us_per_step']:.0f} / {r0['ship_cpu_us_per_step']:.0f} us",
         "off the training thread", ""),
        ("step at rank 0's backends (median / p99)", f"{r0['backend_ms']:.2f} / {r0['backend_p99_ms']:.2f} ms", "",
         f"{r0['steps_at_backend']} of {args.steps} steps"),
        ("transport: TCPStore queue push / pop (4 KB)",
         f"{r1['transport'].get('store_push_us', 0):.0f} / {r0['transport'].get('store_pop_us', 0):.0f} us", "",
         f"gloo send/recv {r0['transport'].get('gloo_p2p_us', 0):.0f} us"),
        ("span (enter + exit): forge_obs.titan", f"{titan['span_forge_obs_us']:.2f} us", "",
         f"TorchTitan {titan['span_torchtitan_us']:.2f} us"),
        ("scalar (one): forge_obs.titan", f"{titan['scalar_forge_obs_us']:.2f} us", "",
         f"TorchTitan {titan['scalar_torchtitan_us']:.2f} us"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"SPMD mode, {args.nproc} ranks (torchrun, gloo, CPU), {args.steps} steps of {args.step_ms:g} ms, "
          f"{KEYS} keys/step; {platform.node()}")
    print(f"{'':{w}}  {'forge_obs':>18}  {'target':>24}  baseline (same run)")
    for name, fig, target, base in rows:
        print(f"{name:{w}}  {fig:>18}  {target:>24}  {base}")
    result = {"nproc": args.nproc, "steps": args.steps, "step_ms": args.step_ms, "keys": KEYS, "ranks": ranks, "titan": titan}
    out = here / "results"
    out.mkdir(exist_ok=True)
    (out / "bench_spmd.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
