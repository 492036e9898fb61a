"""The flush entry points: :func:`start_flush` (a cut of every observed mesh), what a caller
awaits (:class:`FlushWait`, :class:`ProbedFlush`), and the requests the pipeline sends ranks
while a cut is under way (:func:`ask_resend`, :func:`ask_exports`).

    mlogger = await get_or_create_metric_logger()
    await mlogger.flush.call_one(step)      # in the controller process: start_flush(step), awaited

A flush is a cut (see :mod:`forge_obs.controller.pipeline`): :func:`start_flush` swaps the
controller's own collector, opens the cut and casts it to every mesh of
:data:`~forge_obs.controller.registry.LOCAL_MESHES` (on the inbox socket to the ranks connected
there, :func:`cut_route`); it is complete when every expected rank acknowledged on the inbox
(:mod:`forge_obs.controller.inbox`), or after ``flush_timeout_s``.

    >>> check_step(3)
    3
    >>> check_step(-1)
    Traceback (most recent call last):
    ...
    ValueError: flush: global_step must be in [0, 2**63 - 1], got -1
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from typing import Any

from forge_obs.controller.fetcher import store_options
from forge_obs.controller.cuts import Cut
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.controller.registry import LOCAL_MESHES, MeshEntry
from forge_obs.controller.state import CONTROLLER, ControllerState
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.warn import WARNER
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording.timeline.writer import now_us
from forge_obs.wire.messages import CUT, EXPORT, CutOrder, ExportOrder, wire

logger = logging.getLogger("forge_obs")

__all__ = ["MAX_STEP", "check_step", "FlushWait", "ProbedFlush", "probe_round_trip", "start_flush", "cut_route",
           "send_on_socket", "ask_resend", "ask_exports"]

#: the largest step a backend can store (W&B, TensorBoard and DuckDB use signed 64-bit steps)
MAX_STEP = 2**63 - 1

_COLLECTOR = MetricCollector()


def check_step(step: Any) -> int:
    """A flush's step is a non-negative integer that backends can store; anything else is a
    programming error, raised at the ``flush`` call."""
    if isinstance(step, bool):
        raise TypeError(f"flush: global_step must be an int, got bool {step!r}")
    if not isinstance(step, int):
        try:
            step = operator.index(step)  # numpy integers
        except TypeError:
            raise TypeError(f"flush: global_step must be an int, got {type(step).__name__} {step!r}") from None
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"flush: global_step must be in [0, 2**63 - 1], got {step}")
    return int(step)


class FlushWait:
    """What ``mlogger.flush.call_one(step)`` returns in the controller process: awaitable (or
    ``.get()`` from synchronous code), done when the cut is complete. The cut's messages were
    already sent when it was created."""

    def __init__(self, cut: Cut | None, pipeline: FlushPipeline | None) -> None:
        self.cut = cut
        self.pipeline = pipeline

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> None:
        cut, pipeline = self.cut, self.pipeline
        if cut is None or cut.closed:
            return None
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        pipeline.on_cut_closed(cut, lambda: loop.call_soon_threadsafe(_resolve, done))
        timer = loop.call_later(max(0.0, cut.deadline - time.monotonic()), _resolve, done)
        try:
            await done
        finally:
            timer.cancel()
        if not cut.closed:
            pipeline.close_cut(cut)
        pipeline.resumed(cut)
        loop.call_soon(pipeline.request_exports, cut)  # once the caller has run on
        return None

    def get(self, timeout: float | None = None) -> None:
        cut, pipeline = self.cut, self.pipeline
        if cut is None or cut.closed:
            return None
        left = max(0.0, cut.deadline - time.monotonic())
        if not pipeline.wait_cut(cut, left if timeout is None else min(timeout, left)):
            pipeline.close_cut(cut)
        pipeline.request_exports(cut)
        return None


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class ProbedFlush:
    """A flush with ``probe_round_trip``: awaited, it first times a raw round trip to every live
    mesh (:func:`probe_round_trip`), then cuts; ``.get()`` from synchronous code only cuts."""

    def __init__(self, step: Any) -> None:
        self.step = check_step(step)  # a bad step raises at the call, as without the probe

    def __await__(self):
        return self._run().__await__()

    async def _run(self) -> None:
        raw_s = await probe_round_trip()
        await start_flush(self.step, raw_round_trip_s=raw_s)

    def get(self, timeout: float | None = None) -> None:
        start_flush(self.step).get(timeout)


async def probe_round_trip() -> float | None:
    """How long a raw no-op endpoint call (:meth:`LocalFetcherActor.ping`) to every live rank
    takes, all meshes at once, as a cut reaches them: from the first call until the last reply
    was awaited, as user code would time it; None if a mesh failed or did not answer within
    ``flush_timeout_s``."""
    pipeline = CONTROLLER.pipeline
    live = [e for e in LOCAL_MESHES.entries() if not e.stopping]
    if pipeline is None or not live:
        return None

    async def round_trip() -> float:  # timed inside: wait_for's own hop is not part of it
        t0 = time.monotonic()
        calls = [e.fetchers.ping.call() for e in live]
        for c in calls:
            await c
        return time.monotonic() - t0

    try:
        return await asyncio.wait_for(round_trip(), pipeline.flush_timeout_s)
    except Exception as e:  # noqa: BLE001 - a probe never fails the flush
        logger.warning("forge_obs: probe_round_trip: no raw round trip this step: %r", e)
        return None


# -------------------------------------------------------------------- the cut
def start_flush(step: Any, final: bool = False, raw_round_trip_s: float | None = None) -> FlushWait:
    """Cut every rank for ``step``: swap this process's collector, open the cut, cast it to every
    observed mesh. Returns at once; await the result for the cut to complete.
    ``raw_round_trip_s``: the probe's round trip just before (``probe_round_trip``), part of the
    cut from its start, so its step carries it however soon the cut closes."""
    called_at = time.monotonic()
    step = check_step(step)
    st = CONTROLLER
    pipeline = st.pipeline
    if pipeline is None:
        _warn_no_session(st, step)
        return FlushWait(None, None)
    if not pipeline.outputs.workers:
        WARNER.warn("no_backend", "", f"flush({step}): init_backends' config turned every backend off (None): "
                    "steps are cut but not logged until an init_backends names one")
    cpu0 = time.thread_time()
    taken = _COLLECTOR.swap()
    live, stopped = LOCAL_MESHES.take_for_cut()
    ranks = {(e.mesh_id, r): e.label(r) for e in live for r in range(e.size)}
    stopping = {(e.mesh_id, r): e.label(r) for e in stopped for r in range(e.size)}
    casts = _plans(st, pipeline, live, len(ranks))
    groups = st.planner.groups([e.mesh_id for e, _plan in casts])
    cut = pipeline.begin_cut(step, taken, ranks, stopping, final=final, groups=groups, called_at=called_at,
                             raw_round_trip_s=raw_round_trip_s)
    st.last_step = step
    _COLLECTOR.global_step = step + 1  # the controller's own raw values stream under the next step
    store_options({"last_step": step})  # fetchers spawned from now on predict from it
    _cast(cut, step, casts, pipeline)
    cut.sent_at = time.monotonic()
    SELF_OBS.add("flush", time.thread_time() - cpu0)
    return FlushWait(cut, pipeline)


def _warn_no_session(st: ControllerState, step: int) -> None:
    """A flush with no session: values are kept for the first flush of the next one."""
    if st.disabled:  # FORGE_DISABLE_METRICS: silent
        return
    if st.shut_down:
        WARNER.warn("flush_after_shutdown", "", f"flush({step}) after shutdown: values are kept until the "
                    "first flush after the next init_backends")
    else:
        WARNER.warn("flush_before_init", "", f"flush({step}) before init_backends: values are kept until "
                    "the first flush after it")


def _plans(st: ControllerState, pipeline: FlushPipeline, live: list[MeshEntry], job_ranks: int) -> list[tuple]:
    """``(mesh, plan)`` of every live mesh the cut goes to (``plan``: its aggregated route's, when
    it changed); a mesh that cannot be planned is left out (reported as missing ranks)."""
    casts = []
    for e in live:
        try:
            casts.append((e, st.planner.replan(e.mesh_id, e.size, pipeline.lagging, pipeline.need_per_rank,
                                               pipeline.flush_timeout_s, st.aggregate, job_ranks)))
        except Exception as ex:  # noqa: BLE001 - a dead mesh is reported as missing ranks
            logger.warning("forge_obs: could not plan mesh %s: %r", e.name, ex)
    return casts


def _cast(cut: Cut, step: int, casts: list[tuple], pipeline: FlushPipeline) -> None:
    """Send ``cut`` to every mesh of ``casts``: on the inbox socket, by a cast, or both (see
    :func:`cut_route`); a mesh that cannot be reached is reported as missing ranks."""
    ctl_us = now_us()
    for e, plan in casts:
        try:
            route = cut_route(e, plan, pipeline)
            if route != "monarch":
                send_on_socket(e, CutOrder(CUT, cut.seq, step, e.actor_label, ctl_us))
            if route == "split":  # the others by a cast, which the ranks on the socket ignore
                e.fetchers.cut.broadcast(cut.seq, step, e.actor_label, ctl_us, None, e.cast_ranks())
            elif route == "monarch":
                e.fetchers.cut.broadcast(cut.seq, step, e.actor_label, ctl_us, plan)
            e.last_cut = cut
        except Exception as ex:  # noqa: BLE001 - a dead mesh is reported as missing ranks
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)


def cut_route(e: MeshEntry, plan: dict | None, pipeline: FlushPipeline) -> str:
    """How mesh ``e`` takes this cut: on the inbox socket when every one of its ranks is
    connected there and the cut goes to each rank directly (no ``plan``), else through Monarch.
    A rank moves to the socket only when no cut of its mesh is in flight through Monarch (its
    mesh's last one closed, and it is not lagging), so a cut on the socket never overtakes an
    earlier cast; the mesh moves back at once when a rank's connection is gone (or a ``plan``
    comes): a cut already on the socket was read by the rank before the connection's end.
    While a mesh starts (some ranks not connected yet) the connected ones take their cuts on the
    socket ("split"): a cast to a mesh is delivered to none of its ranks until each of them
    spawned its fetcher, so a rank hung in that spawn would hold back the others' cut."""
    local = CONTROLLER.local
    keys = e.rank_keys()
    last = e.last_cut
    settled = last is None or last.closed
    if plan is not None or not local:
        e.socket_ranks = frozenset()
    elif local.named(keys):
        if e.route != "socket" and settled and pipeline.lagging.isdisjoint(keys):
            e.socket_ranks = frozenset(range(e.size))
    elif e.route == "socket":  # a connection is gone: a dead rank does not hold back a cast
        e.socket_ranks = frozenset()
    else:
        named, lagging = local.peers, pipeline.lagging
        e.socket_ranks = frozenset(r for r, k in enumerate(keys)
                                   if k in named and k not in lagging and (settled or r in e.socket_ranks))
    return e.route


