"""A user's SPMD loop whose job counts as large (``FORGE_OBS_SPMD_SAMPLE_FROM=2``): 4 ranks with
coordinates ``dp_replicate = rank // 2``, ``dp_shard = rank % 2``, so that by default ranks 0
and 1 (``dp_replicate`` 0) write their spans. Rank 3 records a NaN loss in steps 20-59: the
live alert names it, and it writes its spans while the alert is on. Each step is a span
``train_step``, paced at 20 ms. argv: run_dir steps"""

import sys
import time

import torch.distributed as dist

from forge_obs import Reduce, record_metric, record_span, spmd

run_dir, steps = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
obs = spmd.init({"jsonl": {}, "alerts": {"sinks": ["file"]}}, run_dir=run_dir,
                coords={"dp_replicate": rank // 2, "dp_shard": rank % 2})
start = time.time()
for step in range(steps):
    time.sleep(max(0.0, start + step * 0.02 - time.time()))
    with record_span("train_step"):
        nan = rank == 3 and 20 <= step < 60
        record_metric("loss", float("nan") if nan else 1.0, Reduce.MEAN)
    obs.flush(step)
obs.shutdown()
dist.destroy_process_group()
