"""The cut's parts and a raw round trip beside it, as a user turns them on from the docs: every
actor defined here, a worker mesh without a name, two replicas spawned with one name,
``"probe_round_trip": True``; small steps (states with the ack) and large ones (held until
the cut closes). ``python probed_cuts.py RUNS_ROOT``; prints one JSON line per step, then the
run directory."""

import asyncio
import json
import sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, get_or_create_metric_logger, record_metric

STEPS = 4


class Worker(Actor):
    @endpoint
    async def work(self, step: int, n_keys: int) -> None:
        r = current_rank().rank
        for i in range(n_keys):
            record_metric(f"work/k{i}", float(step + r), Reduce.SUM)


class Replica(Actor):
    @endpoint
    async def generate(self, step: int) -> None:
        record_metric("replica/requests", 1, Reduce.SUM)


async def main(root: str) -> None:
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one({"probe_round_trip": True, "run": {"root": root, "id": "probed"}})
    workers = this_host().spawn_procs(per_host={"procs": 2}).spawn("worker", Worker)
    replicas = [this_host().spawn_procs(per_host={"procs": 1}, name="replica").spawn("replica", Replica)
                for _ in range(2)]
    for step in range(STEPS):
        n_keys = 10 if step % 2 == 0 else 500  # small, then large cuts
        await workers.work.call(step, n_keys)
        for rep in replicas:
            await rep.generate.call_one(step)
        await mlogger.flush.call_one(step)
        print(json.dumps({"step": step, "n_keys": n_keys}), flush=True)
    await mlogger.shutdown.call_one()
    print(json.dumps({"run_dir": info["run_dir"]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
