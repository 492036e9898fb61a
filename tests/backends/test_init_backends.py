"""``init_backends`` on the real GlobalLoggingActor: a failed call (a backend whose constructor
or ``init`` raises, or whose ``init`` never returns) changes nothing -- the running backends keep
logging every step, each value in its own step --, every error names its backend, the run
directory exists before any backend starts, ``meta.json`` counts exactly the steps logged, and
a flush after ``shutdown`` says so."""

from __future__ import annotations

import json
import logging
import threading

import pytest

import provisioner_hooks
from forge_obs import LoggerBackend, Reduce, get_or_create_metric_logger, record_metric, register_backend
from tests.support.helpers import global_rows, start_logger


class FailingInit(LoggerBackend):
    def init(self, run=None, **kw):
        raise OSError("cannot open the dashboard")


class FailingConstructor(LoggerBackend):
    def __init__(self, config=None, **kw):
        super().__init__(config, **kw)
        raise KeyError("webhook_url")


#: released by the test that starts a HangingInit, so that its thread ends
RELEASE = threading.Event()


class HangingInit(LoggerBackend):
    """A dashboard whose server never answers: ``init`` blocks until the test releases it."""

    def init(self, run=None, **kw):
        RELEASE.wait()


class WritesInRunDir(LoggerBackend):
    """A custom backend that opens a file of its own in the run directory in ``init``."""

    def init(self, run=None, **kw):
        super().init(run)
        self.f = open(run.run_dir / "custom.txt", "w")

    def log_step(self, record):
        self.f.write(f"{record.step}\n")

    def finish(self):
        self.f.close()


register_backend("t_failing_init", FailingInit)
register_backend("t_failing_ctor", FailingConstructor)
register_backend("t_hanging_init", HangingInit)
register_backend("t_writes_in_run_dir", WritesInRunDir)


def _meta(tmp_path, run_id="t"):
    return json.loads((tmp_path / run_id / "meta.json").read_text())


async def _steps(mlogger, steps):
    for step in steps:
        record_metric("x", float(step + 1), Reduce.SUM)
        await mlogger.flush.call_one(step)


@pytest.mark.parametrize("bad, named", [
    ({"t_failing_init": {}}, "backend 't_failing_init' failed to initialise: OSError('cannot open the dashboard')"),
    ({"t_failing_ctor": {}}, "backend 't_failing_ctor' (FailingConstructor) could not be created: KeyError('webhook_url')"),
    ({"t_hanging_init": {}, "backend_init_timeout_s": 1.0},
     "backend 't_hanging_init' did not finish init within backend_init_timeout_s=1s"),
])
async def test_a_failed_second_init_backends_leaves_the_running_backends_logging(tmp_path, bad, named):
    """Steps 0-1 logged, then init_backends fails; the user catches it and trains on: steps 2-5
    reach the backends that were running, each with its own value; shutdown finishes the run."""
    RELEASE.clear()
    mlogger = await start_logger(tmp_path, {})
    await _steps(mlogger, range(2))
    try:
        with pytest.raises(Exception) as info:
            await mlogger.init_backends.call_one(bad)
    finally:
        RELEASE.set()
    assert named in str(info.value)
    assert "the running backends keep logging" in str(info.value)
    await _steps(mlogger, range(2, 6))
    await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path)
    assert {s: r["metrics"]["x"] for s, r in rows.items()} == {s: float(s + 1) for s in range(6)}
    meta = _meta(tmp_path)
    assert meta["status"] == "finished" and meta["steps_logged"] == 6 and len(meta["starts"]) == 1


async def test_a_failed_first_init_backends_starts_nothing_and_says_so(tmp_path):
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    with pytest.raises(Exception) as info:
        await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "t"}, "t_failing_init": {}})
    assert "backend 't_failing_init' failed to initialise" in str(info.value) and "no backend was started" in str(info.value)
    assert not (tmp_path / "t" / "metrics.jsonl").exists()


