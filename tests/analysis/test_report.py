"""``forge-obs report``: one self-contained page that tells the run's story, checked in headless
Chromium (Debian's ``chromium`` over the DevTools protocol, tests/support/browser.py) with screenshots
kept in build/test-output/."""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
from pathlib import Path

import pytest

from forge_obs.analysis.report import html as report_html
from forge_obs.analysis.report.html import render_report, write_report
from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.core.types import Metric
from forge_obs.backends.record import RunContext, StepRecord
from forge_obs.core.run import write_meta
from tests.support.browser import Browser

EVIL = 'trainer/<script>alert("x")</script>'
#: where screenshots are kept (build/ is git-ignored)
OUT_DIR = Path(os.environ.get("FORGE_OBS_TEST_OUT", Path(__file__).resolve().parents[2] / "build" / "test-output"))
OVERVIEW = ["reward", "loss", "throughput (tokens/s)", "step time breakdown (s)"]
GROUP_CHARTS = {"trainer": ["trainer/forward_backward_s", "trainer/loss", "trainer/reward_mean", "trainer/step_time_s", EVIL],
                "generator": ["generator/latency_s", "generator/tokens_per_s"], "buffer": ["buffer/size"],
                "controller": ["controller/step_s", "controller/wait_for_batch_s"], "(top level)": ["policy_version"]}
FLAT = {"trainer/lr": "0.0003", "generator/model_load_s": "32.56 s", "obs/backend_errors": "0"}
RANK_CHARTS = ["trainer/loss"]  # trainer/lr: two ranks, one value; generator/tokens_per_s: one rank
N_FIGURES = len(OVERVIEW) + sum(map(len, GROUP_CHARTS.values())) + len(RANK_CHARTS)


def make_run(root: Path, run_id: str = "rep1", steps: int = 12) -> Path:
    run = RunContext(run_id=run_id, run_dir=root / run_id, config={"console": {}})
    be = JsonlBackend({})
    be.init(run=run)
    t0 = 1.79e9
    for s in range(steps):
        glob = {
            "trainer/loss": (math.nan if s == 5 else 2.0 / (s + 1)),
            "trainer/reward_mean": 0.5 + 0.02 * s,
            "trainer/lr": 3e-4,
            "trainer/step_time_s": 0.5 + 0.01 * s,
            "trainer/forward_backward_s": 0.1 + 0.001 * s,
            "controller/step_s": 0.3 + 0.002 * (s % 3),
            "controller/wait_for_batch_s": 0.05 + 0.001 * s,
            EVIL: float(s % 2),
            "generator/tokens_per_s": 2700.0 + 10 * s,
            "generator/latency_s": {"p50": 0.1, "p90": 0.2 + 0.01 * s, "p99": 0.4, "count": 64},
            "buffer/size": 32 * s,
            "policy_version": s // 3,
            "obs/backend_errors": 0.0,
            "rollouts": [{"prompt": "1+1", "response": "<b>2</b>", "reward": 1.0}] if s == steps - 1 else [],
        }
        if s == 0:
            glob["generator/model_load_s"] = 32.5645
        be.log_step(StepRecord(
            step=s, run_id=run_id, wall_time=t0 + 3.0 * s,
            global_metrics=[Metric(k, v) for k, v in glob.items()],
            per_rank={
                "trainer/r0": [Metric("trainer/loss", 1.0 / (s + 1)), Metric("trainer/lr", 3e-4)],
                "trainer/r1": [Metric("trainer/loss", 3.0 / (s + 1)), Metric("trainer/lr", 3e-4)],
                "generator/r0": [Metric("generator/tokens_per_s", 2700.0 + s)],
            },
            sources={"trainer/r0": {"label": "trainer/r0", "mesh": "trainer", "rank": 0},
                     "trainer/r1": {"label": "trainer/r1", "mesh": "trainer", "rank": 1},
                     "generator/r0": {"label": "generator/r0", "mesh": "generator", "rank": 0}},
        ))
    be.finish()
    write_meta(run.run_dir, run_id=run_id, config={"console": {"compact": True}, "wandb": {"api_key": "secret"}},
               start_time=t0, end_time=t0 + 40, status="finished", steps_logged=steps,
               note="<img src=x onerror=alert(1)>", app="apps.test",
               app_settings={"lr": 3e-4, "steps": steps, "wandb_token": "hunter2", "run_root": "runs"})
    return run.run_dir


