"""The ``"critical_path"`` backend: every controller step's critical path as metrics in every
backend, under ``critical_path/`` (one section in W&B and TensorBoard).

    await mlogger.init_backends.call_one({
        "wandb": {"mode": "offline"},
        "critical_path": {},          # {"stages": 6, "settle_s": 2.0, ...}: CriticalPathOptions
    })

Per step ``M`` (docs/backends.md, "Critical path per step"):

- ``critical_path/step``: ``M``, the step the other keys describe (their x-axis: W&B's
  ``define_metric("critical_path/*", step_metric="critical_path/step")``, TensorBoard's step);
- ``critical_path/duration_s``, ``critical_path/explained_frac`` (the share of the step its
  spans explain), ``critical_path/unexplained_s``, ``critical_path/unfinished`` (1: a span on
  its path never ended), ``critical_path/cause_share``, ``critical_path/lag_steps``;
- ``critical_path/path_s/<mesh>/<span>``: time on the path per stage (mesh, actor, span name,
  over the ranks) for at most ``max_stage_keys`` stages over the run (each step's largest
  ``stages`` get one while there is room; 0 at a step where it is not on the path) and
  ``critical_path/path_s/other``: they add up to the step;
- ``critical_path/idle_s/<mesh>`` (its ranks' mean) and ``critical_path/waiting_s/<mesh>`` (its
  most waiting rank's), per mesh (replicas as one: ``generator``), at most ``max_mesh_keys``;
- ``critical_path/slow_steps``: a row (``Reduce.SAMPLE``: a W&B table, TensorBoard text) for a
  step ``slow_ratio`` times the median of the steps before it, or unfinished: its culprit
  (mesh, actor, rank, stage), share, the one-line answer and the ``forge-obs why`` / ``trace``
  commands that show it (at most ``max_slow_rows`` per run).

Where it is computed: a child process (:mod:`.path_worker`) reads each step's stored result from
the run's index once the step *settled* (``settle_s`` after it ended: its spans reach the files
only as each process's timeline writer passes), at a low priority, apart from the controller's
GIL. This backend, on its own thread, records one step's values (``record_metric`` on the
controller) and records the next only once a step that carried them reached it: each ``M``
travels with exactly one step ``N > M`` to every backend (JSONL, console when its ``include``
names ``critical_path/``, W&B, TensorBoard, yours). What is still to log at shutdown (the last
steps: their spans were written after the last flush) is handed to W&B, TensorBoard and JSONL
(:mod:`forge_obs.backends.late`), which write it after the last step (JSONL: rows of mode
``late`` under the step they describe); so every step's values reach every backend that writes
at shutdown once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_obs.backends.base import LoggerBackend
from forge_obs.backends.late import LATE, PATH_PREFIX, PATH_STEP_KEY, TABLE_KEYS, LateValues
from forge_obs.core.options import parse_options
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.shell import printed_command
from forge_obs.recording.collector import record_metric
from forge_obs.recording.reduce import Reduce

__all__ = ["CriticalPathOptions", "PathKeys", "CriticalPathBackend", "PREFIX", "STEP_KEY", "SLOW_KEY", "slow_row"]

logger = logging.getLogger("forge_obs")

PREFIX = PATH_PREFIX
#: the step the other keys describe: their x-axis
STEP_KEY = PATH_STEP_KEY
#: rows of the slow steps (a table)
SLOW_KEY = TABLE_KEYS[0]


@dataclass(kw_only=True, slots=True)
class CriticalPathOptions:
    """The ``"critical_path"`` config: ``init_backends({"critical_path": {...}})``."""

    #: a step's largest stages (mesh, actor, span) that get a key of their own while there is room
    stages: int = 6
    #: ... if they take at least this share of the step (a stage under it stays in ``other``)
    min_share: float = 0.05
    #: stage keys over the run, at most (the rest of a step's time is ``critical_path/path_s/other``)
    max_stage_keys: int = 16
    #: meshes (replicas as one) with ``idle_s`` / ``waiting_s`` keys, at most
    max_mesh_keys: int = 12
    #: seconds after a step ended that its path is read (its spans are on disk by then)
    settle_s: float = 2.0
    #: seconds between two looks for settled steps
    interval_s: float = 1.0
    #: a step this many times the median duration of the steps before it has a row in ``slow_steps``
    slow_ratio: float = 1.5
    #: rows of ``critical_path/slow_steps`` per run, at most
    max_slow_rows: int = 100
    #: steps read and not logged yet, at most (beyond: the oldest are left out, counted in meta.json)
    max_backlog_steps: int = 10_000
    #: share of one core the child process may use when it walks the files (no index)
    cpu_share: float = 0.02
    #: seconds ``finish`` waits for the child's last steps
    finish_timeout_s: float = 20.0
    logging_mode: Any = None  # LoggerBackend's

    def __post_init__(self) -> None:
        for k in ("stages", "max_stage_keys", "max_mesh_keys", "max_slow_rows", "max_backlog_steps"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"critical_path: {k} must be an integer >= 0, got {v!r}")
        if not isinstance(self.min_share, (int, float)) or isinstance(self.min_share, bool) or \
                not 0 <= self.min_share <= 1:
            raise ValueError(f"critical_path: min_share must be a share of the step in [0, 1], got {self.min_share!r}")
        for k in ("settle_s", "interval_s", "slow_ratio", "cpu_share", "finish_timeout_s"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"critical_path: {k} must be a number > 0, got {v!r}")


_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]+")


def _key_part(label: str) -> str:
    return _UNSAFE.sub("_", label).strip("/") or "_"


class PathKeys:
    """The bounded key set: stage and mesh keys are given on first sight while there is room."""

    def __init__(self, opts: CriticalPathOptions) -> None:
        self.opts = opts
        self.stage_keys: dict[str, str] = {}  # stage label -> key
        self.mesh_keys: dict[str, tuple] = {}  # mesh -> (idle key, waiting key)

    def values(self, line: dict, lag: int) -> dict[str, float]:
        """The keys of one step's line (:func:`forge_obs.alerts.path_worker.step_line`)."""
        o = self.opts
        stages = {k: v for k, v in line["stages"].items() if k != "other"}
        big = line["duration_s"] * o.min_share
        for label in sorted(stages, key=lambda k: -stages[k])[:o.stages]:
            if label not in self.stage_keys and len(self.stage_keys) < o.max_stage_keys and stages[label] >= big:
                self.stage_keys[label] = f"{PREFIX}path_s/{_key_part(label)}"
        c = line.get("cause") or {}
        out = {STEP_KEY: line["step"], f"{PREFIX}duration_s": line["duration_s"],
               f"{PREFIX}explained_frac": line["explained"], f"{PREFIX}unexplained_s": line["unexplained_s"],
               f"{PREFIX}unfinished": 1.0 if line["unfinished"] else 0.0,
               f"{PREFIX}cause_share": c.get("share") or 0.0, f"{PREFIX}lag_steps": lag}
        named = 0.0
        for label, key in self.stage_keys.items():
            v = stages.get(label, 0.0)
            out[key] = v
            named += v
        out[f"{PREFIX}path_s/other"] = max(line["duration_s"] - named, 0.0)
        for mesh, (idle, waiting) in line["slack"].items():
            keys = self.mesh_keys.get(mesh)
            if keys is None and len(self.mesh_keys) < o.max_mesh_keys:
                part = _key_part(mesh)
                keys = self.mesh_keys[mesh] = (f"{PREFIX}idle_s/{part}", f"{PREFIX}waiting_s/{part}")
            if keys is not None:
                out[keys[0]], out[keys[1]] = idle, waiting
        return out


