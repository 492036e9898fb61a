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
- ``init(run=RunContext, role=BackendRole.GLOBAL, process_name=...)``: open files/runs. Raising
  fails ``init_backends``.
- ``log_step(record)``: the whole :class:`~forge_obs.backends.record.StepRecord`; the default calls
  ``log_batch`` (reduced modes) and ``log_raw`` (``per_rank_no_reduce``) per the backend's modes.
- ``log_steps(records)``: steps arrive in batches (at most ``backend_batch_s`` after their cut
  completed); the default calls ``log_step`` for each (and a failure costs its step only).
- ``log_batch(metrics, global_step, source=None)``: plain numbers by default (config ``values``:
  ``"scalar"``, or ``"rich"`` for dicts and row lists as reduced); ``show_obs: False`` leaves out
  the ``obs/…`` keys.
- ``log_raw(raw, global_step)`` (default: ``log_stream`` per value), ``log_stream_batch(batch)``
  (raw values streamed between flushes, :class:`StreamBatch`), ``log_stream(metric, global_step,
  source=...)``.
- ``finish()``: flush and close at shutdown.
- ``meta_report()``: counts of its own for its entry in ``meta.json``'s ``backends``.

torchforge's backends work unchanged: a keyword-only constructor (``logging_mode=...,
per_rank_share_run=..., **kwargs`` -> ``backend_kwargs``) is called with the config's keys
(:func:`instantiate_backend`), and async hooks are run to completion.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from forge_obs.backends.record import RunContext, StepRecord
from forge_obs.core.redact import redacted_repr
from forge_obs.core.safe import safe_repr
from forge_obs.core.types import LoggingMode, Metric
from forge_obs.core.warn import WARNER

__all__ = [
    "LoggerBackend",
    "StreamBatch",
    "register_backend",
    "get_logger_backend_class",
    "backend_names",
    "call_hook",
    "instantiate_backend",
    "scalar_metrics",
    "flattened_clashes",
    "write_each",
    "awaitable",
    "parse_modes",
]


@dataclass
class StreamBatch:
    """Raw values streamed between flushes: ``entries`` of ``(rank label, step, [(key, value,
    wall_time), ...])``, each rank's under its predicted step (its last flushed step + 1)."""

    entries: list = field(default_factory=list)
    sources: dict = field(default_factory=dict)

    def values(self) -> int:
        return sum(len(rows) for _label, _step, rows in self.entries)


_UNSET: Any = object()
#: LoggerBackend's own keyword arguments (torchforge's constructor); the rest is ``backend_kwargs``
_OWN_KWARGS = ("logging_mode", "per_rank_share_run")


