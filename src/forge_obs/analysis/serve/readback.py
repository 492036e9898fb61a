"""A run's exact values read back from ``metrics.jsonl``: a step's rows (the drill-down), a zoomed
chart finer than the held buckets, and the CSV export. Each is one seek and a read of the byte
range the held steps know (:meth:`~forge_obs.analysis.serve.held.Held.byte_span`), never the whole run.

    >>> import json, tempfile, pathlib, threading
    >>> from forge_obs.analysis.serve.files import Confined
    >>> from forge_obs.analysis.serve.held import Held, ServeConfig
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "mode": "global_reduce", "wall_time": 1.0 + s, "metrics": {"loss": 1.0 / (s + 1)}}
    ...         for s in range(3)]
    >>> text = "".join(json.dumps(r) + "\\n" for r in rows)
    >>> _ = (d / "metrics.jsonl").write_text(text)
    >>> h = Held(ServeConfig())
    >>> off = 0
    >>> for r, line in zip(rows, text.splitlines(keepends=True)):
    ...     h.add(off, r)
    ...     off += len(line)
    >>> rb = ReadBack(d / "metrics.jsonl", Confined(d), ServeConfig(), threading.RLock())
    >>> rb.step_detail(h, 1)["global"]
    {'loss': 0.5}
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.serve.files import Confined
from forge_obs.analysis.serve.held import Held, ServeConfig
from forge_obs.analysis.serve.ranges import Memo, read_rows, value_of
from forge_obs.analysis.serve.series import Buckets
from forge_obs.analysis.store import metric_row_problem
from forge_obs.core.formatting import flatten

__all__ = ["ReadBack"]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class ReadBack:
    """Exact reads of ``path`` (a run's ``metrics.jsonl``, opened through ``files``); ``lock``
    guards the held state and this object's caches (the run's lock)."""

    def __init__(self, path: Path, files: Confined, cfg: ServeConfig, lock: Any) -> None:
        self.path, self.files, self.cfg, self.lock = path, files, cfg, lock
        self._cache: OrderedDict = OrderedDict()  # the last complete zoomed ranges' answers
        self._memo: tuple[tuple[int, int], Memo] | None = None  # the last zoomed range's decoded rows

    def _open(self) -> Any:
        return self.files.open(self.path)

    def step_rows(self, held: Held, step: int) -> list[dict]:
        """The rows of ``step`` (every mode)."""
        ent = held.steps.get(step)
        if ent is None:
            return []
        lo, hi = ent[2], ent[3]
        out = []
        try:
            f = self._open()
        except OSError:
            return []
        with f:
            f.seek(lo)
            data = f.read(min(hi - lo, self.cfg.max_step_bytes))
            data += f.readline()
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(row, dict) and row.get("step") == step and metric_row_problem(row) is None:
                out.append(row)
        return out

    def step_detail(self, held: Held, step: int) -> dict[str, Any]:
        """What the drill-down shows of ``step``: global values, per-rank values, SAMPLE rows."""
        glob: dict[str, Any] = {}
        ranks: dict[str, dict[str, Any]] = {}
        samples: dict[str, list] = {}
        missing: list = []
        for row in self.step_rows(held, step):
            metrics = row.get("metrics") or {}
            if row.get("mode") == "global_reduce":
                missing = row.get("missing") or missing
                for key, v in metrics.items():
                    if isinstance(v, list):
                        samples[key] = v[: self.cfg.sample_rows]
                    else:
                        flatten(key, v, glob)
            elif row.get("mode") == "per_rank_reduce":
                flat: dict[str, float] = {}
                for key, v in metrics.items():
                    flatten(key, v, flat)
                ranks.setdefault(str((row.get("source") or {}).get("label") or "?"), {}).update(flat)
        ent = held.steps.get(step) or [None, None]
        return {"step": step, "wall_time": ent[0], "policy_version": ent[1], "global": _finite(glob),
                "ranks": {k: _finite(v) for k, v in ranks.items()}, "samples": samples, "missing": missing}

    def exact(self, held: Held, names: list[str], lo: int, hi: int, per: int, mode: str, rank_key: str | None,
              current: Any) -> tuple[dict, dict] | None:
        """``names`` over steps ``[lo, hi]`` in at most ``per`` buckets each, read back (None: the
        range spans more than ``exact_max_bytes``, or ``current()`` is false once read: the run
        was replaced meanwhile)."""
        cache_key = (tuple(names), lo, hi, per, mode, rank_key)
        with self.lock:
            span = held.byte_span(lo, hi)
            if cache_key in self._cache:
                self._cache.move_to_end(cache_key)
                return self._cache[cache_key]
            complete = held.last_step is not None and hi < held.last_step  # no row of the range is still to come
        if span is not None and span[1] - span[0] > self.cfg.exact_max_bytes:
            return None
        out = {k: Buckets(per) for k in names}
        if span is not None:
            self._fill(out, span, lo, hi, mode, rank_key)
        width = max((b.width for b in out.values()), default=1)
        res = ({k: b.points(lo, hi) for k, b in out.items()}, {"width": width, "exact": width == 1, "read": True})
        with self.lock:
            if not current():
                return None
            if complete:
                self._cache[cache_key] = res
                while len(self._cache) > 64:
                    self._cache.popitem(last=False)
        return res

    def _fill(self, out: dict, span: tuple, lo: int, hi: int, mode: str, rank_key: str | None) -> None:
        wanted = [rank_key] if rank_key else list(out)
        with self.lock:
            if self._memo is None or self._memo[0] != span:
                self._memo = (span, Memo(self.cfg.memo_bytes))
            memo = self._memo[1]
        for row in read_rows(self._open, span[0], span[1], wanted, mode, memo):
            step = row["step"]
            if not lo <= step <= hi:
                continue
            if rank_key is None:
                for k, b in out.items():
                    if (v := value_of(row["metrics"], k)) is not None:
                        b.add(step, v)
            elif (b := out.get(str((row.get("source") or {}).get("label") or "?"))) is not None:
                if (v := value_of(row["metrics"], rank_key)) is not None:
                    b.add(step, v)

    def csv_rows(self, held: Held, keys: list[str], lo: int | None = None, hi: int | None = None,
                 rank_key: str | None = None) -> Iterator[list]:
        """The header, then one row per step of ``[lo, hi]`` (all steps when not given): the
        step, seconds since the run's first step, and each key's exact value (``rank_key``: that
        key's value on each rank, one column a rank), in file order, a chunk at a time."""
        with self.lock:
            lo = held.order[0] if lo is None and held.order else lo
            hi = held.order[-1] if hi is None and held.order else hi
            span = held.byte_span(lo, hi) if lo is not None and hi is not None else None
            t0 = held.t0 or 0.0
            cols = held.rank_labels(rank_key) if rank_key else [k for k in keys if k in held.series]
            name = rank_key if rank_key is None else held.rank_name(rank_key)
        yield ["step", "wall_time_s", *cols]
        if span is None:
            return
        mode = "per_rank_reduce" if rank_key else "global_reduce"
        index = {c: i for i, c in enumerate(cols)}
        current: list | None = None
        for row in read_rows(self._open, span[0], span[1], [name] if rank_key else cols, mode):
            step = row["step"]
            if not lo <= step <= hi:
                continue
            if current is None or current[0] != step:
                if current is not None:
                    yield current
                wall = row.get("wall_time")
                current = [step, wall - t0 if _num(wall) else None, *([None] * len(cols))]
            if rank_key is None:
                for c, i in index.items():
                    current[2 + i] = value_of(row["metrics"], c)
            elif (i := index.get(str((row.get("source") or {}).get("label") or "?"))) is not None:
                current[2 + i] = value_of(row["metrics"], name)
        if current is not None:
            yield current


def _finite(d: dict[str, float]) -> dict[str, Any]:
    """Values JSON can carry: NaN / inf as text."""
    return {k: (v if math.isfinite(v) else str(v)) for k, v in d.items()}
