"""Structured per-rank timeline: spans, instant events and step tags, cheap enough for every step.

    from forge_obs.recording.timeline import record_span, record_event, set_step, add_step_tag

    set_step(7)
    with record_span("train_step", flow=f"policy-v{version}"):
        ...                                   # the caller pays two appends to a buffer

    @record_span("generate")                  # also decorates sync and async functions
    async def generate(prompt): ...

    record_event("weights_pushed", version=3, flow="policy-v3")
    add_step_tag("eval")

The hot path appends tuples to a per-process bounded buffer; a background thread
(:mod:`forge_obs.recording.timeline.writer`) turns them into compact JSONL under
``runs/<run_id>/events/<host>_<pid>_<mesh>_<rank>.jsonl``. The run directory comes from
``init_backends`` (the controller configures itself and pushes the configuration to every
fetcher mesh), or from :func:`configure` in a standalone script. Until configured, records are
kept in a small bounded buffer. ``FORGE_DISABLE_METRICS=true`` or ``FORGE_DISABLE_TIMELINE=true``
turns every call into a no-op. Nothing here imports Monarch or torch.

This package is the recording side only. The views of what it writes (``forge-obs trace`` /
``sql`` / ``doctor``, and their Python API) are in :mod:`forge_obs.analysis`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import secrets
import sys
import threading
import time
from asyncio import current_task as _current_task
from asyncio.events import _get_running_loop
from collections import deque
from contextvars import ContextVar
from typing import Any, Callable

from forge_obs.core.env import METRICS_DISABLED, env_flag
from forge_obs.core.safe import safe_str

__all__ = [
    "record_span",
    "record_event",
    "set_step",
    "add_step_tag",
    "get_step",
    "configure",
    "flush",
    "close",
    "is_enabled",
    "call_link",
    "set_incoming",
]

#: the timeline is off for the whole process (read once)
DISABLED: bool = METRICS_DISABLED or env_flag("FORGE_DISABLE_TIMELINE")
#: entries kept before the process is configured (oldest dropped beyond)
PRECONFIG_CAP = 20_000
#: entries kept between two writer passes (oldest dropped beyond; the writer reports the loss)
BUFFER_CAP = 500_000

# entry kinds (first element of each buffered tuple)
K_BEGIN, K_END, K_LANE, K_STEP, K_TAG, K_EVENT = 1, 2, 3, 4, 5, 6

_buf: deque = deque(maxlen=PRECONFIG_CAP)
_append = _buf.append
_next_id = itertools.count(1).__next__
_clock_ns = time.perf_counter_ns
_get_ident = threading.get_ident
#: recording is on (False: disabled, or this rank is not selected by ``ranks``)
_ON: bool = not DISABLED

_step_var: ContextVar[int | None] = ContextVar("forge_obs_timeline_step", default=None)
_proc_step: list = [None]  # process-wide step (last set_step anywhere in the process)
_lanes: dict[int, int] = {}
_lane_lock = threading.Lock()

#: this context's innermost open span (a ``_Span``; a task created in it inherits it, and a span
#: that ended is no longer open: its ``sid`` is 0); or, in a message handler before any span
#: opened, the caller's link (a tuple ``(link id, message token)``, :func:`set_incoming`)
_cur: ContextVar[Any] = ContextVar("forge_obs_timeline_cur", default=None)
#: ``check(token)``: whether a link's message token is the message being handled (set by the
#: layer that knows the message; without one, a link holds for its context)
_incoming_check: list = [None]
_link_prefix = f"{secrets.token_hex(4)}."
_next_link = itertools.count(1).__next__


def _new_lane(key: int, task: Any) -> int:
    with _lane_lock:
        lane = _lanes.get(key)
        if lane is None:
            lane = len(_lanes)
            _lanes[key] = lane
            if task is not None:
                try:
                    label = task.get_name()
                except Exception:  # noqa: BLE001
                    label = "task"
            else:
                label = threading.current_thread().name
            _append((K_LANE, lane, label, _get_ident()))
    return lane


def _lane() -> int:
    """Track of the caller: one per asyncio task (concurrent tasks get separate tracks), else
    one per thread."""
    loop = _get_running_loop()
    if loop is not None:
        task = _current_task(loop)
        if task is not None:
            lane = _lanes.get(id(task))
            return lane if lane is not None else _new_lane(id(task), task)
    key = _get_ident()
    lane = _lanes.get(key)
    return lane if lane is not None else _new_lane(key, None)


def _step() -> int | None:
    s = _step_var.get()
    return s if s is not None else _proc_step[0]


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # noqa: BLE001
        return False


_PLAIN = (str, int, float, bool, type(None))


def _jsonable(v: Any) -> Any:
    """``v`` if the writer can serialise it (plain values, JSON containers), else its text: an
    attribute never fails the writer (a cycle, a key that is not a string, a ``__str__`` that
    raises)."""
    if type(v) in _PLAIN:
        return v
    try:
        json.dumps(v, default=str)
        return v
    except Exception:  # noqa: BLE001
        return safe_str(v)


def _extras(flow: Any, attrs: dict | None) -> dict | None:
    if flow is None and not attrs:
        return None
    d: dict = {}
    if flow is not None:
        d["f"] = _jsonable(flow)
    if attrs:
        d["a"] = {k: _jsonable(v) for k, v in attrs.items()}
    return d


class _Span:
    """A span: context manager, and decorator of sync/async functions (a fresh span per call)."""

    __slots__ = ("name", "extras", "to_metrics", "sid", "t0", "tok", "lane")

    def __init__(self, name: str, extras: dict | None, to_metrics: bool) -> None:
        self.name = name
        self.extras = extras
        self.to_metrics = to_metrics
        self.sid = 0

    def __enter__(self) -> "_Span":
        if _ON and not (_torch_loaded[0] and _compiling()):
            sid = _next_id()
            self.sid = sid
            step = _step_var.get()
            if step is None:
                step = _proc_step[0]
            lane = _lane()
            ex = self.extras
            cur = _cur.get()
            if cur is not None and type(cur) is tuple:
                ex = _linked(ex, cur)
            self.lane = lane
            self.tok = _cur.set(self)
            t = _clock_ns()
            self.t0 = t
            _append((K_BEGIN, sid, t, lane, self.name, step, ex))
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        sid = self.sid
        if sid:
            t = _clock_ns()
            self.sid = 0
            try:
                _cur.reset(self.tok)
            except ValueError:  # ended in another context than it began in: that one keeps its mark
                pass
            _append((K_END, sid, t, None if ev is None else _err(et, ev)))
            if self.to_metrics:
                _span_metric(self.name, (t - self.t0) / 1e9)

    async def __aenter__(self) -> "_Span":
        return self.__enter__()

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.__exit__(et, ev, tb)

    def __call__(self, fn: Callable) -> Callable:
        name, extras, to_metrics = self.name, self.extras, self.to_metrics
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with _Span(name, extras, to_metrics):
                    return await fn(*args, **kwargs)

            return awrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Span(name, extras, to_metrics):
                return fn(*args, **kwargs)

        return wrapper


def _linked(ex: dict | None, incoming: tuple) -> dict | None:
    """``ex`` plus the caller's link ``"p"`` when ``incoming`` belongs to the message being handled."""
    check = _incoming_check[0]
    try:
        if check is not None and not check(incoming[1]):
            return ex
    except Exception:  # noqa: BLE001 - a link is never worth a failed span
        return ex
    d = dict(ex) if ex else {}
    d["p"] = incoming[0]
    return d