def _figures(page: str) -> list[str]:
    return re.findall(r'<figure class="chart" id="([^"]+)" data-key="([^"]*)"', page)


def test_overview_first_then_run_groups_ranks(tmp_path):
    page = render_report(make_run(tmp_path))
    figs = _figures(page)
    assert len(figs) == N_FIGURES, figs
    # order: the run's story, the run table, the groups, the per-rank charts, the samples
    pos = [page.index(f'<section id="{s}"') for s in ("overview", "run", "metrics", "ranks", "samples")]
    assert pos == sorted(pos)
    assert [k for i, k in figs if i.startswith("o-")] == OVERVIEW
    group_keys = [k for i, k in figs if i.startswith("c-")]
    for group, keys in GROUP_CHARTS.items():
        assert f'data-group="{report_html.esc(group)}"' in page
    assert sorted(group_keys) == sorted(report_html.esc(k) for ks in GROUP_CHARTS.values() for k in ks)
    assert group_keys.index("trainer/loss") < group_keys.index("generator/tokens_per_s") < group_keys.index("buffer/size")
    assert [k for i, k in figs if i.startswith("r-")] == RANK_CHARTS
    # constant and single-point series: a line each, with their value, no chart
    for key, value in FLAT.items():
        m = re.search(rf'<div id="k-{re.escape(report_html.slug(key))}"[^>]*><code>{re.escape(key)}</code> = ([^<]+)<', page)
        assert m and m.group(1).strip() == value, (key, m and m.group(1))
    assert "constant over 12 steps" in page and "step 0 only" in page
    # the overview's panels name the first and last 10 points of what they show
    assert "trainer/reward_mean: 0.55 → 0.67" in page  # 6 points each: 12 steps
    # the breakdown stacks the parts and "other", the rest of the total
    spec = json.loads(report_html.html.unescape(re.search(r'id="o-3" data-key="[^"]*" data-spec="([^"]*)"', page).group(1)))
    assert spec["stack"] and [ln["key"] for ln in spec["lines"]] == ["controller/wait_for_batch_s",
                                                                     "trainer/forward_backward_s", "other"]


def test_run_table_app_settings_redacted_no_debug_text(tmp_path):
    page = render_report(make_run(tmp_path))
    run = page[page.index('<section id="run"'):page.index('<section id="metrics"')]
    assert "App settings" in run and "<b>steps</b> 12" in run and "<b>run_root</b> runs" in run
    assert "hunter2" not in page and "secret" not in page  # through forge_obs.core.redact.redact
    assert "<b>wandb_token</b> ***" in run
    assert "<th>console</th><td>compact=true</td>" in run  # the config inline, not a JSON dump
    assert "ended" in run and "after 40s" in run
    for debug in ("script errors", "ready no", "charts 1", "js-errors"):
        assert debug not in page


def test_page_is_self_contained_and_escaped(tmp_path):
    page = render_report(make_run(tmp_path))
    assert "<script>alert" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "<b>2</b>" not in page and "&lt;b&gt;2&lt;/b&gt;" in page
    data = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S).group(1)
    assert "</" not in data and "<" not in data  # the data cannot close its element
    assert json.loads(data)["s"][EVIL][:2] == [0, 1]
    assert json.loads(data)["s"]["trainer/loss"][5] == "NaN"  # non-finite values travel as strings
    assert page.count("<script") == 2  # the data and ours
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page)  # nothing fetched from a network
    assert "trainer/r1" in page and "Per rank" in page
    assert "Samples" in page and "rollouts" in page


