"""Monarch actors: one ``GlobalLoggingActor`` per experiment, one ``LocalFetcherActor`` mesh per
proc mesh.

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

Flush protocol (push, so a dead or hung rank never blocks the others): ``flush(step)`` snapshots
the controller's own collector, opens the step, casts ``flush(step)`` to the fetcher meshes for
at most ``INLINE_CAST_S`` and hands the remaining meshes to a sender thread. Each fetcher
snapshots its process's collector and *pushes* the states to a Monarch port (``Channel.open``)
that a thread of the controller drains, whatever the user's event loop is doing; the
:class:`~forge_obs.pipeline.FlushPipeline` assembles the step (or gives up on missing ranks after
``flush_timeout_s``), reduces it and hands it to the backends in a worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from monarch.actor import Actor, Channel, context, endpoint, get_or_spawn_controller

from forge_obs.backends.base import LoggerBackend, backend_names, call_hook, get_logger_backend_class
from forge_obs.collector import MetricCollector
from forge_obs.identity import set_identity
from forge_obs.metric import LoggingMode
from forge_obs.pipeline import FlushPipeline
from forge_obs.record import RunContext
from forge_obs.run import RunConfig, redact, write_meta

logger = logging.getLogger("forge_obs")

GLOBAL_LOGGER_NAME = "obs_global_logger"
INBOX_NAME = "obs_inbox"
FETCHER_NAME = "obs_fetcher"
#: top-level keys of ``init_backends``'s config that are not backends
RESERVED_KEYS = ("run", "flush_timeout_s", "timeline")
DEFAULT_FLUSH_TIMEOUT_S = 10.0
#: how long ``flush`` casts to meshes itself before handing the rest to the sender thread
INLINE_CAST_S = 0.25e-3
# kinds of message on the inbox's submission port
_SUBMIT = "submit"
_DEREGISTER = "deregister"

__all__ = [
    "GlobalLoggingActor",
    "LocalFetcherActor",
    "get_or_create_metric_logger",
    "attach_fetcher",
    "ObsInbox",
    "GLOBAL_LOGGER_NAME",
]


class LocalFetcherActor(Actor):
    """Runs on every proc of a mesh; snapshots that process's :class:`MetricCollector`."""

    def __init__(self, port: Any, mesh_id: str, mesh_name: str | None = None) -> None:
        inst = context().actor_instance
        point = inst.rank
        proc_name = inst.actor_id.proc_name or ""
        name = mesh_name or (proc_name.rsplit("-", 1)[0] if "-" in proc_name else proc_name) or "mesh"
        self.port = port  # the controller inbox's submission port
        try:
            port.return_undeliverable = False  # a gone controller must not fail this actor
        except Exception:  # noqa: BLE001
            pass
        self.mesh_id = mesh_id
        self.rank = int(point.rank)
        self.identity = set_identity(
            mesh=name, rank=self.rank, coords={k: int(v) for k, v in dict(point).items()}, world_size=int(point.extent.nelements)
        )
        self.collector = MetricCollector()

    def _submit(self, step: int | None) -> None:
        cpu0 = time.thread_time()
        try:
            snap = self.collector.snapshot(packed=True)
            self.port.send((_SUBMIT, step, (self.mesh_id, self.rank), self.identity.to_dict(), snap))
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: fetcher %s/r%d could not submit step %s: %r", self.mesh_id, self.rank, step, e)
        self.collector.add_obs_cpu("export", time.thread_time() - cpu0)  # reported with the next step

    @endpoint
    async def flush(self, global_step: int) -> None:
        self._submit(global_step)

    @endpoint
    async def configure(self, streaming: bool, actor: str | None) -> None:
        try:
            self.collector.set_streaming(streaming)
            if actor:
                self.identity.actor = actor
        except Exception as e:  # noqa: BLE001
            logger.error("forge_obs: fetcher configure failed: %r", e)

    @endpoint
    async def configure_timeline(self, run_dir: str | None, options: dict) -> None:
        """Structured timeline (forge_obs.timeline): write this process's events under run_dir
        (None: close the file; records are kept in a small buffer until the next run)."""
        try:
            from forge_obs.timeline.writer import configure_from_push

            configure_from_push(run_dir, options)
        except Exception as e:  # noqa: BLE001
            logger.error("forge_obs: timeline configure failed: %r", e)

    async def __cleanup__(self, exc: Exception | None) -> None:
        """The mesh is stopping: hand over what was recorded since the last flush, then leave.
        The whole mesh is deregistered (a rank that already died cannot say so itself)."""
        self._submit(None)
        _timeline_close()
        try:  # on the same channel as the final snapshot, so it cannot overtake it
            self.port.send((_DEREGISTER, self.mesh_id, None))
        except Exception:  # noqa: BLE001
            pass


