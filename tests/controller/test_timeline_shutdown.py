"""A span its process's clean shutdown cuts short is not "unfinished" and not a hang; a span open
past ``open_after_s`` still is. In one process (the writer) and on a real Monarch proc mesh
stopped while an actor is inside a span."""

from __future__ import annotations

import asyncio
import threading

from monarch.actor import Actor, endpoint, this_host

import provisioner_hooks
from forge_obs import get_or_create_metric_logger
from forge_obs.recording import timeline as tl
from forge_obs.analysis import reader
from forge_obs.analysis.doctor import diagnose
from forge_obs.analysis.trace import export_trace
from tests.support.trace_validate import load


def _export(run_dir):
    out = run_dir / "trace.json"
    stats = export_trace(run_dir, out)
    return stats, load(out)


def test_young_span_cut_by_close_is_not_unfinished(tmp_path):
    tl.close()
    try:
        tl.configure(tmp_path, open_after_s=60)
        tl.set_step(3)
        with tl.record_span("done"):
            pass
        tl.record_span("weights_load", version=4).__enter__()  # in flight when the process shuts down
        tl.close()
    finally:
        tl.close()
    text = next((tmp_path / "events").glob("*.jsonl")).read_text()
    assert '{"x":"shutdown"}' in text  # B, then E marked as cut by the shutdown
    items = list(reader.walk(reader.scan(tmp_path)))
    assert not [it for it in items if it[0] == reader.OPEN]
    (cut,) = [it for it in items if it[0] == reader.SPAN and it[3] == "weights_load"]
    assert cut[7]["x"] == "shutdown" and cut[7]["a"] == {"version": 4} and cut[6] >= 0
    stats, s = _export(tmp_path)
    assert stats["unfinished"] == 0 and s.unfinished == [] and stats["cut_by_shutdown"] == 1
    (e,) = [e for e in s.events if e.get("name") == "weights_load"]
    assert e["cat"] == "shutdown" and e["args"]["cut_by_shutdown"] is True and e["args"]["version"] == 4
    assert diagnose(tmp_path) == []


def test_span_open_past_open_after_s_stays_unfinished(tmp_path):
    """open_after_s=0: every open span is old enough to be a possible hang, also at a clean close."""
    tl.close()
    try:
        tl.configure(tmp_path, open_after_s=0)
        tl.record_span("hung").__enter__()
        tl.flush()
        tl.close()
    finally:
        tl.close()
    text = next((tmp_path / "events").glob("*.jsonl")).read_text()
    assert '["B",' in text and '"x":"shutdown"' not in text
    stats, s = _export(tmp_path)
    assert stats["unfinished"] == 1 and stats["cut_by_shutdown"] == 0 and s.unfinished[0]["name"] == "hung"


class Loader(Actor):
    @endpoint
    async def start_load(self) -> None:
        """A 'weights_load' in a worker thread, still running when the process shuts down (as
        a blocking load is: Monarch cancels the actor's asyncio tasks at stop, not threads)."""
        entered = threading.Event()

        def load() -> None:
            with tl.record_span("weights_load", version=7):
                entered.set()
                threading.Event().wait()  # never finishes on its own

        threading.Thread(target=load, daemon=True).start()
        assert entered.wait(30)

    @endpoint
    async def work(self, step: int) -> None:
        tl.set_step(step)
        with tl.record_span("generate"):
            await asyncio.sleep(0)


async def test_span_in_flight_when_the_mesh_stops(tmp_path):
    provisioner_hooks.install()
    ml = await get_or_create_metric_logger()
    try:
        await ml.init_backends.call_one({"run": {"root": str(tmp_path), "id": "stop"}, "jsonl": {},
                                         "timeline": {"flush_interval_s": 0.05, "open_after_s": 60}})
        pm = this_host().spawn_procs(per_host={"procs": 1}, name="gen")
        actor = pm.spawn("loader", Loader)
        for step in range(3):
            await actor.work.call(step)
            await ml.flush.call_one(step)
        await actor.start_load.call()
        await pm.stop()  # the process exits cleanly with the span open
    finally:
        await ml.shutdown.call_one()
        provisioner_hooks.uninstall()
    run_dir = tmp_path / "stop"
    gen_files = [p for p in (run_dir / "events").glob("*.jsonl") if "_gen_" in p.name]
    assert gen_files and gen_files[0].read_text().rstrip().splitlines()[-1].startswith('["Z"')  # a clean close
    stats, s = _export(run_dir)
    assert stats["unfinished"] == 0 and s.unfinished == [], s.unfinished
    assert stats["cut_by_shutdown"] == 1
    (e,) = [e for e in s.events if e.get("name") == "weights_load"]
    assert e["args"]["cut_by_shutdown"] is True and s.process_names[e["pid"]].startswith("gen/loader r0")
    assert s.slices["generate"] == 3
    assert not [f for f in diagnose(run_dir) if f.kind in ("hang", "stall")]
