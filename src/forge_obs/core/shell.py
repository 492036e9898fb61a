"""How a ``forge-obs`` command that this process prints is written, so that it works as printed
in the shell that started the process: the one rule of every command forge_obs and its apps print
(the run's "view live" line, the GRPO run's closing commands, the demos').

    >>> from forge_obs.core.shell import forge_obs_command, printed_command
    >>> forge_obs_command() in ("forge-obs", printed_command("serve", "runs").rsplit(" serve ", 1)[0])
    True

- ``forge-obs`` when the ``forge-obs`` found on ``PATH`` is this environment's (it is active);
- else the path of this environment's ``forge-obs`` script (``.venv/bin/forge-obs`` from the
  repository, before ``source .venv/bin/activate``), relative to the working directory when it is
  under it;
- else ``<this python> -m forge_obs.cli``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

__all__ = ["forge_obs_command", "printed_command", "python_command"]


def forge_obs_command() -> str:
    """How to call ``forge-obs`` from the shell that started this process, exactly."""
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    on_path = shutil.which("forge-obs")
    if on_path and os.path.dirname(os.path.abspath(on_path)) == bindir:
        return "forge-obs"
    script = os.path.join(bindir, "forge-obs")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return shlex.quote(_shell_path(script))
    return f"{python_command()} -m forge_obs.cli"


def python_command() -> str:
    """This process's Python as the shell that started it calls it (``.venv/bin/python``)."""
    return shlex.quote(_shell_path(sys.executable))


def printed_command(*args: object) -> str:
    """``forge-obs ARGS...`` as :func:`forge_obs_command` writes it, each argument quoted for the
    shell: ``printed_command("doctor", run_dir)``."""
    return " ".join([forge_obs_command(), *(shlex.quote(str(a)) for a in args)])


def _shell_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return os.path.abspath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)
