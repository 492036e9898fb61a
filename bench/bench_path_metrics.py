"""Cost per step of the ``critical_path`` backend (each step's critical path as metrics in every
backend), beside what the run pays anyway.

1. **The child process** (``forge_obs.alerts.path_worker``, nice 10, off the controller): per
   step, reading the stored result of newly settled steps from the run's index and making its
   line (``why(steps=...)`` + ``step_line``), in passes of ``--batch`` steps as a live run has
   them; beside the live indexer's own update per step (what the ``index`` backend pays for the
   same steps: the baseline) and the direct walk without the index (the fallback, whole run
   per pass).
2. **The controller's backend thread**: per step, parsing the line, the bounded keys and the
   slow-step check, and recording the ~20 values (``record_metric``); beside the controller's
   CPU per step of the GRPO app (32-36 ms, docs/alerts.md).
3. **The backends**: the W&B backend's ``log_step`` (offline) of a step of 40 values with and
   without the ~20 ``critical_path/*`` values, and TensorBoard's (thread CPU, least of three).

    python bench/bench_path_metrics.py [--steps 300] [--batch 10]

Prints a table and writes bench/results/path_metrics.json. Figures, never timed asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers


def _cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _grow(src: Path, dst: Path, steps: int, batch: int):
    """Yield after each ``batch`` of steps is appended to ``dst``'s files (cut at step boundaries
    of the controller's clock: every line whose time is before the cut)."""
    from tests.support.path_runs import T0_US

    files = {p.name: p.read_text().splitlines(keepends=True) for p in (src / "events").glob("*.jsonl")}
    (dst / "events").mkdir(parents=True)
    step_starts = []
    for line in files[next(n for n in files if "controller" in n)]:
        rec = json.loads(line)
        if isinstance(rec, list) and rec[0] == "S":
            step_starts.append(rec[1])
    for i in range(batch, steps + batch, batch):
        cut = step_starts[i] if i < len(step_starts) else 1 << 62
        for name, lines in files.items():
            keep = [lines[0]] + [ln for ln in lines[1:] if _ts(ln) < cut]
            (dst / "events" / name).write_text("".join(keep))
        yield min(i, steps), T0_US + cut


def _ts(line: str) -> int:
    rec = json.loads(line)
    if isinstance(rec, list) and rec:
        if isinstance(rec[0], int):
            return rec[0]
        if rec[0] in ("B", "S", "I", "T", "Z") and len(rec) > 1:
            return rec[2] if rec[0] == "B" else rec[1]
        return -1  # names, lanes: always
    return -1


def child_costs(src: Path, steps: int, batch: int) -> dict:
    """CPU per step of the index update (baseline) and of the child's pass over new steps."""
    from forge_obs.alerts.path_worker import results, step_line
    from forge_obs.analysis.critical_path import analyse
    from forge_obs.analysis.index import open_index

    with tempfile.TemporaryDirectory(prefix="bench_pm_") as tmp:
        dst = Path(tmp) / "run"
        update_s = pass_s = 0.0
        done = None
        for upto, _cut in _grow(src, dst, steps, batch):
            update_s += _cpu(lambda: open_index(dst, warn=False))
            t = time.process_time()
            lines = [step_line(r) for r in results(dst, done, update=False)]
            pass_s += time.process_time() - t
            done = max([-1 if done is None else done] + [ln["step"] for ln in lines])
        direct_s = _cpu(lambda: analyse(dst, index=False))
    return {"index_update_ms_per_step": 1e3 * update_s / steps, "child_pass_ms_per_step": 1e3 * pass_s / steps,
            "direct_walk_whole_run_s": direct_s}


def backend_costs(src: Path, n: int = 2000) -> dict:
    """µs per step on the controller's backend thread: line -> keys -> record_metric."""
    from forge_obs.alerts.path_metrics import CriticalPathBackend
    from forge_obs.alerts.path_worker import step_line
    from forge_obs.analysis.critical_path import why
    from forge_obs.recording.collector import record_metric
    from forge_obs.recording.reduce import Reduce

    lines = [json.loads(json.dumps(step_line(r))) for r in why(src, slowest=10**6)["steps"]]
    raw = [json.dumps(ln) for ln in lines]
    be = CriticalPathBackend({})
    be.run_dir = src
    t = time.thread_time()
    for i in range(n):
        line = json.loads(raw[i % len(raw)])
        values, row = be._values(line, line["step"] + 5)
        for k, v in values.items():
            record_metric(k, v, Reduce.LAST)
    per_us = (time.thread_time() - t) / n * 1e6
    return {"backend_thread_us_per_step": per_us, "values_per_step": len(values)}


