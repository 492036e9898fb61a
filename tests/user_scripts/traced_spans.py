"""A user's script: ``@trace`` on the endpoints of actors defined here, on meshes spawned without
a name, and on a controller function; no ``record_span`` anywhere. Every traced call is a span in
the run's timeline, linked to the span that made the call (across processes), so the critical
path and the drill-down see the endpoints.

``python traced_spans.py ROOT`` writes the run ``ROOT/traced`` and prints one JSON line.

- ``Trainer.train_step`` (async, 2 ranks): a ``Tracer`` with one step inside, then a call to the
  reference model from inside the traced endpoint (a mesh process's call under a ``@trace`` span);
- ``Reference.logprobs`` (sync): sleeps, so its span is waiting time, not CPU time;
- ``controller_step`` (``@trace`` on the controller): calls every trainer rank, per step.
"""

import asyncio
import json
import sys
import time

from monarch.actor import Actor, endpoint, this_host

from forge_obs import Tracer, get_or_create_metric_logger, trace

STEPS = 3


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Reference(Actor):
    @endpoint
    @trace("ref/logprobs")
    def logprobs(self, n: int) -> int:
        time.sleep(0.05)
        return n


class Trainer(Actor):
    @endpoint
    @trace("trainer/train_step")
    async def train_step(self, ref, step: int) -> int:
        t = Tracer("trainer/phases")
        t.start()
        busy(0.03)
        t.step("forward")
        t.stop()
        return await ref.logprobs.call_one(step)


@trace("controller/step")
async def controller_step(trainer, ref, step: int) -> list:
    return list((await trainer.train_step.call(ref, step)).values())


async def main(root: str) -> None:
    import provisioner_hooks
    from forge_obs.recording.timeline import set_step

    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger()
    await mlogger.init_backends.call_one({"run": {"root": root, "id": "traced"}, "jsonl": {},
                                          "timeline": {"flush_interval_s": 0.05}})
    trainer = this_host().spawn_procs(per_host={"procs": 2}).spawn("trainer", Trainer)
    ref = this_host().spawn_procs(per_host={"procs": 1}).spawn("ref", Reference)
    results = []
    for step in range(STEPS):
        set_step(step)
        results.append(await controller_step(trainer, ref, step))
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
