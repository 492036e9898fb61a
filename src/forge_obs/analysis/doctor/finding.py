"""A doctor finding: one root event, who it is about, when it started, and what followed from it.

    >>> from forge_obs.analysis.doctor.finding import Finding, format_findings
    >>> f = Finding("nonfinite", "'loss' is NaN at step 20", mesh="trainer", actor="Trainer", rank=0,
    ...             steps=[20, 20], onset_step=20, where="trainer/Trainer/r0",
    ...             consequences=[{"kind": "nonfinite", "where": "global", "key": "loss", "steps": [20, 20],
    ...                            "message": "'loss' NaN in the global value"}])
    >>> print(format_findings([f]))
    doctor: 1 finding(s)
      [nonfinite] trainer/Trainer/r0 step 20: 'loss' is NaN at step 20
          then: global step 20: 'loss' NaN in the global value
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from forge_obs.analysis.doctor.subjects import describe

__all__ = ["Finding", "steps_text", "format_findings"]


@dataclass
class Finding:
    kind: str
    message: str
    mesh: str | None = None
    actor: str | None = None
    rank: int | None = None
    steps: list = field(default_factory=list)  # [first, last]
    details: dict = field(default_factory=dict)
    replica: int | None = None
    #: the full label: ``mesh/actor/rN`` (``global`` for a value reduced over every rank)
    where: str = ""
    #: the step the condition started (``since step N``); None where the data has no steps
    onset_step: int | None = None
    #: what followed from this event: ``[{"kind", "where", "message", "steps", ...}]``
    consequences: list = field(default_factory=list)
    #: how much of its steps it was on the controller step's critical path (:mod:`.path`); None
    #: where not judged
    critical_path: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def set_where(self, where: dict) -> "Finding":
        self.mesh, self.actor, self.rank = where.get("mesh"), where.get("actor"), where.get("rank")
        self.replica, self.where = where.get("replica"), where.get("where") or ""
        return self


def steps_text(steps: list) -> str:
    if not steps:
        return ""
    if len(steps) > 1 and steps[0] != steps[-1]:
        return f" steps {steps[0]}..{steps[-1]}"
    return f" step {steps[0]}"


def format_findings(findings: list[Finding], notes: list[str] | None = None) -> str:
    """Text for a terminal: one line per finding, its consequences indented under it, then what
    could not be judged."""
    lines = [f"doctor: {len(findings)} finding(s)" if findings else "doctor: no findings"]
    for f in findings:
        where = describe({"where": f.where or f.mesh, "replica": f.replica})
        lines.append(f"  [{f.kind}] {where}{steps_text(f.steps)}: {f.message}")
        for c in f.consequences:
            cw = describe(c) if c.get("where") else "-"
            lines.append(f"      then: {cw}{steps_text(c.get('steps') or [])}: {c.get('message', '')}")
    if notes:
        lines.append("not judged / how it was judged:")
        lines.extend(f"  - {n}" for n in notes)
    return "\n".join(lines)
