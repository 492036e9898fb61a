"""The timeline's hot path: one span mechanism, instant events, steps and call links, appended
to a per-process bounded buffer; and the buffer's API for the writer.

Every span of forge_obs is a :class:`Span`: ``record_span``, ``@trace`` / ``Tracer``
(:mod:`forge_obs.recording.tracer`, with a hook that records its metrics) and TorchTitan's
``log_trace_span`` (:mod:`forge_obs.titan`); :func:`wrap` is the one decorator of sync and async
functions behind all three. Entering a span costs a few hundred ns and two appends of a tuple
(laid out as :mod:`~forge_obs.recording.timeline.records` defines); no I/O, no lock, no RPC.

**Call links.** The innermost open span of each context (thread, or asyncio task and the tasks
it creates) is kept in a context variable: :func:`call_link` gives the link an endpoint call
carries (:mod:`forge_obs.controller.call_context`), :func:`set_incoming` marks the link of the
message being handled, and the spans opened at top level while it is handled carry it.

**CPU time.** A span reads its thread's CPU clock (``time.thread_time_ns``: a system call,
0.2–0.6 µs on a VM, more than the rest of the span) at enter and exit, unless the last span of
the same name lasted under :data:`CPU_MIN_NS` (100 µs): such spans are cheap work where the two
reads would be ≥ 1 % of the span. So a name's first span carries its CPU time, a name whose
spans take ≥ 100 µs carries it every time, and a name whose spans got long again carries it
from the next one on. In an asyncio task that awaits inside the span, the figure includes the
other tasks the thread ran meanwhile.

The writer (:mod:`forge_obs.recording.timeline.writer`) takes the entries with :func:`take`;
:func:`set_recording`, :func:`use_capacity`, :func:`clear`, :func:`clock_ns` and
:func:`refresh_compile_check` are the rest of its API. Nothing here imports Monarch or torch.
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
from forge_obs.recording.timeline.records import (
    K_BEGIN,
    K_END,
    K_EVENT,
    K_LANE,
    K_STEP,
    K_TAG,
    X_ATTRS,
    X_FLOW,
    X_LINK,
)

__all__ = [
    "Span", "new_span", "wrap", "record_span", "record_event", "set_step", "add_step_tag", "get_step", "follow_cut",
    "is_enabled", "call_link", "in_span", "set_incoming", "link_check", "set_link_check",
    "DISABLED", "PRECONFIG_CAP", "BUFFER_CAP", "CPU_MIN_NS", "take", "pending", "clear", "set_recording",
    "use_capacity", "clock_ns", "set_clock", "refresh_compile_check",
]

#: the timeline is off for the whole process (read once)
DISABLED: bool = METRICS_DISABLED or env_flag("FORGE_DISABLE_TIMELINE")
#: entries kept before the process is configured (oldest dropped beyond)
PRECONFIG_CAP = 20_000
#: entries kept between two writer passes (oldest dropped beyond; the writer reports the loss)
BUFFER_CAP = 500_000
#: a span whose name's last span lasted less than this does not read the thread's CPU clock
CPU_MIN_NS = 100_000
#: names whose last span was shorter than CPU_MIN_NS (cleared when it holds this many)
_SHORT_MAX = 4096

_buf: deque = deque(maxlen=PRECONFIG_CAP)
_append = _buf.append
_next_id = itertools.count(1).__next__
_clock_ns = time.perf_counter_ns
_thread_ns = time.thread_time_ns
_get_ident = threading.get_ident
#: recording is on (False: disabled, or this rank is not selected by ``ranks``)
_ON: bool = not DISABLED
#: ``torch.compiler`` once torch is imported (None before: no check on the hot path); records are
#: skipped while ``torch.compiler.is_dynamo_compiling()`` (Dynamo folds it to True when it traces
#: the caller; eager, a function that returns False: ~40 ns, against ~60+ for ``is_compiling``)
_compiler: Any = None

_step_var: ContextVar[int | None] = ContextVar("forge_obs_timeline_step", default=None)
_proc_step: Any = None  # process-wide step (last set_step anywhere in the process, or the cut's)
_user_steps = False  # set_step was called in this process: cuts no longer move its step
_tracks: dict[int, "_Track"] = {}  # id of an asyncio task, or a thread's ident -> its track
_track_lock = threading.Lock()
_short: set = set()

#: in an asyncio task: the context's innermost open span (a task created in it inherits it; a
#: span that ended is no longer open: its ``sid`` is 0). In a message handler before any span
#: opened: the caller's link (an ``_Incoming``, :func:`set_incoming`). Outside tasks the open
#: span of a thread is kept on its track (a context variable's set and reset cost ~0.1 µs)
_cur: ContextVar[Any] = ContextVar("forge_obs_timeline_cur", default=None)
#: ``check(token)``: whether a link's message token is the message being handled (set by the
#: layer that knows the message; without one, a link holds for its context)
_link_check: Any = None
_link_prefix = f"{secrets.token_hex(4)}."
_next_link = itertools.count(1).__next__


class _Incoming:
    __slots__ = ("link", "token")

    def __init__(self, link: str, token: Any) -> None:
        self.link, self.token = link, token


# ---------------------------------------------------------------------------- tracks, steps
class _Track:
    """Where records are drawn: one per asyncio task (concurrent tasks get separate tracks),
    else one per thread; ``open``: outside tasks, the thread's innermost open span."""

    __slots__ = ("lane", "open")

    def __init__(self, lane: int) -> None:
        self.lane = lane
        self.open: Any = None


