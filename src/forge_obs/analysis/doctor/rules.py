"""The doctor's rules over metrics, one step at a time: the live ``"alerts"`` backend feeds them
each :class:`~forge_obs.backends.record.StepRecord`; ``forge-obs doctor`` replays ``metrics.jsonl``
through the same objects. Each rule keeps bounded state (rolling windows, counters), never
re-reads history, and emits an :class:`Event` when a condition starts (``firing``) and when it
ends (``resolved``); :meth:`Rule.finish` returns what is still active at the end of the data.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.rules import StepView, build_rules
    >>> rules = build_rules(DoctorConfig(), user_rules=["trainer/loss > 10"])
    >>> for step, loss in enumerate([1.0, 12.0, 3.0]):
    ...     view = StepView(step, float(step), {"trainer/loss": loss})
    ...     for rule in rules:
    ...         for e in rule.update(view):
    ...             print(step, e.state, e.rule, e.message)
    1 firing threshold trainer/loss > 10: 12 at step 1
    2 resolved threshold trainer/loss > 10: 12 at step 1 (until step 1)

Rules: ``nonfinite`` (one event per root: the first key to go NaN/inf, on the rank where it did,
with what followed), ``missing_ranks`` (ranks that did not report at a flush), ``quiet_rank``
(a rank that answers but stopped recording values it used to record), ``staleness`` (a
``*staleness*`` metric growing), ``throughput_drop`` (a throughput metric or the step rate down to
``throughput_drop`` of its rolling median), ``straggler`` / ``slowdown`` (per-rank duration
metrics: the :class:`~forge_obs.analysis.doctor.detect.GroupTracker` the timeline doctor uses on
spans), ``sync_bottleneck`` (a state-moving duration metric taking ``sync_share`` of the step),
and ``threshold`` (user rules such as ``"trainer/loss > 10"``).
"""

from __future__ import annotations

import fnmatch
import math
import operator
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import GroupTracker, History, Persistence, fmedian, growth
from forge_obs.analysis.doctor.subjects import GLOBAL, Identities

__all__ = [
    "StepView",
    "Event",
    "KeyIndex",
    "KeySet",
    "Rule",
    "NonFinite",
    "MissingRanks",
    "Staleness",
    "Throughput",
    "duration_scale",
    "step_interval",
    "Stragglers",
    "SyncShare",
    "UserRule",
    "Thresholds",
    "RULES",
    "build_rules",
]


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


def _num(v: Any) -> float | None:
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


# ---------------------------------------------------------------- non-finite values


def _key_order(key: str) -> int:
    """Which of several keys that went non-finite together is the likely root: the loss, then
    gradients, then parameters, then anything else."""
    k = key.lower()
    if "loss" in k:
        return 0
    if "grad" in k:
        return 1
    if re.search(r"param|weight|update|norm", k):
        return 2
    return 3


