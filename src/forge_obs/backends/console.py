"""Console backend: aligned blocks per step (global and per rank), a compact mode for long runs
(one group per line, wrapped to fit 120 columns), or raw value lines.

    >>> from forge_obs.backends.console import format_block, format_compact
    >>> from forge_obs.core.types import Metric
    >>> print(format_block("GlobalReduce", 0, [Metric("my_sum_metric", 6.0), Metric("my_max_metric", 3.0)]))
    === [GlobalReduce] - METRICS STEP 0 ===
    my_max_metric: 3
    my_sum_metric: 6
    >>> ms = [Metric("trainer/loss", 0.25), Metric("trainer/step_time_s", 1.5), Metric("buffer/size", 128.0),
    ...       Metric("generator/tokens_per_s", 2750.4), Metric("generator/kv_cache_bytes", 3 * 2**30),
    ...       Metric("trainer/advantage_mean", 1.49012e-08)]
    >>> print(format_block("GlobalReduce", 3, ms))
    === [GlobalReduce] - METRICS STEP 3 ===
    -- buffer --
    buffer/size:              128
    -- generator --
    generator/kv_cache_bytes: 3 GiB
    generator/tokens_per_s:   2750 /s
    -- trainer --
    trainer/advantage_mean:   1.49e-08
    trainer/loss:             0.25
    trainer/step_time_s:      1.5 s
    >>> print(format_compact("step 3", ms))
    [step 3] buffer    size=128
             generator kv_cache_bytes=3GiB tokens_per_s=2750/s
             trainer   advantage_mean=1.49e-08 loss=0.25 step_time_s=1.5s

Numbers: integral values print as integers (``evicted_episodes=0``, not ``0.0``), others with 4
significant digits (``12.35k`` past 10,000); a distribution's quantiles with 3 (the sketch's 1 %
error), snapped to the integer they are within 1 % of (``seq_len_tokens=p50=6 p90=7 n=128``).
Compact lines are wrapped at ``width`` columns (default 120), continuation lines indented under
the group's first value.

Keys are sorted and grouped by their prefix (the part before the first ``/``); a ``-- prefix --``
line separates groups when a block has more than one. Units come from the key's suffix
(``_s``/``_ms``/``_us`` durations, ``_bytes``, ``_per_s``, ``_pct``) or from the ``units``
config (``{"trainer/lr": "", "generator/": "tok"}``: key or prefix -> unit, ``""`` for none).
Per-rank blocks are titled with the rank's label: ``mesh/actor/rN``.

A rank that misses a step's flush is reported once, on the step it goes missing, and once more
on the step its values arrive again (``[forge_obs] step 12: rank(s) missing: ...`` /
``... back: ...``), whatever ``every`` is.

Keys, labels and text values print with their control characters escaped as ``repr`` writes
them (an ANSI escape as ``\\x1b``, a newline as ``\\n``): nothing recorded can recolour the
terminal or fake a line.

Config: ``logging_mode`` (default ``global_reduce``), ``compact`` (one block of lines per step,
one line per group, and one per rank in per-rank modes), ``every`` (print every N-th step;
default 1), ``include`` (key prefixes to show; default all), ``units``, ``show_obs`` (default
False: the ``obs/…`` self-metrics go to the JSONL store but not the console), ``width`` (compact
line width, default 120), ``stream`` (``stdout``/``stderr``), ``values`` (default ``"rich"``: a
distribution on one line; ``"scalar"``: as ``key/p50``, ...), ``per_rank_share_run``
(torchforge's; accepted, nothing to share). Raw values (``per_rank_no_reduce``) print as they
stream in, also between steps. Constructed as torchforge's too:
``ConsoleBackend(logging_mode=LoggingMode.GLOBAL_REDUCE)``.
"""

from __future__ import annotations

import math
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

from forge_obs.backends.base import LoggerBackend, awaitable
from forge_obs.backends.record import StepRecord
from forge_obs.core.options import parse_options
from forge_obs.core.safe import printable, safe_repr, safe_str, write_line
from forge_obs.core.types import Metric

__all__ = [
    "WIDTH",
    "ConsoleOptions",
    "unit_for",
    "format_value",
    "format_block",
    "format_compact",
    "ConsoleBackend",
]

WIDTH = 120


