"""The experiment's logger: :class:`GlobalLoggingActor`, a controller singleton.

    import asyncio
    from forge_obs import get_or_create_metric_logger, record_metric, Reduce

    async def main():
        mlogger = await get_or_create_metric_logger(process_name="Controller")
        await mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce"}})
        for n in (1, 2, 3):
            record_metric("my_sum_metric", n, Reduce.SUM)
        await mlogger.flush.call_one(global_step=0)   # prints my_sum_metric: 6.0
        await mlogger.shutdown.call_one()

    asyncio.run(main())

Its endpoints are thin: a session is :mod:`forge_obs.controller.session` (``init_backends``,
``shutdown``), a flush is :mod:`forge_obs.controller.flush` (a cut of every rank, answered on the
inbox, :mod:`forge_obs.controller.inbox`); what they share in the controller process is
:data:`~forge_obs.controller.state.CONTROLLER`.

torchforge's endpoints are here too: ``register_fetcher(fetcher, proc_id)`` connects a
``LocalFetcherActor`` spawned by hand to the cut (on an inbox of this process: a
GlobalLoggingActor spawned on a mesh by hand gets its own), ``deregister_fetcher`` hands its
values over, and ``init_backends`` may be called again (the current backends get every flushed
step and finish first).
"""

from __future__ import annotations

import logging
from typing import Any

from monarch.actor import Actor, context, endpoint

from forge_obs.backends.base import parse_modes
from forge_obs.controller.flush import ProbedFlush, start_flush
from forge_obs.controller.inbox import local_port, start_local_inbox
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.controller.session import end_session, start_session
from forge_obs.controller.state import CONTROLLER
from forge_obs.core.types import LoggingMode

logger = logging.getLogger("forge_obs")

__all__ = ["GlobalLoggingActor", "GLOBAL_LOGGER_NAME"]

GLOBAL_LOGGER_NAME = "obs_global_logger"


