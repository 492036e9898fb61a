"""``forge-obs serve``: bounded series, incremental tailing, the JSON API, run status, and what
the server refuses (path traversal in every spelling, symbolic links out of the root, foreign
Host headers, writes); markup in keys, rank labels, SAMPLE rows and alerts stays text in the page."""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forge_obs.analysis.serve import RunState, ServeConfig, ServeServer
from forge_obs.analysis.serve.series import Buckets, merge_to
from forge_obs.analysis.serve.server import STATIC
from forge_obs.analysis.serve.tail import Tail
from tests.support.helpers import ROOT, user_env

XSS_KEY = "trainer/<img src=x onerror=alert(1)>"
XSS_LABEL = "<script>alert(3)</script>/r0"
XSS_ROW = {"prompt": "<script>alert(2)</script>", "answer": "<img src=y onerror=alert(4)>"}


def _row(step: int, mode: str = "global_reduce", **kw) -> str:
    return json.dumps({"run_id": "r", "step": step, "mode": mode, "wall_time": 1000.0 + step, **kw}) + "\n"


def make_run(root: Path, run_id: str = "r1", steps: int = 50, ranks: int = 2, status: str = "running") -> Path:
    d = root / run_id
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"run_id": run_id, "status": status, "start_time": 1000.0}))
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(_row(s, metrics={"trainer/loss": 1.0 / (s + 1), XSS_KEY: float(s), "trainer/policy_version": s // 5,
                                     "gen/len": {"p50": s, "p90": 2 * s, "p99": 3 * s, "count": 4},
                                     "rollouts": [XSS_ROW]}))
            for r in range(ranks):
                label = XSS_LABEL if r == 0 else f"trainer/T/r{r}"
                f.write(_row(s, "per_rank_reduce", source={"label": label, "rank": r},
                             metrics={"trainer/loss": 1.0 / (s + 1) + r}))
    with open(d / "alerts.jsonl", "w") as f:
        f.write(json.dumps({"rule": "threshold", "state": "firing", "id": "a1", "step": 7, "onset_step": 7,
                            "where": "global", "message": f"trainer/loss > 10 <b>bold</b> at step 7"}) + "\n")
    return d


# ----------------------------------------------------------------------------- series and tail
def test_buckets_stay_bounded_and_keep_extremes():
    s = Buckets(cap=64)
    for step in range(100_000):
        s.add(step, 1e9 if step == 77_777 else (math.nan if step == 5 else -1e9 if step == 31_000 else 0.5))
    assert len(s) <= 64 and s.n == 100_000
    xs, ys = s.points()
    assert max(ys) == 1e9 and xs[ys.index(1e9)] == 77_777  # the spike, at its step
    assert min(y for y in ys if y is not None) == -1e9 and xs[ys.index(-1e9)] == 31_000
    assert sum(s.nonfinite) == 1
    m = merge_to(s, 8, 70_000, 80_000)
    mx, my = m.points(70_000, 80_000)
    assert len(m) <= 8 and 1e9 in my and -1e9 not in my


