"""The controller's actors: :class:`GlobalLoggingActor` (the experiment's logger) and
:class:`ObsInbox` (the port the fetchers answer on).

    import asyncio
    from forge_obs import get_or_create_metric_logger, record_metric, Reduce

    async def main():
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        await mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce"}})
        for n in (1, 2, 3):
            record_metric("my_sum_metric", n, Reduce.SUM)
        await mlogger.flush.call_one(global_step=0)   # prints my_sum_metric: 6.0
        await mlogger.shutdown.call_one()

    asyncio.run(main())

A flush is a cut (see :mod:`forge_obs.controller.pipeline`): :func:`start_flush` swaps the controller's own
collector, opens the cut and casts it to every mesh of :data:`~forge_obs.controller.registry.LOCAL_MESHES`;
it is complete when every expected rank acknowledged on the inbox's port (or after
``flush_timeout_s``). The inbox drains that port on a thread of its own, whatever the user's
event loop is doing. Both actors run in the controller process and share :data:`_STATE`.

torchforge's endpoints are here too: ``register_fetcher(fetcher, proc_id)`` connects a
``LocalFetcherActor`` spawned by hand to the cut (on an inbox of this process: a
GlobalLoggingActor spawned on a mesh by hand gets its own), ``deregister_fetcher`` hands its
values over, and ``init_backends`` may be called again (the current backends get every flushed
step and finish first). A timer on this actor's loop streams the controller's own raw values to
``per_rank_no_reduce`` backends every ``stream_interval_s``, as the fetchers do theirs.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import operator
import threading
import time
from typing import Any

from monarch.actor import Actor, Channel, context, endpoint

from forge_obs.backends.base import LoggerBackend, parse_modes
from forge_obs.backends.record import RunContext
from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.startup import create_backends, make_run_dir, start_backend, start_backends
from forge_obs.controller.fetcher import configure_all, store_options
from forge_obs.controller.monarch_internals import receiver_with_timeout
from forge_obs.controller.pipeline import Cut, FlushPipeline, RankBook
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.core.env import env_flag, local_socket_enabled
from forge_obs.core.identity import start_naming_run
from forge_obs.core.run import redact, release_meta_space, reserve_meta_space, write_meta
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.threads import STOP, stop_port_thread
from forge_obs.core.types import LoggingMode
from forge_obs.core.warn import WARNER
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording.timeline.writer import now_us
from forge_obs.wire.messages import ACK, ACKB, BUNDLE, CUT, EXPORT, FINAL, HELLO, RESENT, STATES, STREAM
from forge_obs.wire.plan import Planner
from forge_obs.controller.local_socket import LocalInbox
from forge_obs.wire.snapshot import has_values

logger = logging.getLogger("forge_obs")

__all__ = ["GlobalLoggingActor", "ObsInbox", "start_flush", "FlushWait", "ProbedFlush", "probe_round_trip", "GLOBAL_LOGGER_NAME", "INBOX_NAME"]

GLOBAL_LOGGER_NAME = "obs_global_logger"
INBOX_NAME = "obs_inbox"
#: the largest step a backend can store (W&B, TensorBoard and DuckDB use signed 64-bit steps)
MAX_STEP = 2**63 - 1


class _ControllerState:
    """What the controller actors share (they run in the controller process, each on its own
    thread); ``lock`` guards the hand-over between the inbox thread and ``init_backends``."""

    def __init__(self) -> None:
        self.process_name = "Controller"
        self.in_this_process = False  # the GlobalLoggingActor lives in this process
        self.disabled = False  # init_backends saw FORGE_DISABLE_METRICS: flush is a silent no-op
        self.shut_down = False  # shutdown() ended the last session (no init_backends since)
        self.pipeline: FlushPipeline | None = None
        self.run: RunContext | None = None
        self.last_step: int | None = None
        self.early: list[tuple] = []  # states that arrived with no pipeline (before init_backends)
        self.book = RankBook()  # what is known of ranks, across sessions
        self.planner = Planner()  # the aggregated route's groups and leaders, across sessions
        self.aggregate = "off"  # init_backends' "aggregate": "auto" | "on" | "off"
        self.probe_round_trip = False  # init_backends' "probe_round_trip"
        self.lock = threading.Lock()
        self.inbox: Any = None  # the ObsInbox of this process, and its port (see _local_port)
        self.port: Any = None
        self.local: LocalInbox | bool | None = None  # this process's inbox socket (False: none can be made here)
        self.stream_interval_s = 0.0  # the controller's own raw values: pushed this often (0: off)
        self.stream_timer: Any = None


_STATE = _ControllerState()
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


# -------------------------------------------------------------------- flush
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


def _ask_resend(seq: int, ranks: dict[str, list[int]]) -> None:
    """Ask ``ranks`` (mesh id -> ranks) to send their answer to cut ``seq`` to the controller
    directly (their group leader did not deliver it in time; the pipeline calls this)."""
    for mesh_id, rs in ranks.items():
        _ask_mesh(mesh_id, "resend", f"resend cut {seq}", seq, sorted(rs))


def _ask_exports(seq: int, mesh_ids: list[str]) -> None:
    """Cut ``seq`` closed: ask the ranks of ``mesh_ids`` for the states they hold for it (on the
    channel their cut came on: after it). A rank the request misses sends them before its next
    cut or final states."""
    for mesh_id in mesh_ids:
        e = LOCAL_MESHES.get(mesh_id)
        on_socket = e is not None and e.route != "monarch" and not e.stopping and _STATE.local
        if on_socket:
            _send_on_socket(e, (EXPORT, seq))
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


def _cut_route(e: Any, plan: dict | None, pipeline: FlushPipeline) -> str:
    """How mesh ``e`` takes this cut: on the inbox socket when every one of its ranks is
    connected there and the cut goes to each rank directly (no ``plan``), else through Monarch.
    A rank moves to the socket only when no cut of its mesh is in flight through Monarch (its
    mesh's last one closed, and it is not lagging), so a cut on the socket never overtakes an
    earlier cast; the mesh moves back at once when a rank's connection is gone (or a ``plan``
    comes): a cut already on the socket was read by the rank before the connection's end.
    While a mesh starts (some ranks not connected yet) the connected ones take their cuts on the
    socket ("split"): a cast to a mesh is delivered to none of its ranks until each of them
    spawned its fetcher, so a rank hung in that spawn would hold back the others' cut."""
    local = _STATE.local
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


