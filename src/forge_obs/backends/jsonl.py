"""JSONL store: ``<run_dir>/metrics.jsonl``, one object per step and mode (and rank), written at
every step (a process that dies after ``log_step`` returned loses none of its rows) and fsync'ed at
most every ``fsync_interval_s`` (so a crash of the machine loses at most that much), and at
``finish``. Read it back with :func:`forge_obs.analysis.store.read_metrics`.

    {"run_id": "r1", "step": 0, "mode": "global_reduce", "wall_time": 1.7e9, "metrics": {"loss": 0.5}}
    {"run_id": "r1", "step": 0, "mode": "per_rank_reduce", "source": {"label": "trainer/r0", ...}, "metrics": {...}}
    {"run_id": "r1", "step": 0, "mode": "per_rank_no_reduce", "source": {...}, "values": [["loss", 0.5, 1.7e9]]}
    {"run_id": "r1", "step": 0, "mode": "late", "wall_time": 1.7e9, "metrics": {"critical_path/step": 0, ...}}

A ``late`` row, written at ``finish``, holds values worked out after its step was logged
(:mod:`forge_obs.backends.late`: the last steps' critical path, under the step each describes, with
the rows of their tables; the final doctor's findings, under the last step logged): not a second
value of that step (the readers of the steps' rows leave it out). Written with ``global_reduce``.

Config (:class:`JsonlOptions`; an unknown key raises at ``init_backends``): ``logging_mode``
(default: ``global_reduce`` and ``per_rank_reduce``), ``fsync`` (default True), ``fsync_interval_s``
(default 1: a step's rows are fsync'ed with it when the last fsync is at least that old, else with
a later step or at ``finish``; 0: with every step), ``show_obs`` (default True: the ``obs/…``
self-metrics, which the report and ``doctor`` read), ``retry_buffer_mb`` (default 256: see below),
``filename`` (default ``metrics.jsonl``: a relative path inside the run directory; an absolute one or
one with ``..`` raises at ``init_backends``).
Raw values streamed between flushes (``per_rank_no_reduce``) are written as they arrive, under
their rank's predicted step (its last flushed step + 1).
NaN/inf are written as JSON ``NaN``/``Infinity`` (Python's json reads them back).

A write the file system refuses (a full disk, a quota) loses nothing while memory allows: the
rows not on disk are held, in order, and retried with every later step and at ``finish``, so the
file ends up with every row once, in order (a row the disk took part of is completed, never
written twice). At most ``retry_buffer_mb`` MiB are held; the rows of a step beyond that, and
those still held at ``finish``, are lost and named: :meth:`JsonlBackend.meta_report` gives
``unwritten_steps`` (which steps), ``delayed_steps`` (how many steps waited in memory) and
``write_errors`` for ``meta.json``'s ``backends.jsonl``, and each outage, recovery and loss is
logged once. A file left with a torn last row is given its line end when a session opens it
again, so the next session's rows start on a line of their own.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from forge_obs.backends.base import LoggerBackend, StreamBatch, awaitable
from forge_obs.backends.late import LATE, WAIT_S
from forge_obs.backends.record import StepRecord
from forge_obs.core.options import parse_options
from forge_obs.core.plain import plain
from forge_obs.core.redact import redact_text
from forge_obs.core.run import check_run_path, path_in_run
from forge_obs.core.safe import is_number, safe_repr, safe_str
from forge_obs.core.types import LoggingMode
from forge_obs.core.warn import WARNER

__all__ = ["DEFAULT_FSYNC_INTERVAL_S", "DEFAULT_RETRY_BUFFER_MB", "LATE_MODE", "JsonlBackend", "JsonlOptions"]

logger = logging.getLogger("forge_obs")


def _default(o: Any) -> Any:
    """An object JSON does not know: its ``.item()`` (numpy / torch scalars), else its text with
    credential-looking parts masked."""
    item = getattr(o, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # noqa: BLE001
            pass
    return redact_text(safe_str(o))


def _line(row: dict[str, Any]) -> str:
    """``row`` as one JSON line. Every key is written: a value JSON cannot encode as it is (a
    custom reduction's dict with a tuple key, an int longer than JSON readers take, or one that
    contains itself) is written as :func:`forge_obs.core.plain.plain` makes it, or else as its text."""
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
    """``v`` if JSON encodes it, else ``v`` as :func:`forge_obs.core.plain.plain` makes it (keys
    as strings, long ints as their digits, redacted), else its text (warned, saying why)."""
    why = ""
    for make in (lambda: v, lambda: plain(v, key)):
        try:
            out = make()
            json.dumps(out, default=_default)
            return out
        except (TypeError, ValueError, RecursionError) as e:  # BadRow is a ValueError
            why = safe_str(e) or type(e).__name__
    text = safe_repr(v, 10_000)
    WARNER.warn("jsonl_text", safe_str(key), f"metrics.jsonl: the value of {safe_repr(key)} is not JSON "
                f"({why}): written as its text")
    return redact_text(text)


#: the ``mode`` of a row of values known after its step was logged (:mod:`forge_obs.backends.late`)
LATE_MODE = "late"
#: ``retry_buffer_mb`` default: MiB of rows held in memory while the disk refuses them
DEFAULT_RETRY_BUFFER_MB = 256.0
#: ``fsync_interval_s`` default: the rows on disk are fsync'ed at most this often (and at ``finish``)
DEFAULT_FSYNC_INTERVAL_S = 1.0


@dataclass
class JsonlOptions:
    """The ``"jsonl"`` config: ``init_backends({"jsonl": {...}})``; an unknown key raises there."""

    logging_mode: Any = None  # one mode or a list (LoggerBackend parses it)
    show_obs: bool = True  # write forge_obs's own obs/... keys (the report and doctor read them)
    fsync: bool = True  # fsync the file (at most every fsync_interval_s, and at finish)
    fsync_interval_s: float = DEFAULT_FSYNC_INTERVAL_S  # 0: fsync with every step
    retry_buffer_mb: float = DEFAULT_RETRY_BUFFER_MB  # rows held in memory while the disk refuses them
    filename: str = "metrics.jsonl"  # a relative path inside the run directory
    per_rank_share_run: bool = False  # torchforge's; one file holds every rank's rows

    def __post_init__(self) -> None:
        for name, unit in (("retry_buffer_mb", "MiB"), ("fsync_interval_s", "seconds")):
            v = getattr(self, name)
            if not is_number(v) or not 0 <= v < float("inf"):
                raise ValueError(f"jsonl backend: {name} must be a number of {unit} >= 0, got {v!r}")
        self.show_obs = bool(self.show_obs)
        self.fsync = bool(self.fsync)
        self.filename = check_run_path(self.filename, "jsonl backend: filename")


class JsonlBackend(LoggerBackend):
    default_modes = (LoggingMode.GLOBAL_REDUCE, LoggingMode.PER_RANK_REDUCE)

    def __init__(self, logger_backend_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(logger_backend_config, **kwargs)
        self.options = parse_options(JsonlOptions, "jsonl backend", self.config)
        self._max_held = int(self.options.retry_buffer_mb * 2**20)
        self._synced_at = float("-inf")  # time.monotonic() of the last fsync
        self._held: deque = deque()  # [steps, bytes not on disk yet], in file order
        self._held_bytes = 0
        self._failing = False  # the last write or fsync failed
        self.write_errors = 0
        self._delayed: set[int] = set()  # steps whose rows waited in memory for the disk
        self._unwritten: set[int] = set()  # steps whose rows are not in the file
        self._fd: int | None = None
        self._last_step: int | None = None  # the last step logged

    @awaitable
    def init(self, run=None, **kwargs: Any) -> None:
        self.run = run
        assert run is not None, "the jsonl backend needs a run directory"
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = path_in_run(run.run_dir, self.options.filename, "jsonl backend: filename")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if _ends_torn(self.path):  # a torn last row of an earlier session: the next row starts a line
            self._hold([], b"\n")
            self._drain()

    def log_step(self, record: StepRecord) -> None:
        self._last_step = record.step
        base = {"run_id": record.run_id, "step": record.step}
        lines = []
        show_obs = self.options.show_obs
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
        self._write(lines, [record.step])

    def log_stream_batch(self, batch: StreamBatch) -> None:
        run_id = self.run.run_id if self.run is not None else None
        mode = LoggingMode.PER_RANK_NO_REDUCE.value
        entries = [(label, step, rows) for label, step, rows in batch.entries if rows]
        self._write([{"run_id": run_id, "step": step, "mode": mode, "source": batch.sources.get(label, {"label": label}),
                      "values": [list(r) for r in rows]} for label, step, rows in entries],
                    sorted({step for _label, step, _rows in entries}))

    def _write(self, lines: list[dict], steps: list[int]) -> None:
        """Append ``lines`` (the rows of ``steps``) after every row still held, as far as the disk takes them."""
        if not lines:
            return
        ready = not self._held or self._drain()  # the rows waiting go first (one try per call)
        held = self._hold(steps, "".join(_line(r) for r in lines).encode("utf-8"))
        if not (ready and self._drain()) and held:
            self._delayed.update(steps)

    def _hold(self, steps: list[int], data: bytes) -> bool:
        """Queue ``data`` behind the rows held; beyond ``retry_buffer_mb`` it is dropped, its
        steps named (False)."""
        if self._held and self._held_bytes + len(data) > self._max_held:
            if not self._unwritten:
                logger.error("forge_obs: %s: %d MiB of rows are waiting for the disk; the rows of new steps are "
                             "dropped until it takes them (named in meta.json: backends.jsonl.unwritten_steps)",
                             self.path, self._max_held >> 20)
            self._unwritten.update(steps)
            return False
        self._held.append([steps, memoryview(data)])
        self._held_bytes += len(data)
        return True

    def _drain(self, sync_now: bool = False) -> bool:
        """Write what is held, in order (a partly written row is completed, never repeated), then
        fsync if the last fsync is ``fsync_interval_s`` old (or ``sync_now``). True when nothing
        is held any more; an error is counted and logged once per outage."""
        while self._held:
            item = self._held[0]
            try:
                n = os.write(self._fd, item[1])
            except OSError as e:
                self._outage(e)
                return False
            self._held_bytes -= n
            item[1] = item[1][n:]
            if not item[1]:
                self._held.popleft()
        try:
            now = time.monotonic()
            if self.options.fsync and (sync_now or now - self._synced_at >= self.options.fsync_interval_s):
                os.fsync(self._fd)
                self._synced_at = now
        except OSError as e:
            self._outage(e)
            return False
        if self._failing:
            logger.warning("forge_obs: %s is written again: every held row is on disk (%d steps waited in memory "
                           "so far, %d lost)", self.path, len(self._delayed), len(self._unwritten))
            self._failing = False
        return True

    def _outage(self, e: OSError) -> None:
        self.write_errors += 1
        if not self._failing:
            logger.error("forge_obs: could not write %s: %s; its rows are held in memory (at most %g MiB) and "
                         "written with the next step that the disk takes", self.path, e, self._max_held / 2**20)
        self._failing = True

    def meta_report(self) -> dict[str, Any]:
        """What ``meta.json`` records of this store: steps whose rows are not in the file, steps
        that waited for the disk, failed writes."""
        return {"unwritten_steps": sorted(self._unwritten), "delayed_steps": len(self._delayed),
                "write_errors": self.write_errors}

    def _late_rows(self) -> list[dict]:
        """What other backends worked out after the last step (:mod:`forge_obs.backends.late`), as
        ``late`` rows: one per step described (a producer's ``rows`` of that step, and the table
        rows whose ``step`` names it), then one under the last step logged with the rest of the
        tables and the run's summary (the final findings)."""
        run_id = self.run.run_id if self.run is not None else ""
        if LoggingMode.GLOBAL_REDUCE not in self.modes or not LATE.expects(run_id):
            return []
        by_step: dict[int, dict] = {}
        rest: dict[str, Any] = {}
        for late in LATE.take(run_id, "jsonl", WAIT_S):
            for m, values in late.rows:
                by_step.setdefault(int(m), {}).update(values)
            for key, rows in late.tables.items():
                for r in rows:
                    m = r.get("step") if isinstance(r, dict) else None
                    into = by_step.setdefault(m, {}) if type(m) is int and m >= 0 else rest
                    into.setdefault(key, []).append(r)
            rest.update(late.summary)
        wall = time.time()
        out = [{"run_id": run_id, "step": m, "mode": LATE_MODE, "wall_time": wall, "metrics": metrics}
               for m, metrics in sorted(by_step.items())]
        if rest:
            last = self._last_step if self._last_step is not None else max(by_step, default=0)
            out.append({"run_id": run_id, "step": last, "mode": LATE_MODE, "wall_time": wall, "metrics": rest})
        return out

    @awaitable
    def finish(self) -> None:
        """Write the values known after the last step (``late`` rows), then what is held (one
        last try), then close; the steps whose rows are still not on disk are named in one error
        log and in :meth:`meta_report`."""
        fd = self._fd
        if fd is None:
            return
        try:
            try:
                late = self._late_rows()
                self._write(late, sorted({r["step"] for r in late}))
            except Exception as e:  # noqa: BLE001 - the rows logged are closed in anyway
                logger.error("forge_obs: %s: the values known after the last step were not written: %r", self.path, e)
            self._drain(sync_now=True)
            self._unwritten.update(s for steps, _data in self._held for s in steps)
            self._held.clear()
            self._held_bytes = 0
            if self._unwritten:
                lost = sorted(self._unwritten)
                logger.error("forge_obs: the rows of %d steps could not be written to %s and are lost: steps %s "
                             "(named in meta.json: backends.jsonl.unwritten_steps)", len(lost), self.path,
                             _ranges(lost))
        finally:
            self._fd = None
            os.close(fd)


def _ends_torn(path: Any) -> bool:
    """Whether the file at ``path`` is not empty and does not end with a line end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except OSError:
        return False


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out: list[str] = []
    start = prev = steps[0]
    for s in steps[1:] + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        if s is not None:
            start = prev = s
    return ", ".join(out)
