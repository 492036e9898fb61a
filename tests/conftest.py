"""Shared pytest set-up: real Monarch processes, quiet logs, fast death detection."""

import os
import pathlib
import sys

os.environ.setdefault("MONARCH_FILE_LOG", "error")
# Monarch's child processes unpickle test actors by module name (tests.controller.test_x): make the
# repo root importable there too, and this checkout's src/ first, here and in every child, so the
# tests run this tree's forge_obs whichever checkout the environment was installed from.
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SRC = str(_ROOT / "src")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, str(_ROOT), os.environ.get("PYTHONPATH")) if p)
if sys.path[:1] != [_SRC]:
    sys.path.insert(0, _SRC)
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _monarch_fault_hook():
    """Without this, one dead child process (tests kill some on purpose) ends the session."""
    try:
        import monarch.actor
    except ImportError:
        yield
        return
    orig = monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = lambda failure: None
    yield
    monarch.actor.unhandled_fault_hook = orig


@pytest.fixture
def fresh_collector():
    """The process's collector, emptied before and after the test."""
    from forge_obs.recording.collector import MetricCollector

    c = MetricCollector()
    c.reset()
    c.set_streaming(False)
    yield c
    c.reset()
    c.set_streaming(False)
