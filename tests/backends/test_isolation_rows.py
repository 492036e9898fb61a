"""SAMPLE rows that no backend could write as they are (a tuple key, a row that contains itself)
cost that row at most: keys are turned into strings, a row that contains itself is dropped and
counted (``bad_row``), and every backend writes every other key of every rank, in its step."""

from __future__ import annotations

import json
import logging

import pytest
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import LoggerBackend, Reduce, record_metric
from forge_obs.backends.base import get_logger_backend_class
from forge_obs.core.types import Metric
from forge_obs.backends.record import RunContext, StepRecord
from tests.support.helpers import global_rows, rank_rows, start_logger

FAKE_KEY = "fakekey0123456789abcdef0123456789abcdef01"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def _cycle() -> dict:
    row = {"prompt": "1+1"}
    row["self"] = row
    return row


def _nested_cycle() -> list:
    inner: list = [1]
    row = [{"a": inner}]
    inner.append(row)
    return row


def test_row_keys_become_strings_and_rows_that_contain_themselves_are_dropped(fresh_collector, caplog):
    shared = {"s": 1}
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        record_metric("rows", {("a", "b"): 1, 2: [{None: 3}], "ok": shared, "again": shared}, Reduce.SAMPLE)
        record_metric("rows", _cycle(), Reduce.SAMPLE)
        record_metric("rows", _nested_cycle(), "sample")
        record_metric("rows", {1: "x", "1": "y"}, Reduce.SAMPLE)  # two keys, one string: ambiguous
        plain = {"prompt": "2+2", "score": [1.0, 2.0]}
        record_metric("rows", plain, Reduce.SAMPLE)
    snap = fresh_collector.snapshot()
    rows = snap["states"]["rows"]["rows"]
    assert rows == [{"('a', 'b')": 1, "2": [{"None": 3}], "ok": {"s": 1}, "again": {"s": 1}}, plain]
    assert rows[1] is plain  # a row that is already plain is kept as it is (not copied)
    json.dumps(rows)
    assert dict(snap["counters"]["dropped_by_reason"]) == {"bad_row": 3} and snap["counters"]["dropped_values"] == 3
    assert "'rows'" in caplog.text and "contains itself" in caplog.text


class Rows(Actor):
    """Every rank: a value and a row with a tuple key; rank 0 also a row that contains itself."""

    @endpoint
    async def record(self) -> None:
        rank = current_rank().rank
        record_metric("good/x", 1.0, Reduce.SUM)
        record_metric("rows/t", {("a", "b"): rank, "rank": rank}, Reduce.SAMPLE)
        if rank == 0:
            record_metric("rows/cyc", _cycle(), Reduce.SAMPLE)
            record_metric("rows/cyc", {"ok": 1}, Reduce.SAMPLE)


@pytest.mark.parametrize("aggregate", ["off", "on"])
async def test_every_backend_writes_every_key_of_a_step_with_bad_rows(tmp_path, aggregate, offline_wandb):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.support.wandb_reader import find_run_files, read_run

    modes = ["global_reduce", "per_rank_reduce"]
    mlogger = await start_logger(tmp_path, {
        "aggregate": aggregate, "console": {"logging_mode": modes}, "tensorboard": {"logging_mode": modes},
        "wandb": {"mode": "offline", "project": "rows", "logging_mode": modes}})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="rows")
    try:
        a = pm.spawn("rows", Rows)
        await mlogger.flush.call_one(0)
        await a.record.call()
        await mlogger.flush.call_one(1)
        await mlogger.shutdown.call_one()
    finally:
        await pm.stop()
    row = global_rows(tmp_path)[1]
    m = row["metrics"]
    assert not row.get("missing") and m["good/x"] == 2.0
    assert sorted(r["rank"] for r in m["rows/t"]) == [0, 1]
    assert all(r["('a', 'b')"] == r["rank"] for r in m["rows/t"])
    assert m["rows/cyc"] == [{"ok": 1}]
    assert m["obs/dropped/bad_row"] == 1.0 and m["obs/dropped_values"] == 1.0
    ranks = {r["source"]["rank"]: r["metrics"] for r in rank_rows(tmp_path) if r["step"] == 1}
    assert ranks[0]["rows/t"] == [{"('a', 'b')": 0, "rank": 0}] and ranks[1]["good/x"] == 1.0
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert {name: b["errors"] for name, b in meta["backends"].items()} == dict.fromkeys(
        ["jsonl", "console", "tensorboard", "wandb"], 0)
    assert all(b["steps"] == 2 for b in meta["backends"].values())
    ea = EventAccumulator(str(tmp_path / "t" / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("good/x")] == [(1, 2.0)]
    assert "rows/t/text_summary" in ea.Tags()["tensors"]
    (wb,) = find_run_files(tmp_path / "t" / "wandb")
    history = {h["_step"]: h for h in read_run(wb).history}
    assert history[1]["good/x"] == 2.0 and history[1]["rows/t/nrows"] == 2 and history[1]["rows/cyc/nrows"] == 1
    assert history[1]["rows/t/ncols"] == 2 and history[1]["rows/rows/r0/good/x"] == 1.0


class Unwritable:
    """A value no backend can print: its ``str`` and ``repr`` raise."""

    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


@pytest.mark.parametrize("name", ["jsonl", "console", "tensorboard", "wandb"])
def test_a_value_a_backend_cannot_write_costs_only_that_key(tmp_path, name, offline_wandb):
    """Values that reach a backend as they are (a custom reduction's, rich): each backend writes
    the step's other keys, and what it could not write is counted in its own report."""
    if name == "tensorboard":
        pytest.importorskip("tensorboard")
    cyclic = {"a": 1}
    cyclic["self"] = cyclic
    be = get_logger_backend_class(name)({"mode": "offline"} if name == "wandb" else {})
    be.init(run=RunContext(run_id="r", run_dir=tmp_path / "r"))
    rec = StepRecord(step=1, run_id="r", wall_time=1.0, global_metrics=[
        Metric("good/x", 2.0), Metric("custom/cycle", cyclic, "custom"), Metric("custom/tuple", {("a", 1): 1.0}, "custom"),
        Metric("custom/obj", Unwritable(), "custom"), Metric("rows", [{"o": Unwritable()}], "sample")])
    be.log_step(rec)
    be.finish()
    # the dict that contains itself: flattened by W&B and TensorBoard, so left out there (counted);
    # the local store writes it as its text, the console prints its repr
    assert be.skipped_values == {"jsonl": 0, "console": 0, "tensorboard": 1, "wandb": 1}[name]
    if name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(tmp_path / "r" / "tb"), size_guidance={"scalars": 0})
        ea.Reload()
        assert [e.value for e in ea.Scalars("good/x")] == [2.0] and "custom/tuple/('a', 1)" in ea.Tags()["scalars"]
    if name == "wandb":
        from tests.support.wandb_reader import find_run_files, read_run

        (h,) = read_run(find_run_files(tmp_path / "r" / "wandb")[0]).history
        assert h["good/x"] == 2.0 and h["custom/tuple/('a', 1)"] == 1.0 and h["rows/nrows"] == 1
    if name == "jsonl":
        (line,) = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
        assert line["step"] == 1 and line["metrics"]["good/x"] == 2.0
        m = line["metrics"]
        assert set(m) == {"good/x", "custom/cycle", "custom/tuple", "custom/obj", "rows"}
        assert m["custom/tuple"] == {"('a', 1)": 1.0} and m["custom/obj"] == "<Unwritable>"
        assert m["custom/cycle"] == "{'a': 1, 'self': {...}}" and m["rows"] == [{"o": "<Unwritable>"}]


