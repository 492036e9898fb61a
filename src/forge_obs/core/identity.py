"""Who recorded a value: host, pid, mesh, actor and rank of the current process.

    >>> from forge_obs.core.identity import current_identity
    >>> ident = current_identity()
    >>> ident.mesh, ident.rank
    ('controller', 0)

The fetcher actor sets the identity of a mesh process when it starts (``set_identity``); the
controller process keeps the default. No Monarch import here.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

__all__ = ["ProcessIdentity", "rank_label", "PARALLEL_DIMS", "parallel_coords", "coords_suffix", "split_label", "unique_mesh_name", "start_naming_run", "release_mesh_name", "mesh_selected", "current_identity", "set_identity", "DEFAULT_MESH_NAME"]


@dataclass
class ProcessIdentity:
    host: str
    pid: int
    mesh: str = "controller"
    actor: str = ""
    rank: int = 0
    coords: dict[str, int] = field(default_factory=dict)
    world_size: int = 1

    @property
    def label(self) -> str:
        """A short, stable rank label, e.g. ``trainer/TrainActor/r3`` (or ``trainer/r3``)."""
        return rank_label(self.mesh, self.actor, self.rank, self.coords)

    def to_dict(self) -> dict[str, Any]:
        """Every field (``coords`` copied) and the label: what travels with a rank's states."""
        d = {f: getattr(self, f) for f in _FIELDS}
        d["coords"] = dict(self.coords)
        d["label"] = self.label
        return d


_FIELDS = tuple(f.name for f in fields(ProcessIdentity))

#: the parallel dimensions of an SPMD trainer a rank's label carries (TorchTitan's names), in
#: the order they are written
PARALLEL_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def parallel_coords(coords: "dict[str, Any] | None") -> dict[str, int]:
    """The parallel dimensions (:data:`PARALLEL_DIMS`) among ``coords``, in their order; other
    coordinates (a Monarch mesh's ``hosts`` / ``procs``) are not part of a label.

        >>> parallel_coords({"tp": 1, "procs": 3, "pp": 0})
        {'pp': 0, 'tp': 1}
    """
    if not coords:
        return {}
    return {d: int(coords[d]) for d in PARALLEL_DIMS if d in coords}


def rank_label(mesh: str, actor: str | None, rank: int, coords: "dict[str, Any] | None" = None) -> str:
    """The one way a rank is labelled everywhere: ``mesh/Actor/rN`` (``mesh/rN`` without actor),
    followed by the rank's coordinates in the parallel dimensions when it has any
    (``trainer/r5[pp=1,dp_shard=0,tp=1]``).

        >>> rank_label("trainer", "Trainer", 1), rank_label("buffer", "", 0)
        ('trainer/Trainer/r1', 'buffer/r0')
        >>> rank_label("trainer", "", 5, {"tp": 1, "pp": 1, "dp_shard": 0})
        'trainer/r5[pp=1,dp_shard=0,tp=1]'
    """
    base = f"{mesh}/{actor}/r{rank}" if actor else f"{mesh}/r{rank}"
    return base + coords_suffix(coords)


def coords_suffix(coords: "dict[str, Any] | None") -> str:
    """``[pp=1,tp=0]`` for a rank's parallel coordinates; ``""`` when it has none.

        >>> coords_suffix({"tp": 0, "pp": 1, "procs": 3}), coords_suffix({"procs": 3})
        ('[pp=1,tp=0]', '')
    """
    dims = parallel_coords(coords)
    return "[" + ",".join(f"{d}={v}" for d, v in dims.items()) + "]" if dims else ""


def split_label(label: str) -> tuple[str, dict[str, int]]:
    """A label without its parallel coordinates, and those coordinates (inverse of the suffix
    :func:`rank_label` writes).

        >>> split_label("trainer/r5[pp=1,tp=0]")
        ('trainer/r5', {'pp': 1, 'tp': 0})
        >>> split_label("buffer/r0")
        ('buffer/r0', {})
    """
    s = str(label)
    if not s.endswith("]") or "[" not in s:
        return s, {}
    base, _, inner = s[:-1].rpartition("[")
    dims: dict[str, int] = {}
    for part in inner.split(","):
        k, eq, v = part.partition("=")
        if not eq or k not in PARALLEL_DIMS or not v.lstrip("-").isdigit():
            return s, {}
        dims[k] = int(v)
    return base, dims


#: the name of a mesh spawned without one
DEFAULT_MESH_NAME = "mesh"


class _MeshNames:
    """The mesh names this process has given out; a name is never given out twice."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[str] = set()
        self._next: dict[str, int] = {}

    def allocate(self, base: str) -> str:
        with self._lock:
            name, n = base, self._next.get(base, 0)
            while name in self._taken:
                n += 1
                name = f"{base}_{n}"
            self._next[base] = n
            self._taken.add(name)
            return name


    def release(self, name: str) -> None:
        with self._lock:
            self._taken.discard(name)

    def release_all_but(self, keep: set[str]) -> None:
        with self._lock:
            self._taken &= keep
            self._next = {}


_MESH_NAMES = _MeshNames()


def mesh_selected(mesh: str, names: "Iterable[str]") -> bool:
    """Whether ``mesh`` is one of ``names`` or a replica forge_obs numbered after one of them
    (``generator_1`` for ``generator``): a filter by mesh name keeps every replica.

        >>> [mesh_selected(m, ["gen"]) for m in ("gen", "gen_2", "gen_x", "trainer")]
        [True, True, False, False]
    """
    if mesh in names:
        return True
    base, _, n = str(mesh).rpartition("_")
    return bool(base) and n.isdigit() and base in names


def release_mesh_name(name: str) -> None:
    """A mesh stopped while no run is logging: its name may be given out again."""
    _MESH_NAMES.release(name)


def start_naming_run(live: set[str]) -> None:
    """A new run starts in this process: names of meshes that are gone may be given out again
    (a label is unique within a run); ``live`` keeps its names."""
    _MESH_NAMES.release_all_but(live)


def unique_mesh_name(requested: str | None, scope: str = "") -> str:
    """The name under which a new proc mesh's ranks are labelled: unique in the experiment.

    The first mesh spawned from a process with a given name keeps it; the next ones with the same
    name (replicas of one service, a mesh spawned again after a stop) get ``_1``, ``_2``, ...; a
    mesh spawned without a name is ``mesh``. ``scope`` is the spawning process's own label when
    that is not the controller (a mesh spawned inside an actor), so that two processes never give
    out the same name. ``/`` would split a rank label, so it becomes ``_``.

        >>> [unique_mesh_name(n) for n in ("gen", "gen", None, "gen")]
        ['gen', 'gen_1', 'mesh', 'gen_2']
        >>> unique_mesh_name("gen", scope="svc.r0")
        'svc.r0.gen'
    """
    base = str(requested).replace("/", "_") if requested else DEFAULT_MESH_NAME
    return _MESH_NAMES.allocate(f"{scope}.{base}" if scope else base)


_identity: ProcessIdentity | None = None


def current_identity() -> ProcessIdentity:
    global _identity
    if _identity is None or _identity.pid != os.getpid():
        _identity = ProcessIdentity(host=socket.gethostname(), pid=os.getpid())
    return _identity


def set_identity(**fields: Any) -> ProcessIdentity:
    ident = current_identity()
    for k, v in fields.items():
        setattr(ident, k, v)
    return ident
