"""Plain data types shared by every layer: :class:`Metric`, :class:`LoggingMode`, :class:`BackendRole`.

    >>> from forge_obs.core.types import Metric, LoggingMode
    >>> Metric("loss", 0.5).key, LoggingMode("global_reduce")
    ('loss', <LoggingMode.GLOBAL_REDUCE: 'global_reduce'>)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["LoggingMode", "BackendRole", "Metric"]


class LoggingMode(Enum):
    """How a backend sees the experiment's values.

    - ``global_reduce``: one value per key and step for the whole experiment (states merged).
    - ``per_rank_reduce``: each rank's reduced value, labelled with mesh/actor/rank.
    - ``per_rank_no_reduce``: every raw value with its timestamp, labelled by rank.
    """

    GLOBAL_REDUCE = "global_reduce"
    PER_RANK_REDUCE = "per_rank_reduce"
    PER_RANK_NO_REDUCE = "per_rank_no_reduce"


class BackendRole(str, Enum):
    """torchforge's role of a backend instance: ``GLOBAL`` (the controller's) or ``LOCAL`` (a
    rank's). forge_obs runs every backend on the controller, so its backends are initialised with
    ``role=BackendRole.GLOBAL``; compares equal to ``"global"`` / ``"local"``."""

    LOCAL = "local"
    GLOBAL = "global"


@dataclass(slots=True)
class Metric:
    """One value as a backend receives it. ``source`` is the rank label for per-rank modes
    (``None`` for global values); ``timestamp`` is wall time in seconds."""

    key: str
    value: Any
    reduction: Any = None
    timestamp: float = field(default_factory=time.time)
    source: str | None = None
