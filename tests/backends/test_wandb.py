"""W&B backend, offline, read back from the run's ``.wandb`` file (no network)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("wandb")

from tests.support.wandb_reader import find_run_file, find_run_files, read_run  # noqa: E402

from forge_obs.backends.wandb import WandbBackend, rank_key  # noqa: E402
from forge_obs.core.types import Metric  # noqa: E402
from forge_obs.backends.record import RunContext, StepRecord  # noqa: E402

FAKE_KEY = "fakekey0123456789abcdef0123456789abcdef01"


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def _run(tmp_path, run_id="exp1", config=None):
    return RunContext(run_id=run_id, run_dir=tmp_path / run_id, config=config or {"wandb": {"mode": "offline"}})


def _record(step, glob=None, per_rank=None, raw=None, wall=None):
    per_rank = per_rank or {}
    return StepRecord(
        step=step,
        run_id="exp1",
        wall_time=wall if wall is not None else 1.7e9 + step,
        global_metrics=[Metric(k, v) for k, v in (glob or {}).items()],
        per_rank={lbl: [Metric(k, v, source=lbl) for k, v in d.items()] for lbl, d in per_rank.items()},
        raw=raw or {},
        sources={lbl: {"label": lbl, "mesh": lbl.split("/")[0], "rank": int(lbl.rsplit("r", 1)[1])} for lbl in per_rank},
    )


def test_rank_key():
    assert rank_key("trainer/r3", "loss") == "trainer/r3/loss"
    assert rank_key("trainer/r3", "trainer/loss") == "trainer/r3/loss"
    assert rank_key("trainer/Train/r3", "buffer/size") == "trainer/Train/r3/buffer/size"


def test_single_run_global_and_per_rank_keys(tmp_path):
    be = WandbBackend({
        "mode": "offline", "project": "forge-obs-test",
        "logging_mode": ["global_reduce", "per_rank_reduce"],
        "step_metrics": {"generator/": "policy_version"},
        "config": {"lr": 1e-3, "model": "tiny"},
    })
    be.init(run=_run(tmp_path))
    samples = [{"prompt": "1+1", "response": "2", "reward": 1.0}, {"prompt": "2+2", "response": "5", "reward": 0.0}]
    for step in range(3):
        be.log_step(_record(
            step,
            glob={"trainer/loss": 1.0 / (step + 1), "generator/tokens": 10.0 * step, "policy_version": step // 2,
                  "rollouts": samples if step == 1 else [], "obs/backend_errors": 0.0},
            per_rank={"trainer/r0": {"trainer/loss": 0.5}, "trainer/r1": {"trainer/loss": 0.7}},
        ))
    be.finish()

    files = find_run_files(tmp_path / "exp1" / "wandb")
    assert len(files) == 1, files  # one run for the experiment
    run = read_run(files[0])
    assert run.run_id == "exp1" and run.group == "exp1"
    assert run.steps() == [0, 1, 2]
    keys = run.keys()
    for k in ("trainer/loss", "generator/tokens", "policy_version", "trainer_step", "wall_time",
              "trainer/r0/loss", "trainer/r1/loss", "obs/backend_errors"):
        assert k in keys, (k, sorted(keys))
    assert [row["trainer_step"] for row in run.history] == [0, 1, 2]
    assert run.history[2]["trainer/loss"] == pytest.approx(1 / 3)
    assert run.history[0]["trainer/r1/loss"] == pytest.approx(0.7)
    # the sample table is logged in step 1's row, with the step
    assert run.history[1].get("rollouts/_type") == "table-file" and run.history[1]["rollouts/nrows"] == 2
    assert run.history[1]["trainer/loss"] == pytest.approx(0.5)
    # config: the user's and forge_obs's own
    assert run.config["lr"] == 1e-3 and run.config["model"] == "tiny"
    assert run.config["forge_obs"]["run_id"] == "exp1"
    # step axes
    defs = {(d["name"] or d["glob_name"]): d["step_metric"] for d in run.metric_defs}
    assert "trainer_step" in defs and "wall_time" in defs
    assert defs.get("generator/*") == "policy_version"


def test_non_monotonic_step_is_not_dropped(tmp_path, caplog):
    be = WandbBackend({"mode": "offline"})
    be.init(run=_run(tmp_path))
    with caplog.at_level(logging.WARNING, logger="forge_obs"):
        be.log_step(_record(5, glob={"loss": 1.0}))
        be.log_step(_record(3, glob={"loss": 2.0}))  # W&B would drop a write to step 3 < 5
    be.finish()
    run = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1"))
    assert [r["loss"] for r in run.history] == [1.0, 2.0]
    assert [r["trainer_step"] for r in run.history] == [5, 3]
    assert run.steps() == [5, 6]
    assert "not above the last logged step" in caplog.text


def test_per_rank_runs_grouped_without_system_metrics(tmp_path):
    be = WandbBackend({"mode": "offline", "logging_mode": ["global_reduce", "per_rank_reduce"], "per_rank": "runs"})
    be.init(run=_run(tmp_path))
    for step in range(2):
        be.log_step(_record(step, glob={"loss": 1.0},
                            per_rank={"trainer/r0": {"loss": 0.5}, "trainer/r1": {"loss": 1.5}}))
    be.finish()
    runs = {r.run_id: r for r in (read_run(p) for p in find_run_files(tmp_path / "exp1" / "wandb"))}
    assert set(runs) == {"exp1", "exp1-trainer-r0", "exp1-trainer-r1"}
    for rid in ("exp1-trainer-r0", "exp1-trainer-r1"):
        assert runs[rid].group == "exp1" and runs[rid].job_type == "trainer"
        assert runs[rid].steps() == [0, 1]
        assert runs[rid].stats_records == 0  # no system-metrics stream per rank
    assert runs["exp1-trainer-r1"].history[0]["loss"] == 1.5
    assert "trainer/r0/loss" not in runs["exp1"].keys()


def test_per_rank_include(tmp_path):
    be = WandbBackend({"mode": "offline", "logging_mode": ["global_reduce", "per_rank_reduce"],
                       "per_rank_include": ["trainer/loss"]})
    be.init(run=_run(tmp_path))
    be.log_step(_record(0, glob={"trainer/loss": 1.0}, per_rank={"trainer/r0": {"trainer/loss": 0.5, "trainer/gn": 2.0}}))
    be.finish()
    keys = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1")).keys()
    assert "trainer/r0/loss" in keys and "trainer/r0/gn" not in keys


def test_torchforge_per_rank_share_run_flag():
    assert WandbBackend({"per_rank_share_run": False}).per_rank == "runs"
    assert WandbBackend({"per_rank_share_run": True}).per_rank == "keys"
    assert WandbBackend({}).per_rank == "keys"


def test_raw_streams_do_not_touch_main_steps(tmp_path):
    be = WandbBackend({"mode": "offline", "logging_mode": ["global_reduce", "per_rank_no_reduce"]})
    be.init(run=_run(tmp_path))
    t0 = 1.7e9
    for step in range(2):
        raw = {"generator/r0": [("gen/latency_s", 0.1 * i, t0 + step + 0.01 * i) for i in range(4)]}
        be.log_step(_record(step, glob={"loss": 1.0}, raw=raw))
    be.finish()
    main = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1"))
    assert main.steps() == [0, 1]
    assert not any(k.startswith("generator/r0") for k in main.keys())
    raw = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1-raw"))
    assert raw.group == "exp1" and raw.stats_records == 0
    vals = [(r["wall_time"], r["generator/r0/gen/latency_s"]) for r in raw.history]
    assert len(vals) == 8 and vals == sorted(vals)
    assert {"name": "", "glob_name": "*", "step_metric": "wall_time"} in raw.metric_defs


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"projekt": "x"}, "projekt.*valid: .*project"),
        ({"per_rank": "each"}, "per_rank.*valid: keys, runs"),
        ({"logging_mode": "per_step"}, "valid: global_reduce"),
        ({"step_metrics": ["generator/"]}, "step_metrics"),
    ],
)
def test_config_errors_name_valid_choices(cfg, match):
    with pytest.raises(ValueError, match=match):
        WandbBackend(cfg)


def test_api_key_never_written(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    be = WandbBackend({"mode": "offline", "config": {"api_key": FAKE_KEY, "lr": 0.1, "max_tokens": 16,
                                                      "hf": {"hf_token": FAKE_KEY}}})
    be.init(run=_run(tmp_path, config={"wandb": {"mode": "offline", "api_key": FAKE_KEY}}))
    be.log_step(_record(0, glob={"loss": 1.0}))
    be.finish()
    run = read_run(find_run_file(tmp_path / "exp1" / "wandb", "exp1"))
    assert run.config["api_key"] == "***" and run.config["lr"] == 0.1
    assert run.config["max_tokens"] == 16 and run.config["hf"] == {"hf_token": "***"}
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert hits == []
    assert FAKE_KEY not in caplog.text


async def test_end_to_end_monarch_single_run(tmp_path, fresh_collector):
    """Real meshes: two trainer ranks record; the controller writes ONE run with per-rank keys."""
    import provisioner_hooks
    from monarch.actor import Actor, endpoint, this_host

    from forge_obs import Reduce, get_or_create_metric_logger, record_metric

    class Trainer(Actor):
        @endpoint
        async def train_step(self, step: int) -> None:
            from monarch.actor import context

            r = context().actor_instance.rank.rank
            record_metric("trainer/loss", float(r + step), Reduce.MEAN)

    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="trainer")
    try:
        await mlogger.init_backends.call_one({
            "run": {"root": str(tmp_path), "id": "e2e"},
            "wandb": {"mode": "offline", "project": "e2e", "logging_mode": ["global_reduce", "per_rank_reduce"],
                      "config": {"algo": "grpo"}, "settings": {"api_key": FAKE_KEY, "console": "off"}},
        })
        trainers = procs.spawn("trainer_actor", Trainer)
        for step in range(2):
            await trainers.train_step.call(step)
            record_metric("policy_version", step, Reduce.MAX)
            await mlogger.flush.call_one(step)
            await mlogger.wait_idle.call_one()  # flush is asynchronous: keep the steps apart
    finally:
        await mlogger.shutdown.call_one()
        await procs.stop()
    files = find_run_files(tmp_path / "e2e" / "wandb")
    assert len(files) == 1, files
    run = read_run(files[0])
    assert run.steps()[:2] == [0, 1]
    assert run.history[0]["trainer/loss"] == pytest.approx(0.5)  # mean of ranks 0 and 1
    assert run.history[1]["trainer/loss"] == pytest.approx(1.5)
    rank_keys = sorted(k for k in run.keys() if k.startswith("trainer/") and k.endswith("/loss") and k != "trainer/loss")
    assert len(rank_keys) == 2, rank_keys
    assert any("/r0/" in k for k in rank_keys) and any("/r1/" in k for k in rank_keys)
    assert run.config["algo"] == "grpo" and run.config["forge_obs"]["run_id"] == "e2e"
    # the API key is in none of our files (meta.json, metrics.jsonl) nor W&B's (run files, debug logs)
    hits = [p for p in tmp_path.rglob("*") if p.is_file() and FAKE_KEY.encode() in p.read_bytes()]
    assert hits == []
    # the same run as a local report: global charts and per-rank charts from metrics.jsonl
    from forge_obs.analysis.report.html import render_report

    page = render_report(tmp_path / "e2e")
    assert 'data-key="trainer/loss"' in page and "trainer/trainer_actor/r1" in page and "Per rank" in page
