"""Stopping a child process the way a test must: by a signal it cannot have been told to ignore.

A background job of a non-interactive bash (``bash scripts/test.sh &``) starts with SIGINT
ignored, and so does every process it starts: a test that stops its server with SIGINT waits out
its timeout there and leaves the server running. :func:`stop_child` sends SIGTERM (what the
forge-obs servers take as Ctrl+C) and SIGKILL when the child is still there after the timeout.
"""

from __future__ import annotations

import subprocess

__all__ = ["stop_child"]


def stop_child(proc: subprocess.Popen, timeout_s: float = 30.0) -> tuple:
    """SIGTERM ``proc`` and wait for it; past ``timeout_s`` SIGKILL it and fail the test. Returns
    what :meth:`~subprocess.Popen.communicate` returns (the rest of its output)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"pid {proc.pid} ({proc.args!r}) was still running {timeout_s}s after SIGTERM: killed") from None