def test_tail_reads_only_what_was_appended(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(_row(0) + _row(1)[:10])
    t = Tail(p)
    assert [r["step"] for _o, r in t.read()] == [0]
    assert t.offset == len(_row(0))
    with open(p, "a") as f:
        f.write(_row(1)[10:] + "not json\n" + _row(2))
    got = list(t.read())
    assert [r["step"] for _o, r in got] == [1, 2] and t.malformed == 1
    assert got[0][0] == len(_row(0))  # where the row starts, to seek back to
    assert list(t.read()) == [] and t.offset == p.stat().st_size
    p.write_text(_row(9))  # replaced by a shorter file: read from its start
    assert [r["step"] for _o, r in t.read()] == [9] and t.resets == 1


def test_run_state_incremental_and_exact_drill_down(tmp_path):
    d = make_run(tmp_path, steps=20)
    st = RunState(d)
    st.metrics.max_bytes = 500  # read in many chunks: update() reads them all, each row once
    assert st.update() and st.last_step == 19 and st.series["trainer/loss"].n == 20
    assert st.metrics.offset == (d / "metrics.jsonl").stat().st_size
    v = st.version
    assert not st.update() and st.version == v  # nothing new: nothing read
    with open(d / "metrics.jsonl", "a") as f:
        f.write(_row(20, metrics={"trainer/loss": 0.25}))
        f.write(_row(20, "per_rank_reduce", source={"label": "trainer/T/r1"}, metrics={"trainer/loss": 7.0}))
    assert st.update() and st.version == v + 1 and st.series["trainer/loss"].n == 21
    detail = st.step_detail(20)
    assert detail["global"]["trainer/loss"] == 0.25 and detail["ranks"]["trainer/T/r1"]["trainer/loss"] == 7.0
    d13 = st.step_detail(13)
    assert d13["ranks"][XSS_LABEL]["trainer/loss"] == pytest.approx(1 / 14)
    assert d13["samples"]["rollouts"] == [XSS_ROW] and d13["policy_version"] == 2


def test_rank_series_share_a_budget(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(300):
            for r in range(32):
                f.write(_row(s, "per_rank_reduce", source={"label": f"m/r{r}"}, metrics={f"k{i}": s * r for i in range(16)}))
    st = RunState(d, ServeConfig(rank_points=256, rank_budget=32 * 16 * 32))
    st.update()
    assert all(len(s) <= 32 for by in st.rank_series.values() for s in by.values())
    assert st.rank_series["k3"]["m/r5"].n == 300 and max(st.rank_series["k3"]["m/r5"].hi) == 299 * 5


def test_status_finished_stalled_hung_crashed(tmp_path):
    d = make_run(tmp_path, "fin", status="finished")
    assert RunState(d).status()["state"] == "finished"
    d = make_run(tmp_path, "old")
    st = RunState(d)
    st.update()
    assert st.status()["state"] == "running"
    past = time.time() - 3600
    os.utime(d / "metrics.jsonl", (past, past))
    assert st.status()["state"] == "stalled" and "no new step" in st.status()["why"]
    with open(d / "alerts.jsonl", "a") as f:
        f.write(json.dumps({"rule": "stall", "state": "firing", "id": "s", "step": 49, "message": "stalled"}) + "\n")
    st.update()
    assert st.status()["state"] == "hung"
    d = make_run(tmp_path, "dead")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / "events").mkdir()
    import socket

    (d / "events" / "ctl.jsonl").write_text(json.dumps({"h": 1, "ctl": True, "host": socket.gethostname(),
                                                        "pid": dead.pid}) + "\n")
    assert RunState(d).status()["state"] == "crashed"


# ----------------------------------------------------------------------------- HTTP
def _get(srv: ServeServer, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes, dict]:
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    c.putheader("Host", host or f"127.0.0.1:{srv.port}")
    c.endheaders()
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body, dict(r.getheaders())


def _api(srv: ServeServer, path: str) -> dict:
    code, body, headers = _get(srv, path)
    assert code == 200, body
    assert headers["Content-Type"] == "application/json"
    return json.loads(body)


def test_api(tmp_path):
    make_run(tmp_path, "r1", steps=2000)
    make_run(tmp_path, "r2", steps=30, status="finished")
    with ServeServer(tmp_path).start() as srv:
        runs = _api(srv, "/api/runs")
        assert [r["id"] for r in runs["runs"]] == ["r1", "r2"] and runs["runs"][0]["alerts"] == 1
        info = _api(srv, "/api/run?id=r1")
        assert info["last_step"] == 1999 and info["steps"] == 2000 and info["status"]["state"] == "running"
        assert [p["title"] for p in info["panels"]] == ["loss"] and info["rank_keys"] == ["trainer/loss"]
        groups = {g["group"]: [k["key"] for k in g["keys"]] for g in info["groups"]}
        assert groups["gen"] == ["gen/len"] and XSS_KEY in groups["trainer"] and info["samples"] == ["rollouts"]
        s = _api(srv, "/api/series?id=r1&k=trainer/loss&n=100")
        assert 50 <= len(s["x"]) <= 100 and s["y"][0][0] == 1.0 and min(s["y"][0]) == pytest.approx(1 / 2000)
        assert s["marks"][0]["step"] == 7 and s["marks"][0]["kind"] == "alert"
        w = _api(srv, "/api/series?id=r1&k=trainer/loss&n=100&x=wall&lo=100&hi=200")
        assert w["x"][0] == 100.0 and max(w["steps"]) <= 200 and w["steps"][0] >= 100
        pv = _api(srv, "/api/series?id=r1&k=trainer/loss&n=4000&x=policy")
        assert pv["x"][:6] == [0, 0, 0, 0, 0, 1]
        dist = _api(srv, "/api/series?id=r1&k=gen/len/p50&k=gen/len/p90&k=gen/len/p99&n=4000")
        assert dist["names"] == ["gen/len/p50", "gen/len/p90", "gen/len/p99"] and dist["y"][2][10] == 30
        ranks = _api(srv, "/api/ranks?id=r1&k=trainer/loss&n=200")
        assert ranks["names"] == [XSS_LABEL, "trainer/T/r1"] and len(ranks["x"]) <= 200
        step = _api(srv, "/api/step?id=r1&step=7")
        assert step["ranks"]["trainer/T/r1"]["trainer/loss"] == pytest.approx(1 / 8 + 1)
        assert step["alerts"][0]["keys"] == ["trainer/loss"] and step["samples"]["rollouts"] == [XSS_ROW]
        assert step["critical_path"]["available"] is False and "--steps 7 --open" in step["trace_command"]
        assert _api(srv, "/api/samples?id=r1&k=rollouts")["rows"] == [XSS_ROW]
        cmp = _api(srv, "/api/compare?a=r1&b=r2")
        row = next(r for r in cmp["rows"] if r["key"] == "trainer/loss")
        assert row["a"]["last"] == pytest.approx(1 / 2000) and row["b"]["last"] == pytest.approx(1 / 30)
        assert _get(srv, "/api/series?id=r1&k=trainer/loss&n=abc")[0] == 400
        assert _get(srv, "/api/series?id=r1&x=bogus")[0] == 400


def test_findings_are_computed_in_the_background(tmp_path):
    d = make_run(tmp_path, "nan", steps=12)
    with open(d / "metrics.jsonl", "a") as f:
        f.write(_row(12, metrics={"trainer/loss": float("nan")}))
    with ServeServer(tmp_path).start() as srv:
        deadline = time.monotonic() + 60
        while True:
            res = _api(srv, "/api/findings?id=nan")
            if not res["computing"] and res["state"] == "ok":
                break
            assert time.monotonic() < deadline, res
            threading.Event().wait(0.1)
        assert any(f["kind"] == "nonfinite" and "trainer/loss" in f["keys"] for f in res["findings"]), res


TRAVERSALS = [
    "/api/run?id=..", "/api/run?id=../r1", "/api/run?id=%2e%2e", "/api/run?id=%2e%2e%2fr1", "/api/run?id=%252e%252e",
    "/api/run?id=/etc", "/api/run?id=%2fetc", "/api/run?id=r1/../r1", "/api/run?id=r1%00", "/api/run?id=.",
    "/api/run?id=outside", "/api/run?id=link", "/api/run?id=", "/api/step?id=link&step=0",
    "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/static/../server.py", "/static/%2e%2e/server.py",
    "/static/..%2fserver.py", "/static/%252e%252e%252fserver.py", "//etc/passwd", "/etc/passwd", "/static/",
    "/static/app.js/../../server.py", "/api/../static/app.js.bak", "/static/uPlot.LICENSE/..",
]


def test_traversal_and_links_out_of_the_root_lead_nowhere(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "r1")
    outside = make_run(tmp_path, "outside")
    (root / "link").symlink_to(outside)  # a run directory that is a link out of the root
    (root / "r1" / "secret.txt").write_text("SECRET")
    with ServeServer(root).start() as srv:
        assert [r["id"] for r in _api(srv, "/api/runs")["runs"]] == ["r1"]
        for path in TRAVERSALS:
            code, body, _h = _get(srv, path)
            assert code in (400, 403, 404), (path, code)
            assert b"SECRET" not in body and b"root:" not in body and b"import" not in body, path


def test_read_only_foreign_host_refused_and_page_headers(tmp_path):
    make_run(tmp_path)
    with ServeServer(tmp_path).start() as srv:
        for method in ("POST", "PUT", "DELETE"):
            assert _get(srv, "/api/runs", method=method)[0] == 405
        assert _get(srv, "/api/runs", host="evil.example:80")[0] == 403  # DNS rebinding
        assert _get(srv, "/api/runs", host=f"localhost:{srv.port}")[0] == 200
        code, body, h = _get(srv, "/")
        assert code == 200 and b"uPlot.iife.min.js" in body and b"https://" not in body  # nothing from a CDN
        assert "script-src 'self'" in h["Content-Security-Policy"] and h["X-Content-Type-Options"] == "nosniff"
        assert _get(srv, "/static/uPlot.iife.min.js")[0] == 200


def test_page_script_never_inserts_html():
    js = (STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink
    assert (STATIC / "uPlot.LICENSE").read_text().startswith("The MIT License")


def _fake_critical_path(monkeypatch) -> None:
    """``forge_obs.analysis.critical_path`` as the drill-down calls it (the module is another
    branch's work): ``critical_path(run_dir, step)`` -> answer, stages, slack."""
    import types

    mod = types.ModuleType("forge_obs.analysis.critical_path")
    mod.critical_path = lambda run_dir, step: {
        "step": step, "answer": f"step {step}: <img src=z onerror=alert(5)> waited on trainer/r1 update",
        "stages": [{"mesh": "trainer", "rank": 1, "name": "update", "path_s": 0.5, "share": 0.8, "wait": False}],
        "slack": [{"mesh": "trainer", "rank": 0, "busy_s": 0.1, "waiting_s": 0.4, "idle_s": 0.0, "on_path_s": 0.0}]}
    monkeypatch.setitem(sys.modules, "forge_obs.analysis.critical_path", mod)


def test_critical_path_hook(tmp_path, monkeypatch):
    make_run(tmp_path, "r1", steps=10)
    with ServeServer(tmp_path).start() as srv:
        assert _api(srv, "/api/step?id=r1&step=3")["critical_path"]["available"] in (False, True)
        _fake_critical_path(monkeypatch)
        cp = _api(srv, "/api/step?id=r1&step=3")["critical_path"]
        assert cp["available"] and cp["path"]["step"] == 3 and cp["path"]["stages"][0]["name"] == "update"


def test_markup_in_keys_labels_rows_and_alerts_is_inert_in_chromium(tmp_path, monkeypatch):
    from tests.support.browser import Browser

    _fake_critical_path(monkeypatch)
    make_run(tmp_path, "r1", steps=30)
    with ServeServer(tmp_path).start() as srv, Browser() as b:
        page = b.open(srv.url + "#/run/r1")
        page.wait_for("document.querySelector('#samples td') !== null && document.querySelector('#findings .alert') !== null")
        page.evaluate("window.forgeObs.charts.forEach(c => { if (c.id === 'c:' + " + json.dumps(XSS_KEY) + ") c.box.scrollIntoView(); })")
        page.wait_for("[...document.querySelectorAll('.chart .title')].some(t => t.textContent.startsWith(" + json.dumps(XSS_KEY) + "))")
        assert page.evaluate("document.querySelector('#samples td').textContent") == XSS_ROW["prompt"]
        assert "<b>bold</b>" in page.evaluate("document.getElementById('findings').textContent")
        page.evaluate("document.querySelector('#findings .alert button').click()")  # drill down from the alert
        page.wait_for("document.getElementById('drill-ranks') !== null")
        assert XSS_LABEL in page.evaluate("document.getElementById('drill-ranks').textContent")
        path = page.wait_for("document.getElementById('drill-path')?.textContent")
        assert "step 7: <img src=z onerror=alert(5)> waited on trainer/r1 update" in path and "80 %" in path
        assert page.evaluate("document.querySelectorAll('main img, aside img, main b, main script, aside script').length") == 0
        dialogs = [e for e in b.events if e.get("method") == "Page.javascriptDialogOpening"]
        assert dialogs == [] and page.errors == []


def test_cli_serve(tmp_path):
    make_run(tmp_path / "runs", "r1")
    assert subprocess.run([sys.executable, "-m", "forge_obs.cli", "serve", str(tmp_path / "nope")], env=user_env(),
                          capture_output=True, text=True, timeout=60).returncode == 2
    proc = subprocess.Popen([sys.executable, "-m", "forge_obs.cli", "serve", str(tmp_path / "runs"), "--port", "0"],
                            env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line and "ssh -L" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/api/runs")
        assert json.loads(c.getresponse().read())["runs"][0]["id"] == "r1"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_run_start_line_and_quiet(tmp_path, monkeypatch, capsys):
    from forge_obs.backends.record import RunContext
    from forge_obs.controller.session import _announce

    run = RunContext(run_id="x", run_dir=tmp_path / "runs" / "x")
    monkeypatch.delenv("FORGE_OBS_QUIET", raising=False)
    _announce(run)
    assert capsys.readouterr().err == f"forge_obs: run x in {run.run_dir}; view live: forge-obs serve {tmp_path / 'runs'}\n"
    monkeypatch.setenv("FORGE_OBS_QUIET", "1")
    _announce(run)
    assert capsys.readouterr().err == ""


def test_a_large_run_is_read_in_chunks_while_requests_are_answered(tmp_path):
    make_run(tmp_path, "big", steps=600, ranks=4)
    with ServeServer(tmp_path, config=ServeConfig(read_chunk_bytes=4096)).start() as srv:
        first = _api(srv, "/api/run?id=big")
        assert first["reading"] is not None and first["steps"] < 600  # answered before the run is read
        deadline = time.monotonic() + 120
        while _api(srv, "/api/poll?id=big")["reading"] is not None:
            assert time.monotonic() < deadline
            threading.Event().wait(0.05)
        info = _api(srv, "/api/run?id=big")
        assert info["steps"] == 600 and info["last_step"] == 599 and info["malformed"] == 0
        st = srv.runs.get("big")[0]
        assert st.series["trainer/loss"].n == 600  # every row once, whatever the chunks
        assert all(s.n == 600 for s in st.rank_series["trainer/loss"].values())