@pytest.mark.parametrize("config, says", [
    ({"console": {"logging_mode": "sk-proj-abcdefghijklmnop0501XYZ"}}, "logging_mode '***' is not a valid LoggingMode"),
    ({"jsonl": {"filename": "../../escape.jsonl"}}, "jsonl backend: filename '../../escape.jsonl' must be a relative "
                                                    "path inside the run directory"),
])
async def test_init_backends_errors_quote_no_secret_and_write_nothing_outside(tmp_path, config, says):
    """The issue's two cases through the real controller: an ``sk-…`` logging_mode is not echoed
    (in the message Monarch hands back, with every cause), and a file name that leaves the run
    directory raises before anything is written."""
    import traceback

    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    with pytest.raises(Exception) as info:
        await mlogger.init_backends.call_one({"run": {"root": str(tmp_path / "root"), "id": "t"}, **config})
    text = "".join(traceback.format_exception(info.value))
    assert says in text and "0501XYZ" not in text, text
    assert not (tmp_path / "escape.jsonl").exists() and not (tmp_path / "root" / "t" / "metrics.jsonl").exists()


async def test_the_run_directory_exists_before_any_backend_starts(tmp_path):
    """A custom backend listed before the local store opens its file in the run directory."""
    mlogger = await start_logger(tmp_path, {"t_writes_in_run_dir": {}, "jsonl": {}}, run_id="fresh")
    await _steps(mlogger, range(3))
    await mlogger.shutdown.call_one()
    assert (tmp_path / "fresh" / "custom.txt").read_text() == "0\n1\n2\n"


async def test_steps_logged_in_meta_json_is_the_number_of_steps_written(tmp_path):
    """Nothing recorded after the last flush: shutdown's final cut logs no step, and meta.json's
    count is the rows written."""
    mlogger = await start_logger(tmp_path, {})
    await _steps(mlogger, range(4))
    await mlogger.shutdown.call_one()
    assert len(global_rows(tmp_path)) == 4 and _meta(tmp_path)["steps_logged"] == 4
    mlogger = await start_logger(tmp_path, {})  # the same run again, a value after the last flush
    await _steps(mlogger, range(4, 6))
    record_metric("x", 100.0, Reduce.SUM)
    await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path)
    assert sorted(rows) == [0, 1, 2, 3, 4, 5, 6] and rows[6]["metrics"]["x"] == 100.0
    assert _meta(tmp_path)["steps_logged"] == 3  # this session's: steps 4, 5 and shutdown's 6


async def test_a_flush_after_shutdown_says_after_shutdown(tmp_path, caplog):
    mlogger = await start_logger(tmp_path, {})
    await _steps(mlogger, range(1))
    await mlogger.shutdown.call_one()
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        await mlogger.flush.call_one(1)
    text = caplog.text
    assert "flush(1) after shutdown" in text and "before init_backends" not in text


async def test_a_flush_with_every_backend_turned_off_says_so(tmp_path, caplog):
    """``{"jsonl": None}`` turns the default store off: flush warns what the config did, not
    that init_backends failed (it did not)."""
    mlogger = await start_logger(tmp_path, {"jsonl": None}, run_id="none")
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    assert "turned every backend off" in caplog.text and "failed" not in caplog.text, caplog.text
    assert not (tmp_path / "none" / "metrics.jsonl").exists()


class FailsWhenStartedAgain(LoggerBackend):
    """Starts once; every later instance's ``init`` raises (its dashboard went away)."""

    started = 0

    def init(self, run=None, **kw):
        type(self).started += 1
        if type(self).started > 1:
            raise ConnectionError("dashboard gone")


register_backend("t_fails_again", FailsWhenStartedAgain)


async def test_a_backend_that_replaces_a_running_one_and_fails_is_named_and_the_others_log_on(tmp_path):
    """A backend of the same name as a running one starts after the running one finished (two
    W&B runs with one id cannot be open at once). If it then fails, the error says the running
    one has finished and which backends log from now on; every step still lands in its own row."""
    FailsWhenStartedAgain.started = 0
    mlogger = await start_logger(tmp_path, {"t_fails_again": {}})
    await _steps(mlogger, range(2))
    with pytest.raises(Exception) as info:
        await mlogger.init_backends.call_one({"t_fails_again": {}})
    assert ("backend 't_fails_again' failed to initialise: ConnectionError('dashboard gone') (it replaced the running "
            "backend of that name, which has finished; from now on logging continues with jsonl)") in str(info.value)
    await _steps(mlogger, range(2, 6))
    await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path)
    assert {s: r["metrics"]["x"] for s, r in rows.items()} == {s: float(s + 1) for s in range(6)}
    meta = _meta(tmp_path)
    assert meta["status"] == "finished" and meta["steps_logged"] == 4 and len(meta["starts"]) == 2
    assert sorted(meta["backends"]) == ["jsonl"]


