"""``forge-obs doctor``: findings over a run directory, one per root event.

    >>> from forge_obs.analysis.doctor import diagnose_run
    >>> d = diagnose_run("runs/does-not-exist")
    >>> d.findings
    []
    >>> d.notes[0]
    'timeline: no events/ directory: stragglers, slowdowns, hangs, stalls and sync bottlenecks not judged'

Each finding names mesh / actor / rank (and the replica, for a mesh that is one of several
replicas), the step it started (``onset_step``), and lists what followed from it under
``consequences``. What a rule could not judge is in ``notes`` (a mesh with one rank, too few
steps, spans without steps, no per-rank rows).

Timeline rules (:mod:`.timeline`): ``straggler`` (a rank out of line with the other ranks of its
mesh, per span and step, from 2 ranks up), ``slowdown`` (a rank, or every rank of a mesh, out of
line with its own history), ``hang``, ``stall``, ``sync_bottleneck``, ``dropped``,
``missing_ranks`` (selected ranks without a timeline). Metric rules (:mod:`.rules`, the same
objects the live ``"alerts"`` backend runs): ``nonfinite``, ``missing_ranks``, ``quiet_rank``,
``staleness``, ``throughput_drop``, ``threshold`` (``--rule``); ``straggler`` / ``slowdown`` /
``sync_bottleneck`` on duration metrics when the run has no timeline. Thresholds:
:class:`~forge_obs.analysis.doctor.config.DoctorConfig`. Findings about time cite the controller
step's critical path (:mod:`.path`): how much of their steps they were on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.finding import Finding, format_findings
from forge_obs.analysis.doctor.host_findings import host_contention
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.doctor.roots import merge_root_events
from forge_obs.analysis.doctor.path import cite_paths
from forge_obs.analysis.doctor.replay import metric_findings
from forge_obs.analysis.doctor.user_rules import UserRule
from forge_obs.analysis.doctor.timeline_rules import timeline_findings

__all__ = ["diagnose", "diagnose_run", "Diagnosis", "DoctorConfig", "Finding", "format_findings"]


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "notes": list(self.notes)}

    def format(self) -> str:
        return format_findings(self.findings, self.notes)


def diagnose_run(run_dir: "str | Path", config: DoctorConfig | None = None, rules: list | None = None,
                 **settings: Any) -> Diagnosis:
    """Findings and notes over ``run_dir`` (``events/`` and ``metrics.jsonl``). ``settings``
    override :class:`DoctorConfig` fields by name; ``rules`` adds threshold rules
    (``"trainer/loss > 10"``)."""
    if config is None:
        config = DoctorConfig.from_dict(settings)
    elif settings:
        config = DoctorConfig.from_dict({**{k: getattr(config, k) for k in DoctorConfig.names()}, **settings})
    user_rules = [UserRule.parse(r) for r in rules or ()]  # ValueError on a bad rule, before any work
    from forge_obs.analysis.index.updater import no_gc

    with no_gc():  # the per-step tables are millions of objects without cycles
        return _diagnose(Path(run_dir), config, user_rules)


def _diagnose(run_dir: Path, config: DoctorConfig, user_rules: list) -> Diagnosis:
    ids = Identities()
    notes: list[str] = []
    has_timeline = (run_dir / "events").is_dir()
    found, n = timeline_findings(run_dir, config, ids)
    notes += n
    if not has_timeline:
        notes.append("timeline: no events/ directory: stragglers, slowdowns, hangs, stalls and sync bottlenecks "
                     "not judged" + (" (straggler, slowdown and sync_bottleneck judged on duration metrics instead)"
                                     if (run_dir / "metrics.jsonl").exists() else ""))
    m, n, evidence = metric_findings(run_dir, config, ids, user_rules, has_timeline)
    notes += n
    judged, n = host_contention(found + m, evidence, config)
    notes += n
    findings = merge_root_events(judged)
    if has_timeline:
        try:
            cite_paths(run_dir, findings, config.wait_spans)
        except Exception as e:  # noqa: BLE001 - the findings stand without their citation
            notes.append(f"critical path: not judged ({type(e).__name__}: {e})")
    return Diagnosis(findings, notes)


def diagnose(run_dir: "str | Path", **settings: Any) -> list[Finding]:
    """The findings of :func:`diagnose_run`."""
    return diagnose_run(run_dir, **settings).findings
