"""Which ranks of an SPMD job write their timeline's spans: every rank in a small job; at scale,
a sample of each parallel group, plus the ranks the live alerts point at.

    >>> sampled(5, 16, {"dp_shard": 1})                      # 16 ranks: every rank
    True
    >>> sampled(5, 1024, {"pp": 1, "tp": 3, "dp_shard": 2})  # the first DP ranks of each (pp, cp, tp) group
    True
    >>> sampled(9, 1024, {"pp": 1, "tp": 3, "dp_shard": 9})
    False
    >>> sampled(32, 1024, {}), sampled(33, 1024, {})         # no coordinates: every 16th rank
    (True, False)

A job of more than :data:`SAMPLE_FROM_WORLD` ranks writes, by default, the spans of the first
:data:`SAMPLE_DP` data-parallel ranks (``dp_shard``, with ``dp_replicate`` 0) of every group of
ranks that share their other coordinates (``pp``, ``cp``, ``tp``): every pipeline stage and
tensor-parallel shard keeps peers to compare, which is what the doctor's straggler analysis
reads. Without data-parallel coordinates, every ``ceil(world / SAMPLE_MAX)``-th rank writes.
The timeline's ``"ranks"`` option, when given, decides instead (the rank filter).

When a live alert (the ``"alerts"`` backend, on the logger helper) names a rank (a straggler, a
rank with a NaN), the logger helper tells that rank, down the helpers' tree, to write its spans
from then on, until the alert resolves (:class:`~forge_obs.wire.messages.Control`). A rank that
does not write spans pays one flag test per span (the timeline is off); every rank still ships
its metrics each step. ``FORGE_OBS_SPMD_SAMPLE_FROM`` sets :data:`SAMPLE_FROM_WORLD`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["SAMPLE_FROM_WORLD", "SAMPLE_DP", "SAMPLE_MAX", "sampled", "span_ranks", "configure", "set_spans",
           "AlertWatch"]

logger = logging.getLogger("forge_obs")

#: a job of more ranks than this samples its spans by default
SAMPLE_FROM_WORLD = 64
#: data-parallel ranks per group that write spans by default
SAMPLE_DP = 4
#: ranks that write spans by default in a job without data-parallel coordinates, about
SAMPLE_MAX = 64

_state: dict[str, Any] = {"run_dir": None, "options": None, "rank": 0, "sampled": True}


def sample_from_world() -> int:
    return int(os.environ.get("FORGE_OBS_SPMD_SAMPLE_FROM") or SAMPLE_FROM_WORLD)


def sampled(rank: int, world: int, coords: dict[str, int]) -> bool:
    """Whether ``rank`` writes its spans by default (see the module docstring)."""
    if world <= sample_from_world():
        return True
    if "dp_shard" in coords or "dp_replicate" in coords:
        return coords.get("dp_replicate", 0) == 0 and coords.get("dp_shard", 0) < SAMPLE_DP
    return rank % math.ceil(world / SAMPLE_MAX) == 0


def span_ranks(options: "dict | None", rank: int, world: int, coords: dict[str, int]) -> "dict | None":
    """The timeline options this rank starts with: the user's rank filter when given, else the
    default sample (this rank alone, or none)."""
    if options is False or (isinstance(options, dict) and "ranks" in options):
        return options
    opts = dict(options or {})
    opts["ranks"] = [rank] if sampled(rank, world, coords) else []
    return opts


def configure(run_dir: Any, options: dict, rank: int, on: bool) -> None:
    """Remember this rank's timeline options, so that :func:`set_spans` can switch it."""
    _state.update(run_dir=run_dir, options=dict(options), rank=rank, sampled=on)


def set_spans(on: bool) -> None:
    """Turn this rank's spans on (a live alert points at it) or back to its default."""
    from forge_obs.recording.timeline import writer

    if _state["options"] is None:
        return
    want = on or _state["sampled"]
    opts = dict(_state["options"], ranks=[_state["rank"]] if want else [])
    try:
        if not want:
            writer.close()
        writer.configure(_state["run_dir"], opts)
    except Exception as e:  # noqa: BLE001 - the timeline never breaks a rank
        logger.warning("forge_obs.spmd: could not switch this rank's spans: %r", e)


class AlertWatch:
    """On the logger helper: the live alerts' file (``alerts.jsonl``), read as it grows; which
    ranks an active alert points at."""

    def __init__(self, run_dir: Any, mesh: str) -> None:
        self.path = Path(run_dir) / "alerts.jsonl"
        self.mesh = mesh
        self.pos = 0
        self.active: dict[str, int] = {}  # alert id -> the rank it names

    def changes(self) -> list[tuple[int, bool]]:
        """(rank, spans on) for the ranks whose alerts began or ended since the last call."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size <= self.pos:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read(size - self.pos)
        end = data.rfind(b"\n") + 1
        self.pos += end
        before = set(self.active.values())
        for line in data[:end].splitlines():
            self._take(line)
        after = set(self.active.values())
        return [(r, True) for r in sorted(after - before)] + [(r, False) for r in sorted(before - after)]

    def _take(self, line: bytes) -> None:
        try:
            alert = json.loads(line)
        except ValueError:
            return
        rank, key = alert.get("rank"), alert.get("id")
        if alert.get("mesh") != self.mesh or not isinstance(rank, int) or key is None:
            return
        if alert.get("state") == "firing":
            self.active[key] = rank
        else:
            self.active.pop(key, None)