async def test_init_backends_again_with_wandb_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """Real W&B (offline): the second session's W&B run has the first one's id; it is opened
    after the first one finished, and W&B has every step once."""
    pytest.importorskip("wandb")
    from tests.support.wandb_reader import find_run_files, read_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    mlogger = await start_logger(tmp_path, {"wandb": {"mode": "offline"}}, run_id="wb")
    await _steps(mlogger, range(2))
    await mlogger.init_backends.call_one({"wandb": {"mode": "offline"}})
    await _steps(mlogger, range(2, 4))
    await mlogger.shutdown.call_one()
    runs = [read_run(f) for f in find_run_files(tmp_path / "wb" / "wandb")]
    assert {r.run_id for r in runs} == {"wb"}
    assert sorted((row["_step"], row["x"]) for r in runs for row in r.history) == [(s, float(s + 1)) for s in range(4)]


def test_call_hook_passes_each_hook_the_keywords_it_takes():
    """A hook gets only the keyword arguments its own signature names (all of them with
    ``**kwargs``), whatever another backend's hook of the same name takes; async hooks run."""
    from forge_obs.backends.base import call_hook

    class Old:
        def init(self, run=None):
            return ("old", run)

    class New:
        def init(self, run=None, role=None, **kw):
            return ("new", run, role, kw)

    class Async:
        async def init(self, role=None):
            return ("async", role)

    class CallableHook:
        def __call__(self, process_name=None):
            return ("callable", process_name)

    kw = {"run": 1, "role": "global", "process_name": "Controller"}
    for _ in range(2):  # the second time from what was read the first time
        assert call_hook(Old().init, **kw) == ("old", 1)
        assert call_hook(New().init, **kw) == ("new", 1, "global", {"process_name": "Controller"})
        assert call_hook(Async().init, **kw) == ("async", "global")
        assert call_hook(CallableHook(), **kw) == ("callable", "Controller")
        assert call_hook(lambda: "no args") == "no args"


def test_the_view_live_line_works_as_printed_before_the_environment_is_activated(tmp_path):
    """The line a run prints when it starts (the GRPO run's first command) names ``forge-obs``
    by the same rule as every other printed command: in a shell whose PATH lacks the
    environment's bin/ it is ``.venv/bin/forge-obs`` (or ``python -m forge_obs.cli``), and the
    command runs as printed."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.helpers import run_as_user

    bindir = Path(sys.executable).parent.resolve()
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p).resolve() != bindir)
    script = tmp_path / "start.py"
    script.write_text("import asyncio, provisioner_hooks\nfrom forge_obs import get_or_create_metric_logger\n"
                      "async def main():\n    provisioner_hooks.install()\n"
                      "    ml = await get_or_create_metric_logger(process_name='Controller')\n"
                      "    await ml.init_backends.call_one({'run': {'root': 'my runs', 'id': 'r'}})\n"
                      "    await ml.shutdown.call_one()\nasyncio.run(main())\n")
    res = run_as_user(script, tmp_path, env={"PATH": path, "VIRTUAL_ENV": ""}, timeout=120)
    (cmd,) = re.findall(r"view live: (.*)$", res.stderr, re.M)
    assert cmd.endswith(" serve 'my runs'") and not cmd.startswith("forge-obs "), cmd
    help_out = subprocess.run(["bash", "-c", cmd + " --help"], cwd=tmp_path, env=dict(os.environ, PATH=path),
                              capture_output=True, text=True, timeout=120)
    assert help_out.returncode == 0 and "usage: forge-obs serve" in help_out.stdout, help_out.stderr
