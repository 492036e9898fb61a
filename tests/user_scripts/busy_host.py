"""A small data-parallel trainer on a host shared with other jobs, written as a user writes it:
2 trainer ranks on an unnamed mesh, each step's forward/backward a fixed amount of CPU work in a
``record_span`` that logs its duration, the controller's step around it, the live alerts on.
``--fault-rank R --fault-from S --fault-s X``: rank R sleeps X s more in its forward/backward from
step S (a slow rank, as GRPO's --fault-slow-trainer-rank). The busy processes beside it are the
test's (tests/analysis/test_contention_real.py starts them and stops them by SIGKILL).

    python busy_host.py RUNS_ROOT RUN_ID [--steps 60] [--fault-rank 1 --fault-from 10 --fault-s 0.3]

Prints the run directory."""

import argparse
import asyncio
import time

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, get_or_create_metric_logger, record_metric, record_span

WORK_CPU_S = 0.02  # CPU time of one forward/backward


class Trainer(Actor):
    def __init__(self, fault_rank: int, fault_from: int, fault_s: float):
        self.fault = (fault_rank, fault_from, fault_s)

    @endpoint
    async def train_step(self, step: int) -> None:
        rank = current_rank().rank
        with record_span("forward_backward", log_to_metrics=True):
            end = time.thread_time() + WORK_CPU_S
            x = 0
            while time.thread_time() < end:
                x += 1
            if rank == self.fault[0] and step >= self.fault[1]:
                time.sleep(self.fault[2])
        record_metric("trainer/loss", 1.0 / (step + 1), Reduce.MEAN)


async def main(args):
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"run": {"root": args.root, "id": args.run_id},
                                          "alerts": {"sinks": ["file"]}})
    trainer = this_host().spawn_procs(per_host={"procs": 2}).spawn(
        "Trainer", Trainer, args.fault_rank, args.fault_from, args.fault_s)
    for step in range(args.steps):
        with record_span("controller_step"):
            t0 = time.perf_counter()
            await trainer.train_step.call(step)
            record_metric("trainer/samples_per_s", 64 / (time.perf_counter() - t0), Reduce.MEAN)
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    print(f"{args.root}/{args.run_id}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("run_id")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-rank", type=int, default=-1)
    ap.add_argument("--fault-from", type=int, default=0)
    ap.add_argument("--fault-s", type=float, default=0.3)
    asyncio.run(main(ap.parse_args()))
