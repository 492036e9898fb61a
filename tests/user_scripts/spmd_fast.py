"""A user's SPMD loop at full speed (run by the tests under torchrun): every rank records
``tokens = 100 * (rank + 1)`` (SUM) and flushes every step, no sleep, the default timeout.
argv: run_dir steps. Prints each rank's shutdown time and summary."""

import json
import sys
import time

import torch.distributed as dist

from forge_obs import Reduce, record_metric, spmd

run_dir, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
obs = spmd.init({"jsonl": {}}, run_dir=run_dir)
t0 = time.monotonic()
for step in range(steps):
    record_metric("tokens", 100 * (rank + 1), Reduce.SUM)
    obs.flush(step)
loop_s = time.monotonic() - t0
t0 = time.monotonic()
summary = obs.shutdown()
print("SHUTDOWN", json.dumps({"rank": rank, "loop_s": loop_s, "shutdown_s": time.monotonic() - t0,
                              "summary": summary}, default=str), flush=True)
dist.destroy_process_group()