@dataclass
class ConsoleOptions:
    """The ``"console"`` config: ``init_backends({"console": {...}})``."""

    logging_mode: Any = None  # one mode or a list (LoggerBackend parses it)
    compact: bool = False  # one line per group and step instead of torchforge's blocks
    every: int = 1  # print every N-th step
    include: Any = ()  # key prefixes to print (default: all)
    units: dict = field(default_factory=dict)  # key or prefix -> unit
    show_obs: bool = False  # print forge_obs's own obs/... keys
    width: int = WIDTH  # wrap lines at this many columns
    stream: str = "stdout"  # or "stderr"
    values: str = "rich"  # LoggerBackend's: "rich" prints distributions as one line
    per_rank_share_run: bool = False  # torchforge's; nothing to share on a console

    def __post_init__(self) -> None:
        if self.stream not in ("stdout", "stderr"):
            raise ValueError(f"console backend: stream={self.stream!r}; valid: stdout, stderr")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"console backend: every={self.every!r} must be an integer >= 1")
        if not isinstance(self.units, dict):
            raise ValueError('console backend: units must map a key or prefix to a unit, e.g. {"generator/": "tok"}')
        if not isinstance(self.width, int) or isinstance(self.width, bool) or self.width < 40:
            raise ValueError(f"console backend: width={self.width!r} must be an integer >= 40")
        self.compact = bool(self.compact)
        inc = self.include or []
        self.include = [inc] if isinstance(inc, str) else list(inc)
        self.units = {str(k): str(v) for k, v in self.units.items()}

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


_SI = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _num(v: float, digits: int = 4) -> str:
    """``v`` with ``digits`` significant digits; an integral value as an integer."""
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if v == int(v) and a < 1e7:
        return str(int(v))
    if a >= 1e4:
        for scale, suffix in _SI:
            if a >= scale:
                return f"{v / scale:.{digits}g}{suffix}"
    return f"{v:.{digits}g}"


def _quantile(v: float) -> str:
    """A sketch quantile (1 % relative error): 3 significant digits, or the integer within 1 %."""
    if math.isfinite(v) and abs(v) >= 1 and abs(v - round(v)) <= 0.01 * abs(v):
        return str(int(round(v)))
    return _num(v, 3)


def _with_unit(v: float, unit: str, sep: str = " ", digits: int = 4) -> str:
    if not math.isfinite(v):
        return str(v)
    if unit in _TIME_SCALE:
        secs = v * _TIME_SCALE[unit]
        a = abs(secs)
        if a == 0 or a >= 1:
            return f"{_num(secs, digits)}{sep}s"
        for scale, name in ((1e3, "ms"), (1e6, "us"), (1e9, "ns")):
            if a * scale >= 1 or name == "ns":
                return f"{secs * scale:.{digits}g}{sep}{name}"
    if unit == "bytes":
        a = abs(v)
        for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if a >= scale:
                return f"{_num(v / scale, digits)}{sep}{name}"
        return f"{v:.0f}{sep}B"
    return f"{_num(v, digits)}{sep}{unit}"


def format_value(v: Any, unit: str = "", sep: str = " ") -> str:
    """A value for humans: ``6``, ``0.25``, ``1.5 s``, ``3 GiB``, ``p50=1.2 ms p90=… n=100``.
    Never raises: a value that cannot be formatted (a dict that contains itself, a ``__str__``
    that raises) prints as its ``repr``, or ``<TypeName>``."""
    try:
        return _format(v, unit, sep)
    except Exception:  # noqa: BLE001 - one key's value never costs the step's others
        return safe_repr(v)


def _format(v: Any, unit: str, sep: str) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, float)):
        return _with_unit(float(v), unit, sep) if unit else _num(float(v))
    if isinstance(v, dict):
        quantiles = all(k in v for k in ("p50", "p90", "p99"))
        parts = []
        for k, x in v.items():
            if k == "count":
                parts.append(f"n={_format(x, '', ' ')}")
            elif quantiles and isinstance(x, (int, float)) and not isinstance(x, bool) and k.startswith("p"):
                parts.append(f"{k}={_with_unit(float(x), unit, '', 3) if unit else _quantile(float(x))}")
            else:
                parts.append(f"{printable(safe_str(k))}={_format(x, unit if k != 'nan' else '', '')}")
        return " ".join(parts)
    if isinstance(v, list):
        if v and all(isinstance(r, dict) for r in v):
            return f"<{len(v)} rows>"
        return f"<{len(v)} values>"
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return _format(item(), unit, sep)
        except Exception:  # noqa: BLE001
            pass
    return printable(safe_str(v))


