"""The metric rules of :mod:`.rules` replayed over ``metrics.jsonl``, step by step, exactly as the
live ``"alerts"`` backend runs them; each incident (firing ... resolved, or still active at the
end) becomes one :class:`~forge_obs.analysis.doctor.finding.Finding`.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.subjects import Identities
    >>> from forge_obs.analysis.doctor.replay import metric_findings
    >>> metric_findings("runs/does-not-exist", DoctorConfig(), Identities(), [], True)[1:]
    (['metrics: no metrics.jsonl: non-finite values, missing ranks and staleness not judged'], None)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.contention import Evidence, HostContention
from forge_obs.analysis.doctor.detect import growth
from forge_obs.analysis.doctor.finding import Finding
from forge_obs.analysis.doctor.subjects import GLOBAL, Identities
from forge_obs.analysis.doctor.rule_base import Event, StepView
from forge_obs.analysis.doctor.rules import build_rules
from forge_obs.analysis.doctor.value_rules import Staleness
from forge_obs.core.types import LoggingMode

__all__ = ["step_views", "metric_findings"]

#: the modes of the rows a step logged (a row without one is a global row); a ``late`` row (values
#: known after its step was logged, written at shutdown) is not replayed
_STEP_MODES = {None, *(m.value for m in LoggingMode)}


def step_views(rows: Iterator[dict], ids: Identities, stats: dict) -> Iterator[StepView]:
    """Group consecutive rows of one step into a :class:`StepView` (identities learnt on the way)."""
    view: StepView | None = None
    for row in rows:
        mode = row.get("mode")
        if mode not in _STEP_MODES:
            continue
        step = row.get("step")
        if view is None or step != view.step:
            if view is not None:
                yield view
            view = StepView(step, 0.0)
        if mode == "global_reduce" or (mode is None and not row.get("source")):
            view.global_values.update(row.get("metrics") or {})
            view.wall_time = float(row.get("wall_time") or 0.0)
            view.missing.extend(row.get("missing") or ())
            continue
        src = row.get("source") or {}
        label = str(src.get("label") or "?")
        if src:
            ids.learn(src)
            view.sources[label] = src
        if mode == "per_rank_reduce":
            stats["per_rank"] += 1
            view.per_rank.setdefault(label, {}).update(row.get("metrics") or {})
        else:  # per_rank_no_reduce: raw values, the last one per key
            vals = view.per_rank.setdefault(label, {})
            for item in row.get("values") or ():
                if isinstance(item, (list, tuple)) and len(item) > 1:
                    vals.setdefault(item[0], item[1])
    if view is not None:
        yield view


def _finding(e: Event) -> Finding:
    f = Finding(e.rule, e.message, steps=[e.onset_step, e.last_step], details=dict(e.details), onset_step=e.onset_step,
                consequences=list(e.consequences))
    return f.set_where(e.where)


def metric_findings(run_dir: "str | Path", cfg: DoctorConfig, ids: Identities, user_rules: list,
                    has_timeline: bool) -> tuple[list[Finding], list[str], Evidence | None]:
    """The metric rules' findings and notes, and the telemetry they saw (the ``host_contention``
    rule's :class:`~forge_obs.analysis.doctor.contention.Evidence`; None without metrics.jsonl)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return [], ["metrics: no metrics.jsonl: non-finite values, missing ranks and staleness not judged"], None
    rules = build_rules(cfg, ids, user_rules, skip_timeline_equivalent=has_timeline, keep_all=True)
    last: dict[str, Event] = {}  # incident id -> its latest event
    order: list[str] = []
    stats = {"per_rank": 0, "steps": 0}
    for view in step_views(_rows(path), ids, stats):
        stats["steps"] += 1
        for rule in rules:
            for e in rule.update(view):
                if e.key not in last:
                    order.append(e.key)
                last[e.key] = e
    for rule in rules:
        for e in rule.finish():
            if e.key not in last:
                order.append(e.key)
            last[e.key] = e
    out = [_finding(last[k]) for k in order]
    stale = next((r.all for r in rules if isinstance(r, Staleness)), None) or {}
    out += _whole_run_staleness(cfg, ids, stale, {f.details.get("key") for f in out if f.kind == "staleness"})
    notes = []
    if stats["steps"] and not stats["per_rank"]:
        notes.append("metrics: metrics.jsonl has no per-rank rows (jsonl logging_mode without per_rank_reduce): "
                     "non-finite values and staleness are attributed to the global value only")
    host = next((r for r in rules if isinstance(r, HostContention)), None)
    return out, notes, host.evidence if host is not None else None


def _rows(path: Path) -> Iterator[dict]:
    """The rows of ``metrics.jsonl``: from the run's index (brought up to date), or where it cannot
    be built here (no DuckDB or pyarrow), from the file."""
    from forge_obs.analysis.index import available

    if available():
        from forge_obs.analysis.index import open_index

        return open_index(path.parent).metric_rows()
    from forge_obs.analysis.store import read_jsonl

    return read_jsonl(path)


def _whole_run_staleness(cfg: DoctorConfig, ids: Identities, stale: dict, done: set) -> list[Finding]:
    """Growth too slow for the rolling window: the first third of the run against the last."""
    out = []
    per_rank_keys = {k for (lb, k) in stale if lb is not None}
    for (label, key), series in stale.items():
        if key in done or (label is None and key in per_rank_keys):
            continue
        series.sort(key=lambda x: x[0])
        g = growth([s for s, _v, _src in series], [v for _s, v, _src in series], cfg.staleness_growth)
        if g is None:
            continue
        src = series[-1][2]
        w = ids.of_source(src) if src else (ids.of_label(label) if label else dict(GLOBAL))
        msg = (f"'{key}' on {w['where']} grows over the run: {g['first']:.2f} -> {g['last']:.2f} "
               f"(slope {g['slope']:.3f}/step): generators fall behind the trainer")
        f = Finding("staleness", msg, steps=[series[0][0], series[-1][0]], onset_step=series[0][0],
                    details={"key": key, "first_third_mean": g["first"], "last_third_mean": g["last"],
                             "slope": g["slope"]})
        out.append(f.set_where(w))
    return out
