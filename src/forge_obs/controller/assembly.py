"""Step assembly: a cut that left becomes the :class:`~forge_obs.backends.record.StepRecord` every
backend gets.

    >>> from forge_obs.controller.cuts import Cut, RankBook
    >>> from forge_obs.recording.reduce import KeyDrops
    >>> cut = Cut(seq=1, step=0, deadline=0.0, local=None)
    >>> cut.received[("m", 0)] = ({"label": "m/r0"}, {"states": {"x": {"reduction_type": "sum", "sum": 2.0}}})
    >>> gauges = lambda: dict.fromkeys(GAUGES, 0.0)
    >>> record = StepAssembler("doc", "Controller", RankBook()).build(cut, [], [], 0, KeyDrops(), gauges)
    >>> record.step, record.global_dict()["x"], record.global_dict()["obs/ranks_reported"]
    (0, 2.0, 1.0)

Runs on the pipeline's worker thread, apart from any caller. Every rank's snapshot of the step
(the step's own, and the late and final states that joined it) is decoded here (snapshots travel
pickled), each rank's snapshots merged into one, then every rank's and every group's
(:mod:`forge_obs.wire.bundle`) merged exactly across ranks (:mod:`forge_obs.wire.merge`). What
cannot be decoded or merged is left out and counted by reason; the other ranks and keys arrive.
The step carries forge_obs's own view of it as ``obs/...`` keys (:meth:`StepAssembler.obs_metrics`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from forge_obs.backends.base import flattened_clashes
from forge_obs.backends.record import RankViews, StepRecord
from forge_obs.controller.cut_timing import breakdown
from forge_obs.controller.cuts import BUNDLED, Cut, RankBook
from forge_obs.core.counters import add_count, add_counts
from forge_obs.core.identity import current_identity
from forge_obs.core.selfobs import CPU_PARTS, SELF_OBS, add_cpu
from forge_obs.core.types import Metric
from forge_obs.core.warn import WARNER
from forge_obs.recording import telemetry
from forge_obs.recording.collector import MetricCollector, Taken
from forge_obs.recording.reduce import KeyDrops, Reduce
from forge_obs.recording.telemetry.keys import is_telemetry
from forge_obs.wire.bundle import loads_bundle
from forge_obs.wire.merge import merge_snapshots, reduce_snapshots, without_keys
from forge_obs.wire.snapshot import loads

__all__ = ["StepAssembler", "Tally", "GAUGES"]

logger = logging.getLogger("forge_obs")

_COLLECTOR = MetricCollector()
#: the pipeline's own figures a step reports (``gauges()`` of :meth:`StepAssembler.build`)
GAUGES = ("obs/backend_s", "obs/late_states", "obs/backend_errors", "obs/backend_dropped_steps",
          "obs/backend_dropped_stream_values", "obs/fenced_bundles", "obs/duplicates_dropped")
_COUNTERS = ("values_recorded", "dropped_values", "nonfinite_values", "stream_overflow", "stream_step_mismatch")


class StepAssembler:
    """Turns a cut into its step. ``book``: the ranks' labels and identities; ``per_rank``:
    whether a backend shows per-rank views (each rank's own reductions are built only then)."""

    def __init__(self, run_id: str, process_name: str, book: RankBook, per_rank: bool = False) -> None:
        self.run_id = run_id
        self.process_name = process_name
        self.book = book
        self.per_rank = per_rank

    def build(self, cut: Cut, missing: list, late: list, pending: int, drops: KeyDrops,
              gauges: Callable[[], dict[str, float]]) -> StepRecord | None:
        """The step of ``cut`` (None: a final cut with nothing recorded since the last flush).
        ``missing`` / ``late``: labels of the ranks absent from it / that missed its cut;
        ``pending``: cuts still pending; ``drops``: keys already left out (streamed values that
        could not be decoded), counted with this step; ``gauges()``: the pipeline's own
        ``obs/...`` figures, read as the step is assembled."""
        on_drop = drops.add
        entries = self._decoded_entries(cut, drops)
        bundles = self._decoded_bundles(cut, drops)
        tally = Tally(cut.step)
        by_label: dict[str, list[dict]] = {}  # rank label -> its snapshots (the step's own, late/final ones)
        sources: dict[str, dict] = {}
        for ident, snap in entries:
            label = ident.get("label") or str(ident)
            by_label.setdefault(label, []).append(snap)
            sources[label] = ident
            tally.add(snap)
        rank_snaps, raw = _rank_snapshots(by_label, on_drop)
        global_snaps = list(rank_snaps.values())
        conflict_keys = self._add_bundles(bundles, tally, drops, global_snaps, rank_snaps, raw, sources)
        overflows: list[str] = []
        global_metrics = reduce_snapshots(global_snaps, on_drop=on_drop, on_overflow=overflows.append)
        if conflict_keys:  # recorded with two reductions in some group: dropped everywhere, as within a rank
            global_metrics = [m for m in global_metrics if m.key not in conflict_keys]
            for k in conflict_keys:
                drops.add(k, "reduction_mismatch")
        # a name another key is flattened to needs a dict value: only states (not packed rows) hold one
        clashes = flattened_clashes(global_metrics) if any(s.get("states") for s in global_snaps) else {}
        if clashes:
            global_metrics, rank_snaps = _without_clashes(clashes, global_metrics, rank_snaps, drops)
        # per-rank Metrics are built only if a backend reads them (JSONL reads plain values)
        per_rank = RankViews(rank_snaps) if self.per_rank else {}
        if cut.final and not raw and (not global_snaps or _telemetry_only(global_metrics, tally, drops)):
            return None  # nothing was recorded after the last flush
        tally.overflows = len(overflows)
        obs = self.obs_metrics(cut, tally, drops, len(missing), len(late), pending, len(bundles), gauges())
        global_metrics.extend(Metric(k, float(v), Reduce.SUM) for k, v in obs.items())
        return StepRecord(step=cut.step, run_id=self.run_id, wall_time=time.time(), global_metrics=global_metrics,
                          per_rank=per_rank, raw=raw, sources=sources, missing=missing, late=late)

    def _decoded_entries(self, cut: Cut, drops: KeyDrops) -> list[tuple[dict, dict]]:
        """(identity, snapshot) of every rank in the step, decoded here (snapshots travel
        pickled); one that cannot be decoded is counted and left out, the others arrive."""
        raw_entries = []
        local = self._local_snapshot(cut, drops)
        if local is not None:
            me = current_identity()  # host and pid: the controller's telemetry is joined to its host by them
            raw_entries.append(({"label": self.process_name, "mesh": self.process_name, "rank": 0, "ctl": True,
                                 "host": me.host, "pid": me.pid}, local))
        raw_entries.extend(v for v in cut.received.values() if v is not BUNDLED)
        book = self.book
        for key, ident, snap in cut.extra:
            raw_entries.append((ident or book.identities.get(key) or {"label": book.labels.get(key, str(key))}, snap))
        entries = []
        for ident, snap in raw_entries:
            try:
                entries.append((ident or {}, loads(snap, drops.add)))
            except Exception as e:  # noqa: BLE001
                logger.error("forge_obs: states of %s for step %s could not be decoded: %r",
                             (ident or {}).get("label"), cut.step, e)
                drops.add(("states", (ident or {}).get("label")), "undecodable")
        return entries

    def _local_snapshot(self, cut: Cut, drops: KeyDrops) -> Any:
        """The controller's own values of the cut: a :class:`Taken` is exported here."""
        local = cut.local
        if not isinstance(local, Taken):
            return local
        try:
            snap = _COLLECTOR.export(local, packed=True)
        except Exception as e:  # noqa: BLE001 - the controller's own values; the ranks' still arrive
            logger.error("forge_obs: the controller's values of step %s could not be exported: %r", cut.step, e)
            for k in local.keys():
                drops.add(k, "export_error")
            return None
        if not cut.final:
            telemetry.add_to(snap, cut.step)  # the controller process's own obs/sys/... (never raises)
        return snap

    def _decoded_bundles(self, cut: Cut, drops: KeyDrops) -> list[dict]:
        """The step's bundles, decoded; one that cannot be is counted, the other groups arrive."""
        bundles = []
        for i, b in enumerate(cut.bundles):
            try:
                bundles.append(loads_bundle(b, drops.add))
            except Exception as e:  # noqa: BLE001 - counted; the other groups arrive
                logger.error("forge_obs: a bundle for step %s could not be decoded: %r", cut.step, e)
                drops.add(("bundle", i), "undecodable")
        return bundles

    def _add_bundles(self, bundles: list[dict], tally: "Tally", drops: KeyDrops, global_snaps: list,
                     rank_snaps: dict, raw: dict, sources: dict) -> set:
        """Add each group's merge (:mod:`forge_obs.wire.bundle`) to the step; returns the keys a
        group saw recorded with two reductions."""
        conflict_keys: set = set()
        label_of = self.book.label_of
        for b in bundles:
            merged = b["merged"]
            if merged.get("packed") or merged.get("states"):
                global_snaps.append(merged)
            tally.add(merged, b.get("streamed", ()))
            conflict_keys.update(b["conflicts"])
            drops.merge(b["drops"])
            for key, vals in (b.get("raw") or {}).items():
                raw.setdefault(label_of(tuple(key)), []).extend(vals)
            if self.per_rank:  # per-rank views: each rank's own snapshot, batched
                for key in b["ranks"]:
                    ident = self.book.identities.get(tuple(key))
                    if ident:
                        sources[label_of(tuple(key))] = ident
                for key, snap in (b.get("per_rank") or {}).items():
                    label = label_of(tuple(key))
                    rank_snaps[label] = merge_snapshots([rank_snaps[label], snap], drops.add) if label in rank_snaps else snap
        return conflict_keys

    def obs_metrics(self, cut: Cut, tally: "Tally", drops: KeyDrops, missing: int, late: int, pending: int,
                    bundles: int, gauges: dict[str, float]) -> dict[str, float]:
        """The step's ``obs/...`` keys: forge_obs's own view of the step."""
        c, own_cpu = tally.counters, tally.own_cpu
        by_reason = add_counts(dict(tally.rank_drops), drops.counts())
        return {
            "obs/values_recorded": c["values_recorded"],
            "obs/dropped_values": c["dropped_values"] + drops.total(),
            **{f"obs/dropped/{reason}": n for reason, n in sorted(by_reason.items()) if n},
            "obs/nonfinite_values": c["nonfinite_values"] + tally.overflows,
            "obs/stream_overflow": c["stream_overflow"],
            "obs/stream_step_mismatch": c["stream_step_mismatch"],
            # forge_obs's own CPU, all processes, up to this step's assembly
            "obs/cpu_s": sum(own_cpu.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS),
            **{f"obs/cpu_{part}_s": own_cpu.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS},
            "obs/flush_blocked_s": cut.blocked_s,
            "obs/backend_s": gauges["obs/backend_s"],
            "obs/pending_steps": pending,
            "obs/missing_ranks": missing,
            "obs/late_ranks": late,
            "obs/late_states": gauges["obs/late_states"],
            "obs/backend_errors": gauges["obs/backend_errors"],
            "obs/backend_dropped_steps": gauges["obs/backend_dropped_steps"],
            "obs/backend_dropped_stream_values": gauges["obs/backend_dropped_stream_values"],
            "obs/ranks_reported": len(cut.received) if cut.given is None else cut.given.reported,
            "obs/bundles": bundles,
            "obs/fenced_bundles": gauges["obs/fenced_bundles"],
            "obs/duplicates_dropped": gauges["obs/duplicates_dropped"],
            **breakdown(cut.called_at, cut.sent_at, cut.closed_at, cut.resumed_at, cut.stamp),
            **({} if cut.raw_round_trip_s is None else {"obs/raw_round_trip_s": cut.raw_round_trip_s}),
            **({} if cut.given is None else cut.given.obs),
        }


class Tally:
    """What a step's snapshots count: their counters (numbers by name), the values the ranks
    dropped (by reason), forge_obs's own CPU (this process's so far, plus each snapshot's)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.rank_drops: dict[str, int] = {}
        self.own_cpu: dict[str, float] = SELF_OBS.take()  # read now, not a step later
        self.overflows = 0

    def add(self, snap: dict, streamed: Iterable = ()) -> None:
        """A snapshot's (or a bundle's merged) counters and CPU; ``streamed``: a group's
        ``(values streamed early, under step)`` pairs."""
        counters = snap.get("counters") or {}
        for early, step in streamed:  # raw values streamed under a predicted step: was it this one?
            if early and step != self.step:
                self.counters["stream_step_mismatch"] += early
        early = counters.get("streamed_early")
        if early and counters.get("streamed_step") != self.step:
            self.counters["stream_step_mismatch"] += early
        for k, v in counters.items():
            if k in ("streamed_early", "streamed_step"):
                continue
            if isinstance(v, dict):  # dropped_by_reason
                add_counts(self.rank_drops, v)
            elif isinstance(v, (int, float)):
                add_count(self.counters, k, v)
        add_cpu(self.own_cpu, snap.get("self_cpu"))


def _telemetry_only(metrics: list, tally: "Tally", drops: KeyDrops) -> bool:
    """Whether a step holds only telemetry (``obs/sys/...``: sampled, not recorded): no other key,
    no value recorded or dropped."""
    c = tally.counters
    return (not c["values_recorded"] and not c["dropped_values"] and not drops.total()
            and all(is_telemetry(m.key) for m in metrics))


def _rank_snapshots(by_label: dict[str, list[dict]], on_drop: Any) -> tuple[dict[str, dict], dict[str, list]]:
    """Each rank's snapshots of the step merged into one (``label -> snapshot``, ranks that
    recorded nothing left out), and their raw values (``label -> [(key, value, ts)]``)."""
    rank_snaps: dict[str, dict] = {}
    raw: dict[str, list] = {}
    for label, snaps in by_label.items():
        for snap in snaps:
            if snap.get("raw"):
                raw.setdefault(label, []).extend(snap["raw"])
        snap = snaps[0] if len(snaps) == 1 else merge_snapshots(snaps, on_drop)
        if snap.get("states") or snap.get("packed"):
            rank_snaps[label] = snap
    return rank_snaps, raw


def _without_clashes(clashes: dict[str, str], metrics: list, rank_snaps: dict, drops: KeyDrops) -> tuple[list, dict]:
    """The step without the keys equal to a name another key is flattened to (``lat/p50``
    beside a distribution ``lat``): reserved, so that no backend writes two values under one
    name. Each is counted once (``reserved_key``), with a rate-limited warning."""
    for key, parent in clashes.items():
        drops.add(key, "reserved_key")
        WARNER.warn("reserved_key", key, f"{key!r} is a name {parent!r} is written under ({parent!r} is a dict, e.g. a "
                    f"distribution: {parent}/<field>); dropped from the step (counted in obs/dropped_values): rename it")
    metrics = [m for m in metrics if m.key not in clashes]
    return metrics, {label: without_keys(snap, clashes) for label, snap in rank_snaps.items()}
