"""Environment switches.

    >>> from forge_obs.core.env import env_flag
    >>> env_flag("FORGE_OBS_SURELY_UNSET")
    False

``FORGE_DISABLE_METRICS`` is read once at import for ``record_metric`` (the hot path: reading the
environment per call would cost more than the call itself; :func:`forge_obs.set_enabled` switches
recording at run time). Tracers read their switches (``DISABLE_PERF_METRICS``,
``FORGE_DISABLE_PERF_METRICS``, ``FORGE_DISABLE_METRICS``, ``METRIC_TIMER_USES_GPU``) each time
one is created, as torchforge's do, through :func:`env_value`: a lookup in the environment's
backing dict, which skips ``os.environ.get``'s encoding and copying of the value.
"""

from __future__ import annotations

import os

__all__ = [
    "env_value",
    "parse_flag",
    "env_flag",
    "env_bool",
    "perf_metrics_disabled",
    "timer_uses_gpu",
    "local_socket_enabled",
    "tracer_switches",
    "METRICS_DISABLED",
    "PERF_METRICS_DISABLED",
]

_TRUE = {"1", "true", "yes", "on"}

# os.environ's backing dict (bytes keys on POSIX); os.environ.get is the fallback if it moves
_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_KEYS: dict[str, object] = {}


def env_value(name: str) -> str | None:
    """``os.environ.get(name)``, following changes made after import (a lookup in the backing dict)."""
    if _DATA is None or _ENCODE is None or _DECODE is None:
        return os.environ.get(name)
    k = _KEYS.get(name)
    if k is None:
        k = _KEYS[name] = _ENCODE(name)
    v = _DATA.get(k)
    return None if v is None else _DECODE(v)


def parse_flag(raw: str) -> bool:
    """The one reading of a boolean environment value: ``1``/``true``/``yes``/``on`` (any case,
    surrounding blanks ignored) are true, anything else is false."""
    return raw.strip().lower() in _TRUE


def env_flag(name: str) -> bool:
    """Whether ``name`` is set to a true value (:func:`parse_flag`), now."""
    v = env_value(name)
    return v is not None and parse_flag(v)


def env_bool(name: str) -> bool | None:
    """``True``/``False`` for a set variable (``1``/``true``/``yes``/``on`` are true), ``None``
    when unset (torchforge's ``METRIC_TIMER_USES_GPU``: unset means "use the timer argument")."""
    v = env_value(name)
    if v is None:
        return None
    return parse_flag(v)


_PERF_NAMES = ("DISABLE_PERF_METRICS", "FORGE_DISABLE_PERF_METRICS", "FORGE_DISABLE_METRICS")
_PERF_KEYS = tuple(_ENCODE(n) for n in _PERF_NAMES) if _DATA is not None and _ENCODE is not None else ()
_GPU_KEY = _ENCODE("METRIC_TIMER_USES_GPU") if _DATA is not None and _ENCODE is not None else None


def perf_metrics_disabled() -> bool:
    """Tracers are no-ops: ``DISABLE_PERF_METRICS`` (torchforge's name), ``FORGE_DISABLE_PERF_METRICS``
    or ``FORGE_DISABLE_METRICS`` is true now. Read when a Tracer is created."""
    if not _PERF_KEYS:
        return any(env_flag(n) for n in _PERF_NAMES)
    get = _DATA.get  # type: ignore[union-attr]
    k1, k2, k3 = _PERF_KEYS
    if get(k1) is None and get(k2) is None and get(k3) is None:  # the common case: none set
        return False
    return any(env_flag(n) for n in _PERF_NAMES)


_NONE_SET = (False, None)


def _tracer_switches_slow() -> tuple[bool, bool | None]:
    return perf_metrics_disabled(), timer_uses_gpu()


if _PERF_KEYS and _GPU_KEY is not None:

    def tracer_switches(_get=_DATA.get, _k1=_PERF_KEYS[0], _k2=_PERF_KEYS[1], _k3=_PERF_KEYS[2],  # type: ignore[union-attr]
                        _kg=_GPU_KEY) -> tuple[bool, bool | None]:
        """``(perf_metrics_disabled(), timer_uses_gpu())`` in one call: what a Tracer reads when
        it is created (the lookups are bound as defaults: one call, no global lookups)."""
        if _get(_k1) is None and _get(_k2) is None and _get(_k3) is None and _get(_kg) is None:
            return _NONE_SET
        return _tracer_switches_slow()

else:  # os.environ without its backing dict: the public reads
    tracer_switches = _tracer_switches_slow


def timer_uses_gpu() -> bool | None:
    """torchforge's ``METRIC_TIMER_USES_GPU``: True/False forces the GPU/CPU timer, None (unset)
    leaves the ``timer`` argument in charge."""
    if _GPU_KEY is None:
        return env_bool("METRIC_TIMER_USES_GPU")
    v = _DATA.get(_GPU_KEY)  # type: ignore[union-attr]
    return None if v is None else parse_flag(_DECODE(v))  # type: ignore[misc]


def local_socket_enabled() -> bool:
    """Ranks on the controller's host use the inbox socket unless ``FORGE_OBS_LOCAL_SOCKET`` is
    set to a false value (read when the controller's inbox starts)."""
    return env_bool("FORGE_OBS_LOCAL_SOCKET") is not False


#: ``FORGE_DISABLE_METRICS=true`` at import: ``record_metric`` starts disabled (a near-zero-cost no-op).
METRICS_DISABLED: bool = env_flag("FORGE_DISABLE_METRICS")
#: tracers disabled at import (``perf_metrics_disabled()`` follows later changes)
PERF_METRICS_DISABLED: bool = METRICS_DISABLED or perf_metrics_disabled()
