"""The same script on forge_obs: one import changed. argv: output_dir rank [ranks [max_file_mb]]."""

import sys

from forge_obs import titan as sl

out, rank = sys.argv[1], int(sys.argv[2])
ranks = sys.argv[3] if len(sys.argv) > 3 else "all"
max_file_mb = float(sys.argv[4]) if len(sys.argv) > 4 else 64.0
sl.init_structured_logger(source="trainer", output_dir=out, rank=rank, ranks=ranks, run_id="exp7", max_file_mb=max_file_mb)
sl.log_trace_instant("training_start")
for step in range(1, 4):
    sl.set_step(step)
    if step == 2:
        sl.add_step_tag("gc")
        assert sl.get_step_tags() == ("gc",)
    with sl.log_trace_span("train_step"):
        with sl.log_trace_span("fwd_bwd"):
            pass
        sl.log_trace_scalar({"train.loss": 2.5 - step + rank, "bad": "x"})
assert sl.get_step() == 3 and sl.get_step_tags() == () and sl.get_relative_step() == 3
try:
    with sl.log_trace_span("ckpt"):
        raise RuntimeError("disk full")
except RuntimeError:
    pass
sl.init_structured_logger(source="trainer", output_dir=out, enable=False)  # one flag turns it off
with sl.log_trace_span("after_disable"):
    sl.log_trace_instant("after_disable")
from forge_obs.recording import timeline

timeline.close()
print("DONE", rank)
