"""Injected faults: the ``--fault-*`` flags, and what each one does where it happens.

    >>> from apps.grpo.faults import TrainerFaults
    >>> f = TrainerFaults(slow_rank=1, slow_s=0.3, slow_from=3, nan_step=6)
    >>> f.slow_s_for(rank=1, step=2), f.slow_s_for(rank=1, step=3), f.slow_s_for(rank=0, step=3)
    (0.0, 0.3, 0.0)
    >>> f.nan_at(6), f.nan_at(7)
    (True, False)
    >>> f.nan_loss_if_due(1.5, step=6), f.nan_loss_if_due(1.5, step=7)
    (nan, 1.5)
    >>> b = BufferFaults(slow_s=0.4, slow_from=3)
    >>> b.slow_s_for(version=2), b.slow_s_for(version=3)
    (0.0, 0.4)

Each fault is reported by ``forge-obs doctor`` after the run and by a live alert while it runs
(docs/grpo.md, "Faults"). The actors receive their part as a dataclass (picklable), the
controller routes a replica's death (Monarch supervision) to the generator service.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from forge_obs.timeline import record_event

#: exit status of a replica process killed by ``--fault-kill-replica``
KILLED_EXIT_STATUS = 17


def add_fault_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group(
        "faults", "each one injects a fault that `forge-obs doctor` reports after the run and the live alerts "
        "report while it runs (see docs/grpo.md)")
    g.add_argument("--fault-slow-trainer-rank", type=int, default=None, metavar="RANK",
                   help="trainer rank RANK sleeps --fault-slow-trainer-s longer in every forward/backward "
                        "(from step --fault-slow-trainer-from): a straggler the other ranks wait for in the "
                        "gradient all-reduce; found from 2 ranks up")
    g.add_argument("--fault-slow-trainer-s", type=float, default=0.5, metavar="SECONDS",
                   help="how much longer the slow rank's forward/backward takes (default 0.5)")
    g.add_argument("--fault-slow-trainer-from", type=int, default=0, metavar="STEP",
                   help="first step the slow rank is slow (default 0: from the start)")
    g.add_argument("--fault-kill-replica", type=int, default=None, metavar="STEP",
                   help="the last generator replica's process dies when the policy reaches STEP: it stops "
                        "answering flushes (missing rank) and the service reroutes to the others")
    g.add_argument("--fault-stall-replica", type=int, default=None, metavar="STEP",
                   help="the last replica stops answering from policy version STEP on (its span never ends: "
                        "a hang); it is timed out and taken out of rotation")
    g.add_argument("--fault-nan-loss", type=int, default=None, metavar="STEP",
                   help="the loss is NaN at STEP on every trainer rank (the update is skipped)")
    g.add_argument("--fault-slow-weight-sync", type=float, default=None, metavar="SECONDS",
                   help="every weight load on the replicas takes SECONDS longer: the replicas spend most of "
                        "their time moving weights (sync bottleneck)")
    g.add_argument("--fault-slow-buffer", type=float, default=None, metavar="SECONDS",
                   help="the replay buffer's every sample takes SECONDS longer (from step --fault-slow-buffer-from): "
                        "the trainer waits for its batch on the buffer (on the critical path of every step)")
    g.add_argument("--fault-slow-buffer-from", type=int, default=0, metavar="STEP",
                   help="first step the buffer is slow (default 0: from the start)")


def replica_may_die(argv: list[str]) -> bool:
    """Whether the command line injects a replica death or stall (read before Monarch starts)."""
    return any(a.startswith(("--fault-kill", "--fault-stall")) for a in argv)


@dataclass(frozen=True)
class TrainerFaults:
    """What the trainer ranks inject: a slow rank (``--fault-slow-trainer-*``), a NaN loss."""

    slow_rank: int | None = None
    slow_s: float = 0.5
    slow_from: int = 0
    nan_step: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainerFaults:
        return cls(args.fault_slow_trainer_rank, args.fault_slow_trainer_s, args.fault_slow_trainer_from,
                   args.fault_nan_loss)

    def slow_s_for(self, rank: int, step: int) -> float:
        """Extra seconds rank ``rank`` spends in its forward/backward at ``step``."""
        return self.slow_s if self.slow_rank == rank and step >= self.slow_from else 0.0

    def nan_at(self, step: int) -> bool:
        return self.nan_step == step

    def sleep_if_slow(self, rank: int, step: int) -> None:
        """Blocks rank ``rank`` for :meth:`slow_s_for` seconds at ``step``, as slow compute would."""
        slow_s = self.slow_s_for(rank, step)
        if slow_s:
            time.sleep(slow_s)

    def nan_loss_if_due(self, loss, step: int):
        """``loss`` times NaN at ``nan_step`` (the trainer then skips the update), else ``loss``."""
        return loss * float("nan") if self.nan_at(step) else loss


@dataclass(frozen=True)
class ReplicaFaults:
    """What one generator replica injects: death, a stall, a slow weight load."""

    kill_at: int | None = None
    stall_at: int | None = None
    slow_sync_s: float = 0.0

    @classmethod
    def per_replica(cls, args: argparse.Namespace) -> list[ReplicaFaults]:
        """One per replica: death and stall hit the last replica, a slow sync every one."""
        slow = float(args.fault_slow_weight_sync or 0.0)
        out = [cls(slow_sync_s=slow) for _ in range(args.replicas)]
        out[-1] = cls(args.fault_kill_replica, args.fault_stall_replica, slow)
        return out

    def kill_if_due(self, replica: int, latest_version: int) -> None:
        """The process exits (no clean-up, as a crash) once the policy reaches ``kill_at``."""
        if self.kill_at is not None and latest_version >= self.kill_at:
            record_event("replica_killed", replica=replica, version=latest_version)
            os._exit(KILLED_EXIT_STATUS)

    async def stall_if_due(self, version: int) -> None:
        """Never returns (for the length of any run) once ``version`` reaches ``stall_at``."""
        if self.stall_at is not None and version >= self.stall_at:
            await asyncio.sleep(3600)

    async def slow_sync(self) -> None:
        if self.slow_sync_s:
            await asyncio.sleep(self.slow_sync_s)


@dataclass(frozen=True)
class BufferFaults:
    """What the replay buffer injects: a slow sample (``--fault-slow-buffer``)."""

    slow_s: float = 0.0
    slow_from: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BufferFaults:
        return cls(float(args.fault_slow_buffer or 0.0), args.fault_slow_buffer_from)

    def slow_s_for(self, version: int) -> float:
        """Extra seconds a sample takes when the trainer is at policy ``version`` (its step)."""
        return self.slow_s if version >= self.slow_from else 0.0

    def sleep_if_slow(self, version: int) -> None:
        """Blocks the buffer for :meth:`slow_s_for` seconds, as a slow sample would."""
        slow_s = self.slow_s_for(version)
        if slow_s:
            time.sleep(slow_s)


class SupervisionHook:
    """Monarch's ``unhandled_fault_hook``: a generator replica's death goes to the service (which
    goes on with the others); any other actor's failure is printed. Installed before the meshes
    are spawned; a death before the service exists is printed like any other failure.

    Monarch calls it on one of its own threads: the service is told on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, replicas: int) -> None:
        self.loop = loop
        self.replicas = replicas
        self.service: Any = None  # set once the GeneratorService exists

    def __call__(self, failure: Any) -> None:
        name = str(getattr(failure, "mesh_name", ""))
        for i in range(self.replicas):
            if name.startswith(f"replica{i}-") and self.service is not None:
                self.loop.call_soon_threadsafe(self.service.on_replica_died, i)
                return
        if not name.startswith(("obs_", "logger-", "setup-")):  # forge_obs's own meshes report themselves
            print(f"[grpo] actor failure: {str(failure).splitlines()[0]}", flush=True)