def _new_track(key: int, task: Any) -> _Track:
    with _track_lock:
        tr = _tracks.get(key)
        if tr is None:
            tr = _tracks[key] = _Track(len(_tracks))
            if task is not None:
                try:
                    label = task.get_name()
                except Exception:  # noqa: BLE001
                    label = "task"
            else:
                label = threading.current_thread().name
            _append((K_LANE, tr.lane, label, _get_ident()))
    return tr


def _track() -> _Track:
    """The caller's track."""
    loop = _get_running_loop()
    if loop is not None:
        task = _current_task(loop)
        if task is not None:
            return _tracks.get(id(task)) or _new_track(id(task), task)
    key = _get_ident()
    return _tracks.get(key) or _new_track(key, None)


def _lane() -> int:
    return _track().lane


def _step() -> int | None:
    s = _step_var.get()
    return s if s is not None else _proc_step


def _recording() -> bool:
    """Whether a record made now is kept (on, and not inside ``torch.compile`` tracing)."""
    return _ON and (_compiler is None or not _compiler.is_dynamo_compiling())


# ---------------------------------------------------------------------------- values
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
        d[X_FLOW] = _jsonable(flow)
    if attrs:
        d[X_ATTRS] = {k: _jsonable(v) for k, v in attrs.items()}
    return d


def _err(et: Any, ev: Any) -> str:
    try:
        return f"{getattr(et, '__name__', 'Error')}: {ev}"[:300]
    except Exception:  # noqa: BLE001
        return "Error"


def _linked(ex: dict | None, incoming: _Incoming) -> dict | None:
    """``ex`` plus the caller's link when ``incoming`` belongs to the message being handled."""
    check = _link_check
    try:
        if check is not None and not check(incoming.token):
            return ex
    except Exception:  # noqa: BLE001 - a link is never worth a failed span
        return ex
    d = dict(ex) if ex else {}
    d[X_LINK] = incoming.link
    return d


