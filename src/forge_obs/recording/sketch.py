"""A mergeable quantile sketch: the ``"distribution"`` reduction (p50 / p90 / p99).

    >>> from forge_obs.recording.sketch import DistributionAccumulator, DISTRIBUTION
    >>> a = DistributionAccumulator(DISTRIBUTION)
    >>> for v in range(1, 101): a.append(float(v))
    >>> v = a.get_value()
    >>> v["count"], abs(v["p50"] - 50) <= 0.5, abs(v["p99"] - 99) <= 1.0
    (100, True, True)

DDSketch-style log buckets: a positive value ``x`` goes to bucket ``ceil(log_gamma(x))`` with
``gamma = (1 + alpha) / (1 - alpha)``, and a bucket is read back as the value whose relative
distance to both bucket edges is ``alpha``. So every quantile is returned with a **relative error
of at most ``alpha`` (1 %)** of the nearest-rank quantile (the ``ceil(q * count)``-th smallest
sample; so the p99 of 3 samples is the largest), as long as no bucket was collapsed. Negative values use a mirrored
set of buckets, zeros (``|x| < 1e-12``) their own counter. At most ``MAX_BUCKETS`` buckets are
kept per sign; beyond that the *smallest-magnitude* buckets are merged (the low quantiles lose
accuracy first, never the tail). Durations from 100 ns to 1 day need about 1,400 buckets.

States merge exactly (bucket counts add), so a cross-rank p99 is the p99 of all samples, not a
mean of per-rank p99s. ``min``/``max``/``sum`` are kept exactly and quantiles are clamped into
``[min, max]``. NaN values are counted (``nan`` in the value) but not bucketed; ``±inf`` are
counted at the ends (``pinf`` / ``ninf`` in the state), so a p99 above every finite value is
``inf``. Nothing here raises for any float.

``record_metric(key, value, "distribution")`` (or ``forge_obs.recording.sketch.DISTRIBUTION``) records a
value; the reduced value is a dict ``{"p50", "p90", "p99", "count"}`` (JSON-serialisable; the
console prints it as a dict). This module imports neither torch nor Monarch.
"""

from __future__ import annotations

import math
from typing import Any

from forge_obs.recording.reduce import MaxAccumulator, MetricAccumulator, MinAccumulator, exact_fsum, reduction_type_of, register_reduction

__all__ = ["DistributionAccumulator", "DISTRIBUTION", "ALPHA", "MAX_BUCKETS", "quantile"]

#: relative accuracy of every returned quantile
ALPHA = 0.01
#: buckets kept per sign before the smallest-magnitude ones are collapsed
MAX_BUCKETS = 2048
_GAMMA = (1 + ALPHA) / (1 - ALPHA)
_INV_LOG_GAMMA = 1.0 / math.log(_GAMMA)
_ZERO = 1e-12
_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

_log = math.log
_ceil = math.ceil


