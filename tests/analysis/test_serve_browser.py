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


def test_live_run_in_chromium(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(root)], cwd=tmp_path, env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with ServeServer(root).start() as srv, Browser() as b:
            page = b.open(srv.url + "#/run/live")
            page.wait_for("document.getElementById('status').textContent !== ''", timeout_s=120)
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
            want = [20.0] * 2 if step == 7 else [1.0 / (step + 1) + r * 0.1 for r in range(2)]
            assert [float(c[1]) for c in cells] == pytest.approx(want, abs=1e-4), (step, cells)
            drill = page.evaluate("document.getElementById('drill').textContent")
            assert "critical path and slack" in drill and "SAMPLE rows" in drill and "timeline" in drill
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
