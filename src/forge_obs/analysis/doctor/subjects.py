"""Who a finding or an alert is about: mesh / actor / rank, and the replica where the mesh is one
of several replicas (``generator_0``, ``generator_1``, ...). Learnt from every source of identity
a run has (timeline headers, the ``source`` of per-rank metric rows, a step's ``sources``), so a
label that lacks a part (``generator_1/r0``: a rank that never reported) is completed from the
others.

    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> ids = Identities()
    >>> ids.learn({"mesh": "generator_0", "actor": "Generator", "rank": 0})
    >>> ids.learn({"mesh": "generator_1", "actor": "Generator", "rank": 0})
    >>> ids.of_label("generator_1/r0")
    {'mesh': 'generator_1', 'actor': 'Generator', 'rank': 0, 'replica': 1, 'where': 'generator_1/Generator/r0'}
"""

from __future__ import annotations

import re
from typing import Any

from forge_obs.core.identity import DEFAULT_MESH_NAME, split_label

__all__ = ["GLOBAL", "label_of", "describe", "Identities", "parse_label", "replica_family"]

_REPLICA = re.compile(r"^(.*?)[_-](\d+)$")

GLOBAL = {"mesh": "global", "actor": None, "rank": None, "replica": None, "where": "global"}


def label_of(mesh: str, actor: str | None, rank: int | None) -> str:
    parts = [mesh]
    if actor:
        parts.append(actor)
    if rank is not None:
        parts.append(f"r{rank}")
    return "/".join(parts)


def describe(where: dict) -> str:
    """``where`` plus the replica, for text: ``generator_1/Generator/r0 (replica 1)``."""
    w = where.get("where") or "-"
    if where.get("replica") is not None:
        w += f" (replica {where['replica']})"
    return w


class Identities:
    """(mesh, rank) -> actor and host/pid; mesh -> replica index (when replicated)."""

    def __init__(self) -> None:
        self.actors: dict[str, str] = {}  # mesh -> actor (the ranks of a mesh run the same actors)
        self.rank_actor: dict[tuple, str] = {}
        self.hosts: dict[tuple, tuple] = {}
        self.bases: dict[str, set] = {}  # "generator" -> {"generator", "generator_1"}
        self._labels: dict[str, dict] = {}

    def learn(self, src: dict[str, Any]) -> None:
        mesh = src.get("mesh")
        if not mesh:
            return
        mesh = str(mesh)
        actor = src.get("actor") or ""
        rank = src.get("rank")
        if actor:
            if mesh not in self.actors:
                self.actors[mesh] = actor
                self._labels.clear()
            if rank is not None and self.rank_actor.get((mesh, int(rank))) != actor:
                self.rank_actor[(mesh, int(rank))] = actor
                self._labels.clear()
        if rank is not None and src.get("pid"):
            self.hosts[(mesh, int(rank))] = (src.get("host"), src.get("pid"))
        s = self.bases.setdefault(_split(mesh)[0], set())
        if mesh not in s:
            s.add(mesh)
            self._labels.clear()

    def replica(self, mesh: str) -> int | None:
        """The replica index of ``mesh``: ``generator_0``, ``generator_1``, ... as a user names
        replicas; ``generator`` (0), ``generator_1`` (1), ... as forge_obs names meshes spawned
        with one name, when they run the same actor. Meshes spawned without a name (``mesh``,
        ``mesh_1``) are replicas only when they run the same actor."""
        base, index = _split(mesh or "")
        family = self.bases.get(base, set())
        numbered = [m for m in family if m != base]
        same = [m for m in family if self.actors.get(m) == self.actors.get(mesh)]
        if base == DEFAULT_MESH_NAME or mesh == base:
            return index if len(same) >= 2 else None
        return index if len(numbered) >= 2 or len(same) >= 2 else None

    def of(self, mesh: str, rank: int | None, actor: str | None = None) -> dict:
        if not actor:
            actor = self.rank_actor.get((mesh, rank)) if rank is not None else None
            actor = actor or self.actors.get(mesh) or None
        return {"mesh": mesh, "actor": actor, "rank": rank, "replica": self.replica(mesh),
                "where": label_of(mesh, actor, rank)}

    def of_source(self, src: dict) -> dict:
        mesh = str(src.get("mesh") or parse_label(src.get("label", "?"))[0])
        rank = src.get("rank")
        return self.of(mesh, None if rank is None else int(rank), src.get("actor") or None)

    def of_label(self, label: str) -> dict:
        w = self._labels.get(label)
        if w is None:
            mesh, actor, rank = parse_label(label)
            w = self._labels[label] = self.of(mesh, rank, actor)
        return dict(w)


def replica_family(mesh: str) -> str:
    """``generator_1`` -> ``generator``: the mesh name its replicas share."""
    return _split(mesh)[0]


def _split(mesh: str) -> tuple[str, int]:
    """``generator_1`` -> ("generator", 1); a name without a numeric suffix is replica 0."""
    m = _REPLICA.match(mesh)
    return (m.group(1), int(m.group(2))) if m else (mesh, 0)


def parse_label(label: str) -> tuple[str, str | None, int | None]:
    """``mesh/actor/r3`` / ``mesh/r3`` / ``Controller`` -> (mesh, actor or None, rank or None); a
    label's parallel coordinates (``trainer/r3[pp=0]``) are not part of them."""
    parts = split_label(label)[0].split("/")
    rank = None
    if len(parts) > 1 and parts[-1][:1] == "r" and parts[-1][1:].isdigit():
        rank = int(parts[-1][1:])
        parts = parts[:-1]
    mesh = parts[0]
    actor = "/".join(parts[1:]) or None
    if rank is None and len(parts) == 1:
        rank = 0  # a process label (the controller)
    return mesh, actor, rank
