"""``forge-obs doctor`` on run directories with planted faults (files in the documented formats,
exact timings): stragglers from 2 ranks up, roles, one finding per root event, full identity,
shares without start-up, and what a detector could not judge."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from forge_obs.recording import timeline as tl
from forge_obs.analysis.doctor import diagnose, diagnose_run, format_findings
from tests.support.doctor_runs import BusyDP, source, write_metrics, write_startup, write_timeline
from tests.recording.test_timeline import _fake_run


def jitter(rank: int, step: int) -> float:
    """A healthy rank's spread: ±10 %, deterministic."""
    return 1.0 + 0.05 * (((rank * 7 + step * 13) % 5) - 2)


def trainer_spans(slow_rank=None, from_step=0, factor=3.0, push_rank0=True):
    def spans(mesh, rank, step):
        d = 0.010 * jitter(rank, step)
        if rank == slow_rank and step >= from_step:
            d *= factor
        out = [("train", d)]
        if push_rank0:
            out.append(("push_weights", 0.0018 if rank == 0 else 0.00001))
        return out
    return spans


def _cli(*argv):
    return subprocess.run([sys.executable, "-c", "import sys; from forge_obs.cli import main; sys.exit(main())", *argv],
                          capture_output=True, text=True)


# ---------------------------------------------------------------- stragglers


def test_two_ranks_slow_from_step_10_is_named_with_its_onset(tmp_path):
    write_timeline(tmp_path, {"trainer": 2}, 40, trainer_spans(slow_rank=1, from_step=10))
    found = diagnose(tmp_path)
    assert [(f.kind, f.mesh, f.rank) for f in found] == [("straggler", "trainer", 1)], format_findings(found)
    (f,) = found
    assert f.onset_step == 10 and f.steps == [10, 39]
    assert "since step 10" in f.message and "'train'" in f.message
    assert 2.5 < f.details["median_ratio"] < 3.5
    assert f.actor == "Trainer" and f.where == "trainer/Trainer/r1"


def test_one_noisy_step_before_the_onset_does_not_move_it(tmp_path):
    """Rank 1 slow from step 3; one slow step at 1 (a noisy machine), fast at 2: onset is step 3."""
    base = trainer_spans(slow_rank=1, from_step=3)

    def spans(mesh, rank, step):
        out = base(mesh, rank, step)
        return [("train", out[0][1] * 3.0)] + out[1:] if (rank, step) == (1, 1) else out
    write_timeline(tmp_path, {"trainer": 2}, 12, spans)
    (f,) = diagnose(tmp_path)
    assert (f.kind, f.rank, f.onset_step) == ("straggler", 1, 3), f.message


def test_a_small_out_of_line_step_just_before_the_onset_does_not_move_it(tmp_path):
    """Rank 1 0.3 s slower from step 3; at step 2 (a loaded machine) 2.5x its peer, out of line but
    a tenth of the slowdown: onset is step 3, and step 2 is not one of its steps."""
    from forge_obs.analysis.doctor.config import DoctorConfig
    from forge_obs.analysis.doctor.detect import GroupTracker
    t = GroupTracker(DoctorConfig(), keep=True)
    for step in range(12):
        slow = 0.33 if step >= 3 else 0.025 if step == 2 else 0.01
        t.update(step, {0: 0.01, 1: slow}, step_s=0.15 if step < 3 else 0.4)
    (ep,) = [e for e in t.finish() if e.kind == "straggler"]
    assert (ep.rank, ep.onset, ep.end, ep.hit_steps[0], ep.hits) == (1, 3, 11, 3, 9)


def test_a_peer_slow_at_the_first_slow_step_does_not_move_the_onset():
    """Rank 1 3x slower from step 6; rank 0 overslept at step 6 (35 ms instead of 20 ms: a busy
    host), so rank 1 was only 1.7x it there. It was 'since step 7' (tests/alerts/test_alerts_mesh.py
    on a loaded machine): rank 1 was at its slow level and slower than its peer: step 6."""
    from forge_obs.analysis.doctor.config import DoctorConfig
    from forge_obs.analysis.doctor.detect import GroupTracker
    t = GroupTracker(DoctorConfig(), keep=True)
    for step in range(16):
        t.update(step, {0: 0.035 if step == 6 else 0.02, 1: 0.06 if step >= 6 else 0.02}, step_s=0.08)
    (ep,) = [e for e in t.finish() if e.kind == "straggler"]
    assert (ep.rank, ep.onset, ep.end, ep.hits) == (1, 6, 15, 10)


