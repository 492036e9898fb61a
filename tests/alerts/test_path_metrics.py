"""The ``critical_path`` backend: each controller step's critical path as ``critical_path/*``
metrics in every backend. Its values are those ``forge-obs why`` answers for the step; each step
``M`` reaches the backends once: with a later step (JSONL, console when asked, W&B, TensorBoard),
or, for the last steps (their spans were written after the last flush), after the last step in
W&B, TensorBoard and JSONL (``late`` rows under the step they describe). The key set is bounded whatever the number of stages and meshes."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from forge_obs.alerts.path_metrics import CriticalPathBackend, CriticalPathOptions, PathKeys
from forge_obs.analysis.critical_path import why
from forge_obs.backends.late import LateBoard, LateValues
from tests.support.helpers import run_as_user

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40


def _line(step: int, stages: dict, dur: float, slack: "dict | None" = None) -> dict:
    return {"step": step, "duration_s": dur, "end_us": 0, "unfinished": False, "explained": 0.9,
            "unexplained_s": 0.1 * dur, "unexplained_where": None, "answer": f"step {step}", "cause": None,
            "stages": stages, "slack": slack or {}}


def test_the_key_set_is_bounded_and_adds_up_to_the_step():
    """200 distinct stages over 100 steps, 50 meshes: at most max_stage_keys stage keys and
    max_mesh_keys meshes; every step's stage keys and "other" add up to its duration."""
    keys = PathKeys(CriticalPathOptions(stages=3, max_stage_keys=5, max_mesh_keys=4, min_share=0.05))
    seen: set = set()
    for s in range(100):
        stages = {f"mesh{s % 50}/span{s}": 0.3, f"mesh{(s + 1) % 50}/span{s + 1}": 0.2, "trainer/fb": 0.1}
        vals = keys.values(_line(s, stages, 1.0, {f"mesh{s % 50}": [0.5, 0.1]}), lag=2)
        seen |= set(vals)
        parts = [v for k, v in vals.items() if k.startswith("critical_path/path_s/")]
        assert sum(parts) == pytest.approx(1.0)
        assert vals["critical_path/step"] == s and vals["critical_path/lag_steps"] == 2
    assert len([k for k in seen if k.startswith("critical_path/path_s/")]) == 5 + 1
    assert len([k for k in seen if k.startswith("critical_path/idle_s/")]) == 4
    assert len(seen) == 7 + 6 + 8


def test_config_mistakes_name_the_valid_keys():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stage'\]; valid: stages, min_share, max_stage_keys"):
        CriticalPathBackend({"stage": 3})
    with pytest.raises(ValueError, match="settle_s must be a number > 0"):
        CriticalPathBackend({"settle_s": 0})


def test_a_producer_that_never_hands_costs_the_consumer_its_wait_only():
    board = LateBoard()
    board.expect("r", "slow")
    board.expect("r", "quick")
    threading.Timer(0.05, lambda: board.hand("r", "quick", LateValues(rows=[(3, {"k": 1.0})]))).start()
    t0 = time.monotonic()
    got = board.take("r", "wandb", timeout_s=0.5)
    assert 0.45 <= time.monotonic() - t0 < 5 and [v.rows for v in got] == [[(3, {"k": 1.0})]]
    assert board.take("r", "wandb", timeout_s=0.0) == []  # each consumer takes each producer's values once
    assert [v.rows for v in board.take("r", "tensorboard", timeout_s=0.0)] == [[(3, {"k": 1.0})]]


@pytest.fixture(scope="module")
def dash_run(tmp_path_factory):
    """tests/user_scripts/path_dashboard.py: 40 steps of ~0.15 s (step 7: 0.45 s), every backend."""
    tmp = tmp_path_factory.mktemp("dash")
    res = run_as_user(ROOT / "tests" / "user_scripts" / "path_dashboard.py", tmp, str(tmp), str(STEPS),
                      env={"WANDB_SILENT": "true"})
    return tmp / "dash", res.stdout


def _jsonl_paths(run_dir: Path) -> dict:
    """critical_path/step -> (the step that carried it, its values) from metrics.jsonl."""
    out: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        m = r.get("metrics", {})
        if r.get("mode") == "global_reduce" and "critical_path/step" in m:
            assert m["critical_path/step"] not in out, r  # once
            out[int(m["critical_path/step"])] = (r["step"], m)
    return out


