"""Drop-in compatibility with torchforge's ``forge.observability``: code written for it runs with
``forge.observability`` -> ``forge_obs`` (and ``forge.env`` -> ``forge_obs.env``) as the only
change. One test (or a few) per incompatibility of the compatibility issue's table, on real
Monarch processes where the behaviour involves them; torchforge's own suite runs with
scripts/torchforge_suite.sh (see docs/migrating-from-torchforge.md)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
from monarch.actor import Actor, endpoint, this_host

import provisioner_hooks
from forge_obs import LoggerBackend, Reduce, record_metric, register_backend
from forge_obs.recording.collector import MetricCollector
from forge_obs.analysis.store import read_metrics
from tests.support.helpers import CHILD_PATH, global_rows, start_logger

ROOT = Path(__file__).resolve().parents[2]
#: this checkout\'s forge_obs (src/) and its tests/apps helpers (the root), as a child process sees them


# ============================================================ one textual change
#: the names torchforge's forge.observability (and its submodules) export
TORCHFORGE_NAMES = {
    "forge_obs": [
        "get_or_create_metric_logger", "GlobalLoggingActor", "LocalFetcherActor", "BackendRole", "ConsoleBackend",
        "get_logger_backend_class", "LoggerBackend", "LoggingMode", "MaxAccumulator", "MeanAccumulator", "Metric",
        "MetricAccumulator", "MetricCollector", "MinAccumulator", "record_metric", "Reduce", "reduce_metrics_states",
        "StdAccumulator", "SumAccumulator", "WandbBackend", "trace", "Tracer", "get_proc_name_with_rank",
    ],
    "forge_obs.metrics": [
        "BackendRole", "LoggingMode", "Reduce", "Metric", "record_metric", "reduce_metrics_states",
        "MetricAccumulator", "MeanAccumulator", "SumAccumulator", "MaxAccumulator", "MinAccumulator",
        "StdAccumulator", "MetricCollector", "LoggerBackend", "ConsoleBackend", "WandbBackend",
        "get_logger_backend_class", "get_proc_name_with_rank", "current_rank",
    ],
    "forge_obs.metric_actors": ["get_or_create_metric_logger", "GlobalLoggingActor", "LocalFetcherActor"],
    "forge_obs.perf_tracker": ["Tracer", "trace", "_TimerCPU", "_TimerCUDA", "record_metric", "Reduce"],
    "forge_obs.utils": ["get_proc_name_with_rank"],
    "forge_obs.env": ["DISABLE_PERF_METRICS", "METRIC_TIMER_USES_GPU", "FORGE_DISABLE_METRICS", "EnvVar"],
}


@pytest.mark.parametrize("module", sorted(TORCHFORGE_NAMES))
def test_every_torchforge_name_imports_from_the_renamed_module(module):
    mod = importlib.import_module(module)
    missing = [n for n in TORCHFORGE_NAMES[module] if not hasattr(mod, n)]
    assert missing == []


def test_compat_modules_are_our_implementation_and_import_no_monarch():
    """The submodules re-export forge_obs's own objects (no second implementation), and
    importing them (the recording side) pulls in neither Monarch nor torch."""
    code = (
        "import sys, forge_obs, forge_obs.metrics as m, forge_obs.perf_tracker as pt, forge_obs.utils, forge_obs.env\n"
        "from forge_obs.recording.collector import record_metric\n"
        "from forge_obs.recording.tracer import Tracer\n"
        "assert m.record_metric is forge_obs.record_metric is record_metric\n"
        "assert pt.Tracer is Tracer and m.MetricCollector is forge_obs.MetricCollector\n"
        "print(sorted(k for k in ('monarch', 'torch') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=CHILD_PATH),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ============================================================ 1: BackendRole, get_proc_name_with_rank
def test_backend_role_is_torchforge_enum():
    from forge_obs.metrics import BackendRole

    assert (BackendRole.LOCAL.value, BackendRole.GLOBAL.value) == ("local", "global")
    assert BackendRole("global") is BackendRole.GLOBAL and BackendRole.GLOBAL == "global"


class NameActor(Actor):
    @endpoint
    async def names(self) -> tuple:
        from forge_obs.utils import get_proc_name_with_rank

        return get_proc_name_with_rank(), get_proc_name_with_rank("Trainer")


async def test_get_proc_name_with_rank_in_the_client_and_in_actors():
    from forge_obs import get_proc_name_with_rank

    assert get_proc_name_with_rank() == "client_r0"
    assert get_proc_name_with_rank(proc_name="MyProcess") == "MyProcess_r0"
    pm = this_host().spawn_procs(per_host={"procs": 2})
    try:
        got = sorted(v for _p, v in (await pm.spawn("names_abc123", NameActor).names.call()).items())
        assert got == [("names_abc123_r0", "Trainer_abc123_r0"), ("names_abc123_r1", "Trainer_abc123_r1")]
    finally:
        await pm.stop()


# ============================================================ 2, 11: backends
STEPS: dict[str, list] = {}  # backend name -> [(event, ...)], filled on the controller's backend threads
_lock = threading.Lock()


def _note(name: str, *event) -> None:
    with _lock:
        STEPS.setdefault(name, []).append(event)


class TorchforgeStyleBackend(LoggerBackend):
    """A custom backend written for torchforge: keyword-only constructor, async hooks, float(v)."""

    def __init__(self, *, logging_mode, per_rank_share_run=False, **kwargs) -> None:
        super().__init__(logging_mode=logging_mode, per_rank_share_run=per_rank_share_run, **kwargs)
        self.name = kwargs.get("label", "tf")

    async def init(self, role, controller_logger_metadata=None, process_name=None) -> None:
        _note(self.name, "init", role, self.logging_mode, self.backend_kwargs)

    async def log_batch(self, metrics, global_step, *args, **kwargs) -> None:
        _note(self.name, "batch", global_step, {m.key: float(m.value) for m in metrics})

    def log_stream(self, metric, global_step, *args, **kwargs) -> None:
        _note(self.name, "stream", global_step, metric.key, float(metric.value), kwargs.get("source"))

    async def finish(self) -> None:
        _note(self.name, "finish")


register_backend("tf_style", TorchforgeStyleBackend)
register_backend("tf_style_b", TorchforgeStyleBackend)


async def test_builtin_backends_construct_and_await_like_torchforge(capsys):
    from forge_obs.metrics import BackendRole, ConsoleBackend, LoggingMode, Metric, WandbBackend

    console = ConsoleBackend(logging_mode=LoggingMode.GLOBAL_REDUCE)
    await console.init(role=BackendRole.LOCAL)
    await console.log_batch([Metric("loss", 0.25, Reduce.MEAN)], global_step=3)
    await console.finish()
    assert "=== [GlobalReduce] - METRICS STEP 3 ===\nloss: 0.25" in capsys.readouterr().out
    assert console.logging_mode is LoggingMode.GLOBAL_REDUCE and console.backend_kwargs == {}

    wb = WandbBackend(logging_mode=LoggingMode.PER_RANK_REDUCE, project="p", group="g")
    assert wb.backend_kwargs == {"project": "p", "group": "g"} and wb.per_rank_share_run is False
    assert wb.per_rank == "runs"  # torchforge's default for per-rank modes: one run per rank
    assert wb.get_metadata_for_secondary_ranks() == {}
    with mock.patch.object(wb, "_init_global") as init_global:
        await wb.init(role=BackendRole.LOCAL)  # every rank is logged from the controller: no run
        init_global.assert_not_called()
        await wb.init(role=BackendRole.GLOBAL)
        init_global.assert_called_once()
    # our config dict still works, with our default (one W&B run, per-rank values as keys)
    assert WandbBackend({"project": "p", "logging_mode": "per_rank_reduce"}).per_rank == "keys"
    with pytest.raises(ValueError, match="Unknown logger backend type"):
        from forge_obs.metrics import get_logger_backend_class

        get_logger_backend_class("invalid_backend")


class Spans(Actor):
    @endpoint
    async def work(self, step: int) -> None:
        from forge_obs import trace

        record_metric("w/sum", 1.0 + step, Reduce.SUM)
        record_metric("w/hist", 0.5, "distribution")
        with trace("w/region"):
            pass


async def test_a_torchforge_style_custom_backend_gets_plain_scalars(tmp_path):
    """A backend written for torchforge, named in init_backends: instantiated with keywords,
    initialised with role=GLOBAL, handed plain floats (distributions as /p50 /p90 /p99 keys, no
    dicts) and, with show_obs False, no obs/ keys; finished at shutdown."""
    STEPS.clear()
    mlogger = await start_logger(tmp_path, {
        "tf_style": {"logging_mode": "global_reduce", "project": "x", "label": "g"},
        "tf_style_b": {"logging_mode": "global_reduce", "label": "quiet", "show_obs": False},
    })
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="w")
    try:
        actors = pm.spawn("Spans", Spans)
        await actors.work.call(0)
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    ev = STEPS["g"]
    assert ev[0][0] == "init" and ev[0][1] == "global" and ev[0][2].value == "global_reduce"
    assert ev[0][3] == {"project": "x", "label": "g"}
    batch = next(e[2] for e in ev if e[0] == "batch" and e[1] == 0)
    assert batch["w/sum"] == 2.0 and batch["w/hist/p50"] == pytest.approx(0.5, rel=0.01)
    assert {"w/hist/p90", "w/hist/p99", "w/region/total_duration_dist_s/p50", "w/region/total_duration_avg_s"} <= set(batch)
    assert any(k.startswith("obs/") for k in batch)
    assert ev[-1] == ("finish",)
    quiet = next(e[2] for e in STEPS["quiet"] if e[0] == "batch" and e[1] == 0)
    assert quiet["w/sum"] == 2.0 and not any(k.startswith("obs/") for k in quiet)


# ============================================================ 3, 4: states and reduce_metrics_states
def test_accumulator_states_carry_torchforge_fields_and_reduce_either_way():
    from forge_obs.metrics import MaxAccumulator, MinAccumulator, StdAccumulator, SumAccumulator, reduce_metrics_states

    accs = {}
    for cls, red in ((SumAccumulator, Reduce.SUM), (MaxAccumulator, Reduce.MAX), (MinAccumulator, Reduce.MIN),
                     (StdAccumulator, Reduce.STD)):
        a = cls(red)
        for v in (5.0, 7.0, 3.0):
            a.append(v)
        accs[red] = a.get_state()
    assert accs[Reduce.SUM]["total"] == 15.0 and accs[Reduce.MAX]["max_val"] == 7.0 and accs[Reduce.MIN]["min_val"] == 3.0
    std = accs[Reduce.STD]
    assert (std["sum"], std["sum_sq"], std["count"]) == (15.0, pytest.approx(83.0), 3)
    # torchforge's states (only its fields) from one rank, ours from another: merged exactly
    theirs = {"s": {"reduction_type": "sum", "total": 10.0}, "mx": {"reduction_type": "max", "max_val": 9.0},
              "mn": {"reduction_type": "min", "min_val": -1.0},
              "sd": {"reduction_type": "std", "sum": 3.0, "sum_sq": 5.0, "count": 2}}  # values 1, 2
    ours = {"s": accs[Reduce.SUM], "mx": accs[Reduce.MAX], "mn": accs[Reduce.MIN], "sd": accs[Reduce.STD]}
    got = {m.key: m.value for m in reduce_metrics_states([theirs, ours])}
    xs = [1.0, 2.0, 5.0, 7.0, 3.0]
    mean = sum(xs) / len(xs)
    assert got["s"] == 25.0 and got["mx"] == 9.0 and got["mn"] == -1.0
    assert got["sd"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)))


def test_reduce_metrics_states_raises_on_mismatched_reductions():
    from forge_obs.metrics import reduce_metrics_states

    states = [{"loss": {"reduction_type": "mean", "sum": 1.0, "count": 1}}, {"loss": {"reduction_type": "sum", "total": 2.0}}]
    with pytest.raises(ValueError, match="Mismatched reduction types for key 'loss'"):
        reduce_metrics_states(states)
    seen = []
    assert reduce_metrics_states(states, on_conflict=lambda k, rs: seen.append((k, sorted(rs)))) == []
    assert seen == [("loss", ["mean", "sum"])]


# ============================================================ 5: register/deregister, init_backends again
async def test_init_backends_again_hands_over_to_the_new_backends_in_the_same_run(tmp_path):
    STEPS.clear()
    mlogger = await start_logger(tmp_path, {"tf_style": {"logging_mode": "global_reduce", "label": "first"}})
    record_metric("again/x", 1.0, Reduce.SUM)
    await mlogger.flush.call_one(0)
    record_metric("again/x", 2.0, Reduce.SUM)  # after the last flush: for the next step
    await mlogger.init_backends.call_one({"tf_style": {"logging_mode": "global_reduce", "label": "second"}})
    await mlogger.flush.call_one(1)
    await mlogger.shutdown.call_one()
    first = [e for e in STEPS["first"] if e[0] in ("batch", "finish")]
    assert [(e[0], e[1] if e[0] == "batch" else None) for e in first] == [("batch", 0), ("finish", None)]
    assert first[0][2]["again/x"] == 1.0
    second = [e for e in STEPS["second"] if e[0] == "batch"]
    assert [(e[1], e[2]["again/x"]) for e in second] == [(1, 2.0)]
    rows = global_rows(tmp_path)  # one run: both sessions' steps in the same store
    assert rows[0]["metrics"]["again/x"] == 1.0 and rows[1]["metrics"]["again/x"] == 2.0


class Worker(Actor):
    @endpoint
    async def rec(self, v: float) -> None:
        record_metric("tf/v", v, Reduce.SUM)


async def test_a_fetcher_spawned_and_registered_the_torchforge_way_is_cut_exactly(tmp_path):
    """torchforge's get_or_create_metric_logger(proc_mesh, process_name) does this by hand:
    LocalFetcherActor(global_logger, process_name) on the mesh, then register_fetcher. The mesh
    then takes part in every flush (each value in its step), its fetcher's flush(step,
    return_state=True) returns torchforge states, and deregister_fetcher hands over what was
    recorded since the last flush."""
    from forge_obs import LocalFetcherActor, get_or_create_metric_logger

    provisioner_hooks.uninstall()  # only the fetcher spawned by hand
    MetricCollector().reset()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "t"}, "jsonl": {
        "logging_mode": ["global_reduce", "per_rank_reduce"]}})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="tf")
    try:
        fetcher = pm.spawn("local_fetcher_actor", LocalFetcherActor, mlogger, "TrainActor")
        before = await mlogger.get_fetcher_count.call_one()
        await mlogger.register_fetcher.call_one(fetcher, "tf-proc")
        assert await mlogger.has_fetcher.call_one("tf-proc")
        assert await mlogger.get_fetcher_count.call_one() == before + 1
        w = pm.spawn("Worker", Worker)
        for s in range(3):
            await w.rec.call(float(s + 1))
            await mlogger.flush.call_one(s)
        await w.rec.call(10.0)
        states = [st for _p, st in (await fetcher.flush.call(3, return_state=True)).items()]
        assert [st["tf/v"]["total"] for st in states] == [10.0, 10.0] and states[0]["tf/v"]["reduction_type"] == "sum"
        await mlogger.flush.call_one(3)  # the caller took those values: not in step 3
        await w.rec.call(7.0)
        await mlogger.deregister_fetcher.call_one("tf-proc")
        assert not await mlogger.has_fetcher.call_one("tf-proc")
        assert await mlogger.get_fetcher_count.call_one() == before
        await mlogger.flush.call_one(4)  # what it recorded before deregistering
        await w.rec.call(1.0)
        await mlogger.flush.call_one(5)  # not observed any more, not waited for
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    rows = global_rows(tmp_path)
    assert [rows[s]["metrics"].get("tf/v") for s in range(6)] == [2.0, 4.0, 6.0, None, 14.0, None]
    assert all(rows[s]["metrics"]["obs/missing_ranks"] == 0 for s in range(6))
    labels = {r["source"]["label"] for r in read_metrics(tmp_path / "t", "per_rank_reduce") if "tf/v" in r["metrics"]}
    assert labels == {"TrainActor/r0", "TrainActor/r1"}


async def test_get_or_create_with_a_mesh_marks_it_like_torchforge(tmp_path, monkeypatch):
    from forge_obs import get_or_create_metric_logger

    provisioner_hooks.uninstall()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    pm = this_host().spawn_procs(per_host={"procs": 1})
    off = this_host().spawn_procs(per_host={"procs": 1})
    try:
        await get_or_create_metric_logger(proc_mesh=pm, process_name="P")
        assert pm._local_fetcher is not None and await mlogger.has_fetcher.call_one(pm._uid)
        monkeypatch.setenv("FORGE_DISABLE_METRICS", "true")  # read at the call, as torchforge does
        await get_or_create_metric_logger(proc_mesh=off, process_name="Off")
        assert not hasattr(off, "_local_fetcher") and not hasattr(off, "_uid")
    finally:
        await pm.stop()
        await off.stop()


# ============================================================ 7: Tracer misuse
def test_tracer_misuse_raises_value_error():
    from forge_obs.perf_tracker import Tracer, trace

    t = Tracer("tf/misuse")
    for call in (lambda: t.step("x"), t.stop):
        with pytest.raises(ValueError, match="must be started"):
            call()
    t.start()
    with pytest.raises(ValueError, match="already been started"):
        t.start()
    t.stop()
    for bad in (lambda: Tracer("x", timer="tpu"), lambda: trace("x", timer="tpu")):
        with pytest.raises(ValueError, match='timer must be "cpu" or "gpu"'):
            bad()


# ============================================================ 8: collector
async def test_collector_flush_is_awaitable_and_keeps_values_before_init(fresh_collector, caplog):
    c = MetricCollector()
    assert MetricCollector._instances[0] is c
    c.initialized = False
    record_metric("col/x", 2.0, Reduce.SUM)
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        assert await c.flush(global_step=0, return_state=True) == {}
    assert "Cannot flush collected metrics" in caplog.text
    c.initialized = True
    assert await c.flush(global_step=1) == {}  # return_state=False: left for the cut
    states = await c.flush(global_step=1, return_state=True)
    assert states["col/x"]["total"] == 2.0 and c.global_step == 2
    assert await c.flush(global_step=2, return_state=True) == {}


def test_instances_clear_starts_from_an_empty_collector(fresh_collector):
    record_metric("inst/x", 1.0)
    MetricCollector._instances.clear()
    assert MetricCollector._instances == {}
    c = MetricCollector()
    assert MetricCollector._instances == {0: c} and c.snapshot()["states"] == {}


# ============================================================ patch points torchforge's tests use
def test_patching_metrics_collector_and_current_rank_takes_effect(fresh_collector, monkeypatch):
    import forge_obs.metrics as metrics
    from forge_obs.metrics import Metric

    fake = mock.MagicMock()
    with mock.patch("forge_obs.metrics.MetricCollector", return_value=fake):
        metrics.record_metric("p/loss", 1.5, Reduce.MEAN)
        pushed = fake.push.call_args[0][0]
        assert isinstance(pushed, Metric) and (pushed.key, pushed.value, pushed.reduction) == ("p/loss", 1.5, Reduce.MEAN)
        monkeypatch.setenv("FORGE_DISABLE_METRICS", "true")  # read per call while patched
        metrics.record_metric("p/loss", 2.0)
        assert fake.push.call_count == 1
        monkeypatch.delenv("FORGE_DISABLE_METRICS")
    record_metric("p/real", 3.0, Reduce.SUM)  # restored: the collector again
    assert fresh_collector.snapshot()["states"]["p/real"]["total"] == 3.0 and fake.push.call_count == 1
    with mock.patch("forge_obs.metrics.current_rank") as rank:
        rank.return_value.rank = 1
        other = MetricCollector()
        rank.return_value.rank = 0
        assert other is not MetricCollector() is fresh_collector and MetricCollector._instances[1] is other
    assert MetricCollector() is fresh_collector


def test_patching_perf_tracker_record_metric_reroutes_the_tracer(fresh_collector, monkeypatch):
    from forge_obs.perf_tracker import Tracer, trace

    calls = []
    monkeypatch.setattr("forge_obs.perf_tracker.record_metric", lambda k, v, r: calls.append((k, r)))

    @trace("pt/deco")
    def f():
        return 1

    f()
    t = Tracer("pt/t")
    t.start()
    t.step("a")
    t.stop()
    assert sorted(calls) == sorted([
        ("pt/deco/total_duration_avg_s", Reduce.MEAN), ("pt/deco/total_duration_max_s", Reduce.MAX),
        ("pt/t/a/duration_avg_s", Reduce.MEAN), ("pt/t/a/duration_max_s", Reduce.MAX),
        ("pt/t/total_duration_avg_s", Reduce.MEAN), ("pt/t/total_duration_max_s", Reduce.MAX)])
    st = fresh_collector.snapshot()["states"]  # forge_obs's own distribution keys still recorded
    assert set(st) == {"pt/deco/total_duration_dist_s", "pt/t/a/duration_dist_s", "pt/t/total_duration_dist_s"}
    monkeypatch.undo()
    f()
    assert len(calls) == 6 and "pt/deco/total_duration_avg_s" in fresh_collector.snapshot()["states"]


# ============================================================ 9: environment
def test_perf_env_vars_are_read_when_a_tracer_is_created(fresh_collector, monkeypatch):
    from forge_obs.env import DISABLE_PERF_METRICS, METRIC_TIMER_USES_GPU
    from forge_obs.perf_tracker import Tracer, _TimerCPU, trace

    monkeypatch.setenv(DISABLE_PERF_METRICS.name, "true")
    assert DISABLE_PERF_METRICS.get_value() is True
    t = Tracer("env/off")
    t.step("x")  # disabled: no-op, no ValueError
    t.start()
    t.stop()

    @trace("env/deco_off")
    def f():
        return 2

    assert f() == 2 and fresh_collector.snapshot()["states"] == {}
    monkeypatch.delenv(DISABLE_PERF_METRICS.name)
    monkeypatch.setenv(METRIC_TIMER_USES_GPU.name, "false")
    with mock.patch("torch.cuda.is_available", return_value=True):
        t = Tracer("env/gpu", timer="gpu")
        t.start()
        assert isinstance(t._timer, _TimerCPU)
        t.stop()
    assert "env/gpu/total_duration_avg_s" in fresh_collector.snapshot()["states"]


def test_set_enabled_is_the_run_time_switch(fresh_collector):
    import forge_obs

    forge_obs.set_enabled(False)
    try:
        record_metric("en/x", 1.0)
        with forge_obs.trace("en/t"):
            pass
        assert not forge_obs.is_enabled()
    finally:
        forge_obs.set_enabled(True)
    record_metric("en/y", 1.0)
    assert set(fresh_collector.snapshot()["states"]) == {"en/y"}


def test_forge_disable_metrics_at_import_disables_recording():
    code = (
        "import forge_obs, forge_obs.metrics as m\n"
        "m.record_metric('x', 1.0)\n"
        "print(forge_obs.is_enabled(), forge_obs.MetricCollector().snapshot()['states'])\n"
        "forge_obs.set_enabled(True); m.record_metric('x', 1.0)\n"
        "print(sorted(forge_obs.MetricCollector().snapshot()['states']))\n"
    )
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, FORGE_DISABLE_METRICS="true")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False {}", "['x']"]


# ============================================================ 10: await mlogger.flush(global_step=...)
class Flusher(Actor):
    @endpoint
    async def flush_from_here(self, mlogger, step: int) -> None:
        record_metric("flush/child", 1.0, Reduce.SUM)
        await mlogger.flush(global_step=step)


async def test_mlogger_flush_is_callable_as_in_torchforge_readme(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    record_metric("flush/x", 1.0, Reduce.SUM)
    await mlogger.flush(global_step=0)  # in the controller process
    pm = this_host().spawn_procs(per_host={"procs": 1}, name="flusher")
    try:
        await pm.spawn("Flusher", Flusher).flush_from_here.call_one(mlogger, 1)  # from another process
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    rows = global_rows(tmp_path)
    assert rows[0]["metrics"]["flush/x"] == 1.0 and rows[1]["metrics"]["flush/child"] == 1.0


# ============================================================ 12: per_rank_no_reduce streams between flushes
class Streamer(Actor):
    @endpoint
    async def rec(self, v: float) -> None:
        record_metric("stream/v", v, Reduce.SUM)


def _streamed(name: str, key: str) -> list:
    with _lock:
        return [e for e in STEPS.get(name, []) if e[0] == "stream" and e[2] == key]  # (stream, step, key, value, source)


async def _wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting: {STEPS}"
        await asyncio.sleep(0.01)


async def test_per_rank_no_reduce_streams_before_the_flush_exactly_once(tmp_path):
    """Raw values reach a per_rank_no_reduce backend within stream_interval_s of being recorded,
    without a flush, under the predicted step (last flushed + 1); each value exactly once; a
    flush whose step is not the predicted one counts the values streamed under the prediction."""
    STEPS.clear()
    mlogger = await start_logger(tmp_path, {
        "tf_style": {"logging_mode": "per_rank_no_reduce", "label": "s"},
        "jsonl": {"logging_mode": ["global_reduce", "per_rank_no_reduce"]},
        "stream_interval_s": 0.1,
    })
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="st")
    try:
        actors = pm.spawn("Streamer", Streamer)
        await mlogger.flush.call_one(0)
        await actors.rec.call(1.0)
        record_metric("stream/v", 1.0, Reduce.SUM)  # the controller's own value streams too
        await _wait_for(lambda: len(_streamed("s", "stream/v")) == 3)  # no flush yet
        early = _streamed("s", "stream/v")
        assert {(e[1], e[3]) for e in early} == {(1, 1.0)}  # predicted step 1
        assert {e[4] for e in early} == {"st/Streamer/r0", "st/Streamer/r1", "Controller"}
        await actors.rec.call(2.0)
        await mlogger.flush.call_one(1)  # taken by the cut, if not streamed yet
        await actors.rec.call(3.0)
        await _wait_for(lambda: len(_streamed("s", "stream/v")) >= 7)
        await mlogger.flush.call_one(5)  # not the predicted step 2: counted
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    values = sorted((e[3], e[1]) for e in _streamed("s", "stream/v"))
    assert values == [(1.0, 1)] * 3 + [(2.0, 1)] * 2 + [(3.0, 2)] * 2  # each value once, in its step
    store = sorted((v, r["step"]) for r in read_metrics(tmp_path / "t", "per_rank_no_reduce")
                   for k, v, _ts in r["values"] if k == "stream/v")
    assert store == values
    rows = global_rows(tmp_path)
    assert rows[1]["metrics"]["obs/stream_step_mismatch"] == 0
    assert rows[5]["metrics"]["obs/stream_step_mismatch"] == 2


# ============================================================ the migration guide
def test_migration_guide_example_runs_as_torchforge_prints_it(tmp_path):
    """docs/migrating-from-torchforge.md's example (torchforge's README example, renamed) runs and
    prints what the guide says."""
    from tests.project.test_readme import blocks

    (block,) = [b for b in blocks(ROOT / "docs" / "migrating-from-torchforge.md") if b["lang"] == "python"]
    assert "forge.observability" not in block["body"] and "from forge_obs import" in block["body"]
    script = tmp_path / "example.py"
    script.write_text(block["body"])
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, MONARCH_FILE_LOG="error")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "=== [GlobalReduce] - METRICS STEP 0 ===\nmy_max_metric:  3\nmy_mean_metric: 2\nmy_sum_metric:  6" in res.stdout


class StepOnly(LoggerBackend):
    """A backend that implements only log_step (reads record.raw itself)."""

    def log_step(self, record):
        _note("step_only", "step", record.step, sorted((lb, k, v) for lb, rows in record.raw.items() for k, v, _t in rows))


register_backend("step_only", StepOnly)


async def test_a_log_step_only_backend_gets_streamed_values_with_the_next_step(tmp_path):
    """Streamed raw values reach a backend that only implements log_step in record.raw of the
    next step (each once), and at shutdown in a record of their own."""
    STEPS.clear()
    mlogger = await start_logger(tmp_path, {
        "step_only": {"logging_mode": "per_rank_no_reduce"},
        "tf_style": {"logging_mode": "per_rank_no_reduce", "label": "s"},
        "stream_interval_s": 0.05,
    })
    await mlogger.flush.call_one(0)
    record_metric("so/v", 1.0, Reduce.SUM)
    await _wait_for(lambda: len(_streamed("s", "so/v")) == 1)  # streamed (to the other backend)
    record_metric("so/v", 2.0, Reduce.SUM)
    await mlogger.flush.call_one(1)
    record_metric("so/v", 3.0, Reduce.SUM)
    await _wait_for(lambda: len(_streamed("s", "so/v")) == 3)
    await mlogger.shutdown.call_one()
    got = [(e[1], [x for x in e[2] if x[1] == "so/v"]) for e in STEPS["step_only"]]
    assert [(s, [v for _lb, _k, v in xs]) for s, xs in got if xs] == [(1, [1.0, 2.0]), (2, [3.0])]
