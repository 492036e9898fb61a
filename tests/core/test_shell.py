"""The one rule of every ``forge-obs`` command forge_obs and its apps print: it works as printed in
the shell that started the process (:mod:`forge_obs.core.shell`)."""

from __future__ import annotations

import os
import sys

import pytest

from forge_obs.core import shell


@pytest.fixture
def venv(tmp_path, monkeypatch):
    """A virtual environment's bin/ with python and forge-obs, the working directory above it."""
    bindir = tmp_path / ".venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    script = bindir / "forge-obs"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.chdir(tmp_path)
    return bindir


def test_an_active_environment_prints_the_bare_command(venv, monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv), "/usr/bin", "/bin"]))
    assert shell.forge_obs_command() == "forge-obs"
    assert shell.printed_command("serve", "my runs") == "forge-obs serve 'my runs'"


def test_before_activation_the_environment_script_is_printed_relative_to_the_shell(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert shell.forge_obs_command() == ".venv/bin/forge-obs"
    assert shell.printed_command("serve", "runs") == ".venv/bin/forge-obs serve runs"


def test_without_the_script_python_runs_the_module(venv, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    (venv / "forge-obs").unlink()
    assert shell.forge_obs_command() == ".venv/bin/python -m forge_obs.cli"


def test_the_rule_is_written_once():
    """No second copy of the rule (the GRPO app had its own): only this module looks for the
    ``forge-obs`` script. What the run's start line prints before activation is tested in
    tests/backends/test_init_backends.py; the GRPO run's commands in tests/apps/test_grpo_commands.py."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = sorted(str(p.relative_to(root)) for d in ("src", "apps") for p in (root / d).rglob("*.py")
                   if 'which("forge-obs")' in p.read_text() or "'forge-obs')" in p.read_text())
    assert found == ["src/forge_obs/core/shell.py"], found