class NonFinite(Rule):
    """One incident per run of consecutive steps with NaN/inf values: its root is the first key
    (per :func:`_key_order`) on the first rank that had it; every other (key, rank) follows."""

    name = "nonfinite"

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 counted: bool = False) -> None:
        super().__init__(cfg, ids, keys)
        self.counted = counted
        self.inc: dict | None = None

    def update(self, view: StepView) -> list[Event]:
        # x - x is 0.0 for a finite float and NaN (truthy) for NaN and +-inf.
        # Live (``counted``), values are read when one can be non-finite: the step's count of
        # non-finite values recorded (``obs/nonfinite_values``) is not 0 or unknown, or an incident
        # is on; a reduction that makes NaN out of finite values is then seen by the doctor only.
        g = view.global_values
        if self.counted and not g.get("obs/nonfinite_values", 1) and self.inc is None:
            return []
        hits = [(label, k, v) for label, vals in view.per_rank.items() for k, v in vals.items()
                if type(v) is float and v - v]
        hits += [(None, k, v) for k, v in g.items() if type(v) is float and v - v]
        inc = self.inc
        if not hits:
            if inc is None:
                return []
            self.inc = None
            return [self._event(inc, "resolved", view.step)]
        if inc is None:
            label, key, v = min(hits, key=lambda h: (h[0] is None, _key_order(h[1]), h[1], h[0] or ""))
            where = self.ids.of_source(view.sources[label]) if label in view.sources else (
                self.ids.of_label(label) if label else dict(GLOBAL))
            inc = self.inc = {"root": (label, key), "where": where, "value": v, "onset": view.step,
                              "last": view.step, "follow": {}}
            fired = True
        else:
            fired = False
            inc["last"] = view.step
        follow = inc["follow"]
        for label, key, v in hits:
            if (label, key) == inc["root"]:
                continue
            f = follow.get((label, key))
            if f is None:
                if len(follow) >= 64:
                    continue  # bounded: the first 64 consequences are listed
                w = (self.ids.of_source(view.sources[label]) if label in view.sources else self.ids.of_label(label)) \
                    if label else dict(GLOBAL)
                follow[(label, key)] = [view.step, view.step, w, v]
            else:
                f[1] = view.step
        return [self._event(inc, "firing", view.step)] if fired else []

    def _event(self, inc: dict, state: str, step: int) -> Event:
        label, key = inc["root"]
        w = inc["where"]
        cons = []
        items = sorted(inc["follow"].items(), key=lambda kv: (kv[1][0], kv[0][0] is None, kv[0][0] != label,
                                                              _key_order(kv[0][1]), kv[0][1]))
        same, other, glob = [], set(), []
        for (lb, k), (s0, s1, cw, v) in items:
            what = "the global (reduced) value" if lb is None else ("on the same rank" if lb == label else "on another rank")
            cons.append({"kind": "nonfinite", "key": k, "steps": [s0, s1], **cw, "message": f"'{k}' = {v} ({what})"})
            if lb is None:
                glob.append(k)
            elif lb == label:
                same.append(k)
            else:
                other.add(lb)
        span = f"at step {inc['onset']}" if inc["last"] == inc["onset"] else f"at steps {inc['onset']}..{inc['last']}"
        then = []
        if same:
            then.append(", ".join(f"'{k}'" for k in same[:4]) + (f" and {len(same) - 4} more" if len(same) > 4 else "")
                        + " on the same rank")
        if other:
            then.append(f"{len(other)} other rank(s)")
        if glob:
            then.append(f"the global value of {len(set(glob))} key(s)")
        msg = f"'{key}' = {inc['value']} on {w['where']} {span} (the first non-finite value)"
        if then:
            msg += "; then " + ", ".join(then)
        return Event(self.name, state, f"nonfinite:{w['where']}:{key}:{inc['onset']}", step, inc["onset"],
                     inc["last"], msg, w, {"key": key, "source": w["where"], "count": inc["last"] - inc["onset"] + 1},
                     cons)

    def finish(self) -> list[Event]:
        return [self._event(self.inc, "active", self.inc["last"])] if self.inc else []


# ---------------------------------------------------------------- missing and quiet ranks


