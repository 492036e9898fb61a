"""Structured timeline, in one process: API, writer, reader, export, SQL (no Monarch; the doctor: test_doctor.py)."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forge_obs.recording import timeline as tl
from forge_obs.analysis import reader
from forge_obs.analysis.trace import export_trace
from forge_obs.core.identity import current_identity
from forge_obs.recording.timeline import recorder, schema
from tests.support.trace_validate import load


@pytest.fixture
def tdir(tmp_path):
    tl.close()
    recorder.clear()  # what earlier tests recorded before any configure is not this run's
    yield tmp_path
    tl.close()


def _items(run_dir):
    run = reader.scan(run_dir)
    return run, list(reader.walk(run))


def _spans(items, name=None):
    return [it for it in items if it[0] == reader.SPAN and (name is None or it[3] == name)]


def test_spans_events_steps_roundtrip(tdir):
    assert tl.configure(tdir, open_after_s=60)
    tl.set_step(3)

    @tl.record_span("sync_fn", kind="deco")
    def sync_fn(x):
        return x * 2

    @tl.record_span("async_fn", flow="ep-1")
    async def async_fn():
        await asyncio.sleep(0)
        tl.record_event("produced", flow="ep-1", n=4)
        return 5

    with tl.record_span("outer", lr=0.1):
        assert sync_fn(2) == 4
    assert asyncio.run(async_fn()) == 5
    with pytest.raises(KeyError):
        with tl.record_span("fails"):
            raise KeyError("boom")
    tl.add_step_tag("eval")
    tl.close()

    run, items = _items(tdir)
    (st,) = run.streams.values()
    assert st.mesh == "controller" and st.clean
    assert [it[3] for it in _spans(items)] == ["sync_fn", "outer", "async_fn", "fails"]
    outer = _spans(items, "outer")[0]
    inner = _spans(items, "sync_fn")[0]
    assert outer[4] == 3 and outer[7] == {"a": {"lr": 0.1}}
    assert outer[5] <= inner[5] and inner[5] + inner[6] <= outer[5] + outer[6]  # nesting kept
    assert _spans(items, "fails")[0][7]["e"].startswith("KeyError")
    assert _spans(items, "async_fn")[0][7]["f"] == "ep-1"
    ev = [it for it in items if it[0] == reader.INSTANT]
    assert ev[0][3] == "produced" and ev[0][6] == {"f": "ep-1", "a": {"n": 4}}
    tags = [it for it in items if it[0] == reader.TAG]
    assert tags[0][3:5] == (3, "eval")
    # the async span ran in a task: its own track, named after the task
    assert st.lanes[_spans(items, "async_fn")[0][2]] != st.lanes[outer[2]]


def test_step_is_scoped_per_task(tdir):
    tl.configure(tdir)

    async def worker(step, gate):
        tl.set_step(step)
        await gate.wait()  # both tasks have set their step before either records
        with tl.record_span("work"):
            await asyncio.sleep(0)

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(worker(s, gate)) for s in (10, 20)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    tl.close()
    _run, items = _items(tdir)
    spans = _spans(items, "work")
    assert sorted(s[4] for s in spans) == [10, 20]
    assert len({s[2] for s in spans}) == 2  # concurrent tasks: separate tracks


def test_compact_records_and_torn_last_line(tdir):
    tl.configure(tdir)
    tl.set_step(1)
    for _ in range(1000):
        with tl.record_span("fwd"):
            pass
    tl.close()
    (path,) = (tdir / "events").glob("*.jsonl")
    lines = path.read_text().splitlines()
    spans = [ln for ln in lines if ln.startswith("[") and not ln.startswith('["')]
    assert len(spans) == 1000
    assert sum(len(s) + 1 for s in spans) / 1000 <= 40  # bytes per span record
    with open(path, "a") as f:
        f.write('[123,4,0,1')  # a writer killed mid-line
    _run, items = _items(tdir)
    assert len(_spans(items, "fwd")) == 1000


def test_open_span_written_as_begin_and_unfinished_in_views(tdir):
    tl.configure(tdir, open_after_s=0)
    tl.set_step(7)
    with tl.record_span("done"):
        pass
    hang = tl.record_span("hung_step")
    hang.__enter__()
    tl.flush()
    # the open span is on disk before the process ends (a hang) ...
    text = next((tdir / "events").glob("*.jsonl")).read_text()
    assert '["B",' in text
    with tl.record_span("after"):
        pass
    tl.close()
    out = tdir / "trace.json"
    stats = export_trace(tdir, out)
    s = load(out)
    assert stats["unfinished"] == 1 and len(s.unfinished) == 1
    u = s.unfinished[0]
    assert u["name"] == "hung_step" and u["args"]["step"] == 7
    last = max(e["ts"] + e.get("dur", 0) for e in s.events if e.get("ph") in ("X", "i"))
    assert u["ts"] + u["dur"] == last  # drawn up to the end of the data
    cli = _cli("trace", str(tdir), "-o", str(tdir / "cli.json"))
    assert cli.returncode == 0 and "1 unfinished" in cli.stdout
    assert load(tdir / "cli.json").slices == s.slices


def test_a_process_inside_a_span_on_disk_says_it_is_alive_until_the_span_ends(tdir):
    """A span written as "B" (open past ``open_after_s``) and nothing else to write: each writer
    pass writes ``["A", ts]``, so the data of a process killed inside the span reaches its last
    pass (the span's time open, not none). Once the span ended, passes write nothing."""
    tl.configure(tdir, open_after_s=0, flush_interval_s=60)  # passes only when flushed
    stuck = tl.record_span("stuck")
    stuck.__enter__()
    tl.flush()  # its "B"
    tl.flush()
    tl.flush()
    path = next((tdir / "events").glob("*.jsonl"))
    recs = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    (begin,) = [r for r in recs if r[0] == "B"]
    alive = [r for r in recs if r[0] == "A"]
    assert len(alive) == 2 and begin[2] <= alive[0][1] <= alive[1][1], recs
    run, _items_ = _items(tdir)
    t0 = json.loads(path.read_text().splitlines()[0])["t0"]
    assert reader.run_end(run) == t0 + alive[1][1]  # the data reaches the last pass
    stuck.__exit__(None, None, None)
    tl.flush()
    tl.flush()
    after = path.read_text().splitlines()[1 + len(recs):]
    assert [json.loads(x)[0] for x in after] == ["E"], after


def test_rotation_keeps_every_record(tdir):
    tl.configure(tdir, max_file_mb=0.002, open_after_s=0, flush_interval_s=0.01)
    tl.set_step(0)
    long = tl.record_span("long")
    long.__enter__()
    for i in range(400):
        with tl.record_span(f"s{i % 7}"):
            pass
        if i % 20 == 0:
            tl.flush()
    long.__exit__(None, None, None)
    tl.close()
    files = sorted((tdir / "events").glob("*.jsonl"))
    assert len(files) >= 3  # ~7 kB in 2 kB files
    for f in files:
        assert json.loads(f.open().readline())["h"] == 1  # every file is self-describing
    _run, items = _items(tdir)
    assert len(_spans(items)) == 401  # the span begun in file 0 ended in a later one
    assert len(_spans(items, "long")) == 1


def test_rank_selection(tdir):
    assert schema.parse_ranks("all") is None
    assert schema.parse_ranks("0,3") == {0, 3}
    assert schema.parse_ranks("0-2,8") == {0, 1, 2, 8}
    assert schema.rank_selected("every:4", 8) and not schema.rank_selected("every:4", 6)
    with pytest.raises(ValueError):
        schema.validate_options({"ranks": "zero"})
    with pytest.raises(ValueError):
        schema.validate_options({"max_file_mb": 0})
    with pytest.raises(ValueError):
        schema.validate_options({"rank": "0"})
    ident = current_identity()
    saved = (ident.mesh, ident.rank)
    try:
        ident.mesh, ident.rank = "trainer", 1
        assert tl.configure(tdir, ranks="0,3") is False
        assert not tl.is_enabled()
        with tl.record_span("x"):
            pass
        tl.close()
        assert not list((tdir / "events").glob("*.jsonl")) if (tdir / "events").exists() else True
        ident.rank = 3
        assert tl.configure(tdir / "b", ranks="0,3") is True
        with tl.record_span("x"):
            pass
        tl.close()
        assert len(list((tdir / "b" / "events").glob("*_trainer_3.jsonl"))) == 1
    finally:
        ident.mesh, ident.rank = saved
        recorder.set_recording(True)


def test_disable_switch_makes_everything_a_noop(tmp_path):
    code = (
        "from forge_obs.recording import timeline as tl\n"
        f"print(tl.configure({str(tmp_path)!r}))\n"
        "with tl.record_span('x'): pass\n"
        "tl.record_event('e'); tl.set_step(1); tl.close()\n"
        "from forge_obs.recording.timeline import recorder\n"
        "print(tl.is_enabled(), recorder.pending())\n"
    )
    for var in ("FORGE_DISABLE_METRICS", "FORGE_DISABLE_TIMELINE"):
        env = dict(os.environ, **{var: "true"})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False", "False", "0"]
        assert not (tmp_path / "events").exists()


def _fake_run(root: Path, ranks: int, steps: int, slow_rank=None, hang_rank=None, nan_step=None, dead_rank=None,
              weight_sync_us=None):
    """A run written by the real writer, one identity at a time (mesh 'trainer', N ranks), on a
    simulated clock (train_step: 2 ms, 6 ms on the slow rank; with ``weight_sync_us`` every rank
    also spends that long in 'weights_load' each step): no dependence on machine load."""
    import time

    from forge_obs.recording.timeline import writer

    start = time.perf_counter_ns()
    clock = [start]
    recorder.set_clock(lambda: clock[0])

    ident = current_identity()
    saved = (ident.mesh, ident.rank, ident.world_size, writer.SESSION)
    try:
        for r in range(ranks):
            ident.mesh, ident.rank, ident.world_size = "trainer", r, ranks
            writer.SESSION = f"fake{r}"  # one process session per rank
            clock[0] = start  # ranks run side by side
            tl.configure(root, open_after_s=0)
            for s in range(steps):
                tl.set_step(s)
                if dead_rank == r and s == steps // 2:
                    break
                if hang_rank == r and s == steps - 1:
                    tl.record_span("train_step").__enter__()
                    break
                with tl.record_span("train_step"):
                    clock[0] += 6_000_000 if slow_rank == r else 2_000_000 + 10_000 * ((r + s) % 3)
                if weight_sync_us is not None:
                    with tl.record_span("weights_load"):
                        clock[0] += weight_sync_us * 1000
                clock[0] += 1_000_000
            if hang_rank == r or dead_rank == r:
                writer._writer.stop_ev.set()  # dies without closing: no "Z" ...
                writer._writer.thread.join()
                writer._writer._drain(final=True)  # ... after its writer wrote the open span as "B"
                writer._writer.thread.join()
                writer._writer.f.close()
                writer._writer = None
                recorder.clear()
            else:
                tl.close()
    finally:
        ident.mesh, ident.rank, ident.world_size, writer.SESSION = saved
        recorder.set_clock(None)
    if nan_step is not None:
        with open(root / "metrics.jsonl", "w") as f:
            for s in range(steps):
                v = float("nan") if s == nan_step else 0.5
                f.write(json.dumps({"run_id": "x", "step": s, "mode": "global_reduce", "wall_time": 1.0,
                                    "metrics": {"loss": v, "policy/staleness": 0.0}}) + "\n")


def _cli(*argv):
    return subprocess.run([sys.executable, "-c", "import sys; from forge_obs.cli import main; sys.exit(main())", *argv],
                          capture_output=True, text=True)


def test_sql_views(tmp_path):
    pytest.importorskip("duckdb")
    from forge_obs.analysis.sql import connect

    tl.close()
    _fake_run(tmp_path, 3, 4, slow_rank=1, hang_rank=2, nan_step=2)
    con = connect(tmp_path)
    rows = con.execute("SELECT rank, count(*), bool_and(finished) FROM spans GROUP BY rank ORDER BY rank").fetchall()
    assert rows == [(0, 4, True), (1, 4, True), (2, 4, False)]  # rank 2: 3 finished + the hung one
    (slow,) = con.execute("SELECT rank FROM spans WHERE finished GROUP BY rank ORDER BY median(dur_ms) DESC LIMIT 1").fetchone()
    assert slow == 1
    assert con.execute("SELECT count(*) FROM events WHERE kind = 'step'").fetchone()[0] == 12
    nan = con.execute("SELECT step FROM metrics WHERE key = 'loss' AND isnan(value)").fetchall()
    assert nan == [(2,)]
    out = _cli("sql", str(tmp_path), "SELECT count(*) AS n FROM spans WHERE NOT finished", "--format", "json")
    assert out.returncode == 0 and json.loads(out.stdout) == [{"n": 1}]


def test_hot_path_imports_neither_monarch_nor_torch():
    code = ("import sys; import forge_obs; from forge_obs import record_span, set_step\n"
            "from forge_obs.recording.timeline import writer\n"
            "print(sorted(m for m in ('torch', 'monarch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_log_to_metrics_records_the_duration(tdir, fresh_collector):
    tl.configure(tdir)
    for _ in range(3):
        with tl.record_span("fwd", log_to_metrics=True):
            pass
    tl.close()
    snap = fresh_collector.snapshot()
    assert "span/fwd/duration_s" in json.dumps(snap, default=str)


def test_export_filters_and_clock_offsets(tmp_path):
    tl.close()
    _fake_run(tmp_path, 3, 5)
    # pretend rank 1 ran on another host whose clock is 2 s ahead of the controller's
    (f1,) = (tmp_path / "events").glob("*_trainer_1.jsonl")
    lines = f1.read_text().splitlines(keepends=True)
    h = json.loads(lines[0])
    h.update(host="other", clk=[h["t0"] + 2_000_100, h["t0"] + 100], t0=h["t0"] + 2_000_000)
    f1.write_text(json.dumps(h) + "\n" + "".join(lines[1:]))
    ctl_h = {"h": 1, "v": 1, "run": "x", "session": "c", "host": h.get("host_ctl", "vm-ctl"), "pid": 1, "mesh": "controller",
             "rank": 0, "ctl": True, "t0": h["t0"], "file": 0}
    (tmp_path / "events" / "ctl.jsonl").write_text(json.dumps(ctl_h) + "\n")
    out = tmp_path / "t.json"
    export_trace(tmp_path, out, steps=(1, 3), ranks={0, 1})
    s = load(out)
    assert s.slices["train_step"] == 2 * 3  # ranks 0, 1 x steps 1..3
    assert len(s.process_names) == 2
    doc = json.loads(out.read_text())
    assert doc["otherData"]["clock_offsets_us"]["other"] == -2_000_000
    r0 = sorted(e["ts"] for e in s.events if e.get("name") == "train_step" and "trainer r0" not in s.process_names[e["pid"]])
    r_other = [e["ts"] for e in s.events if e.get("ph") == "X"]
    # after correction, the 'other' host's spans sit within the same second as rank 0's
    assert max(r_other) - min(r_other) < 1_000_000 and r0


def test_trace_ranks_take_the_timeline_rank_spec(tmp_path):
    """``forge-obs trace --ranks`` parses ranks like the timeline's ``ranks`` option."""
    tl.close()
    _fake_run(tmp_path, 4, 2)
    out = tmp_path / "every2.json"
    cli = _cli("trace", str(tmp_path), "-o", str(out), "--ranks", "every:2")
    assert cli.returncode == 0, cli.stderr
    names = load(out).process_names.values()
    assert sorted(int(re.search(r" r(\d+) ", n).group(1)) for n in names) == [0, 2]
    bad = _cli("trace", str(tmp_path), "-o", str(tmp_path / "x.json"), "--ranks", "0,x")
    assert bad.returncode == 2 and bad.stderr.strip() == "forge-obs trace: bad ranks '0,x': use 'all', '0,3', '0-3,8' or 'every:4'"
    assert not (tmp_path / "x.json").exists()


def test_resumed_run_keeps_attempts_apart(tdir):
    from forge_obs.analysis.sql import connect
    from forge_obs.recording.timeline import writer

    saved = writer.SESSION
    try:
        for attempt, start in enumerate((1000.0, 2000.0)):
            writer.SESSION = f"attempt{attempt}"  # a new process of the resumed job
            tl.configure(tdir, _run_id="exp", _start=start)
            tl.set_step(attempt * 10)
            with tl.record_span("train_step"):
                pass
            tl.close()
    finally:
        writer.SESSION = saved
    s = load(export_trace(tdir, tdir / "t.json") and tdir / "t.json")
    assert sorted(n.split(" (")[0] for n in s.process_names.values()) == ["controller r0 [attempt 0]", "controller r0 [attempt 1]"]
    rows = connect(tdir).execute("SELECT attempt, step FROM spans ORDER BY attempt").fetchall()
    assert rows == [(0, 0), (1, 10)]


def _busy(seconds):
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_spans_carry_their_thread_cpu_time(tdir):
    """A span's CPU time is its thread's CPU time between enter and exit: busy work shows it all,
    a sleep (waiting, or a preempted thread) almost none; the reader's span rows carry it as
    ``cpu_us`` (``it[8]``), also for a span written as begun and ended later."""
    import time

    tl.configure(tdir, open_after_s=0.0)
    tl.set_step(1)
    with tl.record_span("busy"):
        _busy(0.03)
    with tl.record_span("sleeps"):
        time.sleep(0.03)
    long = tl.record_span("long")
    long.__enter__()
    _busy(0.01)
    tl.flush()  # written as "B" (open past open_after_s), its "E" carries the CPU time
    long.__exit__(None, None, None)
    tl.close()
    text = next((tdir / "events").glob("*.jsonl")).read_text()
    assert '["B",' in text
    _run, items = _items(tdir)
    (busy,), (sleeps,), (lng,) = _spans(items, "busy"), _spans(items, "sleeps"), _spans(items, "long")
    assert 30_000 <= busy[8] <= busy[6]  # at least the busy loop's CPU, never more than the wall time
    assert sleeps[8] < sleeps[6] / 4
    assert 10_000 <= lng[8] <= lng[6]
    assert "c" not in (busy[7] or {})  # the reader's extras are what they were
    out = tdir / "trace.json"
    export_trace(tdir, out)
    tdur = {e["name"]: e.get("tdur") for e in load(out).events if e.get("ph") == "X"}
    assert tdur["busy"] == busy[8] and tdur["long"] == lng[8]  # Perfetto's "Thread duration"
    from forge_obs.analysis.sql import connect

    cpu = dict(connect(tdir).execute("SELECT name, cpu_us FROM spans").fetchall())  # the run's index
    assert cpu == {"busy": busy[8], "sleeps": sleeps[8], "long": lng[8]}


def test_short_spans_stop_paying_for_cpu_time(tdir):
    """A name whose last span lasted under 100 µs stops reading the thread's CPU clock (a syscall
    that costs more than the rest of the span); it reads it again after one lasted longer."""
    tl.configure(tdir, open_after_s=60)
    for _ in range(5):
        with tl.record_span("tiny"):
            pass
    with tl.record_span("tiny"):
        _busy(0.002)  # long, without its CPU time: the name was short
    with tl.record_span("tiny"):
        _busy(0.002)  # long again: it carries it
    tl.close()
    _run, items = _items(tdir)
    cpu = [it[8] for it in _spans(items, "tiny")]
    assert cpu[0] is not None and cpu[1:6] == [None] * 5 and cpu[6] is not None and cpu[6] >= 2000


def test_every_record_the_writer_writes_is_one_of_the_defined_records(tdir):
    """The file's records, as written by the writer, decode as the records of
    ``forge_obs.recording.timeline.records``: each code one record type with named fields."""
    from forge_obs.recording.timeline import records

    tl.configure(tdir, open_after_s=0)
    tl.set_step(2)
    with tl.record_span("a", flow="f1", k=1):
        tl.record_event("ev", n=2)
    tl.add_step_tag("eval")
    hung = tl.record_span("hung")
    hung.__enter__()
    with pytest.raises(ValueError):
        with tl.record_span("err"):
            raise ValueError("x")
    tl.flush()
    hung.__exit__(None, None, None)
    tl.close()
    path = next((tdir / "events").glob("*.jsonl"))
    kinds = {}
    for line in path.read_text().splitlines()[1:]:
        rec = records.decode(json.loads(line))
        assert rec is not None, line
        kinds.setdefault(type(rec).__name__, []).append(rec)
    assert set(kinds) >= {"SpanRecord", "NameRecord", "LaneRecord", "InstantRecord", "StepRecord", "TagRecord",
                          "BeginRecord", "EndRecord", "CloseRecord"}
    names = {r.id: r.name for r in kinds["NameRecord"]}
    a = next(r for r in kinds["SpanRecord"] if names[r.name] == "a")
    assert a.step == 2 and a.extras[records.X_FLOW] == "f1" and a.extras[records.X_ATTRS] == {"k": 1}
    err = next(r for r in kinds["SpanRecord"] if names[r.name] == "err")
    assert err.extras[records.X_ERROR].startswith("ValueError")
    (b,), (e,) = kinds["BeginRecord"], kinds["EndRecord"]
    assert names[b.name] == "hung" and e.sid == b.sid and e.ts >= b.ts
    (tag,) = kinds["TagRecord"]
    assert tag.tag == "eval" and tag.step == 2
    assert records.decode([records.BEGIN, 1, "x"]) is None and records.decode(["?", 1]) is None
    assert records.decode([1, 2, 0, 1, None, {"a": 3}]) is None  # attributes that are not a dict


def test_no_index_arithmetic_on_records_outside_their_definition():
    """The writer reads buffer entries and writes records through their named definitions only."""
    import ast

    src = Path(tl.__file__).parent
    for name in ("writer.py", "recorder.py"):
        tree = ast.parse((src / name).read_text())
        idx = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Subscript)
               and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, int)]
        assert not idx, f"{name}: index reads at lines {idx}"


def test_public_path_star_import(tmp_path):
    """``from forge_obs.timeline import *`` gives the recording API (its __all__ names only what
    it has)."""
    code = "from forge_obs.timeline import *\nprint(sorted(k for k in dir() if not k.startswith('_')))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.replace("'", '"')) == sorted(["record_span", "record_event", "set_step", "add_step_tag",
                                                               "get_step", "configure", "flush", "close", "is_enabled"])
