"""``forge-obs serve`` in headless Chromium while a real run (a Monarch mesh of 2 procs) writes:
the charts draw, new steps appear, an alert shows on the chart it names, a click drills down to
the step, markup in keys and SAMPLE rows stays text, no console error."""

from __future__ import annotations

import http.client
import json
import re
import shlex
import struct
import urllib.request
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from forge_obs.analysis.serve import ServeServer
from tests.support.browser import Browser
from tests.support.helpers import ROOT, user_env

pytestmark = pytest.mark.timeout(300)

SCRIPT = ROOT / "tests" / "user_scripts" / "serve_live.py"


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGBA/RGB bytes) of a PNG that Chromium wrote (8-bit, no interlace)."""
    data = path.read_bytes()
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8
            bpp = {2: 3, 6: 4}[ctype]
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    rows, prev, stride = [], bytearray(w * bpp), w * bpp
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, rows


def _colored_pixels(path: Path) -> int:
    """Pixels that are neither white/grey background nor black text: a drawn line."""
    w, h, rows = _png_pixels(path)
    bpp = len(rows[0]) // w
    n = 0
    for r in rows:
        for i in range(0, len(r), bpp):
            red, green, blue = r[i], r[i + 1], r[i + 2]
            if max(red, green, blue) - min(red, green, blue) > 60:
                n += 1
    return n


def _chart(page, cid: str, expr: str):
    return page.evaluate(f"(() => {{ const c = [...window.forgeObs.charts.values()].find(x => x.id === {cid!r}); "
                         f"return c ? ({expr}) : null; }})()")


def _until(srv: ServeServer, path: str, ready, timeout_s: float = 60.0) -> dict:
    """``path``'s JSON answer once ``ready(answer)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(srv.url + path.lstrip("/"), timeout=30) as r:
            d = json.loads(r.read())
        if ready(d) or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def test_live_run_in_chromium(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root)], cwd=tmp_path, env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with ServeServer(root).start() as srv, Browser() as b:
            page = b.open(srv.url + "#/run/live")
            page.wait_for("document.getElementById('status').textContent !== ''", timeout_s=120)
            # the run's name, tags and notes, from its run config, as text
            labels = page.wait_for("document.getElementById('runlabels')?.textContent", timeout_s=120)
            assert labels == "live <b>demo</b>grpolivewatched by the browser test", labels
            # the first five steps, drawn while the run waits
            page.wait_for("window.forgeObs.info && window.forgeObs.info.last_step === 4", timeout_s=180)
            page.wait_for("[...window.forgeObs.charts.values()].some(c => c.id === 'c:trainer/loss' && c.u)")
            assert _chart(page, "c:trainer/loss", "c.data.steps.length") == 5
            (root / "go").touch()
            # new steps appear, and the alert at step 7 marks the loss chart
            page.wait_for("window.forgeObs.info.last_step === 9", timeout_s=120)
            page.wait_for("[...window.forgeObs.charts.values()].find(c => c.id === 'c:trainer/loss').data.steps.length === 10")
            page.wait_for("document.querySelectorAll('#findings .alert').length >= 1", timeout_s=60)
            assert "threshold" in page.evaluate("document.getElementById('findings').textContent")
            page.wait_for("[...window.forgeObs.charts.values()].find(c => c.id === 'o:loss').data.marks.length >= 1")
            assert "alert threshold @7" in page.evaluate("document.querySelector('[data-title=loss] .title').textContent")
            # markup in a key and in a SAMPLE row is text
            keys = page.evaluate("[...document.querySelectorAll('.chart .title')].map(t => t.textContent).join('|')")
            assert "trainer/<img src=x onerror=alert(1)>" in keys
            page.wait_for("document.querySelector('#samples td') !== null")
            assert page.evaluate("document.querySelector('#samples td').textContent") == "<script>alert(2)</script>"
            assert page.evaluate("document.querySelectorAll('img, #samples script').length") == 0
            # the steps' spans are in the run's index (the server's indexer follows the run)
            for s in range(5, 10):
                _until(srv, f"/api/step?id=live&step={s}",
                       lambda d: sum(x["name"] == "train_step" for x in d["spans"]["spans"]) == 2)
            # a click on the loss chart drills down to that step
            page.evaluate("document.querySelector('[data-title=loss]').scrollIntoView()")
            x, y = page.evaluate("(() => { const r = [...window.forgeObs.charts.values()].find(c => c.id === 'o:loss')"
                                 ".u.over.getBoundingClientRect(); return [r.left + r.width * 0.75, r.top + r.height / 2]; })()")
            for t in ("mouseMoved", "mousePressed", "mouseReleased"):
                page.send("Input.dispatchMouseEvent", {"type": t, "x": x, "y": y, "button": "left", "clickCount": 1})
            title = page.wait_for("document.getElementById('drill-title')?.textContent")
            step = int(title.split()[-1])
            assert 5 <= step <= 9
            page.wait_for("document.getElementById('drill-ranks') !== null")
            cells = page.evaluate("[...document.querySelectorAll('#drill-ranks tr')].slice(1)"
                                  ".map(tr => [...tr.children].map(td => td.textContent))")
            assert len(cells) == 2, cells  # the two ranks of the trainer mesh, with their own losses
            # the controller's row at that step holds only its telemetry: in the answer, not listed
            ranks = _until(srv, f"/api/step?id=live&step={step}", lambda d: True)["ranks"]
            assert set(ranks) == {"Controller", "mesh/trainer/r0", "mesh/trainer/r1"}, ranks
            assert all(k.startswith("obs/") for k in ranks["Controller"]), ranks["Controller"]
            want = [20.0] * 2 if step == 7 else [1.0 / (step + 1) + r * 0.1 for r in range(2)]
            assert [float(c[1]) for c in cells] == pytest.approx(want, abs=1e-4), (step, cells)
            drill = page.evaluate("document.getElementById('drill').textContent")
            assert "critical path and slack" in drill and "SAMPLE rows" in drill and "timeline" in drill
            # each rank's train_step span, its wall time beside its CPU time: rank 0 computed (5 ms
            # of CPU), rank 1 waited (5 ms asleep, little CPU)
            spans = page.wait_for("[...document.querySelectorAll('#drill-spans tr')].slice(1)"
                                  ".map(tr => [...tr.children].map(td => td.textContent))")
            train = {r[0].rsplit("/", 1)[1]: r for r in spans if r[1] == "train_step"}
            assert sorted(train) == ["r0", "r1"] and all(r[5].endswith(" %") for r in train.values()), spans
            (_w0, wall0, cpu0), (_w1, wall1, cpu1) = [(r[0], float(r[3]), float(r[4])) for r in (train["r0"], train["r1"])]
            assert 4.9 <= cpu0 <= wall0 + 0.001 and cpu1 < 2.0 <= wall1, train
            shot = page.screenshot(tmp_path / "serve.png")
            assert _colored_pixels(shot) > 500  # the charts' lines and bands are drawn
            (root / "stop").touch()
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            # written by forge_obs.core.shell's rule: forge-obs, or this environment's script before activation
            assert re.search(rf"view live: \S*forge[-_]obs\S* serve {re.escape(shlex.quote(str(root)))}$", err, re.M), err
            page.wait_for("document.getElementById('status').textContent.startsWith('finished')", timeout_s=30)
            assert page.errors == []
            # the step's timeline, exported from the run's events/ and served in the bundled Perfetto UI
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            c.request("GET", f"/api/perfetto?id=live&step={step}")
            url = json.loads(c.getresponse().read())["url"]
            with urllib.request.urlopen(url + "localtrace", timeout=60) as r:
                events = json.loads(r.read())["traceEvents"]
            spans = [e for e in events if e.get("ph") == "X" and "train_step" in str(e.get("name"))]
            assert len(spans) == 2, [e.get("name") for e in events]  # the step's span on each of the 2 ranks
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ----------------------------------------------------------------------------- the live view's features
# A written run (no Monarch): what W&B / TensorBoard users reach for, each through the page's own
# controls in Chromium (clicks, typed text, drags at real coordinates), asserted on what is drawn.

