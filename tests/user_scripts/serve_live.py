"""A small RL-shaped run that the ``forge-obs serve`` browser test watches while it is written:
a trainer mesh of 2 procs (spawned without a name) with a timeline span per step (rank 0 computes in it, rank 1
waits) records a loss, a step time and SAMPLE rows (one holding markup), the controller flushes each step; the run has a name, tags and notes. ``python serve_live.py ROOT``: steps
0-4, then it waits for ``ROOT/go``; steps 5-9 (the loss is 20 at step 7: the threshold alert
fires), then it waits for ``ROOT/stop`` and shuts down."""

import asyncio
import sys
import time
from pathlib import Path

import provisioner_hooks
from forge_obs import Reduce, get_or_create_metric_logger, record_metric, record_span
from monarch.actor import Actor, current_rank, endpoint, this_host


class Trainer(Actor):
    @endpoint
    async def train_step(self, step: int) -> None:
        with record_span("train_step"):  # on the run's timeline, tagged with the step it is flushed in
            self.record(step)
            if current_rank().rank == 0:  # computes: 5 ms of CPU time
                t = time.thread_time()
                while time.thread_time() - t < 0.005:
                    pass
            else:  # waits: 5 ms with little CPU time
                await asyncio.sleep(0.005)

    def record(self, step: int) -> None:
        rank = current_rank().rank
        record_metric("trainer/loss", 20.0 if step == 7 else 1.0 / (step + 1) + rank * 0.1, Reduce.MEAN)
        record_metric("trainer/step_s", 0.1 + 0.05 * rank + 0.01 * step, Reduce.MEAN)
        record_metric("trainer/<img src=x onerror=alert(1)>", float(step), Reduce.MEAN)
        record_metric("rollouts", {"prompt": "<script>alert(2)</script>", "reward": float(rank)}, Reduce.SAMPLE)


async def wait_for(path: Path) -> None:
    while not path.exists():
        await asyncio.sleep(0.05)


async def main(root: Path) -> None:
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger()
    await mlogger.init_backends.call_one({
        "run": {"root": str(root), "id": "live", "name": "live <b>demo</b>", "tags": ["grpo", "live"],
                "notes": "watched by the browser test"},
        "jsonl": {},
        "alerts": {"rules": ["trainer/loss > 10"], "sinks": ["file"]},
    })
    trainers = this_host().spawn_procs(per_host={"procs": 2}).spawn("trainer", Trainer)
    for step in range(10):
        if step == 5:
            await wait_for(root / "go")
        await trainers.train_step.call(step)
        await mlogger.flush.call_one(step)
        print("flushed", step, flush=True)
    await wait_for(root / "stop")
    await mlogger.shutdown.call_one()


asyncio.run(main(Path(sys.argv[1])))
