"""The ``"telemetry"`` key of ``init_backends`` (and of ``forge_obs.spmd.init``'s config).

    >>> from forge_obs.recording.telemetry.options import TelemetryOptions, parse
    >>> parse({"gpu": False}).gpu, parse(False).enabled, parse(None).enabled
    (False, False, True)
    >>> parse({"interval": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: telemetry: unknown key(s) ['interval']; valid: enabled, host, gpu, interval_s

``FORGE_OBS_TELEMETRY=off`` (or ``0``, ``false``, ``no``) turns it off wherever the config does
not say (``"telemetry": {"enabled": true}`` turns it back on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from forge_obs.core.env import env_value, parse_flag
from forge_obs.core.options import parse_options
from forge_obs.core.redact import redacted_repr

__all__ = ["TelemetryOptions", "parse", "env_default", "ENV"]

#: the environment switch: its value is the default of ``enabled``
ENV = "FORGE_OBS_TELEMETRY"


def env_default() -> bool:
    """``enabled``'s default: on, unless ``FORGE_OBS_TELEMETRY`` says off."""
    v = env_value(ENV)
    return True if v is None or not v.strip() else parse_flag(v)


@dataclass(kw_only=True, slots=True)
class TelemetryOptions:
    """What every process samples at its cuts (docs/telemetry.md)."""

    #: sample at all (``"telemetry": false`` is the same as ``{"enabled": false}``)
    enabled: bool = True
    #: the host's figures (load, runnable tasks, steal, pressure), read by one process per host
    host: bool = True
    #: the GPU figures of the devices a process uses (needs ``nvidia-ml-py``: the ``gpu`` extra)
    gpu: bool = True
    #: about how often a process samples: at the steps that are multiples of the power of two of
    #: steps nearest to this at its step rate, at most 4 (every step where a step takes this long
    #: or longer); a step without a sample carries no telemetry, the next sample covers it
    interval_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("enabled", "host", "gpu"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"telemetry: {name} must be true or false, got {redacted_repr(getattr(self, name))}")
        v = self.interval_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
            raise ValueError(f"telemetry: interval_s must be a number of seconds in [0, 3600], got {redacted_repr(v)}")
        self.interval_s = float(v)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse(value: Any) -> TelemetryOptions:
    """The ``"telemetry"`` config value: a dict of :class:`TelemetryOptions` fields, ``True`` /
    ``None`` (the defaults), or ``False`` (off). ValueError naming the valid keys otherwise."""
    if value is False:
        return TelemetryOptions(enabled=False)
    if value is None or value is True:
        return TelemetryOptions(enabled=env_default())
    if not isinstance(value, dict):
        raise ValueError("telemetry must be a dict (e.g. {\"gpu\": false}), true or false, got "
                         f"{redacted_repr(value)}")
    given = dict(value)
    given.setdefault("enabled", env_default())
    return parse_options(TelemetryOptions, "telemetry", given)