class DistributionAccumulator(MetricAccumulator):
    """Log-bucket sketch (relative error ``ALPHA``) reporting p50/p90/p99 and the count."""

    def reset(self) -> None:
        self.pos: dict[int, int] = {}
        self.neg: dict[int, int] = {}
        self.zero = 0
        self.pinf = 0
        self.ninf = 0
        self.count = 0
        self.nan = 0
        self.total = 0.0
        self.lo = math.inf
        self.hi = -math.inf

    def append(self, value: float) -> None:
        # every field is computed before any is written: a value that raises (an int beyond the
        # float range: OverflowError from the sum) leaves no trace
        if value > _ZERO:
            try:
                i = _ceil(_log(value) * _INV_LOG_GAMMA)
            except OverflowError:  # +inf
                return self._append_inf(value)
            b = self.pos
        elif value < -_ZERO:
            try:
                i = _ceil(_log(-value) * _INV_LOG_GAMMA)
            except OverflowError:  # -inf
                return self._append_inf(value)
            b = self.neg
        elif value == value:
            self.zero += 1
            self.count += 1
            if value < self.lo:
                self.lo = value
            if value > self.hi:
                self.hi = value
            return
        else:
            self.nan += 1
            return
        total = self.total + value
        try:
            b[i] += 1
        except KeyError:  # a new bucket (rare once the range is covered)
            b[i] = 1
            if len(b) > MAX_BUCKETS:
                _collapse(b)
        self.count += 1
        self.total = total
        if value < self.lo:
            self.lo = value + 0.0
        if value > self.hi:
            self.hi = value + 0.0

    def _append_inf(self, value: float) -> None:
        if value > 0:
            self.pinf += 1
            self.hi = value
        else:
            self.ninf += 1
            self.lo = value
        self.count += 1
        self.total += value

    def get_state(self) -> dict[str, Any]:
        return self._state(
            alpha=ALPHA, pos=dict(self.pos), neg=dict(self.neg), zero=self.zero, pinf=self.pinf,
            ninf=self.ninf, count=self.count, nan=self.nan, sum=self.total, min=self.lo, max=self.hi,
        )

    @classmethod
    def merge_states(cls, states: list[dict[str, Any]]) -> dict[str, Any]:
        pos: dict[int, int] = {}
        neg: dict[int, int] = {}
        for s in states:
            for i, n in s["pos"].items():
                pos[i] = pos.get(i, 0) + n
            for i, n in s["neg"].items():
                neg[i] = neg.get(i, 0) + n
        while len(pos) > MAX_BUCKETS:
            _collapse(pos)
        while len(neg) > MAX_BUCKETS:
            _collapse(neg)
        return {
            "reduction_type": reduction_type_of(states[0]),
            "alpha": states[0].get("alpha", ALPHA),
            "pos": pos,
            "neg": neg,
            "zero": sum(s["zero"] for s in states),
            "pinf": sum(s.get("pinf", 0) for s in states),
            "ninf": sum(s.get("ninf", 0) for s in states),
            "count": sum(s["count"] for s in states),
            "nan": sum(s.get("nan", 0) for s in states),
            "sum": exact_fsum([s["sum"] for s in states]),
            "min": MinAccumulator.merge_rows([s["min"] for s in states]),
            "max": MaxAccumulator.merge_rows([s["max"] for s in states]),
        }

    @classmethod
    def value_from_state(cls, state: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {name: quantile(state, q) for name, q in _QUANTILES}
        out["count"] = state["count"]
        if state.get("nan"):
            out["nan"] = state["nan"]
        return out


def _collapse(b: dict[int, int]) -> None:
    """Merge the two smallest-magnitude buckets (keeps the tail exact to ``ALPHA``)."""
    keys = sorted(b)[:2]
    b[keys[1]] += b.pop(keys[0])


def _bucket_value(i: int) -> float:
    try:
        return 2.0 * _GAMMA**i / (_GAMMA + 1.0)
    except OverflowError:  # a bucket at the top of the float range (clamped to max by the caller)
        return math.inf


def quantile(state: dict[str, Any], q: float) -> float:
    """The ``q``-quantile (0..1) of a distribution state; NaN when it holds no value."""
    n = state["count"]
    if not n:
        return math.nan
    rank = max(0, _ceil(q * n - 1e-9) - 1)  # nearest-rank definition
    seen = state.get("ninf", 0)
    neg, pos = state["neg"], state["pos"]
    v = -math.inf if seen > rank else None
    for i in (sorted(neg, reverse=True) if v is None else ()):  # most negative first
        seen += neg[i]
        if seen > rank:
            v = -_bucket_value(i)
            break
    if v is None:
        seen += state["zero"]
        if seen > rank:
            v = 0.0
        else:
            for i in sorted(pos):
                seen += pos[i]
                if seen > rank:
                    v = _bucket_value(i)
                    break
    if v is None:  # above every bucket: +inf values (or counts that do not add up)
        v = math.inf if state.get("pinf") else state["max"]
    return min(max(v, state["min"]), state["max"])


#: the registered reduction name; pass it to ``record_metric`` (a plain "distribution" works too)
DISTRIBUTION = register_reduction("distribution", DistributionAccumulator)
