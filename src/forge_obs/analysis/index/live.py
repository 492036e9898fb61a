"""Indexing while the run goes: one process per run that brings its index up to date every
``interval_s``, so that a new step is a lookup for ``sql``, ``why`` (and ``serve``) within
about ``interval_s`` of its flush, whoever asks.

It is a child process of the controller (started by the ``index`` backend:
``"index": {"interval_s": 1.5}`` in ``init_backends``), at a low priority, apart from the
controller's GIL: it never delays a flush. It exits when the run finishes (after one last
update) or when the controller is gone. Without it, the first command after the run builds the
index, and every command indexes what was appended since the last one.

    python -m forge_obs.analysis.index.live RUN_DIR [--interval-s 1.5] [--cpu-share 0.01] [--parent PID]
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.backends.base import LoggerBackend
from forge_obs.core.procs import StopSignals, parent_alive

__all__ = ["follow", "IndexBackend", "DEFAULT_INTERVAL_S", "start_indexer", "stop_indexer"]

#: seconds between updates: a step is queryable at most this (and the update's own time) after its flush
DEFAULT_INTERVAL_S = 1.5


def follow(run_dir: Path, interval_s: float = DEFAULT_INTERVAL_S, parent: "int | None" = None,
           stop: "threading.Event | None" = None, cpu_share: float = 0.0) -> int:
    """Update the index of ``run_dir`` every ``interval_s`` until ``stop`` is set, SIGTERM /
    SIGINT arrives or process ``parent`` is gone; then once more. With ``cpu_share`` (e.g. 0.01)
    it waits longer after an update that cost more, so that it uses at most that share of one
    core. Returns the number of updates."""
    from forge_obs.analysis.index import store
    from forge_obs.analysis.index.updater import update_index
    from forge_obs.analysis.index.window import Window

    stop = stop or threading.Event()
    signals = StopSignals(stop)
    _warm()
    d = store.index_dir(run_dir)
    window = Window()  # the last steps' rows, kept between updates
    n = 0
    while True:
        last = stop.is_set() or (parent is not None and not parent_alive(parent))
        cost = time.process_time()
        if (run_dir / "events").is_dir() or (run_dir / "metrics.jsonl").exists():
            try:
                update_index(run_dir, d, window=window)
                n += 1
            except Exception as e:  # noqa: BLE001 - the next pass tries again; the files are the record
                print(f"forge_obs index: {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        if last:
            return n
        cost = time.process_time() - cost
        signals.wait(max(interval_s, cost / cpu_share - cost) if cpu_share > 0 else interval_s)


def _warm() -> None:
    """What the updates import on first use, imported at start (once, not in the first update
    that writes or merges a segment): DuckDB, pyarrow's compute functions, and pandas, which
    pyarrow imports the first time it turns Python lists into arrays."""
    import duckdb  # noqa: F401
    import pyarrow as pa
    import pyarrow.compute  # noqa: F401

    pa.array([0])


def start_indexer(run_dir: "str | Path", interval_s: float = DEFAULT_INTERVAL_S) -> subprocess.Popen:
    """The live indexer of ``run_dir`` in a child process of this one, at a low priority (it exits
    when this process is gone; :func:`stop_indexer` ends it)."""
    src = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-m", "forge_obs.analysis.index.live", str(run_dir), "--interval-s", str(interval_s),
         "--parent", str(os.getpid())], env=env, stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))


def stop_indexer(p: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """One last update of what the run wrote, then the indexer exits (killed past ``timeout_s``)."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class IndexBackend(LoggerBackend):
    """Keeps the run's index up to date while it runs (see the module docstring); logs nothing.
    Config: ``interval_s`` (default 1.5)."""

    def __init__(self, logger_backend_config: "dict[str, Any] | None" = None) -> None:
        cfg = dict(logger_backend_config or {})
        interval = cfg.pop("interval_s", DEFAULT_INTERVAL_S)
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not 0.05 <= interval <= 3600:
            raise ValueError(f"index: interval_s must be a number of seconds in [0.05, 3600], got {interval!r}")
        if cfg:
            raise ValueError(f"index: unknown key {sorted(cfg)[0]!r}; valid: interval_s")
        super().__init__({})
        self.interval_s = float(interval)
        self.proc: "subprocess.Popen | None" = None

    def init(self, run: Any = None, **kwargs: Any) -> None:
        super().init(run)
        run_dir = getattr(run, "run_dir", None)
        if run_dir is None or self.proc is not None:
            return
        self.proc = start_indexer(run_dir, self.interval_s)

    def log_step(self, record: Any) -> None:
        return None

    def finish(self, timeout_s: float = 60.0) -> None:
        """One last update of what the run wrote, then the indexer exits (killed past ``timeout_s``)."""
        p, self.proc = self.proc, None
        if p is not None:
            stop_indexer(p, timeout_s)


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forge_obs.analysis.index.live", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--interval-s", type=float, default=DEFAULT_INTERVAL_S)
    ap.add_argument("--parent", type=int, default=None)
    ap.add_argument("--cpu-share", type=float, default=0.0, help="use at most this share of one core (e.g. 0.01)")
    args = ap.parse_args(argv)
    _warm()
    gc.freeze()  # what start-up made stays: the collector never walks it again
    follow(args.run_dir, args.interval_s, args.parent, cpu_share=args.cpu_share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
