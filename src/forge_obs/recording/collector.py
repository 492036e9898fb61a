"""The hot path: ``record_metric`` and the per-process :class:`MetricCollector`.

    >>> from forge_obs import record_metric, Reduce
    >>> from forge_obs.recording.collector import MetricCollector
    >>> for x in (1, 2, 3):
    ...     record_metric("doc/sum", x, Reduce.SUM)
    >>> MetricCollector().snapshot()["states"]["doc/sum"]["sum"]
    6.0

``record_metric`` is O(1): a dict lookup and an update of the key's values under one
process-wide lock, with no I/O, no RPC and no device sync. The built-in numeric reductions keep a
step's values in columns (:mod:`forge_obs.recording.columns`: each key interned once per run, no
object per key and step); SAMPLE, custom reductions and keys beyond :data:`KNOWN_KEYS_MAX` in an
accumulator object per key and step. A flush *swaps* both (so values recorded while a flush runs
land in the next step, never lost) and exports mergeable states. This module imports neither
Monarch nor torch.

Every value enters a step's accumulators through this module: ``record_metric`` and
:meth:`MetricCollector.record_groups` (the tracer) while recording, :meth:`Taken.add` and
:meth:`Taken.merge_row` (device values, GPU timings) at export. None of them raises into the
caller for any value, key or reduction: a value that cannot be recorded is dropped with a
rate-limited warning and counted by reason (``counters["dropped_by_reason"]``; reasons: see
:mod:`forge_obs.recording.reduce`), and a rejected value leaves nothing behind in the accumulator.

Raw values (``per_rank_no_reduce``) leave either with a cut (:meth:`MetricCollector.swap`) or
earlier, every ``stream_interval_s`` (:meth:`MetricCollector.take_raw`): each exactly once.

``record_metric`` chooses its implementation through one route variable, set when something
changes, never per call: off by ``FORGE_DISABLE_METRICS=true`` at import or :func:`set_enabled`,
and onto torchforge's path while a test replaces ``forge_obs.metrics.MetricCollector``
(:func:`set_record_route`, used by :mod:`forge_obs._compat.metrics`).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import types
from typing import Any

from forge_obs.core.counters import add_count
from forge_obs.core.env import METRICS_DISABLED
from forge_obs.core.plain import BadRow, plain
from forge_obs.core.safe import safe_repr
from forge_obs.core.types import Metric
from forge_obs.core.warn import WARNER
from forge_obs.recording.columns import COLUMN_REDUCTIONS, Column, ColumnTake, column_for
from forge_obs.recording.device import DeviceValues
from forge_obs.recording.export import export_taken
from forge_obs.recording.reduce import (
    ROW_CLASSES,
    DropCounts,
    MetricAccumulator,
    Reduce,
    accumulator_for,
    reserved_key,
    resolve_reduction,
    to_float,
)
from forge_obs.recording.sketch import DistributionAccumulator  # importing sketch registers "distribution" in every process

__all__ = ["MetricCollector", "Taken", "record_metric", "set_enabled", "is_enabled", "set_record_route", "DEFAULT_RAW_CAP"]

#: raw values kept per flush interval for ``per_rank_no_reduce`` streams (beyond: counted)
DEFAULT_RAW_CAP = 100_000
#: at most this many keys get an id in a column (see forge_obs.recording.columns); beyond, a key's
#: values go to an accumulator object per step
KNOWN_KEYS_MAX = 10_000

_DROP = object()
_SAMPLE = Reduce.SAMPLE  # module globals: cheaper than the Enum attribute lookup per call
_MEAN = Reduce.MEAN
_INF = math.inf
#: strings (and their subclasses, e.g. NumPy's): never a number, whatever they spell
_TEXT = (str, bytes, bytearray)
#: accumulator classes whose ``append`` cannot raise for a finite float (cached tracer groups)
_SAFE_FOR_FLOATS = frozenset({DistributionAccumulator})


def _key_text(key: Any) -> str:
    return key if type(key) is str else safe_repr(key)


def _norm_key(key: Any) -> "str | None":
    """``key`` as an exact ``str`` (a ``str`` subclass is copied), or None if it is not one."""
    if type(key) is str:
        return key
    if isinstance(key, str):
        try:
            return str.__str__(key)
        except Exception:  # noqa: BLE001
            return None
    return None


def _lookup(reduction: Any) -> "Reduce | str | None":
    """The registered reduction ``reduction`` names (case-insensitive), or None."""
    if type(reduction) is Reduce:
        return reduction
    try:
        return resolve_reduction(reduction)
    except Exception:  # noqa: BLE001
        return None


def _append(accs: dict, key: Any, value: Any, reduction: Any, sink: Any) -> "tuple[str, Any] | None":
    """Append one value to ``accs`` (a step's accumulators), creating the key's accumulator on its
    first value. The only place values enter accumulators (besides the cached fast paths of
    ``record_metric`` and :meth:`MetricCollector.record_groups`, which call ``append`` on an
    existing accumulator of the same reduction). An ``int`` beyond the float range becomes
    ``±inf`` (IEEE), counted non-finite. Returns ``(key, value)`` as appended, or None when the
    value was dropped (reported to ``sink``). A new accumulator is kept only if its first value
    was appended: nothing phantom is left."""
    k = key if type(key) is str else _norm_key(key)
    if k is None:
        sink._sink_drop("bad_key", key, f"key must be a str, got {type(key).__name__}")
        return None
    why = reserved_key(k)
    if why is not None:
        sink._sink_drop("reserved_key", k, why)
        return None
    red = reduction if type(reduction) is Reduce else _lookup(reduction)
    if red is None:
        sink._sink_drop("unknown_reduction", k, f"unknown reduction {safe_repr(reduction)}")
        return None
    acc = accs.get(k)
    new = acc is None
    try:
        if new:
            cls = accumulator_for(red.value if type(red) is Reduce else red)
            if cls.numeric and not isinstance(value, (int, float)):
                sink._sink_drop("bad_value", k, f"{type(value).__name__} value needs a non-numeric reduction such as Reduce.SAMPLE")
                return None
            acc = cls(red)
        elif acc.reduction is not red:
            sink._sink_drop("reduction_mismatch", k, f"recorded with {_name(red)} but this step already has it as {_name(acc.reduction)}")
            return None
        try:
            acc.append(value)
        except OverflowError:
            if not isinstance(value, int):
                raise
            value = _INF if value > 0 else -_INF
            sink._sink_nonfinite(k, value)
            acc.append(value)
    except Exception as e:  # noqa: BLE001 - a (custom) accumulator that raises: this value only
        sink._sink_drop("append_error", k, f"{type(acc).__name__ if acc is not None else _name(red)} raised {safe_repr(e)}")
        return None
    if new:
        accs[k] = acc
    return k, value


class Taken:
    """What :meth:`MetricCollector.swap` took: the columns' values (``cols``, one
    :class:`~forge_obs.recording.columns.ColumnTake` per reduction with values), accumulator
    objects (``accs``: SAMPLE, custom reductions, keys beyond the columns), raw values, counters,
    and the device values not yet read (resolved by :meth:`MetricCollector.export`). A Taken is
    exported once.

    Values that belong to the cut but are only known at export (device values read back, GPU
    timings) enter with :meth:`add` and :meth:`merge_row`."""

    __slots__ = ("accs", "raw", "counters", "device", "nonfinite_keys", "cols", "step")

    def __init__(self, accs: dict, raw: list | None, counters: dict, device: Any, nonfinite_keys: Any = None,
                 cols: "list[ColumnTake] | tuple" = ()) -> None:
        self.accs = accs
        self.raw = raw
        self.counters = counters
        self.device = device
        #: keys that had a non-finite value recorded (not counted again as overflows at export)
        self.nonfinite_keys = set() if nonfinite_keys is None else nonfinite_keys
        self.cols = cols
        #: the step of the cut, where the caller that took it names one (:func:`forge_obs.wire.rank_cut.take`)
        self.step: int | None = None

    def n_keys(self) -> int:
        """How many keys have values in this cut."""
        return len(self.accs) + sum(t.count() for t in self.cols)

    def keys(self) -> list:
        """The keys that have values in this cut."""
        out = list(self.accs)
        for took in self.cols:
            out.extend(took.keys())
        return out

    def _detach(self, key: Any) -> None:
        """``key``'s values, if it has some in a column, moved to an accumulator object in
        ``accs`` (values added at export then go there)."""
        k = key if type(key) is str else _norm_key(key)
        if k is None or not self.cols:
            return
        for took in self.cols:
            i = took.find(k)
            if i is not None:
                col = took.column
                self.accs[k] = ROW_CLASSES[col.rt].from_row(col.reduction, took.detach(i))
                return

    # ------------------------------------------------------------------ adding values at export
    def add(self, key: str, value: Any, reduction: Any) -> bool:
        """One more value of this step (never raises; False: dropped and counted)."""
        try:
            self._detach(key)
            ok = _append(self.accs, key, value, reduction, self) is not None
        except Exception as e:  # noqa: BLE001
            self.drop("append_error", 1, key, safe_repr(e))
            return False
        if ok:
            self._count("values_recorded", 1)
        return ok

    def merge_row(self, key: str, reduction: Any, row: Any, n: int) -> bool:
        """Merge ``row`` (the state of ``n`` values of a built-in reduction accumulated elsewhere,
        e.g. on a device) into this step's accumulator of ``key`` (never raises)."""
        try:
            rt = reduction.value if type(reduction) is Reduce else reduction
            self._detach(key)
            acc = self.accs.get(key)
            if acc is None:
                self.accs[key] = ROW_CLASSES[rt].from_row(reduction, row)
            elif acc.reduction is not reduction:
                self.drop("reduction_mismatch", n, key, f"recorded with {_name(reduction)} on a device but "
                          f"with {_name(acc.reduction)} on the CPU")
                return False
            else:
                acc.merge_row(row)
        except Exception as e:  # noqa: BLE001
            self.drop("merge_error", n, key, safe_repr(e))
            return False
        self._count("values_recorded", n)
        return True

    def drop(self, reason: str, n: int = 1, key: Any = None, why: str | None = None) -> None:
        """Count ``n`` values dropped for ``reason`` (and warn, rate-limited, when ``why``)."""
        c = self.counters
        c["dropped_values"] = c.get("dropped_values", 0) + n
        d = c.get("dropped_by_reason")
        if d is None:
            d = c["dropped_by_reason"] = DropCounts()
        d.add(reason, n)
        if why is not None:
            WARNER.warn(reason, _key_text(key), f"{safe_repr(key)}: {why}; dropped (counted in obs/dropped_values)")

    def note_nonfinite(self, key: str) -> None:
        """Count a key whose value is non-finite (device values: counted per key)."""
        self._count("nonfinite_values", 1)
        self.nonfinite_keys.add(key)

    def _count(self, name: str, n: int) -> None:
        c = self.counters
        add_count(c, name, n)

    # the sink interface of _append
    def _sink_drop(self, reason: str, key: Any, why: str) -> None:
        self.drop(reason, 1, key, why)

    def _sink_nonfinite(self, key: str, v: float) -> None:
        self.note_nonfinite(key)