class _ControllerState:
    """State shared by the two controller actors (they run in the controller process).

    Fetcher traffic (register, submit, deregister) goes to :class:`ObsInbox`, not to the
    :class:`GlobalLoggingActor`: a Monarch actor handles one message at a time, so submissions
    must not queue behind a ``wait_idle``/``shutdown`` that is waiting for them.
    """

    def __init__(self) -> None:
        self.process_name = "Controller"
        self.fetchers: dict[str, dict[str, Any]] = {}  # mesh_id -> {mesh, name, size, actors}
        self.pipeline: FlushPipeline | None = None
        self.streaming = False
        self.run: RunContext | None = None
        self.last_step: int | None = None
        self.early: list[tuple] = []  # submissions before init_backends
        self.in_this_process = False  # the GlobalLoggingActor lives in this process
        self.timeline: dict[str, Any] | None = None  # timeline options pushed to meshes
        # guards pipeline/early hand-over: submissions arrive on the inbox's port thread
        self.lock = threading.Lock()
        self.sender: _FlushSender | None = None

    def submit(self, step: int | None, rank_key: tuple, identity: dict | None, snapshot: dict) -> None:
        """A fetcher's snapshot (from the inbox's port thread)."""
        if identity is not None:
            info = self.fetchers.get(rank_key[0])
            if info is not None and info["actors"] and not identity.get("actor"):
                identity["actor"] = "+".join(info["actors"])
                identity["label"] = f"{identity['mesh']}/{identity['actor']}/r{identity['rank']}"
        with self.lock:
            pipeline = self.pipeline
            if pipeline is None:
                self.early.append((None, rank_key, identity, snapshot))  # kept for the first step
                return
        pipeline.submit(step, rank_key, identity, snapshot)

    def start_pipeline(self, pipeline: FlushPipeline) -> None:
        with self.lock:
            for mesh_id, info in self.fetchers.items():
                pipeline.register_ranks(mesh_id, info["size"], info["name"])
            for args in self.early:
                pipeline.submit(*args)
            self.early.clear()
            self.pipeline = pipeline

    def deregister(self, mesh_id: str, rank: int | None = None) -> None:
        info = self.fetchers.get(mesh_id)
        if info is None:
            return
        if rank is None:
            self.fetchers.pop(mesh_id, None)
        else:
            info.setdefault("gone", set()).add(rank)
            if len(info["gone"]) >= info["size"]:
                self.fetchers.pop(mesh_id, None)
        if self.pipeline is not None:
            self.pipeline.deregister(mesh_id, rank)

    def register(self, fetcher: Any, mesh_id: str, mesh_name: str, num_ranks: int) -> None:
        self.fetchers[mesh_id] = {"mesh": fetcher, "name": mesh_name, "size": int(num_ranks), "actors": []}
        if self.pipeline is not None:
            self.pipeline.register_ranks(mesh_id, int(num_ranks), mesh_name)
            self.configure(mesh_id)

    def configure(self, mesh_id: str) -> None:
        info = self.fetchers[mesh_id]
        try:
            actors = "+".join(info["actors"]) or None
            info["mesh"].configure.broadcast(self.streaming, actors)
            if self.timeline is not None and self.run is not None:
                opts = dict(self.timeline, _ctl_us=time.time_ns() // 1000)
                info["mesh"].configure_timeline.broadcast(str(self.run.run_dir), opts)
        except Exception as e:  # noqa: BLE001
            logger.warning("forge_obs: could not configure fetchers of mesh %s: %r", info["name"], e)


_STATE = _ControllerState()
_COLLECTOR = MetricCollector()


def _drain_port(receiver: Any) -> None:
    """The inbox's thread: every message of the submission port, in each sender's order, apart
    from every event loop (a controller busy between flushes does not delay them). All of the
    thread's CPU, idle wake-ups of ``Future.get()`` included, is counted in ``obs/cpu_inbox_s``."""
    cpu = time.thread_time()
    while True:
        try:
            msg = receiver.recv().get()
        except Exception as e:  # noqa: BLE001 - the process is going away
            logger.debug("forge_obs: submission port closed: %r", e)
            return
        _take_fetcher_message(msg)
        now = time.thread_time()
        _COLLECTOR.add_obs_cpu("inbox", now - cpu)
        cpu = now


class _FlushSender:
    """Casts ``flush(step)`` to fetcher meshes in step order from a thread of its own, so that
    ``flush`` returns in O(1) whatever the number of meshes (a cast costs ~0.1 ms)."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, list]] = []  # (step, mesh infos)
        self.outstanding = 0  # queued or being sent
        self.cv = threading.Condition()
        threading.Thread(target=self._run, name="forge_obs-flush", daemon=True).start()

    @property
    def idle(self) -> bool:
        return self.outstanding == 0

    def put(self, step: int, infos: list) -> None:
        with self.cv:
            self.queue.append((step, infos))
            self.outstanding += 1
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                step, infos = self.queue.pop(0)
            cpu0 = time.thread_time()
            for info in infos:
                _cast_flush(info, step)
            _COLLECTOR.add_obs_cpu("flush", time.thread_time() - cpu0)
            with self.cv:
                self.outstanding -= 1


def _cast_flush(info: dict, step: int) -> None:
    try:
        info["mesh"].flush.broadcast(step)
    except Exception as e:  # noqa: BLE001 - a dead mesh is reported as missing ranks
        logger.warning("forge_obs: flush of mesh %s failed: %r", info["name"], e)


def _take_fetcher_message(msg: tuple) -> None:
    """One message of the inbox's port: a fetcher's snapshot or its mesh's deregistration."""
    try:
        if msg[0] == _SUBMIT:
            _STATE.submit(*msg[1:])
        elif msg[0] == _DEREGISTER:
            _STATE.deregister(*msg[1:])
    except Exception:  # noqa: BLE001 - one bad message never stops the drain
        logger.exception("forge_obs: could not take a fetcher message")


class ObsInbox(Actor):
    """Controller-side receiver of fetcher traffic (see :class:`_ControllerState`). Snapshots
    arrive on a port drained by a thread of its own (:func:`_drain_port`): it answers ~0.3 ms
    sooner than an actor endpoint and costs the controller less per message."""

    def __init__(self) -> None:
        self._port, receiver = Channel.open()
        threading.Thread(target=_drain_port, args=(receiver,), name="forge_obs-inbox", daemon=True).start()

    @endpoint
    async def get_port(self) -> Any:
        return self._port

    @endpoint
    async def register_fetcher(self, fetcher: Any, mesh_id: str, mesh_name: str, num_ranks: int) -> None:
        _STATE.register(fetcher, mesh_id, mesh_name, num_ranks)

    @endpoint
    async def set_actor_name(self, mesh_id: str, actor_name: str) -> None:
        info = _STATE.fetchers.get(mesh_id)
        if info is not None and actor_name not in info["actors"] and not actor_name.startswith("obs_"):
            info["actors"].append(actor_name)
            _STATE.configure(mesh_id)
            if _STATE.pipeline is not None:
                _STATE.pipeline.relabel(mesh_id, f"{info['name']}/{'+'.join(info['actors'])}")

    @endpoint
    async def deregister_fetcher(self, mesh_id: str, rank: int | None = None) -> None:
        _STATE.deregister(mesh_id, rank)


class GlobalLoggingActor(Actor):
    """The experiment's single logger, a controller singleton (``get_or_create_metric_logger``).

    Endpoints: ``init_backends(config)``, ``flush(global_step)``, ``shutdown()``; ``wait_idle()``
    waits until every flushed step reached the backends; ``has_fetcher(mesh_id)``,
    ``get_fetcher_count()``. Meshes register themselves with the :class:`ObsInbox` (done by
    :func:`attach_fetcher` / ``provisioner_hooks``).
    """

    def __init__(self, process_name: str | None = None) -> None:
        _STATE.process_name = process_name or "Controller"
        _STATE.in_this_process = True

    # ---------------------------------------------------------------- config
    @endpoint
    async def init_backends(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``config`` and start the backends. Raises ValueError (listing valid choices)
        for an unknown backend, mode or key, and RuntimeError naming the backend whose init failed.
        Returns ``{"run_id": ..., "run_dir": ...}``."""
        st = _STATE
        if st.pipeline is not None:
            raise RuntimeError("init_backends was already called; call shutdown() first")
        if not isinstance(config, dict):
            raise ValueError(f"init_backends takes a dict of backend configs, got {type(config).__name__}")
        config = dict(config)
        run_cfg = RunConfig.from_config(config.pop("run", None))
        timeout = float(config.pop("flush_timeout_s", DEFAULT_FLUSH_TIMEOUT_S))
        if timeout <= 0:
            raise ValueError("flush_timeout_s must be > 0")
        from forge_obs.timeline import writer as _timeline

        timeline_cfg = config.pop("timeline", None)
        _timeline.validate_options(timeline_cfg)  # raises ValueError on a bad key/value
        if "jsonl" not in config:
            config["jsonl"] = {}  # the local store is always on unless "jsonl": None
        backends: dict[str, LoggerBackend] = {}
        for name, bcfg in config.items():
            if bcfg is None or bcfg is False:
                continue
            if not isinstance(bcfg, dict):
                raise ValueError(f"config of backend {name!r} must be a dict, got {type(bcfg).__name__}")
            try:
                cls = get_logger_backend_class(name)
            except ValueError as e:
                raise ValueError(f"{e}; reserved keys: {', '.join(RESERVED_KEYS)}") from None
            backends[name] = cls(bcfg)  # validates logging_mode
        run = RunContext(
            run_id=run_cfg.run_id,
            run_dir=run_cfg.run_dir,
            process_name=st.process_name,
            config=redact(config),
            start_time=time.time(),
        )
        for name, be in backends.items():
            try:
                call_hook(be.init, run=run, role="global", process_name=st.process_name)
            except Exception as e:
                for other in backends.values():
                    try:
                        call_hook(other.finish)
                    except Exception:  # noqa: BLE001
                        pass
                raise RuntimeError(f"backend {name!r} failed to initialise: {e!r}") from e
        write_meta(run.run_dir, run_id=run.run_id, process_name=st.process_name, config=config,
                   start_time=run.start_time, status="running")
        st.run = run
        st.timeline = _timeline.controller_options(run.run_id, run.start_time, timeline_cfg)
        _timeline.configure(run.run_dir, dict(st.timeline, _ctl=True))
        pipeline = FlushPipeline(backends, run.run_id, timeout, st.process_name)
        pipeline.start()
        st.start_pipeline(pipeline)
        st.streaming = any(LoggingMode.PER_RANK_NO_REDUCE in be.modes for be in backends.values())
        MetricCollector().set_streaming(st.streaming)
        for mesh_id in st.fetchers:
            st.configure(mesh_id)
        return {"run_id": run.run_id, "run_dir": str(run.run_dir)}

    @endpoint
    async def has_fetcher(self, mesh_id: str) -> bool:
        return mesh_id in _STATE.fetchers

    @endpoint
    async def get_fetcher_count(self) -> int:
        return len(_STATE.fetchers)

    # ---------------------------------------------------------------- steps
    @endpoint
    async def flush(self, global_step: int) -> None:
        """Snapshot every rank for ``global_step`` and return; reduction and backend I/O happen
        in the background, in step order."""
        _flush(global_step)

    @endpoint
    async def wait_idle(self) -> None:
        """Return once every step flushed so far has reached the backends."""
        if _STATE.pipeline is not None:
            await _STATE.pipeline.drain()

    @endpoint
    async def shutdown(self) -> None:
        """Log what was recorded after the last flush (as step ``last + 1``), drain every pending
        step and finish the backends. ``init_backends`` may be called again afterwards."""
        st = _STATE
        if st.pipeline is None:
            return
        _flush((st.last_step + 1) if st.last_step is not None else 0, final=True)
        pipeline = st.pipeline
        await pipeline.close()  # fetchers' final snapshots still reach it through the inbox
        with st.lock:
            st.pipeline = None
        st.timeline = None
        _timeline_close(st)
        if st.run is not None:
            write_meta(
                st.run.run_dir,
                end_time=time.time(),
                status="finished",
                steps_logged=pipeline.steps_logged,
                backend_errors=pipeline.backend_errors,  # obs/backend_errors lags a step; this is the total
            )
        st.last_step = None


def _timeline_close(st: _ControllerState | None = None) -> None:
    """Close this process's timeline (and, from the controller, every mesh's: run_dir None)."""
    for info in list(st.fetchers.values()) if st is not None else ():
        try:
            info["mesh"].configure_timeline.broadcast(None, {})
        except Exception:  # noqa: BLE001
            pass
    try:
        from forge_obs.timeline.writer import close

        close()
    except Exception:  # noqa: BLE001
        pass


def _flush(step: int, final: bool = False) -> None:
    st = _STATE
    t0 = time.perf_counter()
    cpu0 = time.thread_time()
    if st.pipeline is None:
        logger.warning("forge_obs: flush(%s) before init_backends: values are kept until the first flush after it", step)
        return
    # open the step before asking the ranks, so that no answer can arrive before it exists
    pending = st.pipeline.begin_step(step, _COLLECTOR.snapshot(packed=True), final=final)
    st.last_step = step
    if st.sender is None:
        st.sender = _FlushSender()
    infos = list(st.fetchers.values())
    if st.sender.idle:  # cast here while it is cheap (lowest latency), the rest from the thread
        deadline = t0 + INLINE_CAST_S
        for i, info in enumerate(infos):
            _cast_flush(info, step)
            if i + 1 < len(infos) and time.perf_counter() > deadline:
                st.sender.put(step, infos[i + 1 :])
                break
    else:  # keep each mesh's steps in order behind what the thread still has to send
        st.sender.put(step, infos)
    pending.blocked_s = time.perf_counter() - t0
    _COLLECTOR.add_obs_cpu("flush", time.thread_time() - cpu0)  # reported with the next step


# -------------------------------------------------------------------- client side
class LoggerHandles:
    """The controller actors' handles, as passed to meshes and child processes."""

    def __init__(self, glob: Any, inbox: Any, port: Any) -> None:
        self.glob = glob
        self.inbox = inbox
        self.port = port  # the inbox's submission port


_handles: LoggerHandles | None = None


def cached_handles() -> LoggerHandles | None:
    return _handles


def set_cached_handles(handles: LoggerHandles) -> None:
    global _handles
    _handles = handles


async def get_or_create_metric_logger(proc_mesh: Any = None, process_name: str | None = None) -> Any:
    """The experiment's :class:`GlobalLoggingActor` (spawned on first use, in the controller
    process). With ``proc_mesh``, also attaches a fetcher to that mesh (not needed when
    ``provisioner_hooks.install()`` is active)."""
    glob = await get_or_spawn_controller(GLOBAL_LOGGER_NAME, GlobalLoggingActor, process_name)
    inbox = await get_or_spawn_controller(INBOX_NAME, ObsInbox)
    handles = LoggerHandles(glob, inbox, await inbox.get_port.call_one())
    set_cached_handles(handles)
    if proc_mesh is not None and not getattr(proc_mesh, "_forge_obs_mesh_id", None):
        attach_fetcher(proc_mesh, handles)
    return MetricLogger(glob)


class _Ready:
    """An already-finished result that can be awaited or ``.get()``-ed like a Monarch Future."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # pragma: no cover - makes this a generator

    def get(self, timeout: float | None = None) -> Any:
        return self.value


class _LocalFlush:
    """``mlogger.flush``: in the controller process the flush runs right here (snapshot, open
    the step, broadcast to fetchers), without a message round trip to the actor; elsewhere it is
    the actor's endpoint."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    def call_one(self, global_step: int) -> Any:
        if _STATE.in_this_process and _STATE.pipeline is not None:
            _flush(global_step)
            return _Ready(None)
        return self._endpoint.call_one(global_step)

    def __getattr__(self, name: str) -> Any:  # call, broadcast, ... go to the endpoint
        return getattr(self._endpoint, name)


class MetricLogger:
    """What :func:`get_or_create_metric_logger` returns: the :class:`GlobalLoggingActor` handle
    (``init_backends``, ``shutdown``, ... are its endpoints) with a faster ``flush`` in the
    controller process. Picklable: in another process it is the plain actor handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.flush = _LocalFlush(actor.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor, name)

    def __reduce__(self):
        return (MetricLogger, (self.actor,))


def spawn_handles_blocking() -> LoggerHandles:
    """Like :func:`get_or_create_metric_logger` without ``await`` (for spawn callbacks)."""
    h = cached_handles()
    if h is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            glob = get_or_spawn_controller(GLOBAL_LOGGER_NAME, GlobalLoggingActor).get()
            inbox = get_or_spawn_controller(INBOX_NAME, ObsInbox).get()
            port = inbox.get_port.call_one().get()
        h = LoggerHandles(glob, inbox, port)
        set_cached_handles(h)
    return h


def attach_fetcher(proc_mesh: Any, handles: LoggerHandles, mesh_name: str | None = None) -> str:
    """Spawn a :class:`LocalFetcherActor` on every proc of ``proc_mesh`` and register it.
    Returns the mesh id. Non-blocking: safe inside ``spawn_procs`` callbacks."""
    mesh_id = uuid.uuid4().hex[:12]
    fetcher = proc_mesh.spawn(
        FETCHER_NAME, LocalFetcherActor, handles.port, mesh_id, mesh_name
    )
    try:
        proc_mesh._forge_obs_mesh_id = mesh_id
    except Exception:  # noqa: BLE001
        pass
    if _STATE.in_this_process:
        # spawned by the controller: register synchronously, so that the very next flush
        # (which may overtake a message) already includes this mesh
        _STATE.register(fetcher, mesh_id, mesh_name or "mesh", len(proc_mesh))
    else:
        handles.inbox.register_fetcher.broadcast(fetcher, mesh_id, mesh_name or "mesh", len(proc_mesh))
    _track_actor_names(proc_mesh, handles.inbox, mesh_id)
    _deregister_on_stop(proc_mesh, handles.inbox, mesh_id)
    return mesh_id


def _deregister_on_stop(proc_mesh: Any, inbox: Any, mesh_id: str) -> None:
    """``proc_mesh.stop()`` deregisters the mesh at once, so that a mesh stopped with a dead
    process is not reported missing forever (the live ranks' final snapshots still arrive)."""
    orig = proc_mesh.stop

    def stop(*args: Any, **kwargs: Any) -> Any:
        try:
            if _STATE.in_this_process:
                _STATE.deregister(mesh_id)
            else:
                inbox.deregister_fetcher.broadcast(mesh_id, None)
        except Exception:  # noqa: BLE001
            pass
        return orig(*args, **kwargs)

    try:
        proc_mesh.stop = stop
    except Exception:  # noqa: BLE001
        pass


def _track_actor_names(proc_mesh: Any, inbox: Any, mesh_id: str) -> None:
    """Label ranks with the actors the user spawns on the mesh (wraps this mesh's ``spawn``)."""
    orig = proc_mesh.spawn

    def spawn(name: str, *args: Any, **kwargs: Any) -> Any:
        out = orig(name, *args, **kwargs)
        try:
            inbox.set_actor_name.broadcast(mesh_id, name)
        except Exception:  # noqa: BLE001
            pass
        return out

    try:
        proc_mesh.spawn = spawn
    except Exception:  # noqa: BLE001
        pass
