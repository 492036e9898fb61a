"""Cost of ``forge-obs doctor`` and of the live ``"alerts"`` backend on a real GRPO run.

1. **Doctor**: wall time of :func:`forge_obs.analysis.doctor.diagnose_run` on a 300-step GRPO run
   directory (median of 5, warm), against the floor any doctor pays in the same run: one pass
   of the timeline reader over ``events/`` plus parsing ``metrics.jsonl``. Target: <= 1 s.
2. **Live rules**: the run has ``"alerts"`` on (the GRPO app's default); every step reports the
   backend's own CPU as ``obs/cpu_alerts_s`` (rules on the backend thread, watchdog, sink
   thread). Compared with the controller process's CPU per step over the same steps (sampled
   from ``/proc/<pid>/stat`` while the run goes, cut at the first and last step's end).
   Target: <= 1 % per step.

    python bench/bench_doctor.py                          # a fresh 300-step run (vLLM when installed)
    python bench/bench_doctor.py --generator torch --steps 300
    python bench/bench_doctor.py --run-dir runs/<id>      # only the doctor, on an existing run

Prints a table and writes bench/results/doctor.json. Figures, never timed asserts.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers
from _timing import proc_stat  # noqa: E402  (bench/, beside this script)


class ProcCpu:
    """Samples a process's user+system CPU seconds (``/proc/<pid>/stat``) with wall time."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> float | None:
        st = proc_stat(self.pid)
        return None if st is None else st[1]

    def _run(self) -> None:
        while not self._stop.is_set():
            c = self._read()
            if c is not None:
                self.samples.append((time.time(), c))
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def at(self, wall: float) -> float:
        """CPU seconds at ``wall``, interpolated between samples."""
        s = self.samples
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= wall <= t1:
                return c0 + (c1 - c0) * (wall - t0) / max(t1 - t0, 1e-9)
        return s[-1][1] if wall > s[-1][0] else s[0][1]


