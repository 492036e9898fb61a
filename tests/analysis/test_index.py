"""The run's index (forge_obs.analysis.index): built incrementally from the append-only files, it
answers exactly what a direct read of the files answers (a property test on generated runs with
torn lines, resumed attempts, clock offsets between hosts, open spans and SPMD coordinates), and
holds its guarantees: a torn last line waits, a file that shrank or was replaced is indexed
again, a read-only run directory is answered without writing, concurrent readers never see a
deleted segment, a live run's new step is queryable at once."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
import sys
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from hypothesis import HealthCheck, given, settings, strategies as hs  # noqa: E402

from forge_obs.analysis import reader  # noqa: E402
from forge_obs.analysis.critical_path import analyse, why  # noqa: E402
from forge_obs.analysis.index import open_index, store  # noqa: E402
from tests.support.path_runs import grpo_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def direct_spans(run_dir: Path) -> list:
    """Every span as the reader yields it, as the ``spans`` view's columns (the direct read)."""
    run = reader.scan(run_dir)
    out, opens = [], []
    for it in reader.walk(run):
        if it[0] is reader.SPAN:
            _k, st, lane, name, step, ts, dur, ex, _cpu = it
            out.append((st.attempt, st.host, st.pid, st.mesh, st.rank, st.lanes.get(lane, str(lane)), name, step, ts,
                        ts + dur, True, (ex or {}).get("e"), _flow(ex)))
        elif it[0] is reader.OPEN:
            opens.append(it)
    end = reader.run_end(run) or 0
    for _k, st, lane, name, step, ts, ex in opens:
        out.append((st.attempt, st.host, st.pid, st.mesh, st.rank, st.lanes.get(lane, str(lane)), name, step, ts,
                    end, False, None, _flow(ex)))
    return sorted(out, key=repr)


def _flow(ex):
    if not ex or "f" not in ex:
        return None
    return ex["f"] if isinstance(ex["f"], str) else json.dumps(ex["f"])


def indexed_spans(run_dir: Path) -> list:
    con = open_index(run_dir).connect()
    rows = con.execute("SELECT attempt, host, pid, mesh, rank, task, name, step, start_us, end_us, finished, error, "
                       "flow FROM spans").fetchall()
    return sorted(rows, key=repr)


def assert_same_answers(run_dir: Path) -> None:
    """The index's spans, every step's critical-path answer and the doctor's evidence and
    findings equal the direct read's."""
    assert indexed_spans(run_dir) == direct_spans(run_dir)
    a = why(run_dir, slowest=10**6)
    b = why(run_dir, slowest=10**6, index=False)
    assert a == b
    assert analyse(run_dir) == analyse(run_dir, index=False)
    assert_same_doctor(run_dir)


def doctor_tables(t) -> dict:
    """The doctor's per-step tables (:mod:`forge_obs.analysis.doctor.tables`) as plain data, in
    the order a pass over the records builds them (dict orders included: findings follow them)."""
    marks = t.marks.all() if hasattr(t.marks, "all") else dict(t.marks)
    return {
        "streams": [(k, st.attempt, st.first_ts, st.last_ts, st.clean, st.records, st.dropped, st.actor, st.header,
                     dict(st.lanes)) for k, st in t.run.streams.items()],
        "per_step": [(g, [(s, list(r.items())) for s, r in steps.items()]) for g, steps in t.per_step.items()],
        "step_wall": dict(t.step_wall), "longest": dict(t.longest), "last_step": dict(t.last_step),
        "opens": [(o[0], o[1].key, *o[2:6]) for o in t.opens], "window": dict(t.window),
        "budget": list(t.budget.items()), "budget_steps": list(t.budget_steps.items()),
        "ctl_wait": list(t.ctl_wait.items()), "stream_of": {k: v.key for k, v in t.stream_of.items()},
        "unstepped": dict(t.unstepped), "end_by_attempt": dict(t.end_by_attempt), "marks": sorted(marks.items(), key=repr)}