class _Instances(dict):
    """``MetricCollector._instances`` (torchforge's name): rank -> collector. This process's
    collector is registered under its rank; :meth:`clear` forgets every collector and empties this
    process's (what it recorded is dropped: tests start from a clean collector)."""

    def clear(self) -> None:
        inst = MetricCollector._instance
        super().clear()
        if inst is not None:
            inst.reset()
            inst.initialized = False
            inst._warned = set()


_DEVICE_LOCK = threading.Lock()


class MetricCollector:
    """Per-process singleton that accumulates values between flushes.

    ``record_metric`` writes here; the process's ``LocalFetcherActor`` (or, on the controller, the
    ``GlobalLoggingActor``) calls :meth:`swap` at the cut and :meth:`export` afterwards.

    One process is one rank, so the per-process singleton is torchforge's per-rank singleton;
    ``_instances`` maps the rank to it. Only when ``forge_obs.metrics.current_rank`` is replaced
    (a test's mock) does ``MetricCollector()`` look the rank up and keep a separate collector per
    mocked rank; ``record_metric`` always writes to this process's collector.
    """

    _instance: "MetricCollector | None" = None
    _instance_lock = threading.Lock()
    _instances: "_Instances" = _Instances()
    #: ``forge_obs.metrics.current_rank`` when a test replaced it (see forge_obs.metrics)
    _rank_fn: Any = None

    def __new__(cls) -> "MetricCollector":
        inst = cls._instance
        if inst is None:
            with cls._instance_lock:
                inst = cls._instance
                if inst is None:
                    inst = super().__new__(cls)
                    inst._setup()
                    cls._instance = inst
        if cls._rank_fn is None:
            if 0 not in cls._instances:
                cls._instances[0] = inst
            return inst
        rank = _mocked_rank(cls._rank_fn)
        other = cls._instances.get(rank)
        if other is None:
            with cls._instance_lock:
                other = cls._instances.get(rank)
                if other is None:
                    other = inst if rank == 0 else super().__new__(cls)
                    if other is not inst:
                        other._setup()
                    cls._instances[rank] = other
        return other

    def _setup(self) -> None:
        #: init_backends configured this process (the controller's, or one its fetchers reach);
        #: before that, values are kept for the first flush after it
        self.initialized = False
        self._warned: set[str] = set()
        #: torchforge's ``global_step``: the step raw values stream under (last flushed step + 1)
        self.global_step = 0
        self._streamed = 0  # raw values handed out early (take_raw) since the last swap
        self._streamed_step: int | None = None  # the step they were streamed under
        self._lock = threading.Lock()
        #: this step's accumulator objects (SAMPLE, custom reductions, keys beyond the columns)
        self._accs: dict[str, MetricAccumulator] = {}
        #: the built-in numeric reductions' columns (forge_obs.recording.columns), made on first use
        self._columns: dict[Reduce, Column] = {}
        #: key -> (reduction, its column, its id there, whether MEAN): a key's values of every
        #: step go to its column (interned once per run, at most KNOWN_KEYS_MAX keys)
        self._slots: dict[str, tuple] = {}
        # per_rank_no_reduce: raw (key, value, wall time) tuples, bounded per flush interval
        self._raw: list[tuple[str, Any, float]] | None = None
        self.raw_cap = DEFAULT_RAW_CAP
        self._recorded = 0
        self._dropped = 0
        self._drops = DropCounts()
        self._nonfinite = 0
        self._nonfinite_keys: set[str] = set()
        self._raw_overflow = 0
        # record_groups: key tuple -> (the step it was made in, its (column, id) or (None,
        # accumulator) per key); cleared when a key leaves its column
        self._groups: dict[tuple, tuple] = {}
        self._step_gen = 0  # swaps so far
        self._device_values: DeviceValues | None = None  # created when a GPU value is first seen

    # ------------------------------------------------------------------ recording
    def push(self, metric: Metric) -> None:
        """torchforge-compatible entry point: record a :class:`Metric`. Before ``init_backends``
        reached this process it warns once (as torchforge does) but keeps the value for the
        first flush after it."""
        if not self.initialized:
            self._warn_once(
                "push",
                "Metric logging backends (e.g. wandb) were not initialized yet: init_backends was not called, "
                "or has not reached this process. Values are kept and logged with the first flush after "
                "`await mlogger.init_backends.call_one(config)`.",
            )
        if self is not MetricCollector._instance:  # a mocked rank's collector (tests)
            with self._lock:
                self._record_slow(metric.key, metric.value, metric.reduction or Reduce.MEAN)
            return
        _record_fast(metric.key, metric.value, metric.reduction or Reduce.MEAN)

    def _warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            import logging

            logging.getLogger("forge_obs").warning("forge_obs: %s", msg)

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

    def take_raw(self, step: int) -> list | None:
        """Take the raw values recorded so far for an early stream under ``step`` (the predicted
        step: the last flushed one + 1); None when there are none. Each raw value is taken once,
        by this or by the next :meth:`swap`; :meth:`swap` reports how many were taken early
        (``counters["streamed_early"]``) and under which step."""
        with self._lock:
            raw = self._raw
            if not raw:
                return None
            self._raw = []
            self._streamed += len(raw)
            self._streamed_step = step
        return raw

    def count_drop(self, reason: str, n: int = 1, key: Any = None, why: str | None = None) -> None:
        """Count ``n`` values dropped for ``reason``, reported with the next cut (and warn,
        rate-limited, when ``why``)."""
        with self._lock:
            self._dropped += n
            add_count(self._drops, reason, n)
        if why is not None:
            WARNER.warn(reason, _key_text(key), f"{safe_repr(key)}: {why}; dropped (counted in obs/dropped_values)")

    def _record_slow(self, key: Any, value: Any, reduction: Any) -> None:
        """Called under the lock: a key's first value in this run, a reduction mismatch, a
        non-``Reduce`` reduction argument, or whatever made the fast path raise. Never raises."""
        try:
            r = self._put(key, value, reduction)
            if r is None:
                return
            self._recorded += 1
            if self._raw is not None:
                self._append_raw(*r)
        except Exception as e:  # noqa: BLE001 - never into the caller
            self._sink_drop("append_error", key, safe_repr(e))

    def _put(self, key: Any, value: Any, reduction: Any) -> "tuple[str, Any] | None":
        """Under the lock: one value, checked, into the key's column (a built-in numeric
        reduction; the key interned on its first value) or its accumulator object. Returns
        ``(key, value)`` as recorded, or None (dropped and counted). A key keeps one reduction
        per step: another one is a ``reduction_mismatch``; in a later step the key may change its
        reduction (it leaves its column)."""
        k = key if type(key) is str else _norm_key(key)
        if k is None:
            self._sink_drop("bad_key", key, f"key must be a str, got {type(key).__name__}")
            return None
        red = reduction if type(reduction) is Reduce else _lookup(reduction)
        slot = self._slots.get(k)
        if slot is not None and red is not None:
            if slot[0] is red:
                return self._add_to_column(slot[1], slot[2], k, value)
            if slot[1].n[slot[2]]:
                self._sink_drop("reduction_mismatch", k, f"recorded with {_name(red)} but this step already "
                                f"has it as {_name(slot[0])}")
                return None
            del self._slots[k]  # the key changes its reduction: it leaves its column
            self._groups.clear()
        if red in COLUMN_REDUCTIONS and k not in self._accs and len(self._slots) < KNOWN_KEYS_MAX \
                and isinstance(value, (int, float)) and reserved_key(k) is None:
            col = self._columns.get(red)
            if col is None:
                col = self._columns[red] = column_for(red)
            i = col.intern(k)
            self._slots[k] = (red, col, i, red is _MEAN)
            return self._add_to_column(col, i, k, value)
        return _append(self._accs, k, value, red if red is not None else reduction, self)

    def _add_to_column(self, col: Column, i: int, key: str, value: Any) -> "tuple[str, Any]":
        """``value`` into id ``i`` of ``col``; an int beyond the float range as ``±inf``, counted."""
        try:
            col.add(i, value)
        except OverflowError:
            if not isinstance(value, int):
                raise
            value = _INF if value > 0 else -_INF
            self._sink_nonfinite(key, value)
            col.add(i, value)
        return key, value

    def _append_raw(self, key: str, value: Any) -> None:
        if len(self._raw) < self.raw_cap:  # type: ignore[arg-type]
            self._raw.append((key, value, time.time()))  # type: ignore[union-attr]
        else:
            self._raw_overflow += 1

    # the sink interface of _append (the lock is held)
    def _sink_drop(self, reason: str, key: Any, why: str, n: int = 1) -> None:
        self._dropped += n
        add_count(self._drops, reason, n)
        WARNER.warn(reason, _key_text(key), f"record_metric({safe_repr(key)}): {why}; dropped (counted in obs/dropped_values)")

    def _sink_nonfinite(self, key: str, v: float) -> None:
        self._nonfinite += 1
        self._nonfinite_keys.add(key)
        WARNER.warn("nonfinite", key, f"record_metric({key!r}): non-finite value {v} kept (counted in obs/nonfinite_values)")

    def device_values(self) -> DeviceValues:
        """This collector's device accumulators (:mod:`forge_obs.recording.device`), created on
        first use; the cut swaps them with the CPU accumulators."""
        dv = self._device_values
        if dv is None:
            with _DEVICE_LOCK:  # not the collector's lock: this may run while it is held
                dv = self._device_values
                if dv is None:
                    dv = self._device_values = DeviceValues()
        return dv

    def add_cut_hook(self, hook: Any) -> None:
        """Register ``hook``: ``hook.take()`` runs at every cut (O(1)) and
        ``hook.resolve(taken, ...)`` at its export; what it resolves enters the step of the cut
        that took it (the GPU tracer's pending CUDA-event timings)."""
        self.device_values().add_hook(hook)

    def _device_record(self, key: Any, value: Any, reduction: Any) -> Any:
        """GPU tensors: accumulated on their device (:mod:`forge_obs.recording.device`)."""
        try:
            self.device_values().record(key, value, reduction)
            return _DROP  # accumulated on the device: nothing left for the CPU accumulators
        except Exception as e:  # noqa: BLE001
            return self._drop(key, "device_error", f"device value could not be recorded ({safe_repr(e)})")

    def _drop(self, key: Any, reason: str, why: str) -> Any:
        with self._lock:
            self._sink_drop(reason, key, why)
        return _DROP

    def _record_nonfinite(self, key: Any, value: float, reduction: Any) -> None:
        """A NaN / inf: recorded like any value, and counted in ``nonfinite_values`` (with a
        rate-limited warning) only if it was kept."""
        with self._lock:
            try:
                r = self._put(key, value, reduction)
                if r is None:
                    return
                self._recorded += 1
                self._sink_nonfinite(r[0], value)
                if self._raw is not None:
                    self._append_raw(*r)
            except Exception as e:  # noqa: BLE001 - never into the caller
                self._sink_drop("append_error", key, safe_repr(e))

    def record_groups(self, pairs: list, reductions: tuple) -> None:
        """Record ``[(keys, value), ...]``: each value under every key of its tuple ``keys``, with
        the reduction at the same position of ``reductions`` (the tracer's avg / max / dist
        triples), under one lock acquisition. Never raises.

        Fast path: where each key of a group goes (its column and id, or its accumulator object
        of this step) is cached while the step lasts (a flush starts another); a finite float is
        added to each of them directly."""
        if not _ENABLED[0]:
            return
        later = None
        n = 0
        lock = self._lock
        lock.acquire()
        try:
            cache = self._groups
            gen = self._step_gen
            if self._raw is not None:  # streaming raw values: one by one, through record_metric
                later = pairs
                pairs = ()
            for keys, v in pairs:
                try:
                    if type(v) is float and v - v == 0.0:  # a finite float (else: record_metric, below)
                        grp = cache.get(keys)
                        if grp is not None and grp[0] == gen:
                            for col, x in grp[1]:  # columns and these accumulators: cannot raise for it
                                if col is None:
                                    x.append(v)
                                else:
                                    col.add(x, v)
                            n += len(grp[1])
                        else:
                            self._record_group_slow(keys, v, reductions)  # never raises
                        continue
                except Exception:  # noqa: BLE001 - keys that are not hashable, ...: below
                    pass
                if later is None:
                    later = []
                later.append((keys, v))
        finally:
            self._recorded += n
            lock.release()
        if later:
            for keys, v in later:
                try:
                    items = list(zip(keys, reductions))
                except Exception:  # noqa: BLE001
                    self._drop(keys, "bad_key", "a group of keys must be a tuple of str")
                    continue
                for key, red in items:
                    record_metric(key, v, red)

    def _record_group_slow(self, keys: tuple, v: float, reductions: tuple) -> None:
        """Under the lock: a group not cached yet (or of a previous step)."""
        try:
            items = list(zip(keys, reductions))
        except Exception:  # noqa: BLE001
            self._sink_drop("bad_key", keys, "a group of keys must be a tuple of str")
            return
        for key, red in items:
            self._record_slow(key, v, red)
        try:
            where = []
            for k, r in items:
                slot = self._slots.get(k) if type(k) is str else None
                acc = self._accs.get(k) if slot is None else None
                if slot is not None and slot[0] is r:
                    where.append((slot[1], slot[2]))
                elif acc is not None and type(acc) in _SAFE_FOR_FLOATS and acc.reduction is r:
                    where.append((None, acc))
                else:
                    return  # not cached: the slow path next time too
            self._groups[keys] = (self._step_gen, tuple(where))
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ flushing
    def swap(self) -> "Taken":
        """Take everything recorded so far, in O(1) under the lock: no export, no device sync.

        This is the cut of a flush: a value recorded before ``swap()`` returns is in the returned
        :class:`Taken`; a value recorded after it is in the next one. :meth:`export` turns a
        ``Taken`` into mergeable states later, off the caller's path.
        """
        with self._lock:
            accs, self._accs = self._accs, {}
            cols = [col.take() for col in self._columns.values() if col.touched]
            self._step_gen += 1
            raw = self._raw
            if raw is not None:
                self._raw = []
            drops, self._drops = self._drops, DropCounts()
            nonfinite_keys, self._nonfinite_keys = self._nonfinite_keys, set()
            counters = {
                "values_recorded": self._recorded,
                "dropped_values": self._dropped,
                "dropped_by_reason": drops,
                "nonfinite_values": self._nonfinite,
                "stream_overflow": self._raw_overflow,
            }
            if self._streamed:
                counters["streamed_early"] = self._streamed
                counters["streamed_step"] = self._streamed_step
                self._streamed = 0
                self._streamed_step = None
            self._recorded = self._dropped = self._nonfinite = self._raw_overflow = 0
        dev = self._device_values
        device = dev.swap() if dev is not None else None
        return Taken(accs, raw, counters, device, nonfinite_keys, cols)

    def export(self, taken: "Taken", packed: bool = False) -> dict[str, Any]:
        """Mergeable states of a :class:`Taken`, off the caller's path: see
        :func:`forge_obs.recording.export.export_taken`. Never raises."""
        return export_taken(taken, packed)

    def snapshot(self, packed: bool = False) -> dict[str, Any]:
        """:meth:`swap` then :meth:`export`: everything recorded so far, as mergeable states."""
        return self.export(self.swap(), packed)

    async def flush(self, global_step: int = 0, return_state: bool = False) -> dict[str, dict[str, Any]]:
        """torchforge's ``await collector.flush(global_step, return_state)``.

        With ``return_state=True``: takes everything recorded so far and returns
        ``{key: state}`` (torchforge's state fields included); the caller owns those values (they
        do not reach the backends through a cut). With ``return_state=False`` it takes nothing and
        returns ``{}``: forge_obs logs per-rank views from the controller, so the values stay for
        the next cut. Before ``init_backends`` reached this process it warns once and returns
        ``{}``, keeping the values."""
        if not self.initialized:
            self._warn_once(
                "flush",
                f"Cannot flush collected metrics: MetricCollector.flush(global_step={global_step}) called before "
                "init_backends; values are kept for the first flush after "
                "`await mlogger.init_backends.call_one(config)`.",
            )
            return {}
        self.global_step = global_step + 1
        if not return_state:
            return {}
        return self.snapshot()["states"]

    def reset(self) -> None:
        """Drop everything recorded so far (tests)."""
        self.snapshot()


