"""The user-script layer: each file of ``tests/user_scripts/`` is a standalone script written as a
user writes one — actors defined in the script itself (Monarch pickles them by value), meshes
spawned without a name or with the same name for every replica — run with ``python script.py``
in a fresh process whose working directory is not the repository (nothing of the script is
importable by its children). Its printed values are asserted by arithmetic here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import CHILD_PATH, run_as_user

ROOT = Path(__file__).resolve().parents[2]
#: this checkout\'s forge_obs (src/) and its tests/apps helpers (the root), as a child process sees them
SCRIPTS = ROOT / "tests" / "user_scripts"


def run_script(name: str, tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 300) -> str:
    return run_as_user(SCRIPTS / name, tmp_path, *args, env=env, timeout=timeout).stdout


def last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def sql(run_dir: Path, query: str) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "sql", str(run_dir), query, "--format", "json"],
                         env=dict(os.environ, PYTHONPATH=CHILD_PATH), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_traced_actors_defined_in_the_script(tmp_path):
    """@trace / Tracer / trace / record_span / a custom reduction and backend, all defined in the
    script, on two unnamed meshes of 2 procs; 3 calls of each endpoint per rank and step."""
    out = run_script("traced_actors.py", tmp_path, str(tmp_path / "runs"))
    steps = last_json(out)["steps"]
    assert sorted(steps) == ["0", "1"]
    calls = 2 * 3  # ranks x calls, per step
    for step in ("0", "1"):
        g, ranks = steps[step]["global"], steps[step]["ranks"]
        for prefix in ("sync/cpu", "sync/gpu", "sync/mem", "async/cpu", "async/gpu_mem", "async/init_tracer",
                       "async/endpoint_tracer", "ctx/region"):
            assert g[f"{prefix}/total_duration_dist_s"]["count"] == calls, prefix
            assert 0 < g[f"{prefix}/total_duration_avg_s"] <= g[f"{prefix}/total_duration_max_s"], prefix
        for key in ("async/init_tracer/a", "async/endpoint_tracer/b", "ctx/region/inner"):
            assert g[f"{key}/duration_dist_s"]["count"] == calls, key
        assert g["sync/x"] == 2 * (0 + 1 + 2)          # SUM over 2 ranks of x = 0, 1, 2
        assert g["async/range"] == (10 * 1 + 2) - 0    # the script's own reduction: rank 1's max - rank 0's min
        assert g["async/spans"] == calls
        assert g["span/async/span_cm/duration_s"] > 0
        # the two unnamed meshes: distinct labels, each rank its own series
        assert sorted(ranks) == ["mesh/sync/r0", "mesh/sync/r1", "mesh_1/asy/r0", "mesh_1/asy/r1"]
        assert [ranks[f"mesh/sync/r{r}"]["sync/x"] for r in (0, 1)] == [3.0, 3.0]
        assert [ranks[f"mesh_1/asy/r{r}"]["async/range"] for r in (0, 1)] == [2.0, 2.0]
    spans = sql(tmp_path / "runs" / "traced", "SELECT name, mesh, rank, count(*) AS n FROM spans "
                "WHERE name LIKE 'async/%' GROUP BY ALL ORDER BY ALL")
    # @trace / Tracer regions (and a Tracer's steps) are spans too, as record_span's are
    names = ("async/cpu", "async/endpoint_tracer", "async/endpoint_tracer/b", "async/gpu_mem", "async/init_tracer",
             "async/init_tracer/a", "async/span_cm", "async/span_decorated")
    assert [(s["name"], s["mesh"], s["rank"], s["n"]) for s in spans] == [
        (name, "mesh_1", r, 2 * 3) for name in names for r in (0, 1)]


def _blocks(out: str) -> dict[str, float]:
    """``=== [label] - METRICS STEP 0 ===`` blocks of one key -> {label: value}."""
    lines = out.splitlines()
    return {ln[len("=== ["): ln.index("]")]: float(lines[i + 1].split(":")[1])
            for i, ln in enumerate(lines) if ln.startswith("=== [") and "METRICS STEP" in ln}


def test_forge_doc_global_reduce(tmp_path):
    out = run_script("forge_doc.py", tmp_path, "global_reduce")
    assert _blocks(out) == {"GlobalReduce": (0 + 1) * 2 * 2}  # (rank_0 + rank_1) * 2 steps * 2 replicas


def test_forge_doc_per_rank_reduce_keeps_replicas_apart(tmp_path):
    """Two replicas spawned without a name, the same actor name on both: four series."""
    out = run_script("forge_doc.py", tmp_path, "per_rank_reduce")
    assert _blocks(out) == {"mesh/MyActor/r0": 0.0, "mesh/MyActor/r1": 2.0,      # rank * 2 steps
                            "mesh_1/MyActor/r0": 0.0, "mesh_1/MyActor/r1": 2.0}


def test_forge_doc_per_rank_no_reduce(tmp_path):
    out = run_script("forge_doc.py", tmp_path, "per_rank_no_reduce")
    raw = sorted(ln.split("] ")[0] + "] " + ln.rsplit(":", 1)[1].strip() for ln in out.splitlines()
                 if "INFO my_sum_rank_metric" in ln)
    assert raw == sorted(f"[{m}/MyActor/r{r}] {r}" for m in ("mesh", "mesh_1") for r in (0, 1) for _ in range(2))


def test_forge_doc_basics_tracer_custom_backend_and_reduction(tmp_path):
    """Sections 1.1, 1.2, 3.1 and 4: the document's own custom backend and torchforge-style
    accumulator (get_value / get_reduced_value_from_states), defined in the script."""
    import ast

    out = run_script("forge_doc.py", tmp_path, "basics")
    batches = [dict(ast.literal_eval(m.group(1))) for m in re.finditer(r"Controller (\[\(.*?\)\])", out)]
    assert len(batches) == 2
    step0, step1 = batches
    assert (step0["my_sum_metric"], step0["my_max_metric"], step0["my_mean_metric"]) == (6.0, 3.0, 2.0)
    assert step1["my_cuda_loop/my_metric_mm_a_b/duration_dist_s/count"] == 2 * 3   # 2 calls x 3 steps
    assert step1["my_cuda_loop/total_duration_dist_s/count"] == 2
    assert step1["my_reward_fn/total_duration_dist_s/count"] == 2 * 3              # 2 ranks x 3 calls
    assert step1["doc/custom_mean"] == (-1.0 + 2.0 + 5.0) / 3                      # the same 3 values on 2 ranks
    assert step1["obs/dropped_values"] == 0


def test_rl_loop_from_the_docs(tmp_path):
    """Trainer on an unnamed mesh, two generator replicas spawned with one name, a buffer; every
    view keeps the replicas apart, W&B (offline) and the local store agree step by step, the
    alert rule fires and resolves, and trainer rank 1 (slowed on purpose) is the one straggler
    named, live and by the doctor."""
    from forge_obs.backends.wandb import rank_key
    from forge_obs.analysis.store import read_metrics
    from tests.support.wandb_reader import find_run_file, read_run

    out = run_script("rl_loop.py", tmp_path, str(tmp_path / "runs"))
    run_dir = Path(last_json(out)["run_dir"])
    steps = range(8)
    g = {r["step"]: r["metrics"] for r in read_metrics(run_dir, "global_reduce")}
    assert sorted(g) == list(steps)
    for s in steps:
        assert g[s]["trainer/loss"] == pytest.approx(1 / (s + 1) + 0.5)   # mean over ranks of 1/(s+1) + rank
        assert (g[s]["generator/tokens"], g[s]["generator/requests"], g[s]["buffer/size"]) == (10 + 20, 2, 2 * (s + 1))
    labels = {"generator/generator/r0": 10.0, "generator_1/generator/r0": 20.0}
    per_rank = read_metrics(run_dir, "per_rank_reduce")
    for s in steps:
        got = {r["source"]["label"]: r["metrics"] for r in per_rank if r["step"] == s}
        assert sorted(set(got) - {"Controller"}) == ["generator/generator/r0", "generator_1/generator/r0", "mesh/trainer/r0",
                               "mesh/trainer/r1", "mesh_1/buffer/r0"]
        assert {lb: got[lb]["generator/tokens"] for lb in labels} == labels
    raw = read_metrics(run_dir, "per_rank_no_reduce")
    tokens = sorted((r["source"]["label"], v[1]) for r in raw for v in r["values"] if v[0] == "generator/tokens")
    assert tokens == sorted((lb, v) for lb, v in labels.items() for _ in steps)
    # W&B, read back from its offline files: the same values, per rank under distinct keys
    wb = read_run(find_run_file(run_dir / "wandb", "rl"))
    assert [h["_step"] for h in wb.history] == list(steps)
    assert [h["trainer/loss"] for h in wb.history] == pytest.approx([1 / (s + 1) + 0.5 for s in steps])
    for lb, v in labels.items():
        assert [h[rank_key(lb, "generator/tokens")] for h in wb.history] == [v] * len(steps)
    # live alerts: the rule fires at step 0 (1.5 > 1.2) and resolves at step 1; the straggler is rank 1
    alerts = {tuple(ln.split()[1:3] + ln.split()[4:5]) for ln in out.splitlines() if ln.startswith("ALERT ")}
    assert "ALERT firing threshold 0 global" in out and "ALERT resolved threshold 1 global" in out
    assert alerts == {("firing", "threshold", "global"), ("resolved", "threshold", "global"),
                      ("firing", "straggler", "mesh/trainer/r1")}, alerts
    # the doctor, offline: the same rank and nothing else
    res = subprocess.run([sys.executable, "-m", "forge_obs.cli", "doctor", str(run_dir), "--json"],
                         env=dict(os.environ, PYTHONPATH=CHILD_PATH), capture_output=True, text=True, timeout=120)
    findings = json.loads(res.stdout)["findings"]
    assert [(f["kind"], f["where"]) for f in findings] == [("straggler", "mesh/trainer/r1")], findings


def test_gpu_traced_class_sent_by_value(tmp_path):
    """GPU timers and track_memory on a class sent by value, run under sync-debug "error"
    (skips without CUDA; needs no Monarch, so it runs on a GPU machine without it)."""
    data = last_json(run_script("gpu_by_value.py", tmp_path))
    if "skipped" in data:
        pytest.skip(data["skipped"])
    calls = 5
    v = data["values"]
    assert data["module"] == "__main__"  # the class travelled by value
    assert v["model/forward/total_duration_dist_s"]["count"] == 2 * calls   # direct + through step_async
    assert v["model/step_async/total_duration_dist_s"]["count"] == calls
    assert v["model/init_tracer/mm/duration_dist_s"]["count"] == 2 * calls
    assert 0 < v["model/forward/total_duration_avg_s"] <= v["model/forward/total_duration_max_s"]
    assert v["model/forward/memory_peak_max_gb"] > 0 and "model/forward/memory_delta_end_start_avg_gb" in v
    assert v["model/out"] == v["model/out"]  # a number, read from the device once


def test_probed_cuts_from_the_docs(tmp_path):
    """``"probe_round_trip": True`` with actors defined in the script, an unnamed mesh and two
    replicas spawned with one name: every step has exactly its values, small cuts and large
    ones alike, beside the raw round trip and the cut's parts."""
    from forge_obs.analysis.store import read_metrics

    out = run_script("probed_cuts.py", tmp_path, str(tmp_path / "runs"))
    run_dir = Path(last_json(out)["run_dir"])
    g = {r["step"]: r["metrics"] for r in read_metrics(run_dir, "global_reduce")}
    for s in range(4):
        n_keys = 10 if s % 2 == 0 else 500
        m = g[s]
        # 2 worker ranks record step + rank under every key; each replica one request
        assert [m[f"work/k{i}"] for i in (0, n_keys - 1)] == [2.0 * s + 1.0] * 2, s
        assert f"work/k{n_keys}" not in m and m["replica/requests"] == 2
        assert m["obs/missing_ranks"] == 0 and m["obs/late_ranks"] == 0
        assert m["obs/raw_round_trip_s"] > 0.0 and m["obs/cut/blocked_s"] >= m["obs/cut/send_s"] > 0.0
    labels = {r["source"]["label"] for r in read_metrics(run_dir, "per_rank_reduce")} - {"Controller"}
    assert labels == {"mesh/worker/r0", "mesh/worker/r1", "replica/replica/r0", "replica_1/replica/r0"}


def test_ranks_running_the_same_code(tmp_path):
    """One actor class on an unnamed mesh and on two replicas spawned with one name, all
    recording the same keys in the same order (the column-wise merge), small cuts and large
    ones alike; the script's own backend takes only some of the hooks' keywords."""
    out = run_script("same_code_ranks.py", tmp_path, str(tmp_path / "runs"))
    steps = {d["step"]: d["values"] for d in map(json.loads, out.splitlines()) if "step" in d}
    assert sorted(steps) == [0, 1, 2, 3]
    for s, v in steps.items():
        n_keys = 10 if s % 2 == 0 else 300
        assert len(v) == 3 * n_keys, s
        for i in (0, n_keys // 2, n_keys - 1):
            assert v[f"loss/k{i}"] == s + (0 + 1 + 2 + 3) / 4  # MEAN of step + rank id over ids 0..3
            assert v[f"grad/k{i}"] == 10 * 3 + s                # MAX of 10 * id + step
            assert v[f"tokens/k{i}"] == 4                        # SUM of 1 per rank
    assert Path(last_json(out)["run_dir"]).is_dir()
