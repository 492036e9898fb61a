"""The generator service (in the controller): routes requests over the replica actor meshes.

- routing: each request goes to the healthy replica with the fewest requests in flight;
- failure: a replica whose process died (Monarch supervision), whose call failed, or whose call
  outlasts :meth:`GeneratorService.request_timeout` is taken out of rotation for good, and the
  request is retried on another one; ``ReplicaDown`` when none is left;
- weight sync: :meth:`GeneratorService.publish` makes every healthy replica load the newest
  policy in the background; a replica that is behind loads only the latest (latest wins).

Metrics (``service/``): per replica ``replicaN_queue_depth``, ``replicaN_requests``,
``replicaN_failures``; ``replica_failures``, ``healthy_replicas``, ``request_latency_s``,
``time_to_recovery_s`` (from a failure to the next request completed).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable
from typing import Any

from forge_obs import Reduce, record_metric
from forge_obs.timeline import record_event


class ReplicaDown(Exception):
    """The replica (or, from :meth:`GeneratorService.generate`, every replica) is out of rotation."""


class GeneratorService:
    #: a call may take this long before its replica counts as stalled, for the first calls (the
    #: engine's first requests compile and allocate) ...
    FIRST_CALLS_TIMEOUT_S = 60.0
    FIRST_CALLS = 5
    #: ... then ``STALL_FACTOR`` x the median of the last ``LATENCY_WINDOW`` requests (at least ``min_timeout_s``)
    STALL_FACTOR = 10.0
    LATENCY_WINDOW = 50

    def __init__(self, replicas: list, min_timeout_s: float = 5.0) -> None:
        self.replicas = replicas
        self.min_timeout_s = min_timeout_s
        self.healthy = [True] * len(replicas)
        self.inflight = [0] * len(replicas)
        self.dead = [asyncio.Event() for _ in replicas]  # set when a replica leaves rotation
        self.latencies_s: list[float] = []
        self.failed_at: float | None = None  # perf_counter of the first failure not yet recovered from
        self.closing = False
        # weight sync: the newest (path, version) published, each replica's version and loader task
        self.latest: tuple[str, int] | None = None
        self.versions = [0] * len(replicas)
        self.loaders: list[asyncio.Task | None] = [None] * len(replicas)

    # ------------------------------------------------------------------ health
    def alive(self) -> list[int]:
        return [i for i, ok in enumerate(self.healthy) if ok]

    def request_timeout(self) -> float:
        if len(self.latencies_s) < self.FIRST_CALLS:
            return max(self.min_timeout_s, self.FIRST_CALLS_TIMEOUT_S)
        return max(self.min_timeout_s, self.STALL_FACTOR * statistics.median(self.latencies_s[-self.LATENCY_WINDOW:]))

    def on_replica_died(self, i: int) -> None:
        """Monarch's supervision reported replica ``i``'s process gone (called on the event loop)."""
        self._take_out(i, "died (process exited)")

    def close(self) -> None:
        """The run is ending: calls cut short by the meshes stopping are not failures."""
        self.closing = True

    def _take_out(self, i: int, why: str) -> None:
        if not self.healthy[i] or self.closing:
            return
        self.healthy[i] = False
        self.dead[i].set()  # calls still waiting on it give up now
        record_metric(f"service/replica{i}_failures", 1, Reduce.SUM)
        record_metric("service/replica_failures", 1, Reduce.SUM)
        record_event("replica_failed", replica=i, reason=why)
        if self.failed_at is None:
            self.failed_at = time.perf_counter()
        print(f"[grpo] generator replica {i} {why}: taken out of rotation ({len(self.alive())} left)", flush=True)

    async def _call(self, i: int, call: Awaitable, what: str) -> Any:
        """The result of ``call`` to replica ``i``; ReplicaDown (and ``i`` out of rotation) when the
        replica dies, the call fails, or it outlasts :meth:`request_timeout`."""
        call = asyncio.ensure_future(call)
        dead = asyncio.ensure_future(self.dead[i].wait())
        try:
            done, _ = await asyncio.wait({call, dead}, timeout=self.request_timeout(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if call in done:
            try:
                return call.result()
            except Exception as e:  # noqa: BLE001 - the call to a dead replica failed
                self._take_out(i, f"failed during {what} ({type(e).__name__})")
                raise ReplicaDown(str(e)) from e
        call.cancel()
        self._take_out(i, f"died during {what}" if dead in done else f"stalled ({what} timed out)")
        raise ReplicaDown(what)

    # ------------------------------------------------------------------ requests
    def _gauges(self) -> None:
        for i, q in enumerate(self.inflight):
            record_metric(f"service/replica{i}_queue_depth", q, Reduce.MAX)
        record_metric("service/healthy_replicas", len(self.alive()), Reduce.MIN)

    async def generate(self, flow: str, prompts: list[str], n: int, max_tokens: int, temperature: float,
                       latest_version: int) -> list[dict]:
        """``n`` completions per prompt from the least-loaded healthy replica (retried on another
        when it goes down); ReplicaDown when no replica is left."""
        while True:
            alive = self.alive()
            if not alive:
                raise ReplicaDown("no healthy generator replica left")
            i = min(alive, key=lambda j: (self.inflight[j], j))
            self.inflight[i] += 1
            self._gauges()
            t0 = time.perf_counter()
            try:
                out = await self._call(i, self.replicas[i].generate.call_one(
                    flow, prompts, n, max_tokens, temperature, latest_version), "generate")
            except ReplicaDown:
                continue
            finally:
                self.inflight[i] -= 1
            latency_s = time.perf_counter() - t0
            self.latencies_s.append(latency_s)
            record_metric(f"service/replica{i}_requests", 1, Reduce.SUM)
            record_metric("service/request_latency_s", latency_s, Reduce.MEAN)
            if self.failed_at is not None:
                record_metric("service/time_to_recovery_s", time.perf_counter() - self.failed_at, Reduce.MAX)
                record_event("service_recovered", replica=i)
                self.failed_at = None
            self._gauges()
            return out

    # ------------------------------------------------------------------ weight sync
    def publish(self, path: str, version: int) -> None:
        """Every healthy replica loads ``version`` from ``path`` in the background (returns at once)."""
        self.latest = (path, version)
        for i in self.alive():
            task = self.loaders[i]
            if task is None or task.done():
                self.loaders[i] = asyncio.get_running_loop().create_task(self._load_latest(i))

    async def _load_latest(self, i: int) -> None:
        while self.healthy[i] and self.latest is not None and self.versions[i] < self.latest[1]:
            path, version = self.latest
            try:
                await self._call(i, self.replicas[i].update_weights.call_one(path, version), "weight load")
            except ReplicaDown:
                return
            self.versions[i] = version
