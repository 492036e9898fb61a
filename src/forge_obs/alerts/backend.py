"""The ``"alerts"`` backend: the doctor's metric rules, run live on the controller at each step.

    await mlogger.init_backends.call_one({
        "alerts": {"rules": ["trainer/loss > 10"], "webhook": "http://127.0.0.1:9000/hook"},
    })

Each step's :class:`~forge_obs.backends.record.StepRecord` (global values, per-rank values, ``missing``,
``sources``) goes through :func:`forge_obs.analysis.doctor.rules.build_rules`' objects on the
logger's backend thread; a watchdog thread reports a loop that stopped flushing (``stall``). Every
alert fires once when its condition starts and once when it clears, to the console (stderr),
``runs/<run_id>/alerts.jsonl``, W&B (``run.alert``, when a W&B run is active), Python callbacks and
webhooks. The backend's own CPU (rules, watchdog, sink thread) is reported as
``obs/cpu_alerts_s``; ``alerts/active`` (MAX, recorded at the steps it changes) counts the
conditions currently on. An alert about time (straggler, slowdown, sync bottleneck, throughput
drop) cites the critical path of the slowest step since its onset, read from the run's timeline
files when it fires (``critical_path``: step, one-line answer, cause).
"""

from __future__ import annotations

import logging
import threading
import time
from statistics import median
from typing import Any

from forge_obs.alerts.config import AlertsConfig
from forge_obs.alerts.sinks import (FINAL_FINDINGS_KEY, FINDINGS_KEY, Dispatcher, FileSink, alert_row, console_sink,
                                    find_wandb_run, finding_row, post_json, wandb_alert)
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.doctor.rule_base import Event, StepView
from forge_obs.analysis.doctor.rules import build_rules
from forge_obs.backends.base import LoggerBackend
from forge_obs.backends.late import LATE, LateValues
from forge_obs.backends.record import StepRecord
from forge_obs.core.run import path_in_run
from forge_obs.core.safe import printing
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.types import LoggingMode
from forge_obs.recording.collector import record_metric
from forge_obs.recording.reduce import Reduce

__all__ = ["AlertsBackend"]

logger = logging.getLogger("forge_obs")

#: conditions whose onset explains a drop or a slowdown that starts right after
_ROOT_RULES = ("missing_ranks", "quiet_rank", "nonfinite", "straggler", "sync_bottleneck", "stall", "host_contention")
_SYMPTOM_RULES = ("throughput_drop", "slowdown")
#: alerts about time that cite the critical path of their slowest step (when the run has a timeline)
_PATH_RULES = ("slowdown", "straggler", "sync_bottleneck", "throughput_drop")
#: the backends that write the final doctor's findings (after the last step)
_FINAL_READERS = ("wandb", "tensorboard")
#: seconds the final doctor waits for the processes' timeline writers' last pass
_WRITER_PASS_S = 1.0


def _finding_stage(f: Any) -> "str | None":
    d = f.details or {}
    return d.get("span") or d.get("name") or d.get("key")


def _explain(run_dir: Any, first: int, last: int) -> dict | None:
    """:func:`forge_obs.analysis.critical_path.explain` of steps ``first`` to ``last``: from the
    run's index without updating it (:func:`forge_obs.analysis.index.answers.explain`) when the
    run has one, else walked from the files."""
    from forge_obs.analysis.index import available, has_index

    if available() and has_index(run_dir):
        from forge_obs.analysis.index import open_index
        from forge_obs.analysis.index.answers import explain

        return explain(open_index(run_dir, update=False, warn=False), first, last)
    from forge_obs.analysis.critical_path import explain as walk

    return walk(run_dir, first, last)


