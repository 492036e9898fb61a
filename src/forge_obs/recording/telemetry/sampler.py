"""One process's telemetry: at the cuts it samples (off the caller's thread: where the cut is
exported), the figures of the interval since the process's previous sample become values of
the cut under ``obs/sys/...`` (:mod:`.keys`).

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

**Which cuts sample** (:meth:`Sampler.due`). Given the cut's step, a process samples at the steps
that are multiples of its *stride*: the power of two of steps nearest to ``interval_s`` at its
recent step rate, at most :data:`MAX_STRIDE` (4; 1 where a step takes ``interval_s`` or longer; a
slower step counts at once, a quicker one gradually). Every process of a run cuts the same steps
at about the same moment, so they reckon the same stride and sample the same steps; two
processes whose strides differ (a power of two apart) both sample every step the longer stride
samples. So a step has every process's sample or none, mostly, and a reduction over ranks (the
job's CPU, its memory) is over all of them; any 4 consecutive steps hold a sample of every
process (the doctor's and the live alerts' windows). A step that is late (twice ``interval_s``
since the last sample) samples whatever its step. Without a step (a caller that has none), a
cut samples when ``interval_s`` has passed since the last sample.

:func:`configure` (each process, from the session's options) sets the process's sampler, or
none; :func:`add_to` adds a sample to a cut's exported snapshot as forge_obs's own values: rows
of its packed groups (``{reduction: (keys, rows)}``, :func:`forge_obs.recording.export.export_taken`),
not counted as recorded values (``obs/values_recorded``), merged across ranks by each key's
reduction like any value, so every route (direct, group bundles, SPMD helpers) carries them and
every backend gets them per rank and reduced. The key lists are made once per set of keys (a
process's keys change only when it becomes its host's reader or finds a GPU), so a sample costs
no object per key.
"""

from __future__ import annotations

import math
import os
import threading
import time
from itertools import repeat
from typing import Any

from forge_obs.recording.reduce import Reduce
from forge_obs.recording.telemetry.gpu import GpuReader
from forge_obs.recording.telemetry.host import HostLease, HostReader
from forge_obs.recording.telemetry.keys import HOST, KEYS, PROC
from forge_obs.recording.telemetry.options import TelemetryOptions, parse
from forge_obs.recording.telemetry.proc import ProcReader

__all__ = ["Sampler", "configure", "add_to", "current", "status", "merge_packed", "MAX_STRIDE"]

_GB = 1e9
#: the most steps between two samples: the doctor and the live alerts judge a condition over
#: ``fire_steps`` (4) steps or more, so that each such window holds a sample of every process
MAX_STRIDE = 4
_SQRT2 = math.sqrt(2.0)
#: the keys, made once (a sample's dict and its layout's lookup then hash and compare no new string)
_RSS, _THREADS, _IV, _CPU, _UTIL = (PROC + k for k in ("rss_gb", "threads", "interval_s", "cpu_s", "cpu_util"))
_VCSW, _IVCSW, _RUNQ, _RUNQ_SHARE = (PROC + k for k in ("ctx_voluntary", "ctx_involuntary", "runq_wait_s",
                                                         "runq_wait_share"))
_CORES, _LOAD, _RUNNABLE, _RPC, _HOST_UTIL, _STEAL = (HOST + k for k in ("cores", "load1", "runnable",
                                                                        "runnable_per_core", "cpu_util", "steal_share"))
