"""A small RL loop written from the docs, as a user writes it: every actor defined here, a
trainer on an unnamed mesh, two generator replicas spawned with the same name, a buffer; @trace
on the generator's endpoint and record_span in the trainer; all three logging modes into the
local store, W&B offline, a live alert rule. Trainer rank 1 is slowed on purpose (the planted
fault ``forge-obs doctor`` and the live alerts must name). ``python rl_loop.py RUNS_ROOT``; prints the run directory."""

import asyncio
import json
import sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, get_or_create_metric_logger, record_metric, record_span, trace

STEPS = 8
SLOW_S = 0.08  # trainer rank 1's extra time per step


class Generator(Actor):
    def __init__(self, replica: int):
        self.replica = replica

    @endpoint
    @trace("generator/generate")
    async def generate(self, step: int) -> list[int]:
        await asyncio.sleep(0.005)
        record_metric("generator/requests", 1, Reduce.SUM)
        record_metric("generator/tokens", 10 * (self.replica + 1), Reduce.SUM)
        return [step, self.replica]


class Buffer(Actor):
    def __init__(self):
        self.items = []

    @endpoint
    async def add(self, items: list) -> int:
        self.items.extend(items)
        record_metric("buffer/size", len(self.items), Reduce.LAST)
        return len(self.items)


class Trainer(Actor):
    @endpoint
    @trace("trainer/train_step")
    async def train_step(self, step: int) -> None:
        with record_span("trainer/step"):
            rank = current_rank().rank
            await asyncio.sleep(SLOW_S if rank == 1 else 0.002)
            record_metric("trainer/loss", 1.0 / (step + 1) + rank, Reduce.MEAN)


async def main(root: str) -> None:
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    modes = ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]
    info = await mlogger.init_backends.call_one({
        "run": {"root": root, "id": "rl"},
        "console": {"logging_mode": "global_reduce"},
        "jsonl": {"logging_mode": modes},
        "wandb": {"mode": "offline", "project": "rl", "logging_mode": ["global_reduce", "per_rank_reduce"]},
        "alerts": {"rules": ["trainer/loss > 1.2"],
                   "callback": lambda a: print(f"ALERT {a['state']} {a['rule']} {a['step']} {a['where']}", flush=True)},
    })
    trainer = this_host().spawn_procs(per_host={"procs": 2}).spawn("trainer", Trainer)
    generators = [this_host().spawn_procs(per_host={"procs": 1}, name="generator").spawn("generator", Generator, i)
                  for i in range(2)]
    buffer = this_host().spawn_procs(per_host={"procs": 1}).spawn("buffer", Buffer)
    for step in range(STEPS):
        rollouts = await asyncio.gather(*(g.generate.call_one(step) for g in generators))
        await buffer.add.call_one(rollouts)
        await trainer.train_step.call(step)
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(json.dumps({"run_dir": info["run_dir"]}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
