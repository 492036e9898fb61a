"""A multi-mesh demo of forge_obs: trainer, generator replicas and a buffer on their own proc
meshes, one experiment view. Shows the three logging modes side by side.

    python -m apps.demo.main --steps 5                       # global_reduce on the console
    python -m apps.demo.main --mode per_rank_reduce          # one block per rank
    python -m apps.demo.main --mode per_rank_no_reduce       # every raw value, timestamped
    python -m apps.demo.main --mode all                      # all three

Every run also writes runs/<run_id>/metrics.jsonl (see `forge-obs show runs/<run_id>`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

os.environ.setdefault("MONARCH_FILE_LOG", "error")

from monarch.actor import Actor, current_rank, endpoint, this_host  # noqa: E402

import provisioner_hooks  # noqa: E402
from forge_obs import Reduce, get_or_create_metric_logger, record_metric  # noqa: E402
from forge_obs.core.shell import printed_command  # noqa: E402

MODES = ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]


class Generator(Actor):
    @endpoint
    async def generate(self, n_prompts: int, policy_version: int) -> list[float]:
        t0 = time.perf_counter()
        rewards = [random.random() for _ in range(n_prompts)]
        record_metric("generator/requests", n_prompts, Reduce.SUM)
        record_metric("generator/reward_mean", sum(rewards) / n_prompts, Reduce.MEAN)
        record_metric("generator/policy_version", policy_version, Reduce.MAX)
        record_metric("generator/generate_s", time.perf_counter() - t0, Reduce.MAX)
        return rewards


class Buffer(Actor):
    def __init__(self) -> None:
        self.items: list[float] = []

    @endpoint
    async def add(self, rewards: list[float]) -> None:
        self.items.extend(rewards)
        record_metric("buffer/size", len(self.items), Reduce.LAST)
        record_metric("buffer/added", len(rewards), Reduce.SUM)

    @endpoint
    async def sample(self, n: int) -> list[float]:
        batch, self.items = self.items[:n], self.items[n:]
        record_metric("buffer/sampled", len(batch), Reduce.SUM)
        return batch


class Trainer(Actor):
    @endpoint
    async def train_step(self, batch: list[float], step: int) -> float:
        rank = current_rank().rank
        loss = 1.0 / (1 + step) + 0.01 * rank
        record_metric("trainer/loss", loss, Reduce.MEAN)
        record_metric("trainer/loss_std", loss, Reduce.STD)
        record_metric("trainer/batch_size", len(batch), Reduce.SUM)
        record_metric("trainer/rank_sum", rank, Reduce.SUM)
        return loss


async def main(steps: int, mode: str, run_root: str) -> str:
    provisioner_hooks.install()  # every proc mesh spawned from now on is observed
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    modes = MODES if mode == "all" else [mode]
    info = await mlogger.init_backends.call_one({"console": {"logging_mode": modes}, "run": {"root": run_root}})

    trainer_procs = this_host().spawn_procs(per_host={"procs": 2}, name="trainer")
    gen_procs = [this_host().spawn_procs(per_host={"procs": 1}, name=f"generator{i}") for i in range(2)]
    buffer_procs = this_host().spawn_procs(per_host={"procs": 1}, name="buffer")
    trainer = trainer_procs.spawn("Trainer", Trainer)
    generators = [p.spawn("Generator", Generator) for p in gen_procs]
    buffer = buffer_procs.spawn("Buffer", Buffer)

    for step in range(steps):
        rollouts = await asyncio.gather(*(g.generate.call_one(4, step) for g in generators))
        for rewards in rollouts:
            await buffer.add.call_one(rewards)
        batch = await buffer.sample.call_one(8)
        await trainer.train_step.call(batch, step)
        record_metric("controller/step", step, Reduce.LAST)
        await mlogger.flush.call_one(step)  # returns at once; reduction + I/O run in the background

    await mlogger.shutdown.call_one()  # drains every pending step, finishes the backends
    for pm in (trainer_procs, *gen_procs, buffer_procs):
        await pm.stop()
    print(f"\nrun directory: {info['run_dir']}  (try: {printed_command('show', info['run_dir'])})")
    return info["run_dir"]


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", choices=MODES + ["all"], default="all")
    ap.add_argument("--run-root", default="runs")
    args = ap.parse_args()
    asyncio.run(main(args.steps, args.mode, args.run_root))


if __name__ == "__main__":
    cli()