def _coerce(c: MetricCollector, key: Any, value: Any, reduction: Any) -> Any:
    """A value of ``record_metric`` that is not an int or float, for collector ``c``: a float
    (kept as it is for a non-numeric reduction such as SAMPLE; a GPU tensor is accumulated on its
    device); _DROP if it cannot be (counted). Never raises."""
    try:
        if reduction is _SAMPLE:
            return _row(c, key, value)
        if type(reduction) is not Reduce:
            red = _lookup(reduction)
            if red is None:
                return value  # dropped as unknown_reduction under the lock
            if red is _SAMPLE:
                return _row(c, key, value)
            if not accumulator_for(red.value if type(red) is Reduce else red).numeric:
                return value
        if type(value) is (_TENSOR or _tensor_type()):  # plain torch.Tensor: the common case, fast
            if not value.is_cpu:
                return c._device_record(key, value, reduction)
            try:
                return float(value.item())  # .item() rejects tensors of more than one element
            except Exception as e:  # noqa: BLE001
                return c._drop(key, "bad_value", f"Tensor could not be read as a scalar ({safe_repr(e)})")
        if type(value) is bool:
            return float(value)
        if isinstance(value, _TEXT) or value is None:  # np.str_ / np.bytes_ too: never parsed
            return c._drop(key, "bad_value", f"value of type {_type_name(value)} is not a number")
        item = getattr(value, "item", None)
        if item is not None:
            # torch tensors: ``is_cpu`` is far cheaper than ``.device.type``; others: ``.device``
            is_cpu = getattr(value, "is_cpu", None)
            if is_cpu is False or (is_cpu is None and getattr(getattr(value, "device", None), "type", "cpu") != "cpu"):
                return c._device_record(key, value, reduction)
            try:
                # .item() itself rejects tensors / arrays of more than one element
                v = to_float(item())
            except Exception as e:  # noqa: BLE001 - bad input never raises into the caller
                return c._drop(key, "bad_value", f"{_type_name(value)} could not be read as a scalar ({safe_repr(e)})")
        else:
            try:
                v = to_float(value)
            except Exception:  # noqa: BLE001
                return c._drop(key, "bad_value", f"value of type {_type_name(value)} is not a number")
        return v
    except Exception as e:  # noqa: BLE001 - an .item property, __getattr__, __float__ that raises
        return c._drop(key, "bad_value", f"{_type_name(value)} value could not be read ({safe_repr(e)})")


