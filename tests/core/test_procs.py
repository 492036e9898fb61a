"""forge_obs's child processes (the live indexer, the critical-path reader) stop on SIGTERM /
SIGINT without a signal handler that can deadlock: a second signal arriving while the first
one's stop request holds the lock of the stop event used to hang the process for good (seen: a
live indexer orphaned and blocked in ``Event.set`` under ``Event.set``)."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.helpers import CHILD_PATH

SCRIPT = textwrap.dedent('''
    import os, signal, sys, threading
    from pathlib import Path

    class Stop(threading.Event):
        """A stop event whose first set() is interrupted by a second SIGTERM while it holds its lock."""
        calls = 0

        def set(self):
            with self._cond:
                Stop.calls += 1
                if Stop.calls == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                    sum(range(10000))  # the signal is due here, inside the lock
                self._flag = True
                self._cond.notify_all()

    which, run = sys.argv[1], Path(sys.argv[2])
    stop = Stop()
    if which == "index":
        from forge_obs.analysis.index.live import follow
        args = (run, 0.05)
    else:
        from forge_obs.alerts.path_worker import follow
        args = (run, lambda line: None, 0.05, 0.0, False, 0.0, None)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # follow is waiting by then
    follow(*args, stop=stop)
    print("STOPPED", Stop.calls >= 1, flush=True)
''')


@pytest.mark.parametrize("which", ["index", "critical_path"])
def test_a_second_signal_during_the_first_stop_request_does_not_hang(tmp_path, which):
    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "stop.py"
    script.write_text(SCRIPT)
    try:
        res = subprocess.run([sys.executable, str(script), which, str(run)], capture_output=True, text=True,
                             timeout=30, env=dict(os.environ, PYTHONPATH=CHILD_PATH))
    except subprocess.TimeoutExpired:  # subprocess.run killed it (SIGKILL)
        pytest.fail("the process hung on a second SIGTERM")
    assert res.returncode == 0 and "STOPPED True" in res.stdout, res.stderr
