"""Telemetry: what every process of a run is doing to, and suffering from, its host and GPUs,
sampled by forge_obs itself at each cut and recorded in the cut's step under ``obs/sys/...``.

- :mod:`~forge_obs.recording.telemetry.keys`: every key, defined once (reduction, unit, source)
- :mod:`~forge_obs.recording.telemetry.options`: the ``"telemetry"`` config and ``FORGE_OBS_TELEMETRY``
- :mod:`~forge_obs.recording.telemetry.proc`: the process (CPU, context switches, memory, threads,
  run-queue wait)
- :mod:`~forge_obs.recording.telemetry.host`: the host (load, runnable tasks, steal, PSI), one
  reader per host
- :mod:`~forge_obs.recording.telemetry.gpu`: the GPUs a process uses (NVML)
- :mod:`~forge_obs.recording.telemetry.sampler`: the per-process sampler; ``configure`` and
  ``add_to`` (a cut's values)

Sampling runs where a cut is exported (the fetcher, the SPMD shipper thread, the controller's
step assembly), never on the thread that asked for the cut. Nothing here imports Monarch or
torch. See docs/telemetry.md.
"""

from __future__ import annotations

from forge_obs.core.lazy import lazy_exports

__all__ = ["configure", "add_to", "current", "status", "KEYS", "PREFIX", "is_telemetry", "TelemetryOptions"]

_EXPORTS = {
    "configure": "forge_obs.recording.telemetry.sampler",
    "add_to": "forge_obs.recording.telemetry.sampler",
    "current": "forge_obs.recording.telemetry.sampler",
    "status": "forge_obs.recording.telemetry.sampler",
    "KEYS": "forge_obs.recording.telemetry.keys",
    "PREFIX": "forge_obs.recording.telemetry.keys",
    "is_telemetry": "forge_obs.recording.telemetry.keys",
    "TelemetryOptions": "forge_obs.recording.telemetry.options",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