SLOW = {777: 30.0, 1234: 20.0, 2222: 10.0}  # step -> seconds it took beyond the usual 1 s
STEPS = 3000


def _wall(s: int) -> float:
    return 1000.0 + s + sum(extra for step, extra in SLOW.items() if s >= step)


def _write_static_run(d: Path, steps: int, loss_scale: float, labels: dict, alerts: bool) -> None:
    import math

    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"run_id": d.name, "status": "finished", "start_time": 1000.0,
                                             "end_time": _wall(steps - 1), **labels}))
    enc = json.JSONEncoder(separators=(",", ":")).encode
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps):
            g = {"trainer/loss": loss_scale / (s + 1) + 0.01 * math.sin(s), "trainer/lr": 6.7e-4,
                 "generator/tokens_per_s": 120000.0 + 5000.0 * math.sin(s / 50), "controller/step_s": _wall(s + 1) - _wall(s),
                 "reward/reward": math.nan if s == 1500 else s / steps, "trainer/grad_norm": 0.5 + 0.1 * math.cos(s / 7)}
            f.write(enc({"step": s, "mode": "global_reduce", "wall_time": _wall(s), "metrics": g}) + "\n")
            for r in range(4):
                m = {"trainer/loss": g["trainer/loss"] + r, "trainer/forward_backward_s": 0.1 * r,
                     "trainer/optimizer_step_s": 0.01 * r, "trainer/allreduce_wait_s": 0.02 * r,
                     "trainer/tokens_processed_total": 1000.0 * r, "trainer/gradient_norm_before_clipping": 0.5 + r}
                f.write(enc({"step": s, "mode": "per_rank_reduce", "wall_time": _wall(s),
                             "source": {"label": f"trainer/Trainer/r{r}", "rank": r}, "metrics": m}) + "\n")
    with open(d / "alerts.jsonl", "w") as f:
        if alerts:  # five early false alarms, resolved, then the real one, firing
            for s in range(2, 7):
                base = {"rule": "straggler", "id": f"straggler:{s}", "onset_step": s, "where": "trainer r1",
                        "message": f"trainer/loss: trainer r1 slow at step {s}"}
                f.write(json.dumps({**base, "state": "firing", "step": s}) + "\n")
                f.write(json.dumps({**base, "state": "resolved", "step": s + 1}) + "\n")
            f.write(json.dumps({"rule": "threshold", "state": "firing", "id": "thr", "step": 2500, "onset_step": 2500,
                                "where": "global", "message": "trainer/loss > 0.5 at step 2500"}) + "\n")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Runs ``a`` (3,000 steps, named, tagged, with notes, five early false alerts and a real one,
    a NaN reward at step 1500) and ``b`` (1,000 steps) served; headless Chromium."""
    root = tmp_path_factory.mktemp("served") / "runs"
    _write_static_run(root / "a", STEPS, 1.0, {"name": "baseline <b>lr</b>", "tags": ["grpo", "baseline"],
                                               "notes": "first try: <img src=x onerror=alert(9)>"}, True)
    _write_static_run(root / "b", 1000, 2.0, {"tags": ["ablation"]}, False)
    with ServeServer(root).start() as srv, Browser() as b:
        b.allow_downloads(tmp_path_factory.mktemp("downloads"))
        yield srv, b, root


def _run_page(served, run: str = "a"):
    srv, b, _root = served
    page = b.open(srv.url + f"#/run/{run}")
    page.wait_for("window.forgeObs.info && window.forgeObs.info.steps > 0 && !window.forgeObs.info.reading")
    page.wait_for("[...window.forgeObs.charts.values()].some(c => c.id === 'o:loss' && c.u)")
    return page


def _charts(page, expr: str):
    return page.evaluate(f"[...window.forgeObs.charts.values()].map(c => ({expr}))")


def test_key_search_on_the_run_page(served):
    page = _run_page(served)
    page.wait_for("document.querySelector('details.group[data-group=trainer] .chart') !== null")
    page.type("#keysearch", "grad")
    page.wait_for("[...window.forgeObs.charts.values()].filter(c => !c.box.hidden && c.kind !== 'ranks')"
                  ".every(c => c.keys.some(k => k.includes('grad')))")
    shown = page.evaluate("[...window.forgeObs.charts.values()].filter(c => !c.box.hidden).map(c => c.title)")
    assert "trainer/grad_norm" in shown and "trainer/loss" not in shown, shown
    assert "trainer/gradient_norm_before_clipping per rank" in shown, shown
    groups = page.evaluate("[...document.querySelectorAll('details.group')].filter(d => !d.hidden).map(d => d.dataset.group)")
    assert groups == ["trainer"], groups  # a group with no key that matches is hidden
    page.type("#keysearch", "/^gen.*_s$/")  # a regular expression, as W&B's search takes
    page.wait_for("[...window.forgeObs.charts.values()].filter(c => !c.box.hidden && c.kind === 'series' && c.id.startsWith('c:'))"
                  ".map(c => c.title).join() === 'generator/tokens_per_s'")
    page.type("#keysearch", "")
    page.wait_for("[...window.forgeObs.charts.values()].every(c => !c.box.hidden)")
    assert page.errors == []


def test_log_scale_and_per_chart_smoothing(served):
    page = _run_page(served)
    page.wait_for("document.querySelector('.chart[data-title=\"trainer/loss\"]') !== null")
    page.evaluate("document.querySelector('.chart[data-title=\"trainer/loss\"]').scrollIntoView()")
    page.wait_for("window.forgeObs.charts.get(document.querySelector('.chart[data-title=\"trainer/loss\"]')).u !== null")
    sel = '.chart[data-title="trainer/loss"]'
    page.click(sel + " button.log")
    c = f"window.forgeObs.charts.get(document.querySelector('{sel}'))"
    page.wait_for(f"{c}.u && {c}.u.scales.y.distr === 3")
    ticks = page.evaluate(f"{c}.ticks.y")
    assert ticks and all(t.startswith("1") or t.startswith("0.") for t in ticks), ticks  # powers of ten
    assert "log scale" in page.evaluate(f"{c}.box.querySelector('.sub').textContent")  # its values <= 0 are not drawn
    page.click(sel + " button.log")
    page.wait_for(f"{c}.u.scales.y.distr === 1")
    other = "window.forgeObs.charts.get(document.querySelector('.chart[data-title=\"trainer/grad_norm\"]'))"
    raw_other = page.evaluate(f"{other}.u.data[1].slice(0, 50)")
    page.type(sel + " input.smooth", "0.9")
    page.wait_for(f"{c}.sm === 0.9")
    drawn = page.evaluate(f"{c}.u.data")
    raw = page.evaluate(f"{c}.data.y[0]")
    names = page.evaluate(f"{c}.u.series.map(s => s.label)")
    assert names[1:] == ["trainer/loss (raw)", "trainer/loss"], names  # the raw line stays, faint, as in W&B
    assert drawn[1][:50] == raw[:50] and drawn[2][10] != raw[10], (drawn[2][:12], raw[:12])
    a, m, w = 0.9, 0.0, 0.0
    for y in raw[:11]:
        m, w = a * m + (1 - a) * y, a * w + (1 - a)
    assert drawn[2][10] == pytest.approx(m / w)  # debiased EMA
    assert page.evaluate(f"{other}.u.data[1].slice(0, 50)") == raw_other  # the other chart is not smoothed
    assert page.errors == []


def test_zoom_synced_refetched_finer_and_reset(served):
    page = _run_page(served)
    loss = "[...window.forgeObs.charts.values()].find(c => c.id === 'o:loss')"
    page.wait_for(f"{loss}.data.resolution")
    before = page.evaluate(f"{loss}.data.resolution")
    assert before["width"] > 1 and not before["exact"], before  # 3,000 steps held in buckets
    r = page.evaluate(f"(() => {{ const u = {loss}.u; const o = u.over.getBoundingClientRect();"
                      " return [o.left + u.valToPos(1000, 'x'), o.left + u.valToPos(1100, 'x'), o.top + o.height / 2]; })()")
    page.drag(r[0], r[2], r[1], r[2])
    page.wait_for("window.forgeObs.zoom !== null")
    z = page.evaluate("window.forgeObs.zoom")
    assert 990 <= z["lo"] <= 1010 and 1090 <= z["hi"] <= 1110, z
    page.wait_for(f"{loss}.data.resolution.exact === true")
    steps = page.evaluate(f"{loss}.data.steps")
    assert steps == list(range(steps[0], steps[-1] + 1)) and len(steps) >= 90, steps  # every step of the range
    # every chart in view shows the same range
    page.wait_for("[...window.forgeObs.charts.values()].filter(c => c.u && c.visible).every(c => "
                  "Math.abs(c.u.scales.x.min - window.forgeObs.zoom.x0) < 1e-6 && Math.abs(c.u.scales.x.max - window.forgeObs.zoom.x1) < 1e-6)")
    assert page.evaluate("document.getElementById('resetzoom').hidden") is False
    page.click("#resetzoom")
    page.wait_for(f"window.forgeObs.zoom === null && {loss}.data.steps[{loss}.data.steps.length - 1] === {STEPS - 1}")
    assert page.evaluate(f"{loss}.u.scales.x.max") >= STEPS - 1
    assert page.evaluate("document.getElementById('resetzoom').hidden") is True
    assert page.errors == []


def test_csv_and_png_export(served, tmp_path):
    srv, b, _root = served
    page = _run_page(served)
    page.click(".chart[data-title=loss] button.csv")
    target = b.wait_download("a-loss.csv", _download_dir(b))
    lines = target.read_text().splitlines()
    assert lines[0] == "step,wall_time_s,trainer/loss" and len(lines) == STEPS + 1, lines[:3]
    step, wall, v = lines[101].split(",")
    assert int(step) == 100 and float(wall) == _wall(100) - 1000.0
    assert float(v) == pytest.approx(1.0 / 101 + 0.01 * __import__("math").sin(100), rel=1e-12)  # exact, not a bucket
    page.click(".chart[data-title=loss] button.png")
    png = b.wait_download("a-loss.png", _download_dir(b))
    w, h, _rows = _png_pixels(png)
    assert w >= 300 and h >= 150 and _colored_pixels(png) > 200, (w, h)
    assert page.errors == []


def _download_dir(b) -> Path:
    return Path(b.download_dir)


def test_slowest_steps_link_to_their_drill_down(served):
    page = _run_page(served)
    page.wait_for("document.querySelectorAll('#slowest li').length >= 3")
    items = page.evaluate("[...document.querySelectorAll('#slowest li')].slice(0, 3).map(li => li.textContent)")
    assert [int(t.split("step ")[1].split()[0]) for t in items] == [777, 1234, 2222], items
    assert "31" in items[0] and "s" in items[0], items  # 1 s + 30 s
    page.click("#slowest li:nth-child(2) button")
    assert page.wait_for("document.getElementById('drill-title')?.textContent") == "step 1234"
    assert page.errors == []


def test_badges_newest_and_most_relevant_first(served):
    page = _run_page(served)
    page.wait_for("[...window.forgeObs.charts.values()].find(c => c.id === 'o:loss').data.marks.length >= 6")
    badges = page.evaluate("[...document.querySelectorAll('[data-title=loss] .title .badge')].map(b => b.textContent)")
    assert badges[0] == "⚠ alert threshold @2500", badges  # the real alert, still firing, first
    assert len(badges) <= 4 and badges[-1].startswith("+"), badges  # the rest behind "+N more"
    titles = page.evaluate("[...document.querySelectorAll('.chart .title')].map(t => t.textContent)")
    assert not [t for t in titles if "null" in t or "undefined" in t], titles
    assert page.errors == []


def test_drill_down_from_a_finding_shows_its_key_first_and_the_rank_table_fits(served):
    page = _run_page(served)
    page.wait_for("[...document.querySelectorAll('#findings .finding')].some(li => li.textContent.includes('reward/reward'))",
                  timeout_s=120)
    page.click("#findings .finding button")
    page.wait_for("document.getElementById('drill-values') !== null")
    first = page.evaluate("[...document.querySelectorAll('#drill-values tr')][1].children[0].textContent")
    assert first == "reward/reward", first
    # a step's per-rank table (six keys recorded per rank, long names) fits the side panel
    page.click("#slowest li button")
    page.wait_for("document.getElementById('drill-title')?.textContent === 'step 777' && document.getElementById('drill-ranks') !== null")
    assert page.evaluate("document.querySelectorAll('#drill-ranks tr:first-child th').length") == 7  # rank + 6 keys
    fits = page.evaluate("(() => { const a = document.getElementById('drill'), t = document.getElementById('drill-ranks');"
                         " return [a.scrollWidth <= a.clientWidth, t.getBoundingClientRect().right <= a.getBoundingClientRect().right]; })()")
    assert fits == [True, True], fits
    assert page.errors == []


def test_axis_ticks_and_small_numbers_read_as_written(served):
    page = _run_page(served)
    thr = "[...window.forgeObs.charts.values()].find(c => c.id === 'o:throughput (tokens/s)')"
    page.evaluate(f"{thr}.box.scrollIntoView()")
    page.wait_for(f"{thr}.u && {thr}.ticks")
    ticks = page.evaluate(f"{thr}.ticks.y")
    assert len(set(ticks)) == len(ticks) >= 3 and all(t[0] in "123456789" for t in ticks), ticks  # 115k, 120k, 125k
    widest, room = page.evaluate(f"(() => {{ const u = {thr}.u, a = u.axes[1]; u.ctx.font = a.font[0];"
                                 f" return [Math.max(...{thr}.ticks.y.map(t => u.ctx.measureText(t).width)),"
                                 f" a._size - a.ticks.size - a.gap]; }})()")
    assert widest <= room, (widest, room)  # no label is cut off (the old axis: 49.6 px of text in 35 px)
    page.evaluate("document.querySelector('details.group[data-group=trainer]').scrollIntoView()")
    flat = page.wait_for("document.querySelector('details.group[data-group=trainer] .flat')?.textContent")
    assert "trainer/lr = 0.00067" in flat, flat
    assert page.evaluate("fmt(6.7e-4)") == "0.00067" and page.evaluate("fmt(1.5e-7)") == "1.5e-7"
    assert page.evaluate("fmt(123456789)") == "123,456,789" and page.evaluate("fmt(0.5)") == "0.5"
    assert page.errors == []


def test_run_names_tags_and_notes(served):
    srv, b, _root = served
    page = b.open(srv.url + "#/")
    page.wait_for("document.querySelectorAll('#runs tr').length >= 3")
    row = page.evaluate("document.querySelector('#runs tr:nth-child(2)').textContent")
    assert "baseline <b>lr</b>" in row and "grpo" in row and "baseline" in row, row
    page.type("#runfilter", "ablation")  # by tag
    page.wait_for("[...document.querySelectorAll('#runs tr')].filter(r => !r.hidden).length === 2")
    page = _run_page(served)
    labels = page.wait_for("document.getElementById('runlabels')?.textContent")
    assert "baseline <b>lr</b>" in labels and "first try: <img src=x onerror=alert(9)>" in labels, labels
    assert page.evaluate("[...document.querySelectorAll('#runlabels .tag')].map(t => t.textContent)") == ["grpo", "baseline"]
    assert "[object" not in labels, labels
    assert page.evaluate("document.querySelectorAll('main img, main b').length") == 0
    assert page.errors == []


def test_compare_overlays_runs_and_fills_in(served):
    srv, b, root = served
    c = root / "c"
    c.mkdir()
    with open(c / "metrics.jsonl", "w") as f:
        for s in range(10):
            f.write(json.dumps({"step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"trainer/loss": 5.0}}) + "\n")
    page = b.open(srv.url + "#/compare/a/b/c")
    page.wait_for("document.querySelectorAll('#compare tbody tr').length > 0")
    page.type("#cmpfilter", "trainer/loss")
    chart = "[...window.forgeObs.charts.values()].find(c => c.id === 'v:trainer/loss')"
    page.wait_for(f"{chart} && {chart}.u")
    assert page.evaluate(f"{chart}.data.names") == ["a", "b", "c"]
    assert page.evaluate(f"{chart}.u.series.slice(1).map(s => s.label)") == ["a", "b", "c"]
    ys = page.evaluate(f"{chart}.data.y")
    assert ys[2][:1] == [5.0] and ys[1][0] == pytest.approx(2.0)
    row = "[...document.querySelectorAll('#compare tbody tr')].find(r => r.children[0].textContent === 'trainer/loss')"
    assert page.evaluate(f"{row}.children[5].textContent") == "5"
    with open(c / "metrics.jsonl", "a") as f:  # the run goes on after the page drew it
        for s in range(10, 100):
            f.write(json.dumps({"step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"trainer/loss": 0.25}}) + "\n")
    page.wait_for(f"{row}.children[5].textContent === '0.25'")
    page.wait_for(f"{chart}.data.y[2][{chart}.data.x.indexOf(99)] === 0.25")
    assert page.errors == []


def test_a_run_written_again_is_drawn_afresh(served):
    """The page of a run deleted and written again under its id shows the new run only."""
    import shutil

    srv, b, root = served
    d = root / "again"
    _write_static_run(d, 50, 100.0, {"name": "old"}, False)
    page = _run_page(served, "again")
    loss = "[...window.forgeObs.charts.values()].find(c => c.id === 'o:loss')"
    page.wait_for(f"{loss}.data.steps.length === 50")
    shutil.rmtree(d)
    # while the run is gone, what the page fetches on its own (findings, SAMPLE rows, a step) fails quietly
    for call in ("refreshFindings()", "openDrill(3, [])", "renderSamples({samples: ['x']})"):
        assert page.evaluate(f"{call}.then(() => 'ok', (e) => 'thrown: ' + e)") == "ok", call
    assert "could not load" in page.evaluate("document.getElementById('findings').textContent")
    _write_static_run(d, 20, 7.0, {"name": "new"}, False)
    page.wait_for("window.forgeObs.info && window.forgeObs.info.steps === 20 && "
                  "document.getElementById('runlabels').textContent.startsWith('new')", timeout_s=30)
    page.wait_for(f"{loss} && {loss}.data && {loss}.data.steps.length === 20")
    ys = page.evaluate(f"{loss}.data.y[0]")
    assert max(ys) == pytest.approx(7.0 + 0.0) and len(ys) == 20, ys  # step 0 of the new run: 7 / 1
    # no script error; the browser logs the 404s of the requests made while the run was gone
    assert [e for e in page.errors if not e.startswith("Failed to load resource: the server responded with a status of 404")] == []


def test_a_starting_run_shows_no_stall_banner(served):
    """A run a minute into its start-up (meta.json written, no step yet): the header says
    "starting", not "stalled"; so does the runs list."""
    import os
    import time

    srv, b, root = served
    d = root / "starting"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"run_id": "starting", "status": "running", "start_time": time.time() - 60}))
    (d / "metrics.jsonl").write_text("")  # the store opened 24 s ago, nothing in it yet
    os.utime(d / "metrics.jsonl", (time.time() - 24, time.time() - 24))
    page = b.open(srv.url + "#/run/starting")
    status = page.wait_for("document.getElementById('status').textContent")
    assert status.startswith("starting — no step logged yet (6") and "stalled" not in status, status
    page = b.open(srv.url + "#/")
    page.wait_for("document.querySelectorAll('#runs tr').length >= 3")
    row = page.evaluate("[...document.querySelectorAll('#runs tr')].find(r => r.textContent.includes('starting')).textContent")
    assert "stalled" not in row, row
    assert page.errors == []
