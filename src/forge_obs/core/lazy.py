"""A package's public names, imported on first use.

A package ``__init__`` that imports its submodules at load nests the package's import lock
around theirs; a thread that imports one of those submodules directly while another imports the
package can then deadlock (a new mesh process unpickles on several threads at once). A package
that exports through :func:`lazy_exports` imports only this leaf module at load. (The
``forge_obs`` facade itself imports nothing at all, not even this: every forge_obs module's
import passes through it.)

    >>> getattr_, dir_ = lazy_exports("pkg", {"dumps": "json"}, ["dumps"], {})
    >>> getattr_("dumps").__name__, dir_()
    ('dumps', ['dumps'])
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: dict[str, str], public: list[str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps each public name to the module
    that defines it; a name, once imported, is stored in ``namespace`` (the package's globals), so
    later lookups are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        mod = names.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__
