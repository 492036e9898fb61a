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
        mid = f"/{self.actor}" if self.actor else ""
        return f"{self.mesh}{mid}/r{self.rank}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        return d


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
