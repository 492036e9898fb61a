"""Tracer and ``@trace``: time code blocks and endpoints on the CPU or the GPU, never syncing.

    from forge_obs import Tracer, trace

    t = Tracer("trainer/step", timer="gpu", track_memory=True)
    t.start()
    loss = model(batch); t.step("forward")
    loss.backward();      t.step("backward")
    t.stop()              # records one more CUDA event and queues the timing; never waits for the GPU

    @trace("generator/generate")            # sync or async functions, Monarch endpoints too
    async def generate(self, prompt): ...

    with trace("reward", timer="cpu") as t:  # context manager yielding the Tracer
        ...; t.step("score")

Every ``@trace`` call, ``with trace()`` block and Tracer region is also a timeline span named
``prefix`` (a Tracer's steps: spans ``prefix/<step>`` inside it), linked to the calling span like
``record_span``'s: the one span mechanism of :mod:`forge_obs.recording.timeline.recorder`, with
an exit hook that records the metrics.

Metric names (torchforge's): ``{prefix}/{step}/duration_avg_s`` (MEAN), ``…/duration_max_s``
(MAX), ``{prefix}/total_duration_avg_s``, ``{prefix}/total_duration_max_s``, with
``track_memory``: ``{prefix}/memory_delta_end_start_avg_gb`` (MEAN) and
``{prefix}/memory_peak_max_gb`` (MAX); in addition ``{prefix}/{step}/duration_dist_s`` and
``{prefix}/total_duration_dist_s`` (the ``distribution`` reduction of :mod:`forge_obs.recording.sketch`:
``{"p50", "p90", "p99", "count"}``, 1 % relative error, merged exactly across ranks).

``timer="gpu"`` records a CUDA event on the current stream at ``start``/``step``/``stop``; the
durations (GPU time between the events) are resolved later by a background poller thread once the
events completed, or at the next flush, whichever comes first; a flush includes every timing whose
``stop()`` ran before it (the *flushing* thread waits for those events, the training thread never
does). Without CUDA, ``timer="gpu"`` falls back to CPU timing with one warning. See docs/tracer.md for ``track_memory``'s exact semantics.

Switches, read when a Tracer is created (``@trace``: when it decorates), as torchforge reads
them: ``DISABLE_PERF_METRICS=true`` (torchforge's name), ``FORGE_DISABLE_PERF_METRICS=true`` or
``FORGE_DISABLE_METRICS=true`` turn the Tracer into a no-op and ``@trace`` into the identity;
``METRIC_TIMER_USES_GPU=true|false`` forces the GPU / CPU timer whatever ``timer`` says.

Misuse is a programming error and raises ``ValueError``, as in torchforge: ``step()`` or
``stop()`` before ``start()``, ``start()`` while started, an unknown ``timer``. Nothing else raises
(a CUDA error falls back to CPU timing with one warning). This module imports torch only when a
GPU timer or memory tracking is first used.
"""

from __future__ import annotations

import atexit
import contextvars
import itertools
import logging
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from forge_obs.core.env import perf_metrics_disabled, timer_uses_gpu, tracer_switches
from forge_obs.core.safe import safe_str
from forge_obs.recording.collector import MetricCollector, record_metric
from forge_obs.recording.reduce import Reduce
from forge_obs.recording.sketch import DISTRIBUTION
from forge_obs.recording.timeline.recorder import clock_ns, new_span, wrap

__all__ = ["Tracer", "trace", "set_record_hook", "TimerCPU", "TimerCUDA"]

logger = logging.getLogger("forge_obs")

_clock_s = time.perf_counter
_clock_ns = clock_ns  # the timeline's clock: a region's metrics and its span time one interval
_MEAN, _MAX = Reduce.MEAN, Reduce.MAX
_GIB = float(1 << 30)

_C = MetricCollector()


# ---------------------------------------------------------------------------- recording
_step_keys_cache: dict[tuple[str, str], tuple[str, str, str]] = {}
_total_keys_cache: dict[str, tuple[str, str, str]] = {}


