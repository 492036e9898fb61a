"""The run's actors, each on its own proc mesh: spawned and ready at the start, stopped at the end."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

from monarch.actor import this_host

from apps.grpo.buffer import ReplayBuffer
from apps.grpo.faults import BufferFaults, ReplicaFaults, TrainerFaults
from apps.grpo.generator import TorchGenerator, VLLMGenerator
from apps.grpo.reference import ReferenceModel
from apps.grpo.reward import RewardActor
from apps.grpo.trainer import Trainer
from forge_obs.timeline import record_span


@dataclass
class Actors:
    """The actor meshes of a run, each on its own proc mesh (``meshes``)."""

    meshes: list
    replicas: list
    trainer: object
    reference: object
    reward: object
    buffer: object
    weights_dir: str  # where the trainer writes each policy version for the replicas to load


def pick_generator(kind: str) -> tuple[str, type]:
    """The generator kind (``auto``: vllm when importable, else torch) and its actor class."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401

            kind = "vllm"
        except Exception:  # noqa: BLE001
            kind = "torch"
    return kind, (VLLMGenerator if kind == "vllm" else TorchGenerator)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def spawn_actors(args: argparse.Namespace, generator_cls: type, model_dir: str) -> Actors:
    """Spawn every proc mesh and actor; the trainer ranks join their gloo group and each replica
    answers a first request before this returns."""
    weights_dir = tempfile.mkdtemp(prefix="grpo_weights_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    host = this_host()
    gen_procs = [host.spawn_procs(per_host={"procs": 1}, name=f"generator_{i}") for i in range(args.replicas)]
    trainer_procs = host.spawn_procs(per_host={"procs": args.trainer_ranks}, name="trainer")
    ref_procs = host.spawn_procs(per_host={"procs": 1}, name="reference")
    reward_procs = host.spawn_procs(per_host={"procs": 1}, name="reward")
    buffer_procs = host.spawn_procs(per_host={"procs": 1}, name="buffer")
    replica_faults = ReplicaFaults.per_replica(args)
    actors = Actors(
        meshes=[*gen_procs, trainer_procs, ref_procs, reward_procs, buffer_procs],
        replicas=[pm.spawn(f"replica{i}", generator_cls, model_dir, i, args.seed, args.kv_cache_mb, replica_faults[i])
                  for i, pm in enumerate(gen_procs)],
        trainer=trainer_procs.spawn("trainer", Trainer, model_dir, args.trainer_ranks, free_port(), args.lr,
                                    args.kl_beta, weights_dir, TrainerFaults.from_args(args)),
        reference=ref_procs.spawn("reference", ReferenceModel, model_dir),
        reward=reward_procs.spawn("reward", RewardActor),
        buffer=buffer_procs.spawn("buffer", ReplayBuffer, args.seed, 4096, BufferFaults.from_args(args)),
        weights_dir=weights_dir,
    )
    with record_span("startup"):
        await actors.trainer.setup.call()
        await asyncio.gather(*(r.generate.call_one("warmup", ["1+1="], 1, 1, 1.0, 0) for r in actors.replicas))
    return actors


async def stop_actors(actors: Actors) -> None:
    """Every mesh stops (a dead or stalled replica's mesh within 15 s); the weight files go."""
    for pm in actors.meshes:
        try:
            await asyncio.wait_for(pm.stop(), 15)
        except Exception:  # noqa: BLE001 - a killed or stalled replica's mesh
            pass
    shutil.rmtree(actors.weights_dir, ignore_errors=True)
