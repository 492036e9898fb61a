"""Programs for tests/controller/test_cut.py, each run in a fresh process (a cold start):

    python -m tests.support.cut_programs multi_mesh <run_root> <steps>
    python -m tests.support.cut_programs chain <run_root> <steps>
    python -m tests.support.cut_programs attach_then_spawn <run_root>

Each prints one JSON line: what was recorded per step, for the test to compare with the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

os.environ.setdefault("MONARCH_FILE_LOG", "error")

import monarch.actor  # noqa: E402
from monarch.actor import Actor, current_rank, endpoint, this_host  # noqa: E402

import provisioner_hooks  # noqa: E402
from forge_obs import Reduce, get_or_create_metric_logger, record_metric  # noqa: E402

monarch.actor.unhandled_fault_hook = lambda failure: None


class Worker(Actor):
    @endpoint
    async def work(self, step: int) -> None:
        record_metric("cut/sum", 10, Reduce.SUM)
        record_metric("cut/max", step * 100 + current_rank().rank, Reduce.MAX)
        record_metric("cut/raw", float(step), Reduce.MEAN)


class Relay(Actor):
    """Spawns a mesh of its own and calls into it: controller -> Relay -> Leaf."""

    @endpoint
    async def setup(self) -> None:
        self.pm = this_host().spawn_procs(per_host={"procs": 2}, name="leafmesh")
        self.leaf = self.pm.spawn("Leaf", Leaf)

    @endpoint
    async def relay(self, step: int) -> None:
        record_metric("chain/relay", 1, Reduce.SUM)
        await self.leaf.leaf.call(step)

    @endpoint
    async def stop_leaves(self) -> None:
        await self.pm.stop()


class Leaf(Actor):
    @endpoint
    async def leaf(self, step: int) -> None:
        record_metric("chain/leaf", 1, Reduce.SUM)
        record_metric("chain/step", step, Reduce.MAX)


async def _logger(root: str, config: dict | None = None):
    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"run": {"root": root, "id": "cut"}, **(config or {})})
    return mlogger


async def multi_mesh(root: str, steps: int) -> dict:
    """2 meshes x 2 procs, each rank records per step; the README loop: await, then flush."""
    mlogger = await _logger(root, {"jsonl": {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]}})
    meshes = [this_host().spawn_procs(per_host={"procs": 2}, name=f"m{i}") for i in range(2)]
    workers = [m.spawn("Worker", Worker) for m in meshes]
    for step in range(steps):
        await asyncio.gather(*(w.work.call(step) for w in workers))
        await mlogger.flush.call_one(step)
    await mlogger.shutdown.call_one()
    for m in meshes:
        await m.stop()
    return {"ranks": 4}


async def chain(root: str, steps: int) -> dict:
    mlogger = await _logger(root)
    pm = this_host().spawn_procs(per_host={"procs": 1}, name="relaymesh")
    relay = pm.spawn("Relay", Relay)
    await relay.setup.call_one()
    for step in range(steps):
        await relay.relay.call_one(step)
        await mlogger.flush.call_one(step)
    await relay.stop_leaves.call_one()
    await mlogger.shutdown.call_one()
    await pm.stop()
    return {}


async def attach_then_spawn(root: str) -> dict:
    """torchforge's provisioner: attach by hand, then spawn on the mesh at once."""
    provisioner_hooks.uninstall()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    await mlogger.init_backends.call_one({"run": {"root": root, "id": "cut"}})
    pm = this_host().spawn_procs(per_host={"procs": 2}, name="manual")
    await get_or_create_metric_logger(proc_mesh=pm)
    w = pm.spawn("Worker", Worker)
    await w.work.call(0)
    await mlogger.flush.call_one(0)
    await mlogger.shutdown.call_one()
    await pm.stop()
    return {}


def main() -> None:
    prog, root = sys.argv[1], sys.argv[2]
    args = [int(a) for a in sys.argv[3:]]
    out = asyncio.run(globals()[prog](root, *args))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