def _step_keys(prefix: str, name: Any) -> tuple[str, str, str]:
    k = _step_keys_cache.get((prefix, name)) if type(name) is str else None
    if k is None:
        name = name if type(name) is str else safe_str(name)
        base = f"{prefix}/{name}/duration_"
        k = _step_keys_cache[(prefix, name)] = (base + "avg_s", base + "max_s", base + "dist_s")
    return k


def _total_keys(prefix: str) -> tuple[str, str, str]:
    k = _total_keys_cache.get(prefix)
    if k is None:
        base = f"{prefix}/total_duration_"
        k = _total_keys_cache[prefix] = (base + "avg_s", base + "max_s", base + "dist_s")
    return k


#: the reductions of a duration's (avg, max, dist) keys
_REDS = (_MEAN, _MAX, DISTRIBUTION)
_record_groups = _C.record_groups
_RECORD_METRIC = record_metric


def set_record_hook(fn: Callable[[str, Any, Any], None] | None) -> None:
    """Route the tracer's values through ``fn(key, value, reduction)`` (None: the collector).

    What replacing ``forge_obs.perf_tracker.record_metric`` does (torchforge's tests mock it):
    the durations' avg/max keys and the memory keys are recorded with ``fn``, one call per value,
    as torchforge's Tracer does; the ``…_dist_s`` keys (forge_obs's own) still go to the collector."""
    global _record_groups, record_metric
    if fn is None or fn is _RECORD_METRIC:
        _record_groups, record_metric = _C.record_groups, _RECORD_METRIC
        return

    def through_hook(pairs: list, reductions: tuple) -> None:
        for keys, v in pairs:
            for key, red in zip(keys, reductions):
                if red is DISTRIBUTION:
                    _RECORD_METRIC(key, v, DISTRIBUTION)
                else:
                    fn(key, v, red)

    _record_groups, record_metric = through_hook, fn


def _record_total(span: Any, seconds: float) -> None:
    """Record a ``@trace`` call's total duration under its prefix's (avg, max, dist) keys: the
    exit hook of its span.

    ``@trace``'s wrappers capture this module-level function, the span factory and the prefix,
    and nothing else of this module: a wrapper on a class defined in a user's ``__main__`` is
    pickled by value (Monarch sends the class to its processes), and a module-level function
    travels by reference, while the collector it records into (its lock) could not travel."""
    _record_groups([(_total_keys_cache.get(span.name) or _total_keys(span.name), seconds)], _REDS)


def _emit_durations(pairs: list) -> None:
    """Record ``[(key_triple, seconds), ...]`` (avg/max/dist keys of a duration) through the
    collector, under one lock acquisition (:meth:`MetricCollector.record_groups`)."""
    _record_groups(pairs, _REDS)


def _duration_pairs(prefix: str, steps: list, total: float) -> list:
    get = _step_keys_cache.get
    pairs = [((type(name) is str and get((prefix, name))) or _step_keys(prefix, name), d) for name, d in steps]
    pairs.append((_total_keys_cache.get(prefix) or _total_keys(prefix), total))
    return pairs


_warned: set[str] = set()