class MissingRanks(Rule):
    """``missing_ranks``: ranks of a mesh that did not answer a flush (one incident per mesh
    while any of its ranks is missing). ``quiet_rank``: a rank that answers but recorded nothing
    for ``quiet_steps`` steps (and longer than twice its longest earlier gap) after recording."""

    name = "missing_ranks"

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None) -> None:
        super().__init__(cfg, ids, keys)
        self.inc: dict[str, dict] = {}  # mesh -> incident
        self.gap: dict[str, list] = {}  # label -> [steps with values, current gap, longest gap, gap start]
        self.quiet: dict[str, dict] = {}

    def update(self, view: StepView) -> list[Event]:
        out: list[Event] = []
        step = view.step
        now: dict[str, dict] = {}
        for label in view.missing:
            w = self.ids.of_label(str(label))
            now.setdefault(w["mesh"], {})[str(label)] = w
        for mesh, labels in now.items():
            inc = self.inc.get(mesh)
            if inc is None:
                inc = self.inc[mesh] = {"onset": step, "last": step, "labels": {}, "steps": 0}
                inc["labels"].update(labels)
                inc["steps"] = 1
                out.append(self._event(mesh, inc, "firing", step))
            else:
                inc["labels"].update(labels)
                inc["last"] = step
                inc["steps"] += 1
        for mesh in [m for m in self.inc if m not in now]:
            out.append(self._event(mesh, self.inc.pop(mesh), "resolved", step))
        # ---- quiet ranks: answered, but no values (ranks of meshes: the controller's own entry
        # has no pid, and a stuck controller sends no step at all: the stall watchdog's case)
        q = self.cfg.quiet_steps
        if q:
            per_rank = view.per_rank
            for label, src in view.sources.items():
                g = self.gap.get(label)
                has = bool(per_rank.get(label))
                if g is None:
                    if has and src.get("pid"):
                        self.gap[label] = [1, 0, 0, None, 1]  # steps with values, gap, longest gap, gap start, steps
                    continue
                g[4] += 1
                if has:
                    if label in self.quiet:
                        out.append(self._quiet_event(label, self.quiet.pop(label), "resolved", step))
                    if g[1] > g[2]:
                        g[2] = g[1]
                    g[0] += 1
                    g[1] = 0
                    continue
                if g[1] == 0:
                    g[3] = step
                g[1] += 1
                regular = g[0] >= q and g[0] >= 0.8 * (g[4] - g[1])  # it recorded at most of its steps
                if label not in self.quiet and regular and g[1] >= max(q, 2 * g[2] + 1):
                    w = self.ids.of_source(view.sources[label])
                    inc = self.quiet[label] = {"onset": g[3], "last": step, "where": w, "had": g[0]}
                    out.append(self._quiet_event(label, inc, "firing", step))
                elif label in self.quiet:
                    self.quiet[label]["last"] = step
        return out

    def _event(self, mesh: str, inc: dict, state: str, step: int) -> Event:
        ws = list(inc["labels"].values())
        ranks = sorted({w["rank"] for w in ws if w["rank"] is not None})
        where = dict(ws[0]) if len(ws) == 1 else self.ids.of(mesh, None)
        if len(ws) > 1:
            where["where"] += f" (ranks {ranks})"
        span = f"from step {inc['onset']}" + ("" if state == "firing" else f" to step {inc['last']}")
        msg = (f"{where['where']} did not report at the flushes {span} ({inc['steps']} step(s)): "
               "dead, hung or slower than flush_timeout_s")
        return Event("missing_ranks", state, f"missing_ranks:{mesh}:{inc['onset']}", step, inc["onset"], inc["last"],
                     msg, where, {"ranks": ranks, "labels": sorted(inc["labels"]), "count": inc["steps"],
                                  "label": sorted(inc["labels"])[0]})

    def _quiet_event(self, label: str, inc: dict, state: str, step: int) -> Event:
        w = inc["where"]
        msg = (f"{w['where']} answers the flushes but has recorded nothing since step {inc['onset']} "
               f"(it recorded values in {inc['had']} earlier steps): stuck or starved")
        return Event("quiet_rank", state, f"quiet_rank:{label}:{inc['onset']}", step, inc["onset"], inc["last"], msg, w,
                     {"label": label, "silent_steps": inc["last"] - inc["onset"] + 1})

    def finish(self) -> list[Event]:
        out = [self._event(m, inc, "active", inc["last"]) for m, inc in self.inc.items()]
        out += [self._quiet_event(lb, inc, "active", inc["last"]) for lb, inc in self.quiet.items()]
        return out


# ---------------------------------------------------------------- staleness


