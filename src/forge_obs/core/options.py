"""The one way a config section is checked: unknown keys raise ``ValueError`` naming the valid
ones; a section parses into a dataclass whose fields are its keys. What an error quotes of the
user's config (an unknown key, a bad value) goes through :mod:`forge_obs.core.redact`'s rule.

    >>> from forge_obs.core.options import check_keys
    >>> check_keys("demo", {"every": 1}, ("every",))
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, TypeVar

from forge_obs.core.redact import redact_key, redact_text

__all__ = ["check_keys", "parse_options", "redacted_errors"]

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
        shown = [redact_key(k) if isinstance(k, str) else k for k in unknown]
        raise ValueError(f"{section}: unknown key(s) {shown}; valid: {', '.join(valid)}{more}")


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
    with redacted_errors():  # a value's check quotes the value
        return cls(**{k: v for k, v in cfg.items() if k in names})


@contextmanager
def redacted_errors() -> Iterator[None]:
    """Around config checks that quote the user's values: a ``ValueError`` whose message holds a
    credential-looking part is raised again with it masked (:func:`forge_obs.core.redact.redact_text`),
    the original not chained; any other passes as it is.

        >>> with redacted_errors():
        ...     raise ValueError("bad value 'sk-proj-abcdefghijklmnopqrst'")
        Traceback (most recent call last):
        ...
        ValueError: bad value '***'
    """
    try:
        yield
    except ValueError as e:
        text = str(e)
        masked = redact_text(text)
        if masked == text:
            raise
        raise ValueError(masked) from None

#: top-level keys of ``init_backends``'s config that are not backends
