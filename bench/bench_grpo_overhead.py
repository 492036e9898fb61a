"""Overhead of forge_obs on a real GRPO run: the same run (apps/grpo, same seed and config) with
observability on, and with ``FORGE_DISABLE_METRICS=true``, in separate processes on the same
machine, alternating. Reports the median controller step time (one policy update: wait for a
batch, train on every rank, publish weights, flush) after the warm-up steps, and the ratio.

    python bench/bench_grpo_overhead.py                  # 3 runs each, 80 steps, vLLM when installed
    python bench/bench_grpo_overhead.py --runs 2 --steps 40 --generator torch

Prints a table and writes bench/results/grpo_overhead.json. Figures, never timed asserts.
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


def one_run(disabled: bool, args: argparse.Namespace, root: str, i: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), MONARCH_FILE_LOG="error")
    env.pop("FORGE_DISABLE_METRICS", None)
    if disabled:
        env["FORGE_DISABLE_METRICS"] = "true"
    run_id = f"{'off' if disabled else 'on'}{i}"
    cmd = [sys.executable, "-m", "apps.grpo.main", "--steps", str(args.steps), "--seed", "0", "--no-report",
           "--generator", args.generator, "--run-root", root, "--run-id", run_id, "--console-every", "1000000"]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    summary = json.loads((Path(root) / run_id / "grpo_summary.json").read_text())
    steps = summary["step_s"][args.warmup:]
    return {"obs": not disabled, "run_id": run_id, "generator": summary["generator"], "wall_s": time.time() - t0,
            "step_s_median": statistics.median(steps), "step_s_mean": statistics.fmean(steps),
            "train_loop_s": sum(summary["step_s"]), "steps": len(summary["step_s"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per setting (alternating on/off)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    ap.add_argument("--generator", default="auto")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grpo_overhead.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as root:
        for i in range(args.runs):
            for disabled in (False, True) if i % 2 == 0 else (True, False):
                r = one_run(disabled, args, root, i)
                rows.append(r)
                print(f"  run {r['run_id']:>5}: median step {r['step_s_median'] * 1e3:7.1f} ms  "
                      f"mean {r['step_s_mean'] * 1e3:7.1f} ms  ({r['wall_s']:.0f}s wall)", flush=True)
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
    print(f"  ratio on/off: {ratio:.3f}  (overhead {100 * (ratio - 1):+.1f} %)")
    out = {"benchmark": "grpo_overhead", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.platform(),
           "cores": os.cpu_count(), "steps": args.steps, "warmup": args.warmup, "runs": rows,
           "median_step_s_on": med_on, "median_step_s_off": med_off, "ratio": ratio,
           "overhead_pct": 100 * (ratio - 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
