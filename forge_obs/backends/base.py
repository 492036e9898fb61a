"""The backend interface and registry.

    >>> from forge_obs.backends.base import LoggerBackend, register_backend
    >>> class PrintLoss(LoggerBackend):
    ...     def log_batch(self, metrics, global_step, **kwargs):
    ...         print(global_step, [m.value for m in metrics if m.key == "loss"])
    >>> register_backend("print_loss", PrintLoss)

A backend is configured by name in ``init_backends({"print_loss": {"logging_mode": ...}})``, or
by import path (``"my_pkg.backends:SlackBackend"``). Backends run on the controller only, in the
logger's backend threads (one per backend): never on the training path. Methods may be ``def`` or ``async def``
(torchforge's backends are async; both work).

Hooks, all optional:
- ``init(run=RunContext, role=..., process_name=...)``: open files/runs. Raising fails ``init_backends``.
- ``log_step(record)``: the whole :class:`~forge_obs.record.StepRecord`; the default calls
  ``log_batch`` (reduced modes) and ``log_stream`` (``per_rank_no_reduce``) per the backend's modes.
- ``log_batch(metrics, global_step, source=None)``, ``log_stream(metric, global_step, source=...)``.
- ``finish()``: flush and close at shutdown.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
from typing import Any, Callable

from forge_obs.metric import LoggingMode, Metric
from forge_obs.record import RunContext, StepRecord

__all__ = ["LoggerBackend", "register_backend", "get_logger_backend_class", "backend_names", "call_hook"]


class LoggerBackend:
    """Base class of every backend. ``logging_mode`` may be one mode or a list of modes."""

    #: modes used when the config names none
    default_modes: tuple[LoggingMode, ...] = (LoggingMode.GLOBAL_REDUCE,)

    def __init__(self, logger_backend_config: dict[str, Any] | None = None) -> None:
        self.config = dict(logger_backend_config or {})
        self.modes = parse_modes(self.config.get("logging_mode"), self.default_modes)
        self.run: RunContext | None = None

    @property
    def logging_mode(self) -> LoggingMode:
        return self.modes[0]

    def init(self, run: RunContext | None = None, **kwargs: Any) -> None:
        self.run = run

    def log_step(self, record: StepRecord) -> None:
        for mode in self.modes:
            if mode is LoggingMode.GLOBAL_REDUCE:
                call_hook(self.log_batch, record.global_metrics, record.step)
            elif mode is LoggingMode.PER_RANK_REDUCE:
                for label, metrics in record.per_rank.items():
                    call_hook(self.log_batch, metrics, record.step, source=label)
            else:
                for label, rows in record.raw.items():
                    for key, value, ts in rows:
                        call_hook(self.log_stream, Metric(key, value, None, ts, label), record.step, source=label)

    def log_batch(self, metrics: list[Metric], global_step: int, **kwargs: Any) -> None:
        pass

    def log_stream(self, metric: Metric, global_step: int, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass


def parse_modes(value: Any, default: tuple[LoggingMode, ...]) -> tuple[LoggingMode, ...]:
    """``"global_reduce"`` / ``["global_reduce", "per_rank_reduce"]`` -> modes; ValueError
    naming the valid choices otherwise."""
    if value is None:
        return default
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, LoggingMode):
            out.append(item)
            continue
        try:
            out.append(LoggingMode(str(item).lower()))
        except ValueError:
            valid = ", ".join(m.value for m in LoggingMode)
            raise ValueError(f"unknown logging_mode {item!r}; valid: {valid}") from None
    if not out:
        raise ValueError("logging_mode is empty; valid: " + ", ".join(m.value for m in LoggingMode))
    return tuple(out)


def call_hook(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a backend hook with the keyword arguments its signature accepts; run it to
    completion if it is a coroutine function (torchforge backends are async)."""
    try:
        sig = inspect.signature(fn)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters}
    except (TypeError, ValueError):
        pass
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        return _run_coro(out)
    return out


_local = threading.local()  # each backend thread runs its async hooks on a loop of its own


def _run_coro(coro: Any) -> Any:
    """Run an async hook in the calling (backend) thread's own event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_local, "loop", None)
        if loop is None or loop.is_closed():
            loop = _local.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    # Called from inside a running loop (init on the actor's loop): run in a helper thread.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


_BACKENDS: dict[str, "type[LoggerBackend] | str"] = {
    "console": "forge_obs.backends.console:ConsoleBackend",
    "jsonl": "forge_obs.backends.jsonl:JsonlBackend",
    "wandb": "forge_obs.backends.wandb:WandbBackend",
    "tensorboard": "forge_obs.backends.tensorboard:TensorBoardBackend",
    "alerts": "forge_obs.alerts.backend:AlertsBackend",
}


def register_backend(name: str, backend: "type[LoggerBackend] | str") -> None:
    """Register a backend class (or ``"module:Class"`` path) under ``name``."""
    _BACKENDS[name] = backend


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_logger_backend_class(name: str) -> type[LoggerBackend]:
    """Class for a registered name or a ``"package.module:Class"`` path; ValueError listing the
    valid names otherwise."""
    target = _BACKENDS.get(name)
    if target is None and ":" in name:
        target = name
    if target is None:
        raise ValueError(
            f"unknown backend {name!r}; valid: {', '.join(backend_names())} "
            "(or a 'package.module:Class' path to a LoggerBackend subclass)"
        )
    if isinstance(target, str):
        mod_name, _, cls_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"backend {name!r}: cannot import {target!r} ({e})") from e
    else:
        cls = target
    if not (isinstance(cls, type) and issubclass(cls, LoggerBackend)):
        raise ValueError(f"backend {name!r}: {cls!r} is not a forge_obs.LoggerBackend subclass")
    return cls
