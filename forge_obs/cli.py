"""``forge-obs`` command line: one subcommand per view of a run directory.

    forge-obs show runs/<run_id>            # the reduced metrics of a run, one line per step

A subcommand that needs an optional package which is not installed (duckdb for ``sql``,
viztracer for ``trace --open``) prints one line naming the extra that installs it, and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

#: subcommand name -> (help, add_arguments, run) ; other modules register theirs here
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    def deco(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return deco


SHOW_MODES = ("global_reduce", "per_rank_reduce", "per_rank_no_reduce", "all")


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--mode", default="global_reduce", help=" | ".join(SHOW_MODES))


@command("show", "print a run's reduced metrics, one JSON line per step", _show_args)
def _show(args: argparse.Namespace) -> int:
    from forge_obs.store import read_jsonl

    if args.mode not in SHOW_MODES:
        print(f"forge-obs show: unknown --mode {args.mode!r}; valid: {', '.join(SHOW_MODES)}", file=sys.stderr)
        return 2
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"forge-obs show: no metrics.jsonl in {args.run_dir} (pass a run directory, e.g. runs/<run_id>)", file=sys.stderr)
        return 2
    mode = None if args.mode == "all" else args.mode
    try:
        for row in read_jsonl(path):  # streamed: the first lines print before the file is read
            if mode is None or row.get("mode") == mode:
                print(json.dumps(row))
    except BrokenPipeError:
        raise  # handled by main(): the reader (e.g. `head`) has gone
    except OSError as e:
        print(f"forge-obs show: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _load_plugins() -> None:
    """Subcommands defined in other modules (timeline, report, ...) register on import."""
    import importlib

    for mod in ("forge_obs.timeline.cli", "forge_obs.report.cli"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


#: optional dependency (top-level module) -> the extra of forge-obs that installs it
EXTRAS = {"duckdb": "timeline", "viztracer": "timeline", "perfetto": "timeline", "wandb": "wandb",
          "tensorboard": "tensorboard", "transformers": "grpo", "tokenizers": "grpo", "vllm": "vllm"}


def missing_dependency(cmd: str, module: str) -> str:
    """The one line printed when ``cmd`` needs a package that is not installed."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return f"forge-obs {cmd}: needs the Python package {top!r}, which is not installed: pip install {top}"
    return (f"forge-obs {cmd}: needs {top}, which is not installed: pip install 'forge-obs[{extra}]' "
            f"(in a checkout: pip install -e '.[{extra}]')")


def main(argv: list[str] | None = None) -> int:
    _load_plugins()
    parser = argparse.ArgumentParser(prog="forge-obs", description="Views of a forge_obs run directory")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, (help_, add_args, _fn) in sorted(COMMANDS.items()):
        add_args(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    try:
        rc = COMMANDS[args.cmd][2](args)
        sys.stdout.flush()
    except ModuleNotFoundError as e:
        name = e.name or ""
        if not name or name.split(".")[0] in ("forge_obs", "provisioner_hooks", "apps"):
            raise  # our own code is missing: a broken install, the traceback is the useful part
        print(missing_dependency(args.cmd, name), file=sys.stderr)
        return 2
    except BrokenPipeError:  # `forge-obs show ... | head -1`: the reader has what it wanted
        _quiet_stdout()
        return 0
    return rc


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    # run the registry of the importable module (plugins register there), not of __main__
    from forge_obs.cli import main as _main

    sys.exit(_main())
