"""One process's telemetry: at each cut (off the caller's thread: where the cut is exported),
the figures of the interval since the process's previous sample become values of the cut
under ``obs/sys/...`` (:mod:`.keys`).

    >>> from forge_obs.recording.telemetry.options import TelemetryOptions
    >>> from forge_obs.recording.telemetry.sampler import Sampler
    >>> s = Sampler(TelemetryOptions(gpu=False, interval_s=0.1), run_key="doc")
    >>> first = s.sample(now=100.0)          # the baseline: gauges only
    >>> "obs/sys/proc/cpu_s" in first, "obs/sys/proc/rss_gb" in first
    (False, True)
    >>> later = s.sample(now=100.5)
    >>> later["obs/sys/proc/interval_s"], "obs/sys/proc/cpu_s" in later
    (0.5, True)
    >>> s.sample(now=100.55) is None         # sooner than interval_s: nothing
    True
    >>> s.close()

:func:`configure` (each process, from the session's options) sets the process's sampler, or
none; :func:`add_to` adds a sample to a cut's :class:`~forge_obs.recording.collector.Taken` as
forge_obs's own values: not counted as recorded values (``obs/values_recorded``), merged across
ranks by each key's reduction like any value, so every route (direct, group bundles, SPMD
helpers) carries them and every backend gets them per rank and reduced.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from forge_obs.recording.reduce import accumulator_for
from forge_obs.recording.telemetry.gpu import GpuReader
from forge_obs.recording.telemetry.host import HostLease, HostReader
from forge_obs.recording.telemetry.keys import HOST, KEYS, PROC
from forge_obs.recording.telemetry.options import TelemetryOptions, parse
from forge_obs.recording.telemetry.proc import ProcReader

__all__ = ["Sampler", "configure", "add_to", "current", "status"]

_GB = 1e9


def _delta(a: dict, b: dict, k: str) -> float | None:
    return None if k not in a or k not in b else b[k] - a[k]


class Sampler:
    """Readers of the process, its host (when it holds the host's lease) and its GPUs; the
    previous readings; the interval (see the module docstring)."""

    def __init__(self, options: TelemetryOptions, run_key: str = "", nvml: Any = None) -> None:
        self.options = options
        self.run_key = run_key
        self.pid = os.getpid()
        self.proc = ProcReader()
        self.lease = HostLease(run_key) if options.host else None
        self.host: HostReader | None = None
        self.gpu = GpuReader(nvml=nvml if options.gpu else False, pid=self.pid)
        self.prev: tuple | None = None  # (time, proc reading)
        self.prev_host: tuple | None = None  # (time, host reading)
        self.lock = threading.Lock()

    def sample(self, now: float | None = None) -> dict[str, float] | None:
        """The figures since the previous sample, or None when it was less than ``interval_s`` ago."""
        with self.lock:
            now = time.monotonic() if now is None else now
            if self.prev is not None and now - self.prev[0] < self.options.interval_s:
                return None
            out: dict[str, float] = {}
            self._proc(now, out)
            if self.lease is not None and self.lease.held(now):
                self._host(now, out)
            out.update(self.gpu.read(now))
            return out

    def _proc(self, now: float, out: dict) -> None:
        cur = self.proc.read(now)
        prev, self.prev = self.prev, (now, cur)
        if "rss_bytes" in cur:
            out[PROC + "rss_gb"] = cur["rss_bytes"] / _GB
        if "threads" in cur:
            out[PROC + "threads"] = float(cur["threads"])
        if prev is None or now <= prev[0]:
            return
        dt = now - prev[0]
        p = prev[1]
        out[PROC + "interval_s"] = dt
        cpu = cur["cpu_s"] - p["cpu_s"]
        out[PROC + "cpu_s"] = cpu
        out[PROC + "cpu_util"] = cpu / dt
        out[PROC + "ctx_voluntary"] = float(cur["ctx_voluntary"] - p["ctx_voluntary"])
        out[PROC + "ctx_involuntary"] = float(cur["ctx_involuntary"] - p["ctx_involuntary"])
        runq = _delta(p, cur, "runq_ns")
        if runq is not None:
            out[PROC + "runq_wait_s"] = max(runq, 0) / 1e9
            out[PROC + "runq_wait_share"] = max(runq, 0) / 1e9 / dt

    def _host(self, now: float, out: dict) -> None:
        if self.host is None:
            self.host = HostReader()
        cur = self.host.read()
        prev, self.prev_host = self.prev_host, (now, cur)
        cores = cur["cores"]
        out[HOST + "cores"] = float(cores)
        if "load1" in cur:
            out[HOST + "load1"] = cur["load1"]
            out[HOST + "runnable"] = float(cur["runnable"])
            out[HOST + "runnable_per_core"] = cur["runnable"] / cores
        if prev is None or now <= prev[0]:
            return
        dt_us = (now - prev[0]) * 1e6
        p = prev[1]
        ticks = _delta(p, cur, "cpu_ticks")
        if ticks:
            out[HOST + "cpu_util"] = 1.0 - _delta(p, cur, "idle_ticks") / ticks
            out[HOST + "steal_share"] = _delta(p, cur, "steal_ticks") / ticks
        for key, fig in (("cpu_pressure", "cpu_stall_us"), ("memory_pressure", "memory_stall_us"),
                         ("memory_full_pressure", "memory_full_stall_us"), ("io_pressure", "io_stall_us")):
            d = _delta(p, cur, fig)
            if d is not None:
                out[HOST + key] = min(max(d / dt_us, 0.0), 1.0)

    def close(self) -> None:
        with self.lock:
            self.proc.close()
            if self.host is not None:
                self.host.close()
            if self.lease is not None:
                self.lease.release()
            self.gpu.close()


_SAMPLER: list = [None]  # this process's Sampler, or None (not configured, or off)
_CONFIG_LOCK = threading.Lock()


def configure(options: Any, run_key: str | None = None, nvml: Any = None) -> Sampler | None:
    """This process samples with ``options`` (a :class:`TelemetryOptions`, or the config value
    :func:`~forge_obs.recording.telemetry.options.parse` takes; None or disabled: no sampling),
    its host lease named after ``run_key`` (the run directory). Returns the sampler. Never raises
    for a process's own failure to read (a figure it cannot read is left out)."""
    opts = options if isinstance(options, TelemetryOptions) else parse(options)
    with _CONFIG_LOCK:
        old = _SAMPLER[0]
        same = old is not None and (old.options, old.run_key, old.pid) == (opts, run_key or "", os.getpid())
        if same and opts.enabled:
            return old  # the same session's options again: the previous readings stay
        _SAMPLER[0] = None
        if old is not None:
            old.close()
        if opts.enabled:
            s = Sampler(opts, run_key or "", nvml)
            s.gpu.on_device = _note_device
            _SAMPLER[0] = s
        return _SAMPLER[0]


def _note_device(d: dict) -> None:
    from forge_obs.recording.timeline.recorder import record_event

    record_event("gpu_device", **d)


def current() -> Sampler | None:
    """This process's sampler (None: telemetry off or not configured here)."""
    s = _SAMPLER[0]
    return s if s is not None and s.pid == os.getpid() else None


def add_to(taken: Any) -> int:
    """Add a sample (if one is due) to ``taken`` as forge_obs's own values; returns how many
    values. Never raises: a sample that fails costs only itself."""
    s = current()
    if s is None:
        return 0
    try:
        values = s.sample()
    except Exception:  # noqa: BLE001 - telemetry never costs a cut
        return 0
    if not values:
        return 0
    accs = taken.accs
    for k, v in values.items():
        red = KEYS[k].reduction
        acc = accumulator_for(red.value)(red)
        acc.append(v)
        accs[k] = acc
    return len(values)


def status() -> dict[str, Any]:
    """What this process samples: ``{"enabled", "host_reader", "gpu", "gpu_devices", "schedstat"}``
    (``gpu``: None when GPU figures are read, else why not)."""
    s = current()
    if s is None:
        return {"enabled": False}
    with s.lock:
        gpu_on = s.gpu.start()
    return {"enabled": True, "host_reader": s.lease is not None and s.lease.sock is not None,
            "gpu": None if gpu_on else s.gpu.note,
            "gpu_devices": [u for u, _i, _h in s.gpu.devices], "schedstat": s.proc.delays.available}
