"""A user's SPMD training script (run by the tests under torchrun, or one process per rank as Slurm
starts them). argv: run_dir mode [steps]. Each rank records known values; the tests check the
merged steps by arithmetic.

modes: exact (every rank the same keys; only rank 1 records "stage_loss"), slow (rank 1 waits
until rank 0 has flushed every step: a flush that blocked on rank 1 would never return), kill
(rank 1 exits at step 3 without a word), late (rank 1 flushes step 2 only after rank 0's
backends logged step 2 without it)."""

import json

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from forge_obs import Reduce, record_metric, spmd
from forge_obs.recording.timeline import record_span

run_dir, mode = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if world == 4:  # the coordinates from a DeviceMesh (the same ones)
    from torch.distributed.device_mesh import init_device_mesh

    where = {"device_mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))}
else:
    where = {"coords": {"pp": rank // 2, "dp_shard": rank % 2}}
obs = spmd.init({"console": {"logging_mode": "global_reduce"}, "jsonl": {"logging_mode": ["global_reduce", "per_rank_reduce"]}},
                run_dir=run_dir, **where,
                timeout_s=2.0 if mode in ("kill", "late") else 60.0)
done = Path(run_dir) / "rank0_flushed_all"


def wait_until(cond, what: str, timeout_s: float = 90.0) -> None:
    """Wait for another rank's progress (polled); a rank that never sees it exits with an error
    instead of waiting forever."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            print(f"rank {rank}: gave up waiting for {what}", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.001)


def _logged(step: int) -> bool:
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(line).get("step") == step for line in lines if line.endswith("}"))


for step in range(steps):
    if mode == "kill" and rank == 1 and step == 3:
        # steps 0-2 went out (a rank that dies loses only what it had not shipped)
        wait_until(lambda: obs.shipped >= 3, "steps 0-2 shipped")
        record_metric("loss", 1000.0, Reduce.MEAN)  # never flushed: the process dies
        os._exit(1)
    if mode == "slow" and rank == 1 and step == 2:
        wait_until(done.exists, "rank 0's last flush")  # rank 0 went through every flush without rank 1
    if mode == "late" and rank == 1 and step == 2:
        wait_until(lambda: _logged(2), "step 2 logged")  # rank 0's step 2 left without rank 1 (after the timeout)
    with record_span("train_step"):
        t = torch.tensor([float(rank)])
        if mode == "exact":  # (a collective couples the ranks: not where one is slow or dies)
            dist.all_reduce(t)  # the training group: untouched by forge_obs
        record_metric("loss", rank * 10 + step, Reduce.MEAN)
        record_metric("tokens", rank + 1, Reduce.SUM)
        record_metric("peak", rank * 100 + step, Reduce.MAX)
        if rank == 1:
            record_metric("stage_loss", 7 + step, Reduce.MEAN)
    obs.flush(step)
    if rank == 0 and step == steps - 1:
        done.touch()

if mode == "late":  # rank 0 shuts down once rank 1's steps were all sent
    flushed = Path(run_dir) / "rank1_flushed_all"
    if rank == 1:
        wait_until(lambda: obs.shipped >= steps, "every step shipped")
        flushed.touch()
    else:
        wait_until(flushed.exists, "rank 1's last shipment")
record_metric("after_last", 1, Reduce.SUM)  # recorded after the last flush: logged at shutdown
out = obs.shutdown()
print("SHUTDOWN", rank, out, flush=True)
if mode == "exact":
    dist.barrier()
dist.destroy_process_group()