def _row(c: MetricCollector, key: Any, value: Any) -> Any:
    """A SAMPLE row as backends write it (:func:`forge_obs.core.plain.plain`: keys as ``str``);
    _DROP, counted as ``bad_row``, for a row that contains itself."""
    try:
        return plain(value, key)
    except BadRow as e:
        return c._drop(key, "bad_row", f"a SAMPLE row {e}")


_TENSOR: Any = None  # torch.Tensor once torch is imported (never imported from here)


def _tensor_type() -> Any:
    global _TENSOR
    torch = sys.modules.get("torch")
    if torch is not None:
        _TENSOR = getattr(torch, "Tensor", None)
    return _TENSOR


def _name(r: Any) -> str:
    return r.name if isinstance(r, Reduce) else safe_repr(r) if type(r) is not str else r


def _type_name(v: Any) -> str:
    try:
        return type(v).__name__
    except Exception:  # noqa: BLE001
        return "object"


def _mocked_rank(fn: Any) -> Any:
    try:
        return fn().rank
    except Exception:  # noqa: BLE001 - a mock without .rank: this process's collector
        return 0


_C = MetricCollector()
_acquire = _C._lock.acquire
_release = _C._lock.release
#: set_enabled(): record_groups (the tracer) checks it; record_metric switches its code
_ENABLED = [True]


