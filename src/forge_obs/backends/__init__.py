"""Backends: where reduced steps go. Built-in: ``console``, ``jsonl``; more register by name.

    >>> from forge_obs.backends import get_logger_backend_class, backend_names
    >>> get_logger_backend_class("console").__name__, "jsonl" in backend_names()
    ('ConsoleBackend', True)
"""

from forge_obs.core.lazy import lazy_exports

_EXPORTS = {
    "LoggerBackend": "forge_obs.backends.base",
    "backend_names": "forge_obs.backends.base",
    "get_logger_backend_class": "forge_obs.backends.base",
    "register_backend": "forge_obs.backends.base",
    "ConsoleBackend": "forge_obs.backends.console",
    "JsonlBackend": "forge_obs.backends.jsonl",
}

__all__ = [
    "LoggerBackend",
    "ConsoleBackend",
    "JsonlBackend",
    "register_backend",
    "get_logger_backend_class",
    "backend_names",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
