"""What the report shows, read from a run directory and sorted into what deserves a chart.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "mode": "global_reduce", "wall_time": 100.0 + s,
    ...          "metrics": {"trainer/loss": 1.0 / (s + 1), "trainer/lr": 3e-4}} for s in range(3)]
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> run = RunData(d)
    >>> [(k, run.kind(k)) for k in sorted(run.series)]
    [('trainer/loss', 'chart'), ('trainer/lr', 'constant')]

A global series is a ``chart`` when it has two or more distinct values, ``constant`` when every
point has the same value, ``single`` when it has one point. A distribution (a value with
``p50``/``p90``/``p99``/``count``) is one chart of its quantiles. A per-rank chart exists only for a
key that two or more ranks recorded and whose ranks' values differ somewhere.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_obs.core.formatting import QUANTILES, flatten, is_distribution

__all__ = [
    "Point",
    "GROUP_ORDER",
    "OVERVIEW_PANELS",
    "STEP_TOTAL_KEYS",
    "STEP_PART_PATTERNS",
    "overview_panels",
    "group_of",
    "group_sort_key",
    "Panel",
    "RunData",
]

#: (step, wall time or None, value); a non-finite value is kept (NaN is a signal)
Point = tuple[int, "float | None", float]

GROUP_ORDER = ("trainer", "generator", "service", "buffer", "reference", "reward", "controller")

#: the run's story, drawn first: (panel title, key patterns); a panel shows every non-``obs/`` key
#: that matches one of its patterns (``re.search``), and is left out when none does
OVERVIEW_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", (r"(^|/)reward(_mean)?$", r"(^|/)correct_frac$", r"(^|/)accuracy$")),
    ("loss", (r"(^|/)loss$",)),
    ("KL", (r"(^|/)kl(_|$)",)),
    ("entropy", (r"entropy",)),
    ("throughput (tokens/s)", (r"(^|/)tokens_per_s$",)),
    ("staleness", (r"staleness", r"policy_age")),
)
#: the step-time breakdown: the total (first key found) and its parts, stacked in this order;
#: what the parts do not cover is drawn as "other"
STEP_TOTAL_KEYS = ("controller/step_s", "trainer/step_s")
STEP_PART_PATTERNS = (r"wait\w*_s$", r"batch_creation_s$", r"forward_backward_s$", r"(^|/)forward_s$",
                      r"(^|/)backward_s$", r"optimizer\w*_s$", r"allreduce\w*_s$", r"weights?_push_s$",
                      r"^span/(\w*wait\w*|batch_creation|forward_backward|optimizer\w*|\w*allreduce\w*|weights?_push)/duration_s$")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def group_of(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else "(top level)"


def group_sort_key(g: str) -> tuple:
    return (g == "obs", GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g)


def _finite(vals: list[float]) -> list[float]:
    return [v for v in vals if math.isfinite(v)]


def overview_panels(keys: "list[str]") -> "list[Panel]":
    """The run's story panels over global ``keys`` (``obs/`` keys left out): one per
    :data:`OVERVIEW_PANELS` entry that matches a key, then the step-time breakdown."""
    keys = [k for k in keys if not k.startswith("obs/")]
    order = sorted(keys, key=lambda k: (group_sort_key(group_of(k)), k))
    panels: list[Panel] = []
    for title, pats in OVERVIEW_PANELS:
        hit = [k for k in order if any(re.search(p, k) for p in pats)]
        if hit:
            panels.append(Panel(title, hit))
    total = next((k for k in STEP_TOTAL_KEYS if k in keys), None)
    parts: list[str] = []
    for pat in STEP_PART_PATTERNS:
        for k in order:
            if k != total and k not in parts and re.search(pat, k):
                parts.append(k)
    if parts or total:
        panels.append(Panel("step time breakdown (s)", parts, stacked=True, total=total))
    return panels


@dataclass
class Panel:
    """One overview chart: its title and the keys drawn on it (``stacked``: a step-time breakdown)."""

    title: str
    keys: list[str]
    stacked: bool = False
    total: str | None = None


def _rows(run_dir: Path) -> Any:
    """The well-formed rows of ``metrics.jsonl``, in order, read from the run's index
    (:mod:`forge_obs.analysis.index`); from the file itself where the index cannot be built
    (DuckDB or pyarrow missing: the report needs neither)."""
    from forge_obs.analysis.index import available, open_index

    if not available():
        from forge_obs.analysis.store import read_jsonl

        yield from read_jsonl(run_dir / "metrics.jsonl")
        return
    cur = open_index(run_dir).connect().execute("SELECT json FROM _metric_rows ORDER BY off")
    for batch in iter(lambda: cur.fetchmany(4096), []):
        for (text,) in batch:
            yield json.loads(text)


class RunData:
    """Every series of ``metrics.jsonl`` and the run's ``meta.json``.

    - ``series``: global key -> [(step, wall, value)] (a distribution's quantiles as ``key/p50`` ...)
    - ``rank_series``: key -> rank label -> points (a distribution: its p50)
    - ``distributions``: the distribution keys; ``samples``: key -> (step, rows) of the latest SAMPLE
    """

    def __init__(self, run_dir: "str | Path") -> None:
        self.run_dir = Path(run_dir)
        self.meta: dict[str, Any] = {}
        self.series: dict[str, list[Point]] = {}
        self.rank_series: dict[str, dict[str, list[Point]]] = {}
        self.distributions: set[str] = set()
        self.samples: dict[str, tuple[int, list[dict]]] = {}
        self.missing_steps = 0
        self.raw_values = 0
        self.t0: float | None = None
        self.last_step: int | None = None
        self._global_steps: set[int] = set()
        self._charts: list[str] | None = None
        meta_path = self.run_dir / "meta.json"
        if meta_path.exists():
            try:
                self.meta = json.loads(meta_path.read_text())
            except (OSError, json.JSONDecodeError):
                self.meta = {"error": "meta.json is not valid JSON"}
            if not isinstance(self.meta, dict):
                self.meta = {"error": "meta.json is not a JSON object"}
        if not (self.run_dir / "metrics.jsonl").exists():
            return
        for row in _rows(self.run_dir):
            self._add_row(row)

    def _add_row(self, row: dict[str, Any]) -> None:
        mode = row.get("mode", "global_reduce")
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        wall = float(row["wall_time"]) if _is_num(row.get("wall_time")) else None
        if wall is not None and (self.t0 is None or wall < self.t0):
            self.t0 = wall
        metrics = row.get("metrics") if isinstance(row.get("metrics"), dict) else {}
        if mode == "global_reduce":
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self._global_steps.add(step)
            if row.get("missing"):
                self.missing_steps += 1
            for key, v in metrics.items():
                if isinstance(v, list):
                    if v and all(isinstance(r, dict) for r in v):
                        self.samples[key] = (step, v)
                    continue
                if is_distribution(v):
                    self.distributions.add(key)
                flat: dict[str, float] = {}
                flatten(key, v, flat)
                for k, x in flat.items():
                    self.series.setdefault(k, []).append((step, wall, x))
        elif mode == "per_rank_reduce":
            label = str((row.get("source") or {}).get("label") or "?")
            for key, v in metrics.items():
                if is_distribution(v):  # per rank: the median is the line worth comparing
                    v = v["p50"]
                    key = f"{key}/p50"
                flat = {}
                flatten(key, v, flat)
                for k, x in flat.items():
                    self.rank_series.setdefault(k, {}).setdefault(label, []).append((step, wall, x))
        elif mode == "per_rank_no_reduce":
            self.raw_values += len(row.get("values") or ())

    # ------------------------------------------------------------------ classification
    def dist_of(self, key: str) -> str | None:
        """The distribution ``key`` is a part of (``gen/len/p50`` -> ``gen/len``), else None."""
        base, _, leaf = key.rpartition("/")
        return base if base in self.distributions and leaf in (*QUANTILES, "count") else None

    def kind(self, key: str) -> str:
        """``chart``, ``constant`` (>= 2 points, one value) or ``single`` (one point)."""
        pts = self.series[key]
        if len(pts) < 2:
            return "single"
        vals = [v for _s, _w, v in pts]
        fin = _finite(vals)
        if len(fin) == len(vals) and max(fin) == min(fin):
            return "constant"
        return "chart"

    def chart_keys(self) -> list[str]:
        """Keys with a chart of their own: varying series, and each distribution once."""
        if self._charts is not None:
            return self._charts
        out: list[str] = []
        for key in self.series:
            d = self.dist_of(key)
            if d is not None:
                if key == f"{d}/p50" and any(self.kind(f"{d}/{q}") == "chart" for q in QUANTILES if f"{d}/{q}" in self.series):
                    out.append(d)
                continue
            if self.kind(key) == "chart":
                out.append(key)
        self._charts = out
        return out

    def flat_keys(self) -> list[str]:
        """Constant and single-point series (a distribution's only when all of it is flat)."""
        charts = set(self.chart_keys())
        out = []
        for key in self.series:
            d = self.dist_of(key)
            if d is not None:
                if key == f"{d}/p50" and d not in charts:
                    out.append(d)
                continue
            if self.kind(key) != "chart":
                out.append(key)
        return out

    def groups(self) -> list[tuple[str, list[str], list[str]]]:
        """(group, chart keys, flat keys), groups in the order trainer, generator, ..., obs last."""
        charts: dict[str, list[str]] = {}
        flats: dict[str, list[str]] = {}
        for k in self.chart_keys():
            charts.setdefault(group_of(k), []).append(k)
        for k in self.flat_keys():
            flats.setdefault(group_of(k), []).append(k)
        names = sorted(set(charts) | set(flats), key=group_sort_key)
        return [(g, sorted(charts.get(g, [])), sorted(flats.get(g, []))) for g in names]

    def rank_chart_keys(self) -> list[str]:
        """Keys recorded by >= 2 ranks whose values differ between ranks or over time."""
        out = []
        for key, by in self.rank_series.items():
            if len(by) < 2 or key.endswith("/count") or max(len(pts) for pts in by.values()) < 2:
                continue
            vals = {v for pts in by.values() for _s, _w, v in pts}
            if len(vals) > 1 or any(not math.isfinite(v) for v in vals):
                out.append(key)
        return sorted(out, key=lambda k: (group_sort_key(group_of(k)), k))

    def points(self, key: str) -> list[Point]:
        """A chart key's points (a distribution: its p50)."""
        return self.series.get(key) or self.series.get(f"{key}/p50") or []

    # ------------------------------------------------------------------ overview
    def overview(self) -> list[Panel]:
        return overview_panels([k for k in self.series if self.dist_of(k) is None])

    # ------------------------------------------------------------------ summaries
    def summary(self, key: str) -> dict[str, Any]:
        pts = self.series.get(key) or []
        vals = [v for _s, _w, v in pts]
        fin = _finite(vals)
        out: dict[str, Any] = {"points": len(vals), "nonfinite": len(vals) - len(fin)}
        if pts:
            out["first_step"], out["last_step"] = pts[0][0], pts[-1][0]
            out["last"] = vals[-1]
        if fin:
            out["min"], out["max"] = min(fin), max(fin)
        return out

    def n_global_steps(self) -> int:
        """Distinct steps with a global row."""
        return len(self._global_steps)
