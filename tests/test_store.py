"""The JSONL store: durable rows per step, identity fields, a torn last line skipped."""

import json
import math

from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.metric import Metric
from forge_obs.record import RunContext, StepRecord
from forge_obs.run import RunConfig, redact, write_meta
from forge_obs.store import read_jsonl, read_metrics


def _record(step):
    return StepRecord(
        step=step,
        run_id="r",
        wall_time=100.0 + step,
        global_metrics=[Metric("loss", 0.5 * step), Metric("bad", math.nan)],
        per_rank={"trainer/Trainer/r0": [Metric("loss", 1.0, source="trainer/Trainer/r0")]},
        raw={"trainer/Trainer/r0": [("loss", 1.0, 123.0)]},
        sources={"trainer/Trainer/r0": {"label": "trainer/Trainer/r0", "mesh": "trainer", "rank": 0, "pid": 7}},
        missing=["gen/r1"] if step else [],
    )


def test_rows_are_on_disk_after_each_step_and_read_back(tmp_path):
    run = RunContext(run_id="r", run_dir=tmp_path / "r")
    be = JsonlBackend({"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]})
    be.init(run=run)
    be.log_step(_record(0))
    # durable before finish(): another reader sees the step already
    rows = read_metrics(run.run_dir, None)
    assert [r["mode"] for r in rows] == ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]
    be.log_step(_record(1))
    be.finish()
    g = read_metrics(run.run_dir)
    assert [r["step"] for r in g] == [0, 1]
    assert g[1]["metrics"]["loss"] == 0.5 and math.isnan(g[1]["metrics"]["bad"])
    assert g[1]["missing"] == ["gen/r1"] and "missing" not in g[0]
    pr = read_metrics(run.run_dir, "per_rank_reduce")[0]
    assert pr["source"] == {"label": "trainer/Trainer/r0", "mesh": "trainer", "rank": 0, "pid": 7}
    raw = read_metrics(run.run_dir, "per_rank_no_reduce")[0]
    assert raw["values"] == [["loss", 1.0, 123.0]]


def test_a_torn_last_line_is_skipped_and_a_corrupt_middle_line_warns(tmp_path, caplog):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1, "metr\n{"step": 2}\n{"step": 3, "met')
    assert [r["step"] for r in read_jsonl(p)] == [0, 2]
    assert sum("is not valid JSON" in r.getMessage() for r in caplog.records) == 1


def test_resumed_run_appends_and_meta_records_both_starts(tmp_path):
    run = RunContext(run_id="r", run_dir=tmp_path / "r")
    for start, step in ((1.0, 0), (2.0, 1)):
        be = JsonlBackend({})
        be.init(run=run)
        be.log_step(_record(step))
        be.finish()
        write_meta(run.run_dir, start_time=start, config={"wandb": {"api_key": "SECRET", "project": "p"}})
    assert [r["step"] for r in read_metrics(run.run_dir)] == [0, 1]
    meta = json.loads((run.run_dir / "meta.json").read_text())
    assert meta["starts"] == [1.0, 2.0]
    assert meta["config"]["wandb"] == {"api_key": "***", "project": "p"}
    assert "SECRET" not in (run.run_dir / "meta.json").read_text()


def test_run_config_defaults_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_OBS_RUN_ID", "from-env")
    assert RunConfig.from_config({"root": str(tmp_path)}).run_dir == tmp_path / "from-env"
    monkeypatch.delenv("FORGE_OBS_RUN_ID")
    assert RunConfig.from_config({}).run_id != RunConfig.from_config({}).run_id
    for bad in ({"dir": "x"}, {"id": "a/b"}):
        try:
            RunConfig.from_config(bad)
        except ValueError as e:
            assert "valid" in str(e) or "plain directory" in str(e)
        else:
            raise AssertionError(bad)
    assert redact({"a": [{"hf_token": 1}], "b": 2}) == {"a": [{"hf_token": "***"}], "b": 2}
