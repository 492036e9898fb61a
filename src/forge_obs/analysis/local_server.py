"""What the local web servers (``forge-obs serve``, ``forge-obs trace --open``, the Perfetto side
server of ``/api/perfetto``) share: run in the foreground or from a thread, ``close()`` ends
either and frees the port; in the foreground SIGTERM ends it as Ctrl+C does. Every request is
checked by :class:`HostChecked` first: a ``Host`` header that names another site is refused (403).

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
import ipaddress
import signal
import socket
import threading
from typing import Any

__all__ = ["HostChecked", "LocalHTTPServer", "LocalServer", "host_allowed", "is_loopback"]

#: connections the kernel holds for the server before it accepts them (``listen``'s backlog; the
#: kernel caps it at ``net.core.somaxconn``). The standard library's 5 dropped the connections of
#: pages opened together while the handlers held the interpreter, and each waited out a SYN retry.
LISTEN_BACKLOG = 1024


def is_loopback(host: str) -> bool:
    """Whether the bind address ``host`` is this machine's loopback."""
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def host_allowed(header: str, bind_host: str = "127.0.0.1") -> bool:
    """Whether a request's ``Host`` header may be answered by a server bound to ``bind_host``.

    DNS rebinding (a page of another site whose name it points at 127.0.0.1) always carries
    that site's name in ``Host``: only an IP address, ``localhost`` and, for a server bound to
    an address other than loopback, this machine's own names are answered. Any port is: an SSH
    tunnel's local port may differ from the server's.

        >>> [host_allowed(h) for h in ("127.0.0.1:8765", "localhost:9000", "[::1]:8765", "evil.example:8765")]
        [True, True, True, False]
        >>> host_allowed("localhost.evil.example"), host_allowed("")
        (False, False)
    """
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":")[0]
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name == "localhost":
        return True
    return not is_loopback(bind_host) and name in _own_names()


def _own_names() -> set[str]:
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    return names


class LocalHTTPServer(http.server.ThreadingHTTPServer):
    """A thread per request (daemon threads: a request in flight never holds the process at
    exit) and a listen backlog of :data:`LISTEN_BACKLOG`."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG


class HostChecked(http.server.BaseHTTPRequestHandler):
    """A request handler that answers only requests whose ``Host`` passes :func:`host_allowed`
    (checked before any method runs, so ``GET``, ``HEAD`` and the rest alike)."""

    #: the address the server is bound to (set by the server's subclass of the handler)
    bind_host = "127.0.0.1"

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if host_allowed(self.headers.get("Host") or "", self.bind_host):
            return True
        self.refuse_host()
        return False

    def refuse_host(self) -> None:
        """Answer a refused ``Host`` (403)."""
        self.send_error(403, "unknown Host")


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
