"""Bounded, downsampled series: min/max buckets over steps, merged two by two when full.

    >>> s = Buckets(cap=4)
    >>> for step in range(10):
    ...     s.add(step, float(step % 3))
    >>> s.width, len(s)                      # 10 steps in at most 4 buckets: 4 steps a bucket
    (4, 3)
    >>> [round(v, 1) for v in s.points()[1]]  # each bucket's min and max, in the order of their steps
    [0.0, 2.0, 2.0, 0.0, 2.0, 0.0]

A series holds at most ``cap`` buckets whatever the number of steps: a bucket covers ``width``
steps (a power of two) and keeps the minimum and the maximum with the steps they were at, the
last value and its count of non-finite values. When there would be more than ``cap`` buckets,
the width doubles and neighbouring buckets merge. The minimum and maximum of every stretch of
steps survive every merge, so a spike stays visible at any zoom. Non-finite values (NaN is a
signal) are counted per bucket and never hide a finite minimum or maximum.

:meth:`Buckets.add` only appends to a buffer of at most ``cap`` raw points; the buffer is folded
into the buckets with numpy when it is full or when the buckets are read.
"""

from __future__ import annotations

from array import array

import numpy as np

__all__ = ["Buckets", "merge_to", "align"]

_FIELDS = ("b", "lo", "lo_s", "hi", "hi_s", "last", "nf")


def _regroup(f: dict) -> dict:
    """Buckets sorted by key ``b`` with equal keys merged (min/max with their steps, the last
    value, non-finite counts summed)."""
    b = f["b"]
    if len(b) < 2 or not (b[1:] == b[:-1]).any():
        return f
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    counts = np.diff(np.r_[starts, len(b)])
    gid = np.repeat(np.arange(len(starts)), counts)
    out = {"b": b[starts], "last": f["last"][starts + counts - 1], "nf": np.add.reduceat(f["nf"], starts)}
    for ext, red in (("lo", np.fmin), ("hi", np.fmax)):
        vals = red.reduceat(f[ext], starts)
        steps = f[ext + "_s"][starts].copy()
        hit = np.flatnonzero(f[ext] == vals[gid])  # NaN never equals: an all-NaN bucket keeps its first step
        if len(hit):
            g, first = np.unique(gid[hit], return_index=True)
            steps[g] = f[ext + "_s"][hit[first]]
        out[ext], out[ext + "_s"] = vals, steps
    return out


class Buckets:
    __slots__ = ("cap", "_w", "_f", "_ps", "_pv", "_folded")

    def __init__(self, cap: int = 1024) -> None:
        self.cap = max(2, cap)
        self._w = 1
        self._f = {k: np.empty(0, np.float64 if k in ("lo", "hi", "last") else np.int64) for k in _FIELDS}
        self._ps, self._pv = array("q"), array("d")  # raw points not folded yet
        self._folded = 0

    def add(self, step: int, v: float) -> None:
        self._ps.append(step)
        self._pv.append(v)
        if len(self._ps) >= self.cap:
            self._fold()

    @property
    def width(self) -> int:
        """Steps per bucket."""
        self._fold()
        return self._w

    @property
    def n(self) -> int:
        """Points added."""
        return self._folded + len(self._ps)

    def _fold(self) -> None:
        if not self._ps:
            return
        ps = np.array(self._ps, dtype=np.int64)
        pv = np.array(self._pv, dtype=np.float64)
        self._folded += len(ps)
        self._ps, self._pv = array("q"), array("d")
        fin = np.where(np.isfinite(pv), pv, np.nan)
        new = {"b": ps // self._w, "lo": fin, "lo_s": ps, "hi": fin.copy(), "hi_s": ps.copy(), "last": pv,
               "nf": (~np.isfinite(pv)).astype(np.int64)}
        f = {k: np.concatenate((self._f[k], new[k])) for k in _FIELDS}
        if len(f["b"]) > 1 and (f["b"][1:] < f["b"][:-1]).any():  # a step older than the last (a resumed run)
            order = np.argsort(f["b"], kind="stable")
            f = {k: v[order] for k, v in f.items()}
        self._f = _regroup(f)
        self._shrink()

    def _shrink(self) -> None:
        while len(self._f["b"]) > self.cap:
            self._w *= 2
            self._f = _regroup(dict(self._f, b=self._f["b"] // 2))

    def compact(self, cap: int | None = None) -> None:
        """Double the width until at most ``cap`` (default: own cap) buckets remain."""
        if cap is not None:
            self.cap = max(2, cap)
        self._fold()
        self._shrink()

    def _get(self, k: str) -> np.ndarray:
        self._fold()
        return self._f[k]

    def __len__(self) -> int:
        return len(self._get("b"))

    lo = property(lambda self: self._get("lo"))
    hi = property(lambda self: self._get("hi"))
    last = property(lambda self: self._get("last"))
    nonfinite = property(lambda self: self._get("nf"))

    def points(self, lo_step: int | None = None, hi_step: int | None = None) -> tuple[list[int], list[float | None]]:
        """Each bucket's minimum and maximum at their steps, in step order (one point when they
        are at one step; None for a bucket of non-finite values only), those within
        ``[lo_step, hi_step]``."""
        f = self._in_range(lo_step, hi_step)
        nan = np.isnan(f["lo"])
        first = np.where(nan, f["b"] * self._w, np.minimum(f["lo_s"], f["hi_s"]))
        a_s, a_v = np.where(f["lo_s"] <= f["hi_s"], f["lo_s"], f["hi_s"]), np.where(f["lo_s"] <= f["hi_s"], f["lo"], f["hi"])
        b_s, b_v = np.where(f["lo_s"] <= f["hi_s"], f["hi_s"], f["lo_s"]), np.where(f["lo_s"] <= f["hi_s"], f["hi"], f["lo"])
        xs: list[int] = []
        ys: list = []
        for i, (s1, v1, s2, v2) in enumerate(zip(a_s.tolist(), a_v.tolist(), b_s.tolist(), b_v.tolist())):
            if nan[i]:
                xs.append(int(first[i]))
                ys.append(None)
                continue
            for st, v in ((s1, v1), (s2, v2)) if s2 != s1 else ((s1, v1),):
                if (lo_step is None or st >= lo_step) and (hi_step is None or st <= hi_step):
                    xs.append(st)
                    ys.append(v)
        return xs, ys

    def _in_range(self, lo_step: int | None, hi_step: int | None) -> dict:
        f = {k: self._get(k) for k in _FIELDS}
        if lo_step is None and hi_step is None:
            return f
        first = np.minimum(f["lo_s"], f["hi_s"])
        last = np.maximum(f["lo_s"], f["hi_s"])
        keep = np.ones(len(first), bool)
        if lo_step is not None:
            keep &= last >= lo_step
        if hi_step is not None:
            keep &= first <= hi_step
        return {k: v[keep] for k, v in f.items()}

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._f.values()) + 8 * (len(self._ps) + len(self._pv))


def merge_to(s: Buckets, n: int, lo_step: int | None = None, hi_step: int | None = None) -> Buckets:
    """``s`` within ``[lo_step, hi_step]`` in at most ``n`` buckets (min and max kept)."""
    out = Buckets(max(2, n))
    out._f = s._in_range(lo_step, hi_step)  # folds what ``s`` had not folded yet: its width is final
    out._w = s._w
    out._folded = s.n
    out._shrink()
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