def test_an_even_straggler_keeps_its_first_step_and_a_ramp_starts_at_half_its_median_excess():
    from forge_obs.analysis.doctor.detect import Persistence
    for excess, onset in [([0.3, 0.3, 0.3, 0.3], 0), ([0.2, 0.3, 0.25, 0.3], 0), ([0.05, 0.1, 0.2, 0.4], 1)]:
        p = Persistence(fire=4, window=5, clear=1, level=lambda pl: pl, lead_share=0.5)
        for i, x in enumerate(excess):
            p.update(i, True, x)
        assert p.onset == onset, (excess, p.onset)


def test_persistence_onset_skips_a_lone_leading_hit():
    from forge_obs.analysis.doctor.detect import Persistence
    for pattern, onset in [("HMHHH", 2), ("HHMHH", 0), ("MHHHH", 1), ("HHHMM", None), ("HHHH", 0)]:
        p = Persistence(fire=4, window=5, clear=1)
        states = [p.update(i, c == "H") for i, c in enumerate(pattern)]
        assert ("onset" in states) == (onset is not None) and (onset is None or p.onset == onset), (pattern, p.onset)


def test_two_ranks_slow_from_the_start(tmp_path):
    write_timeline(tmp_path, {"trainer": 2}, 20, trainer_spans(slow_rank=0, factor=3.0))
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.onset_step) for f in found] == [("straggler", 0, 0)], format_findings(found)


def test_three_ranks_clean_with_rank0_only_work_has_no_findings(tmp_path):
    """Rank 0 alone writes the weights (1.8 ms vs 0.01 ms elsewhere): a role, not a straggler."""
    write_timeline(tmp_path, {"trainer": 3}, 40, trainer_spans())
    d = diagnose_run(tmp_path)
    assert d.findings == [], format_findings(d.findings)
    assert any("push_weights" in n and "trainer/Trainer/r0" in n for n in d.notes), d.notes


def test_three_ranks_slow_rank_is_found_and_role_work_is_not(tmp_path):
    write_timeline(tmp_path, {"trainer": 3}, 40, trainer_spans(slow_rank=1, from_step=10))
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.onset_step) for f in found] == [("straggler", 1, 10)], format_findings(found)


def test_a_straggler_whose_peers_work_about_as_long_as_a_role_threshold_is_found(tmp_path):
    """Rank 1 loads its data for 1.5 s; rank 0 for 0.7-2.4 ms, now under ``role_peer_max_s`` (1 ms),
    now over it (TorchTitan's DP run with a slowed rank). Rank 1 has no role (its first steps
    were not all like one): every step is judged, also those where rank 0 was quick."""
    peer_ms = [2.29, 0.94, 0.88, 2.45, 0.77, 1.90, 0.75, 0.91]

    def spans(mesh, rank, step):
        load = 1.5 if rank == 1 else peer_ms[step] / 1e3
        return [("data_loading", load), ("forward_backward", 0.3 * jitter(rank, step))]

    write_timeline(tmp_path, {"trainer": 2}, len(peer_ms), spans)
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.onset_step) for f in found] == [("straggler", 1, 0)], format_findings(found)


def test_tiny_spans_stay_quiet(tmp_path):
    """3x slower, but 0.3 ms against a 50 ms step: under the minimum duration and share."""
    def spans(mesh, rank, step):
        return [("train", 0.05 * jitter(rank, step)), ("log", 0.0003 if rank == 1 else 0.0001)]

    write_timeline(tmp_path, {"trainer": 3}, 30, spans)
    assert diagnose(tmp_path) == []


