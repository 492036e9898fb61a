"""The user-facing handle: :func:`get_or_create_metric_logger`, and attaching fetchers to meshes.

    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce"}})
    await mlogger.flush.call_one(step)       # the step's cut: see forge_obs.controller.flush
    await mlogger.shutdown.call_one()

``provisioner_hooks.install()`` calls :func:`attach_fetcher` for every new proc mesh; without it,
``await get_or_create_metric_logger(proc_mesh=pm)`` attaches one mesh by hand.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from monarch.actor import get_or_spawn_controller

from forge_obs.controller.fetcher import FETCHER_NAME, LocalFetcherActor, current_options, hosts_fetcher
from forge_obs.controller.flush import ProbedFlush, start_flush
from forge_obs.controller.inbox import INBOX_NAME, ObsInbox
from forge_obs.controller.logger import GLOBAL_LOGGER_NAME, GlobalLoggingActor
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.controller.state import CONTROLLER
from forge_obs.core.env import env_flag
from forge_obs.core.identity import current_identity, release_mesh_name, unique_mesh_name

logger = logging.getLogger("forge_obs")

__all__ = ["get_or_create_metric_logger", "MetricLogger", "attach_fetcher", "LoggerHandles", "cached_handles",
           "set_cached_handles", "spawn_handles_blocking"]


class LoggerHandles:
    """The controller actors' handles, as passed to meshes and child processes."""

    def __init__(self, glob: Any, inbox: Any, port: Any, socket: tuple | None = None) -> None:
        self.glob = glob
        self.inbox = inbox
        self.port = port  # the inbox's port: every fetcher answers on it ...
        self.socket = socket  # ... or, on the inbox's host, on its socket (see inbox.start_local_inbox)


_handles: LoggerHandles | None = None


def cached_handles() -> LoggerHandles | None:
    return _handles


def set_cached_handles(handles: LoggerHandles) -> None:
    global _handles
    _handles = handles


async def get_or_create_metric_logger(proc_mesh: Any = None, process_name: str | None = None) -> "MetricLogger":
    """The experiment's :class:`GlobalLoggingActor` (spawned on first use, in the controller
    process). With ``proc_mesh``, also attaches a fetcher to that mesh (not needed when
    ``provisioner_hooks.install()`` is active); the mesh takes part in every flush after this
    returns. As in torchforge, the mesh then has ``_local_fetcher`` (the fetchers) and ``_uid``
    (its id for ``has_fetcher``), and with ``FORGE_DISABLE_METRICS=true`` (read at the call) no
    fetcher is spawned. Called without ``proc_mesh`` inside an actor whose process has no fetcher,
    it attaches that process (``this_proc()``), as torchforge does; the controller's own process
    needs none (a flush takes its values directly)."""
    glob = await get_or_spawn_controller(GLOBAL_LOGGER_NAME, GlobalLoggingActor, process_name)
    inbox = await get_or_spawn_controller(INBOX_NAME, ObsInbox)
    handles = LoggerHandles(glob, inbox, *await inbox.get_address.call_one())
    set_cached_handles(handles)
    if env_flag("FORGE_DISABLE_METRICS"):
        return MetricLogger(glob)
    if proc_mesh is None and not _cut_here() and _in_user_actor():
        proc_mesh = _this_proc_once()
    if proc_mesh is not None and not getattr(proc_mesh, "_forge_obs_mesh_id", None):
        attach_fetcher(proc_mesh, handles, process_name)
        if not _cut_here():
            # registered with the controller by a message from this process: a call to the same
            # actor from here returns only after that message was handled
            await inbox.get_port.call_one()
    return MetricLogger(glob)


def _in_user_actor() -> bool:
    try:
        from monarch.actor import context

        return context().actor_instance.actor_id.actor_name != "client"
    except Exception:  # noqa: BLE001
        return False


_this_proc: list = []


def _this_proc_once() -> Any:
    """This process as a one-proc mesh, attached at most once."""
    if _this_proc:
        return None
    from monarch.actor import this_proc

    _this_proc.append(this_proc())
    return _this_proc[0]


