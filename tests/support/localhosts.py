"""Several Monarch hosts on one machine: each a worker process (``run_worker_loop_forever``) on a
localhost TCP port, attached with the public ``attach_to_workers``.

    with LocalHosts(2) as hosts:
        hm = hosts.host_mesh()                       # extent {hosts: 2}
        pm = hm.spawn_procs(per_host={"procs": 4})   # extent {hosts: 2, procs: 4}

Each host's procs are children of its worker process (their parent pid tells the host apart, as
the host name does across machines). Workers are started and ended by this object only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker_host.py")
__all__ = ["LocalHosts"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHosts:
    def __init__(self, n: int) -> None:
        self.n = n
        self.addrs = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._hm: Any = None

    def __enter__(self) -> "LocalHosts":
        env = dict(os.environ)
        for a in self.addrs:
            self.procs.append(subprocess.Popen([sys.executable, str(WORKER), a], env=env))
        deadline = time.monotonic() + 60
        for a in self.addrs:  # wait until each worker listens
            port = int(a.rsplit(":", 1)[1])
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"worker host {a} did not start")
                    time.sleep(0.05)
        return self

    def host_mesh(self) -> Any:
        if self._hm is None:
            from monarch.actor import attach_to_workers

            self._hm = attach_to_workers(workers=self.addrs, ca="trust_all_connections")
        return self._hm

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