def _send_on_socket(e: Any, msg: tuple) -> None:
    """Send ``msg`` (a cut, an export request) to the ranks of ``e`` that take their cuts on the
    inbox socket. A rank whose connection is gone or full (dead, or its process frozen) misses
    it, as a dead rank misses a cast."""
    for key in _STATE.local.send_each(e.socket_keys(), msg):
        logger.debug("forge_obs: rank %s of mesh %s did not take %s %s on the socket", key[1], e.name, msg[0], msg[1])


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
    pipeline = _STATE.pipeline
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


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def start_flush(step: Any, final: bool = False, raw_round_trip_s: float | None = None) -> FlushWait:
    """Cut every rank for ``step``: swap this process's collector, open the cut, cast it to every
    observed mesh. Returns at once; await the result for the cut to complete.
    ``raw_round_trip_s``: the probe's round trip just before (``probe_round_trip``), part of the
    cut from its start, so its step carries it however soon the cut closes."""
    called_at = time.monotonic()
    step = check_step(step)
    st = _STATE
    pipeline = st.pipeline
    if pipeline is None:
        if st.disabled:  # FORGE_DISABLE_METRICS: silent
            pass
        elif st.shut_down:
            WARNER.warn("flush_after_shutdown", "", f"flush({step}) after shutdown: values are kept until the "
                        "first flush after the next init_backends")
        else:
            WARNER.warn("flush_before_init", "", f"flush({step}) before init_backends: values are kept until "
                        "the first flush after it")
        return FlushWait(None, None)
    if not pipeline.workers:
        WARNER.warn("no_backend", "", f"flush({step}): init_backends' config turned every backend off (None): "
                    "steps are cut but not logged until an init_backends names one")
    cpu0 = time.thread_time()
    taken = _COLLECTOR.swap()
    live, stopped = LOCAL_MESHES.take_for_cut()
    ranks = {(e.mesh_id, r): e.label(r) for e in live for r in range(e.size)}
    stopping = {(e.mesh_id, r): e.label(r) for e in stopped for r in range(e.size)}
    planner, mode, job_ranks = st.planner, st.aggregate, len(ranks)
    casts = []
    for e in live:
        try:
            casts.append((e, planner.plan_for(e.mesh_id, e.size, pipeline.lagging, pipeline.need_per_rank,
                                              pipeline.flush_timeout_s, mode, job_ranks)))
        except Exception as ex:  # noqa: BLE001 - a dead mesh is reported as missing ranks
            logger.warning("forge_obs: could not plan mesh %s: %r", e.name, ex)
    groups = planner.groups([e.mesh_id for e, _plan in casts])
    cut = pipeline.begin_cut(step, taken, ranks, stopping, final=final, groups=groups, called_at=called_at,
                             raw_round_trip_s=raw_round_trip_s)
    st.last_step = step
    _COLLECTOR.global_step = step + 1  # the controller's own raw values stream under the next step
    store_options({"last_step": step})  # fetchers spawned from now on predict from it
    ctl_us = now_us()
    for e, plan in casts:
        try:
            route = _cut_route(e, plan, pipeline)
            if route != "monarch":
                _send_on_socket(e, (CUT, cut.seq, step, e.actor_label, ctl_us))
            if route == "split":  # the others by a cast, which the ranks on the socket ignore
                e.fetchers.cut.broadcast(cut.seq, step, e.actor_label, ctl_us, None, e.cast_ranks())
            elif route == "monarch":
                e.fetchers.cut.broadcast(cut.seq, step, e.actor_label, ctl_us, plan)
            e.last_cut = cut
        except Exception as ex:  # noqa: BLE001 - a dead mesh is reported as missing ranks
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)
    cut.sent_at = time.monotonic()
    SELF_OBS.add("flush", time.thread_time() - cpu0)
    return FlushWait(cut, pipeline)


