"""A user's SPMD loop, paced (each rank flushes step ``s`` at ``start + s * step_s``, and
catches up at once when it is behind), one process per rank as Slurm starts them. Every rank
records ``tokens = 100 * (rank + 1)`` (SUM) each step. Rank ``victim`` touches
``<run_dir>/victim_at_<mark>`` once its steps up to ``mark`` were shipped (the test then SIGKILLs
or SIGSTOPs it). Rank 0 writes its flush times to ``<run_dir>/flushed.json`` and prints its shutdown time.
A backend stamps when each step reached it (``spmd_stamp:Stamp``).

argv: run_dir steps step_s timeout_s victim mark"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from forge_obs import Reduce, record_metric, spmd

run_dir, steps, step_s, timeout_s, victim, mark = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
                                                   float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
dist.init_process_group("gloo")  # env:// (rank 0 hosts the job's store); no collective after this
obs = spmd.init({"jsonl": {}, "spmd_stamp:Stamp": {}}, run_dir=run_dir, timeout_s=timeout_s)
rank = obs.rank
flushed = {}
start = time.time()
for step in range(steps):
    time.sleep(max(0.0, start + step * step_s - time.time()))  # the step's work (a rank behind catches up)
    record_metric("tokens", 100 * (rank + 1), Reduce.SUM)
    obs.flush(step)
    flushed[step] = time.time()
    if rank == victim and step == mark:
        while obs.shipped < mark + 1:  # steps 0..mark went out (a rank that dies loses what it had not shipped)
            time.sleep(0.001)
        Path(run_dir, f"victim_at_{step}").touch()
record_metric("after_last", 1, Reduce.SUM)
t0 = time.monotonic()
summary = obs.shutdown()
if rank == 0:
    Path(run_dir, "flushed.json").write_text(json.dumps(flushed))
print("SHUTDOWN", json.dumps({"rank": rank, "shutdown_s": time.monotonic() - t0, "summary": summary},
                             default=str), flush=True)
dist.destroy_process_group()