_PSI = tuple((HOST + key, fig) for key, fig in (("cpu_pressure", "cpu_stall_us"), ("memory_pressure", "memory_stall_us"),
                                               ("memory_full_pressure", "memory_full_stall_us"),
                                               ("io_pressure", "io_stall_us")))


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
        self.last_cut: float | None = None  # when the previous cut asked
        self.period_s: float | None = None  # the time between cuts (moving average)
        self.layouts: dict[tuple, list] = {}  # the keys of a sample, in order -> its packed layout
        self.lock = threading.Lock()

    def stride(self) -> int:
        """The steps between two samples: the power of two nearest to ``interval_s`` over the
        time between cuts, at most :data:`MAX_STRIDE` (1 where a cut takes ``interval_s`` or
        longer, or the time is not known)."""
        p, iv = self.period_s, self.options.interval_s
        if not p or p * _SQRT2 >= iv:
            return 1
        k = 2
        while k < MAX_STRIDE and p * k * _SQRT2 < iv:  # nearest in log scale: below k * sqrt(2)
            k *= 2
        return k

    def due(self, now: float, step: int | None = None) -> bool:
        """Whether the cut of ``step`` at ``now`` samples (see the module docstring); notes the
        time between cuts either way."""
        last, self.last_cut = self.last_cut, now
        if last is not None and now > last:  # a slower step counts at once, a quicker one by a quarter
            gap, p = now - last, self.period_s
            self.period_s = gap if p is None or gap > p else p + 0.25 * (gap - p)
        if self.prev is None:
            return True
        since, iv = now - self.prev[0], self.options.interval_s
        if type(step) is not int:
            return since >= iv
        return since >= 2 * iv or step % MAX_STRIDE == 0 or step % self.stride() == 0

    def sample(self, now: float | None = None, step: int | None = None) -> dict[str, float] | None:
        """The figures since the previous sample, or None when this cut does not sample
        (:meth:`due`: the cut of ``step``; without one, ``interval_s`` did not pass yet)."""
        with self.lock:
            now = time.monotonic() if now is None else now
            return self._read(now) if self.due(now, step) else None

    def packed(self, now: float | None = None, step: int | None = None) -> dict[str, tuple] | None:
        """:meth:`sample` as packed groups, ``{reduction: (keys, rows)}`` (the keys' list is the
        same object for the same keys: never modify it), or None when this cut does not sample."""
        values = self.sample(now, step)
        if values is None:
            return None
        layout = self.layouts.get(sig := tuple(values))
        if layout is None:
            layout = self.layouts[sig] = _layout(sig)
        pick = list(values.values()).__getitem__
        out = {}
        for rt, keys, idx, mean in layout:
            rows = list(map(pick, idx))
            out[rt] = (keys, list(zip(rows, repeat(1))) if mean else rows)
        return out

    def _read(self, now: float) -> dict[str, float]:
        out: dict[str, float] = {}
        self._proc(now, out)
        if self.lease is not None and self.lease.held(now):
            self._host(now, out)
        if self.gpu.started is not False:
            out.update(self.gpu.read(now))
        return out

    def _proc(self, now: float, out: dict) -> None:
        cur = self.proc.read(now)
        prev, self.prev = self.prev, (now, cur)
        rss, threads = cur.get("rss_bytes"), cur.get("threads")
        if rss is not None:
            out[_RSS] = rss / _GB
        if threads is not None:
            out[_THREADS] = float(threads)
        if prev is None or now <= prev[0]:
            return
        dt, p = now - prev[0], prev[1]
        cpu = cur["cpu_s"] - p["cpu_s"]
        out[_IV] = dt
        out[_CPU] = cpu
        out[_UTIL] = cpu / dt
        out[_VCSW] = float(cur["ctx_voluntary"] - p["ctx_voluntary"])
        out[_IVCSW] = float(cur["ctx_involuntary"] - p["ctx_involuntary"])
        runq, was = cur.get("runq_ns"), p.get("runq_ns")
        if runq is not None and was is not None:
            w = max(runq - was, 0) / 1e9
            out[_RUNQ] = w
            out[_RUNQ_SHARE] = w / dt

    def _host(self, now: float, out: dict) -> None:
        if self.host is None:
            self.host = HostReader()
        cur = self.host.read()
        prev, self.prev_host = self.prev_host, (now, cur)
        cores = cur["cores"]
        out[_CORES] = float(cores)
        if "load1" in cur:
            out[_LOAD] = cur["load1"]
            out[_RUNNABLE] = float(cur["runnable"])
            out[_RPC] = cur["runnable"] / cores
        if prev is None or now <= prev[0]:
            return
        dt_us = (now - prev[0]) * 1e6
        p = prev[1]
        if "cpu_ticks" in cur and "cpu_ticks" in p and cur["cpu_ticks"] > p["cpu_ticks"]:
            ticks = cur["cpu_ticks"] - p["cpu_ticks"]
            out[_HOST_UTIL] = 1.0 - (cur["idle_ticks"] - p["idle_ticks"]) / ticks
            out[_STEAL] = (cur["steal_ticks"] - p["steal_ticks"]) / ticks
        for key, fig in _PSI:
            if fig in cur and fig in p:
                out[key] = min(max((cur[fig] - p[fig]) / dt_us, 0.0), 1.0)

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
#: this process's id, set again in a forked child (a sampler is its process's: a child's cuts
#: sample nothing until the child configures its own); os.getpid() is a system call
_PID = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


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
    return s if s is not None and s.pid == _PID[0] else None


def _layout(keys: tuple) -> list:
    """``[(reduction name, [key, ...], [index in keys, ...], whether its row is (sum, count))]``."""
    groups: dict[str, tuple] = {}
    for i, k in enumerate(keys):
        red = KEYS[k].reduction
        g = groups.setdefault(red.value, (red.value, [], [], red is Reduce.MEAN))
        g[1].append(k)
        g[2].append(i)
    return list(groups.values())


def add_to(snapshot: dict, step: int | None = None) -> int:
    """Add this process's sample, if the cut of ``step`` takes one (:meth:`Sampler.due`), to
    ``snapshot`` (a cut exported packed: :func:`forge_obs.recording.export.export_taken`) as
    forge_obs's own values; returns how many. Never raises: a sample that fails costs only itself."""
    s = current()
    if s is None:
        return 0
    try:
        groups = s.packed(step=step)
        return merge_packed(snapshot, groups) if groups else 0
    except Exception:  # noqa: BLE001 - telemetry never costs a cut
        return 0


#: (user keys, telemetry keys) of a group -> both in one list, made once for the same two lists
#: (by identity, as the column keys' lists are the same step after step): at most 64 pairs
_JOINED: dict[tuple, tuple] = {}


def merge_packed(snapshot: dict, groups: dict[str, tuple]) -> int:
    """``groups`` (``{reduction: (keys, rows)}``) added to ``snapshot["packed"]``: a reduction
    the snapshot has gets the keys and rows after its own (its rows as lists of rows or as a
    tuple of field columns, as the snapshot has them). Returns how many values."""
    packed = snapshot.get("packed")
    if packed is None:
        packed = snapshot["packed"] = {}
    n = 0
    for rt, (keys, rows) in groups.items():
        n += len(keys)
        g = packed.get(rt)
        if g is None:
            packed[rt] = (keys, rows)
            continue
        own_keys, own = g
        hit = _JOINED.get((id(own_keys), id(keys)))
        if hit is None or hit[0] is not own_keys or hit[1] is not keys:
            if len(_JOINED) >= 64:
                _JOINED.clear()
            hit = _JOINED[(id(own_keys), id(keys))] = (own_keys, keys, own_keys + keys)
        if type(own) is tuple:  # field columns
            data: Any = tuple(a + list(b) for a, b in zip(own, zip(*rows)))
        else:
            data = own + rows
        packed[rt] = (hit[2], data)
    return n


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
