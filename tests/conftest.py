"""Shared pytest set-up: real Monarch processes, quiet logs, fast death detection."""

import os
import pathlib

os.environ.setdefault("MONARCH_FILE_LOG", "error")
# Monarch's child processes unpickle test actors by module name (tests.test_x): make the repo
# root importable there too.
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
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
