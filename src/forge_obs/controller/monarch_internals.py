"""The one module that touches Monarch's internals (torchmonarch 0.7.0): the patches that attach
forge_obs to every proc mesh, and the receive fast path of a port.

New meshes, primary: ``monarch._src.actor.proc_mesh.register_proc_mesh_spawn_callback`` (runs ``cb(pm)`` for
every ``spawn_procs`` in this process) and ``SetupActor.register_startup_function`` (runs a
callable in every new child process, so meshes spawned from inside actors are covered too).
Fallback, if those names move: wrap the public ``HostMesh.spawn_procs``. Either way the mesh name
given to ``spawn_procs(name=...)`` is passed to the callback, and a callback error never reaches
the caller of ``spawn_procs``.

Each observed mesh: :func:`watch_mesh` wraps that mesh object's ``spawn`` (to label its ranks with
the user's actor names) and ``stop`` (so the next flush collects the final states it hands over).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any, Callable

__all__ = ["install", "uninstall", "register_child_startup", "unregister_child_startup", "watch_mesh", "receiver_with_timeout"]

logger = logging.getLogger("forge_obs")

_mesh_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("forge_obs_mesh_name", default=None)
_callback: Callable[[Any, str | None], None] | None = None
_private_ok = False
_orig_spawn_procs: Any = None


def _safe_call(pm: Any) -> None:
    cb = _callback
    if cb is None:
        return
    try:
        cb(pm, _mesh_name.get())
    except Exception as e:  # noqa: BLE001 - never raise into the user's spawn_procs
        logger.warning("forge_obs: could not attach observability to a new proc mesh: %r", e)


def install(callback: Callable[[Any, str | None], None]) -> str:
    """Route every new proc mesh to ``callback(proc_mesh, mesh_name)``. Returns the mechanism
    used: ``"spawn_callback"`` or ``"spawn_procs_wrapper"``."""
    global _callback, _private_ok, _orig_spawn_procs
    _callback = callback
    from monarch.actor import HostMesh

    if _orig_spawn_procs is None:
        _orig_spawn_procs = HostMesh.spawn_procs
        orig = _orig_spawn_procs

        @functools.wraps(orig)
        def spawn_procs(self: Any, *args: Any, **kwargs: Any) -> Any:
            name = kwargs.get("name") if "name" in kwargs else (args[2] if len(args) > 2 else None)
            token = _mesh_name.set(name or None)
            try:
                pm = orig(self, *args, **kwargs)
            finally:
                _mesh_name.reset(token)
            if not _private_ok:
                _safe_call(pm)
            return pm

        HostMesh.spawn_procs = spawn_procs
    if not _private_ok:
        try:
            from monarch._src.actor.proc_mesh import register_proc_mesh_spawn_callback

            register_proc_mesh_spawn_callback(_safe_call)
            _private_ok = True
        except Exception as e:  # noqa: BLE001
            logger.info("forge_obs: Monarch spawn callback unavailable (%r); using the spawn_procs wrapper", e)
    return "spawn_callback" if _private_ok else "spawn_procs_wrapper"


def uninstall() -> None:
    global _callback, _private_ok, _orig_spawn_procs
    _callback = None
    if _private_ok:
        try:
            from monarch._src.actor.proc_mesh import unregister_proc_mesh_spawn_callback

            unregister_proc_mesh_spawn_callback(_safe_call)
        except Exception:  # noqa: BLE001
            pass
        _private_ok = False
    if _orig_spawn_procs is not None:
        from monarch.actor import HostMesh

        HostMesh.spawn_procs = _orig_spawn_procs
        _orig_spawn_procs = None


def register_child_startup(make_callable: Callable[[], Any]) -> bool:
    """Run ``make_callable()``'s result in every child process spawned from now on."""
    try:
        from monarch._src.actor.proc_mesh import SetupActor

        if make_callable not in SetupActor._startup_functions:
            SetupActor.register_startup_function(make_callable)
        return True
    except Exception as e:  # noqa: BLE001
        logger.info("forge_obs: child-process startup hook unavailable (%r)", e)
        return False


def unregister_child_startup(make_callable: Callable[[], Any]) -> None:
    try:
        from monarch._src.actor.proc_mesh import SetupActor

        if make_callable in SetupActor._startup_functions:
            SetupActor._startup_functions.remove(make_callable)
    except Exception:  # noqa: BLE001
        pass


def watch_mesh(proc_mesh: Any, on_spawn: Callable[[str], Any], on_stop: Callable[[], Any]) -> None:
    """Call ``on_spawn(actor_name)`` after each ``proc_mesh.spawn(name, ...)`` and ``on_stop()``
    when ``proc_mesh.stop()`` is called (before it runs). Patches this one mesh object; a
    callback error is logged, never raised into the user's call."""

    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            logger.warning("forge_obs: mesh watcher failed: %r", e)

    orig_spawn, orig_stop = proc_mesh.spawn, proc_mesh.stop

    @functools.wraps(orig_spawn)
    def spawn(name: str, *args: Any, **kwargs: Any) -> Any:
        out = orig_spawn(name, *args, **kwargs)
        _quiet(on_spawn, name)
        return out

    @functools.wraps(orig_stop)
    def stop(*args: Any, **kwargs: Any) -> Any:
        _quiet(on_stop)
        return orig_stop(*args, **kwargs)

    try:
        proc_mesh.spawn = spawn
        proc_mesh.stop = stop
    except Exception as e:  # noqa: BLE001 - a mesh type that refuses attributes: unlabelled, stop() unseen
        logger.info("forge_obs: cannot watch proc mesh %r: %r", proc_mesh, e)


def receiver_with_timeout(receiver: Any, public_only: bool = False) -> Callable[[float | None], Any]:
    """``recv(timeout_s)`` on a Monarch ``PortReceiver``: the next message, or ``None`` after
    ``timeout_s`` (``None``: wait for one); raises once the port is closed.

    Waits on the receive task itself (no coroutine and private event loop per message) when
    Monarch has it; falls back to the public ``receiver.recv().get(timeout=...)``, keeping the
    pending receive across timeouts (a timed-out ``get`` does not consume it)."""
    base = getattr(receiver, "_receiver", None)
    process = getattr(receiver, "_process", None)
    if not public_only and base is not None and process is not None and hasattr(base, "recv_task"):

        def fast(timeout_s: float | None) -> Any:
            task = base.recv_task()
            if timeout_s is not None:
                task = task.with_timeout(timeout_s)
            try:
                return process(task.block_on())
            except TimeoutError:
                return None

        return fast
    pending: list = []

    def public(timeout_s: float | None) -> Any:
        if not pending:
            pending.append(receiver.recv())
        try:
            msg = pending[0].get(timeout=timeout_s)
        except TimeoutError:
            return None
        pending.clear()
        return msg

    return public
