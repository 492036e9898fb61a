"""Structured timeline from real Monarch proc meshes: two meshes, concurrent asyncio tasks, flows,
a planted slow rank and a planted hang, then a clean run on the same meshes. Views: Perfetto
trace (checked by Perfetto's trace_processor when its binary is available, else by
:mod:`tests.support.trace_validate`), DuckDB, doctor."""

import asyncio
import time

import pytest
from monarch.actor import Actor, context, endpoint, this_host

import provisioner_hooks
from forge_obs import Reduce, get_or_create_metric_logger, record_metric
from forge_obs.analysis.doctor import diagnose
from forge_obs.analysis.trace import export_trace
from forge_obs.recording.timeline import record_event, record_span, set_step
from tests.support.trace_validate import load, perfetto_shell

GEN_STEPS = 5  # the generator hangs in the last one (run 1)
TRAIN_STEPS = 10


class GenActor(Actor):
    @endpoint
    async def generate(self, step: int, hang: bool) -> int:
        set_step(step)
        rank = context().actor_instance.rank.rank
        if hang and rank == 1:
            record_span("generate", flow=f"ep{step}").__enter__()  # never ends: a planted hang
            return rank

        async def rollout(i: int) -> None:
            with record_span("rollout", i=i):
                await asyncio.sleep(0.003)

        with record_span("generate", flow=f"ep{step}"):
            await asyncio.gather(rollout(0), rollout(1))  # concurrent tasks: separate tracks
        return rank


class TrainActor(Actor):
    @endpoint
    async def train(self, step: int, slow_rank: int) -> None:
        set_step(step)
        rank = context().actor_instance.rank.rank
        with record_span("train_step", flow=f"ep{step}" if step < GEN_STEPS else None):
            time.sleep(0.06 if rank == slow_rank else 0.02)
        record_event("weights_pushed", version=step)
        record_metric("loss", 1.0 / (step + 1), Reduce.MEAN)


async def _steps(ml, gen, trainer, slow_rank: int, hang: bool) -> None:
    for step in range(TRAIN_STEPS):
        set_step(step)
        with record_span("ctl_step", flow=f"ep{step}" if step < GEN_STEPS else None):
            if step < GEN_STEPS:
                await gen.generate.call(step, hang and step == GEN_STEPS - 1)
            await trainer.train.call(step, slow_rank)
        await ml.flush.call_one(global_step=step)


