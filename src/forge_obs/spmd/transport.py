"""How an SPMD rank's states reach the logger rank: a queue on the job's TCPStore.

Every rank opens a client connection of its own to the store torchrun (or ``torch.distributed``)
already runs (``MASTER_ADDR`` / ``MASTER_PORT``, or the default process group's store), under a
namespace of the job's run and restart. Ranks push their messages to one queue key; the logger
rank's receiver thread pops them, blocking. No collective and no process group: a dead rank only
stops pushing, and the logger rank's pipeline names it after one timeout. The training process
group is never touched.

    >>> import datetime
    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    >>> t = StoreTransport("127.0.0.1", server.port, "doc", timeout_s=5.0)
    >>> t.push(b"hello"); t.pop()
    b'hello'
    >>> t.close()
"""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["StoreTransport", "store_endpoint", "job_namespace", "STOP", "SYNC"]

#: what the logger rank pushes to its own queue to end its receiver thread
STOP = b"\x00forge_obs-stop"
#: what the logger rank pushes to its own queue to learn that every message queued before it was taken
SYNC = b"\x00forge_obs-sync"
#: how long one blocking pop waits before it is retried (a pop that times out is not an error)
POP_WAIT_S = 3600.0


def store_endpoint() -> tuple[str, int]:
    """(host, port) of the job's TCPStore: ``MASTER_ADDR`` / ``MASTER_PORT`` (torchrun, Slurm with
    ``env://``), else the store of the initialized default process group. Raises ValueError
    saying what to set when there is none."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and port.isdigit():
        return host, int(port)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            store: Any = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            if hasattr(store, "host") and hasattr(store, "port"):
                return str(store.host), int(store.port)
    except Exception:  # noqa: BLE001 - reported below
        pass
    raise ValueError("forge_obs.spmd: no TCPStore to reach the logger rank: run under torchrun, or set MASTER_ADDR and "
                     "MASTER_PORT (as torch.distributed's env:// does), or init the default process group with a TCPStore")


def job_namespace(session: int) -> str:
    """The store keys of one ``spmd.init`` session of this job (every rank computes the same one):
    torchrun's run id (or Slurm's job id) and restart count, and the session's number in the process."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "job"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"forge_obs/{run}/{restart}/{session}"


class StoreTransport:
    """A client connection of this rank's own to the job's TCPStore, under ``namespace``:
    ``push`` a message onto the logger rank's queue, ``pop`` one (the logger rank), and
    ``set`` / ``get`` a value every rank shares (the run's id and directory)."""

    def __init__(self, host: str, port: int, namespace: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.timeout_s = float(timeout_s)
        self._client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s),
                                     wait_for_workers=False)
        self._store = dist.PrefixStore(namespace, self._client)
        self._queue = "q"
        self._more = False  # the last pop found a message: the next one tries without blocking first

    def push(self, data: bytes) -> None:
        self._store.queue_push(self._queue, data)

    def pop(self) -> bytes:
        """The next message (blocks until there is one; retried past the store's timeout). While
        messages are queued it takes them without the blocking wait (one round trip, not two)."""
        if self._more:
            try:
                return bytes(self._store.queue_pop(self._queue, False))
            except Exception as e:  # noqa: BLE001 - QueueEmptyError: wait below
                if type(e).__name__ != "QueueEmptyError":
                    raise
                self._more = False
        while True:
            try:
                data = bytes(self._store.queue_pop(self._queue, True))
            except Exception as e:  # noqa: BLE001 - the store's wait timed out: wait again
                if "timeout" not in str(e).lower():
                    raise
                continue
            self._more = True
            return data

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it at most the transport's timeout (then raises)."""
        return bytes(self._store.get(key))

    def close(self) -> None:
        self._store = None
        self._client = None