def test_findings_are_rendered_generically_and_linked_to_charts(tmp_path, monkeypatch):
    findings = [
        {"kind": "nonfinite", "message": "trainer/loss is NaN at step 5", "mesh": None, "actor": None, "rank": None,
         "steps": [5], "details": {"key": "trainer/loss", "sources": ["global"]}},
        {"kind": "straggler", "message": "trainer/trainer/r1 is slow", "mesh": "trainer", "actor": "trainer", "rank": 1,
         "replica": None, "steps": [0, 11], "details": {"span": "forward_backward", "median_ratio": 3.1}},
        {"kind": "stall", "message": "replica 1 went silent; generator/model_load_s was <b>huge</b>",
         "mesh": "generator_1", "actor": "replica1", "rank": 0, "replica": 1, "steps": [], "details": {}},
    ]
    monkeypatch.setattr(report_html, "doctor_findings", lambda run_dir: ("", findings))
    page = render_report(make_run(tmp_path))
    items = re.findall(r'<li id="f-(\d)">(.*?)</li>', page, re.S)
    assert [i for i, _ in items] == ["0", "1", "2"]
    f0, f1, f2 = (body for _i, body in items)
    assert '<span class="badge">nonfinite</span>' in f0 and "step 5:" in f0
    assert 'href="#c-trainer_loss">trainer/loss</a>' in f0 and 'href="#r-trainer_loss">trainer/loss (per rank)</a>' in f0
    assert "<b>trainer/trainer/r1</b> steps 0–11:" in f1 and "median_ratio" in f1  # details, folded
    assert "<b>generator_1/replica1/r0/replica 1</b>" in f2 and "&lt;b&gt;huge&lt;/b&gt;" in f2
    assert 'href="#k-generator_model_load_s">generator/model_load_s</a>' in f2  # a flat series: its line
    # the charts a finding names link back to it
    loss_fig = re.search(r'<figure class="chart" id="c-trainer_loss".*?</figcaption>', page).group(0)
    assert 'href="#f-0"' in loss_fig
    assert "3 findings" in page[:page.index("<main>")]


def test_real_doctor_finds_the_nan(tmp_path):
    page = render_report(make_run(tmp_path))
    if "doctor not available" in page:
        pytest.skip("forge_obs.analysis.doctor is not importable here")
    assert re.search(r'<li id="f-\d+"><span class="badge">nonfinite</span>.*?href="#c-trainer_loss"', page, re.S)


def test_doctor_missing_still_renders(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "forge_obs.analysis.doctor", None)  # the import fails
    page = render_report(make_run(tmp_path))
    assert "doctor not available" in page and len(_figures(page)) == N_FIGURES


def test_cli_writes_report(tmp_path, capsys):
    from forge_obs.cli import main

    run_dir = make_run(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").exists() and str(run_dir / "report.html") in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nope")]) == 2


