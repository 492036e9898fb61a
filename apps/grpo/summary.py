"""The end of a GRPO run: ``grpo_summary.json`` and ``report.html`` in its run directory, the
reward trend and the commands that look at the run, printed as they work in the shell that
started it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
from dataclasses import dataclass, field

from forge_obs.analysis.store import read_metrics
from forge_obs.core.shell import forge_obs_command


@dataclass
class StepLog:
    """The controller's clock over the run, for the progress bar and the summary (one clock:
    what they print agrees)."""

    run_start: float = 0.0  # wall clock when the run started (before start-up)
    train_start: float | None = None  # wall clock when training started
    durations_s: list = field(default_factory=list)  # the controller's time per step
    end_wall: list = field(default_factory=list)  # wall clock at the end of each step

    def phases(self, now: float) -> tuple[float, float, float]:
        """(start-up, training, shutdown) seconds of the run until ``now``: start-up until
        training started, training until its last step ended, shutdown after it."""
        train_start = self.train_start if self.train_start is not None else now
        train_end = self.end_wall[-1] if self.end_wall else train_start
        return train_start - self.run_start, train_end - train_start, now - train_end


def write_summary(args: argparse.Namespace, run_dir: str, steps: StepLog, now: float, gen_kind: str) -> dict:
    """``grpo_summary.json`` and ``report.html`` in the run directory; prints the reward trend, the
    run's time as the progress bar splits it, and the commands that look at the run. Returns the
    summary."""
    startup_s, training_s, shutdown_s = steps.phases(now)
    summary = summarize(run_dir, steps.durations_s, now - steps.run_start, gen_kind)
    summary.update(step_end_wall=steps.end_wall, startup_s=startup_s, training_s=training_s, shutdown_s=shutdown_s)
    if not args.no_report:
        from forge_obs.analysis.report import write_report

        summary["report"] = str(write_report(run_dir))
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "grpo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    k = summary["reward_window"]
    print(f"\n[grpo] reward: first {k} steps {summary['reward_first10']:.3f} -> last {k} steps "
          f"{summary['reward_last10']:.3f}   ({summary['steps']} steps, {summary['wall_s']:.0f}s elapsed: start-up "
          f"{startup_s:.0f}s, training {training_s:.0f}s, shutdown {shutdown_s:.0f}s)")
    print(end_text(run_dir, with_report="report" in summary, with_alerts=not args.no_alerts), end="")
    return summary


def end_text(run_dir: str, with_report: bool, with_alerts: bool = False) -> str:
    """The lines printed after a run: where it is and the commands that look at it (each works
    as printed, in the shell that started the run: :func:`forge_obs.core.shell.forge_obs_command`)."""
    fo = forge_obs_command()
    d = shlex.quote(str(run_dir))
    report = f"   report: {os.path.join(str(run_dir), 'report.html')}" if with_report else ""
    lines = [
        f"[grpo] run directory: {run_dir}{report}",
        f"  {fo} doctor {d}           # findings: stragglers, hangs, stalls, NaNs, missing ranks",
        f"  {fo} why {d} --slowest 3  # why the slowest steps were slow: their critical path across actors",
        f"  {fo} trace {d} --open     # the timeline in the Perfetto UI (offline, 127.0.0.1)",
        f"  {fo} report {d}           # (re)write report.html",
        f"  {fo} sql {d} \"SELECT name, count(*) AS n, median(dur_ms) AS median_ms FROM spans GROUP BY name ORDER BY n DESC\"",
    ]
    if with_alerts:
        lines.append(f"  cat {shlex.quote(os.path.join(str(run_dir), 'alerts.jsonl'))}   # the live alerts of this run")
    return "\n".join(lines) + "\n"


def summarize(run_dir: str, step_times: list, wall_s: float, gen_kind: str) -> dict:
    """The run's summary: its reward per step (``trainer/reward_mean``, from the store), the mean
    reward of the first and of the last steps, and the controller's step times."""
    try:
        rows = sorted(read_metrics(run_dir, "global_reduce"), key=lambda r: r["step"])
    except FileNotFoundError:  # FORGE_DISABLE_METRICS=true: no store
        rows = []
    rewards = [r["metrics"]["trainer/reward_mean"] for r in rows if "trainer/reward_mean" in r.get("metrics", {})]
    n = min(10, max(1, len(rewards) // 2))
    return {
        "run_dir": run_dir, "generator": gen_kind, "steps": len(step_times), "wall_s": wall_s,
        "step_s_median": statistics.median(step_times) if step_times else None,
        "reward_window": n,  # steps averaged at each end: 10, fewer for a short run
        "reward_first10": statistics.fmean(rewards[:n]) if rewards else float("nan"),
        "reward_last10": statistics.fmean(rewards[-n:]) if rewards else float("nan"),
        "rewards": rewards,
        "step_s": step_times,
    }