# ---------------------------------------------------------------------------- the span
class Span:
    """``record_span(name, *, flow=None, log_to_metrics=False, **attrs)``: a time span named
    ``name`` on the caller's track (thread or asyncio task).

    Use as ``with record_span("fwd"):`` / ``async with`` or as a decorator ``@record_span("fwd")``
    of sync and async functions (a fresh span per call, :func:`wrap`). ``flow=<id>`` links spans
    and events that share the id (across actors) with arrows in the trace;
    ``log_to_metrics=True`` also records the duration as the metric ``span/<name>/duration_s``
    (Reduce.MEAN); other keyword arguments are kept as attributes (JSON-serialisable values;
    anything else is written as its text). A span that raises is marked with the error. A span
    that never ends (a hang) is still written, and shown as unfinished. Never raises into the
    caller, for any name or attribute.

    ``hook(span, seconds)`` (:func:`new_span`) is called at exit with the span's duration, also
    when the timeline does not record (how ``@trace`` records its metrics); it never raises into
    the caller. ``t0`` / ``t1`` are the enter / exit times (``perf_counter_ns``)."""

    __slots__ = ("name", "extras", "hook", "sid", "t0", "t1", "tok", "up", "track", "cpu0")

    def __init__(self, name: str, *, flow: Any = None, log_to_metrics: bool = False, **attrs: Any) -> None:
        if flow is None and not attrs:
            self.name = name if type(name) is str else safe_str(name)
            self.extras = None
        else:
            self.name = safe_str(name)
            self.extras = _extras(flow, attrs)
        self.hook = _span_metric if log_to_metrics else None

    def __enter__(self) -> "Span":
        if _ON and (_compiler is None or not _compiler.is_dynamo_compiling()):
            sid = _next_id()
            self.sid = sid
            step = _step_var.get()
            if step is None:
                step = _proc_step
            ex = self.extras
            loop = _get_running_loop()
            task = _current_task(loop) if loop is not None else None
            if task is None:  # a thread's track: its open span is kept there
                key = _get_ident()
                tr = _tracks.get(key) or _new_track(key, None)
                up = tr.open
                if up is None or not up.sid:  # top level: the handled message's link, if any
                    cur = _cur.get()
                    if cur is not None and type(cur) is _Incoming:
                        ex = _linked(ex, cur)
                tr.open = self
                self.up = up
                self.tok = tr
            else:  # an asyncio task: the open span is in the context (tasks created here inherit it)
                tr = _tracks.get(id(task)) or _new_track(id(task), task)
                cur = _cur.get()
                if cur is None:
                    self.tok = _cur.set(self)
                elif type(cur) is _Incoming:
                    ex = _linked(ex, cur)
                    self.tok = _cur.set(self)
                elif cur.sid and cur.track is tr:  # nested in the task's open span: that one's
                    self.tok = None  # track is what the call links need
                else:
                    self.tok = _cur.set(self)
            self.track = tr
            lane = tr.lane
            name = self.name
            cpu = None if name in _short else _thread_ns()
            self.cpu0 = cpu
            t = _clock_ns()
            self.t0 = t
            _append((K_BEGIN, sid, t, lane, name, step, ex, cpu))
        else:
            self.sid = 0
            self.t0 = _clock_ns()
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        t = self.t1 = _clock_ns()
        sid = self.sid
        if sid:
            self.sid = 0
            cpu = self.cpu0
            if cpu is None:
                if t - self.t0 >= CPU_MIN_NS and _short:
                    _short.discard(self.name)
            else:
                cpu = _thread_ns()
                if t - self.t0 < CPU_MIN_NS:
                    _short_name(self.name)
            tok = self.tok
            if type(tok) is _Track:
                tok.open = self.up
            elif tok is not None:
                try:
                    _cur.reset(tok)
                except ValueError:  # ended in another context than it began in: that one keeps its mark
                    pass
            _append((K_END, sid, t, None if ev is None else _err(et, ev), cpu))
        hook = self.hook
        if hook is not None:
            try:
                hook(self, (t - self.t0) / 1e9)
            except Exception:  # noqa: BLE001 - a hook never fails the caller's code
                pass

    async def __aenter__(self) -> "Span":
        return self.__enter__()

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.__exit__(et, ev, tb)

    def __call__(self, fn: Callable) -> Callable:
        return wrap(fn, new_span, self.name, self.extras, self.hook)

    def child(self, name: str, t0_ns: int, t1_ns: int) -> None:
        """Record a finished span ``name`` from ``t0_ns`` to ``t1_ns`` inside this open span, on
        its track (a Tracer's steps)."""
        if self.sid and _ON:
            sid = _next_id()
            _append((K_BEGIN, sid, t0_ns, self.track.lane, name, _step(), None, None))
            _append((K_END, sid, t1_ns, None, None))


record_span = Span


def new_span(name: str, extras: dict | None = None, hook: Any = None) -> Span:
    """A span of a name and extras already checked (``@record_span``'s calls, ``@trace``, a
    Tracer), with an exit ``hook(span, seconds)``."""
    s = _new(Span)
    s.name = name
    s.extras = extras
    s.hook = hook
    return s


_new = object.__new__


def _short_name(name: str) -> None:
    if len(_short) >= _SHORT_MAX:
        _short.clear()
    _short.add(name)


def wrap(fn: Callable, factory: Callable, *args: Any) -> Callable:
    """``fn`` decorated: each call runs inside a fresh ``factory(*args)`` context manager (a
    :class:`Span`, a Tracer). The one wrapper of sync and async functions behind ``record_span``,
    ``@trace`` and ``log_trace_span``. It captures only ``fn``, ``factory`` and ``args``: a
    wrapper on a class of a user's ``__main__`` is pickled by value (Monarch sends the class to
    its processes), so they must travel (module-level functions and classes, plain values)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapper(*a: Any, **kw: Any) -> Any:
            with factory(*args):
                return await fn(*a, **kw)

        return awrapper

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        with factory(*args):
            return fn(*a, **kw)

    return wrapper


def _span_metric(span: Span, seconds: float) -> None:
    from forge_obs.recording.collector import record_metric
    from forge_obs.recording.reduce import Reduce

    record_metric(f"span/{span.name}/duration_s", seconds, Reduce.MEAN)


def record_event(name: str, *, flow: Any = None, **attrs: Any) -> None:
    """An instant event on the caller's track (``flow`` and attributes as for spans). Never
    raises: a name or attribute that cannot be written as JSON is written as its text."""
    if _recording():
        _append((K_EVENT, _next_id(), _clock_ns(), _lane(), name if type(name) is str else safe_str(name), _step(),
                 _extras(flow, attrs)))


# ---------------------------------------------------------------------------- call links
def _open_span() -> "Span | None":
    """The innermost span open in this context: the asyncio task's (or inherited from the task
    that created it), else the thread's."""
    span = _cur.get()
    if type(span) is Span and span.sid:
        return span
    tr = _tracks.get(_get_ident())
    span = tr.open if tr is not None else None
    return span if span is not None and span.sid else None