def _stopping(mesh_id: str, name: str) -> None:
    """``proc_mesh.stop()`` of a mesh cut from here: the next cut takes its final states; with no
    run logging (before ``init_backends`` or after ``shutdown``) its name is free again."""
    LOCAL_MESHES.mark_stopping(mesh_id)
    if CONTROLLER.pipeline is None:
        release_mesh_name(name)


def _name_scope() -> str:
    """What prefixes the names of meshes spawned from this process: nothing in the controller
    process, else this process's own ``mesh.rN`` (its pid where it has no fetcher)."""
    if CONTROLLER.in_this_process:
        return ""
    ident = current_identity()
    if hosts_fetcher():
        return f"{ident.mesh}.r{ident.rank}"
    return "" if ident.mesh == "controller" else f"pid{ident.pid}"


def _cut_here() -> bool:
    """Whether meshes spawned in this process are cut from here (the controller process, or a
    process with a fetcher); otherwise the controller registers them."""
    return CONTROLLER.in_this_process or hosts_fetcher()


class _Flush:
    """``mlogger.flush``: ``await mlogger.flush.call_one(step)``, or ``await mlogger.flush(step)``.
    In the controller process the cut starts right here, without a message to the actor; elsewhere
    it is the actor's endpoint."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint

    def call_one(self, global_step: int) -> Any:
        if CONTROLLER.in_this_process:
            if CONTROLLER.probe_round_trip and CONTROLLER.pipeline is not None:
                return ProbedFlush(global_step)
            return start_flush(global_step)
        return self._endpoint.call_one(global_step)

    __call__ = call_one

    def __getattr__(self, name: str) -> Any:  # call, broadcast, ... go to the endpoint
        return getattr(self._endpoint, name)


class MetricLogger:
    """What :func:`get_or_create_metric_logger` returns: the :class:`GlobalLoggingActor` handle
    (``init_backends``, ``shutdown``, ... are its endpoints) whose ``flush`` starts the cut in
    place in the controller process. Picklable: in another process it is the plain actor handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.flush = _Flush(actor.flush)

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
            port, address = inbox.get_address.call_one().get()
        h = LoggerHandles(glob, inbox, port, address)
        set_cached_handles(h)
    return h


def attach_fetcher(proc_mesh: Any, handles: LoggerHandles, mesh_name: str | None = None) -> str:
    """Spawn a :class:`LocalFetcherActor` on every proc of ``proc_mesh`` and register the mesh
    with the cut: in this process's :data:`~forge_obs.controller.registry.LOCAL_MESHES` when this process
    cuts (the controller, or a process with a fetcher), else with the controller. Non-blocking:
    safe inside ``spawn_procs`` callbacks. Returns the mesh id."""
    from forge_obs.controller.monarch_internals import watch_mesh

    mesh_id = uuid.uuid4().hex[:12]
    name = unique_mesh_name(mesh_name, _name_scope())
    fetchers = proc_mesh.spawn(FETCHER_NAME, LocalFetcherActor, port=handles.port, mesh_id=mesh_id,
                               mesh_name=name, options={**current_options(), "inbox_socket": handles.socket})
    try:
        proc_mesh._forge_obs_mesh_id = mesh_id
        proc_mesh._uid = mesh_id  # torchforge's names: has_fetcher(proc_mesh._uid)
        proc_mesh._local_fetcher = fetchers
    except Exception:  # noqa: BLE001
        pass
    if _cut_here():
        LOCAL_MESHES.add(mesh_id, name, len(proc_mesh), fetchers)
        watch_mesh(
            proc_mesh,
            on_spawn=lambda actor: LOCAL_MESHES.add_actor(mesh_id, actor),
            on_stop=lambda: _stopping(mesh_id, name),
        )
    else:
        inbox = handles.inbox
        inbox.register_mesh.broadcast(fetchers, mesh_id, name, len(proc_mesh))
        watch_mesh(
            proc_mesh,
            on_spawn=lambda actor: inbox.add_actor.broadcast(mesh_id, actor),
            on_stop=lambda: inbox.stop_mesh.broadcast(mesh_id),
        )
    return mesh_id
