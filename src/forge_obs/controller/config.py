"""``init_backends``'s config dict, parsed and checked once into a :class:`LoggerConfig`.

    >>> import tempfile
    >>> from forge_obs.controller.config import LoggerConfig
    >>> cfg = LoggerConfig.parse({"console": {"logging_mode": "global_reduce"},
    ...                           "run": {"id": "exp1", "root": tempfile.mkdtemp()}})
    >>> sorted(cfg.backends), cfg.flush_timeout_s, cfg.run.run_id
    (['console', 'jsonl'], 10.0, 'exp1')

Top-level keys are backend names (or ``"package.module:Class"`` paths) plus the reserved keys
below. Mistakes raise ``ValueError`` naming the valid choices; what a message quotes of the
config goes through :func:`forge_obs.core.redact.redacted_repr` (no credential in an error).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from forge_obs.controller.backend_worker import DEFAULT_QUEUE_STEPS
from forge_obs.controller.pipeline import DEFAULT_BATCH_S
from forge_obs.core.options import check_keys, parse_options
from forge_obs.core.redact import redacted_repr
from forge_obs.core.run import RunConfig
from forge_obs.wire.messages import DEFAULT_STREAM_INTERVAL_S

__all__ = ["LoggerConfig", "RESERVED_KEYS", "DEFAULT_FLUSH_TIMEOUT_S", "check_keys", "parse_options"]

RESERVED_KEYS = ("run", "flush_timeout_s", "shutdown_timeout_s", "backend_init_timeout_s", "backend_queue_steps",
                 "backend_batch_s", "timeline", "stream_interval_s", "aggregate", "probe_round_trip", "telemetry")
#: ``"aggregate"``: answer cuts through one leader per (mesh, host) ("on"), directly ("off"), or
#: through leaders from 32 ranks in the job ("auto"); FORGE_OBS_AGGREGATE sets the default
AGGREGATE_MODES = ("auto", "on", "off")
DEFAULT_AGGREGATE = "auto"
DEFAULT_FLUSH_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
#: longer than W&B's own wait for its service (90 s), so W&B reports its own errors first
DEFAULT_BACKEND_INIT_TIMEOUT_S = 120.0
#: how often raw values reach ``per_rank_no_reduce`` backends between flushes


@dataclass
class LoggerConfig:
    """What ``init_backends`` was given, validated."""

    run: RunConfig
    #: how long a flush waits for a silent rank (once: it is not waited for again)
    flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S
    #: how long ``shutdown()`` (and ``wait_idle()``) wait for the backends in all
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    #: how long one backend's ``init`` may take (a W&B server that never answers): past it,
    #: ``init_backends`` raises naming that backend and changes nothing
    backend_init_timeout_s: float = DEFAULT_BACKEND_INIT_TIMEOUT_S
    #: steps a backend may fall behind before new steps are dropped for it (and counted)
    backend_queue_steps: int = DEFAULT_QUEUE_STEPS
    #: steps reach the backends in batches: a step at most this long after its cut completed
    #: (one wake-up of each backend per batch); 0: each step as soon as it is assembled
    backend_batch_s: float = DEFAULT_BATCH_S
    #: raw values reach ``per_rank_no_reduce`` backends at most this long after being recorded
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S
    timeline: dict[str, Any] | None = None
    #: how ranks answer a cut: through one leader per (mesh, host) or directly (AGGREGATE_MODES)
    aggregate: str = DEFAULT_AGGREGATE
    #: measure, right before each awaited flush, a raw no-op round trip to the same ranks
    #: (``obs/raw_round_trip_s``, beside the cut's ``obs/cut/...`` parts); it delays every flush
    #: by that round trip, so it is for benchmarks. FORGE_OBS_PROBE_ROUND_TRIP sets the default
    probe_round_trip: bool = False
    #: what every process samples at its cuts (``obs/sys/...``; docs/telemetry.md): a dict of
    #: :class:`~forge_obs.recording.telemetry.options.TelemetryOptions`, or False (off);
    #: FORGE_OBS_TELEMETRY=off sets the default
    telemetry: Any = field(default_factory=lambda: _telemetry_options(None))
    #: backend name -> its own config dict (``jsonl`` is on unless given as None/False)
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def parse(cls, config: Any) -> "LoggerConfig":
        if not isinstance(config, dict):
            raise ValueError(f"init_backends takes a dict of backend configs, got {type(config).__name__}")
        config = dict(config)
        run = RunConfig.from_config(config.pop("run", None))
        timeout = _seconds(config, "flush_timeout_s", DEFAULT_FLUSH_TIMEOUT_S)
        shutdown_timeout = _seconds(config, "shutdown_timeout_s", DEFAULT_SHUTDOWN_TIMEOUT_S)
        init_timeout = _seconds(config, "backend_init_timeout_s", DEFAULT_BACKEND_INIT_TIMEOUT_S)
        stream_interval = _seconds(config, "stream_interval_s", DEFAULT_STREAM_INTERVAL_S)
        batch_s = config.pop("backend_batch_s", DEFAULT_BATCH_S)
        if isinstance(batch_s, bool) or not isinstance(batch_s, (int, float)) or not 0 <= batch_s <= 10:
            raise ValueError(f"backend_batch_s must be a number of seconds in [0, 10], got {redacted_repr(batch_s)}")
        queue_steps = config.pop("backend_queue_steps", DEFAULT_QUEUE_STEPS)
        if isinstance(queue_steps, bool) or not isinstance(queue_steps, int) or queue_steps < 1:
            raise ValueError(f"backend_queue_steps must be an int >= 1, got {redacted_repr(queue_steps)}")
        from forge_obs.core.env import env_value

        aggregate = config.pop("aggregate", env_value("FORGE_OBS_AGGREGATE") or DEFAULT_AGGREGATE)
        if aggregate not in AGGREGATE_MODES:
            raise ValueError(f"aggregate must be one of {', '.join(map(repr, AGGREGATE_MODES))}, got {redacted_repr(aggregate)}")
        from forge_obs.core.env import env_flag

        probe = config.pop("probe_round_trip", env_flag("FORGE_OBS_PROBE_ROUND_TRIP"))
        if not isinstance(probe, bool):
            raise ValueError(f"probe_round_trip must be True or False, got {redacted_repr(probe)}")
        timeline = config.pop("timeline", None)
        from forge_obs.recording.timeline.schema import validate_options

        validate_options(timeline)  # raises ValueError on a bad key or value
        telemetry = _telemetry_options(config.pop("telemetry", None))
        config.setdefault("jsonl", {})  # the local store is always on unless "jsonl": None
        backends: dict[str, dict[str, Any]] = {}
        for name, bcfg in config.items():
            if bcfg is None or bcfg is False:
                continue
            if not isinstance(name, str):
                raise ValueError(f"backend names are strings, got {redacted_repr(name)}")
            if not isinstance(bcfg, dict):
                raise ValueError(f"config of backend {redacted_repr(name)} must be a dict, got {type(bcfg).__name__}")
            backends[name] = bcfg
        return cls(run=run, flush_timeout_s=timeout, shutdown_timeout_s=shutdown_timeout, backend_init_timeout_s=init_timeout,
                   backend_queue_steps=queue_steps, backend_batch_s=float(batch_s), stream_interval_s=stream_interval,
                   timeline=timeline, aggregate=aggregate, probe_round_trip=probe, telemetry=telemetry, backends=backends)


def _telemetry_options(value: Any) -> Any:
    """The ``"telemetry"`` value parsed (:func:`forge_obs.recording.telemetry.options.parse`)."""
    from forge_obs.recording.telemetry.options import parse

    return parse(value)


def _seconds(config: dict[str, Any], key: str, default: float) -> float:
    value = config.pop(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a number of seconds > 0, got {redacted_repr(value)}")
    return float(value)
