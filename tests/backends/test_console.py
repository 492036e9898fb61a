"""Console backend: the torchforge block format, grouping, units, compact mode, failure isolation."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from forge_obs.backends.base import LoggerBackend
from forge_obs.backends.console import ConsoleBackend
from forge_obs.core.formatting import format_value, unit_for
from forge_obs.core.types import LoggingMode, Metric
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.backends.record import StepRecord


def _rec(step, glob, per_rank=None, missing=None, sources=None):
    return StepRecord(
        step=step, run_id="c", wall_time=0.0,
        global_metrics=[Metric(k, v) for k, v in glob.items()],
        per_rank={lbl: [Metric(k, v, source=lbl) for k, v in d.items()] for lbl, d in (per_rank or {}).items()},
        missing=missing or [],
        sources={lbl: {"label": lbl} for lbl in (sources or [])},
    )


def test_default_block_is_torchforge_compatible(capsys):
    ConsoleBackend({}).log_step(_rec(0, {"my_sum_metric": 6.0, "my_max_metric": 3.0, "my_mean_metric": 2.5}))
    out = capsys.readouterr().out
    assert "=== [GlobalReduce] - METRICS STEP 0 ===\nmy_max_metric:  3\nmy_mean_metric: 2.5\nmy_sum_metric:  6\n" == out


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
    assert "generator/kv_cache_bytes: 1.5 KiB" in lines
    assert "generator/ttft_ms:        p50=12ms p90=30ms p99=95ms n=40" in lines
    assert "trainer/step_time_s:      12.3 ms" in lines
    assert not any("obs/" in ln for ln in lines)  # self-metrics hidden by default
    assert "=== [trainer/TrainActor/r3] - METRICS STEP 7 ===" in lines
    assert "[forge_obs] step 7: missing (no values within flush_timeout_s; not waited for again): generator/r1" in lines


def test_compact_every_and_include(capsys):
    be = ConsoleBackend({"compact": True, "every": 2, "include": ["trainer/", "buffer/"],
                         "logging_mode": ["global_reduce", "per_rank_reduce"]})
    for step in range(4):
        be.log_step(_rec(step, {"trainer/loss": 1.0 / (step + 1), "trainer/lr": 1e-4, "buffer/size": 64, "x/y": 1.0},
                         per_rank={"trainer/r0": {"trainer/loss": 0.5}}))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[step 0] buffer  size=64",
        "         trainer loss=1 lr=0.0001",
        "[step 0 trainer/r0] trainer loss=0.5",
        "[step 2] buffer  size=64",
        "         trainer loss=0.3333 lr=0.0001",
        "[step 2 trainer/r0] trainer loss=0.5",
    ]


def test_units():
    assert unit_for("trainer/step_time_s") == "s" and unit_for("gen/tokens_per_s") == "/s"
    assert unit_for("mem/peak_bytes") == "bytes" and unit_for("loss") == ""
    assert unit_for("generator/tokens", {"generator/": "tok"}) == "tok"
    assert format_value(2.5, "s") == "2.5 s" and format_value(0.0005, "s") == "500 us"
    assert format_value(3 * 2**30, "bytes") == "3 GiB" and format_value(5.0) == "5"


def test_numbers_integers_as_integers_4_significant_digits():
    assert [format_value(v) for v in (0.0, 256.0, -3.0, 1234567.0, 1.49012e-08, 0.2400641, 2863.6176, 12345.6, 3.2e9)] == [
        "0", "256", "-3", "1234567", "1.49e-08", "0.2401", "2864", "12.35k", "3.2G"]
    assert format_value(0.06990, "ms") == "69.9 us" and format_value(32.5645, "s") == "32.56 s"
    assert format_value(2.543, "%") == "2.543 %" and format_value(5784.2, "/s") == "5784 /s"
    # a sketch's quantiles (1 % relative error): 3 digits, snapped to the integer they are within 1 % of
    dist = {"p50": 5.98951037117262, "p90": 7.02879302153477, "p99": 8.3, "count": 386}
    assert format_value(dist) == "p50=6 p90=7 p99=8.3 n=386"
    assert format_value({"p50": 0.01234, "p90": 0.0456, "p99": 0.1, "count": 3}, "s") == "p50=12.3ms p90=45.6ms p99=100ms n=3"


def _grpo_like_metrics(step: int) -> dict:
    """A step of the GRPO app's console: ~80 keys over 5 groups, long names, integral floats."""
    m = {}
    for g, n in (("trainer", 22), ("generator", 20), ("buffer", 12), ("reward", 6), ("service", 6)):
        for i in range(n):
            m[f"{g}/some_rather_long_metric_name_{i}_s" if i % 3 == 0 else f"{g}/metric_{i}_episodes"] = (
                float(i * 64) if i % 2 else 0.123456789 * (i + 1) + step)
    m["generator/seq_len_tokens"] = {"p50": 5.98951037117262, "p90": 7.02879302153477, "p99": 7.02879302153477, "count": 386}
    return m


def test_compact_fits_120_columns_grouped(capsys):
    be = ConsoleBackend({"compact": True})
    be.log_step(_rec(10, _grpo_like_metrics(10)))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 5 and max(len(ln) for ln in lines) <= 120, max(len(ln) for ln in lines)
    # each group starts a line of its own, in order; continuation lines are indented under its values
    starts = [ln.split()[2] if ln.startswith("[step") else ln.split()[0] for ln in lines if not ln.startswith(" " * 18)]
    assert starts == ["buffer", "generator", "reward", "service", "trainer"], lines
    assert lines[0].startswith("[step 10] buffer    ")
    text = " ".join(lines)
    assert "metric_1_episodes=64 " in text and ".0 " not in text and "seq_len_tokens=p50=6,p90=7,p99=7,n=386" in text
    # four significant digits
    assert "some_rather_long_metric_name_6_s=10.86s" in text
    narrow = ConsoleBackend({"compact": True, "width": 80})
    narrow.log_step(_rec(10, _grpo_like_metrics(10)))
    assert max(len(ln) for ln in capsys.readouterr().out.splitlines()) <= 80