def send_on_socket(e: MeshEntry, msg: CutOrder | ExportOrder) -> None:
    """Send ``msg`` to the ranks of ``e`` that take their cuts on the inbox socket. A rank whose
    connection is gone or full (dead, or its process frozen) misses it, as a dead rank misses a cast."""
    for key in CONTROLLER.local.send_each(e.socket_keys(), wire(msg)):
        logger.debug("forge_obs: rank %s of mesh %s did not take %s %s on the socket", key[1], e.name, msg.kind,
                     msg.seq)


# -------------------------------------------------------------------- requests while a cut is under way
def ask_resend(seq: int, ranks: dict[str, list[int]]) -> None:
    """Ask ``ranks`` (mesh id -> ranks) to send their answer to cut ``seq`` to the controller
    directly (their group leader did not deliver it in time; the pipeline calls this)."""
    for mesh_id, rs in ranks.items():
        _ask_mesh(mesh_id, "resend", f"resend cut {seq}", seq, sorted(rs))


def ask_exports(seq: int, mesh_ids: list[str]) -> None:
    """Cut ``seq`` closed: ask the ranks of ``mesh_ids`` for the states they hold for it (on the
    channel their cut came on: after it). A rank the request misses sends them before its next
    cut or final states."""
    for mesh_id in mesh_ids:
        e = LOCAL_MESHES.get(mesh_id)
        on_socket = e is not None and e.route != "monarch" and not e.stopping and CONTROLLER.local
        if on_socket:
            send_on_socket(e, ExportOrder(EXPORT, seq))
        if not on_socket or e.route == "split":  # a rank that holds nothing for ``seq`` ignores it
            _ask_mesh(mesh_id, "export", f"send its states of cut {seq}", seq)


def _ask_mesh(mesh_id: str, endpoint_name: str, what: str, *args: Any) -> None:
    """Cast ``endpoint_name(*args)`` to the fetchers of a live mesh; a gone or stopping one is
    skipped (it is reported as missing ranks; a message that reached its actors after they
    stopped would fail the sender)."""
    e = LOCAL_MESHES.get(mesh_id)
    if e is None or e.stopping:  # a stopping mesh's fetchers hand over what they hold themselves
        return
    try:
        getattr(e.fetchers, endpoint_name).broadcast(*args)
    except Exception as ex:  # noqa: BLE001 - a gone mesh is reported as missing ranks
        logger.warning("forge_obs: could not ask mesh %s to %s: %r", e.name, what, ex)