class Done:
    """What a built-in backend's ``init`` / ``log_batch`` / ``finish`` return: the work is done,
    and the result may be awaited (torchforge's backends are async: ``await backend.init(...)``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # noqa: unreachable - makes this a generator, as __await__ must return an iterator


def awaitable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make a synchronous hook's result awaitable (see :class:`Done`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Done:
        return Done(fn(*args, **kwargs))

    wrapper.__forge_obs_awaitable__ = True  # type: ignore[attr-defined]
    return wrapper


class LoggerBackend:
    """Base class of every backend. ``logging_mode`` may be one mode or a list of modes.

    Two ways to construct one, the same backend either way:

    - forge_obs's: one config dict, as given in ``init_backends`` --
      ``ConsoleBackend({"logging_mode": "global_reduce", "compact": True})``;
    - torchforge's: keyword arguments -- ``ConsoleBackend(logging_mode=LoggingMode.GLOBAL_REDUCE)``,
      ``WandbBackend(logging_mode=..., project="p")``; ``per_rank_share_run`` and the other
      keywords (``backend_kwargs``) become config keys.
    """

    #: modes used when the config names none
    default_modes: tuple[LoggingMode, ...] = (LoggingMode.GLOBAL_REDUCE,)

    def __init__(
        self,
        logger_backend_config: dict[str, Any] | None = None,
        *,
        logging_mode: Any = _UNSET,
        per_rank_share_run: Any = _UNSET,
        **kwargs: Any,
    ) -> None:
        keywords = dict(kwargs)
        if logging_mode is not _UNSET:
            keywords["logging_mode"] = logging_mode
        if per_rank_share_run is not _UNSET:
            keywords["per_rank_share_run"] = per_rank_share_run
        if logger_backend_config is not None and not isinstance(logger_backend_config, dict):
            raise TypeError(f"{type(self).__name__}: the config must be a dict, got {type(logger_backend_config).__name__}")
        self.config = dict(logger_backend_config or {})
        self.config.update(keywords)
        self.modes = parse_modes(self.config.get("logging_mode"), self.default_modes)
        if self.config.get("values", self.default_values) not in ("scalar", "rich"):
            raise ValueError(f"{type(self).__name__}: values={redacted_repr(self.config['values'])}; valid: scalar, rich")
        #: torchforge's attributes
        self.per_rank_share_run = bool(self.config.get("per_rank_share_run", False))
        self.backend_kwargs = {k: v for k, v in self.config.items() if k not in _OWN_KWARGS}
        self.run: RunContext | None = None

    @property
    def logging_mode(self) -> LoggingMode:
        return self.modes[0]

    @logging_mode.setter
    def logging_mode(self, value: Any) -> None:
        self.modes = parse_modes(value, self.default_modes)

    @awaitable
    def init(self, run: RunContext | None = None, **kwargs: Any) -> None:
        self.run = run

    #: what ``log_batch`` receives by default: ``"scalar"`` (plain numbers; a distribution as
    #: ``key/p50``, ``key/p90``, ``key/p99``, ``key/count``; SAMPLE rows left out) or ``"rich"``
    #: (values as reduced: dicts, row lists). Config key ``values``.
    default_values = "scalar"
    #: whether ``log_batch`` receives forge_obs's ``obs/…`` self-metrics. Config key ``show_obs``.
    default_show_obs = True
    #: values this backend could not write and left out of their step (:func:`write_each`);
    #: ``meta.json`` reports them per backend
    skipped_values = 0

    def log_step(self, record: StepRecord) -> None:
        for mode in self.modes:
            if mode is LoggingMode.GLOBAL_REDUCE:
                call_hook(self.log_batch, self.batch_values(record.global_metrics), record.step)
            elif mode is LoggingMode.PER_RANK_REDUCE:
                for label, metrics in record.per_rank.items():
                    call_hook(self.log_batch, self.batch_values(metrics), record.step, source=label)
            else:
                self.log_raw(record.raw, record.step)

    def log_steps(self, records: list[StepRecord]) -> None:
        """Several steps, oldest first: the pipeline hands steps to the backends in batches
        (``backend_batch_s``). Default: :meth:`log_step` for each, each failure costing its step
        only. A backend may override it to take them at once (one write for the batch); then a
        failure counts every step of the batch as failed for this backend."""
        for record in records:
            self.log_step(record)

    def batch_values(self, metrics: list[Metric]) -> list[Metric]:
        """``metrics`` as this backend's ``log_batch`` takes them (config ``values``, ``show_obs``)."""
        show_obs = bool(self.config.get("show_obs", self.default_show_obs))
        rich = self.config.get("values", self.default_values) == "rich"
        if rich and show_obs:
            return metrics
        out: list[Metric] = []
        for m in metrics:
            if not show_obs and m.key.startswith("obs/"):
                continue
            if rich:
                out.append(m)
            else:
                out.extend(scalar_metrics(m))
        return out

    def log_raw(self, raw: dict[str, list], global_step: int) -> None:
        """Raw values (``per_rank_no_reduce``): ``{rank label: [(key, value, wall_time), ...]}``
        under ``global_step``, from a step's cut (:meth:`log_step`) or streamed between flushes
        (:meth:`log_stream_batch`). Default: ``log_stream`` per value."""
        for label, rows in raw.items():
            for key, value, ts in rows:
                call_hook(self.log_stream, Metric(key, value, None, ts, label), global_step, source=label)

    def log_stream_batch(self, batch: "StreamBatch") -> None:
        """Raw values streamed between flushes (``per_rank_no_reduce`` backends only), each
        rank's under its predicted step (its last flushed step + 1)."""
        for label, step, rows in batch.entries:
            self.log_raw({label: rows}, step)

    @awaitable
    def log_batch(self, metrics: list[Metric], global_step: int, **kwargs: Any) -> None:
        pass

    def log_stream(self, metric: Metric, global_step: int, **kwargs: Any) -> None:
        pass

    @awaitable
    def finish(self) -> None:
        pass

    def meta_report(self) -> dict[str, Any]:
        """Counts of this backend's own that ``meta.json`` adds to its entry in ``backends``
        (read after ``finish``; e.g. the local store's ``unwritten_steps``). Default: none."""
        return {}

    def get_metadata_for_secondary_ranks(self) -> dict[str, Any] | None:
        """torchforge's hook for per-rank backends sharing the controller's run. forge_obs runs
        every backend on the controller, so there is nothing to share: None."""
        return None


def write_each(backend: LoggerBackend, metrics: Iterable[Metric], write: Callable[[Metric], None]) -> None:
    """``write(m)`` for each metric, so that a value the backend cannot write (e.g. a custom
    reduction's value that contains itself) costs that key only: it is left out of this
    backend's step, counted in ``backend.skipped_values`` with a rate-limited warning, and every
    other key is written. ``write`` should write nothing of a key before it can raise."""
    for m in metrics:
        try:
            write(m)
        except Exception as e:  # noqa: BLE001 - this key only
            backend.skipped_values += 1
            name = type(backend).__name__
            WARNER.warn("backend_skipped", f"{name}:{m.key}", f"{name} could not write {m.key!r} ({safe_repr(e)}); "
                        "left out of its step for this backend (counted in meta.json's backends)")


