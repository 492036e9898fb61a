"""Creating and starting a session's backends (no Monarch here: the Monarch controller and the
SPMD logger rank both start their backends with these).

- :func:`create_backends`: one backend per config entry; mistakes raise naming the backend;
- :func:`make_run_dir`: the run directory exists before any backend starts;
- :func:`start_backends`: each backend's ``init`` on a thread of its own, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from forge_obs.backends.base import LoggerBackend, call_hook, get_logger_backend_class, instantiate_backend
from forge_obs.backends.record import RunContext
from forge_obs.controller.config import RESERVED_KEYS
from forge_obs.core.types import BackendRole

__all__ = ["create_backends", "make_run_dir", "start_backends", "start_backend"]


def create_backends(configs: dict[str, dict[str, Any]]) -> dict[str, LoggerBackend]:
    """One backend per entry of ``configs``, each error naming its backend: ValueError for a
    config mistake (unknown backend, mode or key; the valid choices in the message),
    RuntimeError for a constructor that fails otherwise."""
    backends: dict[str, LoggerBackend] = {}
    for name, bcfg in configs.items():
        try:
            cls = get_logger_backend_class(name)
        except ValueError as e:
            raise ValueError(f"{e}; reserved keys: {', '.join(RESERVED_KEYS)}") from None
        try:
            backends[name] = instantiate_backend(cls, name, bcfg)  # validates logging_mode
        except ValueError as e:
            raise ValueError(f"backend {name!r} ({cls.__name__}): {e}") from e
        except Exception as e:  # noqa: BLE001 - any constructor error, named
            raise RuntimeError(f"backend {name!r} ({cls.__name__}) could not be created: {e!r}") from e
    return backends


def make_run_dir(run_dir: Any) -> None:
    """The run directory exists before any backend starts (a backend may open files there)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot create the run directory {run_dir}: {e}") from e


async def start_backends(backends: dict[str, LoggerBackend], run: RunContext, timeout_s: float) -> None:
    """Start every backend in turn (:func:`start_backend`); at the first that fails, the ones
    started are finished and its error is raised."""
    started: list[LoggerBackend] = []
    for name, be in backends.items():
        error = await start_backend(name, be, run, timeout_s)
        if error is not None:
            for other in started:
                _finish_quietly(other)
            raise error from error.__cause__
        started.append(be)


async def start_backend(name: str, be: LoggerBackend, run: RunContext, timeout_s: float) -> RuntimeError | None:
    """Call ``be.init`` on a thread of its own for at most ``timeout_s``; None, or a RuntimeError
    naming the backend (its ``__cause__`` the backend's error). A hung ``init`` is left behind
    on its daemon thread (and finished if it ever returns)."""
    try:
        await _init_within(be, run, timeout_s)
    except asyncio.TimeoutError:
        return RuntimeError(f"backend {name!r} did not finish init within backend_init_timeout_s={timeout_s:g}s; "
                            "left behind")
    except Exception as e:  # noqa: BLE001 - any init error, named
        error = RuntimeError(f"backend {name!r} failed to initialise: {e!r}")
        error.__cause__ = e
        return error
    return None


def _finish_quietly(be: LoggerBackend) -> None:
    """``be.finish()`` for a backend given up on; its error is not the one that matters."""
    try:
        call_hook(be.finish)
    except Exception:  # noqa: BLE001
        pass


async def _init_within(be: LoggerBackend, run: RunContext, timeout_s: float) -> None:
    """``be.init(run=..., role=GLOBAL, process_name=...)`` on a daemon thread; its error, or
    asyncio.TimeoutError after ``timeout_s`` (an ``init`` that returns later is then finished)."""
    import concurrent.futures

    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_running_or_notify_cancel()  # never cancelled: its outcome is set by the thread, or abandoned
    lock = threading.Lock()
    abandoned = False

    def run_init() -> None:
        error = None
        try:
            call_hook(be.init, run=run, role=BackendRole.GLOBAL, process_name=run.process_name)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            error = e
        with lock:
            late = abandoned
            if not late:
                done.set_exception(error) if error is not None else done.set_result(None)
        if late and error is None:
            _finish_quietly(be)

    threading.Thread(target=run_init, name="forge_obs-backend-init", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), timeout_s)
    except asyncio.TimeoutError:
        with lock:
            if not done.done():
                abandoned = True
                raise
        done.result()  # it ended just as the time was up: its outcome
