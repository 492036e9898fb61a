"""TorchTitan's structured logger, on forge_obs's timeline: switching is one import.

    # from torchtitan.observability import structured_logger as sl
    from forge_obs import titan as sl

    sl.init_structured_logger(source="trainer", output_dir="./outputs")
    sl.set_step(5)
    with sl.log_trace_span("fwd_bwd"):
        ...
    sl.log_trace_scalar({"train.loss": 2.5})
    sl.log_trace_instant("checkpoint_saved")

The names of ``torchtitan.observability.structured_logger`` (``init_structured_logger``,
``log_trace_span``, ``log_trace_instant``, ``log_trace_scalar``, ``set_step``, ``add_step_tag``,
``clear_step_tags``, ``get_step``, ``get_step_tags``, ``get_relative_step``), with the same
meaning: a span is a timed block (context manager or decorator of sync / async functions; an
exception marks it with the error), an instant is a point event, a scalar is an instant named
after the scalar carrying ``value`` (non-numeric values are skipped with a warning); records are
stamped with the step and the step's tags. Every call is skipped while
``torch.compiler.is_dynamo_compiling()``, and does nothing after ``init_structured_logger(enable=False)``.

Records go to forge_obs's per-rank timeline (``<run_dir>/events/``; a header with the run id
heads every file, and each SQL row carries it): ``forge-obs trace`` / ``sql`` / ``doctor``
read them. When ``forge_obs.spmd.init`` (or ``init_backends``) already configured the timeline,
``init_structured_logger`` keeps that run directory; otherwise ``output_dir`` is the run
directory. ``ranks`` (``"every:4"``, ``[0, 3]``, ``"0-3"``) picks the ranks that write;
``max_file_mb`` / ``max_files`` rotate the files.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable

from forge_obs.core.identity import current_identity, set_identity
from forge_obs.core.warn import WARNER
from forge_obs.recording import timeline as _tl

__all__ = ["init_structured_logger", "log_trace_span", "log_trace_instant", "log_trace_scalar", "set_step",
           "add_step_tag", "clear_step_tags", "get_step", "get_step_tags", "get_relative_step", "is_enabled"]

_ON = [True]  # init_structured_logger(enable=False) turns every call off
_initialized = [False]
_TAGS_GLOBAL: list = [()]
_TAGS_CV: ContextVar[tuple] = ContextVar("forge_obs_titan_tags", default=())
_REL_GLOBAL: list = [None]
_REL_CV: ContextVar = ContextVar("forge_obs_titan_relative_step", default=None)


def init_structured_logger(source: str, output_dir: "str | os.PathLike", rank: "int | None" = None, enable: bool = True,
                           *, ranks: Any = "all", max_file_mb: float = 64.0, max_files: int = 0,
                           run_id: "str | None" = None) -> None:
    """Start recording this process's trace (once per process; later calls do nothing).
    ``rank`` defaults to ``$RANK``; ``enable=False`` makes every ``log_trace_*`` call a no-op."""
    if not enable:
        _ON[0] = False
        return
    if _initialized[0]:
        return
    _initialized[0] = True
    from forge_obs.recording.timeline import writer

    if writer.current_writer() is not None:  # spmd.init / init_backends configured this process
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
    ident = current_identity()
    if ident.mesh == "controller":  # not named by forge_obs yet: named after the source
        set_identity(mesh=str(source), rank=rank, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    run_dir = Path(output_dir)
    rid = run_id or os.environ.get("FORGE_OBS_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or run_dir.name
    opts = {"ranks": ranks, "max_file_mb": max_file_mb, "max_files": max_files, "_run_id": rid}
    writer.configure(run_dir, opts)


def is_enabled() -> bool:
    """Whether ``log_trace_*`` calls record in this process."""
    return _ON[0] and _tl.is_enabled()


class log_trace_span:  # noqa: N801 - TorchTitan's name
    """Time a block: ``with log_trace_span("fwd_bwd"):`` or ``@log_trace_span("rollout")`` on a
    sync or async function (forge_obs's one span mechanism, ``record_span``'s). ``description`` is
    kept as an attribute; ``stacklevel`` is accepted."""

    __slots__ = ("base_name", "description", "stacklevel", "_span")

    def __init__(self, event_type: str, description: "str | None" = None, *, stacklevel: int = 2) -> None:
        self.base_name = str(event_type)
        self.description = description
        self.stacklevel = stacklevel
        self._span: Any = None

    def __enter__(self) -> "log_trace_span":
        self._span = _titan_span(self.base_name, self.description)
        self._span.__enter__()
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        span = self._span
        if span is not None:
            self._span = None
            span.__exit__(et, ev, tb)

    def __call__(self, fn: Callable) -> Callable:
        return _tl.wrap(fn, _titan_span, self.base_name, self.description)


_OFF = nullcontext()  # reusable: what a span is after init_structured_logger(enable=False)


def _titan_span(name: str, description: "str | None") -> Any:
    """The span of one ``log_trace_span`` block or call (checked per call: ``enable=False``
    turns off the spans of functions decorated before)."""
    if not _ON[0]:
        return _OFF
    return _tl.record_span(name) if description is None else _tl.record_span(name, description=description)


def log_trace_instant(event_type: str, *, stacklevel: int = 2) -> None:
    """A point-in-time event (e.g. ``"training_start"``)."""
    if _ON[0]:
        _tl.record_event(event_type)


def log_trace_scalar(scalars: "dict[str, float | int]", *, stacklevel: int = 2) -> None:
    """One event per ``name: value`` (the event is named ``name`` and carries ``value``);
    non-numeric values (and bools) are skipped with a warning."""
    if not _ON[0]:
        return
    bad = []
    for name, value in scalars.items():
        if not isinstance(value, (float, int)) or isinstance(value, bool):
            bad.append(name)
            continue
        _tl.record_event(name, value=value)
    if bad:
        WARNER.warn("titan_scalar", "log_trace_scalar", f"log_trace_scalar skipped non-numeric values for keys: {bad}")


def set_step(step: int, *, relative_step: "int | None" = None) -> None:
    """The step of every later record (``relative_step``: steps since this process started,
    default ``step``); clears the step's tags."""
    _tl.set_step(step)
    rel = step if relative_step is None else relative_step
    _REL_GLOBAL[0] = rel
    _REL_CV.set(rel)
    clear_step_tags()


def get_step() -> "int | None":
    return _tl.get_step()


def get_relative_step() -> "int | None":
    rel = _REL_CV.get()
    return rel if rel is not None else _REL_GLOBAL[0]


def _in_task() -> bool:
    try:
        return asyncio.current_task() is not None
    except RuntimeError:
        return False


def add_step_tag(tag: str) -> None:
    """Tag the current step (``"gc"``, ``"eval"``); inside an asyncio task the tag is the task's
    only (sibling tasks do not see it), as in TorchTitan."""
    if _in_task():
        cur = _TAGS_CV.get()
        if tag not in cur:
            _TAGS_CV.set(cur + (tag,))
    elif tag not in _TAGS_GLOBAL[0]:
        _TAGS_GLOBAL[0] = _TAGS_GLOBAL[0] + (tag,)
    if _ON[0]:
        _tl.add_step_tag(tag)


def get_step_tags() -> tuple:
    cv = _TAGS_CV.get()
    return cv if cv else _TAGS_GLOBAL[0]


def clear_step_tags() -> None:
    _TAGS_GLOBAL[0] = ()
    _TAGS_CV.set(())