# -------------------------------------------------------------------- inbox
class InboxDrain:
    """The thread that takes every message of an inbox's port, in each sender's order, apart
    from every event loop; all of its CPU is counted in ``obs/cpu_inbox_s``. Its owner (the
    :class:`ObsInbox`) stops it when the actor stops, or, for the process's port (which outlives
    the actor that opened it), at process exit: :meth:`stop` sends ``_threads.STOP`` on the port,
    so every message sent before it is still taken."""

    def __init__(self, port: Any, receiver: Any) -> None:
        self._port = port
        self._recv = _receive_blocking(receiver)
        self._thread = threading.Thread(target=self._run, name="forge_obs-inbox", daemon=True)

    def start(self) -> "InboxDrain":
        self._thread.start()
        atexit.register(self.stop)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the messages already sent; True if the thread ended within ``timeout_s``."""
        atexit.unregister(self.stop)
        return stop_port_thread(self._thread, self._port, timeout_s)

    def _run(self) -> None:
        cpu = time.thread_time()
        recv = self._recv
        while True:
            try:
                msg = recv()
            except Exception as e:  # noqa: BLE001 - the process is going away
                logger.debug("forge_obs: inbox port closed: %r", e)
                return
            if msg == STOP:
                return
            # charged before the message is taken, so a step assembled once it closed its cut
            # counts it (the take's own CPU is charged with the next message)
            now = time.thread_time()
            SELF_OBS.add("inbox", now - cpu)
            cpu = now
            _take(msg)


def _receive_blocking(receiver: Any) -> Any:
    """The next message of ``receiver``, waiting for it (the one receive fast path)."""
    recv = receiver_with_timeout(receiver)
    return lambda: recv(None)


def _stream_label(rank_key: Any, label: str) -> str:
    """The label of a rank that streamed raw values: as the registry names it now (a rank may
    stream before the first cut tells it the actors spawned on its mesh), else as it sent it."""
    try:
        e = LOCAL_MESHES.get(rank_key[0])
        if e is not None:
            return e.label(int(rank_key[1]))
    except Exception:  # noqa: BLE001 - a key of another shape: the rank's own label
        pass
    return label


def _take(msg: tuple) -> None:
    """One message of the inbox's port: an ack, a rank's states, a stopping rank's final states,
    raw values streamed; from group leaders, ack batches and bundles (:mod:`forge_obs.controller.aggregate`)."""
    try:
        kind = msg[0]
        if kind == HELLO:  # a fetcher's host and port, kept across sessions
            _STATE.planner.hello(msg[1], msg[2], msg[3])
            return
        with _STATE.lock:
            pipeline = _STATE.pipeline
            if pipeline is None:
                # kept for the first cut after init_backends: values, and every stopped rank's
                # final states (that cut expects them, values or not)
                if kind == FINAL or (kind == STATES and has_values(msg[4])):
                    _STATE.early.append(msg[2:])
                return  # a raw stream with no session: its values' states are in the collector's cut

        if kind == ACK:  # (seq, rank, children, stamp[, identity, states])
            states = (msg[5], msg[6]) if len(msg) > 6 else None
            pipeline.ack(msg[1], msg[2], msg[3], msg[4] if len(msg) > 4 else None, states)
        elif kind == STREAM:
            pipeline.stream(msg[1], _stream_label(msg[1], msg[2]), msg[3], msg[4], msg[5])
        elif kind == STATES:
            pipeline.states(*msg[1:])
        elif kind == FINAL:
            pipeline.final(*msg[1:])
        elif kind == ACKB:
            pipeline.ack_batch(msg[1], msg[2], msg[3])
        elif kind == BUNDLE:  # (seq, leader, version, ranks, identities, bytes)
            if _STATE.planner.current(msg[2], msg[3]):
                pipeline.bundle(msg[1], msg[4], msg[6], msg[5], leader=msg[2])
            else:  # a replaced leader's: its members resent their states to the controller
                pipeline.fenced_bundles += 1
        elif kind == RESENT:
            pipeline.states_resent(*msg[1:])
    except Exception:  # noqa: BLE001 - one bad message never stops the drain
        logger.exception("forge_obs: could not take a fetcher message")


def local_address() -> tuple | None:
    """``(host, path)`` of this process's inbox socket (:mod:`forge_obs.controller.local_socket`),
    started on first use: fetchers of this host answer there rather than on the inbox's port
    (the same messages, taken by the same ``_take``). None when ``FORGE_OBS_LOCAL_SOCKET`` is
    false or the socket cannot be made here."""
    st = _STATE
    if st.local is None and local_socket_enabled():
        with st.lock:
            if st.local is None:
                try:
                    st.local = LocalInbox.start(_take, lambda cpu_s: SELF_OBS.add("inbox", cpu_s))
                    atexit.register(st.local.close)
                except Exception as e:  # noqa: BLE001 - the port serves every fetcher
                    logger.warning("forge_obs: no inbox socket (fetchers answer on the port): %r", e)
                    st.local = False
    return st.local.address if st.local else None


class ObsInbox(Actor):
    """Owns the port every fetcher answers on (acks, states, final states), drained by a thread
    of its own; also registers meshes attached by hand from processes that have no fetcher."""

    def __init__(self) -> None:
        self._port, receiver = Channel.open()
        if _STATE.port is None:  # this process's inbox (a GlobalLoggingActor here registers fetchers on it)
            _STATE.port = self._port
        self.drain = InboxDrain(self._port, receiver).start()

    @endpoint
    async def get_port(self) -> Any:
        return self._port

    @endpoint
    async def get_address(self) -> tuple:
        """``(port, socket address or None)``: where fetchers answer (see :func:`local_address`)."""
        return self._port, local_address()

    @endpoint
    async def register_mesh(self, fetchers: Any, mesh_id: str, mesh_name: str, num_ranks: int) -> None:
        LOCAL_MESHES.add(mesh_id, mesh_name, num_ranks, fetchers)

    @endpoint
    async def add_actor(self, mesh_id: str, actor: str) -> None:
        LOCAL_MESHES.add_actor(mesh_id, actor)

    @endpoint
    async def stop_mesh(self, mesh_id: str) -> None:
        LOCAL_MESHES.mark_stopping(mesh_id)


# -------------------------------------------------------------------- logger
class GlobalLoggingActor(Actor):
    """The experiment's single logger, a controller singleton (``get_or_create_metric_logger``).

    Endpoints: ``init_backends(config)`` (again: the current backends get every step flushed so
    far and finish, then the new ones start, same run unless ``"run"`` says otherwise),
    ``flush(global_step)``, ``shutdown()``; ``wait_idle()`` waits until every flushed step reached
    the backends; torchforge's ``register_fetcher(fetcher, proc_id)``,
    ``deregister_fetcher(proc_id)``, ``has_fetcher(proc_id)``, ``get_fetcher_count()``.
    """

    def __init__(self, process_name: str | None = None) -> None:
        self.process_name = process_name
        if _in_actor():  # not a plain GlobalLoggingActor() built outside Monarch (tests)
            _STATE.process_name = process_name or "Controller"
            _STATE.in_this_process = True

    def _validate_backend_config(self, backend_name: str, config: dict[str, Any]) -> dict[str, Any]:
        """torchforge's check of one backend's config: ``logging_mode`` as a :class:`LoggingMode`
        (ValueError naming the valid modes), ``per_rank_share_run`` a bool (ignored, with a
        warning, for ``global_reduce``; W&B ``per_rank_reduce`` with a shared run is warned about)."""
        if not isinstance(config, dict):
            raise ValueError(f"config of backend {backend_name!r} must be a dict, got {type(config).__name__}")
        modes = parse_modes(config.get("logging_mode"), (LoggingMode.GLOBAL_REDUCE,))
        mode: Any = modes[0] if len(modes) == 1 else list(modes)
        share = bool(config.get("per_rank_share_run", False))
        if share and modes == (LoggingMode.GLOBAL_REDUCE,):
            logger.warning("%s: per_rank_share_run=True is ignored in global_reduce mode", backend_name)
            share = False
        if backend_name == "wandb" and share and LoggingMode.PER_RANK_REDUCE in modes:
            logger.warning(
                "W&B: 'per_rank_reduce' with 'per_rank_share_run=True' is not recommended with torchforge's "
                "per-rank runs; in forge_obs it means one run with every rank's values as '<rank>/<key>' keys "
                "(the default). Set per_rank_share_run=False for one run per rank."
            )
        return {**config, "logging_mode": mode, "per_rank_share_run": share}

    @endpoint
    async def init_backends(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``config`` and start the backends. Raises ValueError (naming the backend and
        the valid choices) for an unknown backend, mode or key, and RuntimeError naming the
        backend whose constructor or ``init`` failed or whose ``init`` did not return within
        ``backend_init_timeout_s``; a call that raises changes nothing (a running session keeps
        logging). Called again, it creates and starts the new backends first, then hands every
        step flushed so far to the current backends and finishes them (values recorded since the
        last flush stay for the next one); the new ones continue the same run (unless ``config``
        has ``"run"``). With ``FORGE_DISABLE_METRICS=true`` (read at the call, as torchforge
        does) it starts nothing. Returns ``{"run_id": ..., "run_dir": ...}``."""
        st = _STATE
        _mark_controller(self.process_name)
        if env_flag("FORGE_DISABLE_METRICS"):
            logger.info("forge_obs: FORGE_DISABLE_METRICS is set: init_backends starts no backend")
            st.disabled = True
            return {"run_id": None, "run_dir": None}
        st.disabled = False
        if isinstance(config, dict) and st.pipeline is not None and "run" not in config and st.run is not None:
            config = {**config, "run": {"id": st.run.run_id, "root": str(st.run.run_dir.parent)}}
        cfg = LoggerConfig.parse(config)
        run = RunContext(
            run_id=cfg.run.run_id,
            run_dir=cfg.run.run_dir,
            process_name=st.process_name,
            config=redact(cfg.backends),
            start_time=time.time(),
            flush_timeout_s=cfg.flush_timeout_s,
        )
        backends, failed = await _take_over(cfg, run)
        st.shut_down = False
        write_meta(run.run_dir, run_id=run.run_id, process_name=st.process_name, config=cfg.backends,
                   start_time=run.start_time, status="running", **cfg.run.labels())
        reserve_meta_space(run.run_dir)  # room for the final status, should the disk fill up
        from forge_obs.recording.timeline import writer as _timeline

        if st.run is None or st.run.run_dir != run.run_dir:
            start_naming_run(LOCAL_MESHES.live_names())
            _announce(run)
        st.run = run
        timeline = _timeline.controller_options(run.run_id, run.start_time, cfg.timeline)
        if _timeline.configure(run.run_dir, dict(timeline, _ctl=True)):
            from forge_obs.controller.call_context import install as _link_calls

            _link_calls()
        pipeline = FlushPipeline(backends, run.run_id, cfg.flush_timeout_s, st.process_name, st.book,
                                 shutdown_timeout_s=cfg.shutdown_timeout_s, queue_steps=cfg.backend_queue_steps)
        st.aggregate = cfg.aggregate
        st.probe_round_trip = cfg.probe_round_trip
        pipeline.leader_of = st.planner.leader_of
        pipeline.ask_resend = _ask_resend
        pipeline.ask_exports = _ask_exports
        pipeline.start()
        streaming = any(LoggingMode.PER_RANK_NO_REDUCE in be.modes for be in backends.values())
        _COLLECTOR.set_streaming(streaming)
        _COLLECTOR.initialized = True
        options = {"streaming": streaming, "run_dir": str(run.run_dir), "timeline": timeline,
                   "stream_interval_s": cfg.stream_interval_s, "last_step": st.last_step}
        store_options(options)
        with st.lock:
            for item in st.early:
                pipeline.final(0, *item)
            st.early.clear()
            st.pipeline = pipeline
        st.stream_interval_s = cfg.stream_interval_s if streaming else 0.0
        _start_stream_timer()
        await _configure_meshes(options, cfg.flush_timeout_s)
        if failed:
            now = ", ".join(backends) or "no backend: flushed steps are not logged"
            raise RuntimeError(f"{'; '.join(map(str, failed))} (it replaced the running backend of that name, which "
                               f"has finished; from now on logging continues with {now})") from failed[0].__cause__
        return {"run_id": run.run_id, "run_dir": str(run.run_dir)}

    # ------------------------------------------------------------ fetchers (torchforge's endpoints)
    @endpoint
    async def register_fetcher(self, fetcher: Any, proc_id: str) -> None:
        """Take part a :class:`~forge_obs.controller.fetcher.LocalFetcherActor` mesh spawned by hand
        (torchforge's ``LocalFetcherActor(global_logger, process_name)``) in every flush from now
        on, as mesh ``proc_id``. ``provisioner_hooks`` and ``get_or_create_metric_logger`` do this
        themselves."""
        _mark_controller(self.process_name)
        port = await _local_port()
        from forge_obs.controller.fetcher import current_options

        identities = await fetcher.connect.call(port, proc_id, {**current_options(), "inbox_socket": local_address()})
        size, name = 0, None
        for _point, ident in identities.items():
            size += 1
            name = name or (ident or {}).get("mesh")
        LOCAL_MESHES.add(proc_id, name or proc_id, size, fetcher)

    @endpoint
    async def deregister_fetcher(self, proc_id: str) -> None:
        """Stop cutting mesh ``proc_id``: what it recorded since its last cut is handed over and
        logged with the next flush. An unknown ``proc_id`` is warned about, as torchforge does."""
        e = LOCAL_MESHES.get(proc_id)
        if e is None or e.stopping:
            logger.warning("forge_obs: fetcher %r is not registered; cannot deregister. Registered: %s",
                           proc_id, [x.mesh_id for x in LOCAL_MESHES.entries() if not x.stopping])
            return
        LOCAL_MESHES.mark_stopping(proc_id)  # the next cut expects its final states
        try:
            await e.fetchers.release.call()
        except Exception as ex:  # noqa: BLE001 - a gone mesh shows up as missing ranks
            logger.warning("forge_obs: fetcher %r did not hand over its values: %r", proc_id, ex)

    @endpoint
    async def has_fetcher(self, proc_id: str) -> bool:
        """Whether mesh ``proc_id`` takes part in the flushes (``proc_mesh._uid``)."""
        e = LOCAL_MESHES.get(proc_id)
        if e is not None:
            return not e.stopping
        return _STATE.pipeline is not None and any(k[0] == proc_id for kids in list(_STATE.pipeline.tree.values()) for k in kids)

    @endpoint
    async def get_fetcher_count(self) -> int:
        """Observed meshes: those spawned here, and those spawned from their processes that
        declared themselves at the last flush."""
        children = set()
        if _STATE.pipeline is not None:
            children = {k[0] for kids in list(_STATE.pipeline.tree.values()) for k in kids}
        return sum(1 for e in LOCAL_MESHES.entries() if not e.stopping) + len(children)

    @endpoint
    async def get_inbox(self) -> tuple:
        """``(inbox, port)``: the inbox of this actor's process (spawned there on first use)."""
        port = await _local_port()
        return _STATE.inbox, port

    # ------------------------------------------------------------ flush, shutdown
    @endpoint
    async def flush(self, global_step: int) -> None:
        """Cut every rank for ``global_step``; returns once every rank took part (or after
        ``flush_timeout_s``). Reduction and backend I/O happen in the background, in step order."""
        await (ProbedFlush(global_step) if _STATE.probe_round_trip else start_flush(global_step))

    @endpoint
    async def wait_idle(self) -> None:
        """Return once every step flushed so far has reached the backends (a backend busy for
        longer than ``shutdown_timeout_s`` is not waited for)."""
        if _STATE.pipeline is not None:
            await _STATE.pipeline.drain()

    @endpoint
    async def shutdown(self) -> None:
        """Log what was recorded after the last flush (as step ``last + 1``), drain every pending
        step and finish the backends. ``init_backends`` may be called again afterwards."""
        if _STATE.pipeline is None:
            return
        await _end_session(final=True)