def test_role_work_that_grows_over_time_is_a_slowdown(tmp_path):
    """Rank 0's own job (the weights) goes from 2 ms to 40 ms at step 20: judged against its history."""
    def spans(mesh, rank, step):
        out = [("train", 0.010 * jitter(rank, step))]
        if rank == 0:
            out.append(("push_weights", 0.040 if step >= 20 else 0.002))
        return out

    write_timeline(tmp_path, {"trainer": 2}, 40, spans)
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.onset_step) for f in found] == [("slowdown", 0, 20)], format_findings(found)
    assert "push_weights" in found[0].message and "since step 20" in found[0].message
    # consequences: the controller's step got slower, and the weight push now takes most of r0's time
    assert {c["kind"] for c in found[0].consequences} == {"slowdown", "sync_bottleneck"}, found[0].consequences


def test_the_waiting_rank_is_a_consequence_not_a_second_straggler(tmp_path):
    """2 data-parallel ranks: rank 1 computes slowly, rank 0 waits for it in the all-reduce."""
    def spans(mesh, rank, step):
        fb = 0.010 * jitter(rank, step) * (4 if rank == 1 else 1)
        wait = 0.030 if rank == 0 else 0.0005
        return [("forward_backward", fb), ("grad_allreduce", wait)]

    write_timeline(tmp_path, {"trainer": 2}, 20, spans)
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank) for f in found] == [("straggler", 1)], format_findings(found)
    (f,) = found
    assert f.details["span"] == "forward_backward"
    assert any(c["where"] == "trainer/Trainer/r0" and "grad_allreduce" in c["message"] for c in f.consequences), f.consequences


def test_eight_ranks_one_slow(tmp_path):
    write_timeline(tmp_path, {"trainer": 8}, 12, trainer_spans(slow_rank=5, from_step=4, factor=3.0))
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.onset_step) for f in found] == [("straggler", 5, 4)], format_findings(found)


def test_single_rank_mesh_and_short_runs_say_what_was_not_judged(tmp_path):
    write_timeline(tmp_path, {"trainer": 1}, 2, trainer_spans(push_rank0=False))
    d = diagnose_run(tmp_path)
    assert d.findings == []
    text = " ".join(d.notes)
    assert "trainer" in text and "1 rank" in text and "2 steps" in text, d.notes
    out = _cli("doctor", str(tmp_path))
    assert out.returncode == 0 and "not judged" in out.stdout, out.stdout


# ---------------------------------------------------------------- a busy host: clean runs, real faults


def test_clean_runs_on_a_busy_host_have_no_finding(tmp_path):
    """2 data-parallel ranks on a host shared with other jobs (BusyDP: one rank favoured by the
    scheduler for 5-12 steps at a time, 0.4-0.7x its usual time, the other waiting for it in the
    all-reduce; ranks descheduled now and then). The 300-step run ends while rank 0 is favoured:
    rank 1 is then 2-4x rank 0 at every step and rank 0 waits for it, as in the README run that
    reported 'trainer r1 steps 292..299'. Rank 1 takes its usual time: no straggler."""
    for steps, quick in ((300, 9), (1000, 0)):
        run = tmp_path / str(steps)
        write_timeline(run, {"trainer": 2}, steps, BusyDP(steps, quick_at_end=quick).spans)
        d = diagnose_run(run)
        assert d.findings == [], format_findings(d.findings)
        out = _cli("doctor", str(run))
        assert out.returncode == 0 and "doctor: no findings" in out.stdout, out.stdout
    notes = diagnose_run(tmp_path / "300").notes
    assert any("trainer/Trainer/r1, the rank waited for, reaches 'grad_allreduce' no later than its peers usually do" in n for n in notes), notes


def test_a_continuous_fault_through_a_busy_spell_is_one_finding(tmp_path):
    """Rank 1 0.5 s slower from step 600 to the end; at steps 791-794 rank 0 is descheduled for
    0.3 s too, so rank 1 is only 1.6-1.9x its peer there. It was two findings (600..790 and
    795..999): once out of line, a rank stays so while it is out of line against its peers' usual
    time (hysteresis)."""
    dp = BusyDP(1000, slow_rank=1, slow_from=600, extra={(0, s): 0.3 for s in range(791, 795)})
    assert all(dp.fb[(1, s)] < 2 * dp.fb[(0, s)] for s in range(791, 795))
    write_timeline(tmp_path, {"trainer": 2}, 1000, dp.spans)
    found = diagnose(tmp_path)
    assert [(f.kind, f.rank, f.steps) for f in found] == [("straggler", 1, [600, 999])], format_findings(found)
    assert "since step 600:" in found[0].message and "400/400 steps" in found[0].message


