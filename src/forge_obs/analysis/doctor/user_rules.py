"""User rules: ``"trainer/loss > 10"`` (``--rule`` of the doctor, ``"rules"`` of the alerts) on
global values.

    >>> from forge_obs.analysis.doctor.user_rules import UserRule
    >>> UserRule.parse("trainer/*_s > 5").text
    'trainer/*_s > 5'
"""

from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from forge_obs.analysis.doctor.config import DoctorConfig
from forge_obs.analysis.doctor.rule_base import Event, KeyIndex, Rule, StepView, number
from forge_obs.analysis.doctor.subjects import GLOBAL, Identities

__all__ = ["UserRule", "Thresholds"]


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}
_RULE_RE = re.compile(r"^\s*(\S+)\s*(>=|<=|==|!=|>|<)\s*([-+0-9.eEinfaINFA]+)\s*$")


@dataclass
class UserRule:
    """``key op value`` on the global value of ``key`` (``fnmatch`` patterns match several keys);
    fires after ``for_steps`` consecutive steps."""

    key: str
    op: str
    value: float
    for_steps: int = 1
    name: str = ""

    @classmethod
    def parse(cls, spec: Any) -> "UserRule":
        """``"trainer/loss > 10"`` or ``{"key": ..., "op": ..., "value": ..., "for_steps": 1, "name": ...}``."""
        syntax = ("a rule is 'KEY OP NUMBER' (OP one of " + " ".join(_OPS) +
                  "), e.g. 'trainer/loss > 10', or a dict with key, op, value[, for_steps, name]")
        if isinstance(spec, str):
            m = _RULE_RE.match(spec)
            if not m:
                raise ValueError(f"bad alert rule {spec!r}: {syntax}")
            key, op, val = m.groups()
            try:
                return cls(key, op, float(val))
            except ValueError:
                raise ValueError(f"bad alert rule {spec!r}: {syntax}") from None
        if isinstance(spec, dict):
            unknown = set(spec) - {"key", "op", "value", "for_steps", "name"}
            if unknown or not {"key", "op", "value"} <= set(spec):
                raise ValueError(f"bad alert rule {spec!r}: {syntax}")
            if spec["op"] not in _OPS:
                raise ValueError(f"bad alert rule {spec!r}: op must be one of {', '.join(_OPS)}")
            try:
                return cls(str(spec["key"]), spec["op"], float(spec["value"]), int(spec.get("for_steps", 1)),
                           str(spec.get("name", "")))
            except (TypeError, ValueError):
                raise ValueError(f"bad alert rule {spec!r}: {syntax}") from None
        raise ValueError(f"bad alert rule {spec!r}: {syntax}")

    @property
    def text(self) -> str:
        return self.name or f"{self.key} {self.op} {self.value:g}"


class Thresholds(Rule):
    name = "threshold"

    def __init__(self, cfg: DoctorConfig, ids: Identities, rules: list[UserRule],
                 keys: KeyIndex | None = None) -> None:
        super().__init__(cfg, ids, keys)
        self.rules = rules
        self.match: dict[str, list] = {}  # key -> rules that match it
        self.keys = self.key_index.keyset(lambda k: bool(self._rules_for(k)))
        self.streak: dict[tuple, int] = {}
        self.active: dict[tuple, dict] = {}

    def _rules_for(self, key: str) -> list:
        r = self.match.get(key)
        if r is None:
            r = self.match[key] = [u for u in self.rules if u.key == key or (
                any(c in u.key for c in "*?[") and fnmatch.fnmatchcase(key, u.key))]
        return r

    def update(self, view: StepView) -> list[Event]:
        out = []
        g = view.global_values
        for k in self.keys.of(view, None, g):
            rules = self._rules_for(k)
            x = number(g.get(k))
            if x is None:
                continue
            for u in rules:
                ik = (u.text, k)
                ok = _OPS[u.op](x, u.value)
                inc = self.active.get(ik)
                if ok:
                    n = self.streak[ik] = self.streak.get(ik, 0) + 1
                    if inc is None and n >= u.for_steps:
                        inc = self.active[ik] = {"onset": view.step - n + 1, "last": view.step, "value": x, "rule": u}
                        out.append(self._event(ik, inc, "firing", view.step))
                    elif inc is not None:
                        inc["last"] = view.step
                else:
                    self.streak[ik] = 0
                    if inc is not None:
                        out.append(self._event(ik, self.active.pop(ik), "resolved", view.step))
        return out

    def _event(self, ik: tuple, inc: dict, state: str, step: int) -> Event:
        u, key = inc["rule"], ik[1]
        head = u.text if u.key == key else f"{u.text} ({key})"
        msg = f"{head}: {inc['value']:.6g} at step {inc['onset']}"
        if state != "firing":
            msg += f" (until step {inc['last']})"
        return Event(self.name, state, f"threshold:{u.text}:{key}", step, inc["onset"], inc["last"], msg, dict(GLOBAL),
                     {"key": key, "rule": u.text, "value": inc["value"]})

    def finish(self) -> list[Event]:
        return [self._event(ik, inc, "active", inc["last"]) for ik, inc in self.active.items()]

