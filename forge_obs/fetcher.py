"""The process side of a flush: :class:`LocalFetcherActor`, one per proc of every observed mesh.

    procs = this_host().spawn_procs(per_host={"procs": 2}, name="trainer")
    # provisioner_hooks spawns LocalFetcherActor("obs_fetcher") on procs; nothing else to do

At each flush the controller casts ``cut(seq, step)`` to the fetchers. A fetcher then, in order:
swaps its process's collector (the cut: O(1), no export, no device sync), forwards the cut to the
meshes spawned from its own process (meshes spawned inside actors), acknowledges on the
controller's port (a tiny message, declaring those meshes), and only then exports the states it
took and sends them on the same port. The controller's ``flush`` returns when every rank has
acknowledged, so a value recorded by work the controller awaited before ``flush(step)`` is in
``step`` or earlier, and one recorded by work started after ``flush`` returned is in a later step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from monarch.actor import Actor, context, endpoint

from forge_obs.collector import MetricCollector
from forge_obs.identity import set_identity
from forge_obs.registry import LOCAL_MESHES
from forge_obs.snapshot import dumps

logger = logging.getLogger("forge_obs")

__all__ = ["LocalFetcherActor", "FETCHER_NAME", "ACK", "STATES", "FINAL", "apply_options", "current_options", "store_options"]

FETCHER_NAME = "obs_fetcher"
#: kinds of message on the controller's inbox port
ACK, STATES, FINAL = "ack", "states", "final"
#: how long a fetcher waits for the meshes it spawned to take a new configuration
CONFIGURE_TIMEOUT_S = 10.0

_COLLECTOR = MetricCollector()
#: this process's current options: what ``init_backends`` configured (streaming, timeline)
_OPTIONS: dict[str, Any] = {"streaming": False, "run_dir": None, "timeline": None}


_hosts_fetcher = [False]


def hosts_fetcher() -> bool:
    """Whether this process has a fetcher (which then cuts the meshes spawned from here)."""
    return _hosts_fetcher[0]


def expect_fetcher() -> None:
    """This process's mesh gets a fetcher (set before any actor is built, by the hook's
    process start-up): meshes spawned from here are cut from here."""
    _hosts_fetcher[0] = True


def current_options() -> dict[str, Any]:
    """Options to give fetchers spawned from this process (and their new processes)."""
    return dict(_OPTIONS)


def store_options(options: dict[str, Any]) -> None:
    """Remember the options fetchers spawned from this process start with (the controller
    process configures itself directly)."""
    _OPTIONS.update(options)


def apply_options(options: dict[str, Any] | None, timeline: bool = True) -> None:
    """Configure this process: raw streaming for ``per_rank_no_reduce`` and (``timeline``) the
    timeline writer, which names its file after the process's identity: the fetcher sets that
    first. Runs when a process starts (before user actors; streaming only), when a fetcher is
    built, and on ``configure``; never raises."""
    if not options:
        return
    try:
        _OPTIONS.update(options)
        _COLLECTOR.set_streaming(bool(options.get("streaming")))
        if timeline and "timeline" in options:
            from forge_obs.timeline.writer import configure_from_push

            tl = options.get("timeline")
            configure_from_push(options.get("run_dir") if tl is not None else None, tl or {})
    except Exception as e:  # noqa: BLE001 - configuration never breaks a process
        logger.error("forge_obs: could not apply options %r: %r", options, e)


class LocalFetcherActor(Actor):
    """Takes its process's values at each cut and hands them to the controller's inbox port."""

    def __init__(self, port: Any, mesh_id: str, mesh_name: str | None = None, options: dict | None = None) -> None:
        inst = context().actor_instance
        point = inst.rank
        proc_name = inst.actor_id.proc_name or ""
        name = mesh_name or (proc_name.rsplit("-", 1)[0] if "-" in proc_name else proc_name) or "mesh"
        self.port = port  # the controller inbox's port: acks, states and finals, in this order
        try:
            port.return_undeliverable = False  # a gone controller must not fail this actor
        except Exception:  # noqa: BLE001
            pass
        self.mesh_id = mesh_id
        self.rank = int(point.rank)
        self.key = (mesh_id, self.rank)
        self.identity = set_identity(
            mesh=name, rank=self.rank, coords={k: int(v) for k, v in dict(point).items()}, world_size=int(point.extent.nelements)
        )
        self.last_seq = 0  # the last cut this rank took (its final states come after it)
        expect_fetcher()
        apply_options(options)

    @endpoint
    async def cut(self, seq: int, step: int, actor: str, ctl_us: int | None = None) -> None:
        """Swap the collector, cut the meshes spawned here, acknowledge; then export and send."""
        cpu0 = time.thread_time()
        taken = _COLLECTOR.swap()
        self.last_seq = seq
        if actor and self.identity.actor != actor:
            self.identity.actor = actor
        children = _cut_children(seq, step)
        try:
            self.port.send((ACK, seq, self.key, children))
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not acknowledge step %s: %r", self.identity.label, step, e)
        if ctl_us is not None:
            _clock_sample(ctl_us)
        self._send(STATES, seq, taken)
        _COLLECTOR.add_obs_cpu("export", time.thread_time() - cpu0)  # reported with the next step

    def _send(self, kind: str, seq: int, taken: Any) -> None:
        try:
            # pickled here, so that the controller's inbox thread only moves bytes: the decode
            # happens on its pipeline thread, after the flush that waits for acks resumed
            snap = dumps(_COLLECTOR.export(taken, packed=True))
            self.port.send((kind, seq, self.key, self.identity.to_dict(), snap))
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not send its states (cut %s): %r", self.identity.label, seq, e)

    @endpoint
    async def configure(self, options: dict) -> None:
        """New options (``init_backends``): applied here and in the meshes spawned from here
        before this returns, so that nothing recorded after ``init_backends`` returns is missed."""
        apply_options(options)
        await configure_all(LOCAL_MESHES.entries(), options, CONFIGURE_TIMEOUT_S)

    async def __cleanup__(self, exc: Exception | None) -> None:
        """The mesh is stopping: hand over what was recorded since the last cut."""
        self._send(FINAL, self.last_seq, _COLLECTOR.swap())
        try:
            from forge_obs.timeline.writer import close

            close()
        except Exception:  # noqa: BLE001
            pass


async def configure_all(entries: list, options: dict[str, Any], timeout_s: float) -> None:
    """Configure the fetchers of ``entries`` (live meshes) and wait, at most ``timeout_s``; a
    mesh that is gone or does not answer is skipped (it shows up as missing ranks)."""
    calls = []
    for e in entries:
        if e.stopping:
            continue
        try:
            calls.append(asyncio.ensure_future(e.fetchers.configure.call(options)))
        except Exception as ex:  # noqa: BLE001
            logger.warning("forge_obs: could not configure mesh %s: %r", e.name, ex)
    if not calls:
        return
    done, pending = await asyncio.wait(calls, timeout=timeout_s)
    for f in pending:
        f.cancel()
    for f in done:
        if f.exception() is not None:
            logger.info("forge_obs: a mesh did not take its configuration: %r", f.exception())


def _cut_children(seq: int, step: int) -> list[tuple]:
    """Cast the cut to the meshes spawned from this process; declare them (stopped ones last)."""
    live, stopped = LOCAL_MESHES.take_for_cut()
    out = []
    for e in live:
        try:
            e.fetchers.cut.broadcast(seq, step, e.actor_label)
        except Exception as ex:  # noqa: BLE001 - a dead mesh shows up as missing ranks
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)
        out.append((e.mesh_id, e.size, e.name, e.actor_label, False))
    out.extend((e.mesh_id, e.size, e.name, e.actor_label, True) for e in stopped)
    return out


def _clock_sample(ctl_us: int) -> None:
    """The controller's clock when it sent the cut: narrows this host's clock-offset estimate."""
    try:
        from forge_obs.timeline import writer

        w = writer.current_writer()
        if w is not None:
            w.clock_sample([writer.now_us(), int(ctl_us)])
    except Exception:  # noqa: BLE001
        pass
