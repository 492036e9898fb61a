"""Cost of ``forge-obs why`` (the per-step critical path) beside ``forge-obs doctor``.

1. **Offline**: wall time of :func:`forge_obs.analysis.critical_path.analyse` (every step's
   path, stages, slack and answer) on a 300-step GRPO-shaped run directory (tests/support/path_runs.py:
   9 processes, concurrent rollouts, a slow replica from step 150), median of 5, warm; beside the
   floor (one pass of the timeline reader) and the doctor on the same directory. Target: <= 1 s.
2. **Per step**: the walk of one step (``Walker.path`` + summary) once the graph is loaded, as a
   share of the median step time: what evaluating every step live would cost. Target: <= 1 %.
3. **Live alert citation**: :func:`~forge_obs.analysis.critical_path.explain` at the run's last
   step (what an alert about time pays when it fires, on the alerts backend's thread, counted in
   ``obs/cpu_alerts_s``), and that time as a share of the run's wall time, per alert.

    python bench/bench_why.py                      # a fresh synthetic 300-step run
    python bench/bench_why.py --run-dir runs/<id>  # an existing run (e.g. bench_doctor.py's GRPO run)

Prints a table and writes bench/results/why.json. Figures, never timed asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers


def _median_s(fn, repeat: int = 5) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    from forge_obs.analysis import reader
    from forge_obs.analysis.critical_path import analyse, explain
    from forge_obs.analysis.critical_path.graph import load
    from forge_obs.analysis.critical_path.summary import Busy, step_result
    from forge_obs.analysis.critical_path.walk import Walker
    from forge_obs.analysis.doctor import diagnose_run

    tmp = None
    run_dir = args.run_dir
    if run_dir is None:
        from tests.support.path_runs import grpo_run

        tmp = tempfile.TemporaryDirectory(prefix="bench_why_")
        run_dir = grpo_run(Path(tmp.name) / "run", args.steps, slow_replica=(1, 0.8), slow_from=args.steps // 2)
    size_mb = sum(p.stat().st_size for p in (run_dir / "events").glob("*.jsonl")) / 1e6
    floor_s = _median_s(lambda: sum(1 for _ in reader.walk(reader.scan(run_dir))))
    why_s = _median_s(lambda: analyse(run_dir))
    doctor_s = _median_s(lambda: diagnose_run(run_dir))
    last = max(w.step for w in load(run_dir).windows)
    alert_s = _median_s(lambda: explain(run_dir, last - 5, last - 1))
    g = load(run_dir)
    walker = Walker(g)
    busy = Busy(g, walker)
    per_step = []
    for w in g.windows:
        t = time.perf_counter()
        step_result(g, walker, busy, w)
        per_step.append(time.perf_counter() - t)
    step_walk_s = statistics.median(per_step)
    step_s = statistics.median(w.end - w.start for w in g.windows) / 1e6
    res = {"run_dir": str(run_dir), "steps": len(g.windows), "events_mb": round(size_mb, 3),
           "why_offline_s": why_s, "reader_floor_s": floor_s, "doctor_s": doctor_s,
           "step_walk_ms": step_walk_s * 1e3, "median_step_s": step_s,
           "step_walk_share": step_walk_s / step_s if step_s else None, "alert_citation_s": alert_s,
           "alert_citation_share_of_run": alert_s / (step_s * len(g.windows)) if step_s else None}
    rows = [("forge-obs why, whole run (s)", f"{why_s:.3f}", "<= 1 s"),
            ("  reader floor: one pass (s)", f"{floor_s:.3f}", ""),
            ("  forge-obs doctor, same run (s)", f"{doctor_s:.3f}", "<= 1 s"),
            ("one step's walk + summary (ms)", f"{step_walk_s * 1e3:.3f}", ""),
            ("  share of the median step", f"{100 * res['step_walk_share']:.3f} %", "<= 1 %"),
            ("live alert citation, at the last step (s)", f"{alert_s:.3f}", ""),
            ("  share of the run's wall time, per alert", f"{100 * res['alert_citation_share_of_run']:.3f} %", "")]
    print(f"bench_why: {res['steps']} steps, {size_mb:.2f} MB of events ({run_dir})")
    w = max(len(r[0]) for r in rows)
    for name, val, target in rows:
        print(f"  {name:<{w}}  {val:>10}  {target}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "why.json").write_text(json.dumps(res, indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
