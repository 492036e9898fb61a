"""Shared pytest set-up: real Monarch processes, quiet logs, fast death detection."""

import os

os.environ.setdefault("MONARCH_FILE_LOG", "error")
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
    from forge_obs.collector import MetricCollector

    c = MetricCollector()
    c.reset()
    c.set_streaming(False)
    yield c
    c.reset()
    c.set_streaming(False)
