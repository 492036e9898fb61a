"""The whole pipeline on real Monarch proc meshes: doc examples, modes, exactness, dead and hung
ranks, automatic attachment, config errors."""

import asyncio
import os
import signal
import threading
import time

import pytest
from monarch.actor import Actor, current_rank, endpoint, this_host

import provisioner_hooks
from forge_obs import LoggerBackend, MetricAccumulator, Reduce, get_or_create_metric_logger, record_metric, register_backend, register_reduction
from tests.support.helpers import aggregating, global_rows, rank_rows, start_logger, stop_process, until_answered


class MyActor(Actor):
    """The actor of the Forge metric-logging doc."""

    @endpoint
    async def my_fn(self):
        rank = current_rank().rank
        record_metric("my_sum_rank_metric", rank, Reduce.SUM)


async def _two_replicas():
    meshes = [this_host().spawn_procs(per_host={"procs": 2}, name=f"replica{i}") for i in range(2)]
    return meshes, [m.spawn("MyActor", MyActor) for m in meshes]


async def _stop(*meshes):
    for m in meshes:
        try:
            await m.stop()
        except Exception:  # noqa: BLE001 - a mesh with a dead process may fail to stop cleanly
            pass


async def test_forge_doc_examples_in_all_three_modes(tmp_path, capsys):
    mlogger = await start_logger(
        tmp_path,
        {
            "console": {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]},
            "jsonl": {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]},
        },
    )
    # 1.1: one process
    for number in range(1, 4):
        record_metric("my_sum_metric", number, Reduce.SUM)
        record_metric("my_max_metric", number, Reduce.MAX)
        record_metric("my_mean_metric", number, Reduce.MEAN)
    await mlogger.flush.call_one(global_step=0)
    # 2: an actor on 2 replicas x 2 procs, called twice
    meshes, actors = await _two_replicas()
    for _ in range(2):
        await asyncio.gather(*(a.my_fn.call() for a in actors))
    await mlogger.flush.call_one(global_step=1)
    await mlogger.shutdown.call_one()
    await _stop(*meshes)

    out = capsys.readouterr().out
    # integral values print as integers (see forge_obs.backends.console)
    assert "=== [GlobalReduce] - METRICS STEP 0 ===\nmy_max_metric:  3\nmy_mean_metric: 2\nmy_sum_metric:  6" in out
    assert "=== [GlobalReduce] - METRICS STEP 1 ===\nmy_sum_rank_metric: 4" in out
    blocks = {lbl: v for lbl, v in _per_rank_blocks(out, step=1)}
    assert blocks == {
        "replica0/MyActor/r0": 0.0,
        "replica0/MyActor/r1": 2.0,
        "replica1/MyActor/r0": 0.0,
        "replica1/MyActor/r1": 2.0,
    }
    raw_lines = [ln for ln in out.splitlines() if "INFO my_sum_rank_metric" in ln]
    assert sorted(ln.split("] ")[0] + "]" + ln.rsplit(":", 1)[1] for ln in raw_lines) == sorted(
        [f"[replica{i}/MyActor/r{r}] {r}" for i in range(2) for r in (0, 1) for _ in range(2)]
    )
    # the JSONL store has the same three views, with identity fields
    g = global_rows(tmp_path)
    assert g[1]["metrics"]["my_sum_rank_metric"] == 4.0
    ranks = [r for r in rank_rows(tmp_path) if r["step"] == 1 and r["source"]["mesh"].startswith("replica")]
    assert sorted((r["source"]["mesh"], r["source"]["rank"], r["metrics"]["my_sum_rank_metric"]) for r in ranks) == [
        ("replica0", 0, 0.0), ("replica0", 1, 2.0), ("replica1", 0, 0.0), ("replica1", 1, 2.0)]
    assert all(r["source"]["pid"] != os.getpid() and r["source"]["host"] for r in ranks)


def _per_rank_blocks(out, step):
    lines = out.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("=== [replica") and ln.endswith(f"METRICS STEP {step} ==="):
            label = ln[len("=== ["): ln.index("]")]
            yield label, float(lines[i + 1].split(":")[1])


