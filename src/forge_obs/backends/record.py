"""What a backend receives per step: :class:`StepRecord`, and the run it belongs to: :class:`RunContext`.

    >>> from forge_obs.backends.record import StepRecord
    >>> from forge_obs.core.types import Metric
    >>> r = StepRecord(step=3, run_id="demo", wall_time=0.0, global_metrics=[Metric("loss", 0.5)])
    >>> r.global_dict()
    {'loss': 0.5}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from forge_obs.core.types import Metric
from forge_obs.recording.reduce import reduction_of
from forge_obs.wire.merge import snapshot_values

__all__ = ["RunContext", "RankViews", "StepRecord"]


@dataclass
class RunContext:
    """The experiment a backend writes for. ``run_dir`` is ``<root>/<run_id>``."""

    run_id: str
    run_dir: Path
    process_name: str = "Controller"
    config: dict[str, Any] = field(default_factory=dict)
    start_time: float = 0.0
    #: how long a flush waits for a silent rank (a step may legitimately take that long)
    flush_timeout_s: float = 10.0


class RankViews(Mapping):
    """``StepRecord.per_rank`` as the pipeline fills it: rank label -> that rank's reduced
    Metrics (sorted by key), computed from the rank's snapshot on first access, once for all
    the backends that read it (each on its own thread); :meth:`values` gives plain
    ``{key: value}`` without building Metrics."""

    def __init__(self, snapshots: dict[str, dict[str, Any]], timestamp: float | None = None) -> None:
        self._snaps = snapshots
        self._ts = time.time() if timestamp is None else timestamp
        self._values: dict[str, tuple[dict, dict]] = {}
        self._metrics: dict[str, list[Metric]] = {}
        self._lock = threading.Lock()

    def _reduced(self, label: str) -> tuple[dict, dict]:
        v = self._values.get(label)
        if v is None:
            with self._lock:  # another backend's thread may be reducing it: it is reduced once
                v = self._values.get(label)
                if v is None:  # a key that cannot be reduced is left out (counted with the global values)
                    v = self._values[label] = snapshot_values(self._snaps[label])
        return v

    def values(self, label: str) -> dict[str, Any]:
        return self._reduced(label)[0]

    def __getitem__(self, label: str) -> list[Metric]:
        ms = self._metrics.get(label)
        if ms is None:
            values, kinds = self._reduced(label)
            ts = self._ts
            ms = self._metrics[label] = [
                Metric(k, values[k], reduction_of(kinds[k]), ts, label) for k in sorted(values)
            ]
        return ms

    def __iter__(self) -> Iterator[str]:
        return iter(self._snaps)

    def __len__(self) -> int:
        return len(self._snaps)


@dataclass
class StepRecord:
    """Everything flushed for one step, already reduced.

    - ``global_metrics``: one Metric per key, states merged across every rank (+ ``obs/…``).
    - ``per_rank``: rank label -> that rank's reduced Metrics (``source`` = label).
    - ``raw``: rank label -> ``[(key, value, wall_time), ...]`` (only when a backend streams).
    - ``sources``: rank label -> identity dict (mesh, actor, rank, host, pid, coords).
    - ``missing``: labels of ranks whose values are not in this step: they did not take part
      in its cut within ``flush_timeout_s`` (dead, hung or slow) or their states did not arrive.
    - ``late``: those of ``missing`` that did not acknowledge this step's cut in time.
    """

    step: int
    run_id: str
    wall_time: float
    global_metrics: list[Metric] = field(default_factory=list)
    per_rank: Mapping[str, list[Metric]] = field(default_factory=dict)
    raw: dict[str, list[tuple[str, Any, float]]] = field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    late: list[str] = field(default_factory=list)

    def global_dict(self) -> dict[str, Any]:
        return {m.key: m.value for m in self.global_metrics}

    def per_rank_values(self) -> dict[str, dict[str, Any]]:
        """rank label -> ``{key: value}`` (cheaper than reading ``per_rank``'s Metrics)."""
        pr = self.per_rank
        if isinstance(pr, RankViews):
            return {label: pr.values(label) for label in pr}
        return {label: {m.key: m.value for m in ms} for label, ms in pr.items()}
