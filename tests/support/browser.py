"""Headless Chromium driven over the Chrome DevTools Protocol, with the standard library only.

    with Browser() as b:                       # pytest.skip()s when chromium is not installed
        page = b.open("file:///tmp/report.html")
        page.evaluate("document.title")
        page.click("#run-a")                   # a real mouse click at the element's centre
        page.type("#search", "loss")           # typed into the element, as keys are
        page.screenshot("shot.png", full_page=True)
        assert page.errors == []               # console errors and uncaught exceptions
        b.allow_downloads(tmp_path)            # what the page downloads lands there

The protocol runs over ``--remote-debugging-pipe`` (fd 3: commands to the browser, fd 4: replies
and events, each message JSON followed by a NUL byte), so no websocket package is needed.
Chromium is the Debian package (``apt-get install chromium``; scripts/test.sh installs it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: what report.html sets once its charts are drawn
REPORT_READY = "document.body.dataset.ready === '1'"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process. ``skip=True``: pytest.skip when chromium is missing."""

    def __init__(self, window: tuple[int, int] = (1400, 900), skip: bool = True) -> None:
        exe = chromium_path()
        if exe is None:
            if skip:
                import pytest

                pytest.skip("chromium is not installed (scripts/test.sh installs it with apt-get when run as root)")
            raise FileNotFoundError("chromium is not installed")
        self.profile = tempfile.mkdtemp(prefix="forge-obs-chromium-")
        cmd_r, cmd_w = os.pipe()  # we write commands; chromium reads fd 3
        ev_r, ev_w = os.pipe()  # chromium writes fd 4; we read
        args = [exe, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={window[0]},{window[1]}", "about:blank"]
        # the pipes become fds 3 and 4 of chromium: moved above both first (either may be 3 or 4)
        h1, h2 = max(cmd_r, ev_w) + 1, max(cmd_r, ev_w) + 2
        script = (f'exec {h1}<&{cmd_r} {h2}>&{ev_w} {cmd_r}<&- {ev_w}>&-; '
                  f'exec "$@" 3<&{h1} 4>&{h2} {h1}<&- {h2}>&-')
        self.proc = subprocess.Popen(
            ["bash", "-c", script, "bash", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(cmd_r, ev_w),
        )
        os.close(cmd_r)
        os.close(ev_w)
        self._w = os.fdopen(cmd_w, "wb", buffering=0)
        self._r = os.fdopen(ev_r, "rb", buffering=0)
        self._id = 0
        self._cv = threading.Condition()
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ protocol
    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._r.read(65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cv:
                    self._closed = True
                    self._cv.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                with self._cv:
                    if "id" in msg:
                        self._replies[msg["id"]] = msg
                    else:
                        self.events.append(msg)
                    self._cv.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 60) -> dict:
        with self._cv:
            self._id += 1
            mid = self._id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while mid not in self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise CDPError(f"{method}: no reply ({'browser exited' if self._closed else 'timeout'})")
                self._cv.wait(left)
            reply = self._replies.pop(mid)
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def allow_downloads(self, path: "str | Path") -> None:
        """Files the pages download are written to ``path`` under their suggested names."""
        self.download_dir = Path(path)
        self.send("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(path), "eventsEnabled": True})

    def wait_download(self, name: str, path: "str | Path", timeout_s: float = 60) -> Path:
        """The downloaded file ``path/name``, once Chromium reports its download complete."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                begun = {e["params"]["guid"] for e in self.events if e.get("method") == "Browser.downloadWillBegin"
                         and e["params"].get("suggestedFilename") == name}
                if any(e.get("method") == "Browser.downloadProgress" and e["params"].get("guid") in begun
                       and e["params"].get("state") == "completed" for e in self.events):
                    return Path(path) / name
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise CDPError(f"no completed download of {name} within {timeout_s}s")
                self._cv.wait(left)

    def wait_event(self, method: str, session: str | None, timeout_s: float = 60, after: int = 0) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for e in self.events[after:]:
                    if e.get("method") == method and e.get("sessionId") == session:
                        return e
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise CDPError(f"no {method} event within {timeout_s}s")
                self._cv.wait(left)

    # ------------------------------------------------------------------ pages
    def open(self, url: str, width: int = 1400, height: int = 900, timeout_s: float = 60) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        mark = len(self.events)
        self.send("Page.navigate", {"url": url}, session)
        self.wait_event("Page.loadEventFired", session, timeout_s, after=mark)
        return Page(self, session, width, height)

    def open_report(self, path: Any, width: int = 1400, height: int = 900) -> "Page":
        """``report.html`` at ``path``, once its script marked the page ready."""
        page = self.open(path.as_uri(), width=width, height=height)
        page.wait_for(REPORT_READY)
        return page

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=10)
        except CDPError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self._w, self._r):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str, width: int, height: int) -> None:
        self.b, self.session, self.width, self.height = browser, session, width, height

    def send(self, method: str, params: dict | None = None, timeout_s: float = 60) -> dict:
        return self.b.send(method, params, self.session, timeout_s)

    def evaluate(self, expression: str, timeout_s: float = 60) -> Any:
        """The JSON value of ``expression`` (a promise is awaited); raises on a JS exception."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True},
                      timeout_s)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CDPError(f"{expression[:60]}...: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 60) -> Any:
        """Poll ``expression`` until it is truthy (the page's own condition, not a fixed sleep)."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.evaluate(expression)
            if v:
                return v
            if time.monotonic() > deadline:
                raise CDPError(f"timed out waiting for {expression!r} (last value {v!r})")
            with self.b._cv:
                self.b._cv.wait(0.1)  # woken early by any browser event

    def center(self, selector: str) -> tuple[float, float]:
        """The viewport position of the centre of the first element ``selector`` matches,
        scrolled into view first."""
        xy = self.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")
        if xy is None:
            raise CDPError(f"no element {selector!r}")
        return xy[0], xy[1]

    def mouse(self, kind: str, x: float, y: float, buttons: int = 0, clicks: int = 1) -> None:
        """One mouse event (``mouseMoved``, ``mousePressed``, ``mouseReleased``) at (x, y)."""
        params = {"type": kind, "x": x, "y": y, "button": "left" if kind != "mouseMoved" or buttons else "none",
                  "buttons": buttons, "clickCount": clicks}
        self.send("Input.dispatchMouseEvent", params)

    def click(self, selector: str, clicks: int = 1) -> None:
        """A left click (``clicks=2``: a double click) at the centre of ``selector``."""
        x, y = self.center(selector)
        self.mouse("mouseMoved", x, y)
        for n in range(1, clicks + 1):
            self.mouse("mousePressed", x, y, 1, n)
            self.mouse("mouseReleased", x, y, 0, n)

    def drag(self, x0: float, y0: float, x1: float, y1: float, steps: int = 8) -> None:
        """Press the left button at (x0, y0), move to (x1, y1) and release it there."""
        self.mouse("mouseMoved", x0, y0)
        self.mouse("mousePressed", x0, y0, 1)
        for i in range(1, steps + 1):
            self.mouse("mouseMoved", x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps, 1)
        self.mouse("mouseReleased", x1, y1, 0)

    def type(self, selector: str, text: str) -> None:
        """Click into ``selector``, select what it holds and type ``text`` over it (an ``input``
        event, as typed keys make)."""
        self.click(selector)
        self.evaluate(f"document.querySelector({json.dumps(selector)}).select()")
        self.send("Input.insertText", {"text": text})

    def content_height(self) -> int:
        return int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))

    def screenshot(self, path: "str | Path", full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            h = self.content_height()
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": h, "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", params, timeout_s=120)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    @property
    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions of this page so far."""
        out = []
        for e in list(self.b.events):
            if e.get("sessionId") != self.session:
                continue
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out
