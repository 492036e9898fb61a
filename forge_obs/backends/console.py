"""Console backend: aligned blocks per step (global and per rank), a compact one-line-per-step
mode for long runs, or raw value lines.

    >>> from forge_obs.backends.console import format_block, format_compact
    >>> from forge_obs.metric import Metric
    >>> print(format_block("GlobalReduce", 0, [Metric("my_sum_metric", 6.0), Metric("my_max_metric", 3.0)]))
    === [GlobalReduce] - METRICS STEP 0 ===
    my_max_metric: 3.0
    my_sum_metric: 6.0
    >>> ms = [Metric("trainer/loss", 0.25), Metric("trainer/step_time_s", 1.5), Metric("buffer/size", 128),
    ...       Metric("generator/tokens_per_s", 2750.0), Metric("generator/kv_cache_bytes", 3 * 2**30)]
    >>> print(format_block("GlobalReduce", 3, ms))
    === [GlobalReduce] - METRICS STEP 3 ===
    -- buffer --
    buffer/size:              128
    -- generator --
    generator/kv_cache_bytes: 3.00 GiB
    generator/tokens_per_s:   2750 /s
    -- trainer --
    trainer/loss:             0.25
    trainer/step_time_s:      1.50 s
    >>> print(format_compact("step 3", ms))
    [step 3] buffer: size=128 | generator: kv_cache_bytes=3.00GiB tokens_per_s=2750/s | trainer: loss=0.25 step_time_s=1.50s

Keys are sorted and grouped by their prefix (the part before the first ``/``); a ``-- prefix --``
line separates groups when a block has more than one. Units come from the key's suffix
(``_s``/``_ms``/``_us`` durations, ``_bytes``, ``_per_s``, ``_pct``) or from the ``units``
config (``{"trainer/lr": "", "generator/": "tok"}``: key or prefix -> unit, ``""`` for none).
Per-rank blocks are titled with the rank's label: ``mesh/actor/rN``.

Config: ``logging_mode`` (default ``global_reduce``), ``compact`` (one line per step, and one per
rank in per-rank modes), ``every`` (print every N-th step; default 1), ``include`` (key prefixes
to show; default all), ``units``, ``show_obs`` (default False: the ``obs/…`` self-metrics go to
the JSONL store but not the console), ``stream`` (``stdout``/``stderr``).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from forge_obs.backends.base import LoggerBackend
from forge_obs.metric import Metric
from forge_obs.record import StepRecord

OWN_KEYS = ("logging_mode", "compact", "every", "include", "units", "show_obs", "stream")

#: key suffix -> unit (longest first)
_SUFFIX_UNITS = (
    ("_per_sec", "/s"),
    ("_per_s", "/s"),
    ("_seconds", "s"),
    ("_bytes", "bytes"),
    ("_percent", "%"),
    ("_pct", "%"),
    ("_sec", "s"),
    ("_ms", "ms"),
    ("_us", "us"),
    ("_ns", "ns"),
    ("_s", "s"),
)
_TIME_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def unit_for(key: str, units: dict[str, str] | None = None) -> str:
    """Unit of ``key``: from ``units`` (exact key, then longest prefix), else from its suffix."""
    if units:
        if key in units:
            return units[key]
        best = max((p for p in units if p.endswith("/") and key.startswith(p)), key=len, default=None)
        if best is not None:
            return units[best]
    name = key.rsplit("/", 1)[-1]
    for suffix, unit in _SUFFIX_UNITS:
        if name.endswith(suffix) and len(name) > len(suffix):
            return unit
    return ""


def _num(v: float) -> str:
    s = f"{v:.6g}"
    if s.lstrip("-").isdigit():
        s += ".0"
    return s


def _with_unit(v: float, unit: str, sep: str = " ") -> str:
    if not math.isfinite(v):
        return str(v)
    if unit in _TIME_SCALE:
        secs = v * _TIME_SCALE[unit]
        a = abs(secs)
        if a == 0 or a >= 1:
            return f"{secs:.2f}{sep}s" if a < 1e4 else f"{secs:.4g}{sep}s"
        if a >= 1e-3:
            return f"{secs * 1e3:.3g}{sep}ms"
        if a >= 1e-6:
            return f"{secs * 1e6:.3g}{sep}us"
        return f"{secs * 1e9:.3g}{sep}ns"
    if unit == "bytes":
        a = abs(v)
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if a >= scale:
                return f"{v / scale:.2f}{sep}{name}"
        return f"{v:.0f}{sep}B"
    return f"{v:.4g}{sep}{unit}"


def format_value(v: Any, unit: str = "", sep: str = " ") -> str:
    """A value for humans: ``6.0``, ``1.50 s``, ``3.00 GiB``, ``p50=1.2 ms p90=… n=100``."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return _with_unit(float(v), unit, sep) if unit else str(v)
    if isinstance(v, float):
        return _with_unit(v, unit, sep) if unit else _num(v)
    if isinstance(v, dict):
        parts = []
        for k, x in v.items():
            if k == "count":
                parts.append(f"n={x}")
            else:
                parts.append(f"{k}={format_value(x, unit if k != 'nan' else '', '')}")
        return " ".join(parts)
    if isinstance(v, list):
        if v and all(isinstance(r, dict) for r in v):
            return f"<{len(v)} rows>"
        return f"<{len(v)} values>"
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return format_value(item(), unit, sep)
        except Exception:  # noqa: BLE001
            pass
    return str(v)