class GlobalLoggingActor(Actor):
    """The experiment's single logger, a controller singleton (``get_or_create_metric_logger``).

    Endpoints: ``init_backends(config)`` (again: the current backends get every step flushed so
    far and finish, then the new ones start, same run unless ``"run"`` says otherwise),
    ``flush(global_step)``, ``shutdown()``; ``wait_idle()`` waits until every flushed step reached
    the backends; torchforge's ``register_fetcher(fetcher, proc_id)``,
    ``deregister_fetcher(proc_id)``, ``has_fetcher(proc_id)``, ``get_fetcher_count()``.
    """

    def __init__(self, process_name: str | None = None) -> None:
        self.process_name = process_name
        if _in_actor():  # not a plain GlobalLoggingActor() built outside Monarch (tests)
            CONTROLLER.process_name = process_name or "Controller"
            CONTROLLER.in_this_process = True

    def _validate_backend_config(self, backend_name: str, config: dict[str, Any]) -> dict[str, Any]:
        """torchforge's check of one backend's config: ``logging_mode`` as a :class:`LoggingMode`
        (ValueError naming the valid modes), ``per_rank_share_run`` a bool (ignored, with a
        warning, for ``global_reduce``; W&B ``per_rank_reduce`` with a shared run is warned about)."""
        if not isinstance(config, dict):
            raise ValueError(f"config of backend {backend_name!r} must be a dict, got {type(config).__name__}")
        modes = parse_modes(config.get("logging_mode"), (LoggingMode.GLOBAL_REDUCE,))
        mode: Any = modes[0] if len(modes) == 1 else list(modes)
        share = bool(config.get("per_rank_share_run", False))
        if share and modes == (LoggingMode.GLOBAL_REDUCE,):
            logger.warning("%s: per_rank_share_run=True is ignored in global_reduce mode", backend_name)
            share = False
        if backend_name == "wandb" and share and LoggingMode.PER_RANK_REDUCE in modes:
            logger.warning(
                "W&B: 'per_rank_reduce' with 'per_rank_share_run=True' is not recommended with torchforge's "
                "per-rank runs; in forge_obs it means one run with every rank's values as '<rank>/<key>' keys "
                "(the default). Set per_rank_share_run=False for one run per rank."
            )
        return {**config, "logging_mode": mode, "per_rank_share_run": share}

    @endpoint
    async def init_backends(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate ``config`` and start the backends. Raises ValueError (naming the backend and
        the valid choices) for an unknown backend, mode or key, and RuntimeError naming the
        backend whose constructor or ``init`` failed or whose ``init`` did not return within
        ``backend_init_timeout_s``; a call that raises changes nothing (a running session keeps
        logging). Called again, it creates and starts the new backends first, then hands every
        step flushed so far to the current backends and finishes them (values recorded since the
        last flush stay for the next one); the new ones continue the same run (unless ``config``
        has ``"run"``). With ``FORGE_DISABLE_METRICS=true`` (read at the call, as torchforge
        does) it starts nothing. Returns ``{"run_id": ..., "run_dir": ...}``."""
        _mark_controller(self.process_name)
        return await start_session(config)

    # ------------------------------------------------------------ fetchers (torchforge's endpoints)
    @endpoint
    async def register_fetcher(self, fetcher: Any, proc_id: str) -> None:
        """Take part a :class:`~forge_obs.controller.fetcher.LocalFetcherActor` mesh spawned by hand
        (torchforge's ``LocalFetcherActor(global_logger, process_name)``) in every flush from now
        on, as mesh ``proc_id``. ``provisioner_hooks`` and ``get_or_create_metric_logger`` do this
        themselves."""
        _mark_controller(self.process_name)
        port = await local_port()
        from forge_obs.controller.fetcher import current_options

        options = {**current_options(), "inbox_socket": start_local_inbox()}
        identities = await fetcher.connect.call(port, proc_id, options)
        size, name = 0, None
        for _point, ident in identities.items():
            size += 1
            name = name or (ident or {}).get("mesh")
        LOCAL_MESHES.add(proc_id, name or proc_id, size, fetcher)

    @endpoint
    async def deregister_fetcher(self, proc_id: str) -> None:
        """Stop cutting mesh ``proc_id``: what it recorded since its last cut is handed over and
        logged with the next flush. An unknown ``proc_id`` is warned about, as torchforge does."""
        e = LOCAL_MESHES.get(proc_id)
        if e is None or e.stopping:
            logger.warning("forge_obs: fetcher %r is not registered; cannot deregister. Registered: %s",
                           proc_id, [x.mesh_id for x in LOCAL_MESHES.entries() if not x.stopping])
            return
        LOCAL_MESHES.mark_stopping(proc_id)  # the next cut expects its final states
        try:
            await e.fetchers.release.call()
        except Exception as ex:  # noqa: BLE001 - a gone mesh shows up as missing ranks
            logger.warning("forge_obs: fetcher %r did not hand over its values: %r", proc_id, ex)

    @endpoint
    async def has_fetcher(self, proc_id: str) -> bool:
        """Whether mesh ``proc_id`` takes part in the flushes (``proc_mesh._uid``)."""
        e = LOCAL_MESHES.get(proc_id)
        if e is not None:
            return not e.stopping
        pipeline = CONTROLLER.pipeline
        return pipeline is not None and any(k[0] == proc_id for kids in list(pipeline.book.tree.values()) for k in kids)

    @endpoint
    async def get_fetcher_count(self) -> int:
        """Observed meshes: those spawned here, and those spawned from their processes that
        declared themselves at the last flush."""
        children = set()
        if CONTROLLER.pipeline is not None:
            children = {k[0] for kids in list(CONTROLLER.pipeline.book.tree.values()) for k in kids}
        return sum(1 for e in LOCAL_MESHES.entries() if not e.stopping) + len(children)

    @endpoint
    async def get_inbox(self) -> tuple:
        """``(inbox, port)``: the inbox of this actor's process (spawned there on first use)."""
        port = await local_port()
        return CONTROLLER.inbox, port

    # ------------------------------------------------------------ flush, shutdown
    @endpoint
    async def flush(self, global_step: int) -> None:
        """Cut every rank for ``global_step``; returns once every rank took part (or after
        ``flush_timeout_s``). Reduction and backend I/O happen in the background, in step order."""
        await (ProbedFlush(global_step) if CONTROLLER.probe_round_trip else start_flush(global_step))

    @endpoint
    async def wait_idle(self) -> None:
        """Return once every step flushed so far has reached the backends (a backend busy for
        longer than ``shutdown_timeout_s`` is not waited for)."""
        if CONTROLLER.pipeline is not None:
            await CONTROLLER.pipeline.drain()

    @endpoint
    async def shutdown(self) -> None:
        """Log what was recorded after the last flush (as step ``last + 1``), drain every pending
        step and finish the backends. ``init_backends`` may be called again afterwards."""
        if CONTROLLER.pipeline is None:
            return
        await end_session(final=True)


def _in_actor() -> bool:
    """Whether this runs inside a Monarch actor (not code calling ``GlobalLoggingActor()`` directly)."""
    try:
        return context().actor_instance.actor_id.actor_name != "client"
    except Exception:  # noqa: BLE001
        return False


def _mark_controller(process_name: str | None) -> None:
    """This process hosts the logger (an endpoint of it runs here)."""
    if not CONTROLLER.in_this_process:
        CONTROLLER.in_this_process = True
        CONTROLLER.process_name = process_name or CONTROLLER.process_name