def scalar_metrics(m: Metric) -> list[Metric]:
    """``m`` as plain-number Metrics: a number as itself (a bool or a 0-d tensor as a float), a
    dict of numbers (a distribution: p50/p90/p99/count) as ``key/<field>`` Metrics, anything
    else (SAMPLE rows) as nothing.

        >>> [(x.key, x.value) for x in scalar_metrics(Metric("t_s", {"p50": 1.0, "p90": 2.0, "p99": 3.0, "count": 5}))]
        [('t_s/p50', 1.0), ('t_s/p90', 2.0), ('t_s/p99', 3.0), ('t_s/count', 5.0)]
    """
    v = m.value
    t = type(v)
    if t is float or t is int:
        return [m]
    if isinstance(v, (int, float)):  # bool, numpy numbers
        return [Metric(m.key, float(v), m.reduction, m.timestamp, m.source)]
    if isinstance(v, dict):
        return [Metric(f"{m.key}/{k}", float(x), m.reduction, m.timestamp, m.source)
                for k, x in v.items() if isinstance(x, (int, float))]
    item = getattr(v, "item", None)
    if callable(item) and not isinstance(v, (list, tuple, str)):
        try:
            return [Metric(m.key, float(item()), m.reduction, m.timestamp, m.source)]
        except Exception:  # noqa: BLE001 - not a scalar: left out
            return []
    return []


def flattened_clashes(metrics: list[Metric]) -> dict[str, str]:
    """The keys of ``metrics`` equal to a name another of them is flattened to (a dict value,
    e.g. a distribution's, is written as ``key/<field>``: :func:`scalar_metrics`, W&B,
    TensorBoard), each mapped to that other key: they would write two values under one name.

        >>> flattened_clashes([Metric("lat", {"p50": 1.0, "count": 3}), Metric("lat/p50", 9.0), Metric("lat/n", 1.0)])
        {'lat/p50': 'lat'}
    """
    names = {f"{m.key}/{f}": m.key for m in metrics if isinstance(m.value, dict) for f in m.value}
    if not names:
        return {}
    return {m.key: names[m.key] for m in metrics if m.key in names}


def instantiate_backend(cls: type, name: str, config: dict[str, Any]) -> "LoggerBackend":
    """Build a backend from its ``init_backends`` config: ``cls(config)`` for forge_obs-style
    backends, ``cls(**config)`` for torchforge-style ones (keyword-only constructors:
    ``logging_mode`` as a :class:`LoggingMode`, ``per_rank_share_run`` defaulting to False)."""
    if _takes_config_dict(cls):
        return cls(config)
    kw = dict(config)
    mode = kw.get("logging_mode", LoggingMode.GLOBAL_REDUCE)
    modes = parse_modes(mode, (LoggingMode.GLOBAL_REDUCE,))
    if len(modes) != 1:
        raise ValueError(f"backend {redacted_repr(name)} ({cls.__name__}) takes one logging_mode (torchforge-style "
                         f"constructor), got {redacted_repr(mode)}")
    kw["logging_mode"] = modes[0]
    kw.setdefault("per_rank_share_run", False)
    return cls(**kw)


def _takes_config_dict(cls: type) -> bool:
    """Whether ``cls.__init__`` takes a positional argument (forge_obs's config dict)."""
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


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
            raise ValueError(f"logging_mode {redacted_repr(item)} is not a valid LoggingMode; valid: {valid}") from None
    if not out:
        raise ValueError("logging_mode is empty; valid: " + ", ".join(m.value for m in LoggingMode))
    return tuple(out)


def call_hook(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a backend hook with the keyword arguments its signature accepts; run it to
    completion if it is a coroutine function (torchforge backends are async)."""
    if kwargs:
        names = _keyword_names(fn)
        if names is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in names}
    out = fn(*args, **kwargs)
    if type(out) is Done:
        return out.value
    if inspect.isawaitable(out):
        return _run_coro(out)
    return out


def _keyword_names(fn: Callable[..., Any]) -> "frozenset[str] | None":
    """The parameter names ``fn`` takes; None if it takes any keyword (or has no signature).
    Read once per function (a bound method's: once per class)."""
    func = getattr(fn, "__func__", fn)
    if isinstance(func, types.FunctionType):
        return _names_of(func)
    return _names_of.__wrapped__(fn)  # another callable: read each time


@functools.lru_cache(maxsize=1024)
def _names_of(func: Callable[..., Any]) -> "frozenset[str] | None":
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


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
    "critical_path": "forge_obs.alerts.path_metrics:CriticalPathBackend",
    "index": "forge_obs.analysis.index.live:IndexBackend",
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
            f"Unknown logger backend type: {redacted_repr(name)}; valid: {', '.join(backend_names())} "
            "(or a 'package.module:Class' path to a LoggerBackend subclass)"
        )
    if isinstance(target, str):
        mod_name, _, cls_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"backend {redacted_repr(name)}: cannot import {redacted_repr(target)} ({e})") from e
    else:
        cls = target
    if not (isinstance(cls, type) and issubclass(cls, LoggerBackend)):
        raise ValueError(f"backend {redacted_repr(name)}: {cls!r} is not a forge_obs.LoggerBackend subclass")
    return cls
