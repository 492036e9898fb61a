"""The HTTP server of ``forge-obs serve``: the page, its assets and the JSON API, read-only.

    from forge_obs.analysis.serve import ServeServer
    with ServeServer("runs") as srv:          # 127.0.0.1, a free port (or port=8765)
        print(srv.url)
        srv.serve_forever()

Only ``GET`` (and ``HEAD``) are answered. The page and its assets are a fixed set of files of
this package (:data:`ASSETS`), looked up by name, never joined to a request's path; a run is
named by its id, which must be a directory listed directly under the runs root
(:meth:`~forge_obs.analysis.serve.api.Runs.path`): ``..``, absolute paths, encoded variants and
symbolic links lead nowhere (404). Requests whose ``Host`` names another site are refused (403,
:class:`~forge_obs.analysis.local_server.HostChecked`), so a web page elsewhere cannot read the
API through DNS rebinding.
The page's policy (``Content-Security-Policy``) runs only its own scripts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from forge_obs.analysis.local_server import HostChecked, LocalHTTPServer, LocalServer, is_loopback
from forge_obs.analysis.serve.api import Runs
from forge_obs.analysis.serve.held import ServeConfig

__all__ = ["ASSETS", "STATIC", "ServeServer", "is_loopback"]

logger = logging.getLogger("forge_obs")

STATIC = Path(__file__).resolve().parent / "static"
#: URL path -> (file in static/, content type)
ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
    "/static/uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/static/uPlot.min.css": ("uPlot.min.css", "text/css; charset=utf-8"),
}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _int(q: dict, name: str, default: int | None = None) -> int | None:
    v = q.get(name, [None])[0]
    if v in (None, ""):
        return default
    try:
        return int(v)
    except ValueError:
        raise _BadRequest(f"{name} must be an integer") from None


class _BadRequest(ValueError):
    pass


class _Handler(HostChecked):
    server_version = "forge-obs-serve"
    runs: Runs

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self._common_headers()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_file(self, filename: str, lines: Any, ctype: str) -> None:
        """A download streamed as it is made (no length: the connection's end ends it)."""
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Disposition", f'attachment; filename="{filename}"')
        self.send_header("Connection", "close")
        self._common_headers()
        self.end_headers()
        self.close_connection = True
        if self.command != "HEAD":
            for chunk in lines:
                self.wfile.write(chunk)

    def _common_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("Referrer-Policy", "no-referrer")

    def _json(self, obj: Any, code: int = 200) -> None:
        self._send(code, json.dumps(obj, allow_nan=False).encode(), "application/json")

    def _error(self, code: int, why: str) -> None:
        self._json({"error": why}, code)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def refuse_host(self) -> None:
        self._error(403, "unknown Host")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        asset = ASSETS.get(url.path)
        if asset is not None:
            return self._send(200, (STATIC / asset[0]).read_bytes(), asset[1])
        if not url.path.startswith("/api/"):
            return self._error(404, "not found")
        try:
            q = parse_qs(url.query)
            if url.path == "/api/csv":
                return self._csv(q)
            out = self._api(url.path[5:], q)
        except _BadRequest as e:
            return self._error(400, str(e))
        if out is None:
            return self._error(404, "no such run or endpoint")
        self._json(out)

    def _csv(self, q: dict) -> None:
        """``/api/csv?id=&k=KEY&k=KEY&lo=&hi=&rank=KEY&name=``: a chart's exact values."""
        rank = q.get("rank", [None])[0]
        got = self.runs.csv(q.get("id", [None])[0], q.get("k", []), _int(q, "lo"), _int(q, "hi"), rank,
                            q.get("name", [""])[0])
        if got is None:
            return self._error(404, "no such run")
        self._send_file(got[0], got[1], "text/csv; charset=utf-8")

    def _api(self, name: str, q: dict) -> Any:
        runs = self.runs
        rid = q.get("id", [None])[0]
        n, axis = _int(q, "n", 800), q.get("x", ["step"])[0]
        if axis not in ("step", "wall", "policy"):
            raise _BadRequest("x must be step, wall or policy")
        lo, hi = _int(q, "lo"), _int(q, "hi")
        if name == "runs":
            return runs.runs()
        if name == "run":
            return runs.info(rid)
        if name == "poll":
            return runs.poll(rid)
        if name == "series":
            return runs.series(rid, q.get("k", []), n, axis, lo, hi)
        if name == "ranks":
            return runs.ranks(rid, q.get("k", [""])[0], n, axis, lo, hi)
        if name == "step":
            return runs.step(rid, _int(q, "step", 0))
        if name == "findings":
            return runs.findings(rid)
        if name == "samples":
            return runs.samples(rid, q.get("k", [""])[0])
        if name == "compare":
            return runs.compare(q.get("id") or [x for x in (q.get("a", [None])[0], q.get("b", [None])[0]) if x])
        if name == "overlay":
            return runs.overlay(q.get("id", []), q.get("k", [""])[0], n, axis, lo, hi)
        if name == "perfetto":
            return runs.perfetto(rid, _int(q, "step", 0))
        return None

    def _refuse(self) -> None:
        self._error(405, "read-only: only GET")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815


class _HTTPServer(LocalHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A browser that closed a connection (a page left, a chart no longer in view) is not an
        error; anything else is logged once per request, with its traceback."""
        import sys

        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        logger.exception("forge-obs serve: a request from %s failed", client_address)


class ServeServer(LocalServer):
    """``forge-obs serve``'s server on ``host`` (default 127.0.0.1), ``port`` 0: a free one."""

    thread_name = "forge_obs-serve"

    def __init__(self, root: "str | Path", port: int = 0, host: str = "127.0.0.1",
                 config: ServeConfig | None = None) -> None:
        self.runs = Runs(root, config)
        handler = type("Handler", (_Handler,), {"runs": self.runs, "bind_host": host})
        self.httpd = _HTTPServer((host, port), handler)
        self.host, self.port = host, self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.host in ('', '0.0.0.0') else self.host}:{self.port}/"

    def close(self) -> None:
        super().close()
        self.runs.close()
