"""Helpers that take a value of any type and never raise: what error paths and backends use to
describe or classify a user's value without a second exception hiding the first.

    >>> class Bad:
    ...     def __str__(self): raise RuntimeError("boom")
    ...     __repr__ = __str__
    >>> safe_str("loss"), safe_str(3), safe_str(Bad())
    ('loss', '3', '<Bad>')
    >>> safe_repr("x" * 500)[-5:], len(safe_repr("x" * 500)), safe_repr(Bad())
    ('xxxxx', 200, '<Bad>')
    >>> is_number(1.5), is_number(2), is_number(True), is_number("3")
    (True, True, False, False)
    >>> print(printable("loss\\x1b[31m\\nfake"))
    loss\\x1b[31m\\nfake

Nothing here imports Monarch or torch; ``safe_str`` returns a ``str`` argument unchanged without
a call to ``str()``, so it costs one type check on the common path.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["safe_str", "safe_repr", "is_number", "printable", "write_line", "printing", "OUTPUT_WAIT_S"]

#: held while forge_obs writes a line (:func:`write_line`) and while a user's callback that may
#: print runs (:func:`printing`): the callback's ``print`` (its text and its line end are two
#: writes) and forge_obs's lines never interleave
_OUTPUT = threading.RLock()
#: how long a line waits for a callback still printing; then it is written anyway (a callback
#: that blocks delays forge_obs's output by this much, never stops it)
OUTPUT_WAIT_S = 1.0


def _type_text(x: Any) -> str:
    try:
        return f"<{type(x).__name__}>"
    except Exception:  # noqa: BLE001 - a metaclass whose __name__ raises
        return "<?>"


def safe_str(x: Any) -> str:
    """``str(x)``; ``"<TypeName>"`` when ``__str__`` raises."""
    if type(x) is str:
        return x
    try:
        return str(x)
    except Exception:  # noqa: BLE001 - describing a bad value never raises
        return _type_text(x)


def safe_repr(x: Any, limit: int = 200) -> str:
    """``repr(x)`` cut to ``limit`` characters; ``"<TypeName>"`` when ``__repr__`` raises."""
    try:
        return repr(x)[:limit]
    except Exception:  # noqa: BLE001 - a repr that raises never hides the real message
        return _type_text(x)


def is_number(v: Any) -> bool:
    """An ``int`` or ``float`` (subclasses included), not a ``bool``."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def printable(s: str) -> str:
    """``s`` with every character that is not printable (ANSI escapes, newlines, tabs, other
    control and format characters) written as ``repr`` writes it (``\\x1b``, ``\\n``, ``\\u2028``):
    text shown on a terminal cannot move the cursor, recolour it or fake a line."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def write_line(out: Any, text: str, flush: bool = False) -> None:
    """``text`` and its line end in one ``write`` to ``out``: what other threads print comes
    before or after the line, never inside it; what a callback run by :func:`printing` prints
    (``print`` writes its arguments, separators and line end one by one) comes whole before or
    after it."""
    held = _OUTPUT.acquire(timeout=OUTPUT_WAIT_S)
    try:
        out.write(text + "\n")
        if flush:
            out.flush()
    finally:
        if held:
            _OUTPUT.release()


def printing(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` (a user's callback) run so that whatever it prints lands between forge_obs's lines
    (:func:`write_line`), never inside them."""

    def run(arg: Any) -> Any:
        with _OUTPUT:
            return fn(arg)

    return run