def assert_same_doctor(run_dir: Path, **settings) -> None:
    """``forge-obs doctor`` reads the index (its per-step evidence, the stored critical paths,
    the metric rows) and answers as it does reading the files (the run walked for its paths)."""
    from unittest import mock

    from forge_obs.analysis.doctor import DoctorConfig, diagnose_run, tables

    cfg = DoctorConfig.from_dict(settings)
    if (Path(run_dir) / "events").is_dir():
        assert doctor_tables(tables.scan(run_dir, cfg)) == doctor_tables(tables.scan(run_dir, cfg, index=False))
    got = diagnose_run(run_dir, **settings).to_dict()
    with mock.patch("forge_obs.analysis.index.available", return_value=False):
        want = diagnose_run(run_dir, **settings).to_dict()
    assert got == want


def _resume(run_dir: Path, src: Path, shift_us: int) -> None:
    """Copy the run in ``src`` into ``run_dir`` as a later attempt: new sessions and pids, a later
    controller start, times shifted by ``shift_us``."""
    for p in sorted((src / "events").glob("*.jsonl")):
        lines = p.read_text().splitlines(keepends=True)
        h = json.loads(lines[0])
        h.update(start=h["start"] + 3600, session=h["session"] + "-b", pid=h["pid"] + 100, t0=h["t0"] + shift_us)
        name = f"{h['host']}_{h['pid']}_{h['mesh']}_{h['rank']}.jsonl"
        (run_dir / "events" / name).write_text(json.dumps(h) + "\n" + "".join(lines[1:]))


def _clock(run_dir: Path, host: str, sample_us: int) -> None:
    """Give ``host``'s files a clock sample: that host's clock runs ``sample_us`` ahead."""
    for p in (run_dir / "events").glob(f"{host}_*.jsonl"):
        lines = p.read_text().splitlines(keepends=True)
        h = json.loads(lines[0])
        h["clk"] = [h["t0"] + sample_us + 5, h["t0"] + 5]
        p.write_text(json.dumps(h) + "\n" + "".join(lines[1:]))


def _spmd(run_dir: Path) -> None:
    for p in (run_dir / "events").glob("*trainer*.jsonl"):
        lines = p.read_text().splitlines(keepends=True)
        h = json.loads(lines[0])
        h["coords"] = {"pp": 0, "dp_shard": h["rank"]}
        p.write_text(json.dumps(h) + "\n" + "".join(lines[1:]))


def _grow(run_dir: Path, full: dict, rng: random.Random, rounds: int, live: bool = False) -> None:
    """Write each file's bytes in ``rounds`` parts (cut anywhere: a line may be torn), updating
    the index after each part (``live``: as the live indexer does, its window kept between updates)."""
    from forge_obs.analysis.index.updater import update_index
    from forge_obs.analysis.index.window import Window

    window = Window()
    cuts = {p: sorted(rng.randrange(len(b) + 1) for _ in range(rounds - 1)) + [len(b)] for p, b in full.items()}
    for r in range(rounds):
        for p, b in full.items():
            p.write_bytes(b[:cuts[p][r]])
        if live:
            update_index(run_dir, store.index_dir(run_dir), window=window)
        else:
            open_index(run_dir)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=hs.integers(3, 14), fault=hs.sampled_from(["", "slow_replica", "slow_rank", "hang", "carried", "starved"]),
       resumed=hs.booleans(), skew=hs.sampled_from([0.0, 0.03, -0.03]), clock=hs.booleans(), spmd=hs.booleans(),
       rounds=hs.integers(1, 4), seed=hs.integers(0, 10**6), how=hs.sampled_from(["", "parallel", "live"]))