def test_a_fault_from_step_0_is_dated_step_0_when_the_peer_starts_slowly(tmp_path):
    """GRPO --fault-slow-trainer-rank 1: rank 1 0.5 s slower from step 0; rank 0's first
    forward_backward takes 0.3 s longer (its warm-up), so at step 0 rank 1 is 1.6x its peer only.
    It was 'since step 1': a step just before the onset where the rank was at the fault's level and
    slower than its peer by the minimum excess belongs to it."""
    dp = BusyDP(60, slow_rank=1, extra={(0, 0): 0.3})
    assert dp.fb[(1, 0)] < 2 * dp.fb[(0, 0)]
    write_timeline(tmp_path, {"trainer": 2}, 60, dp.spans)
    (f,) = diagnose(tmp_path)
    assert (f.kind, f.rank, f.onset_step, f.steps) == ("straggler", 1, 0, [0, 59]), f.message
    assert "since step 0 (from the start)" in f.message


def test_slow_work_without_a_span_names_the_rank_the_others_wait_for(tmp_path):
    """From step 10 rank 1 spends 0.3 s outside any span before the all-reduce; rank 0 waits
    there. Only the wait is out of line; rank 1 reaches it 0.3 s late: it is named."""
    def arrival(rank, step):
        return 0.05 * jitter(rank, step) + (0.3 if rank == 1 and step >= 10 else 0.0)

    def spans(mesh, rank, step):
        wait = max(arrival(0, step), arrival(1, step)) - arrival(rank, step) + 0.002
        return [("forward_backward", 0.05 * jitter(rank, step)), (None, arrival(rank, step) - 0.05 * jitter(rank, step)),
                ("grad_allreduce", wait)]

    write_timeline(tmp_path, {"trainer": 2}, 40, spans)
    (f,) = diagnose(tmp_path)
    assert (f.kind, f.rank, f.onset_step, f.steps) == ("straggler", 1, 10, [10, 39]), f.message
    assert f.details["inferred_from_waits"] and f.details["arrival_ratio"] > 5, f.details
    assert "the slow work itself has no span" in f.message
    assert [(c["kind"], c["where"], c["span"]) for c in f.consequences] == [
        ("waits", "trainer/Trainer/r0", "grad_allreduce"), ("slowdown", "controller/r0", "controller_step")]


def test_a_run_in_its_start_up_has_no_stall_and_no_absent_rank(tmp_path):
    """The GRPO app's first minute: the controller is in its start-up span while the meshes start
    (vLLM loads); no step yet; trainer rank 0 has not opened its file. It was 'stall ...
    controller/r0 ... dead or stuck' and 'trainer/r0 wrote no timeline'."""
    write_startup(tmp_path, 12.0, {"generator_0": 1, "reference": 1, "trainer": 1}, {"generator_0": 1, "reference": 1,
                                                                                      "trainer": 2})
    d = diagnose_run(tmp_path)
    assert d.findings == [], format_findings(d.findings)
    assert any(n.startswith("stall: not judged yet") and "controller/r0 silent 12.0s, in an open span" in n
               for n in d.notes), d.notes


def test_a_run_still_being_written_has_no_stall_from_its_writers_lag(tmp_path):
    """Mid-run, every process's last records are not all on disk yet (a writer pass every 0.5 s,
    delayed on a busy host): three processes' data end 0.6-1.2 s before the newest records. It
    was three 'stall ... went silent ~1.2 s before the end of the data' findings."""
    write_timeline(tmp_path, {"generator_0": 1, "trainer": 2}, 200, lambda m, r, s: [("work", 0.02)], writing=True,
                   unwritten_s={("generator_0", 0): 1.2, ("trainer", 1): 0.8, ("controller", 0): 0.6})
    d = diagnose_run(tmp_path)
    assert d.findings == [], format_findings(d.findings)


