"""The doctor's rules over values, one step at a time (the live alerts run the same objects):
``nonfinite`` (one event per root: the first key to go NaN/inf, on the rank where it did, with
what followed), ``missing_ranks`` (ranks that did not report at a flush) and ``quiet_rank`` (a
rank that answers but stopped recording values it used to record), ``staleness`` (a
``*staleness*`` metric growing), ``throughput_drop`` (a throughput metric or the step rate down
to ``throughput_drop`` of its rolling median).

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> from forge_obs.analysis.doctor.rule_base import StepView
    >>> from forge_obs.analysis.doctor.value_rules import NonFinite
    >>> rule = NonFinite(DoctorConfig(), Identities())
    >>> [e.message for e in rule.update(StepView(3, 0.0, {"loss": float("nan")}))]
    ["'loss' = nan on global at step 3 (the first non-finite value)"]
"""

from __future__ import annotations

import math
import re
from collections import deque
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import History, Persistence, growth
from forge_obs.analysis.doctor.rule_base import Event, KeyIndex, Rule, StepView, number
from forge_obs.analysis.doctor.subjects import GLOBAL, Identities

__all__ = ["NonFinite", "MissingRanks", "Staleness", "Throughput"]


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


def _recorded(values: dict | None) -> bool:
    """Whether a rank's values of a step hold one it recorded (not only forge_obs's ``obs/``)."""
    if not values:
        return False
    for k in values:
        if k[:4] != "obs/":
            return True
    return False


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
        # ---- quiet ranks: answered, but no values recorded (telemetry, obs/sys/..., is sampled,
        # not recorded). Ranks of meshes: not the controller's own entry (``ctl``; older runs: no
        # pid), and a stuck controller sends no step at all: the stall watchdog's case
        q = self.cfg.quiet_steps
        if q:
            per_rank = view.per_rank
            for label, src in view.sources.items():
                g = self.gap.get(label)
                has = _recorded(per_rank.get(label))
                if g is None:
                    if has and src.get("pid") and not src.get("ctl"):
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
                x = number(vals.get(k))
                if x is not None and math.isfinite(x):
                    self.per_rank_keys.add(k)
                    seen.append(((label, k), x))
        for k in self.keys.of(view, None, view.global_values):
            if k not in self.per_rank_keys:
                x = number(view.global_values.get(k))
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

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 contention: Any = None) -> None:
        super().__init__(cfg, ids, keys)
        #: the ``host_contention`` rule: a drop while a host's processes wait for a CPU is listed there too
        self.contention = contention
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
            x = number(g.get(k))
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
            fired = self._event(key, inc, "firing", view.step)
            return self._host_side(fired, view.step) + [fired]
        if inc is not None:
            if hit:
                inc["last"] = view.step
                inc["low"] = min(inc["low"], x)
            if ch == "clear":
                out = [self._event(key, self.active.pop(key), "resolved", view.step)]
                h = self.contention
                return out + (h.release(f"throughput_drop:{key}", view.step) if h is not None else [])
        return []

    def _host_side(self, fired: Event, step: int) -> list[Event]:
        """A drop while a process waited for a CPU on an oversubscribed host (the evidence's
        ``judge_drop``) is listed under that host's ``host_contention`` (fired with it when it
        opens); the drop itself is still reported, as a consequence."""
        h = self.contention
        if h is None:
            return []
        v = h.evidence.judge_drop(fired.onset_step, step)
        if not v.explained:
            return []
        d = v.details
        key = fired.details["key"]
        summary = (f"{'the step rate' if key == '<step rate>' else repr(key)} at "
                   f"{fired.details['lowest'] / fired.details['baseline']:.0%} of its "
                   f"median while {d['label']} waited for a CPU {d['runq_wait_share']:.0%} of the time "
                   f"(before: {d['usual_runq_wait_share']:.0%})")
        what = {"kind": "throughput_drop", **fired.where, "steps": [fired.onset_step, step],
                "message": fired.message, "summary": summary, "verdict": v.to_dict()}
        return h.absorb(f"throughput_drop:{fired.details['key']}", v, what, step, fired.onset_step)

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