def test_index_answers_as_a_direct_read(tmp_path_factory, steps, fault, resumed, skew, clock, spmd, rounds, seed, how):
    base = tmp_path_factory.mktemp("gen")
    kw = {"slow_replica": {"slow_replica": (1, 0.5)}, "slow_rank": {"slow_rank": (1, 0.6)},
          "hang": {"hang": (steps - 1,)}, "carried": {"carried_sync_s": 0.3}, "starved": {"starved": (0.4,)}}.get(fault, {})
    src = grpo_run(base / "src", steps, slow_from=steps // 2, trainer_host="node1" if skew else "node0",
                   trainer_skew_s=skew, **kw)
    if clock and skew:
        _clock(src, "node1", int(skew * 1e6))
    if spmd:
        _spmd(src)
    if resumed:
        again = grpo_run(base / "again", 3, slow_rank=(0, 0.4))
        _resume(src, again, 7_200 * 10**6)
    full = {p: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    run_dir = base / "run"
    (run_dir / "events").mkdir(parents=True)
    from forge_obs.analysis.index import build

    was, build.PARALLEL_BYTES = build.PARALLEL_BYTES, 0 if how == "parallel" else build.PARALLEL_BYTES  # 2 processes
    try:
        _grow(run_dir, {run_dir / "events" / p.name: b for p, b in full.items()}, random.Random(seed), rounds,
              live=how == "live")
        assert_same_answers(run_dir)
        assert indexed_spans(run_dir) == sorted(indexed_rebuilt(run_dir), key=repr)
    finally:
        build.PARALLEL_BYTES = was


def indexed_rebuilt(run_dir: Path) -> list:
    con = open_index(run_dir, rebuild=True).connect()
    return con.execute("SELECT attempt, host, pid, mesh, rank, task, name, step, start_us, end_us, finished, error, "
                       "flow FROM spans").fetchall()


def test_a_torn_last_line_waits(tmp_path):
    grpo_run(tmp_path, 6)
    p = sorted((tmp_path / "events").glob("*controller*.jsonl"))[0]
    data = p.read_bytes()
    line = b'[999999999, 10, 0, 1, 99]\n'
    p.write_bytes(data + line[:9])  # the writer died mid-line (or has not finished it yet)
    con = open_index(tmp_path).connect()
    assert con.execute("SELECT count(*) FROM spans WHERE step = 99").fetchone()[0] == 0
    p.write_bytes(data + line)
    con = open_index(tmp_path).connect()
    assert con.execute("SELECT count(*) FROM spans WHERE step = 99").fetchone()[0] == 1
    assert_same_answers(tmp_path)


@pytest.mark.parametrize("how", ["shrank", "replaced"])
def test_a_file_that_shrank_or_was_replaced_is_indexed_again(tmp_path, how):
    grpo_run(tmp_path, 8, slow_rank=(1, 0.5), slow_from=4)
    open_index(tmp_path)
    p = sorted((tmp_path / "events").glob("*trainer_1.jsonl"))[0]
    lines = p.read_bytes().splitlines(keepends=True)
    if how == "shrank":
        p.write_bytes(b"".join(lines[: len(lines) // 2]))
    else:
        tmp = p.with_suffix(".new")
        tmp.write_bytes(b"".join(lines[: len(lines) // 2]) + b"".join(lines[len(lines) // 2:]).replace(b"\n", b"\n", 1))
        os.replace(tmp, p)  # another file (another inode) in its place
    assert_same_answers(tmp_path)


def test_metrics_are_indexed_incrementally_and_show_prints_them(tmp_path):
    rows = [{"run_id": "r", "step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"loss": 1.0 / (s + 1)}}
            for s in range(5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + json.dumps(rows[3])[:10])
    con = open_index(tmp_path).connect()
    assert con.execute("SELECT max(step) FROM metrics").fetchone()[0] == 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    idx = open_index(tmp_path)
    assert [s for s, _v, _w in idx.metric_series("loss")] == [0, 1, 2, 3, 4]
    p = subprocess.run([sys.executable, "-m", "forge_obs.cli", "show", str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert p.returncode == 0 and [json.loads(x) for x in p.stdout.splitlines()] == rows


def test_metric_series_downsamples_keeping_spikes(tmp_path):
    rows = [{"step": s, "mode": "global_reduce", "wall_time": float(s), "metrics": {"x": 100.0 if s == 777 else 1.0}}
            for s in range(5000)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pts = open_index(tmp_path).metric_series("x", max_points=300)
    assert len(pts) <= 300 and (777, 100.0, 777.0) in pts and pts[0][0] == 0


def test_a_read_only_run_directory_is_answered_without_writing(tmp_path, monkeypatch):
    grpo_run(tmp_path, 6, slow_rank=(1, 0.5), slow_from=3)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    monkeypatch.setattr(store, "writable", lambda run_dir: False)
    idx = open_index(tmp_path)
    assert idx.summary()["private"] and not idx.dir.is_relative_to(tmp_path)
    assert idx.connect().execute("SELECT count(*) FROM critical_path WHERE step = 4").fetchone()[0] > 0
    assert why(tmp_path, steps=[4]) == why(tmp_path, steps=[4], index=False)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written into the run directory


def test_a_reader_keeps_the_segments_it_reads(tmp_path):
    """A connection holds read.lock: an update that merges segments leaves the old ones on disk
    until no reader holds them, then deletes them."""
    run = tmp_path / "r"
    (run / "events").mkdir(parents=True)
    full = {}
    src = grpo_run(tmp_path / "src", 20)
    for p in (src / "events").glob("*.jsonl"):
        full[run / "events" / p.name] = p.read_bytes()
    con = None
    for part in range(10, 21):  # 11 updates: the small segments get merged
        for p, b in full.items():
            p.write_bytes(b[: len(b) * part // 20])
        idx = open_index(run)
        if con is None:
            con = idx.connect()
            held = {s["file"] for segs in idx.manifest.tables.values() for s in segs}
    man = store.Manifest.load(store.index_dir(run))
    assert man.garbage and set(man.garbage) & held  # merged away, kept for the reader
    assert all((store.index_dir(run) / f).exists() for f in held)
    assert con.execute("SELECT count(*) FROM spans").fetchone()[0] > 0
    del con
    with open(next(iter(full)), "ab") as f:
        f.write(b'["D", 0]\n')  # something new: the next update runs, and collects the garbage
    open_index(run)
    assert not store.Manifest.load(store.index_dir(run)).garbage
    assert not any((store.index_dir(run) / f).exists() for f in held - {s["file"] for segs in man.tables.values() for s in segs})
    assert_same_answers(run)


def test_concurrent_commands_never_fail(tmp_path):
    """Two sql commands and an indexing command at once, while the files grow."""
    src = grpo_run(tmp_path / "src", 200)
    run = tmp_path / "r"
    (run / "events").mkdir(parents=True)
    full = {run / "events" / p.name: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    procs = []
    for part in range(1, 6):
        for p, b in full.items():
            p.write_bytes(b[: len(b) * part // 5])
        procs += [subprocess.Popen([sys.executable, "-m", "forge_obs.cli", *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
                  for args in (("sql", str(run), "SELECT count(*) FROM critical_path"),
                               ("sql", str(run), "SELECT count(*) FROM spans"), ("index", str(run)))]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert "Traceback" not in err
    assert_same_answers(run)


def test_index_command(tmp_path, capsys):
    from forge_obs.cli import main

    grpo_run(tmp_path, 5)
    assert main(["index", str(tmp_path)]) == 0
    assert "5 steps with their critical path" in capsys.readouterr().out
    assert main(["index", str(tmp_path), "--rebuild"]) == 0
    assert main(["index", str(tmp_path / "nope")]) == 2
    shutil.rmtree(tmp_path / "index")
    assert main(["sql", str(tmp_path), "SELECT count(*) FROM slack WHERE step = 2"]) == 0  # builds it again
    assert (tmp_path / "index" / "manifest.json").exists()


def test_live_indexer_keeps_the_index_up_to_date(tmp_path):
    """The ``index`` backend's child process indexes a run while it is written: a step flushed
    to the files becomes a finished step of the index without any command being run; at finish
    the index holds every step, and its answers are the direct read's."""
    from forge_obs.analysis.index.live import IndexBackend
    from forge_obs.backends.base import get_logger_backend_class
    from forge_obs.backends.record import RunContext

    assert get_logger_backend_class("index") is IndexBackend
    with pytest.raises(ValueError, match="valid: interval_s"):
        IndexBackend({"intervall_s": 1})
    src = grpo_run(tmp_path / "src", 40)
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    full = {run / "events" / p.name: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    for p, b in full.items():
        p.write_bytes(b[: len(b) // 2])
    be = IndexBackend({"interval_s": 0.2})
    be.init(run=RunContext(run_id="run", run_dir=run))
    try:
        d = store.index_dir(run)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            man = store.Manifest.load(d)
            if man is not None and sum(s["rows"] for s in man.tables.get("steps", [])) > 0:
                break
            time.sleep(0.05)
        assert man is not None and man.tables.get("steps"), "the live indexer indexed nothing"
        for p, b in full.items():
            p.write_bytes(b)
    finally:
        be.finish()
    man = store.Manifest.load(store.index_dir(run))
    assert man.state["files"] and all(f["offset"] == len(full[run / rel]) for rel, f in man.state["files"].items())
    assert open_index(run, update=False).connect().execute("SELECT count(*) FROM _steps").fetchone()[0] == 40
    assert_same_answers(run)


@pytest.mark.parametrize("fault", [{"carried_sync_s": 0.3}, {"slow_rank": (1, 0.6), "trainer_host": "node1",
                                                              "trainer_skew_s": 0.03}, {"hang": (59,)}])
def test_batches_and_workers_answer_as_one_graph(tmp_path, monkeypatch, fault):
    """Steps computed in many small batches, in 2 worker processes, answer as the one graph
    of the direct read: each batch's graph reaches back far enough (a step's carried-over work,
    another host's clock, a hang that runs to the end of the data). The files are read in 2
    processes too (each its part of the files), as one process reads them."""
    from forge_obs.analysis.index import build, paths

    monkeypatch.setattr(paths, "BATCH_SPANS", 150)
    monkeypatch.setattr(paths, "WORKER_SPANS", 400)
    monkeypatch.setattr(build, "PARALLEL_BYTES", 0)
    grpo_run(tmp_path, 60, slow_from=20, **fault)
    assert_same_answers(tmp_path)


def _doctor_run(tmp_path: Path, case: str) -> dict:
    """Runs of tests/analysis/test_doctor.py's kinds: a straggler with a role, waits without a
    root, a dead process among metrics, a hang, start-up and state-moving spans, pipeline stages,
    a run still being written; the doctor settings they are judged with."""
    from tests.analysis.test_doctor import jitter, trainer_spans
    from tests.support.doctor_runs import source, write_metrics, write_startup, write_timeline

    if case == "straggler":
        write_timeline(tmp_path, {"trainer": 3}, 30, trainer_spans(slow_rank=2, from_step=8))
    elif case == "waits":
        def spans(mesh, rank, step):
            arrive = [0.05 * jitter(r, step) + (0.3 if r == 1 and step >= 10 else 0.0) for r in range(2)]
            return [("forward_backward", 0.05 * jitter(rank, step)), (None, arrive[rank] - 0.05 * jitter(rank, step)),
                    ("grad_allreduce", max(arrive) - arrive[rank] + 0.002)]
        write_timeline(tmp_path, {"trainer": 2}, 40, spans)
    elif case == "dead":
        write_timeline(tmp_path, {"generator_0": 1, "generator_1": 1}, 30, lambda m, r, s: [("generate", 0.02)],
                       dead={("generator_1", 0): 6}, actors={"generator_0": "Generator", "generator_1": "Generator"})
        srcs = [source("generator_0", 0, "Generator"), source("generator_1", 0, "Generator")]
        write_metrics(tmp_path, 30, srcs, lambda src, s: {} if (src["mesh"] == "generator_1" and s >= 6) else {"x": 1.0},
                      missing=lambda s: ["generator_1/r0"] if s >= 6 else [])
        return {"stall_min_s": 0.05}
    elif case == "hang":
        write_timeline(tmp_path, {"trainer": 2}, 20, lambda m, r, s: [("train", 0.01), ("sync_weights", 0.02)],
                       open_at={("trainer", 1): (12, "train")})
    elif case == "shares":
        write_timeline(tmp_path, {"generator_0": 1}, 20, lambda m, r, s: [("generate", 0.03), ("weights_load", 0.07)],
                       startup_s=23.0, wait_s=lambda s: 0.06)
    elif case == "stages":
        write_timeline(tmp_path, {"trainer": 6}, 40, lambda m, r, s: [("train_step", 0.01 * (3 if r // 3 else 1)
                                                                       * (2 if r == 5 and s >= 10 else 1))],
                       coords=lambda mesh, rank: {"pp": rank // 3, "dp_shard": rank % 3})
    elif case == "writing":
        write_timeline(tmp_path, {"generator_0": 1, "generator_1": 1}, 300, lambda m, r, s: [("generate", 0.025)],
                       writing=True, dead={("generator_1", 0): 6})
    elif case == "startup":
        write_startup(tmp_path, 12.0, {"generator_0": 1, "trainer": 1}, {"generator_0": 1, "trainer": 2})
    return {}


@pytest.mark.parametrize("case", ["straggler", "waits", "dead", "hang", "shares", "stages", "writing", "startup"])
def test_the_doctor_answers_from_the_index_as_from_the_files(tmp_path, case):
    settings = _doctor_run(tmp_path, case)
    assert_same_doctor(tmp_path, **settings)


def test_a_live_alert_cites_the_stored_critical_path_without_indexing(tmp_path):
    """An alert about time cites the slowest step since its onset from the index as the live
    indexer left it (``update=False``: nothing is indexed on the alerts thread): the answer the
    walk of the files gives; a step not indexed yet is not cited; a run without an index is walked."""
    from forge_obs.alerts.backend import AlertsBackend
    from forge_obs.analysis.critical_path import explain
    from forge_obs.analysis.doctor.rule_base import Event

    src = grpo_run(tmp_path / "src", 60, slow_replica=(1, 0.8), slow_from=30)
    be = AlertsBackend({})
    be.run_dir = src
    ev = Event("slowdown", "firing", "slowdown:x", 45, 31, 44, "generate grew", {"mesh": "generator_1"})
    walked = be._path_of(ev)  # no index yet: the files are walked
    assert not (src / "index").exists() and walked["step"] in range(31, 45)
    want = explain(src, 31, 44)
    assert walked == {"step": want["step"], "answer": want["answer"],
                      "cause": {k: want["cause"][k] for k in ("mesh", "actor", "rank", "name", "path_s", "share")}}
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    full = {run / "events" / p.name: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    for p, b in full.items():
        p.write_bytes(b[: len(b) // 3])  # about 20 steps indexed
    open_index(run)
    for p, b in full.items():
        p.write_bytes(b)
    be.run_dir = run
    gen = store.Manifest.load(store.index_dir(run)).gen
    assert be._path_of(ev) is None  # steps 31..44 are in the files, not in the index yet: not cited
    assert store.Manifest.load(store.index_dir(run)).gen == gen  # and nothing was indexed for it
    open_index(run)  # the live indexer's next update
    assert be._path_of(ev) == walked


def test_the_doctor_asked_again_reads_its_last_answer_until_the_run_changes(tmp_path):
    """``forge-obs doctor`` keeps its diagnosis beside the index: asked again about a run that did
    not change (same index generation, settings and meta.json) it prints the same answer without
    computing it; a new record, other settings or another meta.json compute it again."""
    from tests.analysis.test_doctor import trainer_spans
    from tests.support.doctor_runs import write_timeline

    write_timeline(tmp_path, {"trainer": 3}, 30, trainer_spans(slow_rank=2, from_step=8))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))

    def doctor(*args):
        p = subprocess.run([sys.executable, "-m", "forge_obs.cli", "doctor", str(tmp_path), *args], capture_output=True,
                           text=True, env=env, timeout=300)
        assert p.returncode == 1, p.stderr
        return p.stdout

    first = doctor("--json")
    stored = tmp_path / "index" / "doctor.json"
    assert json.loads(first)["findings"][0]["rank"] == 2 and stored.exists()
    stored.write_text(stored.read_text().replace('"rank": 2', '"rank": 7', 1))  # marked: a cache hit prints it
    assert json.loads(doctor("--json"))["findings"][0]["rank"] == 7
    assert json.loads(doctor("--json", "--set", "straggler_ratio=2.5"))["findings"][0]["rank"] == 2  # other settings
    stored.write_text(stored.read_text().replace('"rank": 2', '"rank": 7', 1))
    (tmp_path / "meta.json").write_text("{}")
    assert json.loads(doctor("--json"))["findings"][0]["rank"] == 2  # another meta.json
    stored.write_text(stored.read_text().replace('"rank": 2', '"rank": 7', 1))
    with open(sorted((tmp_path / "events").glob("*trainer_0.jsonl"))[0], "a") as f:
        f.write('["D", 0]\n')
    assert json.loads(doctor("--json"))["findings"][0]["rank"] == 2  # the run changed
    assert doctor() == doctor()


@pytest.mark.parametrize("fault", [{"slow_replica": (1, 0.5)}, {"carried_sync_s": 0.3, "trainer_host": "node1",
                                                                 "trainer_skew_s": 0.03}, {"hang": (49,)}])
def test_the_live_indexer_computes_steps_from_its_window_as_the_index_does(tmp_path, monkeypatch, fault):
    """The live indexer keeps the last steps' rows between updates and computes the steps an
    update may change from them (a step computed again is marked in the segment it was in; small
    segments merge with the marks applied; the window keeps its last steps): after 40 updates that
    each bring a few torn lines, the answers are the direct read's, and nearly every update was
    computed from the window."""
    from forge_obs.analysis.index import paths, updater, window as win_mod
    from forge_obs.analysis.index.window import Window

    monkeypatch.setattr(win_mod, "KEEP_STEPS", 6)
    monkeypatch.setattr(updater, "MERGE_AT", 3)
    used = {True: 0, False: 0}
    real = paths.compute_live

    def counted(*a):
        ok = real(*a)
        used[ok] += 1
        return ok

    monkeypatch.setattr(updater, "compute_live", counted)
    run = follow_live(grpo_run(tmp_path / "src", 50, slow_from=20, **fault), tmp_path / "run", Window())
    assert used[True] >= 30, used
    assert_same_answers(run)


def follow_live(src: Path, run: Path, window, updates: int = 40) -> Path:
    """``src``'s timeline written again into ``run`` in ``updates`` torn parts, the live indexer's
    update (keeping ``window``) after each: ``run``."""
    from forge_obs.analysis.index import updater

    (run / "events").mkdir(parents=True)
    full = {run / "events" / p.name: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    for part in range(1, updates + 1):
        for p, b in full.items():
            p.write_bytes(b[: len(b) * part // updates])
        updater.update_index(run, store.index_dir(run), window=window)
    return run


@pytest.mark.parametrize("fault", [{}, {"carried_sync_s": 0.3, "trainer_host": "node1", "trainer_skew_s": 0.03}])
def test_the_live_indexer_reads_no_index_from_a_run_that_starts(tmp_path, monkeypatch, fault):
    """A run the live indexer follows from its start (its files' headers, then every step a few
    torn lines at a time): after the first update (an empty index), every step is computed from
    the window, the first one included (no update reads the index back), and the answers are
    the direct read's."""
    from forge_obs.analysis.index import paths, updater
    from forge_obs.analysis.index.window import Window

    reads = []
    real = paths.compute_steps
    monkeypatch.setattr(updater, "compute_steps", lambda *a: reads.append(1) or real(*a))
    src = grpo_run(tmp_path / "src", 12, slow_from=6, **fault)
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    full = {run / "events" / p.name: p.read_bytes() for p in (src / "events").glob("*.jsonl")}
    head = {p: b.index(b"\n") + 1 for p, b in full.items()}
    for p, b in full.items():
        p.write_bytes(b[: head[p]])
    window = Window()
    updater.update_index(run, store.index_dir(run), window=window)
    assert reads == [1] and window.ready and window.whole()
    for part in range(1, 25):
        for p, b in full.items():
            p.write_bytes(b[: max(head[p], len(b) * part // 24)])
        updater.update_index(run, store.index_dir(run), window=window)
    assert reads == [1], f"{len(reads) - 1} updates read the index back"
    assert not window.whole()
    assert_same_answers(run)


def test_a_merge_reads_the_segments_this_process_wrote_from_memory_unless_replaced(tmp_path, monkeypatch):
    """A small segment this process wrote is merged from the copy it kept; a segment whose file
    is not that one any more (another process rebuilt the index: same name, other rows) is read
    from its file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from forge_obs.analysis.index.schema import arrow_schema

    schema = arrow_schema("lanes")

    def table(label: str) -> "pa.Table":
        return pa.Table.from_pydict({"sid": [1], "lane": [2], "label": [label]}, schema=schema)

    store.write_arrow(tmp_path, "lanes-1-0.parquet", table("kept"))
    store.write_arrow(tmp_path, "lanes-1-1.parquet", table("mine"))
    tmp = tmp_path / "other.parquet"
    pq.write_table(table("theirs"), tmp)
    os.replace(tmp, tmp_path / "lanes-1-1.parquet")
    monkeypatch.setattr(pq, "ParquetFile", lambda *a, **k: pytest.fail("read a kept segment from its file"))
    assert store.read_segment(tmp_path, "lanes-1-0.parquet", schema)["label"].to_pylist() == ["kept"]
    monkeypatch.undo()
    assert store.read_segment(tmp_path, "lanes-1-1.parquet", schema)["label"].to_pylist() == ["theirs"]


OPEN_ALL_RUN = '''
import os, sys, time
from forge_obs import timeline
from forge_obs.timeline import record_span, set_step

timeline.configure(sys.argv[1], ranks="all", open_after_s=0.0)
with record_span("train"):                      # open for the whole run: the process ends inside it
    timeline.flush()                            # its "begun" record first (as the writer's pass does)
    for step in range(int(sys.argv[2])):
        set_step(step)
        with record_span("controller_step"):
            with record_span("generate"):
                time.sleep(0.001)
            with record_span("train_step"):
                time.sleep(0.002)
    timeline.flush()
    os._exit(0)
'''


def test_a_span_open_since_the_start_costs_the_live_indexer_only_the_new_steps(tmp_path, monkeypatch):
    """A span left open around the whole loop (the user's own ``record_span("train")``) does not
    make every update compute again every step since it began: each update computes the steps it
    brings (from the window, never reading the index back), and the answers are the direct read's."""
    from forge_obs.analysis.index import paths, updater
    from forge_obs.analysis.index.window import Window

    script = tmp_path / "loop.py"
    script.write_text(OPEN_ALL_RUN)
    src = tmp_path / "src"
    subprocess.run([sys.executable, str(script), str(src), "200"], check=True, timeout=120)
    reads, computed = [], []
    real_steps, real_part = paths.compute_steps, paths._compute_part
    monkeypatch.setattr(updater, "compute_steps", lambda *a: reads.append(1) or real_steps(*a))

    def part(*a, **k):
        done = real_part(*a, **k)
        computed.append(len(done))
        return done

    monkeypatch.setattr(paths, "_compute_part", part)
    run = follow_live(src, tmp_path / "run", Window())
    assert len(reads) <= 1, f"{len(reads)} updates read the index back"
    assert max(computed[-10:]) <= max(computed[8:18]) + 3, computed  # as many at the end as early on
    assert_same_answers(run)
