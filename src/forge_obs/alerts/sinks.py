"""Where an alert goes. The console line and the ``alerts.jsonl`` line are written at once (cheap,
bounded); the W&B call, Python callbacks and webhook POSTs can block, so they run on one thread
of their own fed by a bounded queue (full: the alert is dropped for those sinks and counted).

    >>> from forge_obs.alerts.sinks import console_line
    >>> print(console_line({"state": "firing", "rule": "nonfinite", "where": "trainer/Trainer/r0",
    ...                     "replica": None, "step": 20, "onset_step": 20, "message": "'loss' = nan"}))
    [forge_obs alert] FIRING nonfinite trainer/Trainer/r0 (step 20): 'loss' = nan
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from forge_obs.core.safe import write_line
from forge_obs.core.shell import printed_command
from forge_obs.core.warn import RateLimitedWarner

__all__ = [
    "WARNER",
    "console_line",
    "FileSink",
    "console_sink",
    "find_wandb_run",
    "wandb_alert",
    "post_json",
    "Dispatcher",
    "FINDINGS_KEY",
    "FINAL_FINDINGS_KEY",
    "finding_row",
    "alert_row",
]

#: the live findings (a row per alert, firing and resolved: one table over the run in W&B)
FINDINGS_KEY = "doctor/findings"
#: the final doctor's findings, at shutdown (the run's summary)
FINAL_FINDINGS_KEY = "doctor/final_findings"

logger = logging.getLogger("forge_obs")
WARNER = RateLimitedWarner(interval_s=60.0)


def console_line(alert: dict) -> str:
    where = alert.get("where") or "-"
    if alert.get("replica") is not None:
        where += f" (replica {alert['replica']})"
    if alert.get("state") == "firing":
        return f"[forge_obs alert] FIRING {alert['rule']} {where} (step {alert['step']}): {alert['message']}"
    return (f"[forge_obs alert] resolved {alert['rule']} {where} at step {alert['step']} "
            f"(since step {alert.get('onset_step')}): {alert['message']}")


class FileSink:
    """``runs/<run_id>/alerts.jsonl``: one JSON object per alert (firing and resolved)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.f = open(path, "a", encoding="utf-8")

    def __call__(self, alert: dict) -> None:
        self.f.write(json.dumps(alert, default=str) + "\n")
        self.f.flush()

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


def console_sink(alert: dict) -> None:
    write_line(sys.stderr, console_line(alert), flush=True)


def find_wandb_run(run_id: str) -> Any:
    """The active W&B run alerts go to: ``wandb.run`` if the user set one, else the experiment run
    the ``"wandb"`` backend created (named after the run id). None when W&B is not in use: W&B
    is never imported for this."""
    wandb = sys.modules.get("wandb")
    if wandb is None:
        return None
    run = getattr(wandb, "run", None)
    if run is not None:
        return run
    try:  # the wandb backend's runs are made with reinit="create_new", which leaves wandb.run unset
        from wandb.sdk import wandb_setup

        active = list(getattr(wandb_setup.singleton(), "_active_runs", []) or [])
    except Exception:  # noqa: BLE001 - another W&B version
        return None
    named = [r for r in active if getattr(r, "name", None) == run_id]
    return named[0] if named else None


def wandb_alert(run: Any, alert: dict) -> None:
    firing = alert["state"] == "firing"
    title = f"{'FIRING' if firing else 'resolved'} {alert['rule']} {alert.get('where') or ''}"[:63]
    run.alert(title=title, text=console_line(alert), level="WARN" if firing else "INFO", wait_duration=1)


def _stage(details: dict, path: "dict | None", mesh: Any, rank: Any) -> "str | None":
    """The stage a finding is about: the span its evidence names, else the one its critical-path
    citation names on the same rank, else its metric's key (``span/<name>/duration_s`` -> name)."""
    if details.get("span"):
        return str(details["span"])
    cause = (path or {}).get("cause") or {}
    if cause.get("name") and cause.get("mesh") == mesh and cause.get("rank") == rank:
        return str(cause["name"])
    key = details.get("key")
    if isinstance(key, str) and key.startswith("span/") and key.endswith("/duration_s"):
        return key[len("span/"):-len("/duration_s")]
    return str(key) if key else None


