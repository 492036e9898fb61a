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

Values print as :mod:`forge_obs.core.formatting` writes them for people (the report's tables
too): integral values as integers, others with 4 significant digits, units from the key's suffix.
Compact lines are wrapped at ``width`` columns (default 120), continuation lines indented under
the group's first value.

Keys are sorted and grouped by their prefix (the part before the first ``/``); a ``-- prefix --``
line separates groups when a block has more than one. Units come from the key's suffix
(:func:`~forge_obs.core.formatting.unit_for`) or from the ``units`` config
(``{"trainer/lr": "", "generator/": "tok"}``: key or prefix -> unit, ``""`` for none).
Per-rank blocks are titled with the rank's label: ``mesh/actor/rN``.

A rank that misses a step's flush is reported once, on the step it goes missing, and once more
on the step its values arrive again (``[forge_obs] step 12: rank(s) missing: ...`` /
``... back: ...``), whatever ``every`` is.

Keys, labels and text values print with their control characters escaped as ``repr`` writes
them (an ANSI escape as ``\\x1b``, a newline as ``\\n``): nothing recorded can recolour the
terminal or fake a line.

Config: ``logging_mode`` (default ``global_reduce``), ``compact`` (one block of lines per step,
one line per group, and one per rank in per-rank modes), ``every`` (print every N-th step;
default 1), ``include`` (key prefixes to show; default all but ``critical_path/`` and ``doctor/``,
shown when named), ``units``, ``show_obs`` (default
False: the ``obs/…`` self-metrics go to the JSONL store but not the console), ``width`` (compact
line width, default 120), ``stream`` (``stdout``/``stderr``), ``values`` (default ``"rich"``: a
distribution on one line; ``"scalar"``: as ``key/p50``, ...), ``per_rank_share_run``
(torchforge's; accepted, nothing to share). Raw values (``per_rank_no_reduce``) print as they
stream in, also between steps. Constructed as torchforge's too:
``ConsoleBackend(logging_mode=LoggingMode.GLOBAL_REDUCE)``.
"""

from __future__ import annotations

import sys
import textwrap
import time
from operator import add, attrgetter
from dataclasses import dataclass, field
from typing import Any

from forge_obs.backends.base import LoggerBackend, awaitable
from forge_obs.backends.record import StepRecord
from forge_obs.core.formatting import format_value, format_values, unit_for
from forge_obs.core.options import parse_options
from forge_obs.core.safe import printable, safe_str, write_line
from forge_obs.core.types import Metric

__all__ = [
    "ASKED_ONLY",
    "WIDTH",
    "ConsoleOptions",
    "format_block",
    "format_compact",
    "ConsoleBackend",
]

WIDTH = 120
#: key prefixes printed only when ``include`` names them (what other backends derive per step)
ASKED_ONLY = ("critical_path/", "doctor/")


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

def _group(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _sorted(metrics: list[Metric]) -> list[Metric]:
    return sorted(metrics, key=lambda m: (_group(m.key) != "", _group(m.key), m.key))


def format_block(title: str, step: int, metrics: list[Metric], units: dict[str, str] | None = None,
                 layouts: dict | None = None) -> str:
    """A step's block: its keys sorted and grouped, aligned, each value with its unit.
    ``layouts``: where the layout of a set of keys (order, group lines, padded names, units) is
    kept between calls with the same keys and ``units`` (a console's steps)."""
    lines = [f"=== [{printable(title)}] - METRICS STEP {step} ==="]
    if metrics:
        keys = tuple(map(_KEY, metrics))
        lay = layouts.get(keys) if layouts is not None else None
        if lay is None:
            lay = _layout(keys, units)
            if layouts is not None:
                if len(layouts) >= _LAYOUTS_MAX:
                    layouts.clear()
                layouts[keys] = lay
        order, prefixes, unit_list, runs = lay
        texts = list(map(add, prefixes, format_values([metrics[j].value for j in order], unit_list)))
        for header, a, b in runs:
            if header is not None:
                lines.append(header)
            lines.extend(texts[a:b])
    return "\n".join(lines)


_KEY = attrgetter("key")
#: layouts a console keeps (sets of keys it printed)
_LAYOUTS_MAX = 64


def _layout(keys: tuple, units: dict[str, str] | None) -> tuple:
    """How a block of ``keys`` prints: the order of the keys, each one's ``"key: "`` (padded) and
    unit, and the runs of lines under each group line (``(line or None, start, end)``)."""
    order = sorted(range(len(keys)), key=lambda j: (_group(keys[j]) != "", _group(keys[j]), keys[j]))
    grouped = len(set(map(_group, keys))) > 1
    shown = [printable(keys[j]) for j in order]
    width = max(len(k) for k in shown) + 1
    prefixes = [f"{(key + ':').ljust(width)} " for key in shown]
    runs: list = []
    current = None
    for i, j in enumerate(order):
        g = _group(keys[j])
        if not runs or (grouped and g != current):
            current = g
            runs.append([f"-- {printable(g)} --" if grouped and g else None, i, i])
        runs[-1][2] = i + 1
    return order, prefixes, [unit_for(keys[j], units) for j in order], [tuple(r) for r in runs]


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
        self._layouts: dict = {}  # format_block's, for the sets of keys this console printed

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
        else:  # the critical path's and the findings' keys print when ``include`` names them
            out = [m for m in out if not m.key.startswith(ASKED_ONLY)]
        return out

    @awaitable
    def log_batch(self, metrics: list[Metric], global_step: int, source: str | None = None, **kwargs: Any) -> None:
        out = getattr(self, "_out", sys.stdout)
        visible = self._visible(metrics)
        if self.compact:
            if visible:
                title = f"step {global_step}" + (f" {source}" if source else "")
                write_line(out, format_compact(title, visible, self.units, self.width))
        elif visible or source is None:  # a rank with nothing to show (only obs/... keys, hidden) prints no block
            write_line(out, format_block(source or "GlobalReduce", global_step, visible, self.units, self._layouts))

    def log_stream(self, metric: Metric, global_step: int, source: str | None = None, **kwargs: Any) -> None:
        if self.include and not any(metric.key.startswith(p) for p in self.include):
            return
        out = sys.stderr if self.options.stream == "stderr" else sys.stdout  # also between steps
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(metric.timestamp))
        value = format_value(metric.value, unit_for(metric.key, self.units))
        write_line(out, f"[{printable(safe_str(source))}] {ts} INFO {printable(metric.key)}: {value}")
