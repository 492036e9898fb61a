"""Device-side values: GPU tensors accumulated on the device, read once per flush.

    record_metric("loss", loss)                      # loss: a CUDA tensor; no .item(), no sync
    record_metric("grad_norm", gn, Reduce.MAX)

``record_metric`` hands a non-CPU tensor here (``MetricCollector._coerce``). Per (key, step) a
small float64 tensor (float32 where the device has no float64) on the value's device holds the
running state, updated with in-place ops queued on the *current stream* of the recording thread:

============  ==========================  =========================================
reduction     device state                host-side state
============  ==========================  =========================================
MEAN, SUM     ``[sum]``                   count
MAX / MIN     ``[max]`` / ``[min]``       count
STD           ``[mean, m2]`` (Welford)    count (the Welford divisor is a host int)
LAST          ``[value]``                 count, wall time of the last record
COUNT         nothing                     count
other (custom, ``distribution``)          the values, stacked at flush (at most ``RAW_CAP``
                                          per key and step; beyond: counted as dropped)
============  ==========================  =========================================

Nothing here reads a device value on the host: no ``.item()``, no ``.cpu()``, no
``torch.tensor(..., device=...)`` upload, so ``torch.cuda.set_sync_debug_mode("error")`` stays
quiet. At a flush, :meth:`DeviceValues.swap` takes the states at the cut (no sync), then
:meth:`DeviceTake.resolve_into`, on the exporting thread, makes its stream wait (``wait_stream``,
no host wait) on every stream that recorded and reads **all** device states of the process with one ``torch.cat`` and one device-to-host copy per
device (one copy in total on a single-GPU process). That copy is the only host sync, and it is
off the training thread. The values become ordinary accumulators of :mod:`forge_obs.recording.reduce` and
merge with CPU values recorded under the same key.

Non-finite device values are kept (they propagate into the reduced value, e.g. a NaN mean);
``obs/nonfinite_values`` counts the *keys* whose device state is non-finite at flush, not each
value. Device values are not streamed raw (``per_rank_no_reduce``): only their reduced states
travel. The module imports torch lazily (only when a device value is first recorded).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from forge_obs.core.counters import add_count
from forge_obs.core.safe import safe_repr
from forge_obs.core.warn import WARNER
from forge_obs.recording.reduce import Reduce, reserved_key, resolve_reduction, takes_numbers

__all__ = ["DeviceValues", "DeviceTake", "RAW_CAP"]

#: values kept per key and step for reductions without a device-side state (custom, distribution)
RAW_CAP = 4096

# reduction value -> (device state length, kind, the reduction's row from (device state read
# back, entry)); reductions not listed keep their values ("raw") and append them at flush
_LAYOUT = {
    "mean": (1, "sum", lambda v, e: (v[0], e.count)),
    "sum": (1, "sum", lambda v, e: v[0]),
    "max": (1, "max", lambda v, e: v[0]),
    "min": (1, "min", lambda v, e: v[0]),
    "std": (2, "std", lambda v, e: (e.count, v[0], v[1])),
    "last": (1, "last", lambda v, e: (v[0], e.ts)),
    "count": (0, "count", lambda v, e: e.count),
}


class _Entry:
    """One key's device state for the current step."""

    __slots__ = ("reduction", "red_name", "kind", "state", "count", "ts", "raw", "device")

    def __init__(self, reduction: Any, red_name: str, kind: str, device: Any) -> None:
        self.reduction = reduction
        self.red_name = red_name
        self.kind = kind
        self.state = None  # torch tensor on ``device`` (None for count / raw kinds)
        self.count = 0
        self.ts = -math.inf
        self.raw: list[Any] | None = [] if kind == "raw" else None
        self.device = device