# ------------------------------------------------------------------------------------ browser
def test_browser_harness_sees_errors(tmp_path):
    """The harness itself: a broken page is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFn();</script></body></html>")
    with Browser() as b:
        page = b.open(bad.as_uri())
        assert any("undefinedFn" in e for e in page.errors), page.errors


def _chart_state(page) -> dict:
    return page.evaluate("""(() => { const out = {};
        for (const f of document.querySelectorAll('figure.chart')) {
          const svg = f.querySelector('svg');
          out[f.id] = svg ? {lines: svg.querySelectorAll('polyline').length,
                             faint: [...svg.querySelectorAll('polyline')].filter(p => p.hasAttribute('stroke-opacity') && +p.getAttribute('stroke-opacity') < 1).length,
                             areas: svg.querySelectorAll('polygon').length,
                             marks: svg.querySelectorAll('path').length,
                             xlabels: [...svg.querySelectorAll('text')].map(t => t.textContent)} : null; }
        return out; })()""")


def test_report_in_headless_chromium(tmp_path):
    run_dir = make_run(tmp_path, steps=40)
    out = write_report(run_dir)
    with Browser() as b:
        page = b.open_report(out)
        assert page.errors == []
        closed = page.evaluate("document.querySelectorAll('details:not([open]) figure.chart').length")
        assert int(page.evaluate("document.body.dataset.drawn")) == N_FIGURES - closed
        state = _chart_state(page)
        assert all(state[i] is not None for i, _k in _figures(out.read_text())), state
        # smoothing on by default: a faint raw line behind each smoothed one
        assert state["c-trainer_loss"]["lines"] == 2 and state["c-trainer_loss"]["faint"] == 1
        assert state["c-trainer_loss"]["marks"] == 1  # the NaN at step 5: a red mark
        assert state["c-generator_latency_s"]["lines"] == 6  # p50/p90/p99, raw and smoothed
        assert state["o-3"]["areas"] == 3  # the breakdown: two parts and "other", stacked
        assert state["r-trainer_loss"]["lines"] == 4
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        assert page.screenshot(OUT_DIR / "report.png").stat().st_size > 20_000
        page.screenshot(OUT_DIR / "report_full.png", full_page=True)
        # smoothing 0: the raw series alone
        page.evaluate("(() => { const s = document.getElementById('smoothing'); s.value = 0;"
                      " s.dispatchEvent(new Event('input')); })()")
        page.wait_for("document.querySelector('#c-trainer_loss svg polyline[stroke-opacity=\"1\"]') !== null"
                      " && document.querySelectorAll('#c-trainer_loss svg polyline').length === 1")
        assert page.evaluate("document.getElementById('smoothing-value').textContent") == "0.00"
        # x-axis: wall time (seconds since the first step) instead of steps
        before = _chart_state(page)["c-trainer_loss"]["xlabels"]
        page.evaluate("document.querySelector('button[data-axis=wall]').click()")
        page.wait_for("[...document.querySelectorAll('#c-trainer_loss svg text')].some(t => /s$/.test(t.textContent))")
        after = _chart_state(page)["c-trainer_loss"]["xlabels"]
        assert before != after and any(t.endswith("s") for t in after)
        # hovering a chart reads its values
        box = page.evaluate("(() => { const svg = document.querySelector('#c-buffer_size svg');"
                            " svg.scrollIntoView({block: 'center'}); const r = svg.getBoundingClientRect();"
                            " return [r.left + r.width * 0.6, r.top + r.height / 2]; })()")
        page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box[0], "y": box[1]})
        tip = page.wait_for("(() => { const t = document.querySelector('.tip');"
                            " return t && t.style.display === 'block' ? t.textContent : ''; })()")
        assert tip.startswith("t = ") and "buffer/size: " in tip
        assert page.errors == []


# a GRPO run's keys (apps/grpo, 2 trainer ranks, 2 generator replicas): v varies, c constant,
# 1 a single point, d a distribution; the trainer's and the generator's keys per rank too
GRPO_KEYS = {
    "buffer": "add_ms:v evicted_episodes:v eviction_rate_frac:v queue_depth_groups:v read_episodes:v "
              "read_episodes_per_s:v retrieval_latency_ms:v sample_misses:v sample_policy_age_steps:v size_episodes:v "
              "write_episodes_per_s:v written_episodes:v",
    "controller": "policy_version:v step_s:v wait_for_batch_s:v",
    "generator": "engine_requests_waiting:c engine_requests_running:v generate_s:v generated_tokens:v idle_s:v "
                 "kv_cache_usage_pct:v model_load_s:1 policy_staleness_steps:c policy_version:v prefix_cache_hit_pct:c "
                 "request_queue_depth:c requests:v sampling_max_tokens:c sampling_n:c sampling_temperature:c "
                 "sequences:v tokenize_ms:v tokens_per_s:v weight_pull_s:v seq_len_tokens:d",
    "obs": "backend_errors:c backend_s:v cpu_export_s:v cpu_flush_s:v cpu_inbox_s:v cpu_pipeline_s:v cpu_s:v "
           "cpu_timeline_s:v dropped_values:c flush_blocked_s:v late_states:c merge_s:v missing_ranks:c "
           "nonfinite_values:c pending_steps:c ranks_reported:c stream_overflow:c values_recorded:v",
    "reference": "forward_ms:v idle_s:v model_load_s:1 sequences:v tokens_per_s:v",
    "reward": "completions:v correct_frac:v group_reward_std:v reward_mean:v score_ms:v zero_std_groups:v",
    "service": "healthy_replicas:c replica0_queue_depth:v replica0_requests:v replica1_queue_depth:v "
               "replica1_requests:v request_latency_s:v",
    "trainer": "advantage_max:v advantage_mean:v advantage_min:v batch_creation_s:v entropy_nats:v "
               "episode_len_tokens:v forward_backward_s:v grad_abs_max:v grad_mean_sq:v idle_s:v kl_to_ref:v loss:v "
               "lr:c mfu_pct:v param_update_rel:v policy_updates_per_min:v policy_version:v reward_mean:v step_s:v "
               "tokens_per_s:v weight_push_s:v",
}
RANKS = {"trainer": ["trainer/trainer/r0", "trainer/trainer/r1"],
         "generator": ["generator_0/replica0/r0", "generator_1/replica1/r0"]}
#: a third of the 20,841 px that one chart per key (and per rank) in alphabetical order took for
#: the same run at 1400 px wide
MAX_HEIGHT_PX = 20841 // 3


def _value(kind: str, key: str, step: int, rng: random.Random):
    if kind == "c":
        return 3e-4 if key.endswith("lr") else 1.0
    if kind == "d":
        return {"p50": 6 * rng.uniform(0.99, 1.01), "p90": 7.0, "p99": 7 + rng.random(), "count": 128}
    return rng.uniform(0.1, 1.0) * (1 + step / 10)


def test_grpo_sized_report_is_a_third_of_one_chart_per_key(tmp_path):
    rng = random.Random(0)
    run_id, steps = "grpo", 300
    run = RunContext(run_id=run_id, run_dir=tmp_path / run_id, config={})
    be = JsonlBackend({})
    be.init(run=run)
    keys = [(f"{g}/{spec.split(':')[0]}", spec.split(":")[1]) for g, specs in GRPO_KEYS.items() for spec in specs.split()]
    for s in range(steps):
        glob = {k: _value(kind, k, s, rng) for k, kind in keys if kind != "1" or s == 0}
        per_rank = {}
        for g, labels in RANKS.items():
            for label in labels:
                per_rank[label] = [Metric(k, _value(kind, k, s, rng)) for k, kind in keys
                                   if k.startswith(g + "/") and (kind != "1" or s == 0)]
        be.log_step(StepRecord(step=s, run_id=run_id, wall_time=1.79e9 + 0.25 * s,
                               global_metrics=[Metric(k, v) for k, v in glob.items()], per_rank=per_rank,
                               sources={lb: {"label": lb} for lb in per_rank}))
    be.finish()
    write_meta(run.run_dir, run_id=run_id, start_time=1.79e9, status="finished",
               app_settings={"steps": steps, "lr": 3e-4, "generator": "vllm"}, config={"console": {"compact": True}})
    out = write_report(run.run_dir)
    with Browser() as b:
        page = b.open_report(out)
        height = page.content_height()
        assert page.errors == []
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        page.screenshot(OUT_DIR / "report_grpo_top.png")
    print(f"GRPO-sized report: {height} px tall at 1400 px (at most {MAX_HEIGHT_PX})")
    assert height <= MAX_HEIGHT_PX, height
    assert out.stat().st_size < 2_000_000  # the data of 300 steps x ~100 keys x ranks, inline


def test_run_without_metrics_renders_without_script_errors(tmp_path):
    run_dir = tmp_path / "empty"
    write_meta(run_dir, run_id="empty", start_time=1.79e9, status="running")
    out = write_report(run_dir)
    page = out.read_text()
    assert "no metrics in metrics.jsonl" in page and _figures(page) == []
    with Browser() as b:
        p = b.open_report(out)
        assert p.errors == [] and p.evaluate("document.body.dataset.drawn") == "0"
