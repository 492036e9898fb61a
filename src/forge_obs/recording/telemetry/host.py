"""The host's figures, read by one process per host (the host's *reader*): load and runnable
tasks against cores, CPU busy and stolen time, and the kernel's pressure stall information
(PSI) for CPU, memory and I/O where the kernel has it.

    >>> from forge_obs.recording.telemetry.host import HostReader
    >>> h = HostReader()
    >>> a = h.read()
    >>> a["cores"] >= 1 and "runnable" in a
    True
    >>> h.close()

**One reader per host.** The processes of a run that share a host elect one reader with an
abstract Unix socket named after the run (:class:`HostLease`): the first to bind it reads the
host at its samples; the others try again every ``retry_s`` (one failed ``bind``, a few µs)
and take over when the reader's process ends (the kernel frees the name with it). N ranks on a
host cost one reading of the host per sample, not N. A host's figures are therefore in one
process's per-rank row at each step (the reader's; any process of the host), and the doctor
joins them to the other processes by host name.

Every file is opened once and read again with ``pread`` (the kernel makes its text anew);
``/proc/stat`` costs most (its size grows with the host's CPUs). Cumulative counters:
:mod:`.sampler` turns two readings into the shares of the interval between them.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import Any

from forge_obs.recording.telemetry.proc import close_fd, open_file, read_fd

__all__ = ["HostReader", "HostLease", "PSI_FILES", "lease_name"]

#: PSI file -> (figure of its ``some`` line, figure of its ``full`` line or None)
PSI_FILES = {"cpu": ("cpu_stall_us", None), "memory": ("memory_stall_us", "memory_full_stall_us"),
             "io": ("io_stall_us", None)}


def _psi_totals(text: bytes) -> tuple[int | None, int | None]:
    """(``some`` total µs, ``full`` total µs) of a PSI file's text: ``some avg10=.. total=N``
    and, where the kernel has it, ``full avg10=.. total=M``, one line each in that order."""
    parts = text.split(b"total=")
    some = int(parts[1].split(None, 1)[0]) if len(parts) > 1 and text.startswith(b"some") else None
    full = int(parts[2].split(None, 1)[0]) if len(parts) > 2 and b"\nfull" in text else None
    return some, full


class HostReader:
    """The host's counters and gauges (see the module docstring)."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.loadavg = open_file("/proc/loadavg")
        self.stat = open_file("/proc/stat")
        self.psi = {name: fd for name in PSI_FILES if (fd := open_file(f"/proc/pressure/{name}")) is not None}

    def read(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cores": self.cores}
        if self.loadavg is not None:
            try:
                f = read_fd(self.loadavg, 256).split()
                out["load1"] = float(f[0])
                out["runnable"] = int(f[3].split(b"/")[0])
            except (OSError, ValueError, IndexError):
                pass
        if self.stat is not None:
            try:  # cpu  user nice system idle iowait irq softirq steal guest guest_nice (ticks)
                t = [int(x) for x in read_fd(self.stat, 512).split(b"\n", 1)[0].split()[1:9]]
                out["cpu_ticks"] = sum(t)
                out["idle_ticks"] = t[3] + t[4]
                out["steal_ticks"] = t[7]
            except (OSError, ValueError, IndexError):
                pass
        for name, fd in self.psi.items():
            try:
                some, full = _psi_totals(read_fd(fd, 512))
            except (OSError, ValueError):
                continue
            k_some, k_full = PSI_FILES[name]
            if some is not None:
                out[k_some] = some
            if k_full is not None and full is not None:
                out[k_full] = full
        return out

    def close(self) -> None:
        for fd in (self.loadavg, self.stat, *self.psi.values()):
            close_fd(fd)
        self.loadavg = self.stat = None
        self.psi = {}


def lease_name(run_key: str) -> str:
    """The abstract socket name of a run's host lease (per user and run)."""
    h = hashlib.sha1(f"{os.getuid() if hasattr(os, 'getuid') else 0}:{run_key}".encode()).hexdigest()[:20]
    return f"\0forge_obs-host-{h}"


class HostLease:
    """Whether this process is its host's reader for a run (see the module docstring)."""

    def __init__(self, run_key: str, retry_s: float = 2.0) -> None:
        self.name = lease_name(run_key)
        self.retry_s = retry_s
        self.sock: socket.socket | None = None
        self.tried = -1e18

    def held(self, now: float | None = None) -> bool:
        """True while this process holds the lease; tries to take it at most every ``retry_s``."""
        if self.sock is not None:
            return True
        now = time.monotonic() if now is None else now
        if now - self.tried < self.retry_s:
            return False
        self.tried = now
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return False
        try:
            s.bind(self.name)
        except OSError:
            s.close()
            return False
        self.sock = s
        return True

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
