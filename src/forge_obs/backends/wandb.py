"""Weights & Biases backend: ONE W&B run per experiment, written only by the controller.

    init_backends({
        "wandb": {
            "project": "grpo", "mode": "offline",            # any wandb.init kwarg passes through
            "logging_mode": ["global_reduce", "per_rank_reduce"],
            "step_metrics": {"generator/": "policy_version"},  # x-axis per key prefix
        },
    })

What goes where:

- ``global_reduce``: one history row per step in the experiment's run, ``step=global_step``.
  Every row also carries ``trainer_step`` and ``wall_time``, so any chart can switch its x-axis.
- ``per_rank_reduce``: by default the ranks' values are keys in the same run and the same row,
  labelled by rank: ``trainer/r3/loss`` (rank label + key; a key that already starts with the
  rank's mesh name does not repeat it). ``"per_rank": "runs"`` (or torchforge's
  ``"per_rank_share_run": False``) gives one run per rank instead, grouped by the experiment
  (``group=<run_id>``), with system metrics off unless ``"per_rank_system_metrics": true``.
  ``"per_rank_include": ["trainer/loss", "generator/"]`` keeps only those key prefixes per rank
  (many ranks x many keys make wide rows).
- ``per_rank_no_reduce``: raw values with their timestamps go to a companion run
  ``<run_id>-raw`` in the same group (system metrics off), one row per value, plotted against
  ``wall_time``. They never advance or overwrite the steps of the main run.
- SAMPLE values (lists of row dicts) become ``wandb.Table`` s, logged in the step's row (with
  the step, so scalar steps are never lost); lists of numbers become histograms.
- ``step_metrics`` maps a key prefix (``"generator/"``) or glob (``"generator/*"``) or key to the
  metric that is its x-axis (``define_metric(glob, step_metric=axis)``). The axis value is an
  ordinary metric: ``record_metric("policy_version", v, Reduce.MAX)``.
- Config: the W&B run's config gets the user's ``config`` (or ``run_config``) plus
  ``forge_obs`` (run id, run dir, backend configs), all passed through
  :func:`forge_obs.core.redact.redact` (the one redaction of every file forge_obs writes); a SAMPLE
  row's table was redacted where the row was recorded (:func:`forge_obs.core.plain.plain`).

The dashboard's derived values (docs/backends.md): ``critical_path/*`` are plotted against
``critical_path/step`` (the step they describe, known after it was logged: ``define_metric``);
the rows of ``critical_path/slow_steps`` and ``doctor/findings`` are appended to one incremental
table each; what other backends work out after the last step (:mod:`forge_obs.backends.late`:
the last steps' critical path, the final doctor's findings) is written in rows after the last
step and in the run's summary at ``finish``.

Steps: W&B drops a write to a step below its current one. Steps arrive in order, but when one
does not increase (a resumed job replaying a step, a user's non-monotonic flush) it is written at
the next free W&B step, with ``trainer_step`` holding the true value, and a warning is logged once.

Defaults: ``dir=<run_dir>`` (files in ``runs/<run_id>/wandb/``; a ``dir`` given is a relative path
inside the run directory, an absolute one or one with ``..`` raises at ``init_backends``),
``name``/``id``/``group`` =
run id, ``resume="allow"``, ``reinit="create_new"``, ``settings=wandb.Settings(console="off")``.
The API key is read by wandb itself (``WANDB_API_KEY`` / netrc); forge_obs never stores it.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from forge_obs.backends.base import LoggerBackend, StreamBatch, awaitable, write_each
from forge_obs.backends.late import LATE, PATH_PREFIX, PATH_STEP_KEY, TABLE_KEYS, WAIT_S
from forge_obs.backends.record import StepRecord
from forge_obs.core.options import parse_options
from forge_obs.core.plain import plain
from forge_obs.core.redact import redact, redact_text
from forge_obs.core.run import check_run_path, path_in_run
from forge_obs.core.safe import is_number, safe_str
from forge_obs.core.types import BackendRole, LoggingMode, Metric

__all__ = [
    "PER_RANK_CHOICES",
    "AXIS_KEYS",
    "WandbOptions",
    "OWN_KEYS",
    "axis_glob",
    "rank_key",
    "WandbBackend",
]

logger = logging.getLogger("forge_obs")

PER_RANK_CHOICES = ("keys", "runs")
AXIS_KEYS = ("trainer_step", "wall_time")


@dataclass
class WandbOptions:
    """The ``"wandb"`` config keys forge_obs reads itself; every other key goes to ``wandb.init``."""

    logging_mode: Any = None  # one mode or a list (LoggerBackend parses it)
    show_obs: bool = True  # log forge_obs's own obs/... keys
    values: str = "scalar"  # LoggerBackend's
    per_rank: str | None = None  # "keys": trainer/r3/loss in the run; "runs": one grouped run per rank
    per_rank_share_run: bool | None = None  # torchforge's: True means per_rank="keys"
    per_rank_system_metrics: bool = False
    per_rank_include: Any = ()  # key prefixes logged per rank (default: all)
    step_metrics: dict = field(default_factory=dict)  # key prefix/glob -> axis metric
    run_config: dict | None = None  # extra config stored on the run

    def __post_init__(self) -> None:
        if self.per_rank is not None and self.per_rank not in PER_RANK_CHOICES:
            raise ValueError(f"wandb backend: per_rank={self.per_rank!r}; valid: {', '.join(PER_RANK_CHOICES)}")
        sm = self.step_metrics or {}
        if not isinstance(sm, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in sm.items()):
            raise ValueError(
                "wandb backend: step_metrics must map a key prefix/glob to an axis metric name, "
                'e.g. {"generator/": "policy_version"}'
            )
        self.step_metrics = dict(sm)
        inc = self.per_rank_include or []
        self.per_rank_include = [inc] if isinstance(inc, str) else list(inc)
        if self.run_config is not None and not isinstance(self.run_config, dict):
            raise ValueError("wandb backend: run_config must be a dict")


#: config keys that forge_obs reads itself; everything else goes to ``wandb.init``
OWN_KEYS = tuple(f.name for f in fields(WandbOptions))


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ValueError("the 'wandb' backend needs the wandb package: pip install 'forge-obs[wandb]'") from e
    return wandb


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-") or "x"


def axis_glob(prefix: str) -> str:
    """``"generator/"`` -> ``"generator/*"``; a glob or exact key is kept."""
    return prefix + "*" if prefix.endswith("/") else prefix


def rank_key(label: str, key: str) -> str:
    """Key of a per-rank value in the shared run: ``("trainer/r3", "loss") -> "trainer/r3/loss"``;
    ``("trainer/r3", "trainer/loss") -> "trainer/r3/loss"`` (the mesh name is not repeated)."""
    mesh = label.split("/", 1)[0]
    if key.startswith(mesh + "/"):
        key = key[len(mesh) + 1 :]
    return f"{label}/{key}"


def _text(v: Any) -> str:
    """An object's text in a table cell, with credential-looking parts masked (a row's strings
    were redacted where it was recorded)."""
    return redact_text(safe_str(v))


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for c in r:
            if c not in cols:
                cols.append(c)
    return cols


def _cell(v: Any) -> Any:
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    try:
        return json.dumps(v, default=_text)
    except Exception:  # noqa: BLE001
        return _text(v)


class WandbBackend(LoggerBackend):
    """``WandbBackend({"project": "p", "logging_mode": ...})`` or, as torchforge's,
    ``WandbBackend(logging_mode=LoggingMode.GLOBAL_REDUCE, project="p")`` (then
    ``per_rank_share_run`` defaults to False, torchforge's default: one W&B run per rank for
    ``per_rank_reduce``)."""

    default_modes = (LoggingMode.GLOBAL_REDUCE,)

    def __init__(self, logger_backend_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(logger_backend_config, **kwargs)
        self._wandb = _import_wandb()
        init_params = [p for p in inspect.signature(self._wandb.init).parameters if p not in ("self",)]
        self.options = opts = parse_options(
            WandbOptions, "wandb backend", self.config, also=init_params,
            more=f" or any wandb.init argument ({', '.join(init_params)})",
        )
        per_rank = opts.per_rank
        if per_rank is None:
            share = opts.per_rank_share_run
            if share is None:
                share = logger_backend_config is not None or not kwargs
            per_rank = "keys" if share else "runs"
        self.per_rank = per_rank
        if self.config.get("dir") is not None:
            check_run_path(self.config["dir"], "wandb backend: dir")
        self.step_metrics: dict[str, str] = opts.step_metrics
        self.per_rank_include = opts.per_rank_include
        self.wb: Any = None  # the experiment's wandb run
        self._rank_runs: dict[str, Any] = {}
        self._raw_run: Any = None
        self._last_step: dict[str, int] = {}  # per W&B run: the last step written
        self._tables: dict[str, Any] = {}  # key of TABLE_KEYS -> its incremental wandb.Table
        self._run_key = ""  # the run id the late values are handed for
        self._warned_step = False
        self.steps_adjusted = 0

    # ------------------------------------------------------------------ runs
    @awaitable
    def init(self, run=None, role: Any = BackendRole.GLOBAL, **kwargs: Any) -> None:
        """Start the experiment's W&B run (``role=BackendRole.GLOBAL``, what ``init_backends``
        passes). forge_obs logs every rank from the controller, so a torchforge-style
        ``init(role=BackendRole.LOCAL)`` starts nothing."""
        self.run = run
        self._run_key = run.run_id if run is not None else ""
        if role == BackendRole.LOCAL:
            logger.info("forge_obs wandb: init(role=LOCAL) starts no run (every rank is logged from the controller)")
            return
        wandb = self._wandb
        kw = {k: v for k, v in self.config.items() if k not in OWN_KEYS}
        if run is not None:
            run.run_dir.mkdir(parents=True, exist_ok=True)
            kw["dir"] = str(path_in_run(run.run_dir, kw["dir"], "wandb backend: dir") if kw.get("dir") is not None
                            else run.run_dir)
            Path(kw["dir"]).mkdir(parents=True, exist_ok=True)
            kw.setdefault("name", run.run_id)
            kw.setdefault("id", _slug(run.run_id))
            kw.setdefault("group", run.run_id)
        kw.setdefault("resume", "allow")
        kw.setdefault("reinit", "create_new")
        if "settings" not in kw:
            kw["settings"] = wandb.Settings(console="off")
        config = dict(kw.pop("config", None) or {})
        config.update(self.options.run_config or {})
        config["forge_obs"] = redact(
            {
                "run_id": run.run_id if run else None,
                "run_dir": str(run.run_dir) if run else None,
                "backends": run.config if run else {},
            }
        )
        self._base = {k: kw[k] for k in ("project", "entity", "dir", "mode", "anonymous") if k in kw}
        self._group = kw.get("group")
        self._name = kw.get("name") or (run.run_id if run else "forge_obs")
        self._id = kw.get("id")
        self._init_global(redact(config), kw)

    def _init_global(self, config: dict[str, Any], kw: dict[str, Any]) -> None:
        """The experiment's run (torchforge's name for the controller's run)."""
        self.wb = self._wandb.init(config=config, **kw)
        self._resume_step("", self.wb)
        self._define_axes(self.wb)
        for prefix, axis in self.step_metrics.items():
            self.wb.define_metric(axis)
            self.wb.define_metric(axis_glob(prefix), step_metric=axis)

    #: torchforge's shared-run init is the experiment's run here: every rank writes into it
    _init_shared_global = _init_global

    def _init_shared_local(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("forge_obs logs every rank from the controller: there are no per-rank W&B processes")

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any]:
        """torchforge's hook: the experiment run's id when ranks share it, else ``{}``."""
        if self.wb is not None and self.per_rank == "keys":
            return {"shared_run_id": getattr(self.wb, "id", None)}
        return {}

    def _resume_step(self, name: str, wb: Any) -> None:
        """A resumed W&B run continues after its last step."""
        try:
            nxt = int(wb.step)
        except Exception:  # noqa: BLE001 - e.g. shared mode
            return
        if nxt > 0:
            self._last_step[name] = nxt - 1

    @staticmethod
    def _define_axes(wb: Any) -> None:
        for axis in AXIS_KEYS:
            wb.define_metric(axis)
        # the critical path of step M is known after step M was logged: its keys carry M as their x-axis
        wb.define_metric(PATH_STEP_KEY)
        wb.define_metric(PATH_PREFIX + "*", step_metric=PATH_STEP_KEY)

    def _companion(self, suffix: str, name: str, job_type: str, stats: bool, config: dict | None = None) -> Any:
        wandb = self._wandb
        settings = wandb.Settings(console="off", x_disable_stats=not stats)
        kw = dict(self._base, name=f"{self._name}/{name}", job_type=job_type, reinit="create_new", settings=settings)
        if self._group:
            kw["group"] = self._group
        if self._id:
            kw["id"] = f"{self._id}-{_slug(suffix)}"
            kw["resume"] = "allow"
        return wandb.init(config=config or {}, **kw)

    def _rank_run(self, label: str, source: dict[str, Any]) -> Any:
        r = self._rank_runs.get(label)
        if r is None:
            r = self._init_per_rank(label, source)
            self._resume_step(label, r)
            self._define_axes(r)
            for prefix, axis in self.step_metrics.items():
                r.define_metric(axis)
                r.define_metric(axis_glob(prefix), step_metric=axis)
            self._rank_runs[label] = r
        return r

    def _init_per_rank(self, label: str, source: dict[str, Any]) -> Any:
        """A rank's own run (``per_rank: "runs"``), in the experiment's group."""
        mesh = str(source.get("mesh") or label.split("/", 1)[0])
        return self._companion(label, label, mesh, bool(self.options.per_rank_system_metrics),
                               config={"source": {k: v for k, v in source.items() if k != "pid"}})

    def _raw(self) -> Any:
        if self._raw_run is None:
            self._raw_run = self._companion("raw", "raw", "raw_streams", False)
            self._raw_run.define_metric("wall_time")
            self._raw_run.define_metric("*", step_metric="wall_time")
        return self._raw_run

    # ------------------------------------------------------------------ values
    def _put(self, row: dict[str, Any], key: str, value: Any, tables: bool = True) -> None:
        wandb = self._wandb
        item = getattr(value, "item", None)
        if callable(item) and not isinstance(value, (list, dict)):
            try:
                value = item()
            except Exception:  # noqa: BLE001
                pass
        if isinstance(value, bool) or is_number(value):
            row[key] = value
        elif isinstance(value, list):
            if value and all(isinstance(r, dict) for r in value):
                if not tables:
                    return
                if key in TABLE_KEYS:  # one table over the run: these rows are appended to it
                    row[key] = self._append(key, value)
                    return
                cols = _columns(value)
                row[key] = wandb.Table(columns=cols, data=[[_cell(r.get(c)) for c in cols] for r in value])
            elif value and all(is_number(v) for v in value):
                finite = [v for v in value if math.isfinite(v)]
                if finite:
                    row[key] = wandb.Histogram(finite)
            # empty lists (no samples this step) are skipped
        elif isinstance(value, dict):
            for k, v in plain(value).items():  # a dict that contains itself raises before any write
                self._put(row, f"{key}/{k}", v, tables)
        elif isinstance(value, str):
            row[key] = value

    def _append(self, key: str, rows: list[dict]) -> Any:
        """``rows`` appended to the run's incremental table of ``key`` (its columns: those of its
        first rows; a later row's other columns are left out)."""
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = self._wandb.Table(columns=_columns(rows), log_mode="INCREMENTAL")
        for r in rows:
            t.add_data(*[_cell(r.get(c)) for c in t.columns])
        return t

    def _put_each(self, row: dict[str, Any], metrics: list, label: str | None = None, tables: bool | None = None) -> None:
        """Each metric into ``row`` (under ``rank_key(label, key)`` when ``label``): one that
        cannot be written costs that key only (:func:`~forge_obs.backends.base.write_each`)."""
        def put(m: Any) -> None:
            part: dict[str, Any] = {}
            self._put(part, m.key if label is None else rank_key(label, m.key), m.value,
                      label is None if tables is None else tables)
            row.update(part)

        write_each(self, metrics, put)

    def _next_step(self, step: int, run_name: str = "") -> int:
        last = self._last_step.get(run_name)
        if last is not None and step <= last:
            self.steps_adjusted += 1
            if not self._warned_step:
                self._warned_step = True
                logger.warning(
                    "forge_obs wandb: step %s is not above the last logged step %s; W&B would drop it, so it "
                    "is written at step %s (trainer_step keeps %s)",
                    step, last, last + 1, step,
                )
            step = last + 1
        self._last_step[run_name] = step
        return step

    def log_step(self, record: StepRecord) -> None:
        if self.wb is None:
            return
        axes = {"trainer_step": record.step, "wall_time": record.wall_time}
        row: dict[str, Any] = {}
        if LoggingMode.GLOBAL_REDUCE in self.modes:
            show_obs = self.options.show_obs
            self._put_each(row, [m for m in record.global_metrics if show_obs or not m.key.startswith("obs/")])
        if LoggingMode.PER_RANK_REDUCE in self.modes:
            for label, metrics in record.per_rank.items():
                if self.per_rank_include:
                    metrics = [m for m in metrics if any(m.key.startswith(p) for p in self.per_rank_include)]
                if self.per_rank == "keys":
                    self._put_each(row, metrics, label)
                else:
                    rrow: dict[str, Any] = {}
                    self._put_each(rrow, metrics, None, tables=False)
                    if rrow:
                        # the step's axis values (e.g. policy_version) so per-rank charts can use them
                        for axis in set(self.step_metrics.values()):
                            if axis in row and axis not in rrow:
                                rrow[axis] = row[axis]
                        rr = self._rank_run(label, record.sources.get(label, {"label": label}))
                        rr.log({**rrow, **axes}, step=self._next_step(record.step, label))
        if row:
            row.update(axes)
            self.wb.log(row, step=self._next_step(record.step))
        if LoggingMode.PER_RANK_NO_REDUCE in self.modes:
            self.log_raw(record.raw, record.step)

    def log_raw(self, raw: dict[str, list], global_step: int) -> None:
        """Raw values into the ``<run_id>-raw`` run, one row per value, against ``wall_time``."""
        if self.wb is None or not any(raw.values()):
            return
        run = self._raw()
        values = sorted(((ts, label, key, v) for label, rows in raw.items() for key, v, ts in rows), key=lambda t: t[0])
        for ts, label, key, v in values:
            r: dict[str, Any] = {}
            self._put(r, rank_key(label, key), v, tables=False)
            if r:
                run.log({**r, "wall_time": ts, "trainer_step": global_step})

    def log_stream_batch(self, batch: StreamBatch) -> None:
        for label, step, rows in batch.entries:
            self.log_raw({label: rows}, step)

    def _log_late(self) -> None:
        """What other backends worked out after the last step (:mod:`forge_obs.backends.late`):
        the critical path of the last steps, each in a row after the last step (on its own
        ``critical_path/step`` axis), rows of the run's tables, and the run's summary (the final
        findings)."""
        if self.wb is None or not LATE.expects(self._run_key):
            return
        for late in LATE.take(self._run_key, "wandb", WAIT_S):
            for _m, values in late.rows:
                row: dict[str, Any] = {}
                self._put_each(row, [Metric(k, v) for k, v in values.items()])
                last = self._last_step.get("")
                self.wb.log(row, step=self._next_step(0 if last is None else last + 1))
            if late.tables:
                row = {}
                for key, rows in late.tables.items():
                    self._put(row, key, rows)
                last = self._last_step.get("")
                self.wb.log(row, step=self._next_step(0 if last is None else last + 1))
            for key, value in late.summary.items():
                if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
                    cols = _columns(value)
                    value = self._wandb.Table(columns=cols, data=[[_cell(r.get(c)) for c in cols] for r in value])
                self.wb.summary[key] = value

    @awaitable
    def finish(self) -> None:
        try:
            self._log_late()
        except Exception as e:  # noqa: BLE001 - the run is finished anyway
            logger.error("forge_obs wandb: the values known after the last step were not written: %r", e)
        runs = list(self._rank_runs.values()) + [self._raw_run, self.wb]
        self._rank_runs.clear()
        self._raw_run = None
        self.wb = None
        errors = []
        for r in runs:
            if r is None:
                continue
            try:
                r.finish()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]
