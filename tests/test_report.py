"""``forge-obs report``: one self-contained page, checked in headless Chromium."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forge_obs.backends.jsonl import JsonlBackend
from forge_obs.metric import Metric
from forge_obs.record import RunContext, StepRecord
from forge_obs.report.html import render_report, write_report
from forge_obs.run import write_meta

EVIL = 'trainer/<script>alert("x")</script>'
#: where the screenshot is kept (build/ is git-ignored)
OUT_DIR = Path(os.environ.get("FORGE_OBS_TEST_OUT", Path(__file__).resolve().parents[1] / "build" / "test-output"))
GLOBAL_CHARTS = 11  # see make_run: 7 plain keys + 4 from the distribution dict
RANK_CHARTS = 2


def make_run(root: Path, run_id: str = "rep1", steps: int = 12) -> Path:
    run = RunContext(run_id=run_id, run_dir=root / run_id, config={"console": {}})
    be = JsonlBackend({})
    be.init(run=run)
    t0 = 1.79e9
    for s in range(steps):
        glob = {
            "trainer/loss": (math.nan if s == 5 else 2.0 / (s + 1)),
            "trainer/step_time_s": 0.5 + 0.01 * s,
            EVIL: 1.0,
            "generator/tokens_per_s": 2700.0 + 10 * s,
            "generator/latency_s": {"p50": 0.1, "p90": 0.2 + 0.01 * s, "p99": 0.4, "count": 64},
            "buffer/size": 32 * s,
            "policy_version": s // 3,
            "obs/backend_errors": 0.0,
            "rollouts": [{"prompt": "1+1", "response": "<b>2</b>", "reward": 1.0}] if s == steps - 1 else [],
        }
        be.log_step(StepRecord(
            step=s, run_id=run_id, wall_time=t0 + 3.0 * s,
            global_metrics=[Metric(k, v) for k, v in glob.items()],
            per_rank={
                "trainer/r0": [Metric("trainer/loss", 1.0 / (s + 1))],
                "trainer/r1": [Metric("trainer/loss", 3.0 / (s + 1))],
                "generator/r0": [Metric("generator/tokens_per_s", 2700.0)],
            },
            sources={"trainer/r0": {"label": "trainer/r0", "mesh": "trainer", "rank": 0},
                     "trainer/r1": {"label": "trainer/r1", "mesh": "trainer", "rank": 1},
                     "generator/r0": {"label": "generator/r0", "mesh": "generator", "rank": 0}},
        ))
    be.finish()
    write_meta(run.run_dir, run_id=run_id, config={"console": {}, "wandb": {"api_key": "secret"}},
               start_time=t0, status="finished", note="<img src=x onerror=alert(1)>")
    return run.run_dir


def test_page_is_self_contained_and_escaped(tmp_path):
    page = render_report(make_run(tmp_path))
    assert page.count('<figure class="chart"') == GLOBAL_CHARTS + RANK_CHARTS
    assert "<script>alert" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "<img src=x" not in page and "<b>2</b>" not in page and "&lt;b&gt;2&lt;/b&gt;" in page
    assert page.count("<script") == 1  # ours: the axis switch and error counter
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page)  # nothing fetched from a network
    # groups by prefix, both axes, per-rank legend, metadata, samples
    for group in ("trainer", "generator", "buffer", "obs"):
        assert f'data-group="{group}"' in page
    assert page.count('class="ax-step"') == page.count('class="ax-wall"') == GLOBAL_CHARTS + RANK_CHARTS
    assert "trainer/r1" in page and "Per rank" in page
    assert "secret" not in page  # meta.json's config is redacted at write time
    assert "Samples (latest step)" in page


def test_doctor_findings_or_not_available(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path)
    page = render_report(run_dir)
    if "timeline not available (forge_obs.timeline.doctor" not in page:
        assert "nonfinite" in page and "trainer/loss" in page  # the NaN at step 5
    monkeypatch.setitem(sys.modules, "forge_obs.timeline.doctor", None)  # import fails
    assert "timeline not available" in render_report(run_dir)


def test_cli_writes_report(tmp_path, capsys):
    from forge_obs.cli import main

    run_dir = make_run(tmp_path)
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").exists() and str(run_dir / "report.html") in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nope")]) == 2


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (scripts/test.sh installs it with apt-get when run as root)")
    ud = tmp_path / f"chrome-profile-{len(list(tmp_path.glob('chrome-profile-*')))}"
    return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={ud}", *args],
                          capture_output=True, text=True, timeout=120)


def _console_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]


def test_console_detector_sees_errors(tmp_path):
    """The harness itself: a broken page is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFn();</script></body></html>")
    res = _chromium(tmp_path, "--dump-dom", bad.as_uri())
    assert any("undefinedFn" in ln for ln in _console_lines(res.stderr)), res.stderr[-2000:]


def test_report_in_headless_chromium(tmp_path):
    run_dir = make_run(tmp_path, steps=40)
    out = write_report(run_dir)
    res = _chromium(tmp_path, "--dump-dom", out.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    assert _console_lines(res.stderr) == []
    dom = res.stdout
    assert re.search(r'id="js-ready">yes<', dom), "the page's script did not run"
    assert re.search(r'id="js-errors">0<', dom)
    assert re.search(rf'id="js-charts">{GLOBAL_CHARTS + RANK_CHARTS}<', dom)
    assert 'class="axis-step"' in dom  # the axis switch ran
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    shot = OUT_DIR / "report.png"
    res = _chromium(tmp_path, "--hide-scrollbars", "--window-size=1400,2600", f"--screenshot={shot}", out.as_uri())
    assert res.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, res.stderr[-2000:]
    assert _console_lines(res.stderr) == []