def test_a_process_dead_in_a_run_still_being_written_is_a_stall(tmp_path):
    """The same run, a replica dead at step 6 of 300 (no process has closed its file yet): silent
    for ~8 s and 294 steps, it is a stall."""
    write_timeline(tmp_path, {"generator_0": 1, "generator_1": 1}, 300, lambda m, r, s: [("generate", 0.025)],
                   writing=True, dead={("generator_1", 0): 6}, actors={"generator_0": "Generator", "generator_1": "Generator"})
    found = diagnose(tmp_path)
    assert [(f.kind, f.mesh, f.steps) for f in found] == [("stall", "generator_1", [5])], format_findings(found)


# ---------------------------------------------------------------- one finding per root event


def test_nan_on_one_rank_is_one_finding_with_its_consequences(tmp_path):
    srcs = [source("trainer", r, "Trainer") for r in range(2)]

    def values(src, step):
        bad = step == 20 and src["rank"] == 0
        return {"trainer/loss": math.nan if bad else 0.5, "trainer/grad_norm": math.nan if bad else 1.0,
                "trainer/step_s": 0.1}

    write_metrics(tmp_path, 40, srcs, values)
    found = diagnose(tmp_path)
    assert len(found) == 1, format_findings(found)
    (f,) = found
    assert (f.kind, f.mesh, f.actor, f.rank, f.steps) == ("nonfinite", "trainer", "Trainer", 0, [20, 20])
    assert f.details["key"] == "trainer/loss" and "step 20" in f.message
    cons = [(c["where"], c["key"]) for c in f.consequences]
    assert ("trainer/Trainer/r0", "trainer/grad_norm") in cons and ("global", "trainer/loss") in cons, cons
    text = format_findings(found)
    assert text.index("trainer/loss") < text.index("then") < text.index("trainer/grad_norm"), text


def test_every_finding_has_a_full_identity(tmp_path):
    """A replica that died: its label in `missing` lacks the actor; the finding has it."""
    srcs = [source("generator_0", 0, "Generator"), source("generator_1", 0, "Generator")]

    def values(src, step):
        if src["mesh"] == "generator_1" and step >= 5:
            return {}
        return {"generator/policy_staleness_steps": float(step) if src["mesh"] == "generator_0" else 0.0}

    write_metrics(tmp_path, 15, srcs, values, missing=lambda s: ["generator_1/r0"] if s >= 5 else [])
    found = diagnose(tmp_path)
    kinds = sorted((f.kind, f.mesh) for f in found)
    assert kinds == [("missing_ranks", "generator_1"), ("staleness", "generator_0")], format_findings(found)
    for f in found:
        d = f.to_dict()
        assert d["mesh"] and d["actor"] == "Generator" and d["rank"] == 0 and d["replica"] in (0, 1), d
        assert d["where"].startswith(f"{d['mesh']}/Generator/r0")
    miss = next(f for f in found if f.kind == "missing_ranks")
    assert miss.replica == 1 and miss.onset_step == 5 and "replica 1" in format_findings([miss])


def test_dead_process_is_one_finding(tmp_path):
    """A replica's process dies at step 6: stall in the timeline, missing at every flush after."""
    def spans(mesh, rank, step):
        return [("generate", 0.02)]

    write_timeline(tmp_path, {"generator_0": 1, "generator_1": 1}, 30, spans, dead={("generator_1", 0): 6},
                   actors={"generator_0": "Generator", "generator_1": "Generator"})
    srcs = [source("generator_0", 0, "Generator"), source("generator_1", 0, "Generator")]
    write_metrics(tmp_path, 30, srcs, lambda src, s: {} if (src["mesh"] == "generator_1" and s >= 6) else {"x": 1.0},
                  missing=lambda s: ["generator_1/r0"] if s >= 6 else [])
    found = diagnose(tmp_path, stall_min_s=0.05)
    assert [(f.kind, f.mesh, f.rank) for f in found] == [("stall", "generator_1", 0)], format_findings(found)
    assert any(c["kind"] == "missing_ranks" for c in found[0].consequences), found[0].consequences


