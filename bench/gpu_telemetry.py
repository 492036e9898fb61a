"""GPU telemetry on a GPU (issue 39): a traced training loop on CUDA with forge_obs's telemetry
sampled at every cut, as the SPMD shipper does it (the cut on the training thread, the export and
its sample on a thread of their own). No Monarch needed. Needs torch with CUDA and nvidia-ml-py
(``pip install 'forge-obs[gpu]'``).

    python bench/gpu_telemetry.py                    # 300 steps; table on stdout, JSON to bench/results/
    python bench/gpu_telemetry.py --steps 1000 --size 4096

Prints: which device NVML found for this process (UUID, name), every ``obs/sys/gpu/...`` key with
its value at the last steps, the cost of one sample with and without the GPU part (CPU µs of the
exporting thread), and the loop's step time with telemetry on and off (the same loop, this run).
This measures; it asserts nothing. Without a GPU or NVML it says what is missing and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]


def _need() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    from forge_obs.recording.telemetry.gpu import import_nvml

    if import_nvml() is None:
        return "nvidia-ml-py is not installed: pip install 'forge-obs[gpu]'"
    return None


def loop(steps: int, size: int, telemetry: bool) -> dict:
    """``steps`` training steps (matmul, backward, SGD) in a span each, cut every step; the export
    (and the telemetry sample) on a shipper thread. Returns step times and the last values."""
    import torch

    from forge_obs.recording.collector import record_metric
    from forge_obs.recording.reduce import Reduce
    from forge_obs.recording.telemetry import sampler
    from forge_obs.recording.timeline import record_span
    from forge_obs.wire import rank_cut
    from forge_obs.wire.snapshot import loads

    sampler.configure({"interval_s": 0.0} if telemetry else False, f"gpu-bench-{os.getpid()}")
    w = torch.randn(size, size, device="cuda", requires_grad=True)
    x = torch.randn(size, size, device="cuda")
    opt = torch.optim.SGD([w], lr=1e-6)
    q: queue.Queue = queue.Queue()
    last: dict = {}

    def ship() -> None:
        while (taken := q.get()) is not None:
            snap = loads(rank_cut.export(taken))
            for ks, rows in (snap.get("packed") or {}).values():
                for k, row in zip(ks, rows):
                    if k.startswith("obs/sys/"):
                        last[k] = row
    shipper = threading.Thread(target=ship, name="forge_obs-bench-ship")
    shipper.start()
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        with record_span("train_step"):
            loss = (x @ w).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            record_metric("loss", loss, Reduce.MEAN)  # a device value: read back at the export
            torch.cuda.synchronize()
        q.put(rank_cut.take(step))
        times.append(time.perf_counter() - t0)
    q.put(None)
    shipper.join()
    status = sampler.status()
    sampler.configure(False)
    return {"step_s_median": statistics.median(times[10:]), "values": last, "status": status}


def sample_cost(n: int, gpu: bool) -> float:
    from forge_obs.recording.telemetry.options import TelemetryOptions
    from forge_obs.recording.telemetry.sampler import Sampler

    s = Sampler(TelemetryOptions(gpu=gpu, interval_s=0.0), run_key=f"gpu-cost-{os.getpid()}-{gpu}")
    try:
        for _ in range(20):
            s.sample()
        costs = []
        for _ in range(n):
            t0 = time.thread_time_ns()
            s.sample()
            costs.append((time.thread_time_ns() - t0) / 1e3)
        return statistics.median(costs)
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", type=int, default=2048)
    args = ap.parse_args()
    missing = _need()
    if missing:
        print(f"gpu_telemetry: {missing}; nothing measured")
        return 2
    off = loop(args.steps, args.size, telemetry=False)
    on = loop(args.steps, args.size, telemetry=True)
    cost_gpu, cost_cpu = sample_cost(500, gpu=True), sample_cost(500, gpu=False)
    print(f"device(s) of this process: {on['status'].get('gpu_devices')}  (GPU telemetry: "
          f"{on['status'].get('gpu') or 'on'})")
    print("\nkeys at the last steps:")
    for k, v in sorted(on["values"].items()):
        val = v[0] / max(v[1], 1) if isinstance(v, (list, tuple)) and len(v) == 2 else v
        print(f"  {k:36s} {val}")
    print(f"\n{'figure':48s} {'value':>10s} {'target':>8s}")
    print(f"{'one sample, with the GPU part (CPU µs)':48s} {cost_gpu:10.1f} {'≤ 50':>8s}")
    print(f"{'one sample, without it (CPU µs; same run)':48s} {cost_cpu:10.1f}")
    ratio = on["step_s_median"] / off["step_s_median"]
    print(f"{'step time, telemetry on / off (same run)':48s} {ratio:10.3f}")
    out = ROOT / "bench" / "results" / "gpu_telemetry.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sample_us_gpu": cost_gpu, "sample_us_no_gpu": cost_cpu, "step_ratio": ratio,
                               "step_s_on": on["step_s_median"], "step_s_off": off["step_s_median"],
                               "status": on["status"], "values": {k: str(v) for k, v in on["values"].items()}},
                              indent=1))
    print(f"\n-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
