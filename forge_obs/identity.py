"""Who recorded a value: host, pid, mesh, actor and rank of the current process.

    >>> from forge_obs.identity import current_identity
    >>> ident = current_identity()
    >>> ident.mesh, ident.rank
    ('controller', 0)

The fetcher actor sets the identity of a mesh process when it starts (``set_identity``); the
controller process keeps the default. No Monarch import here.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any


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
        return rank_label(self.mesh, self.actor, self.rank)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        return d


def rank_label(mesh: str, actor: str | None, rank: int) -> str:
    """The one way a rank is labelled everywhere: ``mesh/Actor/rN`` (``mesh/rN`` without actor).

        >>> rank_label("trainer", "Trainer", 1), rank_label("buffer", "", 0)
        ('trainer/Trainer/r1', 'buffer/r0')
    """
    return f"{mesh}/{actor}/r{rank}" if actor else f"{mesh}/r{rank}"


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