class DeviceValues:
    """Per-process device accumulators (``MetricCollector._device_values``).

    Works with any non-CPU torch device; the stream bookkeeping is CUDA's. Thread-safe: updates
    of one process are serialised by one lock (they only *queue* kernels, a few µs each).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._streams: dict[Any, Any] = {}  # (device, stream id) -> stream that recorded
        self._drops: dict[str, int] = {}  # reason -> values dropped this step
        #: objects with ``take()`` (called at the cut, must be O(1)) and
        #: ``resolve(taken, accs, counters)`` (called at export): the GPU tracer's pending
        #: CUDA-event timings enter the step of the cut that took them
        self.hooks: list[Any] = []

    def add_hook(self, hook: Any) -> None:
        with self._lock:
            if hook not in self.hooks:
                self.hooks.append(hook)

    # ---------------------------------------------------------------- recording
    def record(self, key: Any, value: Any, reduction: Any) -> bool:
        """Queue the update of ``key``'s state with ``value`` (a 1-element tensor). Returns False
        (after a warning) when the value is dropped."""
        torch = _torch or _torch_mod()

        if type(key) is not str:
            if not isinstance(key, str):
                return self._drop(key, "bad_key", f"key must be a str, got {type(key).__name__}")
            key = str.__str__(key)
        if value.numel() != 1:
            return self._drop(key, "bad_value", f"{type(value).__name__} could not be read as a scalar ({value.numel()} elements, expected 1)")
        if value.is_complex():
            return self._drop(key, "bad_value", "complex device values are not supported")
        dev = value.device
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.reduction is not reduction:
                e = self._slow_entry(key, value, reduction)
                if e is None:
                    return False
            if e.device != dev:
                self._count_drop("reduction_mismatch")
                WARNER.warn("reduction_mismatch", key, f"record_metric({key!r}): device value on {dev} but this step "
                            f"already has {key!r} on {e.device}; dropped (counted in obs/dropped_values)")
                return False
            kind = e.kind
            if kind == "count":
                e.count += 1
                return True
            if dev.type == "cuda":
                self._note_stream(torch, dev)
            # no autograd context needed: the operand is detached and the state never requires grad
            v = value.detach().reshape(())
            st = e.state
            if kind == "sum":
                st.add_(v)
            elif kind == "max":
                torch.maximum(st, v, out=st)
            elif kind == "min":
                torch.minimum(st, v, out=st)
            elif kind == "std":
                # Welford with the count known on the host: delta = v - mean;
                # mean += delta / n; m2 += delta * (v - mean)
                mean = st[0]
                delta = v - mean
                mean.add_(delta, alpha=1.0 / (e.count + 1))
                st[1].add_(delta * (v - mean))
            elif kind == "last":
                st.copy_(v)
                e.ts = time.time()
            else:  # raw
                if len(e.raw) >= RAW_CAP:  # type: ignore[arg-type]
                    self._count_drop("device_cap")
                    WARNER.warn("device_cap", key, f"record_metric({key!r}): more than {RAW_CAP} device values of "
                                f"{e.red_name} this step; dropped (counted in obs/dropped_values)")
                    return False
                e.raw.append(v.to(st.dtype).reshape(1))  # type: ignore[union-attr]
            e.count += 1  # after the update: a failing op (raises to the caller's guard) counts nothing
        return True

    def _note_stream(self, torch: Any, dev: Any) -> None:
        """Remember the current stream of ``dev`` (the flush waits on it). The raw-handle lookup is
        cheap; the Stream object is fetched only for a stream not seen this step."""
        try:
            raw = torch._C._cuda_getCurrentRawStream(dev.index if dev.index is not None else torch.cuda.current_device())
        except Exception:  # noqa: BLE001 - private API gone: use the public one
            raw = None
        sk = (dev, raw)
        if raw is None or sk not in self._streams:
            st = torch.cuda.current_stream(dev)
            self._streams[(dev, raw if raw is not None else st.cuda_stream)] = st

    def _slow_entry(self, key: str, value: Any, reduction: Any) -> "_Entry | None":
        """Under the lock: first device value of ``key`` this step, or a reduction given as a
        name / differing from the step's first one."""
        import torch

        why = reserved_key(key)
        if why is not None:
            self._count_drop("reserved_key")
            WARNER.warn("reserved_key", key, f"record_metric({key!r}): {why}; dropped (counted in obs/dropped_values)")
            return None
        try:
            red = resolve_reduction(reduction)
        except ValueError as e:
            self._count_drop("unknown_reduction")
            WARNER.warn("unknown_reduction", key, f"record_metric({key!r}): {e}; value dropped")
            return None
        e = self._entries.get(key)
        if e is not None:
            if e.reduction is red:
                return e
            self._count_drop("reduction_mismatch")
            WARNER.warn("reduction_mismatch", key, f"record_metric({key!r}): recorded with {_name(red)} but this step "
                        f"already has it as {_name(e.reduction)}; value dropped (counted in obs/dropped_values)")
            return None
        name = red.value if isinstance(red, Reduce) else red
        if not takes_numbers(name):
            self._count_drop("bad_value")
            WARNER.warn("bad_value", key, f"record_metric({key!r}): a device tensor cannot be a {name} row; dropped")
            return None
        n, kind, _row = _LAYOUT.get(name, (0, "raw", None))
        dev = value.device
        e = _Entry(red, name, kind, dev)
        if kind != "count":
            dt = _acc_dtype(dev)
            with torch.inference_mode(False):  # a normal tensor even if recorded under inference_mode
                if kind == "max":
                    e.state = torch.full((1,), -math.inf, dtype=dt, device=dev)
                elif kind == "min":
                    e.state = torch.full((1,), math.inf, dtype=dt, device=dev)
                elif kind == "raw":
                    e.state = torch.empty((0,), dtype=dt, device=dev)  # carries the dtype only
                else:
                    e.state = torch.zeros((n,), dtype=dt, device=dev)
        self._entries[key] = e
        return e

    def _count_drop(self, reason: str) -> None:
        """Under the lock."""
        add_count(self._drops, reason)

    def _drop(self, key: Any, reason: str, why: str) -> bool:
        with self._lock:
            self._count_drop(reason)
        kt = key if type(key) is str else safe_repr(key)
        WARNER.warn(reason, kt, f"record_metric({kt}): {why}; dropped (counted in obs/dropped_values)")
        return False

    # ---------------------------------------------------------------- flushing
    def swap(self) -> "DeviceTake | None":
        """Take this step's device states in O(1) (no device sync): the cut of a flush. Hooks
        (the GPU tracer's pending timings) are taken at the same moment. ``None``: nothing."""
        with self._lock:
            entries, self._entries = self._entries, {}
            streams, self._streams = self._streams, {}
            drops, self._drops = self._drops, {}
            hooks = list(self.hooks)
        taken_hooks = []
        for hook in hooks:
            try:
                taken_hooks.append((hook, hook.take()))
            except Exception as e:  # noqa: BLE001 - a flush never fails because of a hook
                WARNER.warn("device_hook", repr(hook), f"device hook failed to take its values: {e!r}")
        if not entries and not drops and not any(t for _, t in taken_hooks):
            return None
        return DeviceTake(entries, streams, drops, taken_hooks)


