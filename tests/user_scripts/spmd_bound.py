"""A user's SPMD loop at full speed with each rank's queue bounded at 40 values
(``max_queued_values``): the shipper cannot keep up (it looks for cuts every 1-5 ms), so flushes
hold their values back into the next flush that finds room. Every rank records
``tokens = 100 * (rank + 1)`` (SUM) each step. argv: run_dir steps [free_ranks: comma-separated
ranks whose queue keeps the default bound, so that they hold nothing back while the others do]"""

import json
import sys

import torch.distributed as dist

from forge_obs import Reduce, record_metric, spmd

run_dir, steps = sys.argv[1], int(sys.argv[2])
free = {int(r) for r in sys.argv[3].split(",") if r} if len(sys.argv) > 3 else set()
dist.init_process_group("gloo")
bound = {} if dist.get_rank() in free else {"max_queued_values": 40}
obs = spmd.init({"jsonl": {}}, run_dir=run_dir, timeout_s=60.0, **bound)
for step in range(steps):
    record_metric("tokens", 100 * (obs.rank + 1), Reduce.SUM)
    obs.flush(step)
summary = obs.shutdown()
print("SHUTDOWN", json.dumps({"rank": obs.rank, "summary": summary}, default=str), flush=True)
dist.destroy_process_group()