# ---------------------------------------------------------------- shares and the wait clause


def test_startup_does_not_dilute_shares_and_the_wait_clause_appears(tmp_path):
    """A 23 s start-up span on the controller; then 20 steps where the generator spends 70 % of
    its time loading weights and the controller 60 % of its step waiting for a batch."""
    def spans(mesh, rank, step):
        return [("generate", 0.03), ("weights_load", 0.07)]

    write_timeline(tmp_path, {"generator_0": 1}, 20, spans, startup_s=23.0, wait_s=lambda s: 0.06)
    found = diagnose(tmp_path)
    (f,) = [f for f in found if f.kind == "sync_bottleneck"]
    assert f.mesh == "generator_0" and 0.6 < f.details["share"] < 0.8
    assert "meanwhile the controller spent" in f.message and "'wait_for_batch'" in f.message, f.message
    assert f.details["controller_wait_share"] > 0.3


def test_json_output_has_identity_consequences_and_notes(tmp_path):
    write_timeline(tmp_path, {"trainer": 2}, 20, trainer_spans(slow_rank=1, from_step=5))
    out = _cli("doctor", str(tmp_path), "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    (f,) = doc["findings"]
    assert f["kind"] == "straggler" and f["where"] == "trainer/Trainer/r1" and f["onset_step"] == 5
    assert isinstance(doc["notes"], list)


# ---------------------------------------------------------------- runs written by the real writer


def test_doctor_on_written_runs(tmp_path):
    tl.close()
    clean = tmp_path / "clean"
    _fake_run(clean, 4, 6, nan_step=None)
    assert diagnose(clean) == []
    bad = tmp_path / "bad"
    _fake_run(bad, 4, 6, slow_rank=2, nan_step=3)
    found = diagnose(bad)
    assert sorted((f.kind, f.mesh, f.rank) for f in found) == [("nonfinite", "global", None), ("straggler", "trainer", 2)]
    out = _cli("doctor", str(bad), "--json")
    assert out.returncode == 1
    found = json.loads(out.stdout)["findings"]
    st = [f for f in found if f["kind"] == "straggler"][0]
    assert st["mesh"] == "trainer" and st["rank"] == 2 and st["steps"] == [0, 5]
    nan = [f for f in found if f["kind"] == "nonfinite"][0]
    assert nan["where"] == "global" and nan["details"]["key"] == "loss" and nan["steps"] == [3, 3]
    clean_cli = _cli("doctor", str(clean))
    assert clean_cli.returncode == 0 and "no findings" in clean_cli.stdout


def test_doctor_names_a_slow_weight_sync(tmp_path):
    """Slow on every rank: no straggler to find, but the sync phase eats the processes' time (one
    event: the rank it holds back most, the others listed under it)."""
    tl.close()
    quick, slow = tmp_path / "quick", tmp_path / "slow"
    _fake_run(quick, 3, 6, weight_sync_us=500)  # 0.5 ms of a ~3.5 ms step: fine
    assert diagnose(quick) == []
    _fake_run(slow, 3, 6, weight_sync_us=8_000)  # 8 ms of an 11 ms step
    (f,) = diagnose(slow)
    assert f.kind == "sync_bottleneck" and f.mesh == "trainer"
    assert sorted([f.rank] + [c["rank"] for c in f.consequences]) == [0, 1, 2]
    assert f.details["span"] == "weights_load" and f.details["calls"] == 6 and f.steps == [0, 5]
    assert 0.6 < f.details["share"] < 0.8 and "'weights_load' takes" in f.message
    # the threshold and the names are options (CLI too)
    assert diagnose(slow, sync_share=0.9) == []
    assert _cli("doctor", str(slow), "--sync-spans", "checkpoint").returncode == 0
    assert _cli("doctor", str(slow), "--set", "sync_share=0.9").returncode == 0
    out = _cli("doctor", str(slow), "--json")
    assert out.returncode == 1 and {f["kind"] for f in json.loads(out.stdout)["findings"]} == {"sync_bottleneck"}


def test_doctor_growing_staleness(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(12):
            f.write(json.dumps({"run_id": "x", "step": s, "mode": "global_reduce", "metrics": {"policy/staleness": s * 0.5}}) + "\n")
    (f,) = diagnose(tmp_path)
    assert f.kind == "staleness" and f.steps == [0, 11] and f.where == "global"


def test_doctor_slow_staleness_growth_over_the_whole_run(tmp_path):
    """Too slow for the rolling window (0.01 per step over 300 steps), visible over the run."""
    srcs = [source("generator_0", 0, "Generator"), source("generator_1", 0, "Generator")]
    write_metrics(tmp_path, 300, srcs, lambda src, s: {"generator/policy_staleness_steps": s * 0.01 if src["mesh"] == "generator_1" else 0.0})
    (f,) = diagnose(tmp_path)
    assert (f.kind, f.mesh, f.replica, f.steps) == ("staleness", "generator_1", 1, [0, 299]), format_findings([f])


def test_doctor_finds_a_silent_rank(tmp_path):
    tl.close()
    _fake_run(tmp_path, 3, 40, dead_rank=1)
    found = diagnose(tmp_path, stall_min_s=0.01)
    assert [(f.kind, f.mesh, f.rank) for f in found] == [("stall", "trainer", 1)]
    assert found[0].steps == [20]  # it had begun step 20


def test_bad_settings_are_one_line_errors(tmp_path):
    write_timeline(tmp_path, {"trainer": 2}, 3, trainer_spans())
    out = _cli("doctor", str(tmp_path), "--set", "straggler_ratoi=2")
    assert out.returncode == 2 and "unknown doctor setting 'straggler_ratoi'; valid: straggler_ratio" in out.stderr
    assert "Traceback" not in out.stderr
    out = _cli("doctor", str(tmp_path), "--rule", "trainer/loss >> 3")
    assert out.returncode == 2 and "bad alert rule" in out.stderr and "Traceback" not in out.stderr


def test_user_rules_in_the_doctor(tmp_path):
    write_metrics(tmp_path, 10, [source("trainer", 0, "Trainer")], lambda src, s: {"trainer/loss": 20.0 if 4 <= s <= 6 else 1.0})
    out = _cli("doctor", str(tmp_path), "--rule", "trainer/loss > 10", "--json")
    (f,) = json.loads(out.stdout)["findings"]
    assert (f["kind"], f["steps"], f["details"]["rule"]) == ("threshold", [4, 6], "trainer/loss > 10")


def test_docs_python_example(tmp_path, monkeypatch, capsys):
    """The doctor example of docs/timeline.md, on a run with a planted straggler."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "timeline.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "diagnose_run" in b]
    write_timeline(tmp_path / "runs" / "grpo-7", {"trainer": 2}, 30, trainer_spans(slow_rank=1, from_step=8))
    monkeypatch.chdir(tmp_path)
    exec(block, {})
    out = capsys.readouterr().out
    assert "straggler trainer/Trainer/r1 8 ['slowdown']" in out, out
    assert "role: trainer/Trainer/r0 alone does 'push_weights'" in out


def test_straggler_among_the_dp_ranks_of_one_pipeline_stage(tmp_path):
    """An SPMD job, 2 pipeline stages x 3 DP ranks: stage 1's step takes 3x stage 0's (its work,
    not a straggler); rank 5 (pp=1, dp_shard=2) takes 2x its stage's peers from step 10. The
    doctor compares each rank with the ranks of its own stage: only rank 5 is named."""

    def spans(mesh, rank, step):
        s = 0.01 * (3 if rank // 3 == 1 else 1)
        return [("train_step", s * (2 if rank == 5 and step >= 10 else 1))]

    write_timeline(tmp_path, {"trainer": 6}, steps=40, spans=spans,
                   coords=lambda mesh, rank: {"pp": rank // 3, "dp_shard": rank % 3})
    found = [f for f in diagnose(tmp_path) if f.kind == "straggler"]
    assert [(f.rank, f.onset_step) for f in found] == [(5, 10)], [f.message for f in found]
    assert "trainer[pp=1]" in found[0].message
