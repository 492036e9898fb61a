"""Ranks that run the same code, as a user writes them: one actor class defined here, on an
unnamed mesh of 2 procs and on two replicas spawned with one name, every rank recording the
same keys in the same order (MEAN, MAX, SUM); small steps (10 keys: states with the ack) and
large ones (300 keys: held until the cut closes); a backend defined here whose hooks take only
some of the keywords forge_obs passes. ``python same_code_ranks.py RUNS_ROOT``; the backend
prints one JSON line per step, then the run directory."""

import asyncio
import json
import sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import LoggerBackend, Reduce, get_or_create_metric_logger, record_metric, register_backend

STEPS = 4


class Learner(Actor):
    @endpoint
    async def step(self, step: int, n_keys: int, first_id: int) -> None:
        rid = first_id + current_rank().rank  # 0..3 over the 4 ranks
        for i in range(n_keys):
            record_metric(f"loss/k{i}", float(step + rid), Reduce.MEAN)
            record_metric(f"grad/k{i}", float(10 * rid + step), Reduce.MAX)
            record_metric(f"tokens/k{i}", 1, Reduce.SUM)


class PrintSteps(LoggerBackend):
    def init(self, run=None):  # no role / process_name / **kwargs
        super().init(run)

    async def log_batch(self, metrics, global_step):  # no source keyword
        values = {m.key: m.value for m in metrics if not m.key.startswith("obs/")}
        print(json.dumps({"step": global_step, "values": values}), flush=True)


register_backend("print_steps", PrintSteps)


async def main(root: str) -> None:
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one({"print_steps": {"logging_mode": "global_reduce"},
                                                 "run": {"root": root, "id": "same_code"}})
    pair = this_host().spawn_procs(per_host={"procs": 2}).spawn("learner", Learner)
    replicas = [this_host().spawn_procs(per_host={"procs": 1}, name="replica").spawn("learner", Learner)
                for _ in range(2)]
    for step in range(STEPS):
        n_keys = 10 if step % 2 == 0 else 300
        await pair.step.call(step, n_keys, 0)
        for i, rep in enumerate(replicas):
            await rep.step.call_one(step, n_keys, 2 + i)
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(json.dumps({"run_dir": info["run_dir"]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
