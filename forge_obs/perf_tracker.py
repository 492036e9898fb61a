"""torchforge-compatible alias: ``from forge_obs.perf_tracker import Tracer, trace``
(torchforge: ``forge.observability.perf_tracker``). See :mod:`forge_obs.tracer`."""

from forge_obs.tracer import Tracer, trace

__all__ = ["Tracer", "trace"]