class Staleness(Rule):
    """A ``*staleness*`` metric growing over a rolling window of ``staleness_window`` steps (per
    rank where per-rank values exist, else the global value): see :func:`detect.growth`."""

    name = "staleness"

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 keep_all: bool = False) -> None:
        super().__init__(cfg, ids, keys)
        self.series: dict[tuple, deque] = {}
        self.active: dict[tuple, dict] = {}
        self.keys = self.key_index.keyset(lambda k: "staleness" in k)
        self.per_rank_keys: set = set()
        #: the doctor keeps every value (and the source) for its whole-run test
        self.all: dict[tuple, list] | None = {} if keep_all else None

    def update(self, view: StepView) -> list[Event]:
        out: list[Event] = []
        seen = []
        for label, vals, keys in self.keys.per_rank(view):
            for k in keys:
                x = _num(vals.get(k))
                if x is not None and math.isfinite(x):
                    self.per_rank_keys.add(k)
                    seen.append(((label, k), x))
        for k in self.keys.of(view, None, view.global_values):
            if k not in self.per_rank_keys:
                x = _num(view.global_values.get(k))
                if x is not None and math.isfinite(x):
                    seen.append(((None, k), x))
        if self.all is not None:
            for sk, x in seen:
                self.all.setdefault(sk, []).append((view.step, x, view.sources.get(sk[0])))
        for sk, x in seen:
            s = self.series.get(sk)
            if s is None:
                s = self.series[sk] = deque(maxlen=self.cfg.staleness_window)
            s.append((view.step, x))
            g = growth(*zip(*s), self.cfg.staleness_growth)
            inc = self.active.get(sk)
            if g is not None and inc is None:
                label = sk[0]
                w = (self.ids.of_source(view.sources[label]) if label in view.sources else self.ids.of_label(label)) \
                    if label else dict(GLOBAL)
                inc = self.active[sk] = {"onset": s[0][0], "last": view.step, "where": w, "g": g}
                out.append(self._event(sk, inc, "firing", view.step))
            elif inc is not None:
                if g is None:
                    out.append(self._event(sk, self.active.pop(sk), "resolved", view.step))
                else:
                    inc["last"], inc["g"] = view.step, g
        return out

    def _event(self, sk: tuple, inc: dict, state: str, step: int) -> Event:
        g, w, key = inc["g"], inc["where"], sk[1]
        msg = (f"'{key}' on {w['where']} grows since step {inc['onset']}: {g['first']:.2f} -> {g['last']:.2f} "
               f"(slope {g['slope']:.3f}/step): generators fall behind the trainer")
        return Event(self.name, state, f"staleness:{w['where']}:{key}", step, inc["onset"], inc["last"], msg, w,
                     {"key": key, "first_third_mean": g["first"], "last_third_mean": g["last"], "slope": g["slope"]})

    def finish(self) -> list[Event]:
        return [self._event(sk, inc, "active", inc["last"]) for sk, inc in self.active.items()]


# ---------------------------------------------------------------- throughput


