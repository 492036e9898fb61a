"""TorchTitan on CPU: its device type and device module are chosen once, when
``torchtitan.tools.utils`` is imported (an accelerator if one is found, else CUDA), and copied by
the modules that import them. :func:`use_cpu` sets them to the CPU before any of those modules
loads; it is configuration of TorchTitan's module state, not a change of its source.

``torch.cpu`` lacks the memory calls TorchTitan's memory monitor makes; :class:`CpuDeviceModule`
adds them, from the process's resident memory: ``memory_stats`` reports the peak resident set of
this process (``ru_maxrss``) as both active and reserved peak bytes (the OS keeps no resettable
peak, so ``reset_peak_memory_stats`` does nothing), and ``get_device_properties`` the machine's
physical memory as the capacity.

TorchTitan 0.3.0 is written against a newer torch than this project pins (2.13): after the first
step it calls ``torch.distributed.set_timeout``, which torch 2.13 has under its private name
``distributed_c10d._set_pg_timeout``; :func:`use_cpu` gives it the public name when it is missing.
"""

from __future__ import annotations

import os
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["CpuDeviceModule", "use_cpu"]


class CpuDeviceModule:
    """``torch.cpu`` plus the memory calls of TorchTitan's ``DeviceMemoryMonitor``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        """An index, as CUDA's (``torch.cpu.current_device()`` is the string "cpu", which
        ``barrier(device_ids=...)`` refuses)."""
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)


def use_cpu() -> None:
    """Make TorchTitan train on the CPU (gloo). Raises if a TorchTitan module that copies the
    device type was imported before (it would keep the old one)."""
    copied = [m for m in ("torchtitan.components.metrics", "torchtitan.distributed.utils",
                          "torchtitan.distributed.parallel_dims", "torchtitan.trainer") if m in sys.modules]
    if copied:
        raise RuntimeError(f"apps.titan.cpu.use_cpu() must run before importing {copied}")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torchtitan.tools import utils

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout
    utils.device_type, utils.device_module = "cpu", CpuDeviceModule()