def slow_row(line: dict, x_median: float, run_dir: Any) -> dict:
    """A ``critical_path/slow_steps`` row: the step, its culprit and the commands that show it."""
    c = line.get("cause") or {}
    where = line.get("unexplained_where")  # set when the answer leads with time no span explains
    culprit = f"unexplained {where}" if where else \
        f"{c.get('mesh')}/r{c.get('rank')} {c.get('name')}" if c else "no span on its path"
    m = line["step"]
    return {"step": m, "duration_s": round(line["duration_s"], 6), "x_median": round(x_median, 2),
            "culprit": culprit, "mesh": c.get("mesh"), "actor": c.get("actor"), "rank": c.get("rank"),
            "stage": c.get("name"), "share": round(c.get("share") or 0.0, 4), "unfinished": bool(line["unfinished"]),
            "explained_frac": round(line["explained"], 4), "answer": line["answer"],
            "why": printed_command("why", run_dir, "--step", m),
            "trace": printed_command("trace", run_dir, "--steps", f"{m}:{m}", "--critical-path", "--open")}


class CriticalPathBackend(LoggerBackend):
    """See the module docstring; configuration: :class:`CriticalPathOptions`."""

    #: the part of obs/cpu_s its threads' CPU is counted in (its line reader's too)
    cpu_part = "backends"


    def __init__(self, logger_backend_config: "dict[str, Any] | None" = None) -> None:
        self.options = parse_options(CriticalPathOptions, "critical_path", logger_backend_config)
        super().__init__({} if self.options.logging_mode is None else {"logging_mode": self.options.logging_mode})
        self.keys = PathKeys(self.options)
        self.proc: "subprocess.Popen | None" = None
        self._reader: "threading.Thread | None" = None
        self._lines: deque = deque()
        self._lock = threading.Lock()
        self._inflight: "tuple | None" = None  # (step M, wall time recorded, its values, its slow row)
        self._durations: deque = deque(maxlen=101)
        self.run_id = ""
        self.run_dir: Any = None
        self.counts = {"steps_read": 0, "steps_logged": 0, "steps_late": 0, "steps_left_out": 0, "slow_rows": 0,
                       "steps_lost": 0}

    def init(self, run: Any = None, **kwargs: Any) -> None:
        super().init(run)
        self.run_dir = getattr(run, "run_dir", None)
        self.run_id = getattr(run, "run_id", "") or ""
        if self.run_dir is None or self.proc is not None:
            return
        LATE.expect(self.run_id, "critical_path")
        o = self.options
        src = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        update = [] if "index" in (getattr(run, "config", None) or {}) else ["--update"]  # else the live indexer does
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge_obs.alerts.path_worker", str(self.run_dir), "--interval-s", str(o.interval_s),
             "--settle-s", str(o.settle_s), "--cpu-share", str(o.cpu_share), "--parent", str(os.getpid()),
             "--since", repr(time.time()), *update],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=lambda: os.nice(10))
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), name="forge_obs-critical-path",
                                        daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        """The child's lines, into the backlog (bounded: the oldest are left out, counted)."""
        for raw in stream:
            c0 = time.thread_time()
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            with self._lock:
                self.counts["steps_read"] += 1
                self._lines.append(line)
                while len(self._lines) > self.options.max_backlog_steps:
                    self._lines.popleft()
                    self.counts["steps_left_out"] += 1
            SELF_OBS.add(self.cpu_part, time.thread_time() - c0)

    def log_step(self, record: Any) -> None:
        """Record the next step's values once the previous ones reached a step (see the module
        docstring): one step's values per logged step."""
        if self._inflight is not None:
            m, at = self._inflight[:2]
            landed = any(x.key == STEP_KEY and x.value == m for x in record.global_metrics)
            if landed or (record.wall_time or 0) > at + 1.0:  # a later cut took them, or they were lost
                self.counts["steps_lost" if not landed else "steps_logged"] += 1
                self._inflight = None
        if self._inflight is not None:
            return
        with self._lock:
            line = self._lines.popleft() if self._lines else None
        if line is None:
            return
        values, row = self._values(line, record.step)
        for k, v in values.items():
            record_metric(k, v, Reduce.LAST)
        if row is not None:
            record_metric(SLOW_KEY, row, Reduce.SAMPLE)
        self._inflight = (line["step"], time.time(), values, row)

    def _values(self, line: dict, step: int) -> tuple:
        """One line's keys, and its ``slow_steps`` row when it is slow (or unfinished)."""
        values = self.keys.values(line, max(int(step) - int(line["step"]), 0))
        med = statistics.median(self._durations) if len(self._durations) >= 5 else None
        self._durations.append(line["duration_s"])
        slow = line["unfinished"] or (med is not None and med > 0 and line["duration_s"] >= self.options.slow_ratio * med)
        if not slow or self.counts["slow_rows"] >= self.options.max_slow_rows:
            return values, None
        self.counts["slow_rows"] += 1
        return values, slow_row(line, line["duration_s"] / med if med else 0.0, self.run_dir)

    def finish(self) -> None:
        """The child writes the steps left (after the writers' last pass); every step not logged
        yet is handed to the backends that write after the last step (W&B, TensorBoard, JSONL)."""
        p, self.proc = self.proc, None
        if p is None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(self.options.finish_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("forge_obs: critical_path: the path reader did not finish within %.0fs; the last steps "
                           "are left out", self.options.finish_timeout_s)
            p.kill()
            p.wait()
        if self._reader is not None:
            self._reader.join(5.0)
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
        done = [self._inflight[0:1] + self._inflight[2:]] if self._inflight is not None else []  # after the last cut
        self._inflight = None
        done += [(line["step"], *self._values(line, line["step"])) for line in lines]
        late = LateValues(rows=[(m, values) for m, values, _row in done])
        rows = [row for _m, _v, row in done if row is not None]
        if rows:
            late.tables[SLOW_KEY] = rows
        self.counts["steps_late"] += len(done)
        LATE.hand(self.run_id, "critical_path", late)

    def meta_report(self) -> dict:
        return dict(self.counts)
