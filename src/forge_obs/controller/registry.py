"""The proc meshes this process cuts at a flush: one locked registry per process.

    >>> from forge_obs.controller.registry import MeshRegistry
    >>> reg = MeshRegistry()
    >>> _ = reg.add("m1", "trainer", 2, fetchers=None)
    >>> reg.add_actor("m1", "Trainer")
    True
    >>> [(e.mesh_id, e.size, e.label_prefix) for e in reg.entries()]
    [('m1', 2, 'trainer/Trainer')]

In the controller process it holds the meshes spawned there (the top of the cut); in a mesh's
process it holds the meshes spawned *from* that process (meshes spawned inside actors), which
that process's fetcher cuts in turn. A stopped mesh stays one more cut as ``stopping``: the
flush after ``proc_mesh.stop()`` waits for the final states its fetchers hand over, so they land
in that step and not a later one. No Monarch import here: ``fetchers`` is an opaque handle.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from forge_obs.core.identity import rank_label

__all__ = ["MeshEntry", "MeshRegistry", "LOCAL_MESHES"]


@dataclass
class MeshEntry:
    """One proc mesh with a fetcher on each of its procs."""

    mesh_id: str
    name: str
    size: int
    fetchers: Any  # the LocalFetcherActor mesh (None in tests)
    actors: list[str] = field(default_factory=list)  # user actors spawned on the mesh
    stopping: bool = False  # stop() was called: the next cut expects its final states, then forgets it
    socket_ranks: frozenset = frozenset()  # the ranks its cuts go to on the inbox socket (the others: a cast)
    last_cut: Any = None  # the last cut sent to it: a rank moves to the socket only once that one closed

    @property
    def route(self) -> str:
        """How its cuts go: "monarch" (a cast of the endpoint), "socket" (the inbox socket), or
        "split" (``socket_ranks`` on the socket, the others by a cast)."""
        n = len(self.socket_ranks)
        return "monarch" if n == 0 else "socket" if n == self.size else "split"

    @property
    def actor_label(self) -> str:
        return "+".join(self.actors)

    @property
    def label_prefix(self) -> str:
        return f"{self.name}/{self.actor_label}" if self.actors else self.name

    def rank_keys(self) -> list[tuple[str, int]]:
        return [(self.mesh_id, r) for r in range(self.size)]

    def socket_keys(self) -> list[tuple[str, int]]:
        """The keys of the ranks that take its cuts on the inbox socket."""
        return [(self.mesh_id, r) for r in sorted(self.socket_ranks)]

    def cast_ranks(self) -> list[int]:
        """The ranks that take its cuts by a cast."""
        return [r for r in range(self.size) if r not in self.socket_ranks]

    def label(self, rank: int) -> str:
        return rank_label(self.name, self.actor_label, rank)


class MeshRegistry:
    """Thread-safe: Monarch runs each actor on its own thread, and spawn callbacks run on the
    spawning actor's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meshes: dict[str, MeshEntry] = {}

    def add(self, mesh_id: str, name: str, size: int, fetchers: Any) -> MeshEntry:
        entry = MeshEntry(mesh_id, name, int(size), fetchers)
        with self._lock:
            self._meshes[mesh_id] = entry
        return entry

    def add_actor(self, mesh_id: str, actor: str) -> bool:
        """Label a mesh's ranks with a user actor spawned on it; True if the label changed."""
        with self._lock:
            e = self._meshes.get(mesh_id)
            if e is None or actor in e.actors or actor.startswith("obs_"):
                return False
            e.actors.append(actor)
            return True

    def mark_stopping(self, mesh_id: str) -> None:
        with self._lock:
            e = self._meshes.get(mesh_id)
            if e is not None:
                e.stopping = True

    def remove(self, mesh_id: str) -> None:
        with self._lock:
            self._meshes.pop(mesh_id, None)

    def get(self, mesh_id: str) -> MeshEntry | None:
        with self._lock:
            return self._meshes.get(mesh_id)

    def entries(self) -> list[MeshEntry]:
        with self._lock:
            return list(self._meshes.values())

    def take_for_cut(self) -> tuple[list[MeshEntry], list[MeshEntry]]:
        """``(live, stopped)`` for one cut: live meshes are cast the cut; stopped ones are
        expected to hand over their final states instead, and are forgotten from now on."""
        if not self._meshes:  # a rank that spawned no mesh, at every cut; a mesh registered
            return [], []     # meanwhile is seen or not, as it would be under the lock
        with self._lock:
            live = [e for e in self._meshes.values() if not e.stopping]
            stopped = [e for e in self._meshes.values() if e.stopping]
            for e in stopped:
                del self._meshes[e.mesh_id]
        return live, stopped

    def live_names(self) -> set[str]:
        """The names of the meshes that were not stopped."""
        with self._lock:
            return {e.name for e in self._meshes.values() if not e.stopping}

    def __len__(self) -> int:
        with self._lock:
            return len(self._meshes)


#: this process's registry (the controller's top-level meshes, or a mesh process's children)
LOCAL_MESHES = MeshRegistry()
