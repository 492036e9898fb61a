"""TorchTitan 0.3.0 on CPU and on this project's torch (2.13).

TorchTitan on CPU: its device type and device module are chosen once, when
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
With pipeline parallelism it calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``
with microbatches it split itself (a newer torch's signature); torch 2.13's ``step`` splits a whole
batch and runs ``_step_microbatches`` on the pieces. :func:`presplit_schedule` wraps a torch 2.13
single-stage schedule (1F1B, GPipe) so that call runs ``_step_microbatches`` on TorchTitan's
microbatches directly, after the same per-step set-up ``step`` does.
"""

from __future__ import annotations

import os
import resource
import sys
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["CpuDeviceModule", "use_cpu", "presplit_schedule"]


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
        raise RuntimeError(f"apps.titan.compat.use_cpu() must run before importing {copied}")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torchtitan.tools import utils

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout
    utils.device_type, utils.device_module = "cpu", CpuDeviceModule()


class _PresplitStep:
    """A torch 2.13 single-stage pipeline schedule that takes TorchTitan's pre-split microbatches."""

    def __init__(self, schedule: Any) -> None:
        self._schedule = schedule

    def __getattr__(self, name: str) -> Any:
        return getattr(self._schedule, name)

    def step(self, *, arg_mbs: Any = None, kwarg_mbs: Any = None, target_mbs: Any = None, losses: Any = None,
             loss_kwargs: Any = None, return_outputs: bool = True) -> None:
        s = self._schedule
        if s._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("pipeline step() needs gradients enabled")
        s._stage.has_backward = s._has_backward
        s._stage.clear_runtime_states()
        s._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)


def presplit_schedule(schedule: Any) -> Any:
    """``schedule`` itself when its ``step`` takes ``arg_mbs`` (a torch that has the pre-split
    call), else the wrapper above; raises for a schedule it cannot wrap (several stages per rank)."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return schedule
    if not isinstance(schedule, PipelineScheduleSingle):
        raise NotImplementedError(f"{type(schedule).__name__}: on torch {torch.__version__} the app runs "
                                  "single-stage pipeline schedules (1F1B, GPipe) only")
    return _PresplitStep(schedule)