def test_missing_rank_reported_once_when_missing_and_once_when_back(capsys):
    be = ConsoleBackend({"compact": True, "every": 100})
    gen1 = "generator_1/replica1/r0"
    for step in range(30):
        missing = [gen1] if 5 <= step < 20 else []
        sources = ["trainer/r0"] + ([] if 5 <= step < 20 else [gen1])
        if step >= 25:  # its mesh was stopped: neither expected nor reporting
            sources = ["trainer/r0"]
        be.log_step(_rec(step, {"trainer/loss": 1.0}, missing=missing, sources=sources))
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[forge_obs]")]
    assert notes == [
        f"[forge_obs] step 5: missing (no values within flush_timeout_s; not waited for again): {gen1}",
        f"[forge_obs] step 20: back (late values in this step): {gen1}",
    ]
    # a rank that goes missing and whose mesh is then stopped: one line, nothing more
    be = ConsoleBackend({"compact": True, "every": 100})
    for step in range(10):
        be.log_step(_rec(step, {"trainer/loss": 1.0}, missing=[gen1] if step in (3, 4) else [], sources=["trainer/r0"]))
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[forge_obs]")]
    assert len(notes) == 1 and "step 3: missing" in notes[0]


@pytest.mark.parametrize("cfg, match", [({"compakt": True}, "valid: logging_mode, compact"),
                                        ({"width": 20}, "width"),
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
    from tests.support.helpers import global_rows, start_logger

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
    assert [ln for ln in out.splitlines() if ln.startswith("[step")] == [f"[step {s}] trainer loss=0.5" for s in range(3)]


def test_docs_console_samples_are_what_it_prints():
    """docs/backends.md shows a block and a compact step: the same metrics print exactly that."""
    import re
    from pathlib import Path

    from forge_obs.backends.console import format_block, format_compact

    text = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    section = text[text.index("## Console"):text.index("## Local report")]
    block, compact = re.findall(r"```\n(.*?)```", section, re.S)
    ms = [Metric("buffer/size", 128.0), Metric("generator/kv_cache_bytes", 3 * 2**30),
          Metric("generator/tokens_per_s", 2750.4), Metric("trainer/advantage_mean", 1.49012e-08),
          Metric("trainer/loss", 0.25), Metric("trainer/step_time_s", 1.5)]
    assert block.rstrip("\n") == format_block("GlobalReduce", 3, ms)
    assert compact.rstrip("\n") == format_compact("step 3", ms)


BAD_KEY = "x\x1b[31mred\nfake: 1\r\tz\x9b2J\u2028"
SHOWN = "x\\x1b[31mred\\nfake: 1\\r\\tz\\x9b2J\\u2028"  # each control character as repr writes it


@pytest.mark.parametrize("compact", [False, True])
def test_control_characters_in_keys_labels_and_values_print_escaped(capsys, compact):
    """A key, a rank label or a text value holding an ANSI escape, a newline or another control
    character prints it visibly escaped: the terminal is not recoloured, no fake line appears."""
    label = "mesh\x1b]0;title\x07/r0"
    be = ConsoleBackend({"compact": compact, "logging_mode": ["global_reduce", "per_rank_reduce"]})
    be.log_step(_rec(3, {BAD_KEY: 2.0, "text": "a\x1b[2Jb", "d": {"p\nq": 1.0}},
                     per_rank={label: {"k": 1.0}}, missing=[label]))
    be.log_stream(Metric(BAD_KEY, 1.0, timestamp=0.0), 3, source=label)
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\r\t\x9b\x07\u2028"), repr(out)
    assert SHOWN in out and "a\\x1b[2Jb" in out and "p\\nq=1" in out and "mesh\\x1b]0;title\\x07/r0" in out
    assert not any(ln.startswith("fake") for ln in out.splitlines())


def test_printable_keeps_printable_text_as_it_is():
    from forge_obs.core.safe import printable

    assert printable("trainer/loss é 日本") == "trainer/loss é 日本"
    assert printable(BAD_KEY) == SHOWN


class _Writes:
    """A stream that keeps each ``write`` call apart."""

    def __init__(self):
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("config", [{}, {"compact": True}, {"logging_mode": ["global_reduce", "per_rank_reduce"]}])
def test_each_block_and_line_is_one_write(monkeypatch, config):
    """An alert callback (the alerts' sink thread) and the user's code print while the console
    backend prints on its thread: a block, a missing-rank note and an alert's console line each
    go out in one ``write``, so another thread's output comes between them, never inside one."""
    import sys

    from forge_obs.alerts.sinks import console_sink

    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    be = ConsoleBackend(config)
    be.log_step(_rec(0, {"trainer/loss": 1.0, "generator/tokens": 5.0}, per_rank={"trainer/r0": {"trainer/loss": 1.0}},
                     missing=["trainer/r1"]))
    console_sink({"state": "firing", "rule": "threshold", "where": "global", "step": 0, "message": "loss > 0.5"})
    assert len(out.writes) >= 3 and all(w.endswith("\n") and len(w) > 1 for w in out.writes), out.writes
    assert any("loss" in w for w in out.writes) and any("missing" in w for w in out.writes)
