"""JSONL store: ``<run_dir>/metrics.jsonl``, one object per step and mode (and rank), durable
(flushed and fsync'ed) at every step. Read it back with :func:`forge_obs.store.read_metrics`.

    {"run_id": "r1", "step": 0, "mode": "global_reduce", "wall_time": 1.7e9, "metrics": {"loss": 0.5}}
    {"run_id": "r1", "step": 0, "mode": "per_rank_reduce", "source": {"label": "trainer/r0", ...}, "metrics": {...}}
    {"run_id": "r1", "step": 0, "mode": "per_rank_no_reduce", "source": {...}, "values": [["loss", 0.5, 1.7e9]]}

Config: ``logging_mode`` (default: ``global_reduce`` and ``per_rank_reduce``), ``fsync`` (default True),
``show_obs`` (default True: the ``obs/…`` self-metrics, which the report and ``doctor`` read).
Raw values streamed between flushes (``per_rank_no_reduce``) are written as they arrive, under
their rank's predicted step (its last flushed step + 1).
NaN/inf are written as JSON ``NaN``/``Infinity`` (Python's json reads them back).
"""

from __future__ import annotations

import json
import os
from typing import Any

from forge_obs._plain import plain
from forge_obs._safe import safe_repr, safe_str
from forge_obs._warn import WARNER
from forge_obs.backends.base import LoggerBackend, StreamBatch, awaitable
from forge_obs.metric import LoggingMode
from forge_obs.record import StepRecord


def _default(o: Any) -> Any:
    item = getattr(o, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # noqa: BLE001
            pass
    return safe_str(o)


def _line(row: dict[str, Any]) -> str:
    """``row`` as one JSON line. Every key is written: a value JSON cannot encode as it is (a
    custom reduction's dict with a tuple key, or that contains itself) is written with its keys
    as strings (:func:`forge_obs._plain.plain`), or else as its text."""
    try:
        return json.dumps(row, default=_default) + "\n"
    except (TypeError, ValueError, RecursionError):
        pass
    row = dict(row)
    if isinstance(row.get("metrics"), dict):
        row["metrics"] = {k: _writable(k, v) for k, v in row["metrics"].items()}
    if isinstance(row.get("values"), list):
        row["values"] = [[r[0], _writable(r[0], r[1]), *r[2:]] for r in row["values"]]
    return json.dumps(row, default=_default) + "\n"


def _writable(key: str, v: Any) -> Any:
    """``v`` if JSON encodes it, else ``v`` with its keys as strings, else its text (warned)."""
    for make in (lambda: v, lambda: plain(v)):
        try:
            out = make()
            json.dumps(out, default=_default)
            return out
        except (TypeError, ValueError, RecursionError):  # BadRow is a ValueError
            continue
    WARNER.warn("jsonl_text", safe_str(key), f"metrics.jsonl: the value of {safe_str(key)!r} is not JSON "
                "(it contains itself): written as its text")
    return safe_repr(v, 10_000)


class JsonlBackend(LoggerBackend):
    default_modes = (LoggingMode.GLOBAL_REDUCE, LoggingMode.PER_RANK_REDUCE)

    @awaitable
    def init(self, run=None, **kwargs: Any) -> None:
        self.run = run
        assert run is not None, "the jsonl backend needs a run directory"
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run.run_dir / self.config.get("filename", "metrics.jsonl")
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync = bool(self.config.get("fsync", True))

    def log_step(self, record: StepRecord) -> None:
        base = {"run_id": record.run_id, "step": record.step}
        lines = []
        show_obs = self.config.get("show_obs", True)
        for mode in self.modes:
            if mode is LoggingMode.GLOBAL_REDUCE:
                metrics = record.global_dict()
                if not show_obs:
                    metrics = {k: v for k, v in metrics.items() if not k.startswith("obs/")}
                row = dict(base, mode=mode.value, wall_time=record.wall_time, metrics=metrics)
                if record.missing:
                    row["missing"] = record.missing
                if record.late:
                    row["late"] = record.late
                lines.append(row)
            elif mode is LoggingMode.PER_RANK_REDUCE:
                for label, values in record.per_rank_values().items():
                    src = record.sources.get(label, {"label": label})
                    lines.append(dict(base, mode=mode.value, wall_time=record.wall_time, source=src, metrics=values))
            else:
                for label, rows in record.raw.items():
                    if rows:
                        src = record.sources.get(label, {"label": label})
                        lines.append(dict(base, mode=mode.value, source=src, values=[list(r) for r in rows]))
        self._write(lines)

    def log_stream_batch(self, batch: StreamBatch) -> None:
        run_id = self.run.run_id if self.run is not None else None
        mode = LoggingMode.PER_RANK_NO_REDUCE.value
        self._write([{"run_id": run_id, "step": step, "mode": mode, "source": batch.sources.get(label, {"label": label}),
                      "values": [list(r) for r in rows]} for label, step, rows in batch.entries if rows])

    def _write(self, lines: list[dict]) -> None:
        if not lines:
            return
        self._f.write("".join(_line(r) for r in lines))
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    @awaitable
    def finish(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.flush()
            os.fsync(f.fileno())
            f.close()
