"""Every telemetry key, defined once: its name, how ranks' values reduce into the global one,
its unit, where it is read and what it means. The reader, the docs (docs/telemetry.md, checked
against this table by a test), the doctor and the live alerts take the names from here.

    >>> from forge_obs.recording.telemetry.keys import KEYS, PROC
    >>> k = KEYS[PROC + "runq_wait_s"]
    >>> k.reduction.value, k.unit
    ('sum', 's')

Every key is under ``obs/sys/``: forge_obs's own figures (the ``obs/`` prefix is reserved, so a
user key never collides with one; the console shows them with ``"show_obs": true``, the local
store, W&B and TensorBoard log them by default). ``proc`` keys: every process that is cut
(each rank, and the controller), for the interval since its previous sample; ``host`` keys: one
process per host (the host's reader) for the interval since the reader's previous sample;
``gpu`` keys: the devices a process uses, where NVML is present.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_obs.recording.reduce import Reduce

__all__ = ["PREFIX", "PROC", "HOST", "GPU", "Key", "KEYS", "is_telemetry"]

PREFIX = "obs/sys/"
PROC = PREFIX + "proc/"
HOST = PREFIX + "host/"
GPU = PREFIX + "gpu/"


@dataclass(frozen=True, slots=True)
class Key:
    """One telemetry key."""

    name: str
    #: how the ranks' values of a step reduce into its global value
    reduction: Reduce
    unit: str
    #: where the figure is read
    source: str
    #: what it means
    doc: str


def _keys(*rows: tuple) -> dict[str, Key]:
    return {r[0]: Key(*r) for r in rows}


_RUSAGE = "getrusage(RUSAGE_SELF)"
_SCHED = "/proc/self/task/*/schedstat"
KEYS: dict[str, Key] = _keys(
    (PROC + "interval_s", Reduce.MAX, "s", "monotonic clock",
     "wall time the process's figures cover: since its previous sample"),
    (PROC + "cpu_s", Reduce.SUM, "s", _RUSAGE, "CPU time (user + system, every thread) in the interval"),
    (PROC + "cpu_util", Reduce.SUM, "cores", _RUSAGE,
     "cpu_s / interval_s: cores the process kept busy (global: the job's processes together)"),
    (PROC + "runq_wait_s", Reduce.SUM, "s", _SCHED,
     "time its threads were runnable but waited for a CPU in the interval (the kernel's run_delay, summed "
     "over threads): preempted or starved, not sleeping"),
    (PROC + "runq_wait_share", Reduce.MAX, "share", _SCHED, "runq_wait_s / interval_s"),
    (PROC + "rss_gb", Reduce.SUM, "GB", "/proc/self/statm", "resident memory at the sample"),
    (PROC + "threads", Reduce.SUM, "threads", "/proc/self/task",
     "threads of the process (the link count of its directory)"),
    (PROC + "ctx_voluntary", Reduce.SUM, "switches", _RUSAGE,
     "voluntary context switches in the interval (a thread blocked or slept)"),
    (PROC + "ctx_involuntary", Reduce.SUM, "switches", _RUSAGE,
     "involuntary context switches in the interval (a thread was preempted)"),
    (HOST + "cores", Reduce.MAX, "cores", "os.cpu_count()", "logical CPUs of the host"),
    (HOST + "load1", Reduce.MAX, "tasks", "/proc/loadavg", "1-minute load average (global: the busiest host)"),
    (HOST + "runnable", Reduce.MAX, "tasks", "/proc/loadavg",
     "tasks running or runnable at the sample (the reader included)"),
    (HOST + "runnable_per_core", Reduce.MAX, "tasks", "/proc/loadavg",
     "runnable / cores: above 1, tasks queue for a CPU"),
    (HOST + "cpu_util", Reduce.MAX, "share", "/proc/stat", "share of the host's CPU time busy in the interval"),
    (HOST + "steal_share", Reduce.MAX, "share", "/proc/stat",
     "share of the host's CPU time the hypervisor gave to other guests in the interval"),
    (HOST + "cpu_pressure", Reduce.MAX, "share", "/proc/pressure/cpu",
     "share of the interval in which some task waited for a CPU (PSI 'some'; where the kernel has PSI)"),
    (HOST + "memory_pressure", Reduce.MAX, "share", "/proc/pressure/memory",
     "share of the interval in which some task stalled on memory: reclaim, swap-in, thrashing (PSI 'some')"),
    (HOST + "memory_full_pressure", Reduce.MAX, "share", "/proc/pressure/memory",
     "share of the interval in which every non-idle task stalled on memory (PSI 'full')"),
    (HOST + "io_pressure", Reduce.MAX, "share", "/proc/pressure/io",
     "share of the interval in which some task waited for I/O (PSI 'some')"),
    (GPU + "util", Reduce.MEAN, "share", "nvmlDeviceGetUtilizationRates",
     "share of the last sample period a kernel ran on the device"),
    (GPU + "memory_used_gb", Reduce.MAX, "GB", "nvmlDeviceGetMemoryInfo", "device memory in use (global: the fullest)"),
    (GPU + "temperature_c", Reduce.MAX, "°C", "nvmlDeviceGetTemperature", "die temperature"),
    (GPU + "power_w", Reduce.MEAN, "W", "nvmlDeviceGetPowerUsage", "board power draw"),
    (GPU + "sm_clock_mhz", Reduce.MIN, "MHz", "nvmlDeviceGetClockInfo", "SM clock (global: the slowest)"),
    (GPU + "memory_clock_mhz", Reduce.MIN, "MHz", "nvmlDeviceGetClockInfo", "memory clock (global: the slowest)"),
    (GPU + "throttle_power", Reduce.MAX, "0/1", "nvmlDeviceGetCurrentClocksEventReasons",
     "1 while clocks are held down by the power cap"),
    (GPU + "throttle_thermal", Reduce.MAX, "0/1", "nvmlDeviceGetCurrentClocksEventReasons",
     "1 while clocks are held down for temperature (software or hardware)"),
    (GPU + "throttle_hw", Reduce.MAX, "0/1", "nvmlDeviceGetCurrentClocksEventReasons",
     "1 while the hardware slows the clocks (slowdown signal, power brake)"),
)


def is_telemetry(key: str) -> bool:
    """Whether ``key`` is a telemetry key (under :data:`PREFIX`)."""
    return key.startswith(PREFIX)
