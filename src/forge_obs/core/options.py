"""The one way a config section is checked: unknown keys raise ``ValueError`` naming the valid
ones; a section parses into a dataclass whose fields are its keys.

    >>> from forge_obs.core.options import check_keys
    >>> check_keys("demo", {"every": 1}, ("every",))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, TypeVar

__all__ = ["check_keys", "parse_options"]

T = TypeVar("T")


def check_keys(section: str, given: Iterable[Any], valid: Iterable[str], more: str = "", also: Iterable[str] = ()) -> None:
    """The one unknown-key check of every config section: ``ValueError`` naming the unknown
    key(s) and the valid ones (``more`` says what else is accepted, the keys in ``also``).

        >>> check_keys("console backend", {"compat": True}, ("compact", "every"))
        Traceback (most recent call last):
        ...
        ValueError: console backend: unknown key(s) ['compat']; valid: compact, every
    """
    valid = list(valid)
    ok = set(valid) | set(also)
    unknown = sorted((k for k in given if k not in ok), key=str)
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; valid: {', '.join(valid)}{more}")


def parse_options(cls: type[T], section: str, cfg: dict[str, Any] | None, also: Iterable[str] = (), more: str = "") -> T:
    """A config dict as the dataclass ``cls`` (its fields are the valid keys; values are checked
    by its ``__post_init__``); keys in ``also`` are accepted and left to the caller.

        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Opts:
        ...     every: int = 1
        >>> parse_options(Opts, "demo", {"every": 5})
        Opts(every=5)
    """
    cfg = dict(cfg or {})
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    check_keys(section, cfg, names, more, also)
    return cls(**{k: v for k, v in cfg.items() if k in names})

#: top-level keys of ``init_backends``'s config that are not backends