def run_grpo(args: argparse.Namespace, root: str) -> tuple[Path, dict, ProcCpu]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), MONARCH_FILE_LOG="error")
    env.pop("FORGE_DISABLE_METRICS", None)
    cmd = [sys.executable, "-m", "apps.grpo.main", "--steps", str(args.steps), "--seed", "0", "--no-report",
           "--generator", args.generator, "--run-root", root, "--run-id", "bench", "--console-every", "1000000"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cpu = ProcCpu(p.pid)
    cpu.start()
    out, _ = p.communicate()
    cpu.stop()
    if p.returncode != 0:
        raise SystemExit(f"GRPO run failed:\n{out[-4000:]}")
    run_dir = Path(root) / "bench"
    return run_dir, json.loads((run_dir / "grpo_summary.json").read_text()), cpu


def floor_s(run_dir: Path) -> float:
    """One pass of the timeline reader plus parsing metrics.jsonl: what any doctor pays."""
    from forge_obs.analysis import reader
    from forge_obs.analysis.store import read_jsonl

    t0 = time.perf_counter()
    run = reader.scan(run_dir)
    for _ in reader.walk(run):
        pass
    for _ in read_jsonl(run_dir / "metrics.jsonl"):
        pass
    return time.perf_counter() - t0


def doctor_s(run_dir: Path) -> tuple[float, list]:
    from forge_obs.analysis.doctor import diagnose_run

    t0 = time.perf_counter()
    d = diagnose_run(run_dir)
    return time.perf_counter() - t0, [f"[{f.kind}] {f.where} steps {f.steps}" for f in d.findings]


def alerts_cost(run_dir: Path, summary: dict, cpu: ProcCpu | None, warmup: int) -> dict:
    from forge_obs.analysis.store import read_metrics

    rows = {r["step"]: r["metrics"] for r in read_metrics(run_dir, "global_reduce")}
    steps = sorted(s for s in rows if warmup <= s < summary["steps"])
    per_step = [rows[s].get("obs/cpu_alerts_s", 0.0) for s in steps]
    out = {"steps": len(steps), "alerts_cpu_per_step_ms": 1e3 * statistics.fmean(per_step),
           "alerts_cpu_p50_ms": 1e3 * statistics.median(per_step),
           "alerts_cpu_p99_ms": 1e3 * sorted(per_step)[int(0.99 * (len(per_step) - 1))],
           "pipeline_cpu_per_step_ms": 1e3 * statistics.fmean(rows[s].get("obs/cpu_pipeline_s", 0.0) for s in steps)}
    ends = summary.get("step_end_wall") or []
    if cpu is not None and cpu.samples and len(ends) > warmup:
        ctl_s = cpu.at(ends[-1]) - cpu.at(ends[warmup - 1] if warmup else ends[0])
        n = len(ends) - warmup
        out["controller_cpu_per_step_ms"] = 1e3 * ctl_s / n
        out["share_of_controller_cpu"] = out["alerts_cpu_per_step_ms"] / out["controller_cpu_per_step_ms"]
        out["step_s_median"] = statistics.median(summary["step_s"][warmup:])
    alerts = run_dir / "alerts.jsonl"
    rows = [json.loads(ln) for ln in alerts.read_text().splitlines()] if alerts.exists() else []
    out["alerts_fired"] = [f"{a['rule']} {a['where']} step {a['step']}" + (" (consequence)" if a.get("consequence_of") else "")
                           for a in rows if a["state"] == "firing"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--generator", default="auto", choices=["auto", "vllm", "torch"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--run-dir", type=Path, default=None, help="an existing GRPO run: doctor timing only")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the GRPO run directory (printed)")
    args = ap.parse_args()

    tmp = None
    cpu = summary = None
    if args.run_dir is None:
        tmp = tempfile.mkdtemp(prefix="bench_doctor_")
        print(f"running GRPO for {args.steps} steps (generator {args.generator}) ...", flush=True)
        run_dir, summary, cpu = run_grpo(args, tmp)
    else:
        run_dir = args.run_dir
    events = sum(f.stat().st_size for f in (run_dir / "events").glob("*.jsonl"))
    doctor_s(run_dir)  # warm: imports
    times, floors, found = [], [], []
    for _ in range(args.repeats):
        t, found = doctor_s(run_dir)
        times.append(t)
        floors.append(floor_s(run_dir))
    res = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "run_steps": summary["steps"] if summary else None, "events_mb": events / 1e6,
        "doctor_s": statistics.median(times), "floor_s": statistics.median(floors), "findings": found,
    }
    res["doctor_vs_floor"] = res["doctor_s"] / res["floor_s"]
    if summary is not None:
        res["alerts"] = alerts_cost(run_dir, summary, cpu, args.warmup)

    print(f"\nforge-obs doctor on {run_dir} ({res['events_mb']:.1f} MB of events, "
          f"{res['run_steps'] or '?'} steps, {len(found)} finding(s){': ' if found else ''}{'; '.join(found)})")
    print(f"{'figure':<44}{'value':>12}  {'target':<12}")
    print(f"{'doctor wall time (median of ' + str(args.repeats) + ')':<44}{res['doctor_s']:>11.3f}s  <= 1 s")
    print(f"{'floor: read events + metrics once':<44}{res['floor_s']:>11.3f}s")
    print(f"{'doctor / floor':<44}{res['doctor_vs_floor']:>11.2f}x")
    a = res.get("alerts")
    if a:
        print(f"\nlive alerts over {a['steps']} steps (after {args.warmup} warm-up steps); "
              f"{len(a['alerts_fired'])} alert(s) fired{': ' if a['alerts_fired'] else ''}{'; '.join(a['alerts_fired'])}")
        print(f"{'obs/cpu_alerts_s per step (mean)':<44}{a['alerts_cpu_per_step_ms']:>10.3f}ms")
        print(f"{'obs/cpu_alerts_s per step (p50 / p99)':<44}{a['alerts_cpu_p50_ms']:>6.3f}/{a['alerts_cpu_p99_ms']:.3f}ms")
        print(f"{'obs/cpu_pipeline_s per step (all backends)':<44}{a['pipeline_cpu_per_step_ms']:>10.3f}ms")
        if "controller_cpu_per_step_ms" in a:
            print(f"{'controller process CPU per step':<44}{a['controller_cpu_per_step_ms']:>10.3f}ms")
            print(f"{'alerts / controller CPU per step':<44}{100 * a['share_of_controller_cpu']:>10.3f}%   <= 1 %")
            print(f"{'controller step time (median)':<44}{a['step_s_median']:>11.3f}s")
    out = ROOT / "bench" / "results" / "doctor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    if tmp and args.keep:
        print(f"kept {run_dir}")
    elif tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