def test_every_step_reaches_the_backends_once_with_why_s_values(dash_run):
    pytest.importorskip("wandb")
    from tests.support.wandb_reader import find_run_files, read_run

    run_dir, _out = dash_run
    answers = {r["step"]: r for r in why(run_dir, slowest=STEPS)["steps"]}
    assert sorted(answers) == list(range(STEPS))
    carried = _jsonl_paths(run_dir)  # how many travel with a later step depends on the host's load
    for m, (step, vals) in carried.items():
        assert step > m and vals["critical_path/lag_steps"] >= 1
    (path,) = find_run_files(run_dir / "wandb")
    wb = read_run(path)
    rows = [h for h in wb.history if "critical_path/duration_s" in h]
    assert sorted(int(h["critical_path/step"]) for h in rows) == list(range(STEPS))  # every step, once
    last_train = max(h["trainer_step"] for h in wb.history if "trainer_step" in h)
    for h in rows:
        m = int(h["critical_path/step"])
        r = answers[m]
        assert h["critical_path/duration_s"] == pytest.approx(r["duration_s"], abs=1e-9)
        assert h["critical_path/explained_frac"] == pytest.approx(r["explained"], abs=1e-9)
        for name in ("train", "generate"):
            on = sum(a["path_s"] for a in r["stages"] if a["name"] == name)
            assert h[f"critical_path/path_s/controller/{name}"] == pytest.approx(on, abs=1e-9)
        if m in carried:
            assert h["trainer_step"] == carried[m][0]  # in the W&B row of the step that carried it
        else:
            assert h["_step"] > last_train and "trainer_step" not in h  # the last ones: after the last step
    assert {"name": "", "glob_name": "critical_path/*", "step_metric": "critical_path/step"} in wb.metric_defs
    (slow,) = [h for h in rows if h["critical_path/step"] == 7]
    assert slow["critical_path/path_s/controller/train"] >= 0.4  # the planted slow step (its train sleeps 0.4 s)


def test_metrics_jsonl_has_every_step_s_path_once(dash_run):
    """Every step's critical path is in metrics.jsonl exactly once: with a later step (a global
    row), or, for the last steps, in a ``late`` row under the step it describes, written at
    shutdown. The readers tell the late rows apart: none counts a step twice."""
    import subprocess
    import sys

    from forge_obs.analysis.doctor.replay import step_views
    from forge_obs.analysis.index import open_index
    from forge_obs.analysis.serve.state import RunState
    from forge_obs.analysis.store import read_metrics

    run_dir, _out = dash_run
    answers = {r["step"]: r for r in why(run_dir, slowest=STEPS)["steps"]}
    carried = {m: vals for m, (_s, vals) in _jsonl_paths(run_dir).items()}
    late: dict = {}
    for r in read_metrics(run_dir, mode="late"):
        vals = r["metrics"]
        if "critical_path/step" in vals:
            m = vals["critical_path/step"]
            assert r["step"] == m and m not in late and m not in carried, r  # under its step, once
            late[m] = vals
    assert late and sorted([*carried, *late]) == list(range(STEPS))
    for m, vals in {**carried, **late}.items():
        assert vals["critical_path/duration_s"] == pytest.approx(answers[m]["duration_s"], abs=1e-9)
        assert vals["critical_path/explained_frac"] == pytest.approx(answers[m]["explained"], abs=1e-9)
    # the readers: one global row per step; the late rows only where asked for
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))
    show = [subprocess.run([sys.executable, "-m", "forge_obs.cli", "show", str(run_dir), *mode], capture_output=True,
                           text=True, timeout=120, cwd=ROOT) for mode in ([], ["--mode", "late"])]
    assert [json.loads(x)["step"] for x in show[0].stdout.splitlines()] == list(range(STEPS)), show[0].stderr
    assert {json.loads(x)["step"] for x in show[1].stdout.splitlines()} >= set(late), show[1].stderr
    idx = open_index(run_dir)
    assert [s for s, _v, _w in idx.metric_series("loss")] == list(range(STEPS))
    assert sorted(s for s, _v, _w in idx.metric_series("critical_path/step")) == sorted(s for s, _ in
                                                                                         _jsonl_paths(run_dir).values())
    got = idx.connect().execute("SELECT count(*), count(DISTINCT step) FROM metrics WHERE mode = 'late' AND "
                                "key = 'critical_path/duration_s'").fetchone()
    assert got == (len(late), len(late))
    assert [v.step for v in step_views(iter(read_metrics(run_dir, None)), _Ids(), {"per_rank": 0})] == list(range(STEPS))
    st = RunState(run_dir)
    st.update()
    assert st.facts()["steps"] == STEPS and st.last_step == STEPS - 1
    assert "late" not in {r["mode"] for r in st.step_rows(min(late))}  # the drill-down: what its step logged


class _Ids:
    def learn(self, _src: dict) -> None:
        pass


def test_slow_steps_table_names_the_culprit_and_its_commands(dash_run):
    pytest.importorskip("wandb")
    from tests.support.wandb_reader import find_run_files, read_run, tables

    run_dir, _out = dash_run
    (row,) = [r for r in tables(read_run(find_run_files(run_dir / "wandb")[0]))["critical_path/slow_steps"]
              if r["step"] == 7]
    assert row["culprit"] == "controller/r0 train" and row["x_median"] >= 2.0, row
    assert row["answer"] == why(run_dir, steps=[7])["steps"][0]["answer"]
    assert row["why"].endswith(f"why {run_dir} --step 7") and row["trace"].endswith("--steps 7:7 --critical-path --open")


