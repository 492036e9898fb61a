"""Bounded, downsampled series: min/max buckets over steps, merged two by two when full.

    >>> s = Buckets(cap=4)
    >>> for step in range(10):
    ...     s.add(step, float(step % 3))
    >>> s.width, len(s)                      # 10 steps in at most 4 buckets: 4 steps a bucket
    (4, 3)
    >>> [round(v, 1) for v in s.points()[1]]  # each bucket's min then max, at their steps
    [0.0, 2.0, 2.0, 0.0, 2.0, 0.0]

A series holds at most ``cap`` buckets whatever the number of steps: a bucket covers ``width``
steps (a power of two) and keeps the first step, the minimum and the maximum with the steps they
were at, and the last value. When a new bucket would exceed ``cap``, the width doubles and
neighbouring buckets merge. The minimum and maximum of every stretch of steps survive every
merge, so a spike stays visible at any zoom. Non-finite values (NaN is a signal) are counted per
bucket and never hide a finite minimum or maximum.
"""

from __future__ import annotations

import math
from array import array
from typing import Iterable

__all__ = ["Buckets", "merge_to", "align"]


class Buckets:
    __slots__ = ("cap", "width", "b", "lo", "lo_s", "hi", "hi_s", "last", "nonfinite", "n")

    def __init__(self, cap: int = 1024) -> None:
        self.cap = max(2, cap)
        self.width = 1
        self.b = array("q")  # bucket index: first step // width
        self.lo, self.hi, self.last = array("d"), array("d"), array("d")
        self.lo_s, self.hi_s = array("q"), array("q")
        self.nonfinite = array("l")
        self.n = 0  # points added

    def __len__(self) -> int:
        return len(self.b)

    def add(self, step: int, v: float) -> None:
        self.n += 1
        fin = math.isfinite(v)
        k = step // self.width
        if self.b and self.b[-1] == k:
            i = len(self.b) - 1
            self.last[i] = v
            if not fin:
                self.nonfinite[i] += 1
            elif math.isnan(self.lo[i]) or v < self.lo[i]:
                self.lo[i], self.lo_s[i] = v, step
                if math.isnan(self.hi[i]):
                    self.hi[i], self.hi_s[i] = v, step
            elif v > self.hi[i]:
                self.hi[i], self.hi_s[i] = v, step
            return
        if self.b and k < self.b[-1]:  # a step older than the last bucket (a resumed run): merged there
            self._add_old(step, v, fin)
            return
        x = v if fin else math.nan
        self.b.append(k)
        self.lo.append(x)
        self.hi.append(x)
        self.lo_s.append(step)
        self.hi_s.append(step)
        self.last.append(v)
        self.nonfinite.append(0 if fin else 1)
        if len(self.b) > self.cap:
            self.compact()

    def _add_old(self, step: int, v: float, fin: bool) -> None:
        import bisect

        k = step // self.width
        i = max(0, min(bisect.bisect_right(self.b, k) - 1, len(self.b) - 1))
        if not fin:
            self.nonfinite[i] += 1
        elif math.isnan(self.lo[i]) or v < self.lo[i]:
            self.lo[i], self.lo_s[i] = v, step
            if math.isnan(self.hi[i]):
                self.hi[i], self.hi_s[i] = v, step
        elif v > self.hi[i]:
            self.hi[i], self.hi_s[i] = v, step

    def compact(self, cap: int | None = None) -> None:
        """Double the width until at most ``cap`` (default: own cap) buckets remain."""
        if cap is not None:
            self.cap = max(2, cap)
        while len(self.b) > self.cap:
            self.width *= 2
            out = Buckets(self.cap)
            out.width = self.width
            for i in range(len(self.b)):
                _merge_into(out, self.b[i] // 2, self.lo[i], self.lo_s[i], self.hi[i], self.hi_s[i], self.last[i], self.nonfinite[i])
            for name in ("b", "lo", "hi", "lo_s", "hi_s", "last", "nonfinite"):
                setattr(self, name, getattr(out, name))

    def points(self, lo_step: int | None = None, hi_step: int | None = None) -> tuple[list[int], list[float | None]]:
        """Each bucket's minimum and maximum at their steps, in step order (one point when they
        are at one step; None for a bucket of non-finite values only)."""
        xs: list[int] = []
        ys: list[float | None] = []
        for i in range(len(self.b)):
            a, b = (self.lo_s[i], self.lo[i]), (self.hi_s[i], self.hi[i])
            if (lo_step is not None and max(a[0], b[0]) < lo_step) or (hi_step is not None and min(a[0], b[0]) > hi_step):
                continue
            if math.isnan(a[1]):
                xs.append(self.b[i] * self.width)
                ys.append(None)
                continue
            for s, v in sorted({a, b}):
                xs.append(s)
                ys.append(v)
        return xs, ys

    def buckets(self) -> Iterable[tuple]:
        for i in range(len(self.b)):
            yield self.b[i], self.lo[i], self.lo_s[i], self.hi[i], self.hi_s[i], self.last[i], self.nonfinite[i]

    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.b, self.lo, self.hi, self.lo_s, self.hi_s, self.last,
                                                   self.nonfinite))


def _merge_into(out: Buckets, k: int, lo: float, lo_s: int, hi: float, hi_s: int, last: float, nf: int) -> None:
    if out.b and out.b[-1] == k:
        i = len(out.b) - 1
        out.last[i] = last
        out.nonfinite[i] += nf
        if not math.isnan(lo) and (math.isnan(out.lo[i]) or lo < out.lo[i]):
            out.lo[i], out.lo_s[i] = lo, lo_s
        if not math.isnan(hi) and (math.isnan(out.hi[i]) or hi > out.hi[i]):
            out.hi[i], out.hi_s[i] = hi, hi_s
        return
    out.b.append(k)
    out.lo.append(lo)
    out.hi.append(hi)
    out.lo_s.append(lo_s)
    out.hi_s.append(hi_s)
    out.last.append(last)
    out.nonfinite.append(nf)


def merge_to(s: Buckets, n: int, lo_step: int | None = None, hi_step: int | None = None) -> Buckets:
    """``s`` within ``[lo_step, hi_step]`` in at most ``n`` buckets (min and max kept)."""
    out = Buckets(max(2, n))
    out.width = s.width
    for k, lo, lo_s, hi, hi_s, last, nf in s.buckets():
        first = lo_s if not math.isnan(lo) else k * s.width
        if (lo_step is not None and max(lo_s, hi_s, first) < lo_step) or (hi_step is not None and first > hi_step):
            continue
        _merge_into(out, k, lo, lo_s, hi, hi_s, last, nf)
    out.compact()
    return out


def align(series: list[tuple[list[int], list]]) -> tuple[list[int], list[list]]:
    """Several (xs, ys) on one shared, sorted x axis; a series has None where it has no point."""
    xs = sorted({x for sx, _ in series for x in sx})
    index = {x: i for i, x in enumerate(xs)}
    out = []
    for sx, sy in series:
        col: list = [None] * len(xs)
        for x, y in zip(sx, sy):
            col[index[x]] = y
        out.append(col)
    return xs, out
