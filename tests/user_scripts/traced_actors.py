"""Actors defined in this script (pickled by value), on meshes spawned without a name: @trace
(sync and async, cpu and gpu timers, with and without track_memory), a Tracer made in __init__
and one made in an endpoint, a module-level `trace` used as a context manager, record_span as a
decorator and a context manager, a custom reduction and a custom backend, all defined here.
Prints one JSON line: what the custom backend received at each step."""

import asyncio
import json
import sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import (LoggerBackend, MetricAccumulator, Reduce, Tracer, get_or_create_metric_logger, record_metric,
                       record_span, register_backend, register_reduction, trace)

CALLS = 3  # endpoint calls per step


class Range(MetricAccumulator):
    def reset(self): self.lo, self.hi = float("inf"), float("-inf")
    def append(self, v): self.lo, self.hi = min(self.lo, v), max(self.hi, v)
    def get_state(self): return self._state(lo=self.lo, hi=self.hi)
    @classmethod
    def merge_states(cls, ss): return {"reduction_type": "range", "lo": min(s["lo"] for s in ss), "hi": max(s["hi"] for s in ss)}
    @classmethod
    def value_from_state(cls, s): return s["hi"] - s["lo"]


register_reduction("range", Range)   # once, here: forge_obs carries it to the actors' processes

REGION = trace("ctx/region")          # a module-level trace object, entered in an endpoint


class Collect(LoggerBackend):
    steps: dict = {}

    def log_step(self, record):
        Collect.steps[record.step] = {"global": dict(record.global_dict()),
                                      "ranks": {lbl: mine for lbl, v in record.per_rank_values().items()
                                                if (mine := {k: x for k, x in v.items() if not k.startswith("obs/")})}}


register_backend("collect", Collect)


class SyncActor(Actor):
    @endpoint
    @trace("sync/cpu", timer="cpu")
    def cpu(self, x: int) -> int:
        record_metric("sync/x", x, Reduce.SUM)
        return x

    @endpoint
    @trace("sync/gpu", timer="gpu")
    def gpu(self) -> None:
        pass

    @endpoint
    @trace("sync/mem", track_memory=True)
    def mem(self) -> None:
        pass


class AsyncActor(Actor):
    def __init__(self):
        self.tracer = Tracer("async/init_tracer")

    @endpoint
    @trace("async/cpu")
    async def cpu(self, x: int) -> int:
        rank = current_rank().rank
        record_metric("async/range", float(10 * rank + x), "range")
        return x

    @endpoint
    @trace("async/gpu_mem", timer="gpu", track_memory=True)
    async def gpu_mem(self) -> None:
        self.tracer.start()
        self.tracer.step("a")
        self.tracer.stop()
        t = Tracer("async/endpoint_tracer")
        t.start()
        t.step("b")
        t.stop()
        with REGION as r:
            r.step("inner")

    @endpoint
    @record_span("async/span_decorated")
    async def spans(self) -> None:
        with record_span("async/span_cm", log_to_metrics=True):
            record_metric("async/spans", 1, Reduce.SUM)


async def main():
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"collect": {"logging_mode": ["global_reduce", "per_rank_reduce"]},
                                          "run": {"root": sys.argv[1], "id": "traced"}})
    sync = this_host().spawn_procs(per_host={"procs": 2}).spawn("sync", SyncActor)
    asy = this_host().spawn_procs(per_host={"procs": 2}).spawn("asy", AsyncActor)
    for step in range(2):
        for x in range(CALLS):
            await sync.cpu.call(x)
            await sync.gpu.call()
            await sync.mem.call()
            await asy.cpu.call(x)
            await asy.gpu_mem.call()
            await asy.spans.call()
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(json.dumps({"steps": Collect.steps}))


if __name__ == "__main__":
    asyncio.run(main())
