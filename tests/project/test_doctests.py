"""The module docstrings' examples (``>>>``) run, every module of ``forge_obs``, in a fresh
interpreter (the examples record into the process's collector and start writer threads; the
test process keeps none of that).

No module is excluded: the ones that need Monarch (actors, fetcher, controller) have no examples
to run, and no example needs a GPU. A module whose source shows ``>>>`` but whose examples the
doctest finder does not see (a docstring that is not the first statement) fails here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "forge_obs"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))

RUNNER = r"""
import doctest, importlib, io, json, sys
out = {}
for name in sys.argv[1:]:
    buf = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False)
    try:
        module = importlib.import_module(name)
        for test in doctest.DocTestFinder().find(module, name):
            runner.run(test, out=buf.write)
        res = runner.summarize(verbose=False)
        out[name] = {"attempted": res.attempted, "failed": res.failed, "report": buf.getvalue()}
    except Exception as e:  # an import error is a failure of that module, reported with its name
        out[name] = {"attempted": 0, "failed": 1, "report": f"import failed: {type(e).__name__}: {e}"}
print("\n" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_DISABLE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-c", RUNNER, *MODULES], cwd=tmp_path_factory.mktemp("doctests"),
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_module_examples_run(module: str, results: dict) -> None:
    r = results[module]
    assert r["failed"] == 0, r["report"]
    path = PACKAGE.joinpath(*module.split(".")[1:])
    source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    if ">>>" in source:
        assert r["attempted"] > 0, f"{module} shows '>>>' examples that doctest does not find"


def test_examples_are_found() -> None:
    """The walk sees the whole package: the recording side, the analysis side and the hot path."""
    for name in ("forge_obs", "forge_obs.recording.collector", "forge_obs.recording.timeline", "forge_obs.analysis.trace",
                 "forge_obs.analysis.doctor.rules", "forge_obs.core.safe"):
        assert name in MODULES