def wandb_costs(src: Path, n: int = 200) -> dict:
    """ms per ``log_step`` of the W&B backend (offline) with and without the critical_path values,
    and of TensorBoard's."""
    os.environ.setdefault("WANDB_SILENT", "true")
    from forge_obs.alerts.path_metrics import PathKeys, CriticalPathOptions
    from forge_obs.alerts.path_worker import step_line
    from forge_obs.analysis.critical_path import why
    from forge_obs.backends.record import RunContext, StepRecord
    from forge_obs.backends.tensorboard import TensorBoardBackend
    from forge_obs.backends.wandb import WandbBackend
    from forge_obs.core.types import Metric

    keys = PathKeys(CriticalPathOptions())
    lines = [step_line(r) for r in why(src, slowest=10**6)["steps"]]
    base = [Metric(f"trainer/k{i}", float(i)) for i in range(40)]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_pm_wb_") as tmp:
        for name, cls, cfg in (("wandb", WandbBackend, {"mode": "offline", "project": "bench"}),
                               ("tensorboard", TensorBoardBackend, {})):
            for rep in range(3):  # interleaved; the least disturbed of three (thread CPU: this thread's work)
                for with_path in (False, True):
                    be = cls(dict(cfg))
                    be.init(run=RunContext(run_id=f"{name}{rep}{int(with_path)}", run_dir=Path(tmp) / f"{name}{rep}{int(with_path)}"))
                    t = time.thread_time()
                    for s in range(n):
                        ms = list(base)
                        if with_path:
                            ms += [Metric(k, float(v)) for k, v in keys.values(lines[s % len(lines)], 3).items()]
                        be.log_step(StepRecord(step=s, run_id="b", wall_time=time.time(), global_metrics=ms))
                    key = f"{name}_log_step_ms{'_with_path' if with_path else ''}"
                    out[key] = min(out.get(key, 1e9), (time.thread_time() - t) / n * 1e3)
                    be.finish()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=10, help="steps per pass of the child (a live run's rate x interval)")
    args = ap.parse_args()
    from tests.support.path_runs import grpo_run

    with tempfile.TemporaryDirectory(prefix="bench_pm_src_") as tmp:
        src = grpo_run(Path(tmp) / "src", args.steps, slow_replica=(1, 0.8), slow_from=args.steps // 2)
        res = {"steps": args.steps, "batch": args.batch, "load_avg": os.getloadavg()[0]}
        res.update(child_costs(src, args.steps, args.batch))
        res.update(backend_costs(src))
        res.update(wandb_costs(src))
    step_ms = 394.0  # the synthetic run's clean step (tests/support/path_runs.py)
    ctl_ms = 34.0  # the GRPO app's controller CPU per step (docs/alerts.md)
    rows = [
        ("child: reading + lines, per step (ms CPU)", f"{res['child_pass_ms_per_step']:.3f}",
         f"{100 * res['child_pass_ms_per_step'] / step_ms:.2f} % of a 0.39 s step, off the controller"),
        ("  baseline: the index update, per step (ms CPU)", f"{res['index_update_ms_per_step']:.3f}",
         "the live indexer pays it anyway"),
        ("  fallback: direct walk of the whole run (s CPU)", f"{res['direct_walk_whole_run_s']:.3f}",
         "per pass without DuckDB (at most 2 % of a core)"),
        ("backend thread, per step (µs CPU)", f"{res['backend_thread_us_per_step']:.1f}",
         f"{100 * res['backend_thread_us_per_step'] / 1e3 / ctl_ms:.2f} % of the GRPO controller's CPU per step"),
        ("W&B log_step, without / with the path (ms CPU)",
         f"{res['wandb_log_step_ms']:.3f} / {res['wandb_log_step_ms_with_path']:.3f}", "its own thread"),
        ("TensorBoard log_step, without / with (ms CPU)",
         f"{res['tensorboard_log_step_ms']:.3f} / {res['tensorboard_log_step_ms_with_path']:.3f}", "its own thread"),
    ]
    print(f"bench_path_metrics: {args.steps} steps, passes of {args.batch}, load {res['load_avg']:.1f}")
    w = max(len(r[0]) for r in rows)
    for name, val, note in rows:
        print(f"  {name:<{w}}  {val:>16}  {note}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "path_metrics.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