class DeviceTake:
    """Device values taken at a cut; :meth:`resolve_into` reads them (one device-to-host copy
    per device) and adds them to the collector's values of the same cut."""

    def __init__(self, entries: dict, streams: dict, drops: dict, hooks: list) -> None:
        self.entries = entries
        self.streams = streams
        self.drops = drops  # reason -> values dropped while recording
        self.hooks = hooks  # [(hook, what hook.take() returned)]

    def resolve_into(self, taken: Any) -> None:
        """Read the device states and add them to ``taken`` (the collector's
        :class:`~forge_obs.recording.collector.Taken` of the same cut) as rows of their reductions. Runs on
        the exporting thread, never on the training thread."""
        entries, streams = self.entries, self.streams
        for reason, n in self.drops.items():
            taken.drop(reason, n)
        for hook, data in self.hooks:
            try:
                hook.resolve(data, taken)
            except Exception as e:  # noqa: BLE001 - a flush never fails because of a hook
                WARNER.warn("device_hook", repr(hook), f"device hook failed: {e!r}")
        if not entries:
            return
        import torch

        # which flat slice of the per-device buffer holds each entry
        by_dev: dict[Any, list[Any]] = {}
        size: dict[Any, int] = {}
        where: dict[str, tuple[Any, int, int]] = {}
        for key, e in entries.items():
            t = (torch.cat(e.raw) if e.raw else None) if e.kind == "raw" else e.state
            off = size.get(e.device, 0)
            if t is None:
                where[key] = (e.device, off, 0)
                continue
            n = int(t.numel())
            by_dev.setdefault(e.device, []).append(t)
            size[e.device] = off + n
            where[key] = (e.device, off, n)
        host: dict[Any, list[float]] = {}
        for dev, parts in by_dev.items():
            if dev.type == "cuda":
                cur = torch.cuda.current_stream(dev)
                for (sdev, _), s in streams.items():
                    if sdev == dev and s != cur:
                        cur.wait_stream(s)
            try:
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                host[dev] = _to_host(flat)  # the one device-to-host copy per device
            except Exception as e:  # noqa: BLE001 - a flush never fails: drop this device's values
                WARNER.warn("device_error", str(dev), f"device values on {dev} could not be read at flush ({e!r}); dropped")
        for key, e in entries.items():
            if e.count == 0:
                continue
            dev, off, n = where[key]
            if n and dev not in host:
                taken.drop("device_error", e.count)
                continue
            vals = host.get(dev, [])[off : off + n]
            if e.kind == "raw":  # values read back one by one: appended (any reduction)
                for v in vals:
                    taken.add(key, v, e.reduction)
                if any(v - v for v in vals):
                    taken.note_nonfinite(key)
                continue
            if any(v - v for v in vals):
                taken.note_nonfinite(key)
            taken.merge_row(key, e.reduction, _LAYOUT[e.red_name][2](vals, e), e.count)


def _torch_mod() -> Any:
    global _torch
    import torch

    _torch = torch
    return torch


def _to_host(flat: Any) -> list[float]:
    """One device-to-host copy. On CUDA: an async copy into pinned memory, then a wait on an
    event of the flushing thread's stream (so only this thread waits, and
    ``torch.cuda.set_sync_debug_mode`` set by the training thread does not flag the flush)."""
    import torch

    if flat.device.type != "cuda":
        return flat.cpu().tolist()
    buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    buf.copy_(flat, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(flat.device))
    ev.synchronize()
    return buf.tolist()


def _acc_dtype(dev: Any) -> Any:
    import torch

    return torch.float32 if dev.type == "mps" else torch.float64


def _name(r: Any) -> str:
    return r.name if isinstance(r, Reduce) else str(r)


_torch: Any = None