class Throughput(Rule):
    """``throughput_drop``: a global throughput metric (``throughput_keys``) or the step rate (time
    between steps) at or below ``throughput_drop`` x its rolling median in ``fire_steps`` of the
    last ``window_steps`` steps (the same persistence as a straggler: a drop that starts with one
    is reported with it, not before it)."""

    name = "throughput_drop"

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None) -> None:
        super().__init__(cfg, ids, keys)
        self.state: dict[str, tuple] = {}  # key -> (History, Persistence)
        self.active: dict[str, dict] = {}
        self.keys = self.key_index.keyset(lambda k: bool(cfg.throughput_re.search(k)))

    def update(self, view: StepView) -> list[Event]:
        out: list[Event] = []
        iv = self.key_index.times(view)[0]
        if iv is not None:
            out += self._judge(view, "<step rate>", 1.0 / iv)
        g = view.global_values
        for k in self.keys.of(view, None, g):
            x = _num(g.get(k))
            if x is not None and math.isfinite(x):
                out += self._judge(view, k, x)
        return out

    def _judge(self, view: StepView, key: str, x: float) -> list[Event]:
        cfg = self.cfg
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = (History(cfg.history_steps, cfg.history_min_steps),
                                    Persistence(cfg.fire_steps, cfg.window_steps, cfg.clear_steps))
        hist, pers = st
        base = hist.baseline()
        if base is None or base <= 0:
            hist.add(x)
            return []
        hit = x <= cfg.throughput_drop * base
        if not hit:
            hist.add(x)
        ch = pers.update(view.step, hit, x)
        inc = self.active.get(key)
        if ch == "onset":
            w = self._where(key, view) if key != "<step rate>" else dict(self.ids.of("controller", 0),
                                                                          where="the training loop")
            low = min(p for _s, p in pers.window_hits())
            inc = self.active[key] = {"onset": pers.onset, "last": view.step, "base": base, "low": low, "where": w}
            return [self._event(key, inc, "firing", view.step)]
        if inc is not None:
            if hit:
                inc["last"] = view.step
                inc["low"] = min(inc["low"], x)
            if ch == "clear":
                return [self._event(key, self.active.pop(key), "resolved", view.step)]
        return []

    def _where(self, key: str, view: StepView) -> dict:
        meshes = sorted({str(view.sources.get(lb, {}).get("mesh") or lb.split("/")[0])
                         for lb, vals in view.per_rank.items() if key in vals})
        if len(meshes) == 1:
            return self.ids.of(meshes[0], None)
        w = dict(GLOBAL)
        if meshes:
            w["where"] = "global (" + ", ".join(meshes) + ")"
        return w

    def _event(self, key: str, inc: dict, state: str, step: int) -> Event:
        what = "the step rate (steps/s)" if key == "<step rate>" else f"'{key}'"
        msg = (f"{what} dropped to {inc['low']:.3g} since step {inc['onset']}, "
               f"{inc['low'] / inc['base']:.0%} of its rolling median {inc['base']:.3g}")
        return Event(self.name, state, f"throughput_drop:{key}", step, inc["onset"], inc["last"], msg, inc["where"],
                     {"key": key, "baseline": inc["base"], "lowest": inc["low"]})

    def finish(self) -> list[Event]:
        return [self._event(k, inc, "active", inc["last"]) for k, inc in self.active.items()]


# ---------------------------------------------------------------- per-rank durations

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