def _group(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _sorted(metrics: list[Metric]) -> list[Metric]:
    return sorted(metrics, key=lambda m: (_group(m.key) != "", _group(m.key), m.key))


def format_block(title: str, step: int, metrics: list[Metric], units: dict[str, str] | None = None) -> str:
    lines = [f"=== [{title}] - METRICS STEP {step} ==="]
    if metrics:
        ms = _sorted(metrics)
        groups = {_group(m.key) for m in ms}
        width = max(len(m.key) for m in ms) + 1
        current = None
        for m in ms:
            g = _group(m.key)
            if len(groups) > 1 and g != current:
                current = g
                if g:
                    lines.append(f"-- {g} --")
            lines.append(f"{(m.key + ':').ljust(width)} {format_value(m.value, unit_for(m.key, units))}")
    return "\n".join(lines)


def format_compact(title: str, metrics: list[Metric], units: dict[str, str] | None = None) -> str:
    """One line: ``[title] a=1 | trainer: loss=0.25 step_time_s=1.50s | ...``."""
    parts: list[str] = []
    current = None
    chunk: list[str] = []
    for m in _sorted(metrics):
        g = _group(m.key)
        if g != current:
            if chunk:
                parts.append(" ".join(chunk))
            chunk = [f"{g}:"] if g else []
            current = g
        name = m.key[len(g) + 1 :] if g else m.key
        chunk.append(f"{name}={format_value(m.value, unit_for(m.key, units), '')}".replace(" ", ","))
    if chunk:
        parts.append(" ".join(chunk))
    return f"[{title}] " + " | ".join(parts)


class ConsoleBackend(LoggerBackend):
    def __init__(self, logger_backend_config: dict[str, Any] | None = None) -> None:
        super().__init__(logger_backend_config)
        unknown = sorted(set(self.config) - set(OWN_KEYS))
        if unknown:
            raise ValueError(f"console backend: unknown key(s) {unknown}; valid: {', '.join(OWN_KEYS)}")
        if self.config.get("stream", "stdout") not in ("stdout", "stderr"):
            raise ValueError(f"console backend: stream={self.config['stream']!r}; valid: stdout, stderr")
        every = self.config.get("every", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"console backend: every={every!r} must be an integer >= 1")
        self.every = every
        self.compact = bool(self.config.get("compact", False))
        inc = self.config.get("include") or []
        self.include = [inc] if isinstance(inc, str) else list(inc)
        units = self.config.get("units") or {}
        if not isinstance(units, dict):
            raise ValueError('console backend: units must map a key or prefix to a unit, e.g. {"generator/": "tok"}')
        self.units = {str(k): str(v) for k, v in units.items()}

    def log_step(self, record: StepRecord) -> None:
        self._out = sys.stderr if self.config.get("stream") == "stderr" else sys.stdout
        printed = record.step % self.every == 0
        if printed:
            super().log_step(record)
        if record.missing:
            printed = True
            print(f"[forge_obs] step {record.step}: missing ranks: {', '.join(record.missing)}", file=self._out)
        if printed:
            self._out.flush()

    def _visible(self, metrics: list[Metric]) -> list[Metric]:
        show_obs = self.config.get("show_obs", False)
        out = [m for m in metrics if show_obs or not m.key.startswith("obs/")]
        if self.include:
            out = [m for m in out if any(m.key.startswith(p) for p in self.include)]
        return out

    def log_batch(self, metrics: list[Metric], global_step: int, source: str | None = None, **kwargs: Any) -> None:
        out = getattr(self, "_out", sys.stdout)
        visible = self._visible(metrics)
        if self.compact:
            if visible:
                title = f"step {global_step}" + (f" {source}" if source else "")
                print(format_compact(title, visible, self.units), file=out)
        else:
            print(format_block(source or "GlobalReduce", global_step, visible, self.units), file=out)

    def log_stream(self, metric: Metric, global_step: int, source: str | None = None, **kwargs: Any) -> None:
        if self.include and not any(metric.key.startswith(p) for p in self.include):
            return
        out = getattr(self, "_out", sys.stdout)
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(metric.timestamp))
        print(f"[{source}] {ts} INFO {metric.key}: {format_value(metric.value, unit_for(metric.key, self.units))}", file=out)
