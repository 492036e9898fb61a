"""A package's face: its public names, each imported from the module that defines it on first use.

Every face of forge_obs is written one way: ``__all__`` (the contract) and a table ``name ->
module`` served by :func:`lazy_exports`::

    from forge_obs.core.lazy import lazy_exports

    __all__ = ["LoggerBackend", "ConsoleBackend"]
    _EXPORTS = {"LoggerBackend": "forge_obs.backends.base", "ConsoleBackend": "forge_obs.backends.console"}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())

A package ``__init__`` that imports its submodules at load nests the package's import lock
around theirs; a thread that imports one of those submodules directly while another imports the
package can then deadlock (a new mesh process unpickles on several threads at once). A face
served from a table imports only this leaf module at load, and a name costs its module's import
only where it is used. (The ``forge_obs`` facade, the parent of every module, imports not even
this at load: its ``__getattr__`` calls :func:`export` on first use.) A table entry that names
the package's own submodule ``<package>.<name>`` serves the module itself.

    >>> getattr_, dir_ = lazy_exports("pkg", {"dumps": "json"}, ["dumps"], {})
    >>> getattr_("dumps").__name__, dir_()
    ('dumps', ['dumps'])
    >>> export("forge_obs", {"core": "forge_obs.core"}, "core", {}).__name__
    'forge_obs.core'
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["lazy_exports", "export"]


def export(package: str, names: dict[str, str], name: str, namespace: dict[str, Any]) -> Any:
    """Public ``name`` of ``package``, imported from the module ``names`` maps it to (the module
    itself when that is ``<package>.<name>``) and stored in ``namespace`` (the package's globals:
    later lookups are plain attribute reads). AttributeError for a name not in ``names``."""
    mod = names.get(name)
    if mod is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module = importlib.import_module(mod)
    value = module if mod == f"{package}.{name}" else getattr(module, name)
    namespace[name] = value
    return value


def lazy_exports(package: str, names: dict[str, str], public: list[str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps each public name to the module
    that defines it (see :func:`export`); ``dir()`` lists ``public``."""

    def __getattr__(name: str) -> Any:
        return export(package, names, name, namespace)

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__