class Stragglers(Rule):
    """``straggler`` / ``slowdown`` on per-rank duration metrics, grouped by (mesh, key): the
    same :class:`GroupTracker` the doctor runs on spans. Wait-like keys (``wait_spans``) are
    consequences of someone else's slowness and not judged."""

    name = "straggler"
    timeline_equivalent = True

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 slowdowns: bool = True) -> None:
        super().__init__(cfg, ids, keys)
        self.slowdowns = slowdowns
        self.trackers: dict[tuple, GroupTracker] = {}
        self.scale: dict[str, float] = {}  # duration key -> seconds per unit
        self.keys = self.key_index.keyset(self._is_duration)
        self.active: dict[tuple, dict] = {}
        self.absorbed: set = set()  # a rank's own slowdowns while it is a straggler: the same event
        self.straggling: dict[tuple, int] = {}  # (mesh, rank) -> active straggler conditions
        self.where: dict[str, tuple] = {}  # rank label -> (mesh, rank)
        self.mesh_ranks: dict[str, set] = {}  # mesh -> ranks seen
        self.alone: set = set()  # labels of meshes with one rank (so far)

    def _place(self, label: str, view: StepView) -> tuple:
        wr = self.where.get(label)
        if wr is None:
            src = view.sources.get(label) or {}
            wr = self.where[label] = (str(src.get("mesh") or label.split("/")[0]), src.get("rank", label))
            self.mesh_ranks.setdefault(wr[0], set()).add(wr[1])
        return wr

    def _is_duration(self, k: str) -> bool:
        sc = None if self.cfg.wait_re.search(k) else duration_scale(k)
        if sc is not None:
            self.scale[k] = sc
        return sc is not None

    def update(self, view: StepView) -> list[Event]:
        step_s = self.key_index.times(view)[1]
        groups: dict[tuple, dict] = {}
        scale, isfinite = self.scale, math.isfinite
        where, mesh_ranks = self.where, self.mesh_ranks
        if not self.slowdowns:  # labels of one-rank meshes: no peers, and no history wanted
            if not view.per_rank.keys() <= where.keys():  # new ranks: place them, recount
                for label in view.per_rank.keys() - where.keys():
                    self._place(label, view)
                self.alone = {lb for lb, wr in where.items() if len(mesh_ranks[wr[0]]) < 2}
            skip = self.alone
        else:
            skip = None
        for label, vals, keys in self.keys.per_rank(view, skip):
            wr = where.get(label) or self._place(label, view)
            mesh, rank = wr
            for k in keys:
                x = vals.get(k)
                if (type(x) is float or type(x) is int) and isfinite(x):
                    g = groups.get((mesh, k))
                    if g is None:
                        g = groups[(mesh, k)] = {}
                    g[rank] = (x * scale[k], label)
        out: list[Event] = []
        for g, by_rank in groups.items():
            t = self.trackers.get(g)
            if t is None:
                if len(by_rank) < 2 and not self.slowdowns:
                    continue  # one rank, no history wanted: nothing to compare
                t = self.trackers[g] = GroupTracker(self.cfg, history=self.slowdowns)
            changes = t.update(view.step, {r: x for r, (x, _lb) in by_rank.items()}, step_s)
            for c in changes:
                if c.kind == "straggler":
                    n = self.straggling.get((g[0], c.rank), 0) + (1 if c.state == "onset" else -1)
                    self.straggling[(g[0], c.rank)] = n
            for c in changes:
                if c.kind == "slowdown":
                    ik = (g[0], g[1], c.rank)
                    if not self.slowdowns:
                        continue
                    if c.state == "onset" and self.straggling.get((g[0], c.rank), 0) > 0:
                        self.absorbed.add(ik)
                        continue
                    if c.state == "clear" and ik in self.absorbed:
                        self.absorbed.discard(ik)
                        continue
                label = by_rank[c.rank][1] if c.rank in by_rank else None
                out.append(self._event(g, c, view, label))
        return out

    def _event(self, g: tuple, c: Any, view: StepView, label: str | None) -> Event:
        mesh, key = g
        w = self.ids.of_source(view.sources[label]) if label in view.sources else self.ids.of(mesh, c.rank)
        ik = (c.kind, mesh, key, c.rank)
        info = c.info
        if c.state == "onset":
            self.active[ik] = {"where": w, "onset": c.onset, "info": info}
        else:
            self.active.pop(ik, None)
        state = "firing" if c.state == "onset" else "resolved"
        ratio = info.get("median_ratio") or info.get("ratio") or 0
        ref = info.get("reference_s")
        if c.kind == "straggler":
            msg = (f"{w['where']} is a straggler since step {c.onset}: '{key}' {info.get('median_s') or 0:.3g}s is "
                   f"{ratio:.1f}x the median of its {mesh} peers ({ref or 0:.3g}s)")
        else:
            msg = (f"{w['where']}: '{key}' slowed down since step {c.onset}: {info.get('median_s') or 0:.3g}s, "
                   f"{ratio:.1f}x its own recent median ({ref or 0:.3g}s)")
        return Event(c.kind, state, f"{c.kind}:{w['where']}:{key}", view.step, c.onset,
                     info.get("last_hit_step") or view.step, msg, w, {"key": key, **info})

    def finish(self) -> list[Event]:
        out = []
        for (kind, mesh, key, rank), inc in self.active.items():
            info = inc["info"]
            out.append(Event(kind, "active", f"{kind}:{inc['where']['where']}:{key}", info.get("last_hit_step"),
                             inc["onset"], info.get("last_hit_step"), f"'{key}' out of line since step {inc['onset']}",
                             inc["where"], {"key": key, **info}))
        return out


