"""TensorBoard backend: events read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from forge_obs.backends.tensorboard import TensorBoardBackend  # noqa: E402
from forge_obs.core.types import Metric  # noqa: E402
from forge_obs.backends.record import RunContext, StepRecord  # noqa: E402


def _read(log_dir):
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def test_scalars_per_rank_axes_histograms_and_samples(tmp_path):
    run = RunContext(run_id="tb1", run_dir=tmp_path / "tb1")
    be = TensorBoardBackend({
        "logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"],
        "step_metrics": {"generator/": "policy_version"},
    })
    be.init(run=run)
    t0 = 1.7e9
    for step in range(3):
        rec = StepRecord(
            step=step, run_id="tb1", wall_time=t0 + 10 * step,
            global_metrics=[
                Metric("trainer/loss", 1.0 / (step + 1)),
                Metric("generator/tokens", 100.0 * step),
                Metric("policy_version", float(step // 2)),
                Metric("gen/latency_s", {"p50": 0.1, "p90": 0.2, "p99": 0.3, "count": 4}, "distribution"),
                Metric("rollouts", [{"prompt": "1+1", "answer": "2|3"}] if step == 0 else []),
            ],
            per_rank={"trainer/r0": [Metric("trainer/loss", 0.5)], "trainer/r1": [Metric("trainer/loss", 0.7)]},
            raw={"gen/r0": [("gen/latency_s", 0.1 * (i + 1), t0 + 10 * step + i) for i in range(4)]},
        )
        be.log_step(rec)
    be.finish()

    tb_dir = tmp_path / "tb1" / "tb"
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1  # one writer per run
    ea = _read(tb_dir)
    tags = ea.Tags()
    loss = ea.Scalars("trainer/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [round(e.value, 4) for e in loss] == [1.0, 0.5, 0.3333]
    assert [e.wall_time for e in loss] == [t0, t0 + 10, t0 + 20]
    # generator/* plotted against policy_version
    assert [e.step for e in ea.Scalars("generator/tokens")] == [0, 0, 1]
    # per-rank, labelled
    assert [e.value for e in ea.Scalars("trainer/r1/loss")] == pytest.approx([0.7] * 3)
    # distribution metric: quantile scalars + histogram of the raw values
    assert "gen/latency_s/p99" in tags["scalars"]
    hist = ea.Histograms("gen/latency_s/hist")
    assert [h.step for h in hist] == [0, 1, 2] and hist[0].histogram_value.num == 4
    # raw values keep their own timestamps
    raw = ea.Scalars("gen/r0/latency_s")
    assert len(raw) == 12 and raw[1].wall_time == t0 + 1
    # sample rows as a text table
    assert "rollouts/text_summary" in tags["tensors"]


def test_bad_config_raises_with_choices():
    with pytest.raises(ValueError, match="valid: logging_mode, log_dir"):
        TensorBoardBackend({"logdir": "x"})
    with pytest.raises(ValueError, match="valid: global_reduce"):
        TensorBoardBackend({"logging_mode": "sometimes"})


async def test_through_the_global_logger(tmp_path, fresh_collector):
    """init on the logger actor, log_step in its backend thread, finish at shutdown."""
    from forge_obs import Reduce, record_metric
    from tests.support.helpers import start_logger

    mlogger = await start_logger(tmp_path, {"tensorboard": {"step_metrics": {"generator/": "policy_version"}}}, run_id="tbe")
    try:
        for step in range(3):
            record_metric("trainer/loss", 1.0 + step, Reduce.MEAN)
            record_metric("generator/tokens", 10.0, Reduce.SUM)
            record_metric("policy_version", step * 2, Reduce.MAX)
            await mlogger.flush.call_one(step)
    finally:
        await mlogger.shutdown.call_one()
    ea = _read(tmp_path / "tbe" / "tb")
    assert [(e.step, e.value) for e in ea.Scalars("trainer/loss")] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert [e.step for e in ea.Scalars("generator/tokens")] == [0, 2, 4]
    assert "obs/backend_errors" in ea.Tags()["scalars"]
