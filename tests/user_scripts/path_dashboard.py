"""A user's script: a training loop on the controller with spans, every backend, and the
``critical_path`` backend: each step's critical path as ``critical_path/*`` metrics.

``python path_dashboard.py ROOT STEPS`` writes the run ``ROOT/dash``. Each step: a ``controller_step``
span holding ``generate`` (50 ms) and ``train`` (100 ms; 400 ms at step 7), then a flush.
"""

import asyncio
import sys
import time

from forge_obs import Reduce, get_or_create_metric_logger, record_metric
from forge_obs.timeline import record_span, set_step


async def main(root: str, steps: int) -> None:
    mlogger = await get_or_create_metric_logger()
    await mlogger.init_backends.call_one({
        "run": {"root": root, "id": "dash"},
        "jsonl": {},
        "console": {"include": ["critical_path/duration_s", "critical_path/step", "loss"]},
        "wandb": {"mode": "offline", "project": "dash"},
        "tensorboard": {},
        "critical_path": {"settle_s": 1.0, "interval_s": 0.5, "cpu_share": 0.5},
    })
    for step in range(steps):
        set_step(step)
        with record_span("controller_step"):
            with record_span("generate"):
                time.sleep(0.05)
            with record_span("train"):
                time.sleep(0.4 if step == 7 else 0.1)
        record_metric("loss", 1.0 / (step + 1), Reduce.MEAN)
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
