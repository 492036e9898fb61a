"""The doctor's rules over metrics, one step at a time: the live ``"alerts"`` backend feeds them
each :class:`~forge_obs.backends.record.StepRecord`; ``forge-obs doctor`` replays ``metrics.jsonl``
through the same objects. Each rule keeps bounded state (rolling windows, counters), never
re-reads history, and emits an :class:`Event` when a condition starts (``firing``) and when it
ends (``resolved``); :meth:`Rule.finish` returns what is still active at the end of the data.

    >>> from forge_obs.analysis.doctor.config import DoctorConfig
    >>> from forge_obs.analysis.doctor.rule_base import StepView
    >>> from forge_obs.analysis.doctor.rules import build_rules
    >>> rules = build_rules(DoctorConfig(), user_rules=["trainer/loss > 10"])
    >>> for step, loss in enumerate([1.0, 12.0, 3.0]):
    ...     view = StepView(step, float(step), {"trainer/loss": loss})
    ...     for rule in rules:
    ...         for e in rule.update(view):
    ...             print(step, e.state, e.rule, e.message)
    1 firing threshold trainer/loss > 10: 12 at step 1
    2 resolved threshold trainer/loss > 10: 12 at step 1 (until step 1)

Rules: ``nonfinite`` (one event per root: the first key to go NaN/inf, on the rank where it did,
with what followed), ``missing_ranks`` (ranks that did not report at a flush), ``quiet_rank``
(a rank that answers but stopped recording values it used to record), ``staleness`` (a
``*staleness*`` metric growing), ``throughput_drop`` (a throughput metric or the step rate down to
``throughput_drop`` of its rolling median), ``straggler`` / ``slowdown`` (per-rank duration
metrics: the :class:`~forge_obs.analysis.doctor.detect.GroupTracker` the timeline doctor uses on
spans), ``sync_bottleneck`` (a state-moving duration metric taking ``sync_share`` of the step),
``host_contention`` (a straggler, slowdown or drop that was its host's: the processes waited for
a CPU; :mod:`.contention`) and ``threshold`` (user rules such as ``"trainer/loss > 10"``).
Modules: :mod:`.rule_base` (a step, an event, the keys a rule looks at), :mod:`.value_rules`,
:mod:`.duration_rules`, :mod:`.user_rules`, :mod:`.contention`.
"""

from __future__ import annotations

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.contention import HostContention
from forge_obs.analysis.doctor.duration_rules import Stragglers, SyncShare
from forge_obs.analysis.doctor.rule_base import KeyIndex, Rule
from forge_obs.analysis.doctor.subjects import Identities
from forge_obs.analysis.doctor.user_rules import Thresholds, UserRule
from forge_obs.analysis.doctor.value_rules import MissingRanks, NonFinite, Staleness, Throughput

__all__ = ["RULES", "build_rules"]


#: rule name -> class (``disable`` in the alerts config takes these names)
RULES: dict[str, type] = {
    "nonfinite": NonFinite,
    "missing_ranks": MissingRanks,
    "straggler": Stragglers,
    "sync_bottleneck": SyncShare,
    "staleness": Staleness,
    "throughput_drop": Throughput,  # a drop that starts with one of the above follows from it
    "host_contention": HostContention,  # runs first (build_rules): the evidence of a step, before the rules that ask it
}


def build_rules(cfg: DoctorConfig, ids: Identities | None = None, user_rules: list | None = None,
                disable: tuple = (), skip_timeline_equivalent: bool = False, keep_all: bool = False,
                live: bool = False) -> list[Rule]:
    """The rules, in the order they run (the host's evidence first, then roots before symptoms).
    ``keep_all`` (the doctor): the staleness rule keeps whole series for its whole-run test.
    ``live`` (the alerts backend): the NaN rule reads values only at steps that recorded a
    non-finite one, and the telemetry evidence keeps the last 512 samples per process and host.
    ``host_contention`` in ``disable``: stragglers and drops are judged without it."""
    ids = ids or Identities()
    keys = KeyIndex()
    out: list[Rule] = []
    contention = None
    if "host_contention" not in disable:
        contention = HostContention(cfg, ids, keys, keep=512 if live else None)
        out.append(contention)
    for name, cls in RULES.items():
        if name in disable or (skip_timeline_equivalent and cls.timeline_equivalent) or cls is HostContention:
            continue
        if cls is Stragglers:
            out.append(cls(cfg, ids, keys, slowdowns="slowdown" not in disable, contention=contention))
        elif cls is Throughput:
            out.append(cls(cfg, ids, keys, contention=contention))
        elif cls is Staleness:
            out.append(cls(cfg, ids, keys, keep_all=keep_all))
        elif cls is NonFinite:
            out.append(cls(cfg, ids, keys, counted=live))
        else:
            out.append(cls(cfg, ids, keys))
    parsed = [u if isinstance(u, UserRule) else UserRule.parse(u) for u in (user_rules or [])]
    if parsed:
        out.append(Thresholds(cfg, ids, parsed, keys))
    return out
