"""Console backend: the torchforge block format, grouping, units, compact mode, failure isolation."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from forge_obs.backends.base import LoggerBackend
from forge_obs.backends.console import ConsoleBackend, format_value, unit_for
from forge_obs.metric import LoggingMode, Metric
from forge_obs.pipeline import FlushPipeline
from forge_obs.record import StepRecord


def _rec(step, glob, per_rank=None, missing=None):
    return StepRecord(
        step=step, run_id="c", wall_time=0.0,
        global_metrics=[Metric(k, v) for k, v in glob.items()],
        per_rank={lbl: [Metric(k, v, source=lbl) for k, v in d.items()] for lbl, d in (per_rank or {}).items()},
        missing=missing or [],
    )


def test_default_block_is_torchforge_compatible(capsys):
    ConsoleBackend({}).log_step(_rec(0, {"my_sum_metric": 6.0, "my_max_metric": 3.0, "my_mean_metric": 2.0}))
    out = capsys.readouterr().out
    assert "=== [GlobalReduce] - METRICS STEP 0 ===\nmy_max_metric:  3.0\nmy_mean_metric: 2.0\nmy_sum_metric:  6.0\n" == out


def test_grouped_by_prefix_with_units_and_rank_blocks(capsys):
    be = ConsoleBackend({"logging_mode": ["global_reduce", "per_rank_reduce"]})
    be.log_step(_rec(
        7,
        {"trainer/loss": 0.25, "trainer/step_time_s": 0.0123, "generator/kv_cache_bytes": 1536.0,
         "generator/ttft_ms": {"p50": 12.0, "p90": 30.0, "p99": 95.0, "count": 40}, "buffer/size": 12,
         "obs/backend_errors": 0.0},
        per_rank={"trainer/TrainActor/r3": {"trainer/loss": 0.5}},
        missing=["generator/r1"],
    ))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "=== [GlobalReduce] - METRICS STEP 7 ==="
    assert lines[1:4] == ["-- buffer --", "buffer/size:              12", "-- generator --"]
    assert "generator/kv_cache_bytes: 1.50 KiB" in lines
    assert "generator/ttft_ms:        p50=12ms p90=30ms p99=95ms n=40" in lines
    assert "trainer/step_time_s:      12.3 ms" in lines
    assert not any("obs/" in ln for ln in lines)  # self-metrics hidden by default
    assert "=== [trainer/TrainActor/r3] - METRICS STEP 7 ===" in lines
    assert "[forge_obs] step 7: missing ranks: generator/r1" in lines


def test_compact_every_and_include(capsys):
    be = ConsoleBackend({"compact": True, "every": 2, "include": ["trainer/", "buffer/"],
                         "logging_mode": ["global_reduce", "per_rank_reduce"]})
    for step in range(4):
        be.log_step(_rec(step, {"trainer/loss": 1.0 / (step + 1), "trainer/lr": 1e-4, "buffer/size": 64, "x/y": 1.0},
                         per_rank={"trainer/r0": {"trainer/loss": 0.5}}))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[step 0] buffer: size=64 | trainer: loss=1.0 lr=0.0001",
        "[step 0 trainer/r0] trainer: loss=0.5",
        "[step 2] buffer: size=64 | trainer: loss=0.333333 lr=0.0001",
        "[step 2 trainer/r0] trainer: loss=0.5",
    ]


def test_units():
    assert unit_for("trainer/step_time_s") == "s" and unit_for("gen/tokens_per_s") == "/s"
    assert unit_for("mem/peak_bytes") == "bytes" and unit_for("loss") == ""
    assert unit_for("generator/tokens", {"generator/": "tok"}) == "tok"
    assert format_value(2.5, "s") == "2.50 s" and format_value(0.0005, "s") == "500 us"
    assert format_value(3 * 2**30, "bytes") == "3.00 GiB" and format_value(5.0) == "5.0"


@pytest.mark.parametrize("cfg, match", [({"compakt": True}, "valid: logging_mode, compact"),
                                        ({"every": 0}, "every"), ({"stream": "file"}, "valid: stdout, stderr")])
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        ConsoleBackend(cfg)


class Boom(LoggerBackend):
    def log_step(self, record):
        raise RuntimeError("disk full")


class Keep(LoggerBackend):
    def __init__(self, cfg=None):
        super().__init__(cfg)
        self.records = []

    def log_step(self, record):
        self.records.append(record)


async def test_failing_backend_is_isolated_reported_once_and_counted(caplog):
    keep = Keep({})
    p = FlushPipeline(backends={"boom": Boom({}), "keep": keep}, run_id="iso", flush_timeout_s=5)
    p.start()
    with caplog.at_level(logging.ERROR, logger="forge_obs"):
        for step in range(3):
            p.begin_cut(step, {"states": {"x": {"reduction_type": "sum", "sum": 1.0}}})
            await p.drain()  # every backend took the step before the next is assembled
        await p.close()
    assert [r.step for r in keep.records] == [0, 1, 2]  # the others still get every step
    errs = [r for r in caplog.records if "boom" in r.getMessage()]
    assert len(errs) == 1 and "disk full" in errs[0].getMessage()  # reported once, with the name
    # errors so far when each step was assembled (the backends log apart from the assembly)
    assert [r.global_dict()["obs/backend_errors"] for r in keep.records] == [0.0, 1.0, 2.0]
    assert p.backend_errors == 3


async def test_failing_backend_through_the_global_logger(tmp_path, fresh_collector, capsys):
    """A backend raising in log_step: console and the JSONL store still get every step."""
    from forge_obs import Reduce, record_metric, register_backend
    from tests.helpers import global_rows, start_logger

    register_backend("test_boom", Boom)
    mlogger = await start_logger(tmp_path, {"test_boom": {}, "console": {"compact": True}}, run_id="iso")
    try:
        for step in range(3):
            record_metric("trainer/loss", 0.5, Reduce.MEAN)
            await mlogger.flush.call_one(step)
            await mlogger.wait_idle.call_one()
    finally:
        await mlogger.shutdown.call_one()
    rows = global_rows(tmp_path, "iso")
    assert sorted(rows) == [0, 1, 2]
    assert rows[2]["metrics"]["obs/backend_errors"] == 2.0  # errors so far when step 2 was assembled
    meta = json.loads((tmp_path / "iso" / "meta.json").read_text())
    assert meta["backends"]["test_boom"]["errors"] == 3 and meta["unfinished_backends"] == []
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if ln.startswith("[step")] == [f"[step {s}] trainer: loss=0.5" for s in range(3)]