def test_values_a_backend_left_out_are_in_its_report(fresh_collector):
    import asyncio

    from forge_obs.backends.base import write_each
    from forge_obs.controller.pipeline import FlushPipeline

    class Picky(LoggerBackend):
        def log_step(self, record):
            write_each(self, record.global_metrics, lambda m: 1 / (m.key != "bad"))

    async def run():
        pipe = FlushPipeline({"picky": Picky({})}, "t", flush_timeout_s=5)
        pipe.start()
        record_metric("bad", 1.0)
        record_metric("good", 1.0)
        pipe.begin_cut(0, fresh_collector.swap(), {})
        await pipe.close()
        return pipe.backend_report()

    assert asyncio.run(run())["picky"]["skipped_values"] == 1


@pytest.fixture
def fresh_warners(monkeypatch):
    """Warnings not rate-limited by earlier tests."""
    import forge_obs.backends.jsonl
    import forge_obs.core.plain
    from forge_obs.core.warn import RateLimitedWarner

    for mod in (forge_obs.core.plain, forge_obs.backends.jsonl):
        monkeypatch.setattr(mod, "WARNER", RateLimitedWarner())


def test_a_row_holding_an_int_too_long_for_json_keeps_its_other_fields(tmp_path, fresh_collector, fresh_warners,
                                                                       caplog):
    """The issue's row (``10**5000`` in a SAMPLE row was written as ``"<list>"``, its other fields
    lost, with a warning that it "contains itself"): the int becomes the string of its exact
    digits where it is recorded, the row keeps its other fields in metrics.jsonl, and the
    warning names the key and says what happened."""
    from forge_obs.backends.jsonl import JsonlBackend

    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        record_metric("rows/huge", {"prompt": "p", "n": 10**5000, "reward": 0.5}, Reduce.SAMPLE)
    rows = fresh_collector.snapshot()["states"]["rows/huge"]["rows"]
    assert rows == [{"prompt": "p", "n": "1" + "0" * 5000, "reward": 0.5}]
    assert "record_metric('rows/huge'): a row holds an int of 5001 digits" in caplog.text
    assert "contains itself" not in caplog.text
    be = JsonlBackend({})
    be.init(run=RunContext(run_id="r", run_dir=tmp_path / "r"))
    be.log_step(StepRecord(step=0, run_id="r", wall_time=1.0, global_metrics=[Metric("rows/huge", rows, "sample")]))
    be.finish()
    (line,) = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert line["metrics"]["rows/huge"] == rows


def test_the_local_store_writes_a_custom_value_holding_a_long_int_and_says_why(tmp_path, fresh_warners, caplog):
    """A custom reduction's value reaches the store as it is: an int JSON readers do not take is
    written as its digits, the other values as they are, and nothing claims it contains itself."""
    from forge_obs.backends.jsonl import JsonlBackend

    be = JsonlBackend({})
    be.init(run=RunContext(run_id="r", run_dir=tmp_path / "r"))
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        be.log_step(StepRecord(step=0, run_id="r", wall_time=1.0, global_metrics=[
            Metric("good/x", 2.0), Metric("custom/big", {"n": -(10**5000), "m": 1}, "custom")]))
    be.finish()
    (line,) = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert line["metrics"] == {"good/x": 2.0, "custom/big": {"n": "-1" + "0" * 5000, "m": 1}}
    assert "contains itself" not in caplog.text and "5001 digits" in caplog.text