async def _take_over(cfg: LoggerConfig, run: RunContext) -> tuple[dict[str, LoggerBackend], list[RuntimeError]]:
    """The new session's backends, started, and the running session ended. Every new backend is
    created, and every one that replaces no running backend is started, before the running
    session ends: a mistake there raises and changes nothing. A backend of the same name as a
    running one (two W&B runs with one id cannot be open at once) is started after the running
    one finished; those that fail then are left out and returned as errors."""
    st = _STATE
    running = set(st.pipeline.backends) if st.pipeline is not None else set()
    unchanged = "the running backends keep logging" if running else "no backend was started"
    try:
        backends = create_backends(cfg.backends)
        make_run_dir(run.run_dir)
        await start_backends({n: b for n, b in backends.items() if n not in running}, run, cfg.backend_init_timeout_s)
    except (ValueError, RuntimeError) as e:
        raise type(e)(f"{e} ({unchanged})") from e
    failed: list[RuntimeError] = []
    if st.pipeline is not None:  # called again: the current backends get what was flushed, then finish
        await _end_session(final=False)
        for name in [n for n in backends if n in running]:
            error = await start_backend(name, backends[name], run, cfg.backend_init_timeout_s)
            if error is not None:
                failed.append(error)
                del backends[name]
    return backends, failed


