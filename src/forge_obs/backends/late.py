"""Values that reach a backend after the step they describe was logged: what one backend works out
about the run once the others logged it, handed at shutdown to the backends that can still write
it (W&B, TensorBoard, JSONL: rows of mode ``late``).

    >>> from forge_obs.backends.late import LATE, LateValues
    >>> LATE.expect("run-1", "critical_path")                    # at init: a producer will hand values
    >>> LATE.hand("run-1", "critical_path", LateValues(rows=[(7, {"critical_path/duration_s": 1.5})]))
    >>> [v.rows for v in LATE.take("run-1", "wandb", timeout_s=1.0)]
    [[(7, {'critical_path/duration_s': 1.5})]]

A producer (the ``critical_path`` backend: the critical path of the last steps, known only after
their spans were written; the ``alerts`` backend: the final doctor's findings) says at ``init``
that it will hand values, and hands them in its ``finish`` (once, possibly empty). A consumer
takes, in its own ``finish``, what every expected producer of the run handed, waiting at most
``timeout_s`` for the producers still finishing (every backend finishes at the same time, on a
thread of its own). Each consumer gets each producer's values once; a producer that never hands
costs the consumers their wait, never more. Steady-state values travel with the steps
(``record_metric`` on the controller): only what is known after the last step comes here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

__all__ = ["LateValues", "LateBoard", "LATE", "PATH_PREFIX", "PATH_STEP_KEY", "TABLE_KEYS", "WAIT_S"]

#: the per-step critical path's keys (the ``critical_path`` backend's) and their x-axis
PATH_PREFIX = "critical_path/"
PATH_STEP_KEY = "critical_path/step"
#: row keys that are one table over the run, appended to as rows arrive (W&B: an incremental
#: table): the slow steps' answers, the live findings
TABLE_KEYS = ("critical_path/slow_steps", "doctor/findings")
#: how long a consumer's ``finish`` waits for the producers still finishing
WAIT_S = 20.0


@dataclass
class LateValues:
    """What a producer hands: ``rows`` of ``(step, {key: number})`` for steps already logged
    (the step each row describes: a consumer writes it on that step's axis); ``tables``
    (``key -> [row dict]``: rows to append to the table of that key); ``summary`` (``key ->
    value``: the run's final figures, a list of row dicts is a table)."""

    rows: list = field(default_factory=list)
    tables: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


class LateBoard:
    """Producers' values per run, until every consumer took them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._expected: dict[str, set] = {}
        self._handed: dict[str, dict[str, LateValues]] = {}
        self._taken: dict[tuple, set] = {}

    def expect(self, run_id: str, producer: str) -> None:
        """``producer`` will hand values for ``run_id`` in its ``finish``."""
        with self._cv:
            self._expected.setdefault(run_id, set()).add(producer)
            self._handed.setdefault(run_id, {}).pop(producer, None)
            for key in [k for k in self._taken if k[0] == run_id]:
                self._taken[key].discard(producer)

    def expects(self, run_id: str) -> bool:
        with self._cv:
            return bool(self._expected.get(run_id))

    def hand(self, run_id: str, producer: str, values: LateValues) -> None:
        with self._cv:
            self._handed.setdefault(run_id, {})[producer] = values
            self._cv.notify_all()

    def take(self, run_id: str, consumer: str, timeout_s: float) -> list[LateValues]:
        """What the run's producers handed and ``consumer`` did not take yet, once every expected
        producer handed (or ``timeout_s`` passed: then what was handed)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            want = self._expected.get(run_id, set())
            self._cv.wait_for(lambda: want <= set(self._handed.get(run_id, {})), max(0.0, deadline - time.monotonic()))
            seen = self._taken.setdefault((run_id, consumer), set())
            out = [v for p, v in sorted(self._handed.get(run_id, {}).items()) if p not in seen]
            seen.update(self._handed.get(run_id, {}))
            return out

    def forget(self, run_id: str) -> None:
        with self._cv:
            self._expected.pop(run_id, None)
            self._handed.pop(run_id, None)
            for key in [k for k in self._taken if k[0] == run_id]:
                del self._taken[key]


#: the controller process's board (backends run on the controller only)
LATE = LateBoard()