async def test_timeline_from_proc_meshes(tmp_path):
    provisioner_hooks.install()
    ml = await get_or_create_metric_logger()
    tl_cfg = {"open_after_s": 0.0, "flush_interval_s": 0.05}
    try:
        await ml.init_backends.call_one({"run": {"root": str(tmp_path), "id": "planted"}, "jsonl": {}, "timeline": tl_cfg})
        trainer_pm = this_host().spawn_procs(per_host={"gpus": 3}, name="trainer")
        gen_pm = this_host().spawn_procs(per_host={"gpus": 2}, name="gen")
        trainer = trainer_pm.spawn("train_actor", TrainActor)
        gen = gen_pm.spawn("gen_actor", GenActor)
        await _steps(ml, gen, trainer, slow_rank=2, hang=True)
        await ml.shutdown.call_one()
        # same meshes, a new run: no slow rank, no hang
        await ml.init_backends.call_one({"run": {"root": str(tmp_path), "id": "clean"}, "jsonl": {}, "timeline": tl_cfg})
        await _steps(ml, gen, trainer, slow_rank=-1, hang=False)
        await trainer_pm.stop()
        await gen_pm.stop()
    finally:
        await ml.shutdown.call_one()
        provisioner_hooks.uninstall()

    planted, clean = tmp_path / "planted", tmp_path / "clean"
    files = sorted(p.name for p in (planted / "events").glob("*.jsonl"))
    assert len(files) == 6 and sum("_trainer_" in f for f in files) == 3 and sum("_gen_" in f for f in files) == 2

    # ---- Perfetto trace
    out = tmp_path / "trace.json"
    stats = export_trace(planted, out)
    s = load(out)  # Perfetto importer rules: nesting, flow binding, process names
    assert s.slices["ctl_step"] == TRAIN_STEPS
    assert s.slices["train_step"] == 3 * TRAIN_STEPS
    assert s.slices["generate"] == 2 * GEN_STEPS  # incl. the unfinished one
    assert s.slices["rollout"] == 2 * 2 * GEN_STEPS - 2
    assert s.instants["weights_pushed"] == 3 * TRAIN_STEPS
    names = sorted(s.process_names.values())
    assert len(names) == 6
    assert names[0].startswith("controller r0")
    assert [n.split(" (")[0] for n in names[1:]] == [
        "gen/gen_actor r0", "gen/gen_actor r1", "train_actor r0", "train_actor r1", "train_actor r2"] or all(
        ("gen/gen_actor r" in n or "trainer/train_actor r" in n) for n in names[1:])
    assert sum("trainer/train_actor r" in n for n in names) == 3
    # concurrent rollouts ran on separate thread tracks of one process
    roll = [e for e in s.events if e.get("ph") == "X" and e["name"] == "rollout"]
    by_pid = {}
    for e in roll:
        by_pid.setdefault(e["pid"], set()).add(e["tid"])
    assert all(len(t) >= 2 for t in by_pid.values()) and len(by_pid) == 2
    # flows: controller -> generators -> trainers
    kinds = {(a, b) for a, _pa, b, _pb in s.flows}
    assert ("ctl_step", "generate") in kinds and ("generate", "train_step") in kinds
    assert stats["flows"] == len(s.flows) == GEN_STEPS * 5
    # the planted hang: one unfinished span, on gen r1, drawn to the end of the data
    (u,) = s.unfinished
    assert u["name"] == "generate" and u["args"]["step"] == GEN_STEPS - 1
    assert s.process_names[u["pid"]].startswith("gen/gen_actor r1")
    if perfetto_shell():  # the real importer, where its binary can be had
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

        tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=perfetto_shell()))
        rows = {r.name: r.n for r in tp.query("select name, count(*) as n from slice group by name")}
        assert rows["train_step"] == 3 * TRAIN_STEPS and rows["generate"] == 2 * GEN_STEPS
        assert next(iter(tp.query("select count(*) as n from flow"))).n == GEN_STEPS * 5
        unfinished = [r.name for r in tp.query(
            "select s.name from slice s join args a using(arg_set_id) where a.key = 'args.unfinished'")]
        assert unfinished == ["generate"]
        tracks = {r.name for r in tp.query("select name from process")}
        assert set(s.process_names.values()) <= tracks
        tp.close()

    # ---- DuckDB
    pytest.importorskip("duckdb")
    from forge_obs.analysis.sql import connect

    con = connect(planted)
    rows = con.execute(
        "SELECT mesh, rank, count(*) FROM spans WHERE name IN ('train_step', 'generate') GROUP BY ALL ORDER BY ALL").fetchall()
    assert rows == [("gen", 0, GEN_STEPS), ("gen", 1, GEN_STEPS), ("trainer", 0, TRAIN_STEPS),
                    ("trainer", 1, TRAIN_STEPS), ("trainer", 2, TRAIN_STEPS)]
    assert con.execute("SELECT mesh, rank, step FROM spans WHERE NOT finished").fetchall() == [("gen", 1, GEN_STEPS - 1)]
    (slowest,) = con.execute(
        "SELECT rank FROM spans WHERE name = 'train_step' GROUP BY rank ORDER BY avg(dur_ms) DESC LIMIT 1").fetchone()
    assert slowest == 2
    n_loss = con.execute("SELECT count(*) FROM metrics WHERE key = 'loss' AND source = 'global'").fetchone()[0]
    assert n_loss == TRAIN_STEPS

    # ---- doctor: the planted slow rank and hang, nothing on the clean run
    found = diagnose(planted, stall_min_s=0.2)
    got = sorted((f.kind, f.mesh, f.rank) for f in found)
    assert got == [("hang", "gen", 1), ("straggler", "trainer", 2)], [f.message for f in found]
    strag = [f for f in found if f.kind == "straggler"][0]
    # slow from the start (the first step may be blurred by the peers' first-call overhead)
    assert strag.actor == "train_actor" and strag.onset_step <= 1 and strag.steps[-1] == TRAIN_STEPS - 1
    assert diagnose(clean, stall_min_s=0.2) == []
