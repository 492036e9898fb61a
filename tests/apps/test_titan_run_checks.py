"""``python -m apps.titan.run`` as a new user meets it: without the ``titan`` extra it says what
is missing and the command that installs it, exits non-zero and prints no command for a run;
when torchrun fails it prints no doctor / trace / sql command for a run directory that was never
written."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import ROOT, run_group


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORGE_DISABLE_METRICS", "FORGE_OBS_RUN_ID")}
    env.update(PYTHONPATH=os.pathsep.join((str(ROOT / "src"), str(ROOT))), MONARCH_FILE_LOG="error")
    return env


def test_without_the_extra_it_names_what_is_missing_and_how_to_install_it(tmp_path):
    """The extra's packages hidden from the interpreter (``sys.modules[name] = None``: what
    ``import`` and ``find_spec`` see of a package that is not installed)."""
    code = ("import sys, runpy\nfor m in ('torchtitan', 'datasets', 'tyro'): sys.modules[m] = None\n"
            "sys.argv = ['run', '--run-root', 'runs']\nrunpy.run_module('apps.titan.run', run_name='__main__')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "the 'titan' extra is not installed (missing: torchtitan, datasets, tyro)" in res.stderr, out
    assert '-m pip install "torch==2.13.0" && ' in res.stderr and ' -m pip install -e ".[titan]"' in res.stderr
    assert "Traceback" not in out and "doctor" not in out and "trace" not in out and "sql" not in out
    assert not (tmp_path / "runs").exists()  # nothing built, no run started


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs the titan extra")
def test_a_failed_torchrun_prints_no_command_for_a_run_that_does_not_exist(tmp_path):
    """TorchTitan rejects an unknown option on every rank: torchrun fails, the app exits with its
    code and says no run was written, and prints no command for one."""
    res = run_group([sys.executable, "-m", "apps.titan.run", "--run-root", str(tmp_path / "runs"), "--run-id", "bad",
                     "--steps", "1", "--", "--training.no_such_option", "1"], cwd=tmp_path, env=_env(), timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert f"no run was written to {tmp_path / 'runs' / 'bad'}" in res.stderr, out[-3000:]
    assert "titan run directory" not in out and " doctor " not in out and " sql " not in out
    assert not (tmp_path / "runs" / "bad" / "meta.json").exists()