class SyncShare(Rule):
    """``sync_bottleneck`` on per-rank duration metrics that move state (``sync_spans``): the value
    takes >= ``sync_share`` of the step's wall time, persistently."""

    name = "sync_bottleneck"
    timeline_equivalent = True

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None) -> None:
        super().__init__(cfg, ids, keys)
        self.scale: dict[str, float] = {}
        self.keys = self.key_index.keyset(self._is_sync)
        self.state: dict[tuple, Persistence] = {}
        self.active: dict[tuple, dict] = {}

    def _is_sync(self, k: str) -> bool:
        sc = duration_scale(k) if self.cfg.sync_re.search(k) else None
        if sc is not None:
            self.scale[k] = sc
        return sc is not None

    def update(self, view: StepView) -> list[Event]:
        step_s = self.key_index.times(view)[1]
        if not step_s:
            return []
        out: list[Event] = []
        cfg = self.cfg
        for label, vals, keys in self.keys.per_rank(view):
            for k in keys:
                x = _num(vals.get(k))
                if x is None:
                    continue
                share = x * self.scale[k] / step_s
                sk = (label, k)
                p = self.state.get(sk)
                if p is None:
                    p = self.state[sk] = Persistence(cfg.fire_steps, cfg.window_steps, cfg.clear_steps)
                ch = p.update(view.step, share >= cfg.sync_share, share)
                inc = self.active.get(sk)
                if ch == "onset":
                    w = self.ids.of_source(view.sources[label]) if label in view.sources else self.ids.of_label(label)
                    inc = self.active[sk] = {"onset": p.onset, "last": view.step, "share": share, "where": w, "key": k}
                    out.append(self._event(sk, inc, "firing", view.step))
                elif inc is not None:
                    if share >= cfg.sync_share:
                        inc["last"], inc["share"] = view.step, share
                    if ch == "clear":
                        out.append(self._event(sk, self.active.pop(sk), "resolved", view.step))
        return out

    def _event(self, sk: tuple, inc: dict, state: str, step: int) -> Event:
        w = inc["where"]
        msg = (f"{w['where']}: '{inc['key']}' takes {inc['share']:.0%} of the step time since step {inc['onset']}: "
               f"moving state, not computing, holds the run back")
        return Event(self.name, state, f"sync_bottleneck:{w['where']}:{inc['key']}", step, inc["onset"], inc["last"],
                     msg, w, {"key": inc["key"], "share": round(inc["share"], 4)})

    def finish(self) -> list[Event]:
        return [self._event(sk, inc, "active", inc["last"]) for sk, inc in self.active.items()]


# ---------------------------------------------------------------- user rules

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}
_RULE_RE = re.compile(r"^\s*(\S+)\s*(>=|<=|==|!=|>|<)\s*([-+0-9.eEinfaINFA]+)\s*$")


@dataclass
class UserRule:
    """``key op value`` on the global value of ``key`` (``fnmatch`` patterns match several keys);
    fires after ``for_steps`` consecutive steps."""

    key: str
    op: str
    value: float
    for_steps: int = 1
    name: str = ""

    @classmethod
    def parse(cls, spec: Any) -> "UserRule":
        """``"trainer/loss > 10"`` or ``{"key": ..., "op": ..., "value": ..., "for_steps": 1, "name": ...}``."""
        syntax = ("a rule is 'KEY OP NUMBER' (OP one of " + " ".join(_OPS) +
                  "), e.g. 'trainer/loss > 10', or a dict with key, op, value[, for_steps, name]")
        if isinstance(spec, str):
            m = _RULE_RE.match(spec)
            if not m:
                raise ValueError(f"bad alert rule {spec!r}: {syntax}")
            key, op, val = m.groups()
            try:
                return cls(key, op, float(val))
            except ValueError:
                raise ValueError(f"bad alert rule {spec!r}: {syntax}") from None
        if isinstance(spec, dict):
            unknown = set(spec) - {"key", "op", "value", "for_steps", "name"}
            if unknown or not {"key", "op", "value"} <= set(spec):
                raise ValueError(f"bad alert rule {spec!r}: {syntax}")
            if spec["op"] not in _OPS:
                raise ValueError(f"bad alert rule {spec!r}: op must be one of {', '.join(_OPS)}")
            try:
                return cls(str(spec["key"]), spec["op"], float(spec["value"]), int(spec.get("for_steps", 1)),
                           str(spec.get("name", "")))
            except (TypeError, ValueError):
                raise ValueError(f"bad alert rule {spec!r}: {syntax}") from None
        raise ValueError(f"bad alert rule {spec!r}: {syntax}")

    @property
    def text(self) -> str:
        return self.name or f"{self.key} {self.op} {self.value:g}"