def _group(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _sorted(metrics: list[Metric]) -> list[Metric]:
    return sorted(metrics, key=lambda m: (_group(m.key) != "", _group(m.key), m.key))


def format_block(title: str, step: int, metrics: list[Metric], units: dict[str, str] | None = None) -> str:
    lines = [f"=== [{printable(title)}] - METRICS STEP {step} ==="]
    if metrics:
        ms = _sorted(metrics)
        groups = {_group(m.key) for m in ms}
        shown = [printable(m.key) for m in ms]
        width = max(len(k) for k in shown) + 1
        current = None
        for m, key in zip(ms, shown):
            g = _group(m.key)
            if len(groups) > 1 and g != current:
                current = g
                if g:
                    lines.append(f"-- {printable(g)} --")
            lines.append(f"{(key + ':').ljust(width)} {format_value(m.value, unit_for(m.key, units))}")
    return "\n".join(lines)


def format_compact(title: str, metrics: list[Metric], units: dict[str, str] | None = None, width: int = WIDTH) -> str:
    """``[title] group key=value ...``: one line per group (ungrouped keys first), each wrapped
    at ``width`` columns with its continuation lines indented under its first value."""
    groups: dict[str, list[str]] = {}
    for m in _sorted(metrics):
        g = _group(m.key)
        name = m.key[len(g) + 1 :] if g else m.key
        item = f"{printable(name)}={format_value(m.value, unit_for(m.key, units), '')}".replace(" ", ",")
        groups.setdefault(printable(g), []).append(item)
    head = f"[{printable(title)}] "
    gw = max((len(g) for g in groups), default=0)
    lines: list[str] = []
    for g, items in groups.items():
        prefix = (head if not lines else " " * len(head)) + (g.ljust(gw) + " " if gw else "")
        indent = " " * len(prefix)
        line = prefix
        for item in items:
            if line.strip() and line != prefix and len(line) + 1 + len(item) > width:
                lines.append(line)
                line = indent
            line += ("" if line in (prefix, indent) else " ") + item
        lines.append(line)
    if not lines:
        return head.rstrip()
    return "\n".join(lines)


class ConsoleBackend(LoggerBackend):
    """``ConsoleBackend({"logging_mode": "global_reduce", ...})`` or, as torchforge's,
    ``ConsoleBackend(logging_mode=LoggingMode.GLOBAL_REDUCE)``."""

    default_values = "rich"  # distributions print as one line: p50=… p90=… p99=… n=…
    default_show_obs = False

    def __init__(self, logger_backend_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(logger_backend_config, **kwargs)
        self.options = parse_options(ConsoleOptions, "console backend", self.config)
        self.every = self.options.every
        self.compact = self.options.compact
        self.include = self.options.include
        self.units = self.options.units
        self.width = self.options.width
        self._missing: set[str] = set()

    def log_step(self, record: StepRecord) -> None:
        self._out = sys.stderr if self.options.stream == "stderr" else sys.stdout
        printed = record.step % self.every == 0
        if printed:
            super().log_step(record)
        gone, back = self._missing_changes(record)
        if gone:
            self._note(f"[forge_obs] step {record.step}: missing (no values within flush_timeout_s; "
                       f"not waited for again): {', '.join(map(printable, gone))}")
        if back:
            self._note(f"[forge_obs] step {record.step}: back (late values in this step): {', '.join(map(printable, back))}")
        if printed or gone or back:
            self._out.flush()

    def _note(self, text: str) -> None:
        write_line(self._out, "\n".join(textwrap.wrap(text, self.width, subsequent_indent="    ", break_on_hyphens=False)))

    def _missing_changes(self, record: StepRecord) -> tuple[list[str], list[str]]:
        """(labels newly missing at this step, labels that reported again). A missing rank that
        stops being expected without reporting (its mesh was stopped) is forgotten quietly."""
        now = set(record.missing)
        gone = sorted(now - self._missing)
        back = sorted(lb for lb in self._missing - now if lb in (record.sources or {}))
        self._missing = now
        return gone, back

    def _visible(self, metrics: list[Metric]) -> list[Metric]:
        show_obs = self.options.show_obs
        out = [m for m in metrics if show_obs or not m.key.startswith("obs/")]
        if self.include:
            out = [m for m in out if any(m.key.startswith(p) for p in self.include)]
        return out

    @awaitable
    def log_batch(self, metrics: list[Metric], global_step: int, source: str | None = None, **kwargs: Any) -> None:
        out = getattr(self, "_out", sys.stdout)
        visible = self._visible(metrics)
        if self.compact:
            if visible:
                title = f"step {global_step}" + (f" {source}" if source else "")
                write_line(out, format_compact(title, visible, self.units, self.width))
        else:
            write_line(out, format_block(source or "GlobalReduce", global_step, visible, self.units))

    def log_stream(self, metric: Metric, global_step: int, source: str | None = None, **kwargs: Any) -> None:
        if self.include and not any(metric.key.startswith(p) for p in self.include):
            return
        out = sys.stderr if self.options.stream == "stderr" else sys.stdout  # also between steps
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(metric.timestamp))
        value = format_value(metric.value, unit_for(metric.key, self.units))
        write_line(out, f"[{printable(safe_str(source))}] {ts} INFO {printable(metric.key)}: {value}")