class Gate(LoggerBackend):
    """A backend that blocks until the test opens the gate (to prove flush does not wait)."""

    gate = threading.Event()
    steps: list = []

    def log_step(self, record):
        Gate.gate.wait(60)
        Gate.steps.append(record.step)


register_backend("test_gate", Gate)


async def test_flush_returns_while_backends_are_still_busy(tmp_path):
    Gate.gate.clear()
    Gate.steps = []
    mlogger = await start_logger(tmp_path, {"test_gate": {}})
    for step in range(3):
        record_metric("x", step, Reduce.SUM)
        await mlogger.flush.call_one(step)  # returns although the backend is blocked
    assert Gate.steps == []
    Gate.gate.set()
    await mlogger.shutdown.call_one()  # drains every pending step, in order
    assert Gate.steps == [0, 1, 2]
    assert [global_rows(tmp_path)[s]["metrics"]["x"] for s in range(3)] == [0.0, 1.0, 2.0]


class Spammer(Actor):
    @endpoint
    async def spam(self, n_threads: int, n_tasks: int, per_worker: int) -> int:
        def work():
            for _ in range(per_worker):
                record_metric("exact/n", 1, Reduce.SUM)

        ts = [threading.Thread(target=work) for _ in range(n_threads)]
        for t in ts:
            t.start()

        async def task():
            for i in range(per_worker):
                record_metric("exact/n", 1, Reduce.SUM)
                if i % 500 == 0:
                    await asyncio.sleep(0)

        await asyncio.gather(*(task() for _ in range(n_tasks)))
        await asyncio.get_running_loop().run_in_executor(None, lambda: [t.join() for t in ts])
        return (n_threads + n_tasks) * per_worker


async def test_a_million_values_from_threads_tasks_and_processes_lose_nothing(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    meshes = [this_host().spawn_procs(per_host={"procs": 2}, name=f"spam{i}") for i in range(2)]
    actors = [m.spawn("Spammer", Spammer) for m in meshes]
    # 4 processes x (2 threads + 2 asyncio tasks) x 62,500 = 1,000,000 values
    work = [asyncio.ensure_future(a.spam.call(2, 2, 62_500)) for a in actors]
    step = 0
    while not all(w.done() for w in work):  # flush continuously while values are being recorded
        await mlogger.flush.call_one(step)
        step += 1
        await asyncio.wait(work, timeout=0.05)
    sent = sum(v for w in work for _, v in w.result().items())
    await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    await _stop(*meshes)
    rows = global_rows(tmp_path)
    got = sum(r["metrics"].get("exact/n", 0.0) for r in rows.values())
    assert sent == 1_000_000
    assert got == 1_000_000, (got, len(rows))
    assert len([r for r in rows.values() if r["metrics"].get("exact/n")]) > 1  # really spread over steps
    assert sum(r["metrics"]["obs/values_recorded"] for r in rows.values()) >= 1_000_000
    # forge_obs's own CPU (exports on 4 ranks, the controller's flushes, merges and backends)
    cpu = [r["metrics"]["obs/cpu_s"] for r in rows.values()]
    assert sum(cpu) > 0 and all(0 <= c < 5.0 for c in cpu), cpu


class Fragile(Actor):
    @endpoint
    async def record(self, value: float) -> None:
        record_metric("fragile/v", value, Reduce.SUM)

    @endpoint
    async def die_if(self, rank: int) -> None:
        if current_rank().rank == rank:
            os._exit(1)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def test_dead_rank_costs_one_timeout_and_is_reported(tmp_path):
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 2.0})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="fragile")
    a = pm.spawn("Fragile", Fragile)
    await a.record.call(1.0)
    await mlogger.flush.call_one(0)
    await mlogger.wait_idle.call_one()
    pid1 = await a.slice(procs=1).pid.call_one()
    a.die_if.broadcast(1)
    while _alive(pid1):  # wait for the death itself, not a guessed delay
        await asyncio.sleep(0.02)
    await a.slice(procs=0).record.call_one(1.0)
    t0 = time.monotonic()
    await mlogger.flush.call_one(1)
    await mlogger.wait_idle.call_one()
    waited_s = time.monotonic() - t0
    await mlogger.flush.call_one(2)
    await mlogger.shutdown.call_one()
    await _stop(pm)
    rows = global_rows(tmp_path)
    assert rows[0]["metrics"]["fragile/v"] == 2.0 and rows[0]["metrics"]["obs/missing_ranks"] == 0
    assert "fragile/Fragile/r1" in rows[1]["missing"]
    assert waited_s < 2.0 + 3.0  # one flush timeout, not a hang
    # with aggregation rank 1 led the pair: rank 0, asked to resend its answer directly, keeps its step
    assert rows[1]["metrics"]["fragile/v"] == 1.0  # the survivor's value is logged
    assert rows[1]["metrics"]["obs/missing_ranks"] == 1
    assert rows[1]["missing"] == ["fragile/Fragile/r1"]
    if aggregating():
        assert rows[2]["missing"] == ["fragile/Fragile/r1"]
        assert rows[2]["metrics"]["obs/bundles"] >= 1  # rank 0 now leads (the aggregated route)


