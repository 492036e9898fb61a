"""What every metric rule of the doctor is made of: a step as the rules see it
(:class:`StepView`), what a rule says (:class:`Event`), the keys each rule looks at, learnt once
(:class:`KeyIndex`, :class:`KeySet`), and the :class:`Rule` contract (``update`` per step,
``finish`` at the end of the data). The rules themselves: :mod:`.value_rules`,
:mod:`.duration_rules`, :mod:`.user_rules`, :mod:`.contention`; the registry: :mod:`.rules`.

    >>> from forge_obs.analysis.doctor.rule_base import duration_scale
    >>> duration_scale("span/train/duration_s"), duration_scale("trainer/step_ms"), duration_scale("tokens_per_s")
    (1.0, 0.001, None)
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import fmedian
from forge_obs.analysis.doctor.subjects import Identities

__all__ = ["StepView", "Event", "number", "KeyIndex", "KeySet", "Rule", "duration_scale", "step_interval"]


@dataclass
class StepView:
    """One step as the rules see it (built from a StepRecord, or from metrics.jsonl rows)."""

    step: int
    wall_time: float
    global_values: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[str, dict[str, Any]] = field(default_factory=dict)  # rank label -> {key: value}
    sources: dict[str, dict] = field(default_factory=dict)  # rank label -> identity
    missing: list = field(default_factory=list)  # labels of ranks that did not report


@dataclass
class Event:
    rule: str
    state: str  # "firing" | "resolved" | "active" (still on at the end of the data)
    key: str  # stable id of the incident: rule, who, what
    step: int  # the step this event was emitted at
    onset_step: int
    last_step: int  # last step the condition held
    message: str
    where: dict  # mesh / actor / rank / replica / where
    details: dict = field(default_factory=dict)
    consequences: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "state": self.state, "id": self.key, "step": self.step,
                "onset_step": self.onset_step, "last_step": self.last_step, "message": self.message,
                **{k: self.where.get(k) for k in ("mesh", "actor", "rank", "replica", "where")},
                "details": self.details, "consequences": self.consequences}


def number(v: Any) -> float | None:
    """``v`` as a float when it is an int or a float (not a bool), else None."""
    if type(v) is float or type(v) is int:
        return float(v)
    return None


class KeyIndex:
    """Which keys of a step's dicts each rule looks at, learnt once: per dict (a rank's values,
    or the global ones) the keys it ever had, and for each rule the ones it matches. A step costs
    one subset test in C per dict (a step has hundreds of keys); only new keys are classified in
    Python. Keys come and go between steps: readers use ``d.get(k)``."""

    def __init__(self) -> None:
        self.preds: list = []
        self.dicts: dict[Any, list] = {}  # dict name (rank label, None: global) -> [keys seen, {KeySet: [keys]}]
        self._view: Any = None
        self._checked: set = set()
        # the step clock, computed once per step for every rule (see :meth:`times`)
        self._last: list = [None, 0]
        self._intervals: deque = deque(maxlen=9)
        self._times_view: Any = None
        self._times: tuple = (None, None)
        self._ranks_view: Any = None

    def times(self, view: "StepView") -> tuple:
        """(seconds since the previous step, or None: see :func:`step_interval`; the step's wall
        time: the median of the last intervals, None before the first)."""
        if view is not self._times_view:
            self._times_view = view
            iv = step_interval(view, self._last)
            if iv is not None:
                self._intervals.append(iv)
            self._times = (iv, fmedian(self._intervals) if self._intervals else None)
        return self._times

    def keyset(self, pred: Callable[[str], bool]) -> "KeySet":
        ks = KeySet(self, pred)
        for name, (seen, lists) in self.dicts.items():
            lists[ks] = sorted(k for k in seen if ks.test(k))
            if lists[ks] and name is not None:
                ks.labels.add(name)
        self.preds.append(ks)
        return ks

    def keys(self, ks: "KeySet", view: "StepView", name: Any, d: dict) -> list:
        if view is not self._view:
            self._view = view
            self._checked.clear()
        e = self.dicts.get(name)
        if e is None:
            e = self.dicts[name] = [set(), {k: [] for k in self.preds}]
        if name not in self._checked:
            self._checked.add(name)
            self._learn(name, e, d)
        return e[1][ks]

    def _learn(self, name: Any, e: list, d: dict) -> None:
        if not d.keys() <= e[0]:
            new = d.keys() - e[0]
            e[0] |= new
            for k2 in self.preds:
                got = sorted(k for k in new if k2.test(k))
                if got:
                    e[1][k2].extend(got)
                    if name is not None:
                        k2.labels.add(name)

    def per_rank(self, ks: "KeySet", view: "StepView") -> list:
        """``[(label, values, keys)]`` of the ranks with keys ``ks`` looks at. Each rank's dict
        is checked for new keys once per step (for every rule); each rule then visits only the
        ranks that ever had its keys."""
        if view is not self._ranks_view:
            self._ranks_view = view
            if view is not self._view:
                self._view = view
                self._checked.clear()
            for label, d in view.per_rank.items():
                if label not in self._checked:
                    self._checked.add(label)
                    e = self.dicts.get(label)
                    if e is None:
                        e = self.dicts[label] = [set(), {k: [] for k in self.preds}]
                    self._learn(label, e, d)
        pr = view.per_rank
        return [(lb, pr[lb], self.dicts[lb][1][ks]) for lb in ks.labels if lb in pr]


class KeySet:
    """The keys one rule looks at (see :class:`KeyIndex`); ``test`` caches the predicate per key;
    ``labels``: the ranks that ever had such a key."""

    __slots__ = ("index", "pred", "cache", "labels")

    def __init__(self, index: KeyIndex, pred: Callable[[str], bool]) -> None:
        self.index, self.pred, self.cache, self.labels = index, pred, {}, set()

    def test(self, key: str) -> bool:
        b = self.cache.get(key)
        if b is None:
            b = self.cache[key] = bool(self.pred(key))
        return b

    def of(self, view: "StepView", name: Any, d: dict) -> list:
        """The keys of ``d`` (named ``name``: a rank label, None for the global values) this rule
        looks at; some may be missing from ``d`` at this step."""
        return self.index.keys(self, view, name, d)

    def per_rank(self, view: "StepView", skip: Any = None) -> list:
        """``[(label, values, keys)]`` for the ranks of ``view`` that have keys this rule looks at
        (labels in ``skip`` left out)."""
        out = self.index.per_rank(self, view)
        return out if skip is None else [x for x in out if x[0] not in skip]


class Rule:
    name = "rule"
    #: what the timeline judges better (the doctor skips these rules when a run has a timeline)
    timeline_equivalent = False

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None) -> None:
        self.cfg = cfg
        self.ids = ids
        self.key_index = keys if keys is not None else KeyIndex()

    def update(self, view: StepView) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        return []


_DURATION = re.compile(r"(?:^|[/_])(?:s|ms|us|sec|seconds|duration)$")
_SCALE = {"ms": 1e-3, "us": 1e-6}


def duration_scale(key: str) -> float | None:
    """Seconds per unit of a duration metric (``*_s``, ``*_ms``, ``*_us``, ``*duration_s``), None
    for anything else (``tokens_per_s`` is a rate, not a duration)."""
    if "per_" in key or not _DURATION.search(key):
        return None
    return _SCALE.get(key.rsplit("_", 1)[-1], 1.0)


def step_interval(view: StepView, last: list) -> float | None:
    """Seconds since the previous step reached the backends, or None when that is not a step's
    duration: steps that left the pipeline as a backlog (``obs/pending_steps`` > 0, after a
    step waited for a missing rank) arrive back to back. ``last`` = [wall time, pending] of the
    previous step, updated."""
    pending = view.global_values.get("obs/pending_steps") or 0
    prev_wall, prev_pending = last
    last[0], last[1] = view.wall_time or prev_wall, pending
    if not view.wall_time or prev_wall is None or pending or prev_pending or view.wall_time <= prev_wall:
        return None
    return view.wall_time - prev_wall

