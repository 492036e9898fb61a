"""The JSONL store: durable rows per step, identity fields, a torn last line skipped."""

import errno
import json
import logging
import math
import os

import pytest

from forge_obs.backends import jsonl
from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.core.types import Metric
from forge_obs.backends.record import RunContext, StepRecord
from forge_obs.core.redact import redact
from forge_obs.core.run import RunConfig, write_meta
from forge_obs.analysis.store import read_jsonl, read_metrics


def _record(step):
    return StepRecord(
        step=step,
        run_id="r",
        wall_time=100.0 + step,
        global_metrics=[Metric("loss", 0.5 * step), Metric("bad", math.nan)],
        per_rank={"trainer/Trainer/r0": [Metric("loss", 1.0, source="trainer/Trainer/r0")]},
        raw={"trainer/Trainer/r0": [("loss", 1.0, 123.0)]},
        sources={"trainer/Trainer/r0": {"label": "trainer/Trainer/r0", "mesh": "trainer", "rank": 0, "pid": 7}},
        missing=["gen/r1"] if step else [],
    )


def test_rows_are_on_disk_after_each_step_and_read_back(tmp_path):
    run = RunContext(run_id="r", run_dir=tmp_path / "r")
    be = JsonlBackend({"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]})
    be.init(run=run)
    be.log_step(_record(0))
    # durable before finish(): another reader sees the step already
    rows = read_metrics(run.run_dir, None)
    assert [r["mode"] for r in rows] == ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]
    be.log_step(_record(1))
    be.finish()
    g = read_metrics(run.run_dir)
    assert [r["step"] for r in g] == [0, 1]
    assert g[1]["metrics"]["loss"] == 0.5 and math.isnan(g[1]["metrics"]["bad"])
    assert g[1]["missing"] == ["gen/r1"] and "missing" not in g[0]
    pr = read_metrics(run.run_dir, "per_rank_reduce")[0]
    assert pr["source"] == {"label": "trainer/Trainer/r0", "mesh": "trainer", "rank": 0, "pid": 7}
    raw = read_metrics(run.run_dir, "per_rank_no_reduce")[0]
    assert raw["values"] == [["loss", 1.0, 123.0]]


def test_a_torn_last_line_is_skipped_and_a_corrupt_middle_line_warns(tmp_path, caplog):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1, "metr\n{"step": 2}\n{"step": 3, "met')
    assert [r["step"] for r in read_jsonl(p)] == [0, 2]
    assert sum("is not valid JSON" in r.getMessage() for r in caplog.records) == 1


def test_resumed_run_appends_and_meta_records_both_starts(tmp_path):
    run = RunContext(run_id="r", run_dir=tmp_path / "r")
    for start, step in ((1.0, 0), (2.0, 1)):
        be = JsonlBackend({})
        be.init(run=run)
        be.log_step(_record(step))
        be.finish()
        write_meta(run.run_dir, start_time=start, config={"wandb": {"api_key": "SECRET", "project": "p"}})
    assert [r["step"] for r in read_metrics(run.run_dir)] == [0, 1]
    meta = json.loads((run.run_dir / "meta.json").read_text())
    assert meta["starts"] == [1.0, 2.0]
    assert meta["config"]["wandb"] == {"api_key": "***", "project": "p"}
    assert "SECRET" not in (run.run_dir / "meta.json").read_text()


def test_run_config_defaults_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_OBS_RUN_ID", "from-env")
    assert RunConfig.from_config({"root": str(tmp_path)}).run_dir == tmp_path / "from-env"
    monkeypatch.delenv("FORGE_OBS_RUN_ID")
    assert RunConfig.from_config({}).run_id != RunConfig.from_config({}).run_id
    for bad in ({"dir": "x"}, {"id": "a/b"}):
        try:
            RunConfig.from_config(bad)
        except ValueError as e:
            assert "valid" in str(e) or "one directory name" in str(e)
        else:
            raise AssertionError(bad)
    assert redact({"a": [{"hf_token": 1}], "b": 2}) == {"a": [{"hf_token": "***"}], "b": 2}


# ------------------------------------------------------------------ meta.json: concurrency, full disk
def _meta_writer(run_dir: str, who: int, n: int, barrier) -> None:
    """One process writing the same run's meta.json ``n`` times, started together with others."""
    from pathlib import Path

    barrier.wait()
    for i in range(n):
        assert write_meta(Path(run_dir), start_time=who * 1000 + i, status=f"running-{who}") is not None


def test_the_same_run_id_from_several_processes_at_once(tmp_path):
    """Real processes write one run's meta.json at the same moment: none raises, no update is
    lost (the read-modify-write is locked), nothing temporary is left."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    n_procs, n_writes = 4, 25
    barrier = ctx.Barrier(n_procs)
    procs = [ctx.Process(target=_meta_writer, args=(str(tmp_path / "r"), who, n_writes, barrier)) for who in range(n_procs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n_procs
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert sorted(meta["starts"]) == sorted(w * 1000 + i for w in range(n_procs) for i in range(n_writes))
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["meta.json"]


def _no_temp_files(d):
    return [p.name for p in d.iterdir() if p.name != "meta.json"]


def test_meta_write_on_a_full_file_system_reports_and_does_not_raise(tmp_path, caplog):
    """A real full file system (a 64 KiB tmpfs; needs mount rights, else skipped -- the
    RLIMIT_FSIZE test below covers the same path without them)."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run_dir = mnt / "r"
        assert write_meta(run_dir, status="running") is not None
        before = (run_dir / "meta.json").read_text()
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill the file system to the last block
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        with caplog.at_level(logging.ERROR, logger="forge_obs"):
            assert write_meta(run_dir, status="finished", config={"big": "y" * 100_000}) is None
        assert any("could not write" in r.getMessage() and "meta.json" in r.getMessage() for r in caplog.records)
        assert (run_dir / "meta.json").read_text() == before  # intact, still the last good version
        assert _no_temp_files(run_dir) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_meta_write_beyond_the_file_size_limit_reports_and_does_not_raise(tmp_path):
    """The same failure without mount rights: a real process whose file-size limit
    (RLIMIT_FSIZE) is below the new meta.json, so the kernel refuses the write (EFBIG)."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from forge_obs.core.run import write_meta\n"
        "d = Path(sys.argv[1])\n"
        "assert write_meta(d, status='running') is not None\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "print(write_meta(d, status='finished', config={'big': 'y' * 100000}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "None"
    assert "could not write" in p.stderr and "meta.json" in p.stderr and "Traceback" not in p.stderr
    assert json.loads((tmp_path / "r" / "meta.json").read_text())["status"] == "running"
    assert _no_temp_files(tmp_path / "r") == []


# ------------------------------------------------------------------ metrics.jsonl on a full disk
_STORE_PROGRAM = r"""
import json, resource, signal, sys
from pathlib import Path
from forge_obs.backends import jsonl
from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.core.types import Metric
from forge_obs.backends.record import RunContext, StepRecord

root, buffer_rows = Path(sys.argv[1]), float(sys.argv[2])
rec = lambda s: StepRecord(step=s, run_id="r", wall_time=1.0, global_metrics=[Metric("x", float(s)), Metric("pad", "y" * 1000)])
probe = JsonlBackend({"logging_mode": "global_reduce"})
probe.init(run=RunContext(run_id="probe", run_dir=root / "probe"))
probe.log_step(rec(0))
probe.finish()
row = (root / "probe" / "metrics.jsonl").stat().st_size  # every row has this size (steps 0-9)
be = JsonlBackend({"logging_mode": "global_reduce", "retry_buffer_mb": (buffer_rows * row - 1) / 2**20})
be.init(run=RunContext(run_id="r", run_dir=root / "r"))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
for s in range(3):
    be.log_step(rec(s))
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * row + row // 2, resource.RLIM_INFINITY))  # room for half a row more
for s in range(3, 8):
    be.log_step(rec(s))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # room again
be.log_step(rec(8))
be.finish()
print(json.dumps(be.meta_report()))
"""


@pytest.mark.parametrize("buffer_rows, written, report", [
    # steps 3-7 wait in memory (step 3's first half is on disk), then every row is written once
    (100, list(range(9)), {"unwritten_steps": [], "delayed_steps": 5, "write_errors": 5}),
    # room for 2 rows in memory: step 3's second half and step 4 wait; 5-7 exceed it and are named
    (2, [0, 1, 2, 3, 4, 8], {"unwritten_steps": [5, 6, 7], "delayed_steps": 2, "write_errors": 5}),
])
def test_rows_the_disk_refuses_are_held_and_written_once_when_it_takes_them(tmp_path, buffer_rows, written, report):
    """A real process whose file-size limit (RLIMIT_FSIZE, no mount rights needed) makes the
    kernel refuse metrics.jsonl's writes (EFBIG) from the middle of step 3 to step 7, then lets
    them through again: the store holds the rows in memory (up to retry_buffer_mb) and writes
    each once, in order; what it could not hold is named."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _STORE_PROGRAM, str(tmp_path), str(buffer_rows)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == report
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == written and [r["metrics"]["x"] for r in rows] == [float(s) for s in written]
    text = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert text.count("\n") == len(written) and text.endswith("\n")  # no torn or repeated row
    assert p.stderr.count("could not write") == 1 and "is written again" in p.stderr
    if report["unwritten_steps"]:
        assert "lost: steps 5-7" in p.stderr


class TinyDisk:
    """A real 1 MiB tmpfs (needs mount rights): ``fill()`` writes a file until the kernel says
    ENOSPC, ``free()`` removes it."""

    def __init__(self, root):
        self.root = root
        self.filler = root / "filler"

    def fill(self):
        with open(self.filler, "ab", buffering=0) as f:
            for size in (4096, 1):
                try:
                    while True:
                        f.write(b"x" * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e

    def free(self):
        self.filler.unlink()


@pytest.fixture
def tiny_disk(tmp_path):
    import subprocess

    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (the RLIMIT_FSIZE test above covers the store without mount rights)")
    try:
        yield TinyDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


#: 40 keys with long names: a row is over 4 KiB, so no step fits in what is left of a page
_KEYS = [f"k{i:02d}_" + "x" * 100 for i in range(40)]


async def _logged_steps(mlogger, steps, disk, fill_at=None, free_at=None):
    from forge_obs import Reduce, record_metric

    for step in steps:
        if step == fill_at:
            disk.fill()
        if step == free_at:
            disk.free()
        for i, k in enumerate(_KEYS):
            record_metric(k, float(step * 100 + i), Reduce.SUM)
        await mlogger.flush.call_one(step)
        await mlogger.wait_idle.call_one()  # the step reached the store before the disk changes


def _exact(rows, steps):
    assert [r["step"] for r in rows] == list(steps)
    assert all(r["metrics"][k] == r["step"] * 100 + i for r in rows for i, k in enumerate(_KEYS))


async def test_a_full_disk_loses_no_step_of_the_local_store(tiny_disk):
    """The issue's run: the run root on a tmpfs, filled at step 10, freed at step 25: every step
    0-29 is in metrics.jsonl once, with its own values; meta.json says which waited."""
    from tests.support.helpers import start_logger

    mlogger = await start_logger(tiny_disk.root, {"jsonl": {"logging_mode": "global_reduce"}})
    await _logged_steps(mlogger, range(30), tiny_disk, fill_at=10, free_at=25)
    await mlogger.shutdown.call_one()
    run = tiny_disk.root / "t"
    _exact(read_metrics(run), range(30))
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["steps_logged"] == 30
    assert {k: meta["backends"]["jsonl"][k] for k in ("steps", "errors", "unwritten_steps", "delayed_steps", "write_errors")} == \
        {"steps": 30, "errors": 0, "unwritten_steps": [], "delayed_steps": 15, "write_errors": 15}
    assert not (run / ".meta.json.reserve").exists()


async def test_a_disk_that_stays_full_names_the_lost_steps_and_meta_json_is_final(tiny_disk, caplog):
    """Filled at step 10 and never freed: steps 10-19 cannot be written; shutdown names them in
    an error log and in meta.json, whose status is "finished" (written in the space the session
    kept for it). A later session of the same run, the disk freed, starts on a line of its own."""
    from tests.support.helpers import start_logger

    mlogger = await start_logger(tiny_disk.root, {"jsonl": {"logging_mode": "global_reduce"}})
    with caplog.at_level(logging.ERROR, logger="forge_obs"):
        await _logged_steps(mlogger, range(20), tiny_disk, fill_at=10)
        await mlogger.shutdown.call_one()
    run = tiny_disk.root / "t"
    _exact(read_metrics(run), range(10))
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["steps_logged"] == 20
    assert meta["backends"]["jsonl"]["unwritten_steps"] == list(range(10, 20))
    assert any("the rows of 10 steps could not be written" in r.getMessage() and "steps 10-19" in r.getMessage()
               for r in caplog.records)
    tiny_disk.free()
    mlogger = await start_logger(tiny_disk.root, {"jsonl": {"logging_mode": "global_reduce"}})
    await _logged_steps(mlogger, range(20, 22), tiny_disk)
    await mlogger.shutdown.call_one()
    _exact(read_metrics(run), [*range(10), 20, 21])


def test_the_final_status_uses_the_space_kept_for_it(tmp_path, monkeypatch, caplog):
    """Simulated at the file-write boundary (no mount rights needed; the tmpfs test above does
    it for real): meta.json's replacement fails with ENOSPC while the 64 KiB reserve exists, as
    on a disk whose only free blocks would be the reserve's. write_meta frees the reserve and
    records the status; with no reserve left, it logs which status it could not record."""
    import forge_obs.core.run as run_mod
    from forge_obs.core.run import META_RESERVE_BYTES, reserve_meta_space

    d = tmp_path / "r"
    assert write_meta(d, status="running") is not None
    reserve_meta_space(d)
    reserve = d / ".meta.json.reserve"
    assert reserve.stat().st_blocks * 512 >= META_RESERVE_BYTES
    real = run_mod._replace_atomically

    def replace(path, text):
        if reserve.exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(run_mod, "_replace_atomically", replace)
    assert write_meta(d, status="finished") is not None
    assert json.loads((d / "meta.json").read_text())["status"] == "finished" and not reserve.exists()
    def always_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_mod, "_replace_atomically", always_full)
    with caplog.at_level(logging.ERROR, logger="forge_obs"):
        assert write_meta(d, status="reconfigured") is None
    assert "its status stays as it was, not 'reconfigured'" in caplog.text
    assert json.loads((d / "meta.json").read_text())["status"] == "finished"


def _fsyncs(monkeypatch):
    """The store's fsyncs, counted (and done)."""
    calls = []
    real = os.fsync

    def counted(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return calls


def test_the_store_fsyncs_at_most_once_per_interval_and_at_finish(tmp_path, monkeypatch):
    """Every step's rows are written when ``log_step`` returns (another reader sees them); the
    fsync, which costs the machine far more than the write, comes at most every
    ``fsync_interval_s`` (the clock is the test's) and once more at ``finish``."""
    fsyncs = _fsyncs(monkeypatch)
    now = [1000.0]
    monkeypatch.setattr(jsonl.time, "monotonic", lambda: now[0])
    run = RunContext(run_id="r", run_dir=tmp_path / "r")
    be = JsonlBackend({"logging_mode": "global_reduce", "fsync_interval_s": 2.0})
    be.init(run=run)
    for step in range(10):  # 0.5 s apart: steps 0, 4 and 8 are at least 2 s after the last fsync
        be.log_step(_record(step))
        assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(step + 1))
        now[0] += 0.5
    assert len(fsyncs) == 3
    be.finish()
    assert len(fsyncs) == 4


@pytest.mark.parametrize("config, per_step", [({"fsync_interval_s": 0}, 1), ({"fsync": False}, 0)])
def test_fsync_with_every_step_or_never(tmp_path, monkeypatch, config, per_step):
    fsyncs = _fsyncs(monkeypatch)
    be = JsonlBackend({"logging_mode": "global_reduce", **config})
    be.init(run=RunContext(run_id="r", run_dir=tmp_path / "r"))
    for step in range(5):
        be.log_step(_record(step))
    be.finish()
    assert len(fsyncs) == 5 * per_step + per_step


@pytest.mark.parametrize("bad", [-1, "1", float("inf"), True, None])
def test_a_bad_fsync_interval_is_named(bad):
    with pytest.raises(ValueError, match="fsync_interval_s must be a number of seconds >= 0"):
        JsonlBackend({"fsync_interval_s": bad})