class AlertsBackend(LoggerBackend):
    """See the module docstring; configuration: :class:`~forge_obs.alerts.config.AlertsConfig`."""

    default_modes = (LoggingMode.GLOBAL_REDUCE, LoggingMode.PER_RANK_REDUCE)
    #: the part of obs/cpu_s its worker thread's CPU is counted in (its own threads count there too)
    cpu_part = "alerts"

    def __init__(self, logger_backend_config: dict[str, Any] | None = None) -> None:
        cfg = dict(logger_backend_config or {})
        self.settings = AlertsConfig.from_dict(cfg)  # raises at init_backends, with the valid choices
        super().__init__({})
        self.modes = self.default_modes  # per-rank views are what stragglers and NaN roots are judged on
        self.ids = Identities()
        self._known: set = set()  # rank labels whose identity was learnt
        self.rules = build_rules(self.settings.doctor, self.ids, self.settings.user_rules, self.settings.disable,
                                 live=True)
        self.active: dict[str, dict] = {}  # alert id -> its firing payload
        self._followers: set = set()  # ids of symptom alerts that follow an active root alert
        self.fired = 0
        self.resolved = 0
        self._active_recorded = 0
        self._lock = threading.RLock()  # alerts come from the backend thread and the watchdog
        self._file: FileSink | None = None
        self._dispatch: Dispatcher | None = None
        self._sync_sinks: list = []
        self._wandb_run: Any = None
        self._last_step_mono: float | None = None
        self._last_step: int | None = None
        self._intervals: list[float] = []
        self._stalled: dict | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.run_id = ""
        self.run_dir: Any = None  # the run directory (its events/ is read when an alert cites the path)
        self._final = False  # the final doctor runs at finish (a backend reads its findings)

    # ------------------------------------------------------------------ lifecycle
    def init(self, run=None, **kwargs: Any) -> None:
        super().init(run)
        s = self.settings
        self.run_id = run.run_id if run is not None else ""
        self.run_dir = getattr(run, "run_dir", None)
        self.flush_timeout_s = float(getattr(run, "flush_timeout_s", 10.0) or 10.0)
        if "console" in s.sinks:
            self._sync_sinks.append(("console", console_sink))
        if "file" in s.sinks and run is not None:
            self._file = FileSink(path_in_run(run.run_dir, s.file_name, "alerts: file_name"))
            self._sync_sinks.append(("file", self._file))
        slow: list = []
        if "wandb" in s.sinks:
            slow.append(("wandb", self._to_wandb))
        if "callback" in s.sinks:
            slow += [(f"callback {getattr(cb, '__name__', cb)!s}", printing(cb)) for cb in s.callbacks]
        if "webhook" in s.sinks:
            slow += [(f"webhook {url}", self._poster(url)) for url in s.webhooks]
        if slow:
            self._dispatch = Dispatcher(slow, s.queue_size, self._count_cpu)
        if "stall" not in s.disable:
            self._watchdog = threading.Thread(target=self._watch, name="forge_obs-alerts-watchdog", daemon=True)
            self._watchdog.start()
        self._final = bool(s.final_doctor and self.run_dir is not None
                           and any(k in (getattr(run, "config", None) or {}) for k in _FINAL_READERS))
        if self._final:
            LATE.expect(self.run_id, "alerts")

    def finish(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(5.0)
        if self._dispatch is not None:
            self._dispatch.close(2 * self.settings.webhook_timeout_s + 1.0)
        if self._file is not None:
            self._file.close()
        if self._final:
            LATE.hand(self.run_id, "alerts", self._final_findings())

    def _final_findings(self) -> LateValues:
        """``forge-obs doctor`` on the run as it ends (after the timeline writers' last pass): its
        findings as rows, for the run's summary in W&B and as text in TensorBoard."""
        time.sleep(_WRITER_PASS_S)
        try:
            from forge_obs.analysis.doctor import diagnose_run

            found = diagnose_run(self.run_dir, config=self.settings.doctor).findings
        except Exception as e:  # noqa: BLE001 - the live rows stand; the run ends anyway
            logger.warning("forge_obs: alerts: the final doctor failed: %r", e)
            return LateValues()
        rows = [finding_row("final", f.kind, {"where": f.where, "mesh": f.mesh, "actor": f.actor, "rank": f.rank,
                                              "replica": f.replica}, list(f.steps), _finding_stage(f), f.message,
                            self.run_dir, (f.critical_path or {}).get("worst_step")) for f in found]
        culprits = "; ".join(f"{r['rule']}: {r['culprit']}" for r in rows) or "none"
        return LateValues(summary={FINAL_FINDINGS_KEY: rows, "doctor/findings_count": len(rows),
                                   "doctor/culprits": culprits})

    # ------------------------------------------------------------------ steps
    def log_step(self, record: StepRecord) -> None:
        self._step(record)  # its CPU: counted by the backend's worker as obs/cpu_alerts_s (cpu_part)

    def _step(self, record: StepRecord) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_step_mono is not None:
                self._intervals.append(now - self._last_step_mono)
                del self._intervals[:-9]
            self._last_step_mono = now
            self._last_step = record.step
            stalled, self._stalled = self._stalled, None
        if stalled is not None:
            self._emit_event(Event("stall", "resolved", stalled["id"], record.step, stalled["onset_step"],
                                   record.step, stalled["message"] + f"; step {record.step} arrived",
                                   stalled["where"], stalled["details"]))
        if record.sources.keys() != self._known:  # a label names mesh, actor and rank: new ones only
            for label, src in record.sources.items():
                if label not in self._known:
                    self._known.add(label)
                    self.ids.learn(src)
        view = StepView(record.step, record.wall_time, record.global_dict(), record.per_rank_values(),
                        record.sources, list(record.missing))
        events: list[Event] = []
        for rule in self.rules:
            try:
                events += rule.update(view)
            except Exception as e:  # noqa: BLE001 - a rule's bug never stops the others or the step
                logger.error("forge_obs: alerts: rule %s failed at step %s: %r", rule.name, record.step, e)
        events.sort(key=lambda e: e.rule in _SYMPTOM_RULES)  # roots first: symptoms may follow from them
        for e in events:
            self._emit_event(e)
        if len(self.active) != self._active_recorded:  # a gauge, recorded at the steps it changes
            self._active_recorded = len(self.active)
            record_metric("alerts/active", self._active_recorded, Reduce.MAX)
        if self._dispatch is not None and (self._dispatch.dropped or self._dispatch.errors):
            record_metric("alerts/dropped", self._dispatch.dropped, Reduce.MAX)
            record_metric("alerts/sink_errors", self._dispatch.errors, Reduce.MAX)

    # ------------------------------------------------------------------ alerts
    def _emit_event(self, e: Event) -> None:
        path = self._path_of(e) if e.state == "firing" and e.rule in _PATH_RULES else None
        with self._lock:
            self._emit_locked(e, path)

    def _path_of(self, e: Event) -> dict | None:
        """The critical path of the slowest step from the alert's onset to the step before it
        (what every process has written by now): its one-line answer and cause. Read from the
        run's index as the live indexer left it (nothing is indexed on this thread: a step not
        indexed yet is not cited); a run without an index is walked."""
        events = self.run_dir / "events" if self.run_dir is not None else None
        if events is None or not events.is_dir():
            return None
        try:
            r = _explain(self.run_dir, e.onset_step, max(e.step - 1, e.onset_step))
        except Exception as err:  # noqa: BLE001 - the alert goes out without its citation
            logger.warning("forge_obs: alerts: no critical path for %s: %r", e.key, err)
            return None
        if r is None:
            return None
        c = r["cause"] or {}
        return {"step": r["step"], "answer": r["answer"],
                "cause": {k: c.get(k) for k in ("mesh", "actor", "rank", "name", "path_s", "share")}}

    def _emit_locked(self, e: Event, path: dict | None = None) -> None:
        alert = e.to_dict()
        if path is not None:
            alert["critical_path"] = path
            alert["message"] += f"; critical path of step {path['answer'].removeprefix('step ')}"
        alert["run_id"] = self.run_id
        alert["ts"] = time.time()
        if e.state == "firing":
            if e.rule in _SYMPTOM_RULES:  # a drop or slowdown while a root condition is on follows from it
                related = [a["id"] for a in self.active.values() if a["rule"] in _ROOT_RULES]
                if related:
                    alert["consequence_of"] = related
                    alert["message"] += f" (probably a consequence of: {', '.join(related)})"
                    self._followers.add(e.key)
            self.active[e.key] = alert
            self.fired += 1
        else:
            alert["state"] = "resolved"
            self.active.pop(e.key, None)
            self.resolved += 1
        follower = e.key in self._followers
        if follower and e.state != "firing":
            self._followers.discard(e.key)
        if not follower:  # a row of the findings table (W&B: one table over the run)
            record_metric(FINDINGS_KEY, alert_row(alert, self.run_dir), Reduce.SAMPLE)
        self._send(alert, file_only=follower)

    def _send(self, alert: dict, file_only: bool = False) -> None:
        """Every sink; a symptom that follows an active root alert goes to alerts.jsonl only (one
        page per root event)."""
        with self._lock:
            for name, sink in self._sync_sinks:
                if file_only and name != "file":
                    continue
                try:
                    sink(alert)
                except Exception as e:  # noqa: BLE001
                    logger.error("forge_obs: alerts: sink %s failed: %r", name, e)
        if self._dispatch is not None and not file_only:
            self._dispatch.submit(alert)

    def _to_wandb(self, alert: dict) -> None:
        run = self._wandb_run
        if run is None or getattr(run, "_is_finished", False):
            run = self._wandb_run = find_wandb_run(self.run_id)
        if run is not None:
            wandb_alert(run, alert)

    def _poster(self, url: str):
        timeout = self.settings.webhook_timeout_s

        def post(alert: dict) -> None:
            post_json(url, alert, timeout)

        return post

    def _count_cpu(self, seconds: float) -> None:
        if seconds > 0:
            SELF_OBS.add("alerts", seconds)

    # ------------------------------------------------------------------ watchdog
    def stall_threshold_s(self) -> float | None:
        """Seconds without a step after which the loop is reported stalled (None: not yet known):
        ``stall_s``, or max(``stall_floor_s``, ``stall_factor`` x the median time between steps,
        the flush timeout + 2 steps). A step legitimately waits up to the flush timeout for a rank
        that does not answer (that is a ``missing_ranks`` alert, not a stall)."""
        s = self.settings
        if s.stall_s is not None:
            return s.stall_s
        with self._lock:
            iv = list(self._intervals)
        if not iv:
            return None
        typical = median(iv)
        return max(s.stall_floor_s, s.stall_factor * typical, self.flush_timeout_s + 2 * typical)

    def _watch(self) -> None:
        """Sleeps until the moment the loop would count as stalled (not polling: every wake-up
        costs CPU), re-checks, and sleeps again if a step arrived meanwhile."""
        cpu = time.thread_time()  # this thread's CPU so far: one clock read per wake
        while not self._stop.is_set():
            limit = self.stall_threshold_s()
            with self._lock:
                last, step, stalled = self._last_step_mono, self._last_step, self._stalled
            wait = 1.0
            if limit is not None and last is not None and stalled is None:
                silent = time.monotonic() - last
                if silent > limit:
                    self._fire_stall(step, silent, limit)
                else:
                    wait = limit - silent + 0.01
            elif stalled is not None:
                wait = 1.0  # the next step resolves it (on the backend thread)
            now = time.thread_time()
            self._count_cpu(now - cpu)
            cpu = now
            self._stop.wait(min(wait, 60.0))

    def _fire_stall(self, step: int | None, silent: float, limit: float) -> None:
        where = {"mesh": "controller", "actor": None, "rank": 0, "replica": None, "where": "the training loop"}
        with self._lock:
            typical = median(self._intervals) if self._intervals else None
        msg = (f"no step reached the logger for {silent:.1f}s after step {step} "
               f"(limit {limit:.1f}s" + (f"; steps usually take {typical:.2f}s" if typical else "") +
               "): the loop is stalled or waiting on a hung rank")
        onset = (step + 1) if isinstance(step, int) else step
        e = Event("stall", "firing", f"stall:loop:{onset}", onset, onset, onset, msg, where,
                  {"silent_s": round(silent, 3), "limit_s": round(limit, 3), "last_step": step})
        with self._lock:
            if self._stalled is not None or self._last_step != step:
                return  # a step arrived meanwhile
            self._stalled = {"id": e.key, "onset_step": onset, "message": msg, "where": where, "details": e.details}
        self._emit_event(e)
