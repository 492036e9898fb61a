"""Controller side of a flush: assemble rank snapshots into steps, reduce, hand to backends.

    >>> import asyncio
    >>> from forge_obs.pipeline import FlushPipeline
    >>> from forge_obs.backends.base import LoggerBackend
    >>> seen = []
    >>> class Keep(LoggerBackend):
    ...     def log_step(self, record): seen.append(record.global_dict())
    >>> async def demo():
    ...     p = FlushPipeline(backends={"keep": Keep({})}, run_id="doc", flush_timeout_s=5)
    ...     p.start()
    ...     p.register_ranks("m1", 1)
    ...     p.begin_step(0, local_snapshot=None)
    ...     p.submit(0, ("m1", 0), {"label": "m/r0"}, {"states": {"x": {"reduction_type": "sum", "sum": 2.0}}})
    ...     await p.drain()
    >>> asyncio.run(demo())
    >>> seen[0]["x"]
    2.0

No Monarch here: the :class:`~forge_obs.logger_actors.GlobalLoggingActor` feeds this from its
endpoints. Steps leave in the order they were begun. A step waits for every expected rank or
until its deadline (``flush_timeout_s`` after the flush), whichever comes first; ranks that missed
the previous step are not waited for again until they report. Snapshots that arrive after their
step left (late, or a mesh's final snapshot when it stops) are merged into the next step, so no
value is lost or counted twice. Reduction and backend I/O run in one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from forge_obs.backends.base import LoggerBackend, call_hook
from forge_obs.collector import MetricCollector
from forge_obs.metric import LoggingMode, Metric
from forge_obs.record import RankViews, StepRecord
from forge_obs.reduce import Reduce, merge_states, reduce_snapshots, snapshot_states

logger = logging.getLogger("forge_obs")

RankKey = tuple  # (mesh_id, rank)

_COLLECTOR = MetricCollector()
_COUNTERS = ("values_recorded", "dropped_values", "nonfinite_values", "stream_overflow")
#: parts of forge_obs's own CPU (obs/cpu_<part>_s; obs/cpu_s is their sum)
CPU_PARTS = ("export", "timeline", "flush", "inbox", "pipeline", "alerts")


@dataclass
class _Pending:
    step: int
    deadline: float
    expected: set
    local: dict[str, Any] | None
    blocked_s: float = 0.0
    final: bool = False
    received: dict = field(default_factory=dict)  # rank_key -> (identity, snapshot)


class FlushPipeline:
    """Step assembly and backend I/O in one worker thread; every public method is thread-safe
    (Monarch runs each actor on its own thread and loop)."""

    def __init__(
        self,
        backends: dict[str, LoggerBackend],
        run_id: str,
        flush_timeout_s: float = 10.0,
        process_name: str = "Controller",
    ) -> None:
        self.backends = backends
        self.run_id = run_id
        self.flush_timeout_s = flush_timeout_s
        self.process_name = process_name
        self.ranks: dict[RankKey, dict[str, Any]] = {}  # registered rank -> last identity
        self.lagging: set = set()
        self._pending: list[_Pending] = []
        self._carry: dict[RankKey, list[tuple[dict, dict]]] = {}
        self._cv = threading.Condition()  # guards everything above and the counters below
        self._closing = False
        self._begun = 0
        self.steps_logged = 0
        self.backend_errors = 0
        self.late_states = 0
        self.last_backend_s = 0.0
        self._reported_errors: set[str] = set()
        self._worker = threading.Thread(target=self._work, name="forge_obs-backends", daemon=True)
        # per-rank reductions are only computed when some backend shows per-rank views
        self._need_per_rank = any(LoggingMode.PER_RANK_REDUCE in be.modes for be in backends.values())

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._worker.start()

    async def drain(self) -> None:
        """Wait until every begun step reached the backends (waiting at most its deadline)."""
        with self._cv:
            target = self._begun
        await asyncio.get_running_loop().run_in_executor(None, self._wait_logged, target)

    def _wait_logged(self, target: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self.steps_logged >= target or not self._worker.is_alive())

    async def close(self) -> None:
        """Drain, then finish every backend."""
        await self.drain()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        await asyncio.get_running_loop().run_in_executor(None, self._worker.join)

    # ------------------------------------------------------------ ranks
    def register_ranks(self, mesh_id: str, num_ranks: int, mesh_name: str | None = None) -> None:
        with self._cv:
            for r in range(num_ranks):
                self.ranks.setdefault((mesh_id, r), {"label": f"{mesh_name or mesh_id}/r{r}"})

    def relabel(self, mesh_id: str, prefix: str) -> None:
        """Name a mesh's ranks ``<prefix>/r<rank>`` until they report their own identity."""
        with self._cv:
            for (m, r), ident in self.ranks.items():
                if m == mesh_id and "pid" not in ident:
                    ident["label"] = f"{prefix}/r{r}"

    def deregister(self, mesh_id: str, rank: int | None = None) -> None:
        """Forget a mesh's ranks (the mesh stopped): no step waits for them any more."""
        with self._cv:
            keys = [k for k in self.ranks if k[0] == mesh_id and (rank is None or k[1] == rank)]
            for k in keys:
                self.ranks.pop(k, None)
                self.lagging.discard(k)
                for p in self._pending:
                    p.expected.discard(k)
            self._cv.notify_all()

    # ------------------------------------------------------------ steps
    @property
    def pending_steps(self) -> int:
        return len(self._pending)

    def begin_step(
        self, step: int, local_snapshot: dict[str, Any] | None, blocked_s: float = 0.0, final: bool = False
    ) -> _Pending:
        """Open ``step``: it waits for every registered rank's :meth:`submit`. A ``final`` step
        (shutdown) is not logged when nothing was recorded."""
        p = _Pending(
            step=step,
            deadline=time.monotonic() + self.flush_timeout_s,
            expected=set(),
            local=local_snapshot,
            blocked_s=blocked_s,
            final=final,
        )
        with self._cv:
            p.expected = set(self.ranks)
            self._pending.append(p)
            self._begun += 1
            self._cv.notify_all()
        return p

    def submit(self, step: int | None, rank_key: RankKey, identity: dict[str, Any], snapshot: dict[str, Any]) -> None:
        """A rank's snapshot for ``step`` (``None``: a final snapshot when its mesh stops)."""
        rank_key = tuple(rank_key)
        with self._cv:
            if identity and rank_key in self.ranks:
                self.ranks[rank_key] = identity
            self.lagging.discard(rank_key)
            target = None
            if step is not None:
                for p in self._pending:
                    if p.step == step and rank_key not in p.received:
                        target = p
                        break
            if target is None:
                if step is not None:
                    self.late_states += 1
                self._carry.setdefault(rank_key, []).append((identity, snapshot))
            else:
                target.received[rank_key] = (identity, snapshot)
            self._cv.notify_all()

    def _next_step(self) -> "tuple[_Pending, list, dict, int] | None":
        """Block until the oldest step is complete or past its deadline; None when closing."""
        with self._cv:
            while True:
                if not self._pending:
                    if self._closing:
                        return None
                    self._cv.wait()
                    continue
                p = self._pending[0]
                waiting = p.expected - p.received.keys() - self.lagging
                timeout = p.deadline - time.monotonic()
                if waiting and timeout > 0:
                    self._cv.wait(timeout)
                    continue
                self._pending.pop(0)
                missing = sorted(p.expected - p.received.keys(), key=str)
                self.lagging.update(missing)
                carry, self._carry = self._carry, {}
                missing_labels = [self.ranks.get(k, {}).get("label") or f"{k[0]}/r{k[1]}" for k in missing]
                return p, missing_labels, carry, len(self._pending)

    # ------------------------------------------------------------ worker thread
    def _work(self) -> None:
        while True:
            item = self._next_step()
            if item is None:
                break
            p, missing, carry, pending = item
            cpu0 = time.thread_time()
            try:
                t0 = time.perf_counter()
                record = self._build(p, missing, carry, pending)
                if record is not None:
                    record.global_metrics.append(Metric("obs/merge_s", time.perf_counter() - t0, Reduce.MAX))
                    t1 = time.perf_counter()
                    for name, be in self.backends.items():
                        try:
                            call_hook(be.log_step, record)
                        except Exception as e:  # noqa: BLE001 - one backend never stops the others
                            self.backend_errors += 1
                            if name not in self._reported_errors:
                                self._reported_errors.add(name)
                                logger.error(
                                    "forge_obs: backend %r failed at step %s: %r (counted in obs/backend_errors)",
                                    name, p.step, e,
                                )
                    self.last_backend_s = time.perf_counter() - t1
            except Exception:  # noqa: BLE001
                logger.exception("forge_obs: step %s could not be assembled", p.step)
            finally:
                _COLLECTOR.add_obs_cpu("pipeline", time.thread_time() - cpu0)
                with self._cv:
                    self.steps_logged += 1
                    self._cv.notify_all()
        for name, be in self.backends.items():
            try:
                call_hook(be.finish)
            except Exception as e:  # noqa: BLE001
                logger.error("forge_obs: backend %r failed to finish: %r", name, e)

    def _build(self, p: _Pending, missing: list, carry: dict, pending: int) -> StepRecord | None:
        # rank label -> list of snapshots (the step's own, plus late/final ones carried in)
        by_label: dict[str, list[dict]] = {}
        sources: dict[str, dict] = {}
        entries = []
        if p.local is not None:
            entries.append(({"label": self.process_name, "mesh": self.process_name, "rank": 0}, p.local))
        entries.extend(p.received.values())
        for items in carry.values():
            entries.extend(items)
        counters = dict.fromkeys(_COUNTERS, 0)
        conflicts: list[str] = []
        for ident, snap in entries:
            label = ident.get("label") or str(ident)
            by_label.setdefault(label, []).append(snap)
            sources[label] = ident
            for k, v in (snap.get("counters") or {}).items():
                counters[k] = counters.get(k, 0) + v

        def on_conflict(key: str, kinds: set) -> None:
            conflicts.append(key)

        rank_snaps: dict[str, dict] = {}  # label -> one snapshot (packed rows and/or states)
        raw: dict[str, list] = {}
        for label, snaps in by_label.items():
            for s in snaps:
                if s.get("raw"):
                    raw.setdefault(label, []).extend(s["raw"])
            if len(snaps) == 1:
                snap = snaps[0]
            else:  # the step's own snapshot plus late/final ones from the same rank
                merged: dict[str, list[dict]] = {}
                for s in snaps:
                    for k, st in snapshot_states(s).items():
                        merged.setdefault(k, []).append(st)
                states = {}
                for k, sts in merged.items():
                    if len({s["reduction_type"] for s in sts}) > 1:
                        conflicts.append(k)
                        continue
                    states[k] = sts[0] if len(sts) == 1 else merge_states(sts)
                snap = {"states": states}
            if snap.get("states") or snap.get("packed"):
                rank_snaps[label] = snap
        global_metrics = reduce_snapshots(list(rank_snaps.values()), on_conflict)
        # per-rank Metrics are built only if a backend reads them (JSONL reads plain values)
        per_rank = RankViews(rank_snaps) if self._need_per_rank else {}
        if p.final and not rank_snaps and not raw:
            return None  # nothing was recorded after the last flush
        obs = {
            "obs/values_recorded": counters["values_recorded"],
            "obs/dropped_values": counters["dropped_values"] + len(conflicts),
            "obs/nonfinite_values": counters["nonfinite_values"],
            "obs/stream_overflow": counters["stream_overflow"],
            # forge_obs's own CPU, all processes (the controller's merge and backends: the step before)
            "obs/cpu_s": sum(counters.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS),
            **{f"obs/cpu_{part}_s": counters.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS},
            "obs/flush_blocked_s": p.blocked_s,
            "obs/backend_s": self.last_backend_s,
            "obs/pending_steps": pending,
            "obs/missing_ranks": len(missing),
            "obs/late_states": self.late_states,
            "obs/backend_errors": self.backend_errors,
            "obs/ranks_reported": len(p.received),
        }
        global_metrics.extend(Metric(k, float(v), Reduce.SUM) for k, v in obs.items())
        return StepRecord(
            step=p.step,
            run_id=self.run_id,
            wall_time=time.time(),
            global_metrics=global_metrics,
            per_rank=per_rank,
            raw=raw,
            sources=sources,
            missing=missing,
        )