def _in_actor() -> bool:
    """Whether this runs inside a Monarch actor (not code calling ``GlobalLoggingActor()`` directly)."""
    try:
        return context().actor_instance.actor_id.actor_name != "client"
    except Exception:  # noqa: BLE001
        return False


def _announce(run: RunContext) -> None:
    """One line on stderr when a run starts: where it is written and the command that shows it
    live, written to work as printed in the shell that started the process
    (:func:`forge_obs.core.shell.printed_command`). ``FORGE_OBS_QUIET=1`` leaves it out."""
    if env_flag("FORGE_OBS_QUIET"):
        return
    import sys

    from forge_obs.core.shell import printed_command

    print(f"forge_obs: run {run.run_id} in {run.run_dir}; view live: {printed_command('serve', run.run_dir.parent)}",
          file=sys.stderr, flush=True)


def _mark_controller(process_name: str | None) -> None:
    """This process hosts the logger (an endpoint of it runs here)."""
    if not _STATE.in_this_process:
        _STATE.in_this_process = True
        _STATE.process_name = process_name or _STATE.process_name


async def _local_port() -> Any:
    """The port of an :class:`ObsInbox` in this process (the pipeline's): the one the client
    spawned here, or one spawned here now (a GlobalLoggingActor spawned on a mesh by hand)."""
    st = _STATE
    if st.port is None:
        if st.inbox is None:
            from monarch.actor import this_proc

            st.inbox = this_proc().spawn(INBOX_NAME, ObsInbox)
        port = await st.inbox.get_port.call_one()
        st.port = st.port or port
    return st.port


