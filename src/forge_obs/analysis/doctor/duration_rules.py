"""The doctor's rules over per-rank duration metrics (the live alerts run them; the doctor runs
them on runs without a timeline): ``straggler`` / ``slowdown`` (the
:class:`~forge_obs.analysis.doctor.detect.GroupTracker` the doctor uses on spans) and
``sync_bottleneck`` (a state-moving duration metric taking ``sync_share`` of the step).
"""

from __future__ import annotations

import math
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.detect import GroupTracker, Persistence
from forge_obs.analysis.doctor.rule_base import Event, KeyIndex, Rule, StepView, duration_scale, number
from forge_obs.analysis.doctor.subjects import Identities

__all__ = ["Stragglers", "SyncShare"]


class Stragglers(Rule):
    """``straggler`` / ``slowdown`` on per-rank duration metrics, grouped by (mesh, key): the
    same :class:`GroupTracker` the doctor runs on spans. Wait-like keys (``wait_spans``) are
    consequences of someone else's slowness and not judged, nor are forge_obs's own (``obs/``:
    ``obs/sys/proc/cpu_s`` is telemetry, not a duration of work)."""

    name = "straggler"
    timeline_equivalent = True

    def __init__(self, cfg: DoctorConfig, ids: Identities, keys: KeyIndex | None = None,
                 slowdowns: bool = True, contention: Any = None) -> None:
        super().__init__(cfg, ids, keys)
        self.slowdowns = slowdowns
        #: the ``host_contention`` rule (:class:`~forge_obs.analysis.doctor.contention.HostContention`), or None
        self.contention = contention
        self.held: dict[str, list] = {}  # condition id -> [group, kind, rank, label, hits judged]: its host's
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
        sc = None if k[:4] == "obs/" or self.cfg.wait_re.search(k) else duration_scale(k)
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
            if changes:
                out += self._changes(g, t, by_rank, changes, view)
        if self.held:
            out += self._recheck(view)
        return out

    def _changes(self, g: tuple, t: GroupTracker, by_rank: dict, changes: list, view: StepView) -> list[Event]:
        """The events of one group's changes at this step: a rank's own slowdown while it is a
        straggler is part of that event; a condition its host's contention explains goes to the
        ``host_contention`` rule instead."""
        out: list[Event] = []
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
            held = self._host_side(g, t, c, view, label)
            if held is not None:
                out += held
            else:
                out.append(self._event(g, c, view, label))
        return out

    def _host_side(self, g: tuple, t: GroupTracker, c: Any, view: StepView, label: str | None) -> list[Event] | None:
        """The events when condition ``c`` is (or was) its host's contention (the ``host_contention``
        rule's :meth:`~forge_obs.analysis.doctor.contention.HostContention.absorb` /
        ``release``); None when it is the rank's own."""
        h = self.contention
        if h is None or label is None:
            return None
        cond = f"{c.kind}:{label}:{g[1]}"
        if c.state != "onset":
            return h.release(cond, view.step) if self.held.pop(cond, None) is not None else None
        ep = t.episode(c.rank, c.kind)
        if ep is None:
            return None
        v = h.evidence.judge(label, ep.onset, view.step, ep.excess_s(), peers=c.kind == "straggler")
        if not v.explained:
            return None
        self.held[cond] = [g, c.kind, c.rank, label, ep.hits]
        return h.absorb(cond, v, self._member(g, c, view, label, v), view.step, c.onset)

    def _member(self, g: tuple, c: Any, view: StepView, label: str, v: Any) -> dict:
        """A condition held as its host's contention, as the row the ``host_contention`` alert lists."""
        mesh, key = g
        w = self.ids.of_source(view.sources[label]) if label in view.sources else self.ids.of(mesh, c.rank)
        ratio = c.info.get("median_ratio") or 0
        what = f"its {mesh} peers" if c.kind == "straggler" else "its own earlier steps"
        return {"kind": c.kind, **w, "steps": [c.onset, view.step], "key": key, "verdict": v.to_dict(),
                "summary": f"{w['where']} '{key}' {ratio:.1f}x {what}",
                "message": f"'{key}' {ratio:.1f}x {what}: {v.clause()}"}

    def _recheck(self, view: StepView) -> list[Event]:
        """Conditions held as their host's are judged again after every ``window_steps`` more
        out-of-line steps, on those steps: one the host no longer explains (a fault that began
        while the host was busy) fires as the rank's own, from its onset."""
        out: list[Event] = []
        h, win = self.contention, self.cfg.window_steps
        for cond, held in list(self.held.items()):
            g, kind, rank, label, judged = held
            t = self.trackers[g]
            ep = t.episode(rank, kind)
            if ep is None or ep.hits - judged < win or len(ep.hit_steps) < ep.hits - judged:
                continue
            n = ep.hits - judged
            held[4] = ep.hits
            v = h.evidence.judge(label, ep.hit_steps[-n], view.step, ep.excess_s(last=n), peers=kind == "straggler")
            if v.explained:
                continue
            del self.held[cond]
            out += h.release(cond, view.step)
            c = t.current(rank, kind, view.step)
            if c is not None:
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
        sc = duration_scale(k) if k[:4] != "obs/" and self.cfg.sync_re.search(k) else None
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
                x = number(vals.get(k))
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