async def test_hung_rank_is_reported_and_its_values_arrive_late_not_lost(tmp_path):
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 2.0})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="hung")
    a = pm.spawn("Fragile", Fragile)
    # every rank's fetcher is up and answered a cut (a rank hung while its mesh starts: the
    # next test): step 1 is the first one a rank hangs in
    await mlogger.flush.call_one(0)
    await mlogger.wait_idle.call_one()
    await a.record.call(1.0)  # both ranks: 1.0 each
    pid1 = await a.slice(procs=1).pid.call_one()
    stop_process(pid1)  # rank 1 hangs: its fetcher cannot answer
    try:
        t0 = time.monotonic()
        await mlogger.flush.call_one(1)
        await mlogger.wait_idle.call_one()
        waited_s = time.monotonic() - t0
    finally:
        os.kill(pid1, signal.SIGCONT)
    await a.slice(procs=1).pid.call_one()  # rank 1 is back
    await until_answered("hung/Fragile/r1")  # and its late answer to the old flush was taken
    await mlogger.flush.call_one(2)
    await mlogger.shutdown.call_one()
    await _stop(pm)
    rows = global_rows(tmp_path)
    assert rows[0]["metrics"]["obs/missing_ranks"] == 0
    assert 2.0 <= waited_s < 2.0 + 3.0  # one flush timeout
    # with aggregation rank 1 led the pair: rank 0, asked to resend its answer directly, keeps its step
    assert rows[1]["missing"] == ["hung/Fragile/r1"]
    assert rows[1]["metrics"]["obs/missing_ranks"] == 1
    assert rows[1]["metrics"]["fragile/v"] == 1.0
    total = sum(r["metrics"].get("fragile/v", 0.0) for r in rows.values())
    assert total == 2.0  # rank 1's value arrived late and was logged with a later step, once
    assert rows[2]["metrics"]["obs/missing_ranks"] == 0


class _HeldCasts:
    """A mesh's fetchers whose cuts by cast are held back, as Monarch holds back a cast to a mesh
    until every one of its ranks spawned its fetcher (a rank hung while its mesh starts); a real
    hang cannot be timed into that window reliably. ``release()`` delivers them."""

    def __init__(self, fetchers: object) -> None:
        self.fetchers = fetchers
        self.held: list[tuple] = []

    def __getattr__(self, name: str) -> object:
        if name == "cut":
            return type("HeldCut", (), {"broadcast": staticmethod(lambda *args: self.held.append(args))})()
        return getattr(self.fetchers, name)

    def release(self) -> None:
        for args in self.held:
            self.fetchers.cut.broadcast(*args)


