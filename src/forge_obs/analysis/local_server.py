"""What the local web servers (``forge-obs serve``, ``forge-obs trace --open``, the Perfetto side
server of ``/api/perfetto``) share: run in the foreground or from a thread, ``close()`` ends
either and frees the port; in the foreground SIGTERM ends it as Ctrl+C does.

    >>> import http.server
    >>> class Hello(LocalServer):
    ...     thread_name = "hello"
    ...     def __init__(self):
    ...         self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    >>> with Hello().start() as s:
    ...     s.httpd.server_address[1] > 0
    True
"""

from __future__ import annotations

import http.server
import signal
import threading
from typing import Any

__all__ = ["LocalServer"]


class LocalServer:
    """A subclass sets ``self.httpd`` in its ``__init__`` and names its thread."""

    httpd: http.server.HTTPServer
    thread_name = "forge_obs-http"
    _thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl+C or SIGTERM, both raising ``KeyboardInterrupt``.

        A background job of a non-interactive shell ignores SIGINT (and so do its children), so
        SIGTERM is the stop signal that always reaches the server; from the main thread it is
        taken as Ctrl+C, and the previous handler is back once serving ends."""
        if threading.current_thread() is not threading.main_thread():
            self.httpd.serve_forever()
            return
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.httpd.serve_forever()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def start(self) -> Any:
        """Serve from a background thread; returns ``self``."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