def finding_row(state: str, kind: str, where: dict, steps: list, stage: "str | None", evidence: str, run_dir: Any,
                why_step: "int | None" = None) -> dict:
    """One findings row: the step range, the culprit (mesh, actor, rank, replica, stage), the
    evidence and the ``forge-obs why`` / ``trace`` commands that show it."""
    first, last = (steps[0], steps[-1]) if steps else (None, None)
    culprit = " ".join(x for x in (where.get("where") or where.get("mesh") or "", stage or "") if x)
    row = {"state": state, "rule": kind, "culprit": culprit, "mesh": where.get("mesh"), "actor": where.get("actor"),
           "rank": where.get("rank"), "replica": where.get("replica"), "stage": stage,
           "steps": "" if first is None else (f"{first}" if first == last else f"{first}..{last}"),
           "first_step": first, "last_step": last, "evidence": evidence}
    if run_dir is not None:
        at = why_step if why_step is not None else last
        row["why"] = printed_command("why", run_dir, "--step", at) if at is not None else printed_command("why", run_dir)
        row["trace"] = printed_command("trace", run_dir, *(["--steps", f"{first}:{last}"] if first is not None else []),
                                       "--critical-path", "--open")
    return row


def alert_row(alert: dict, run_dir: Any) -> dict:
    """A live alert (firing or resolved) as a findings row."""
    details = alert.get("details") or {}
    path = alert.get("critical_path")
    stage = _stage(details, path, alert.get("mesh"), alert.get("rank"))
    steps = [alert.get("onset_step"), alert.get("last_step") if alert.get("last_step") is not None else alert.get("step")]
    steps = [s for s in steps if s is not None]
    return finding_row(alert.get("state", "firing"), alert.get("rule", ""), alert, steps, stage,
                       alert.get("message", ""), run_dir, (path or {}).get("step"))


def post_json(url: str, alert: dict, timeout_s: float) -> int:
    req = urllib.request.Request(url, data=json.dumps(alert, default=str).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "forge_obs-alerts"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - a URL the user configured
        return resp.status


class Dispatcher:
    """One thread, one bounded queue, for the sinks that can block (W&B, callbacks, webhooks)."""

    _STOP = object()

    def __init__(self, sinks: list[tuple[str, Callable[[dict], Any]]], queue_size: int,
                 count_cpu: Callable[[float], None]) -> None:
        self.sinks = sinks
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped = 0
        self.errors = 0
        self.delivered = 0
        self._count_cpu = count_cpu
        self.thread = threading.Thread(target=self._run, name="forge_obs-alerts-sinks", daemon=True)
        self.thread.start()

    def submit(self, alert: dict) -> None:
        try:
            self.q.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            WARNER.warn("alerts_dropped", "queue", "alerts: the webhook/callback queue is full (a sink is too slow); "
                        "alert dropped for those sinks (counted in alerts/dropped)")

    def _run(self) -> None:
        while True:
            alert = self.q.get()
            if alert is self._STOP:
                return
            c0 = time.thread_time()
            for name, sink in self.sinks:
                try:
                    sink(alert)
                    self.delivered += 1
                except Exception as e:  # noqa: BLE001 - a sink's failure is counted, never raised
                    self.errors += 1
                    WARNER.warn("alerts_sink", name, f"alerts: sink {name} failed: {e!r} (counted in alerts/sink_errors)")
            self._count_cpu(time.thread_time() - c0)

    def close(self, timeout_s: float) -> None:
        """Deliver what is queued (at most ``timeout_s``), then stop the thread."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.q.put(self._STOP, timeout=max(0.01, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            logger.warning("forge_obs: alerts: %d queued alert(s) not delivered within %.1fs at shutdown",
                           self.q.qsize(), timeout_s)