def record_metric(key: str, value: Any, reduction: "Reduce | str" = Reduce.MEAN) -> None:
    """Record ``value`` under ``key``; reduced with ``reduction`` at the next flush.

        >>> from forge_obs import record_metric, Reduce
        >>> record_metric("loss", 0.25)                       # MEAN by default
        >>> record_metric("tokens", 512, Reduce.SUM)
        >>> record_metric("rollouts", {"prompt": "1+1", "reward": 1.0}, Reduce.SAMPLE)

    Safe from any thread, asyncio task, actor or plain process; never raises, for any key,
    value or reduction. Values: int, float, bool, NumPy scalars, 0-d/1-element tensors (GPU
    tensors are accumulated on the device), and anything for ``Reduce.SAMPLE`` (or a custom
    reduction with ``numeric = False``). Bad values are dropped with a rate-limited warning and
    counted in ``obs/dropped_values`` (by reason); NaN/inf are kept and counted in
    ``obs/nonfinite_values``, and so is an int beyond the float range (as ``±inf``).
    """
    if _route is not None:  # disabled, or routed (set_record_route)
        return _route(key, value, reduction)
    c = _C
    t = type(value)
    if t is float:
        if value - value:  # NaN / inf: counted if kept
            return c._record_nonfinite(key, value, reduction)
    elif t is not int:
        value = _coerce(c, key, value, reduction)
        if value is _DROP:
            return
        if type(value) is float and value - value:
            return c._record_nonfinite(key, value, reduction)
    _acquire()  # released in the finally below, whatever happens in between
    try:
        slot = c._slots.get(key)
        if slot is not None and slot[0] is reduction:  # the key's column (see recording.columns)
            col = slot[1]
            i = slot[2]
            if slot[3]:  # MEAN, inlined: MeanColumn.add
                n = col.n
                if n[i]:
                    col.a[i] += value
                    n[i] += 1
                else:
                    col.a[i] = 0.0 + value
                    n[i] = 1
                    col.touched.append(i)
            else:
                col.add(i, value)
            c._recorded += 1
            if c._raw is not None:
                c._append_raw(col.keys[i], value)
        elif slot is None and (acc := c._accs.get(key)) is not None and acc.reduction is reduction:
            acc.append(value)  # an accumulator object of this step (SAMPLE, custom, ...)
            c._recorded += 1
            if c._raw is not None:
                c._append_raw(key, value)
        else:
            c._record_slow(key, value, reduction)
    except Exception:  # noqa: BLE001 - an unhashable key, an int beyond the float range, ...
        c._record_slow(key, value, reduction)  # handles them all; never raises
    finally:
        _release()