def call_link() -> str | None:
    """A message is being sent: when a span is open in this context, a new link id, written as
    a ``"call"`` instant event (extras ``{"p": id}``) on the open span's track at this moment,
    so that the span that waits is found in the timeline; None outside any span, or in a task
    that outlived the span it was created in (one context variable read)."""
    span = _cur.get()
    if type(span) is not _Span or not span.sid or not _ON:
        return None
    link = _link_prefix + str(_next_link())
    _append((K_EVENT, _next_id(), _clock_ns(), span.lane, "call", _step(), {"p": link}))
    return link


def set_incoming(link: Any, token: Any = None) -> None:
    """The message being handled in this context was sent under the caller's span ``link``
    (:func:`call_link`): the spans that open here at top level carry ``"p": link``. ``token``
    identifies the message (checked by the hook in ``_incoming_check``)."""
    if type(link) is str:
        _cur.set((link, token))


_torch_loaded = [False]  # refreshed by the writer thread: keeps the torch check off the hot path


def _err(et: Any, ev: Any) -> str:
    try:
        return f"{getattr(et, '__name__', 'Error')}: {ev}"[:300]
    except Exception:  # noqa: BLE001
        return "Error"


def _span_metric(name: str, seconds: float) -> None:
    try:
        from forge_obs.recording.collector import record_metric
        from forge_obs.recording.reduce import Reduce

        record_metric(f"span/{name}/duration_s", seconds, Reduce.MEAN)
    except Exception:  # noqa: BLE001
        pass


