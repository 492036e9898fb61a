"""``forge-obs`` command line (the installed entry point): one subcommand per view of a run directory.

    forge-obs show runs/<run_id>            # the reduced metrics of a run, one line per step

The subcommands are defined in :mod:`forge_obs.analysis.commands`; this module builds the parser and
handles errors. A subcommand that needs an optional package which is not installed (duckdb for ``sql``,
viztracer for ``trace --open``) prints one line naming the extra that installs it, and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from forge_obs.analysis.commands import COMMANDS

__all__ = ["EXTRAS", "missing_dependency", "main"]

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
    sys.exit(main())