def test_tensorboard_writes_each_step_at_the_step_it_describes(dash_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _out = dash_run
    ea = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    got = {e.step: e.value for e in ea.Scalars("critical_path/duration_s")}
    answers = {r["step"]: r for r in why(run_dir, slowest=STEPS)["steps"]}
    assert sorted(got) == list(range(STEPS))
    assert all(got[m] == pytest.approx(answers[m]["duration_s"], rel=1e-6) for m in got)


def test_console_prints_them_when_asked_and_meta_counts_them(dash_run):
    run_dir, out = dash_run
    assert "critical_path/duration_s" in out  # include names it
    assert "critical_path/path_s" not in out  # not named: not printed
    meta = json.loads((run_dir / "meta.json").read_text())["backends"]["critical_path"]
    assert meta["steps_read"] == STEPS and meta["steps_logged"] + meta["steps_late"] == STEPS, meta
    assert meta["steps_left_out"] == 0 and meta["steps_lost"] == 0, meta


def test_one_step_s_values_per_logged_step_each_once(monkeypatch):
    """The backend thread records a step's values, and the next step's only once a logged step
    carried them (or a step cut more than 1 s after they were recorded did not: lost, counted):
    two values of one key never meet in one step, whatever the backlog."""
    import forge_obs.alerts.path_metrics as pm
    from forge_obs.backends.record import StepRecord
    from forge_obs.core.types import Metric

    pending: list = []  # what the next cut takes
    monkeypatch.setattr(pm, "record_metric", lambda k, v, r=None: pending.append((k, v)))
    be = CriticalPathBackend({})
    be.run_dir = Path("/r")
    for m in range(6):
        be._lines.append(_line(m, {"trainer/fb": 0.2}, 0.3))
    now = time.time()
    seen: dict = {}
    for n in range(10, 24):
        cut = {k: v for k, v in pending}  # a step's cut: the values recorded since the last one (LAST)
        pending.clear()
        if "critical_path/step" in cut:
            seen.setdefault(cut["critical_path/step"], []).append(n)
        lag = 0.0 if n != 14 else 5.0  # step 14's cut happened long after: step 13's values were lost
        rec = StepRecord(step=n, run_id="r", wall_time=now + lag, global_metrics=[Metric(k, v) for k, v in cut.items()])
        be.log_step(rec)
        if n == 13:
            pending.clear()  # lost on the way (e.g. recorded after a cut that never came)
    assert sorted(seen) == [0, 1, 2, 4, 5] and all(len(v) == 1 for v in seen.values()), seen
    assert be.counts["steps_logged"] == 5 and be.counts["steps_lost"] == 1, be.counts


def test_the_reader_writes_this_session_s_steps_once_in_order(tmp_path):
    """The child's loop (here in-process, stopped: its final pass): every step once, in order, as
    why answers them; a resumed run's earlier session (steps that began before ``since``) is not
    written again."""
    from forge_obs.alerts.path_worker import follow
    from tests.support.path_runs import START, grpo_run

    run_dir = grpo_run(tmp_path / "r", 8, slow_rank=(1, 0.9), slow_from=4)
    stop = threading.Event()
    stop.set()
    lines: list = []
    assert follow(run_dir, lines.append, stop=stop, final_wait_s=0.0) == 8
    assert [ln["step"] for ln in lines] == list(range(8))
    res = {r["step"]: r for r in why(run_dir, slowest=8)["steps"]}
    assert all(ln["answer"] == res[ln["step"]]["answer"] for ln in lines)
    assert lines[5]["stages"]["trainer/forward_backward"] == pytest.approx(0.9)
    later: list = []
    since = res[4]["start_us"] / 1e6 - 0.01  # the session began just before step 4
    assert since > START and follow(run_dir, later.append, stop=stop, final_wait_s=0.0, since=since) == 8 - 4
    assert [ln["step"] for ln in later] == [4, 5, 6, 7]


def test_without_the_index_the_reader_walks_the_files(tmp_path, monkeypatch):
    """No DuckDB / pyarrow (``available()`` false): the same lines, from a direct walk of the files;
    nothing is written into the run directory."""
    import forge_obs.analysis.index as index_pkg
    from forge_obs.alerts.path_worker import results, step_line
    from tests.support.path_runs import grpo_run

    run_dir = grpo_run(tmp_path / "r", 8, slow_replica=(1, 0.8), slow_from=4)
    indexed = [step_line(r) for r in results(run_dir, None, update=True)]
    shutil.rmtree(run_dir / "index")
    monkeypatch.setattr(index_pkg, "available", lambda: False)
    direct = [step_line(r) for r in results(run_dir, 2, update=True)]
    assert not (run_dir / "index").exists()
    assert [ln["step"] for ln in direct] == list(range(3, 8)) and direct == indexed[3:]
