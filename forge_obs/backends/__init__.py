"""Backends: where reduced steps go. Built-in: ``console``, ``jsonl``; more register by name.

    >>> from forge_obs.backends import get_logger_backend_class, backend_names
    >>> get_logger_backend_class("console").__name__, "jsonl" in backend_names()
    ('ConsoleBackend', True)
"""

from forge_obs.backends.base import (
    LoggerBackend,
    backend_names,
    get_logger_backend_class,
    register_backend,
)
from forge_obs.backends.console import ConsoleBackend
from forge_obs.backends.jsonl import JsonlBackend

__all__ = [
    "LoggerBackend",
    "ConsoleBackend",
    "JsonlBackend",
    "register_backend",
    "get_logger_backend_class",
    "backend_names",
]
