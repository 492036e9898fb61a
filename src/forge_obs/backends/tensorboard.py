"""TensorBoard backend: one event writer per run, in ``runs/<run_id>/tb/``.

    init_backends({"tensorboard": {"logging_mode": ["global_reduce", "per_rank_reduce"]}})
    # then: tensorboard --logdir runs/<run_id>/tb

- ``global_reduce``: scalars per step (``walltime`` = the step's wall time, so TensorBoard's
  "wall" x-axis is real time). Distribution metrics (``"distribution"`` reduction) give
  ``key/p50``, ``key/p90``, ``key/p99``, ``key/count``; a list of numbers is a histogram; SAMPLE
  rows are a text table.
- ``per_rank_reduce``: per-rank scalars in the same writer, tagged ``<rank label>/<key>``
  (``trainer/r3/loss``): one writer per run, because several writers in one directory confuse
  TensorBoard.
- ``per_rank_no_reduce``: raw values as scalars with their own timestamps, tagged by rank, and,
  for distribution metrics, a histogram per step of all raw values across ranks (``key``).
- ``step_metrics`` (as for W&B): ``{"generator/": "policy_version"}`` plots ``generator/…`` with
  ``step = policy_version`` (when the step's values contain it) instead of the trainer step;
  ``critical_path/…`` is plotted at ``critical_path/step`` (the step it describes) by default.
- Text values (strings, row tables) are text; what other backends work out after the last step
  (:mod:`forge_obs.backends.late`) is written at ``finish``.

Config: ``logging_mode``, ``log_dir`` (default ``tb``: a relative path inside the run directory;
an absolute one or one with ``..`` raises at ``init_backends``), ``step_metrics``,
``flush_secs`` (default 10), ``histograms`` (key prefixes whose raw values also become
histograms; default: distribution metrics only), ``show_obs`` (default True). Needs
``tensorboard`` (``forge-obs[tensorboard]``). Raw values streamed between flushes are written as
they arrive, under their rank's predicted step (its last flushed step + 1); their histogram values join the next step's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_obs.backends.base import LoggerBackend, StreamBatch, awaitable, write_each
from forge_obs.backends.late import LATE, PATH_PREFIX, PATH_STEP_KEY, WAIT_S
from forge_obs.backends.record import StepRecord
from forge_obs.backends.wandb import rank_key
from forge_obs.core.options import parse_options
from forge_obs.core.plain import plain
from forge_obs.core.redact import redact_text, redacted_repr
from forge_obs.core.run import check_run_path, path_in_run
from forge_obs.core.safe import is_number, safe_str
from forge_obs.core.types import LoggingMode

__all__ = ["DIST", "TensorBoardOptions", "TensorBoardBackend"]

logger = logging.getLogger("forge_obs")

DIST = "distribution"


@dataclass
class TensorBoardOptions:
    """The ``"tensorboard"`` config: ``init_backends({"tensorboard": {...}})``."""

    logging_mode: Any = None  # one mode or a list (LoggerBackend parses it)
    log_dir: str | None = None  # a relative path inside the run directory (default: tb)
    step_metrics: dict = field(default_factory=dict)  # key prefix -> axis metric (e.g. policy_version)
    flush_secs: int = 10
    histograms: Any = ()  # keys (or prefixes) whose raw values also go to histograms
    show_obs: bool = True  # write forge_obs's own obs/... keys
    values: str = "scalar"  # LoggerBackend's
    per_rank_share_run: bool = False  # torchforge's; per-rank values share the run's writer

    def __post_init__(self) -> None:
        sm = self.step_metrics or {}
        if not isinstance(sm, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in sm.items()):
            raise ValueError('tensorboard backend: step_metrics must map a key prefix to an axis metric, e.g. {"generator/": "policy_version"}')
        self.step_metrics = dict(sm)
        if self.log_dir is not None:
            self.log_dir = check_run_path(self.log_dir, "tensorboard backend: log_dir")
        hist = self.histograms or []
        hist = [hist] if isinstance(hist, str) else hist
        if not isinstance(hist, (list, tuple)) or not all(isinstance(h, str) for h in hist):
            raise ValueError(f"tensorboard backend: histograms must be a key prefix or a list of them, e.g. "
                             f'["generator/"], got {redacted_repr(self.histograms)}')
        self.histograms = list(hist)
        if not is_number(self.flush_secs) or not 0 < self.flush_secs < float("inf"):
            raise ValueError(f"tensorboard backend: flush_secs must be a number of seconds > 0, got "
                             f"{redacted_repr(self.flush_secs)}")


def _prefix_match(key: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return key.startswith(pattern[:-1])
    if pattern.endswith("/"):
        return key.startswith(pattern)
    return key == pattern


def _md_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        for c in r:
            if c not in cols:
                cols.append(c)

    def cell(v: Any) -> str:  # a row's strings are redacted where it was recorded; an object's text here
        return (v if type(v) is str else redact_text(safe_str(v))).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


class TensorBoardBackend(LoggerBackend):
    default_modes = (LoggingMode.GLOBAL_REDUCE,)

    def __init__(self, logger_backend_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(logger_backend_config, **kwargs)
        self.options = parse_options(TensorBoardOptions, "tensorboard backend", self.config)
        # the critical path of step M is known after step M was logged: its keys are written at step M
        self.step_metrics: dict[str, str] = {PATH_PREFIX: PATH_STEP_KEY, **self.options.step_metrics}
        self.histograms = self.options.histograms
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ValueError("the 'tensorboard' backend needs tensorboard: pip install 'forge-obs[tensorboard]'") from e
        self.writer: Any = None
        self.log_dir: Path | None = None
        self._last_step: int | None = None
        self._dist_keys: set[str] = set()  # distribution keys seen so far
        self._early: dict[str, list[float]] = {}  # histogram values streamed before their step's flush

    @awaitable
    def init(self, run=None, **kwargs: Any) -> None:
        self.run = run
        from torch.utils.tensorboard import SummaryWriter

        if run is None:
            raise ValueError("tensorboard backend: no run directory to write in")
        self.log_dir = path_in_run(run.run_dir, self.options.log_dir or "tb", "tensorboard backend: log_dir")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=int(self.options.flush_secs))

    # ------------------------------------------------------------------ values
    def _step_for(self, key: str, record: StepRecord, axes: dict[str, Any]) -> int:
        for pattern, axis in self.step_metrics.items():
            if _prefix_match(key, pattern) and is_number(axes.get(axis)):
                return int(axes[axis])
        return record.step

    def _put(self, tag: str, value: Any, step: int, wall: float, texts: bool = True) -> None:
        import numpy as np

        w = self.writer
        if isinstance(value, bool):
            value = float(value)
        if is_number(value):
            w.add_scalar(tag, float(value), step, walltime=wall)
        elif isinstance(value, dict):
            for k, v in plain(value).items():  # a dict that contains itself raises before any write
                self._put(f"{tag}/{k}", v, step, wall, texts)
        elif isinstance(value, list) and value:
            if all(isinstance(r, dict) for r in value):
                if texts:
                    w.add_text(tag, _md_table(value), step, walltime=wall)
            elif all(is_number(v) for v in value):
                arr = np.asarray([v for v in value if math.isfinite(v)], dtype=np.float64)
                if arr.size:
                    w.add_histogram(tag, arr, step, walltime=wall)
        elif isinstance(value, str) and texts:
            w.add_text(tag, value, step, walltime=wall)

    def _hist_key(self, key: str, dist_keys: set[str]) -> bool:
        return key in dist_keys or any(_prefix_match(key, p) for p in self.histograms)

    def log_step(self, record: StepRecord) -> None:
        if self.writer is None:
            return
        self._last_step = record.step if self._last_step is None else max(self._last_step, record.step)
        glob = record.global_dict()
        wall = record.wall_time
        if LoggingMode.GLOBAL_REDUCE in self.modes:
            show_obs = self.options.show_obs
            write_each(self, [m for m in record.global_metrics if show_obs or not m.key.startswith("obs/")],
                       lambda m: self._put(m.key, m.value, self._step_for(m.key, record, glob), wall))
        if LoggingMode.PER_RANK_REDUCE in self.modes:
            for label, metrics in record.per_rank.items():
                write_each(self, metrics, lambda m: self._put(rank_key(label, m.key), m.value,
                                                              self._step_for(m.key, record, glob), wall, texts=False))
        if LoggingMode.PER_RANK_NO_REDUCE in self.modes and record.raw:
            import numpy as np

            dist_keys = {m.key for m in record.global_metrics if str(getattr(m.reduction, "value", m.reduction)) == DIST}
            self._dist_keys |= dist_keys
            by_key, self._early = self._early, {}  # values of this step streamed before its flush
            for label, rows in record.raw.items():
                for key, v, ts in rows:
                    if is_number(v):
                        self.writer.add_scalar(rank_key(label, key), float(v), self._step_for(key, record, glob), walltime=ts)
                        if self._hist_key(key, dist_keys) and math.isfinite(v):
                            by_key.setdefault(key, []).append(float(v))
            for key, vals in by_key.items():
                self.writer.add_histogram(f"{key}/hist", np.asarray(vals), self._step_for(key, record, glob), walltime=wall)

    def log_stream_batch(self, batch: StreamBatch) -> None:
        """Raw values streamed between flushes: scalars with their own timestamps, under their
        rank's predicted step; values of histogram keys join the next step's histogram."""
        if self.writer is None:
            return
        for label, step, rows in batch.entries:
            for key, v, ts in rows:
                if is_number(v):
                    self.writer.add_scalar(rank_key(label, key), float(v), step, walltime=ts)
                    if self._hist_key(key, self._dist_keys) and math.isfinite(v):
                        self._early.setdefault(key, []).append(float(v))  # into the next step's histogram

    def _log_late(self) -> None:
        """What other backends worked out after the last step (:mod:`forge_obs.backends.late`):
        the critical path of the last steps at their own steps, table rows and the run's summary
        (the final findings) as text after the last step."""
        run_id = self.run.run_id if self.run is not None else ""
        if self.writer is None or not LATE.expects(run_id):
            return
        wall = time.time()
        after = (self._last_step or 0) + 1
        for late in LATE.take(run_id, "tensorboard", WAIT_S):
            for m, values in late.rows:
                for k, v in values.items():
                    self._put(k, v, int(m) if k.startswith(PATH_PREFIX) else after, wall)
            for key, rows in {**late.tables, **late.summary}.items():
                self._put(key, rows, after, wall)

    @awaitable
    def finish(self) -> None:
        try:
            self._log_late()
        except Exception as e:  # noqa: BLE001 - the writer is closed anyway
            logger.error("forge_obs tensorboard: the values known after the last step were not written: %r", e)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
