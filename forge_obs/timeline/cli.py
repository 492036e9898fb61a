"""``forge-obs trace | sql | doctor`` (registered with :mod:`forge_obs.cli` on import)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from forge_obs.cli import command


def _check_run_dir(p: Path) -> bool:
    if not p.is_dir():
        print(f"forge-obs: {p} is not a run directory", file=sys.stderr)
        return False
    return True


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, default=None, help="default: <run_dir>/trace.json")
    p.add_argument("--steps", default=None, help="step range, inclusive: 10:20, 10:, :20 or 7")
    p.add_argument("--ranks", default=None, help="ranks to keep: 0,3 or 0-7")
    p.add_argument("--meshes", default=None, help="meshes to keep: trainer,generator")


@command("trace", "export the run's timeline to a Perfetto / Chrome JSON trace", _trace_args)
def _trace(args: argparse.Namespace) -> int:
    from forge_obs.timeline.export import export_trace, parse_list, parse_steps

    if not _check_run_dir(args.run_dir):
        return 2
    out = args.output or (args.run_dir / "trace.json")
    try:
        steps = parse_steps(args.steps)
        ranks = parse_list(args.ranks, int)
    except ValueError as e:
        print(f"forge-obs trace: {e}", file=sys.stderr)
        return 2
    stats = export_trace(args.run_dir, out, steps, ranks, parse_list(args.meshes))
    print(
        f"wrote {out}: {stats['tracks']} process tracks, {stats['slices']} slices, "
        f"{stats['unfinished']} unfinished, {stats['errors']} errors, {stats['flows']} flow arrows "
        f"(open in https://ui.perfetto.dev)"
    )
    return 0


def _sql_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("query", help="SQL over the views metrics, spans, events (DuckDB dialect)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


@command("sql", "query a run with DuckDB: views metrics, spans, events", _sql_args)
def _sql(args: argparse.Namespace) -> int:
    if not _check_run_dir(args.run_dir):
        return 2
    try:
        from forge_obs.timeline.sql import connect, format_result
    except ImportError as e:
        print(f"forge-obs sql needs duckdb (pip install 'forge-obs[timeline]'): {e}", file=sys.stderr)
        return 2
    con = connect(args.run_dir)
    try:
        cur = con.execute(args.query)
    except Exception as e:  # noqa: BLE001 - a user's SQL error
        print(f"forge-obs sql: {e}", file=sys.stderr)
        return 1
    cols = [d[0] for d in (cur.description or [])]
    rows = cur.fetchall()
    print(format_result(cols, rows, args.format))
    return 0


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", action="store_true", help="findings and notes as JSON: {\"findings\": [...], \"notes\": [...]}")
    p.add_argument("--stall-min-s", type=float, default=None, help="shortest silence / open span reported (default 0.5)")
    p.add_argument("--sync-spans", default=None, metavar="REGEX",
                   help="span names that move state (sync_bottleneck; default: weight|sync|ckpt|checkpoint|reload|barrier)")
    p.add_argument("--sync-share", type=float, default=None, metavar="FRACTION",
                   help="share of a process's time a sync span may take before it is reported (default 0.5)")
    p.add_argument("--rule", action="append", default=[], metavar="'KEY OP NUMBER'",
                   help="also report steps where a global metric crosses a threshold, e.g. 'trainer/loss > 10' (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="any doctor threshold by name, e.g. straggler_ratio=2 (see docs/timeline.md; repeatable)")


@command("doctor", "find stragglers, slowdowns, stalls, hangs, sync bottlenecks, non-finite metrics, missing ranks; "
                   "exit 1 on findings", _doctor_args)
def _doctor(args: argparse.Namespace) -> int:
    from forge_obs.timeline.doctor import diagnose_run

    if not _check_run_dir(args.run_dir):
        return 2
    kw: dict = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"forge-obs doctor: --set takes NAME=VALUE, got {item!r}", file=sys.stderr)
            return 2
        kw[name.strip()] = value.strip()
    if args.stall_min_s is not None:
        kw["stall_min_s"] = args.stall_min_s
    if args.sync_spans is not None:
        kw["sync_spans"] = args.sync_spans
    if args.sync_share is not None:
        kw["sync_share"] = args.sync_share
    try:
        d = diagnose_run(args.run_dir, rules=args.rule, **kw)
    except ValueError as e:
        print(f"forge-obs doctor: {e}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(d.to_dict(), indent=2, default=str) if args.json else d.format())
    except BrokenPipeError:  # `forge-obs doctor ... | head`
        sys.stderr.close()
    return 1 if d.findings else 0
