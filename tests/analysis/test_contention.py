"""A busy host or a slow actor (issue 39): the doctor and the live alerts on generated runs of a
2-rank data-parallel trainer on a host shared with other jobs (tests/support/doctor_runs.py:
BusyDP, write_busy_run: spans with their CPU time, the processes' and the host's telemetry).
Clean runs whose slowness was the host's carry no finding about an actor; every planted fault is
still named, also while the host is busy; without telemetry the doctor judges as before."""

from __future__ import annotations

import pytest

from forge_obs.analysis.doctor import diagnose_run, format_findings
from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.replay import step_views
from forge_obs.analysis.doctor.rules import build_rules
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.store import read_jsonl
from tests.support.doctor_runs import BusyDP, write_busy_run

N = 300
ACTOR_KINDS = {"straggler", "slowdown", "hang", "stall", "sync_bottleneck", "quiet_rank", "missing_ranks"}


def live(run, disable=("slowdown",)):
    """The live alert rules over the run's metrics.jsonl, as the alerts backend runs them."""
    ids = Identities()
    rules = build_rules(DoctorConfig(), ids, [], disable, live=True)
    out = []
    for view in step_views(read_jsonl(run / "metrics.jsonl"), ids, {"per_rank": 0}):
        for rule in rules:
            out += rule.update(view)
    return out


def doctor(tmp_path, name, dp, **kw):
    run = tmp_path / name
    write_busy_run(run, dp, N, **kw)
    return run, diagnose_run(run)


# ---------------------------------------------------------------- clean runs: the host's, not an actor's


def test_a_rank_starved_for_7_steps_is_the_hosts_not_a_straggler_alert(tmp_path):
    """Phase 1's last false alarm on clean runs: a rank the scheduler starved for 4-10 steps fired
    a straggler alert (2.1-3.3x its peer). Its forward-backward took its usual CPU time and
    waited for a CPU the rest: one host_contention alert, fired and resolved, with the figures."""
    dp = BusyDP(N, starve={(1, s): 3.0 for s in range(100, 107)})
    run, d = doctor(tmp_path, "starved", dp)
    assert d.findings == [], format_findings(d.findings)
    alerts = live(run)
    assert [(e.rule, e.state) for e in alerts] == [("host_contention", "firing"), ("host_contention", "resolved")]
    e = alerts[0]
    assert e.where["where"] == "host node0" and e.onset_step == 100 and e.step <= 104
    assert "trainer/Trainer/r1 'span/forward_backward/duration_s'" in e.message
    assert "runnable tasks per core" in e.message
    assert e.details["figures"]["runnable_per_core"] > 1 and e.details["explained"][0]["explained"]
    # without telemetry the same run is the straggler alert it was
    starved = BusyDP(N, starve={(1, s): 3.0 for s in range(100, 107)})
    run, _d = doctor(tmp_path, "starved_notel", starved, telemetry=False)
    assert [(e.rule, e.state, e.where["where"]) for e in live(run)] == [
        ("straggler", "firing", "trainer/Trainer/r1"), ("straggler", "resolved", "trainer/Trainer/r1")]


def test_every_rank_slowed_by_the_host_is_one_host_contention_finding(tmp_path):
    """Steps 150-174: the host's other jobs take the CPUs; every trainer rank's forward-backward
    is 3x slower on its usual CPU time, and the controller's step with it. It was a slowdown of
    the mesh; now one host_contention finding, with the slowdown and the controller under it."""
    spell = {s: 3.0 for s in range(150, 175)}
    _run, bare = doctor(tmp_path, "notel", BusyDP(N, spell=spell), telemetry=False)
    assert [f.kind for f in bare.findings] == ["slowdown"], format_findings(bare.findings)
    _run, d = doctor(tmp_path, "spell", BusyDP(N, spell=spell))
    (f,) = d.findings
    assert (f.kind, f.where, f.steps, f.mesh, f.rank) == ("host_contention", "host node0", [150, 174], None, None), \
        format_findings(d.findings)
    assert "oversubscribed in steps 150..174" in f.message and "runnable tasks per core" in f.message
    kinds = [(c["kind"], c["where"]) for c in f.consequences]
    assert ("slowdown", "trainer/Trainer (every rank)") in kinds and ("slowdown", "controller/r0") in kinds
    ex = f.details["explained"][0]
    assert ex["extra_runq_s"] > 0.5 * ex["excess_s"] and ex["cpu_ratio"] < 1.5
    assert f.details["figures"]["oversubscribed"] > 0.5


