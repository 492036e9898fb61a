"""A user's script: endpoint calls made under spans carry the caller's span to the callee.

``python linked_calls.py ROOT`` writes the run ``ROOT/calls`` and prints one JSON line per check.

- ``Echo`` / ``SyncEcho``: actors whose code uses nothing of forge_obs, on a mesh spawned before
  forge_obs attached to anything: they return what they received (positional, keyword, many
  arguments, an object of a class of this script), called under a span and outside any.
- ``Worker``: an async actor; two calls made concurrently under two different spans each open a
  span ``work_<tag>`` that must be linked to its own caller's span; ``SyncWorker``: a thread-based
  actor called under a span, then outside any.
- ``Gen``: two replicas; step 1 calls replica 0 under the step span while replica 1 runs a
  longer "generate" that nobody awaits (inference alone would pick replica 1).
"""

import asyncio
import json
import sys
import time

from monarch.actor import Actor, endpoint, this_host


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"

    def __eq__(self, other):
        return type(other).__name__ == "Point" and (self.x, self.y) == (other.x, other.y)


def _seen(args, kwargs):
    return {"type": type(args).__name__, "args": [repr(a) for a in args], "kwargs": {k: repr(v) for k, v in kwargs.items()},
            "points": [a == Point(1, 2) for a in args if type(a).__name__ == "Point"]}


class Echo(Actor):
    @endpoint
    async def echo(self, *args, **kwargs):
        return _seen(args, kwargs)

    @endpoint
    async def pair(self, a, b=0, *, c):
        return [a, b, c]


class SyncEcho(Actor):
    @endpoint
    def echo(self, *args, **kwargs):
        return _seen(args, kwargs)


class Worker(Actor):
    @endpoint
    async def work(self, tag: str, started: int, duration_s: float) -> str:
        from forge_obs.recording.timeline import record_span

        with record_span(f"work_{tag}"):
            await asyncio.sleep(duration_s)
        return tag

    @endpoint
    async def relay(self, leaf) -> None:
        from forge_obs.recording.timeline import record_span

        with record_span("relay"):  # a call made from a mesh process, under its span
            await leaf.work.call_one("nested_leaf")

    @endpoint
    async def plain(self) -> None:
        from forge_obs.recording.timeline import record_span

        with record_span("unlinked"):
            pass


class SyncWorker(Actor):
    @endpoint
    def work(self, name: str) -> None:
        from forge_obs.recording.timeline import record_span

        with record_span(name):
            pass


class Gen(Actor):
    @endpoint
    async def generate(self, delay_s: float, duration_s: float) -> int:
        from forge_obs.recording.timeline import record_span, set_step

        set_step(1)
        await asyncio.sleep(delay_s)
        with record_span("generate"):
            time.sleep(duration_s)
        return 0


async def main(root: str) -> None:
    plain_pm = this_host().spawn_procs(per_host={"procs": 1})  # before forge_obs attaches: no fetcher there
    echo, secho = plain_pm.spawn("echo", Echo), plain_pm.spawn("secho", SyncEcho)

    import provisioner_hooks
    from forge_obs import get_or_create_metric_logger
    from forge_obs.recording.timeline import record_span, set_step

    provisioner_hooks.install()
    ml = await get_or_create_metric_logger()
    await ml.init_backends.call_one({"run": {"root": root, "id": "calls"}, "jsonl": {},
                                     "timeline": {"flush_interval_s": 0.05}})
    many = tuple(range(300)) + ("s", None, 2.5, Point(1, 2), {"k": [1, 2]})
    kw = {f"k{i}": i for i in range(50)}
    outside = await echo.echo.call_one(*many, **kw)
    set_step(0)
    with record_span("ctl_echo"):
        inside = await echo.echo.call_one(*many, **kw)
        sync_inside = await secho.echo.call_one(*many, **kw)
        pair = await echo.pair.call_one(1, c=3)
    print(json.dumps({"check": "args", "same": inside == outside and sync_inside == outside,
                      "outside": outside, "pair": pair}))

    wpm = this_host().spawn_procs(per_host={"procs": 1}, name="workers")
    w = wpm.spawn("worker", Worker)
    sw = wpm.spawn("sync_worker", SyncWorker)
    gpm = this_host().spawn_procs(per_host={"procs": 2}, name="gen")
    gen = gpm.spawn("gen", Gen)

    async def caller(tag: str, duration_s: float) -> str:
        with record_span(f"wait_{tag}"):
            return await w.work.call_one(tag, 0, duration_s)

    with record_span("ctl_concurrent"):
        tags = await asyncio.gather(caller("a", 0.2), caller("b", 0.1))
    await w.plain.call_one()  # outside any span: its span is not linked
    with record_span("ctl_sync"):
        await sw.work.call_one("sync_linked")
    await sw.work.call_one("sync_unlinked")  # the same thread handles it: no link left over
    await w.relay.call_one(sw)
    print(json.dumps({"check": "concurrent", "tags": tags}))

    set_step(1)
    background = gen.slice(procs=1).generate.call_one(0.05, 0.3)  # outside any span: not linked
    with record_span("ctl_step"):
        await gen.slice(procs=0).generate.call_one(0.0, 0.1)
        time.sleep(0.4)  # the controller's own work, not in a span
    await background
    set_step(2)
    with record_span("ctl_step"):
        pass
    await ml.shutdown.call_one()
    await wpm.stop()
    await gpm.stop()
    await plain_pm.stop()
    provisioner_hooks.uninstall()
    print(json.dumps({"check": "done"}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
