"""The GRPO app's fault flags (apps/grpo/faults.py) without starting a run: each flag reaches the
actor it is meant for, and a replica's death reaches the generator service. The end-to-end
effects (findings, alerts) are in tests/apps/test_grpo.py."""

from __future__ import annotations

import argparse
import asyncio
import doctest

from apps.grpo import faults
from apps.grpo.faults import ReplicaFaults, SupervisionHook, TrainerFaults
from apps.grpo.service import GeneratorService


def parse(*argv: str, replicas: int = 3) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    faults.add_fault_flags(ap)
    args = ap.parse_args(list(argv))
    args.replicas = replicas
    return args


def test_doctests():
    assert doctest.testmod(faults).failed == 0


def test_death_and_stall_hit_the_last_replica_slow_sync_every_one():
    per = ReplicaFaults.per_replica(parse("--fault-kill-replica", "3", "--fault-stall-replica", "5",
                                          "--fault-slow-weight-sync", "0.5"))
    assert [(f.kill_at, f.stall_at, f.slow_sync_s) for f in per] == [(None, None, 0.5), (None, None, 0.5), (3, 5, 0.5)]
    assert ReplicaFaults.per_replica(parse()) == [ReplicaFaults()] * 3


def test_trainer_flags_reach_the_trainer():
    f = TrainerFaults.from_args(parse("--fault-slow-trainer-rank", "1", "--fault-slow-trainer-s", "0.3",
                                      "--fault-slow-trainer-from", "3", "--fault-nan-loss", "6"))
    assert [f.slow_s_for(r, s) for r in (0, 1) for s in (2, 3, 9)] == [0.0, 0.0, 0.0, 0.0, 0.3, 0.3]
    assert [s for s in range(10) if f.nan_at(s)] == [6]
    none = TrainerFaults.from_args(parse())
    assert none.slow_s_for(0, 0) == 0.0 and not any(none.nan_at(s) for s in range(10))


def test_replica_may_die_is_read_from_the_command_line():
    assert faults.replica_may_die(["--steps", "6", "--fault-kill-replica", "3"])
    assert faults.replica_may_die(["--fault-stall-replica=4"])
    assert not faults.replica_may_die(["--fault-nan-loss", "3", "--steps", "6"])


class _Failure:
    def __init__(self, mesh_name: str) -> None:
        self.mesh_name = mesh_name

    def __str__(self) -> str:
        return f"actor mesh {self.mesh_name} failed\ntraceback..."


def test_a_replica_death_takes_it_out_of_rotation_other_failures_are_printed(capsys):
    async def run() -> list[int]:
        hook = SupervisionHook(asyncio.get_running_loop(), replicas=2)
        hook(_Failure("replica1-abc"))  # before the service exists: printed
        hook.service = GeneratorService([object(), object()])
        hook(_Failure("replica1-abc"))
        hook(_Failure("trainer-def"))
        hook(_Failure("obs_fetcher-1"))  # forge_obs's own meshes: not printed
        await hook.service.dead[1].wait()  # handed to the loop (call_soon_threadsafe), then taken out
        return hook.service.alive()

    assert asyncio.run(run()) == [0]
    out = capsys.readouterr().out.splitlines()
    # failures print at once; the service hears of a death on its loop, after
    assert out == ["[grpo] actor failure: actor mesh replica1-abc failed",
                   "[grpo] actor failure: actor mesh trainer-def failed",
                   "[grpo] generator replica 1 died (process exited): taken out of rotation (1 left)"], out