def _warn_once(kind: str, msg: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        logger.warning("forge_obs: %s", msg)


_cuda_ok: bool | None = None


def _cuda_available() -> bool:
    """Whether CUDA can be used (cached once it is: ``torch.cuda.is_available()`` costs µs)."""
    global _cuda_ok
    if _cuda_ok:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811
        except ImportError:
            return False
    try:
        _cuda_ok = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        _cuda_ok = False
    return _cuda_ok


# ---------------------------------------------------------------------------- memory
class _CudaMemory:
    """The device-memory counters ``track_memory`` reads (the current CUDA device's caching
    allocator: host-side counters, no device sync): the same ``torch.cuda`` functions as
    torchforge's Tracer, so that what stands in for them in its tests stands in here too. Tests
    may also substitute a fake for the whole object."""

    def available(self) -> bool:
        torch = sys.modules.get("torch") or _torch_mod()
        try:
            return bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001
            return False

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated()

    def reset_peak(self) -> None:
        import torch

        _quiet_reset_warning()
        torch.cuda.reset_max_memory_allocated()


_reset_filtered = [False]


def _quiet_reset_warning() -> None:
    """``reset_max_memory_allocated`` (what torchforge calls) warns that it resets every peak
    statistic: that is what a tracked region wants, so that one warning is silenced."""
    if not _reset_filtered[0]:
        _reset_filtered[0] = True
        import warnings

        warnings.filterwarnings("ignore", message="torch.cuda.reset_max_memory_allocated now calls", category=FutureWarning)


_MEMORY: Any = _CudaMemory()


class _MemoryOwner:
    """At most one tracked region per process at a time: the outermost one.

    The device's peak counter is process-wide, so a region started while another is tracked
    (nested, or a concurrent asyncio task / thread) does not reset it and reports no memory
    metrics; it never releases the owner's claim either. A claim is released by the owner's
    ``stop()`` (always reached by ``@trace`` / ``with trace`` through try/finally), or when the
    owning Tracer is restarted or garbage-collected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: tuple[Any, int] | None = None  # (weakref to Tracer, token)
        self._tokens = itertools.count(1)

    def _held(self) -> bool:
        o = self._owner
        if o is None:
            return False
        t = o[0]()
        return t is not None and t._mem_token == o[1] and t._active

    def acquire(self, tracer: "Tracer") -> int:
        """Claim tracking for ``tracer``; returns a token (0: not the outermost, not tracked)."""
        mem = _MEMORY
        if not mem.available():
            _warn_once("memory_no_cuda", "Tracer(track_memory=True): CUDA is not available; memory is not tracked")
            return 0
        with self._lock:
            if self._held():
                _warn_once(f"nested:{tracer.prefix}", f"Nested memory tracking detected in {tracer.prefix}. Skipping inner tracking.")
                return 0
            token = next(self._tokens)
            self._owner = (weakref.ref(tracer), token)
        tracer._mem_token = token
        mem.reset_peak()
        tracer._mem_start = mem.allocated()
        return token

    def release(self, tracer: "Tracer", token: int) -> tuple[float, float] | None:
        """End ``tracer``'s claim; returns (delta bytes, peak bytes) or None if not the owner."""
        with self._lock:
            o = self._owner
            if o is None or o[1] != token or o[0]() is not tracer:
                return None
            self._owner = None
        mem = _MEMORY
        return float(mem.allocated() - tracer._mem_start), float(mem.peak())


_OWNER = _MemoryOwner()


# ---------------------------------------------------------------------------- GPU timings
_torch: Any = None
_stream_cache: dict[tuple[int, int], Any] = {}


def _torch_mod() -> Any:
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


def _current_device() -> int:
    torch = _torch or _torch_mod()
    try:
        return torch._C._cuda_getDevice()
    except AttributeError:  # private API gone: the public one
        return torch.cuda.current_device()


def _record(ev: Any, dev: int) -> None:
    """``ev.record()`` on the current stream of ``dev``, without the µs that
    ``torch.cuda.current_stream()`` spends building a Stream object per call: the raw stream
    handle (one C call) keys a cache of Stream objects (PyTorch's pool streams live as long as
    the process)."""
    torch = _torch or _torch_mod()
    try:
        raw = torch._C._cuda_getCurrentRawStream(dev)
        s = _stream_cache.get((dev, raw))
        if s is None:
            s = _stream_cache[(dev, raw)] = torch.cuda.current_stream(dev)
        torch._C._CudaEventBase.record(ev, s)
    except AttributeError:  # private API gone: the public one
        ev.record()


class _GpuTimings:
    """Pending CUDA-event timings: resolved by a poller thread once complete, or at flush."""

    poll_interval_s = 0.005
    max_pending = 100_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pending: deque = deque()  # (prefix, step names, events, device index)
        self._pool: dict[int, list[Any]] = {}
        self._thread: threading.Thread | None = None
        self._hooked = False
        self._stopping = False
        self.dropped = 0
        self.resolved = 0  # records resolved so far (by the poller or a flush)
        self._resolved_cv = threading.Condition()

    def event(self, dev: int) -> Any:
        pool = self._pool.get(dev)
        if pool:
            try:
                return pool.pop()
            except IndexError:
                pass
        return (_torch or _torch_mod()).cuda.Event(enable_timing=True)

    def submit(self, prefix: str, names: list, events: list, dev: int) -> None:
        if not self._hooked:
            self._install()
        with self._cv:
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                _warn_once("gpu_pending", "Tracer(timer='gpu'): too many unresolved GPU timings; oldest dropped")
                self._pending.popleft()
            self._pending.append((prefix, names, events, dev))
            self._cv.notify()

    def _install(self) -> None:
        with self._lock:
            if self._hooked:
                return
            _C.add_cut_hook(self)
            self._start_poller()
            self._hooked = True

    def _start_poller(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._poll, name="forge_obs-gpu-timer", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the poller thread (at process exit; pending timings are still taken at the next
        cut). True if it ended within ``timeout_s``."""
        atexit.unregister(self.stop)
        t = self._thread
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
        return t is None or not t.is_alive()

    def _take(self, wait: bool) -> list:
        """Pop the records whose events completed, oldest first, up to the first that has not
        (events complete in the order they were queued on a stream); all of them if ``wait``."""
        out = []
        with self._lock:
            p = self._pending
            if wait:
                out = list(p)
                p.clear()
                return out
            while p and p[0][2][-1].query():
                out.append(p.popleft())
        return out

    def _resolve(self, recs: list) -> list:
        items: list = []
        for prefix, names, events, dev in recs:
            try:
                for e in events:  # at once for completed events (they may sit on several streams)
                    e.synchronize()
                steps = [(n, events[i].elapsed_time(events[i + 1]) / 1000.0) for i, n in enumerate(names)]
                total = events[0].elapsed_time(events[-1]) / 1000.0
            except Exception as e:  # noqa: BLE001 - one bad record never loses the others
                _warn_once("gpu_resolve", f"Tracer({prefix!r}): GPU timing could not be read: {e!r}")
                continue
            items += _duration_pairs(prefix, steps, total)
            self._pool.setdefault(dev, []).extend(events)
        if recs:
            with self._resolved_cv:
                self.resolved += len(recs)
                self._resolved_cv.notify_all()
        return items

    def wait_resolved(self, n: int, timeout: float) -> bool:
        """Block until ``n`` records were resolved in total (tests, benchmarks)."""
        with self._resolved_cv:
            return self._resolved_cv.wait_for(lambda: self.resolved >= n, timeout)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _poll(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
            time.sleep(self.poll_interval_s)  # a poll interval: events complete on the GPU's clock
            try:
                recs = self._take(wait=False)
                if recs:
                    _emit_durations(self._resolve(recs))
            except Exception as e:  # noqa: BLE001 - never let the poller die
                _warn_once("gpu_poll", f"GPU timer poller: {e!r}")

    def take(self) -> list:
        """At a cut (device hook): the pending timings belong to the step being cut. O(1)-ish: a
        list swap, no wait on the GPU."""
        return self._take(wait=True)

    def resolve(self, recs: list, taken: Any) -> None:
        """At export (device hook): wait for the taken timings' events on the exporting thread,
        never on the training thread, and add them to the step's values (``taken``: the
        collector's :class:`~forge_obs.recording.collector.Taken` of the cut)."""
        for keys, d in self._resolve(recs):
            for key, red in zip(keys, _REDS):
                taken.add(key, d, red)

    def resolve_now(self) -> None:
        """Wait for and record every pending GPU timing (tests, shutdown)."""
        _emit_durations(self._resolve(self._take(wait=True)))


_GPU = _GpuTimings()


# ---------------------------------------------------------------------------- Tracer
class Tracer:
    """Times a region: ``start()``, any number of ``step(name)``, ``stop()``; reusable.

    The region is a timeline span named ``prefix`` (linked to the calling span as a
    ``record_span`` is), and each step a span ``{prefix}/{name}`` inside it: the host's
    intervals between the calls (with ``timer="gpu"`` the metrics are GPU time).

    Args:
        prefix: metric name prefix, e.g. ``"trainer/step"``.
        track_memory: record the device-memory delta and peak of the region (outermost tracked
            region only; see docs/tracer.md).
        timer: ``"cpu"`` (the timeline's clock, ``time.perf_counter_ns``) or ``"gpu"`` (CUDA
            events on the current stream, resolved asynchronously; falls back to ``"cpu"``
            without CUDA). ``METRIC_TIMER_USES_GPU`` overrides it.

    Raises ``ValueError`` for an unknown ``timer``, and for ``step``/``stop`` before ``start``
    and ``start`` while started (programming errors, as in torchforge), unless disabled.
    """

    # defaults at class level: a Tracer is created per decorated call, so __init__ stays short
    _gpu = False
    _active = False
    _last = 0  # ns: start, or the last step
    _steps: list = []  # (name, start ns, end ns) per step
    _span: Any = None
    _names: list = []
    _events: list = []
    _dev = 0
    _mem_token = 0
    _mem_start = 0

    def __init__(self, prefix: str, track_memory: bool = False, timer: str = "cpu") -> None:
        if timer != "cpu" and timer != "gpu":
            raise ValueError(f'timer must be "cpu" or "gpu", got {timer!r}')
        self.prefix = prefix if type(prefix) is str else safe_str(prefix)
        self.track_memory = track_memory
        self.timer = timer
        self._disable, forced = tracer_switches()
        if forced is not None:
            timer = "gpu" if forced else "cpu"
        if timer == "gpu" and not self._disable:
            if _cuda_available():
                self._gpu = True
            else:
                _warn_once("gpu_timer_no_cuda", "Tracer(timer='gpu'): CUDA is not available; using CPU timing")

    @property
    def active(self) -> bool:
        return self._active

    @property
    def _timer(self) -> "TimerCPU | TimerCUDA | None":
        """torchforge's timer object of a started Tracer (a view: ``TimerCUDA`` for CUDA-event
        timing, ``TimerCPU`` otherwise; durations in ms); None when stopped."""
        if not self._active:
            return None
        if self._gpu:
            return TimerCUDA._view(self)
        return TimerCPU._view(self)

    def start(self) -> "Tracer":
        if self._disable:
            return self
        if self._active:
            raise ValueError(f"Tracer({self.prefix!r}) has already been started")
        self._active = True
        if self.track_memory:
            try:
                _OWNER.acquire(self)
            except Exception as e:  # noqa: BLE001 - never raise into the training step
                _warn_once("memory_error", f"Tracer({self.prefix!r}): device memory could not be read: {e!r}")
        if self._gpu and not self._gpu_start():
            self._gpu = False
        self._steps = []
        span = self._span = new_span(self.prefix)  # holds nothing of the Tracer: an abandoned one is collected
        span.__enter__()
        self._last = span.t0
        return self

    def _gpu_start(self) -> bool:
        try:
            self._dev = dev = _current_device()
            ev = _GPU.event(dev)
            _record(ev, dev)
            self._events = [ev]
            self._names = []
            return True
        except Exception as e:  # noqa: BLE001 - CUDA unusable: time this region on the CPU
            _warn_once("gpu_start", f"Tracer({self.prefix!r}) could not record a CUDA event ({e!r}); using CPU timing")
            return False

    def step(self, name: str) -> None:
        if not self._active:
            if self._disable:
                return
            raise ValueError(f"Tracer({self.prefix!r}) must be started before calling step")
        now = _clock_ns()
        if self._gpu:
            try:
                ev = _GPU.event(self._dev)
                _record(ev, self._dev)
                self._events.append(ev)
                self._names.append(name)
            except Exception as e:  # noqa: BLE001
                _warn_once("gpu_step", f"Tracer({self.prefix!r}).step could not record a CUDA event: {e!r}")
        self._steps.append((name, self._last, now))
        self._last = now

    def stop(self) -> None:
        self._stop(None, None)

    def _stop(self, et: Any, ev: Any) -> None:
        """End the region (``ev``: the exception that ended it, marked on its span)."""
        if not self._active:
            if self._disable:
                return
            raise ValueError(f"Tracer({self.prefix!r}) must be started before calling stop")
        span = self._span
        try:
            for name, a, b in self._steps:
                span.child(_step_span_name(self.prefix, name), a, b)
            if self._gpu:
                self._gpu_stop()
            span.__exit__(et, ev, None)
            if not self._gpu:
                steps = [(name, (b - a) / 1e9) for name, a, b in self._steps]
                _record_groups(_duration_pairs(self.prefix, steps, (span.t1 - span.t0) / 1e9), _REDS)
        except Exception as e:  # noqa: BLE001 - never raise into the training step
            _warn_once("stop_error", f"Tracer({self.prefix!r}).stop() could not record its timings: {e!r}")
        finally:
            if self._mem_token:
                self._end_memory(record=True)
            self._active = False

    def _gpu_stop(self) -> None:
        try:
            ev = _GPU.event(self._dev)
            _record(ev, self._dev)
            self._events.append(ev)
            _GPU.submit(self.prefix, self._names, self._events, self._dev)
        except Exception as e:  # noqa: BLE001 - never raise into the training step
            _warn_once("gpu_stop", f"Tracer({self.prefix!r}) could not queue its GPU timing: {e!r}")
        self._events = []
        self._names = []

    def _end_memory(self, record: bool) -> None:
        tok = self._mem_token
        if not tok:
            return
        self._mem_token = 0
        try:
            res = _OWNER.release(self, tok)
        except Exception as e:  # noqa: BLE001 - never raise into the training step
            _warn_once("memory_error", f"Tracer({self.prefix!r}): device memory could not be read: {e!r}")
            return
        if res is not None and record:
            delta, peak = res
            p = self.prefix
            record_metric(f"{p}/memory_delta_end_start_avg_gb", delta / _GIB, _MEAN)
            record_metric(f"{p}/memory_peak_max_gb", peak / _GIB, _MAX)

    def __enter__(self) -> "Tracer":
        return self.start()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self._stop(et, ev)


_step_span_names: dict[tuple[str, str], str] = {}


def _step_span_name(prefix: str, name: Any) -> str:
    key = (prefix, name) if type(name) is str else None
    s = _step_span_names.get(key) if key is not None else None
    if s is None:
        s = f"{prefix}/{name if type(name) is str else safe_str(name)}"
        if key is not None and len(_step_span_names) < 65536:
            _step_span_names[key] = s
    return s


# ---------------------------------------------------------------------------- torchforge's timers
class TimerCPU:
    """torchforge's CPU timer: ``start()``, ``step(name)``, ``get_all_durations()`` ->
    ``([(name, ms), ...], ms since the last step)``. A :class:`Tracer` does not use it (it times
    with ``perf_counter`` itself); ``tracer._timer`` is a view of a started Tracer's steps."""

    def __init__(self) -> None:
        self._durations: list[tuple[str, float]] = []
        self._chain_start: float | None = None

    @classmethod
    def _view(cls, tracer: Tracer) -> "TimerCPU":
        t = cls()
        t._durations = [(n, (b - a) / 1e6) for n, a, b in tracer._steps]
        t._chain_start = tracer._last / 1e9
        return t

    def start(self) -> None:
        self._durations = []
        self._chain_start = _clock_s()

    def step(self, name: str) -> None:
        if self._chain_start is None:
            raise ValueError("Timer must be started before calling step")
        now = _clock_s()
        self._durations.append((name, (now - self._chain_start) * 1000.0))
        self._chain_start = now

    def get_all_durations(self) -> tuple[list[tuple[str, float]], float]:
        last = 0.0 if self._chain_start is None else (_clock_s() - self._chain_start) * 1000.0
        return list(self._durations), last


class TimerCUDA:
    """torchforge's CUDA-event timer: the same interface as :class:`TimerCPU`;
    ``get_all_durations()`` waits for the events (a Tracer never does: its GPU timings are
    resolved in the background). Needs CUDA."""

    def __init__(self) -> None:
        if not _cuda_available():
            raise RuntimeError("CUDA is not available for timing")
        self._names: list[str] = []
        self._events: list[Any] = []

    @classmethod
    def _view(cls, tracer: Tracer) -> "TimerCUDA":
        t = cls.__new__(cls)
        t._names = list(tracer._names)
        t._events = list(tracer._events)
        return t

    def _event(self) -> Any:
        torch = _torch or _torch_mod()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self._names = []
        self._events = [self._event()]

    def step(self, name: str) -> None:
        if not self._events:
            raise ValueError("Timer must be started before calling step")
        self._events.append(self._event())
        self._names.append(name)

    def get_all_durations(self) -> tuple[list[tuple[str, float]], float]:
        if not self._events:
            return [], 0.0
        end = self._event()
        end.synchronize()
        evs = self._events
        steps = [(n, evs[i].elapsed_time(evs[i + 1])) for i, n in enumerate(self._names)]
        return steps, evs[-1].elapsed_time(end)


_open_var: contextvars.ContextVar[tuple] = contextvars.ContextVar("forge_obs_open_traces", default=())


class trace:
    """``@trace(prefix, track_memory=False, timer="cpu")`` on a sync or async function (a
    Monarch ``@endpoint`` too: put ``@endpoint`` above ``@trace``), or ``with trace(...) as t``
    (also ``async with``). Each call / ``with`` uses its own :class:`Tracer`, so concurrent calls
    never share state; a call that raises is still timed (and its memory claim released)."""

    def __init__(self, prefix: str, track_memory: bool = False, timer: str = "cpu") -> None:
        if timer not in ("cpu", "gpu"):
            raise ValueError(f'timer must be "cpu" or "gpu", got {timer!r}')
        self.prefix = prefix if type(prefix) is str else safe_str(prefix)
        self.track_memory = track_memory
        self.timer = timer

    # ------------------------------------------------------------ decorator
    def __call__(self, fn: Callable) -> Callable:
        if perf_metrics_disabled():  # read when decorating (torchforge: per call)
            return fn
        prefix, mem, timer = self.prefix, self.track_memory, self.timer
        forced = timer_uses_gpu()
        if forced is not None:
            timer = "gpu" if forced else "cpu"
        simple = not mem and (timer == "cpu" or not _cuda_available())
        if timer == "gpu" and simple:
            _warn_once("gpu_timer_no_cuda", "Tracer(timer='gpu'): CUDA is not available; using CPU timing")
        if simple:  # a span whose exit records the total: no Tracer object per call
            _total_keys(prefix)
            return wrap(fn, new_span, prefix, None, _record_total)
        return wrap(fn, Tracer, prefix, mem, timer)

    # ------------------------------------------------------------ context manager
    # The open tracers live in a context variable, not on the object: one ``trace`` object may
    # be entered by several asyncio tasks / threads at once (each has its own context) and
    # re-entered (nested) within one.
    def __enter__(self) -> Tracer:
        t = Tracer(self.prefix, self.track_memory, self.timer)
        _open_var.set(_open_var.get() + ((self, t),))
        return t.start()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        stack = _open_var.get()
        for i, (owner, tracer) in reversed(list(enumerate(stack))):
            if owner is self:
                _open_var.set(stack[:i] + stack[i + 1 :])
                tracer._stop(et, ev)
                return

    async def __aenter__(self) -> Tracer:
        return self.__enter__()

    async def __aexit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.__exit__(et, ev, tb)
