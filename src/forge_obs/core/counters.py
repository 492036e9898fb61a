"""The one way counts are added up: a count by name, and a snapshot's counters (numbers, and
``{reason: n}`` dicts) into a total.

    >>> from forge_obs.core.counters import add_count, merge_counters
    >>> total = {}
    >>> merge_counters(total, {"values_recorded": 3, "dropped_by_reason": {"bad_key": 1}})
    >>> merge_counters(total, {"values_recorded": 2, "dropped_by_reason": {"bad_key": 2}})
    >>> add_count(total, "late_states")
    >>> total
    {'values_recorded': 5, 'dropped_by_reason': {'bad_key': 3}, 'late_states': 1}
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

__all__ = ["add_count", "add_counts", "merge_counters"]


def add_count(into: dict, key: Any, n: float = 1) -> None:
    """``into[key] += n``, from 0."""
    into[key] = into.get(key, 0) + n


def add_counts(into: dict, counts: Mapping) -> dict:
    """Every ``counts[k]`` added to ``into[k]``; returns ``into``."""
    for k, n in counts.items():
        into[k] = into.get(k, 0) + n
    return into


def merge_counters(into: dict, counters: Mapping, skip: Iterable[str] = ()) -> None:
    """A snapshot's ``counters`` added to the total ``into``: numbers by name, ``{reason: n}``
    dicts by name and reason; names in ``skip`` and values of any other type are left out."""
    for name, v in counters.items():
        if name in skip:
            continue
        if isinstance(v, dict):
            add_counts(into.setdefault(name, {}), v)
        elif isinstance(v, (int, float)):
            into[name] = into.get(name, 0) + v