def call_link() -> str | None:
    """A message is being sent: when a span is open in this context, a new link id, written as
    a ``"call"`` instant event (extras ``{"p": id}``) on the open span's track at this moment,
    so that the span that waits is found in the timeline; None outside any span, or in a task
    that outlived the span it was created in."""
    span = _open_span()
    if span is None or not _ON:
        return None
    link = _link_prefix + str(_next_link())
    _append((K_EVENT, _next_id(), _clock_ns(), span.track.lane, "call", _step(), {X_LINK: link}))
    return link


def in_span() -> bool:
    """Whether a span is open in this context (what :func:`call_link` checks first)."""
    return _open_span() is not None


def set_incoming(link: Any, token: Any = None) -> None:
    """The message being handled in this context was sent under the caller's span ``link``
    (:func:`call_link`): the spans that open here at top level carry ``"p": link``. ``token``
    identifies the message (checked by :func:`set_link_check`'s function). ``link=None`` clears
    it."""
    if type(link) is str:
        _cur.set(_Incoming(link, token))
    elif link is None:
        _cur.set(None)


def link_check() -> Any:
    """The function that tells whether a link's token is the message being handled (or None)."""
    return _link_check


def set_link_check(check: Any) -> None:
    """Set that function (``check(token) -> bool``; None: a link holds for its context)."""
    global _link_check
    _link_check = check


# ---------------------------------------------------------------------------- steps
def follow_cut(next_step: int) -> None:
    """A flush cut this process: records made from now on belong to ``next_step`` (the step after
    the one cut), as its values do, unless this process tags its steps itself (:func:`set_step`)."""
    global _proc_step
    if not _user_steps:
        _proc_step = next_step
        if _ON:
            _append((K_STEP, _next_id(), _clock_ns(), _lane(), next_step))


def set_step(step: int) -> None:
    """Tag the following records with ``step``. Inside an asyncio task the step is scoped to that
    task (and tasks it creates); it is also the process-wide default for records made elsewhere.
    Without it, a mesh process's records take the step its values are cut in."""
    global _proc_step, _user_steps
    try:
        step = int(step)
    except Exception:  # noqa: BLE001 - not a step: ignored, never raised into the caller
        return
    _user_steps = True
    _proc_step = step
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


# ---------------------------------------------------------------------------- the writer's API
def take(limit: int) -> list:
    """Remove and return the oldest entries, at most ``limit`` (the writer's pass)."""
    buf = _buf
    pop = buf.popleft
    out: list = []
    add = out.append
    for _ in range(min(limit, len(buf))):
        try:
            add(pop())
        except IndexError:
            break
    return out


def pending() -> int:
    """Entries waiting for the writer."""
    return len(_buf)


def clear() -> None:
    """Drop every entry waiting for the writer."""
    _buf.clear()


def set_recording(on: bool) -> None:
    """Record from now on (``on``), or stop and drop what waits (never on when disabled)."""
    global _ON
    _ON = bool(on) and not DISABLED
    if not _ON:
        _buf.clear()


def use_capacity(maxlen: int) -> None:
    """Give the hot path a buffer of ``maxlen`` entries (keeping what the current one holds)."""
    global _buf, _append
    old = _buf
    if old.maxlen == maxlen:
        return
    new: deque = deque(maxlen=maxlen)
    _buf, _append = new, new.append
    while old:  # entries appended to the old buffer while copying
        try:
            new.append(old.popleft())
        except IndexError:
            break


def clock_ns() -> int:
    """The recording clock (span times are taken with it)."""
    return _clock_ns()


def set_clock(clock: Callable[[], int] | None) -> None:
    """Record with ``clock`` (ns; tests simulate time with it); None: ``time.perf_counter_ns``."""
    global _clock_ns
    _clock_ns = clock or time.perf_counter_ns


def refresh_compile_check() -> None:
    """Check ``torch.compiler.is_dynamo_compiling()`` on the hot path once torch is imported (the
    writer calls this every pass, so the check costs nothing in a process without torch)."""
    global _compiler
    if _compiler is None and "torch" in sys.modules:
        compiler = getattr(sys.modules["torch"], "compiler", None)
        if callable(getattr(compiler, "is_dynamo_compiling", None)):
            _compiler = compiler
