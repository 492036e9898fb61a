"""Console backend: aligned blocks per step (global and per rank), or raw value lines.

    >>> from forge_obs.backends.console import format_block
    >>> from forge_obs.metric import Metric
    >>> print(format_block("GlobalReduce", 0, [Metric("my_sum_metric", 6.0), Metric("my_max_metric", 3.0)]))
    === [GlobalReduce] - METRICS STEP 0 ===
    my_max_metric: 3.0
    my_sum_metric: 6.0

Config: ``logging_mode`` (default ``global_reduce``), ``show_obs`` (default False: the ``obs/…``
self-metrics go to the JSONL store but not the console), ``stream`` (``stdout``/``stderr``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from forge_obs.backends.base import LoggerBackend
from forge_obs.metric import Metric
from forge_obs.record import StepRecord


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        s = f"{v:.6g}"
        if s.lstrip("-").isdigit():
            s += ".0"
        return s
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return f"<{len(v)} rows>"
    return str(v)


def format_block(title: str, step: int, metrics: list[Metric]) -> str:
    lines = [f"=== [{title}] - METRICS STEP {step} ==="]
    if metrics:
        width = max(len(m.key) for m in metrics) + 1
        for m in sorted(metrics, key=lambda m: m.key):
            lines.append(f"{(m.key + ':').ljust(width)} {format_value(m.value)}")
    return "\n".join(lines)


class ConsoleBackend(LoggerBackend):
    def log_step(self, record: StepRecord) -> None:
        self._out = sys.stderr if self.config.get("stream") == "stderr" else sys.stdout
        super().log_step(record)
        if record.missing:
            print(f"[forge_obs] step {record.step}: missing ranks: {', '.join(record.missing)}", file=self._out)
        self._out.flush()

    def _visible(self, metrics: list[Metric]) -> list[Metric]:
        if self.config.get("show_obs", False):
            return metrics
        return [m for m in metrics if not m.key.startswith("obs/")]

    def log_batch(self, metrics: list[Metric], global_step: int, source: str | None = None, **kwargs: Any) -> None:
        out = getattr(self, "_out", sys.stdout)
        print(format_block(source or "GlobalReduce", global_step, self._visible(metrics)), file=out)

    def log_stream(self, metric: Metric, global_step: int, source: str | None = None, **kwargs: Any) -> None:
        out = getattr(self, "_out", sys.stdout)
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(metric.timestamp))
        print(f"[{source}] {ts} INFO {metric.key}: {format_value(metric.value)}", file=out)
