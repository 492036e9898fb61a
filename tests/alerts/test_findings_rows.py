"""The findings in the dashboard: every live alert (firing and resolved, not a consequence recorded
under another) is a ``doctor/findings`` row with its step range, culprit (mesh, actor, rank,
stage), evidence and the ``forge-obs why`` / ``trace`` commands; at shutdown the final doctor's
findings are handed to the backends that write after the last step (W&B's summary, TensorBoard)."""

from __future__ import annotations

import pytest

import forge_obs.alerts.backend as alerts_backend
from forge_obs.alerts import AlertsBackend
from forge_obs.alerts.sinks import FINAL_FINDINGS_KEY, FINDINGS_KEY
from forge_obs.backends.late import LATE
from forge_obs.backends.record import RunContext
from tests.alerts.test_alerts import record
from tests.support.path_runs import grpo_run

SLOW_FROM = 6


@pytest.fixture
def recorded(monkeypatch):
    """What the alerts backend records (``record_metric``), as (key, value, reduction)."""
    out = []
    monkeypatch.setattr(alerts_backend, "record_metric", lambda k, v, r=None: out.append((k, v, r)))
    return out


def _feed(be, steps: int) -> None:
    for s in range(steps):
        slow = s >= SLOW_FROM
        be.log_step(record(s, {"trainer/loss": float("nan") if s == 9 else 0.5}, per_rank={
            "trainer/Trainer/r0": {"trainer/forward_backward_s": 0.2, "trainer/idle_s": 0.7 if slow else 0.0},
            "trainer/Trainer/r1": {"trainer/forward_backward_s": 0.9 if slow else 0.2}}))


def test_every_alert_is_a_findings_row_with_its_culprit_and_commands(tmp_path, recorded):
    run_dir = grpo_run(tmp_path / "t", 16, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    be = AlertsBackend({"sinks": ["file"]})
    be.init(run=RunContext(run_id="t", run_dir=run_dir))
    try:
        _feed(be, 16)
    finally:
        be.finish()
    rows = [v for k, v, _r in recorded if k == FINDINGS_KEY]
    assert all(r == "sample" or getattr(r, "value", r) == "sample" for k, _v, r in recorded if k == FINDINGS_KEY)
    (st,) = [r for r in rows if r["rule"] == "straggler"]
    # the stage: the span its critical-path citation names on that rank (the metric is the app's own key)
    assert (st["state"], st["mesh"], st["actor"], st["rank"], st["stage"]) == ("firing", "trainer", "Trainer", 1,
                                                                                 "forward_backward")
    assert st["culprit"] == "trainer/Trainer/r1 forward_backward" and st["first_step"] == SLOW_FROM
    assert st["steps"] == f"{SLOW_FROM}..{st['last_step']}" and "critical path of step" in st["evidence"]
    # the command shows the step the alert cites: its slowest since the onset
    assert st["why"].endswith(f"why {run_dir} --step {st['why'].split()[-1]}")
    assert SLOW_FROM <= int(st["why"].split()[-1]) <= st["last_step"]
    assert st["trace"].endswith(f"trace {run_dir} --steps {SLOW_FROM}:{st['last_step']} --critical-path --open")
    nan = [r for r in rows if r["rule"] == "nonfinite"]
    assert [(r["state"], r["stage"], r["steps"]) for r in nan] == [("firing", "trainer/loss", "9"),
                                                                   ("resolved", "trainer/loss", "9")]


def test_the_final_doctor_is_handed_to_the_backends_that_write_after_the_last_step(tmp_path, recorded):
    run_dir = grpo_run(tmp_path / "f", 20, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    be = AlertsBackend({"sinks": ["file"]})
    be.init(run=RunContext(run_id="final-1", run_dir=run_dir, config={"wandb": {}, "alerts": {}}))
    _feed(be, 3)
    be.finish()
    (late,) = LATE.take("final-1", "wandb", timeout_s=0.0)
    rows = late.summary[FINAL_FINDINGS_KEY]
    (st,) = [r for r in rows if r["rule"] == "straggler"]
    assert (st["state"], st["mesh"], st["rank"], st["stage"], st["steps"]) == ("final", "trainer", 1, "forward_backward",
                                                                               f"{SLOW_FROM}..19")
    assert st["why"].endswith(f"--step {st['why'].split()[-1]}") and "on the critical path" in st["evidence"]
    assert late.summary["doctor/findings_count"] == len(rows) and "straggler: trainer/" in late.summary["doctor/culprits"]


def test_no_final_doctor_without_a_backend_that_writes_it(tmp_path, recorded):
    be = AlertsBackend({"sinks": ["file"]})
    be.init(run=RunContext(run_id="final-2", run_dir=tmp_path, config={"jsonl": {}, "console": {}, "alerts": {}}))
    be.finish()
    assert not LATE.expects("final-2")
    with pytest.raises(ValueError, match="final_doctor must be true or false"):
        AlertsBackend({"final_doctor": "yes"})