class Thresholds(Rule):
    name = "threshold"

    def __init__(self, cfg: DoctorConfig, ids: Identities, rules: list[UserRule],
                 keys: KeyIndex | None = None) -> None:
        super().__init__(cfg, ids, keys)
        self.rules = rules
        self.match: dict[str, list] = {}  # key -> rules that match it
        self.keys = self.key_index.keyset(lambda k: bool(self._rules_for(k)))
        self.streak: dict[tuple, int] = {}
        self.active: dict[tuple, dict] = {}

    def _rules_for(self, key: str) -> list:
        r = self.match.get(key)
        if r is None:
            r = self.match[key] = [u for u in self.rules if u.key == key or (
                any(c in u.key for c in "*?[") and fnmatch.fnmatchcase(key, u.key))]
        return r

    def update(self, view: StepView) -> list[Event]:
        out = []
        g = view.global_values
        for k in self.keys.of(view, None, g):
            rules = self._rules_for(k)
            x = _num(g.get(k))
            if x is None:
                continue
            for u in rules:
                ik = (u.text, k)
                ok = _OPS[u.op](x, u.value)
                inc = self.active.get(ik)
                if ok:
                    n = self.streak[ik] = self.streak.get(ik, 0) + 1
                    if inc is None and n >= u.for_steps:
                        inc = self.active[ik] = {"onset": view.step - n + 1, "last": view.step, "value": x, "rule": u}
                        out.append(self._event(ik, inc, "firing", view.step))
                    elif inc is not None:
                        inc["last"] = view.step
                else:
                    self.streak[ik] = 0
                    if inc is not None:
                        out.append(self._event(ik, self.active.pop(ik), "resolved", view.step))
        return out

    def _event(self, ik: tuple, inc: dict, state: str, step: int) -> Event:
        u, key = inc["rule"], ik[1]
        head = u.text if u.key == key else f"{u.text} ({key})"
        msg = f"{head}: {inc['value']:.6g} at step {inc['onset']}"
        if state != "firing":
            msg += f" (until step {inc['last']})"
        return Event(self.name, state, f"threshold:{u.text}:{key}", step, inc["onset"], inc["last"], msg, dict(GLOBAL),
                     {"key": key, "rule": u.text, "value": inc["value"]})

    def finish(self) -> list[Event]:
        return [self._event(ik, inc, "active", inc["last"]) for ik, inc in self.active.items()]


#: rule name -> class (``disable`` in the alerts config takes these names)
RULES: dict[str, type] = {
    "nonfinite": NonFinite,
    "missing_ranks": MissingRanks,
    "straggler": Stragglers,
    "sync_bottleneck": SyncShare,
    "staleness": Staleness,
    "throughput_drop": Throughput,  # last: a drop that starts with one of the above follows from it
}


def build_rules(cfg: DoctorConfig, ids: Identities | None = None, user_rules: list | None = None,
                disable: tuple = (), skip_timeline_equivalent: bool = False, keep_all: bool = False,
                live: bool = False) -> list[Rule]:
    """The rules, in the order they run (roots before symptoms). ``keep_all`` (the doctor): the
    staleness rule keeps whole series for its whole-run test. ``live`` (the alerts backend): the
    NaN rule reads values only at steps that recorded a non-finite one."""
    ids = ids or Identities()
    keys = KeyIndex()
    out: list[Rule] = []
    for name, cls in RULES.items():
        if name in disable or (skip_timeline_equivalent and cls.timeline_equivalent):
            continue
        if cls is Stragglers:
            out.append(cls(cfg, ids, keys, slowdowns="slowdown" not in disable))
        elif cls is Staleness:
            out.append(cls(cfg, ids, keys, keep_all=keep_all))
        elif cls is NonFinite:
            out.append(cls(cfg, ids, keys, counted=live))
        else:
            out.append(cls(cfg, ids, keys))
    parsed = [u if isinstance(u, UserRule) else UserRule.parse(u) for u in (user_rules or [])]
    if parsed:
        out.append(Thresholds(cfg, ids, parsed, keys))
    return out
