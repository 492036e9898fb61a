"""The GPU figures of the devices this process uses, through NVML (``nvidia-ml-py``, the ``gpu``
extra): utilization, memory used, temperature, power, clocks and why the clocks are held down.

    >>> from forge_obs.recording.telemetry.gpu import GpuReader
    >>> g = GpuReader(nvml=False)       # NVML left out: nothing is read, and it says why
    >>> g.read(), g.note
    ({}, 'GPU telemetry off: NVML not used')

**Which devices.** A process uses the devices on which NVML lists it among the running compute
or graphics processes; where NVML cannot see the process (another PID namespace), the device
torch made current in it (``torch.cuda.current_device()``, once torch has initialised CUDA;
torch is never imported here), found by its UUID. Until it uses one, nothing is read (asked
again every ``resolve_s``). Each device found is recorded once on the timeline
(``record_event("gpu_device", uuid=..., index=..., name=...)``): device UUID -> rank in the
``events`` SQL view.

**Where NVML is missing** (no ``nvidia-ml-py``, or no driver): no ``obs/sys/gpu/...`` key, and
:attr:`GpuReader.note` says why; a process that uses CUDA logs it once. Nothing else changes.

Several devices in one process: utilization is their mean, memory and power their sums,
temperature and the throttle flags their maximum, clocks their minimum. A figure the device
does not support is left out from then on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

from forge_obs.recording.telemetry.keys import GPU

__all__ = ["GpuReader", "THROTTLE_BITS", "import_nvml"]

logger = logging.getLogger("forge_obs")

#: clock event (throttle) reason bits of NVML -> the flag they set
THROTTLE_BITS = {"throttle_power": 0x4, "throttle_thermal": 0x20 | 0x40, "throttle_hw": 0x8 | 0x80}
_TEMPERATURE_GPU, _CLOCK_SM, _CLOCK_MEM = 0, 1, 2


def import_nvml() -> Any:
    """The ``pynvml`` module of ``nvidia-ml-py``, or None where it is not installed."""
    try:
        import pynvml  # the gpu extra: nvidia-ml-py
    except Exception:  # noqa: BLE001 - absent or broken: GPU telemetry is off
        return None
    return pynvml


def _torch_device_uuid() -> str | None:
    """The UUID of the device torch made current in this process, once it initialised CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        uuid = str(getattr(props, "uuid", "") or "")
    except Exception:  # noqa: BLE001
        return None
    return None if not uuid else (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


class GpuReader:
    """This process's devices' figures (see the module docstring). ``nvml``: the NVML module
    (None: ``pynvml`` imported on first use; False: not used)."""

    def __init__(self, nvml: Any = None, pid: int | None = None, resolve_s: float = 5.0) -> None:
        self.nvml = nvml
        self.pid = os.getpid() if pid is None else pid
        self.resolve_s = resolve_s
        self.started: bool | None = None
        self.note: str | None = None
        self.devices: list = []  # [(uuid, index, handle)]
        self.resolved_at = -1e18
        self.unsupported: set = set()
        self.on_device: Callable[[dict], None] | None = None  # told once per device found

    def start(self) -> bool:
        if self.started is not None:
            return self.started
        self.started = False
        if self.nvml is False:
            self.note = "GPU telemetry off: NVML not used"
            return False
        if self.nvml is None:
            self.nvml = import_nvml()
        if self.nvml is None:
            self.note = "GPU telemetry off: nvidia-ml-py is not installed (pip install 'forge-obs[gpu]')"
        else:
            try:
                self.nvml.nvmlInit()
                self.started = True
            except Exception as e:  # noqa: BLE001 - no driver, no device
                self.note = f"GPU telemetry off: NVML did not start ({type(e).__name__}: {e})"
        if not self.started and _torch_device_uuid() is not None:
            logger.warning("forge_obs: this process uses a GPU: %s", self.note)
        return self.started

    def _resolve(self, now: float) -> None:
        """Find the devices this process uses (every ``resolve_s`` until it uses one)."""
        if self.devices or now - self.resolved_at < self.resolve_s:
            return
        self.resolved_at = now
        nv = self.nvml
        try:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001
            return
        found = [i for i, h in enumerate(handles) if self.pid in self._pids(h)]
        if not found:
            uuid = _torch_device_uuid()
            found = [i for i, h in enumerate(handles) if uuid is not None and self._uuid(h) == uuid]
        for i in found:
            h = handles[i]
            self.devices.append((self._uuid(h), i, h))
            if self.on_device is not None:
                self.on_device({"uuid": self._uuid(h), "index": i, "name": self._call(nv.nvmlDeviceGetName, h)})

    def _pids(self, handle: Any) -> set:
        pids: set = set()
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            f = getattr(self.nvml, fn, None)
            try:
                pids.update(p.pid for p in (f(handle) if f is not None else ()))
            except Exception:  # noqa: BLE001 - not supported on this device
                pass
        return pids

    def _uuid(self, handle: Any) -> str:
        u = self._call(self.nvml.nvmlDeviceGetUUID, handle)
        return u.decode() if isinstance(u, bytes) else str(u)

    def _call(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001
            return None

    def read(self, now: float | None = None) -> dict[str, float]:
        """``{telemetry key: value}`` for this process's devices (empty: none, or no NVML)."""
        if not self.start():
            return {}
        self._resolve(time.monotonic() if now is None else now)
        per = [self._device(h) for _u, _i, h in self.devices]
        return _combine(per)

    def _device(self, h: Any) -> dict[str, float]:
        nv, out = self.nvml, {}
        reads = (("util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                 ("memory_used_gb", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 1e9),
                 ("temperature_c", lambda: float(nv.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU))),
                 ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                 ("sm_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, _CLOCK_SM))),
                 ("memory_clock_mhz", lambda: float(nv.nvmlDeviceGetClockInfo(h, _CLOCK_MEM))),
                 ("reasons", lambda: self._reasons(h)))
        for name, fn in reads:
            if name in self.unsupported:
                continue
            try:
                out[name] = fn()
            except Exception:  # noqa: BLE001 - not supported here: not asked again
                self.unsupported.add(name)
        reasons = out.pop("reasons", None)
        if reasons is not None:
            for flag, bits in THROTTLE_BITS.items():
                out[flag] = 1.0 if int(reasons) & bits else 0.0
        return out

    def _reasons(self, h: Any) -> int:
        nv = self.nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(h))

    def close(self) -> None:
        if self.started:
            self._call(self.nvml.nvmlShutdown)
        self.started = None
        self.devices = []


#: how one process's devices combine into its value of a key
_COMBINE: dict[str, Callable[[list], float]] = {
    "util": lambda xs: sum(xs) / len(xs), "memory_used_gb": sum, "power_w": sum, "temperature_c": max,
    "sm_clock_mhz": min, "memory_clock_mhz": min, "throttle_power": max, "throttle_thermal": max, "throttle_hw": max,
}


def _combine(per: list[dict]) -> dict[str, float]:
    out = {}
    for name, fn in _COMBINE.items():
        xs = [d[name] for d in per if name in d]
        if xs:
            out[GPU + name] = float(fn(xs))
    return out
