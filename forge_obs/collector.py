"""The hot path: ``record_metric`` and the per-process :class:`MetricCollector`.

    >>> from forge_obs import record_metric, Reduce
    >>> from forge_obs.collector import MetricCollector
    >>> for x in (1, 2, 3):
    ...     record_metric("doc/sum", x, Reduce.SUM)
    >>> MetricCollector().snapshot()["states"]["doc/sum"]["sum"]
    6.0

``record_metric`` is O(1): a dict lookup and an accumulator update under one process-wide lock,
with no I/O, no RPC and no device sync. A flush *swaps* the accumulator dict (so values recorded
while a flush runs land in the next step, never lost) and exports mergeable states. This module
imports neither Monarch nor torch.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from forge_obs._env import METRICS_DISABLED
from forge_obs._warn import WARNER
from forge_obs.metric import Metric
from forge_obs.reduce import ROW_FIELDS, MetricAccumulator, Reduce, accumulator_for, resolve_reduction
from forge_obs.sketch import DISTRIBUTION  # noqa: F401,E402 - registers the "distribution" reduction in every process

__all__ = ["MetricCollector", "record_metric", "DEFAULT_RAW_CAP"]

#: raw values kept per flush interval for ``per_rank_no_reduce`` streams (beyond: counted)
DEFAULT_RAW_CAP = 100_000

_DROP = object()
_SAMPLE = Reduce.SAMPLE  # module global: cheaper than the Enum attribute lookup per call


class Taken:
    """What :meth:`MetricCollector.swap` took: accumulators, raw values, counters, and the
    device values not yet read (resolved by :meth:`MetricCollector.export`)."""

    __slots__ = ("accs", "raw", "counters", "device")

    def __init__(self, accs: dict, raw: list | None, counters: dict, device: Any) -> None:
        self.accs = accs
        self.raw = raw
        self.counters = counters
        self.device = device


class MetricCollector:
    """Per-process singleton that accumulates values between flushes.

    ``record_metric`` writes here; the process's ``LocalFetcherActor`` (or, on the controller, the
    ``GlobalLoggingActor``) calls :meth:`snapshot` at each flush.
    """

    _instance: "MetricCollector | None" = None
    _instance_lock = threading.Lock()

    def __new__(cls) -> "MetricCollector":
        inst = cls._instance
        if inst is None:
            with cls._instance_lock:
                inst = cls._instance
                if inst is None:
                    inst = super().__new__(cls)
                    inst._setup()
                    cls._instance = inst
        return inst

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._accs: dict[str, MetricAccumulator] = {}
        # per_rank_no_reduce: raw (key, value, wall time) tuples, bounded per flush interval
        self._raw: list[tuple[str, Any, float]] | None = None
        self.raw_cap = DEFAULT_RAW_CAP
        self._recorded = 0
        self._dropped = 0
        self._nonfinite = 0
        self._raw_overflow = 0
        # CPU forge_obs itself used, by part (obs/cpu_<part>_s; parts: pipeline.CPU_PARTS)
        self._obs_cpu: dict[str, float] = {}
        self._device_values = None  # set by forge_obs.device when a GPU value is first seen

    # ------------------------------------------------------------------ recording
    def push(self, metric: Metric) -> None:
        """torchforge-compatible entry point: record a :class:`Metric`."""
        record_metric(metric.key, metric.value, metric.reduction or Reduce.MEAN)

    def set_streaming(self, enabled: bool) -> None:
        """Keep raw values (with timestamps) for ``per_rank_no_reduce`` backends."""
        with self._lock:
            if enabled and self._raw is None:
                self._raw = []
            elif not enabled:
                self._raw = None

    @property
    def streaming(self) -> bool:
        return self._raw is not None

    def _record_slow(self, key: Any, value: Any, reduction: Any) -> None:
        """Called under the lock: a key's first value of the step, a reduction mismatch, or a
        non-``Reduce`` reduction argument."""
        try:
            red = resolve_reduction(reduction)
        except ValueError as e:
            self._dropped += 1
            WARNER.warn("bad_reduction", str(key), f"record_metric({key!r}): {e}; value dropped")
            return
        if not isinstance(key, str):
            self._dropped += 1
            WARNER.warn("bad_key", repr(key), f"record_metric: key must be a str, got {type(key).__name__}; value dropped")
            return
        acc = self._accs.get(key)
        if acc is None:
            cls = accumulator_for(red.value if isinstance(red, Reduce) else red)
            if cls.numeric and not isinstance(value, (int, float)):
                self._dropped += 1
                WARNER.warn("bad_value", key, f"record_metric({key!r}): {type(value).__name__} value needs Reduce.SAMPLE; dropped")
                return
            acc = cls(red)
            self._accs[key] = acc
        elif acc.reduction is not red:
            self._dropped += 1
            WARNER.warn(
                "reduction_mismatch",
                key,
                f"record_metric({key!r}): recorded with {_name(red)} but this step already has it as "
                f"{_name(acc.reduction)}; value dropped (counted in obs/dropped_values)",
            )
            return
        acc.append(value)
        self._recorded += 1
        if self._raw is not None:
            self._append_raw(key, value)

    def _append_raw(self, key: str, value: Any) -> None:
        if len(self._raw) < self.raw_cap:  # type: ignore[arg-type]
            self._raw.append((key, value, time.time()))  # type: ignore[union-attr]
        else:
            self._raw_overflow += 1

    def _coerce(self, key: Any, value: Any, reduction: Any) -> Any:
        """Turn a non-int/float value into a float (or keep a row for SAMPLE); _DROP if bad."""
        if reduction is _SAMPLE or reduction == "sample":
            return value
        if type(value) is (_TENSOR or _tensor_type()):  # plain torch.Tensor: the common case, fast
            if not value.is_cpu:
                return self._device_record(key, value, reduction)
            try:
                v = float(value.item())  # .item() rejects tensors of more than one element
            except Exception as e:  # noqa: BLE001
                return self._drop(key, f"Tensor could not be read as a scalar ({e})")
            if v - v:
                self._count_nonfinite(key, v)
            return v
        if type(value) is bool:
            return float(value)
        item = getattr(value, "item", None)
        if item is not None:
            # torch tensors: ``is_cpu`` is far cheaper than ``.device.type``; others: ``.device``
            is_cpu = getattr(value, "is_cpu", None)
            if is_cpu is False or (is_cpu is None and getattr(getattr(value, "device", None), "type", "cpu") != "cpu"):
                return self._device_record(key, value, reduction)
            try:
                # .item() itself rejects tensors / arrays of more than one element
                v = float(item())
            except Exception as e:  # noqa: BLE001 - bad input never raises into the caller
                return self._drop(key, f"{type(value).__name__} could not be read as a scalar ({e})")
        else:
            try:
                if isinstance(value, (str, bytes)) or value is None:
                    raise TypeError
                v = float(value)
            except Exception:  # noqa: BLE001
                return self._drop(key, f"value of type {type(value).__name__} is not a number")
        if v - v:
            self._count_nonfinite(key, v)
        return v

    def _device_record(self, key: str, value: Any, reduction: Any) -> Any:
        """GPU tensors: accumulated on the device by :mod:`forge_obs.device` when available."""
        try:
            from forge_obs.device import record_device_value

            record_device_value(self, key, value, reduction)
            return _DROP  # accumulated on the device: nothing left for the CPU accumulators
        except Exception as e:  # noqa: BLE001
            return self._drop(key, f"device value could not be recorded ({e})")

    def _drop(self, key: Any, why: str) -> Any:
        with self._lock:
            self._dropped += 1
        WARNER.warn("bad_value", str(key), f"record_metric({key!r}): {why}; dropped (counted in obs/dropped_values)")
        return _DROP

    def _count_nonfinite(self, key: str, v: float) -> None:
        with self._lock:
            self._nonfinite += 1
        WARNER.warn("nonfinite", str(key), f"record_metric({key!r}): non-finite value {v} kept (counted in obs/nonfinite_values)")

    def add_obs_cpu(self, part: str, cpu_s: float) -> None:
        """Count CPU time spent by forge_obs itself (``part``: ``export``, ``timeline``, ``flush``,
        ``inbox``, ``pipeline``); reported, summed over processes, as ``obs/cpu_<part>_s`` and
        ``obs/cpu_s``."""
        with self._lock:
            self._obs_cpu[part] = self._obs_cpu.get(part, 0.0) + cpu_s

    # ------------------------------------------------------------------ flushing
    def swap(self) -> "Taken":
        """Take everything recorded so far, in O(1) under the lock: no export, no device sync.

        This is the cut of a flush: a value recorded before ``swap()`` returns is in the returned
        :class:`Taken`; a value recorded after it is in the next one. :meth:`export` turns a
        ``Taken`` into mergeable states later, off the caller's path.
        """
        with self._lock:
            accs, self._accs = self._accs, {}
            raw = self._raw
            if raw is not None:
                self._raw = []
            counters = {
                "values_recorded": self._recorded,
                "dropped_values": self._dropped,
                "nonfinite_values": self._nonfinite,
                "stream_overflow": self._raw_overflow,
            }
            for part, v in self._obs_cpu.items():
                counters[f"cpu_{part}_s"] = v
            self._recorded = self._dropped = self._nonfinite = self._raw_overflow = 0
            self._obs_cpu = {}
        dev = self._device_values
        device = dev.swap() if dev is not None else None
        return Taken(accs, raw, counters, device)

    def export(self, taken: "Taken", packed: bool = False) -> dict[str, Any]:
        """Mergeable states of a :class:`Taken` (device values are read here, once per device).

        Returns ``{"states": {key: state}, "raw": [(key, value, ts)] | None, "counters": {...},
        "wall_time": t}``. With ``packed=True`` (what fetchers send), the built-in numeric
        reductions come as ``"packed": {reduction: (keys, rows)}`` (see
        :data:`forge_obs.reduce.ROW_FIELDS`) and ``"states"`` holds the others (SAMPLE, custom).
        """
        accs, counters = taken.accs, taken.counters
        if taken.device is not None:
            taken.device.resolve_into(accs, counters)
        out = {"raw": taken.raw, "counters": counters, "wall_time": time.time()}
        if not packed:
            out["states"] = {k: a.get_state() for k, a in accs.items()}
            return out
        groups: dict[str, tuple[list, list]] = {}
        states: dict[str, Any] = {}
        for k, a in accs.items():
            rt = a.rt
            g = groups.get(rt)
            if g is None:
                if rt not in ROW_FIELDS:
                    states[k] = a.get_state()
                    continue
                g = groups[rt] = ([], [])
            g[0].append(k)
            g[1].append(a.row())
        out["packed"] = groups
        out["states"] = states
        return out

    def snapshot(self, packed: bool = False) -> dict[str, Any]:
        """:meth:`swap` then :meth:`export`: everything recorded so far, as mergeable states."""
        return self.export(self.swap(), packed)

    def flush(self, global_step: int = 0, return_state: bool = True) -> dict[str, Any]:
        """torchforge-compatible alias of :meth:`snapshot` (states of every key)."""
        return self.snapshot()["states"]

    def reset(self) -> None:
        """Drop everything recorded so far (tests)."""
        self.snapshot()


_TENSOR: Any = None  # torch.Tensor once torch is imported (never imported from here)


def _tensor_type() -> Any:
    global _TENSOR
    torch = sys.modules.get("torch")
    if torch is not None:
        _TENSOR = getattr(torch, "Tensor", None)
    return _TENSOR


def _name(r: Any) -> str:
    return r.name if isinstance(r, Reduce) else str(r)


def _append_locked(c: MetricCollector, accs: dict, key: str, value: Any, reduction: Any) -> None:
    """One value into ``accs`` (the collector's current dict); the caller holds ``c._lock``.
    ``record_metric`` inlines the same lines (a call costs ~0.1 us there); tracers batch with it."""
    acc = accs.get(key)
    if acc is not None and acc.reduction is reduction:
        acc.append(value)
        c._recorded += 1
        if c._raw is not None:
            c._append_raw(key, value)
    else:
        c._record_slow(key, value, reduction)


_C = MetricCollector()
_acquire = _C._lock.acquire
_release = _C._lock.release


def record_metric(key: str, value: Any, reduction: "Reduce | str" = Reduce.MEAN) -> None:
    """Record ``value`` under ``key``; reduced with ``reduction`` at the next flush.

        >>> from forge_obs import record_metric, Reduce
        >>> record_metric("loss", 0.25)                       # MEAN by default
        >>> record_metric("tokens", 512, Reduce.SUM)
        >>> record_metric("rollouts", {"prompt": "1+1", "reward": 1.0}, Reduce.SAMPLE)

    Safe from any thread, asyncio task, actor or plain process; never raises. Values: int, float,
    bool, NumPy scalars, 0-d/1-element tensors (GPU tensors are accumulated on the device), and
    any row for ``Reduce.SAMPLE``. Bad values are dropped with a rate-limited warning and counted
    in ``obs/dropped_values``; NaN/inf are kept and counted in ``obs/nonfinite_values``.
    """
    c = _C
    t = type(value)
    if t is float:
        if value - value:
            c._count_nonfinite(key, value)
    elif t is not int:
        value = c._coerce(key, value, reduction)
        if value is _DROP:
            return
    _acquire()  # explicit acquire/release: measurably cheaper than `with` on this path
    try:
        acc = c._accs.get(key)
        if acc is not None and acc.reduction is reduction:
            acc.append(value)
            c._recorded += 1
            if c._raw is not None:
                c._append_raw(key, value)
        else:
            c._record_slow(key, value, reduction)
    finally:
        _release()


if METRICS_DISABLED:  # read once: a near-zero-cost no-op

    def record_metric(key: str, value: Any, reduction: "Reduce | str" = Reduce.MEAN) -> None:  # noqa: F811
        """Disabled by ``FORGE_DISABLE_METRICS=true``: does nothing."""
        return None

