"""``forge-obs report`` (registered with :mod:`forge_obs.cli` on import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from forge_obs.cli import command


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, default=None, help="default: <run_dir>/report.html")


@command("report", "write a self-contained HTML report of a run (charts, per-rank views, doctor, metadata)", _report_args)
def _report(args: argparse.Namespace) -> int:
    from forge_obs.report.html import write_report

    run_dir: Path = args.run_dir
    if not run_dir.is_dir() or not ((run_dir / "metrics.jsonl").exists() or (run_dir / "meta.json").exists()):
        print(f"forge-obs: {run_dir} is not a run directory (no metrics.jsonl or meta.json)", file=sys.stderr)
        return 2
    out = write_report(run_dir, args.output)
    print(out)
    return 0