# ---------------------------------------------------------------------------- the one swap point
#: how ``record_metric`` records, chosen once per change (never per call): None is the fast path
#: above; otherwise every call goes to this function (disabled recording, or a route installed
#: with :func:`set_record_route`)
_route: Any = None
#: a route installed by compatibility code (torchforge's patched ``MetricCollector``)
_installed_route: list = [None]
#: the fast path whatever the route (``MetricCollector.push``): ``record_metric``'s code, run with
#: ``_route`` fixed to None. Its globals are a copy taken here; the others it reads (``_C``,
#: ``_DROP``, ``_acquire``, ``_release``) are never rebound.
_record_fast = types.FunctionType(record_metric.__code__, {**globals(), "_route": None}, "record_metric",
                                  record_metric.__defaults__)


def _record_disabled(key: str, value: Any, reduction: "Reduce | str" = Reduce.MEAN) -> None:
    """Disabled by ``FORGE_DISABLE_METRICS=true`` at import or ``set_enabled(False)``: does nothing."""
    return None


def _choose_route() -> None:
    global _route
    _route = _installed_route[0] or (None if _ENABLED[0] else _record_disabled)


def set_record_route(route: "Any | None") -> None:
    """Send every ``record_metric`` call to ``route(key, value, reduction)`` (None: record here).
    The compatibility layer's swap point; it takes precedence over :func:`set_enabled`."""
    _installed_route[0] = route
    _choose_route()


def set_enabled(enabled: bool) -> None:
    """Turn recording on or off in this process at run time (``record_metric``, tracers).

        >>> import forge_obs
        >>> forge_obs.set_enabled(False); forge_obs.record_metric("ignored", 1.0)
        >>> forge_obs.set_enabled(True)

    ``FORGE_DISABLE_METRICS`` is read once, at import (following it per call would cost more
    than the call); this is the run-time switch. Values already recorded are kept."""
    _ENABLED[0] = bool(enabled)
    _choose_route()


def is_enabled() -> bool:
    """Whether ``record_metric`` records in this process."""
    return _ENABLED[0]


if METRICS_DISABLED:  # read once: a near-zero-cost no-op
    set_enabled(False)