def test_a_throughput_drop_while_the_host_is_hammered_is_the_hosts(tmp_path):
    """Phase 1's last false finding on clean runs: a throughput drop at load ~15. The processes
    waited for a CPU most of the time then: the drop is listed under host_contention, in the
    doctor and live (the drop alert a consequence of it)."""
    spell = {s: 10.0 for s in range(200, 207)}
    run, bare = doctor(tmp_path, "notel", BusyDP(N, spell=spell), telemetry=False)
    assert {f.kind for f in bare.findings} == {"throughput_drop"}
    run, d = doctor(tmp_path, "hammered", BusyDP(N, spell=spell))
    (f,) = d.findings
    assert f.kind == "host_contention" and f.onset_step == 200, format_findings(d.findings)
    assert sorted(c["where"] for c in f.consequences) == ["controller", "the training loop"]
    assert all(c["kind"] == "throughput_drop" for c in f.consequences)
    alerts = live(run)
    assert [(e.rule, e.state) for e in alerts if e.state == "firing"][0] == ("host_contention", "firing")
    assert "the step rate at" in alerts[0].message and "waited for a CPU" in alerts[0].message


@pytest.mark.parametrize("steps, quick_at_end", [(300, 9), (1000, 0)])
def test_clean_busy_runs_stay_clean_with_telemetry(tmp_path, steps, quick_at_end):
    """BusyDP's clean runs (the scheduler favouring one rank for 5-12 steps at a time, ranks
    descheduled now and then) have no finding and raise no alert, with the host busy throughout."""
    run = tmp_path / "clean"
    write_busy_run(run, BusyDP(steps, quick_at_end=quick_at_end), steps)
    d = diagnose_run(run)
    assert d.findings == [], format_findings(d.findings)
    assert live(run) == []


# ---------------------------------------------------------------- faults: still the actor's


def test_a_sleeping_rank_on_a_busy_host_is_still_a_straggler(tmp_path):
    """Rank 1 sleeps 0.5 s more per step from step 120 (GRPO's --fault-slow-trainer-rank) while
    the host is busy: its CPU time is its usual, but it did not wait for a CPU: the straggler is
    named (doctor and live), and its message says why it is not the host's."""
    run, d = doctor(tmp_path, "sleep", BusyDP(N, slow_rank=1, slow_from=120))
    (f,) = d.findings
    assert (f.kind, f.where, f.onset_step) == ("straggler", "trainer/Trainer/r1", 120), format_findings(d.findings)
    assert "its host node0 was busy" in f.message and "waited" in f.message
    assert f.details["host_contention"]["explained"] is False
    fired = [e for e in live(run) if e.state == "firing"]
    assert [(e.rule, e.where["where"]) for e in fired][0] == ("straggler", "trainer/Trainer/r1")
    assert "host_contention" not in {e.rule for e in fired}


def test_a_rank_doing_more_work_on_a_busy_host_is_still_a_straggler(tmp_path):
    """Rank 1 computes 4x more from step 120: its CPU time grew with its wall time."""
    run, d = doctor(tmp_path, "cpu", BusyDP(N, cpu_fault={(1, s): 4.0 for s in range(120, N)}))
    (f,) = d.findings
    assert (f.kind, f.where) == ("straggler", "trainer/Trainer/r1"), format_findings(d.findings)
    assert "more work, not waiting" in f.message and f.details["cpu_ratio"] > 2
    fired = [e for e in live(run) if e.state == "firing"]
    assert [(e.rule, e.where["where"], e.onset_step) for e in fired] == [("straggler", "trainer/Trainer/r1", 120)]


def test_a_fault_that_starts_while_the_rank_is_starved_is_named(tmp_path):
    """Rank 1 starved at steps 100-106 (the host's) and sleeping 0.5 s more from step 104 (a
    fault): the doctor names the straggler, and the live alert, held as the host's at first, fires
    as the rank's own once its next out-of-line steps are not explained (within 10 steps)."""
    dp = BusyDP(N, starve={(1, s): 3.0 for s in range(100, 107)}, slow_rank=1, slow_from=104)
    run, d = doctor(tmp_path, "both", dp)
    assert [(f.kind, f.where) for f in d.findings] == [("straggler", "trainer/Trainer/r1")], format_findings(d.findings)
    straggler = [e for e in live(run) if e.rule == "straggler" and e.state == "firing"]
    assert len(straggler) == 1 and straggler[0].step <= 114 and straggler[0].where["rank"] == 1