async def test_a_rank_still_starting_does_not_hold_back_the_others_cut(tmp_path):
    """Rank 1 is not connected to the inbox socket yet and a cast to the mesh is held back: rank
    0, connected, takes the cut on the socket and keeps its step; rank 1's value comes late, once."""
    from forge_obs.controller.registry import LOCAL_MESHES
    from forge_obs.controller.state import CONTROLLER

    if aggregating():
        pytest.skip("the aggregated route's cuts (with their plan) go by cast only")
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 1.0})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="starting")
    a = pm.spawn("Fragile", Fragile)
    await a.record.call(1.0)
    (e,) = [x for x in LOCAL_MESHES.entries() if x.name == "starting"]
    local = CONTROLLER.local
    deadline = time.monotonic() + 30
    while not local.named(e.rank_keys()):  # both fetchers are up; rank 1's connection is then hidden
        assert time.monotonic() < deadline, "the fetchers did not connect"
        await asyncio.sleep(0.01)
    conn = local.peers.pop((e.mesh_id, 1))
    fetchers, e.fetchers = e.fetchers, _HeldCasts(e.fetchers)
    try:
        t0 = time.monotonic()
        await mlogger.flush.call_one(0)
        waited_s = time.monotonic() - t0
        await mlogger.wait_idle.call_one()
    finally:
        local.peers[(e.mesh_id, 1)] = conn
        held, e.fetchers = e.fetchers, fetchers
        held.release()  # rank 1 "finished starting": it takes cut 0 late
    await until_answered("starting/Fragile/r1")
    await mlogger.flush.call_one(1)
    await mlogger.shutdown.call_one()
    await _stop(pm)
    rows = global_rows(tmp_path)
    assert rows[0]["missing"] == ["starting/Fragile/r1"]
    assert 1.0 <= waited_s < 1.0 + 3.0  # one flush timeout, for rank 1
    assert held.held and held.held[0][-1] == [1]  # the cast was for rank 1 only
    assert rows[0]["metrics"]["fragile/v"] == 1.0  # rank 0's value, in its step
    assert sum(r["metrics"].get("fragile/v", 0.0) for r in rows.values()) == 2.0  # rank 1's, late, once
    assert rows[1]["metrics"]["obs/missing_ranks"] == 0


