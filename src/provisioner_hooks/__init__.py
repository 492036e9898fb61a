"""Attach forge_obs to every Monarch proc mesh, automatically.

    import provisioner_hooks
    provisioner_hooks.install()          # once, in the controller, before spawning meshes
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="trainer")   # gets a fetcher

After ``install()``, every proc mesh spawned in this process, and in child processes spawned
afterwards (meshes spawned from inside actors), gets a ``LocalFetcherActor`` registered with the
experiment's ``GlobalLoggingActor``; the fetcher deregisters itself when the mesh stops, handing
over what was recorded since the last flush. ``install()`` is idempotent; ``uninstall()`` undoes it.
"""

from __future__ import annotations

import logging
from typing import Any

from forge_obs.controller import monarch_internals as _monarch_spawn

logger = logging.getLogger("forge_obs")

__all__ = ["install", "uninstall", "is_installed"]

_installed = False


def _on_spawn(proc_mesh: Any, mesh_name: str | None) -> None:
    from forge_obs.controller.client import attach_fetcher, spawn_handles_blocking

    attach_fetcher(proc_mesh, spawn_handles_blocking(), mesh_name)


class _ChildInstall:
    """Runs in each new child process before any actor is built: the logger's handles, the
    current options (so that raw streaming and the timeline are on from the first value), and
    the hook itself, so that meshes spawned from inside actors are observed too."""

    def __init__(self, handles: Any, options: dict[str, Any]) -> None:
        self.handles = handles
        self.options = options

    def __call__(self) -> None:
        from forge_obs.controller.fetcher import apply_options, expect_fetcher
        from forge_obs.controller.client import cached_handles, set_cached_handles

        if cached_handles() is None and self.handles is not None:
            set_cached_handles(self.handles)
        expect_fetcher()  # the spawn callback attaches one to this process's mesh
        apply_options(self.options, timeline=False)  # the fetcher starts the timeline
        install()


def _make_child_install() -> Any:
    if not _installed:
        return None
    try:
        from forge_obs.controller.client import spawn_handles_blocking
        from forge_obs.controller.fetcher import current_options

        return _ChildInstall(spawn_handles_blocking(), current_options())
    except Exception as e:  # noqa: BLE001
        logger.warning("forge_obs: child processes will not be observed: %r", e)
        return None


def install() -> str:
    """Start attaching fetchers to new proc meshes. Idempotent. Returns the mechanism used."""
    global _installed
    how = _monarch_spawn.install(_on_spawn)
    _monarch_spawn.register_child_startup(_make_child_install)
    _installed = True
    return how


def uninstall() -> None:
    """Stop attaching fetchers to new meshes (meshes already attached keep theirs)."""
    global _installed
    _monarch_spawn.unregister_child_startup(_make_child_install)
    _monarch_spawn.uninstall()
    _installed = False


def is_installed() -> bool:
    return _installed