def test_without_telemetry_the_doctor_says_it_did_not_judge_the_host(tmp_path):
    _run, d = doctor(tmp_path, "sleep", BusyDP(N, slow_rank=1, slow_from=120), telemetry=False)
    assert [f.kind for f in d.findings] == ["straggler"]
    assert any("no telemetry (obs/sys/...)" in n for n in d.notes), d.notes


def test_the_contention_thresholds_are_settings(tmp_path):
    """``contention_share`` (doctor --set, the alerts config): at 10 (the extra wait would have to
    be 10x the extra time) the starved rank is a straggler alert again."""
    run = tmp_path / "r"
    write_busy_run(run, BusyDP(N, starve={(1, s): 3.0 for s in range(100, 107)}), N)
    ids = Identities()
    rules = build_rules(DoctorConfig.from_dict({"contention_share": 10}), ids, [], ("slowdown",), live=True)
    got = [e for view in step_views(read_jsonl(run / "metrics.jsonl"), ids, {"per_rank": 0}) for r in rules
           for e in r.update(view)]
    assert [e.rule for e in got] == ["straggler", "straggler"]
    with pytest.raises(ValueError, match="contention_share must be >= 0"):
        DoctorConfig.from_dict({"contention_share": -1})
    got_kinds = {e.rule for e in live(run, disable=("slowdown", "host_contention"))}
    assert got_kinds == {"straggler"}


# ---------------------------------------------------------------- a sample every few steps


@pytest.mark.parametrize("every", [2, 4])
def test_with_a_sample_every_few_steps_the_host_is_still_told_from_an_actor(tmp_path, every):
    """Processes that sample every ``every`` steps (telemetry's stride at ~0.1 s steps,
    docs/telemetry.md), each sample covering the steps since the one before; the steps between
    carry no telemetry. The verdicts are the same as with a sample at every step: a clean busy run
    and a rank starved for 7 steps are the host's (no finding, no actor alert), a host's spell is
    one host_contention finding, a sleeping rank and a rank computing more are named."""
    kw = {"sample_every": every}
    run, d = doctor(tmp_path, "clean", BusyDP(N, quick_at_end=9), **kw)
    assert d.findings == [] and live(run) == [], format_findings(d.findings)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("mode") == "per_rank_reduce"]
    assert {r["step"] % every for r in rows if "obs/sys/proc/cpu_s" in r["metrics"]} == {0}
    assert any("obs/sys/proc/cpu_s" not in r["metrics"] for r in rows)  # steps without a sample

    run, d = doctor(tmp_path, "starved", BusyDP(N, starve={(1, s): 3.0 for s in range(100, 107)}), **kw)
    assert d.findings == [], format_findings(d.findings)
    assert {e.rule for e in live(run)} == {"host_contention"}

    _run, d = doctor(tmp_path, "spell", BusyDP(N, spell={s: 3.0 for s in range(150, 175)}), **kw)
    assert [f.kind for f in d.findings] == ["host_contention"], format_findings(d.findings)

    run, d = doctor(tmp_path, "sleep", BusyDP(N, slow_rank=1, slow_from=120), **kw)
    assert [(f.kind, f.where, f.onset_step) for f in d.findings] == [("straggler", "trainer/Trainer/r1", 120)], \
        format_findings(d.findings)
    fired = [e for e in live(run) if e.state == "firing"]
    assert [(e.rule, e.where["where"]) for e in fired][:1] == [("straggler", "trainer/Trainer/r1")]

    run, d = doctor(tmp_path, "cpu", BusyDP(N, cpu_fault={(1, s): 4.0 for s in range(120, N)}), **kw)
    assert [(f.kind, f.where) for f in d.findings] == [("straggler", "trainer/Trainer/r1")], format_findings(d.findings)
    assert [(e.rule, e.where["where"]) for e in live(run) if e.state == "firing"] == [("straggler", "trainer/Trainer/r1")]