def _start_stream_timer() -> None:
    """The controller's own raw values reach streaming backends every ``stream_interval_s``
    too, from a timer on this actor's loop."""
    st = _STATE
    if st.stream_timer is not None or not st.stream_interval_s:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def tick() -> None:
        st.stream_timer = None
        pipeline = st.pipeline
        if pipeline is None or not st.stream_interval_s:
            return
        try:
            step = 0 if st.last_step is None else st.last_step + 1
            rows = _COLLECTOR.take_raw(step)
            if rows:
                pipeline.stream(None, st.process_name, step, rows)
        except Exception as e:  # noqa: BLE001 - the timer never dies of one push
            logger.error("forge_obs: the controller's raw values could not be streamed: %r", e)
        st.stream_timer = loop.call_later(st.stream_interval_s, tick)

    st.stream_timer = loop.call_later(st.stream_interval_s, tick)


async def _end_session(final: bool) -> None:
    """End the current backends' session. ``final`` (shutdown): what was recorded since the last
    flush is logged as step ``last + 1`` first, and the meshes stop streaming and close their
    timelines; otherwise (``init_backends`` again) it stays for the next flush."""
    st = _STATE
    if final:
        await start_flush((st.last_step + 1) if st.last_step is not None else 0, final=True)
    pipeline = st.pipeline
    st.stream_interval_s = 0.0
    if st.stream_timer is not None:
        st.stream_timer.cancel()
        st.stream_timer = None
    # late states still reach it through the inbox until here; bounded by shutdown_timeout_s
    unfinished = await pipeline.close()
    with st.lock:
        st.pipeline = None
    if st.run is not None:
        write_meta(
            st.run.run_dir,
            end_time=time.time(),
            status="finished" if final else "reconfigured",
            steps_logged=pipeline.steps_logged,
            backend_errors=pipeline.backend_errors,  # obs/backend_errors lags a step; this is the total
            backends=pipeline.backend_report(),
            unfinished_backends=unfinished,
        )
        if final:
            release_meta_space(st.run.run_dir)
    if not final:
        return
    st.shut_down = True
    start_naming_run(LOCAL_MESHES.live_names())  # the run ended: stopped meshes' names are free again
    options = {"streaming": False, "run_dir": None, "timeline": None}
    store_options(options)
    _COLLECTOR.set_streaming(False)
    _COLLECTOR.initialized = False
    # close the meshes' timelines, awaited: a mesh stopped after shutdown returns has taken
    # this message (one still in flight when its actors stop would fail this actor)
    await _configure_meshes(options, pipeline.flush_timeout_s)
    try:
        from forge_obs.recording.timeline.writer import close

        close()
    except Exception:  # noqa: BLE001
        pass
    st.last_step = None


async def _configure_meshes(options: dict[str, Any], timeout_s: float) -> None:
    """Apply ``options`` on every observed mesh (and the meshes spawned from them) and wait for
    it, so that every value recorded after ``init_backends`` returns is seen as configured."""
    await configure_all(LOCAL_MESHES.entries(), options, timeout_s)
