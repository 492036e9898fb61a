"""What a backend receives per step: :class:`StepRecord`, and the run it belongs to: :class:`RunContext`.

    >>> from forge_obs.record import StepRecord
    >>> from forge_obs.metric import Metric
    >>> r = StepRecord(step=3, run_id="demo", wall_time=0.0, global_metrics=[Metric("loss", 0.5)])
    >>> r.global_dict()
    {'loss': 0.5}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_obs.metric import Metric


@dataclass
class RunContext:
    """The experiment a backend writes for. ``run_dir`` is ``<root>/<run_id>``."""

    run_id: str
    run_dir: Path
    process_name: str = "Controller"
    config: dict[str, Any] = field(default_factory=dict)
    start_time: float = 0.0


@dataclass
class StepRecord:
    """Everything flushed for one step, already reduced.

    - ``global_metrics``: one Metric per key, states merged across every rank (+ ``obs/…``).
    - ``per_rank``: rank label -> that rank's reduced Metrics (``source`` = label).
    - ``raw``: rank label -> ``[(key, value, wall_time), ...]`` (only when a backend streams).
    - ``sources``: rank label -> identity dict (mesh, actor, rank, host, pid, coords).
    - ``missing``: labels of ranks that did not report within the flush timeout.
    """

    step: int
    run_id: str
    wall_time: float
    global_metrics: list[Metric] = field(default_factory=list)
    per_rank: dict[str, list[Metric]] = field(default_factory=dict)
    raw: dict[str, list[tuple[str, Any, float]]] = field(default_factory=dict)
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    def global_dict(self) -> dict[str, Any]:
        return {m.key: m.value for m in self.global_metrics}