def record_span(name: str, *, flow: Any = None, log_to_metrics: bool = False, **attrs: Any) -> _Span:
    """A time span named ``name`` on the caller's track (thread or asyncio task).

    Use as ``with record_span("fwd"):`` / ``async with`` or as a decorator ``@record_span("fwd")``.
    ``flow=<id>`` links spans and events that share the id (across actors) with arrows in the
    trace; ``log_to_metrics=True`` also records the duration as the metric
    ``span/<name>/duration_s`` (Reduce.MEAN); other keyword arguments are kept as attributes
    (JSON-serialisable values; anything else is written as its text). A span that raises is
    marked with the error. A span that never ends (a hang) is still written, and shown as
    unfinished. Never raises into the caller, for any name or attribute."""
    if flow is None and not attrs:
        return _Span(name if type(name) is str else safe_str(name), None, log_to_metrics)
    return _Span(safe_str(name), _extras(flow, attrs), log_to_metrics)


def record_event(name: str, *, flow: Any = None, **attrs: Any) -> None:
    """An instant event on the caller's track (``flow`` and attributes as for spans). Never
    raises: a name or attribute that cannot be written as JSON is written as its text."""
    if _ON and not (_torch_loaded[0] and _compiling()):
        _append((K_EVENT, _next_id(), _clock_ns(), _lane(), name if type(name) is str else safe_str(name), _step(),
                 _extras(flow, attrs)))


_user_steps = [False]  # set_step was called in this process: cuts no longer move its step


def follow_cut(next_step: int) -> None:
    """A flush cut this process: records made from now on belong to ``next_step`` (the step after
    the one cut), as its values do, unless this process tags its steps itself (:func:`set_step`)."""
    if not _user_steps[0]:
        _proc_step[0] = next_step
        if _ON:
            _append((K_STEP, _next_id(), _clock_ns(), _lane(), next_step))


def set_step(step: int) -> None:
    """Tag the following records with ``step``. Inside an asyncio task the step is scoped to that
    task (and tasks it creates); it is also the process-wide default for records made elsewhere.
    Without it, a mesh process's records take the step its values are cut in."""
    try:
        step = int(step)
    except Exception:  # noqa: BLE001 - not a step: ignored, never raised into the caller
        return
    _user_steps[0] = True
    _proc_step[0] = step
    if _get_running_loop() is not None and _current_task() is not None:
        _step_var.set(step)
    if _ON:
        _append((K_STEP, _next_id(), _clock_ns(), _lane(), step))


def get_step() -> int | None:
    """The step that new records are tagged with (None before any :func:`set_step`)."""
    return _step()


def add_step_tag(tag: str) -> None:
    """Tag the current step (e.g. ``"eval"``, ``"checkpoint"``, ``"weights_sync"``)."""
    if _ON:
        _append((K_TAG, _next_id(), _clock_ns(), _lane(), _step(), safe_str(tag)))


def is_enabled() -> bool:
    """Whether this process records (False when disabled or when its rank is not selected)."""
    return _ON


def _set_on(on: bool) -> None:
    global _ON
    _ON = bool(on) and not DISABLED
    if not _ON:
        _buf.clear()


def _swap_buffer(maxlen: int) -> deque:
    """Give the hot path a buffer of ``maxlen`` (keeping what the current one holds)."""
    global _buf, _append
    old = _buf
    if old.maxlen == maxlen:
        return old
    new: deque = deque(maxlen=maxlen)
    _buf, _append = new, new.append
    while old:  # entries appended to the old buffer while copying
        try:
            new.append(old.popleft())
        except IndexError:
            break
    return new


# -------------------------------------------------------------------- configuration
def configure(run_dir: Any = None, **options: Any) -> bool:
    """Start writing this process's timeline under ``<run_dir>/events/`` (a standalone script;
    with the actors, ``init_backends`` does this in every process). Options: ``ranks``
    (``"all"``, ``"0,3"``, ``"0-3,8"``, ``"every:4"``), ``max_file_mb``, ``max_files``,
    ``flush_interval_s``, ``open_after_s``, ``enabled``. Returns whether this process records."""
    from forge_obs.recording.timeline import writer

    return writer.configure(run_dir, dict(options))


def flush() -> None:
    """Write everything recorded so far (blocks until written)."""
    from forge_obs.recording.timeline import writer

    writer.flush()


def close() -> None:
    """Write everything, mark the file as cleanly closed and stop the writer thread. A later
    :func:`configure` starts a new file."""
    from forge_obs.recording.timeline import writer

    writer.close()