class _SlowConfigure:
    """Stands in for a mesh's fetchers whose ``configure`` is delivered late: Monarch cannot be
    made to hold one message back, and a message that reaches a fetcher after its mesh's stop
    stopped it fails the actor that sent it (Monarch 0.7 calls no handler for that)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.taken: list = []
        self.casts: list = []
        outer = self

        class _Endpoint:
            async def call(self, options):
                await asyncio.sleep(outer.delay_s)
                outer.taken.append(options)

            def broadcast(self, *args):
                outer.casts.append(args)

        class _Cut:
            def broadcast(self, *args):
                pass

        self.configure = _Endpoint()
        self.cut = _Cut()


async def test_shutdown_returns_once_every_mesh_took_its_last_message(tmp_path):
    """``shutdown`` then ``proc_mesh.stop()`` (the usual teardown): shutdown's message to the
    meshes (stop streaming, close the timeline) was taken before shutdown returned, so the stop
    cannot overtake it."""
    from forge_obs.controller.registry import LOCAL_MESHES

    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 5.0})
    slow = _SlowConfigure(delay_s=0.5)
    LOCAL_MESHES.add("slow-mesh", "slow", 0, slow)  # no ranks: no cut waits for it
    try:
        await mlogger.flush.call_one(0)
        await mlogger.shutdown.call_one()
        assert slow.taken == [{"streaming": False, "run_dir": None, "timeline": None, "telemetry": False}]
        assert not slow.casts  # no configuration left in flight to it
    finally:
        LOCAL_MESHES.remove("slow-mesh")


def test_no_export_or_resend_request_goes_to_a_stopping_mesh():
    """After ``proc_mesh.stop()`` was called its fetchers hand over what they hold themselves;
    a request cast to them could reach them stopped, which fails its sender."""
    from forge_obs.controller.flush import ask_exports, ask_resend
    from forge_obs.controller.registry import LOCAL_MESHES

    sent = []

    class _Fetchers:
        def __getattr__(self, name):
            return type("E", (), {"broadcast": lambda _self, *args: sent.append((name, args))})()

    LOCAL_MESHES.add("m-live", "live", 1, _Fetchers())
    LOCAL_MESHES.add("m-stopping", "stopping", 1, _Fetchers())
    LOCAL_MESHES.mark_stopping("m-stopping")
    try:
        ask_exports(7, ["m-live", "m-stopping"])
        ask_resend(7, {"m-live": [0], "m-stopping": [0]})
    finally:
        LOCAL_MESHES.remove("m-live")
        LOCAL_MESHES.remove("m-stopping")
    assert sent == [("export", (7,)), ("resend", (7, [0]))]


async def test_values_recorded_before_init_backends_are_kept(tmp_path):
    provisioner_hooks.install()
    from forge_obs.recording.collector import MetricCollector

    MetricCollector().reset()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    record_metric("early", 7, Reduce.SUM)
    await mlogger.flush.call_one(0)  # no backends yet: a warning, values kept
    await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "t"}})
    record_metric("early", 1, Reduce.SUM)
    await mlogger.flush.call_one(1)
    await mlogger.shutdown.call_one()
    assert global_rows(tmp_path)[1]["metrics"]["early"] == 8.0


class Parent(Actor):
    """Spawns its own proc mesh from inside an actor (a grandchild of the controller)."""

    def __init__(self):
        self.meshes = []

    @endpoint
    async def spawn_child(self) -> None:
        pm = this_host().spawn_procs(per_host={"procs": 1}, name="grandchild")
        self.meshes.append(pm)
        await pm.spawn("Leaf", Leaf).record.call()

    @endpoint
    async def stop_children(self) -> None:
        for pm in self.meshes:
            await pm.stop()


class Leaf(Actor):
    @endpoint
    async def record(self) -> None:
        record_metric("leaf/calls", 1, Reduce.SUM)


async def test_meshes_spawned_inside_actors_are_attached_and_stop_hands_over(tmp_path):
    mlogger = await start_logger(tmp_path, {"flush_timeout_s": 5.0})
    before = await mlogger.get_fetcher_count.call_one()
    pm = this_host().spawn_procs(per_host={"procs": 1}, name="parent")
    parent = pm.spawn("Parent", Parent)
    await parent.spawn_child.call_one()
    await mlogger.flush.call_one(0)  # the parent's fetcher cuts the grandchild mesh and declares it
    assert await mlogger.get_fetcher_count.call_one() == before + 2  # parent mesh + grandchild mesh
    await parent.spawn_child.call_one()  # a second grandchild mesh, recording once more
    await parent.stop_children.call_one()  # stopping hands over what was recorded since the flush
    await mlogger.flush.call_one(1)  # waits for those final states: they land in step 1
    await mlogger.shutdown.call_one()
    await _stop(pm)
    rows = global_rows(tmp_path)
    assert rows[0]["metrics"]["leaf/calls"] == 1.0
    assert rows[1]["metrics"]["leaf/calls"] == 1.0, rows
    assert sum(r["metrics"].get("leaf/calls", 0.0) for r in rows.values()) == 2.0
    assert all(not r.get("missing") for r in rows.values()), rows


async def test_install_is_idempotent_and_uninstall_stops_attaching(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    provisioner_hooks.install()
    provisioner_hooks.install()
    n0 = await mlogger.get_fetcher_count.call_one()
    pm = this_host().spawn_procs(per_host={"procs": 1}, name="once")
    assert await mlogger.get_fetcher_count.call_one() == n0 + 1
    provisioner_hooks.uninstall()
    try:
        pm2 = this_host().spawn_procs(per_host={"procs": 1}, name="unobserved")
        assert await mlogger.get_fetcher_count.call_one() == n0 + 1
    finally:
        provisioner_hooks.install()
    await mlogger.shutdown.call_one()
    await _stop(pm, pm2)


class FailingInit(LoggerBackend):
    def init(self, run=None, **kw):
        raise OSError("cannot open the dashboard")


register_backend("test_failing_init", FailingInit)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"consle": {}}, "Unknown logger backend type: 'consle'; valid: alerts, console, critical_path, index, jsonl"),
        ({"console": {"logging_mode": "global"}}, "valid: global_reduce, per_rank_reduce, per_rank_no_reduce"),
        ({"test_failing_init": {}}, "backend 'test_failing_init' failed to initialise"),
        ({"run": {"dir": "x"}}, "valid: id, root"),
        ({"console": "yes"}, "must be a dict"),
    ],
)
async def test_config_mistakes_raise_at_init_backends_with_choices(tmp_path, config, message):
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    with pytest.raises(Exception) as info:
        await mlogger.init_backends.call_one({**config, "run": config.get("run", {"root": str(tmp_path)})})
    assert message in str(info.value)
    # the logger is still usable after a bad config
    await mlogger.init_backends.call_one({"run": {"root": str(tmp_path), "id": "ok"}})
    await mlogger.shutdown.call_one()


async def test_self_observation_metrics_in_every_step(tmp_path):
    mlogger = await start_logger(tmp_path, {})
    record_metric("x", 1.0)
    record_metric("x", "oops")
    record_metric("x", float("nan"))
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    m = global_rows(tmp_path)[0]["metrics"]
    assert m["obs/values_recorded"] == 2
    assert m["obs/dropped_values"] == 1
    assert m["obs/nonfinite_values"] == 1
    assert 0 <= m["obs/flush_blocked_s"] < 1.0
    assert m["obs/merge_s"] >= 0 and m["obs/missing_ranks"] == 0 and m["obs/pending_steps"] >= 0


class Arrival(LoggerBackend):
    """Notes the wall time at which each step reached the backends."""

    at: dict = {}

    def log_step(self, record):
        Arrival.at[record.step] = time.monotonic()


register_backend("test_arrival", Arrival)


class SlowExport(MetricAccumulator):
    """A custom reduction whose state takes 0.5 s to export (the workload of a big state)."""

    def reset(self):
        self.total = 0.0

    def append(self, v):
        self.total += v

    def get_state(self):
        time.sleep(0.5)  # export work, not a wait for something
        return self._state(total=self.total)

    @classmethod
    def merge_states(cls, states):
        return {"reduction_type": "slow_export", "total": sum(s["total"] for s in states)}

    @classmethod
    def value_from_state(cls, s):
        return s["total"]


register_reduction("slow_export", SlowExport)


class Recorder(Actor):
    @endpoint
    async def record(self, v: float) -> None:
        record_metric("busy/v", v, Reduce.SUM)

    @endpoint
    async def record_slow(self, v: float) -> None:
        record_metric("busy/slow", v, "slow_export")


async def test_flush_returns_before_export_and_a_blocked_controller_loop_does_not_delay_the_step(tmp_path):
    """A flush waits only for the ranks' acknowledgements, not for their exports; the states are
    taken by the inbox's own thread, so while the user's controller loop is blocked by
    synchronous work after a flush, the step still completes."""
    mlogger = await start_logger(tmp_path, {"test_arrival": {}, "flush_timeout_s": 30})
    mesh = this_host().spawn_procs(per_host={"procs": 2}, name="busyloop")
    rec = mesh.spawn("Recorder", Recorder)
    await mlogger.flush.call_one(0)  # warm-up
    await mlogger.wait_idle.call_one()
    await rec.record.call(2.0)
    await rec.record_slow.call(1.0)
    Arrival.at.clear()
    t0 = time.monotonic()
    await mlogger.flush.call_one(1)
    blocked_from = time.monotonic()
    time.sleep(3.0)  # synchronous work on the controller's loop (the workload, not a wait)
    blocked_until = time.monotonic()
    await mlogger.shutdown.call_one()
    await _stop(mesh)
    assert blocked_from - t0 < 0.5  # the flush did not wait for the 0.5 s exports
    assert 1 in Arrival.at and blocked_from < Arrival.at[1] < blocked_until, (Arrival.at, blocked_from, blocked_until)
    m = global_rows(tmp_path)[1]["metrics"]
    assert m["busy/v"] == 4.0 and m["busy/slow"] == 2.0
