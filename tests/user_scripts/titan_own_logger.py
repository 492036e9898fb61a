"""A TorchTitan run that never used forge_obs: TorchTitan's own structured logger writes its
per-rank JSONL. argv: output_dir rank."""

import sys

from torchtitan.observability import structured_logger as sl

out, rank = sys.argv[1], int(sys.argv[2])
sl.init_structured_logger(source="trainer", output_dir=out, rank=rank)
sl.log_trace_instant("training_start")
for step in range(1, 4):
    sl.set_step(step)
    if step == 2:
        sl.add_step_tag("gc")
    with sl.log_trace_span("train_step"):
        with sl.log_trace_span("fwd_bwd"):
            pass
        sl.log_trace_scalar({"train.loss": 2.5 - step + rank})
try:
    with sl.log_trace_span("ckpt"):
        raise RuntimeError("disk full")
except RuntimeError:
    pass
