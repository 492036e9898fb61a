"""A trace context that travels with a Monarch endpoint call: the callee's spans become children
of the span the caller waits in (docs/timeline.md, "Critical path").

Caller: Monarch (torchmonarch 0.7.0) builds every endpoint message with
``monarch._src.actor.actor_mesh._create_endpoint_message`` (the Rust side caches that function at
its first call, so it is not replaced): it checks the arguments with that module's
``_check_endpoint_arguments``, then pickles ``(args, kwargs)`` with that module's ``pickle`` (both
looked up by name at each call). :func:`install` wraps both: after the check of a call made while
a timeline span is open in the calling task or thread, the next pickle of that very ``args``
object in that thread gets an :class:`_ArgsWithParent` in its place: the same tuple, that pickles
as ``_with_parent(link, args)``. Outside any span the wrappers read one context variable and one
thread-local attribute, and pass everything to Monarch unchanged.

Callee: unpickling the message calls :func:`_with_parent` (by reference: this module is importable
in every process of the environment, whether or not the callee's code imports forge_obs), which
returns ``args`` itself, so the endpoint receives exactly the arguments it was sent. It also marks
the link in the context the message is handled in (Monarch unpickles inside the handler that then
runs the endpoint), together with Monarch's per-message ``DebugContext`` object: a span opened at
top level while that object is the current message's carries the link, and only then, so a link
never reaches another message handled later in the same thread or context.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from forge_obs.recording.timeline import call_link, in_span, link_check, set_incoming, set_link_check

__all__ = ["install", "uninstall", "installed"]

logger = logging.getLogger("forge_obs")

_orig: list = [None]


class _ArgsWithParent(tuple):
    """An endpoint's argument tuple that pickles as ``_with_parent(link, args)``."""

    def __new__(cls, args: tuple, link: str) -> "_ArgsWithParent":
        o = tuple.__new__(cls, args)
        o.link = link
        return o

    def __reduce__(self) -> tuple:
        return (_with_parent, (self.link, tuple(self)))


def _message_token() -> Any:
    from monarch._src.actor.actor_mesh import DebugContext

    return DebugContext.get()


def _is_current(token: Any) -> bool:
    try:
        return _message_token() is token
    except Exception:  # noqa: BLE001 - not inside a Monarch handler: no message to belong to
        return False


def _with_parent(link: Any, args: tuple) -> tuple:
    """Unpickling a linked message: mark ``link`` for this message's spans; returns ``args``."""
    try:
        if link_check() is None:
            set_link_check(_is_current)
        set_incoming(link, _message_token())
    except Exception:  # noqa: BLE001 - the call goes through whatever happens here
        pass
    return args


class _Pending(threading.local):
    #: the argument tuple that Monarch checked last in this thread under a span (its next pickle)
    args: Any = None
    link: Any = None


_pending = _Pending()


def install() -> bool:
    """Propagate the caller's span with every endpoint call made from this process (idempotent).
    False when Monarch's message builder is not as this module expects it (nothing patched)."""
    if _orig[0] is not None:
        return True
    try:
        from monarch._src.actor import actor_mesh
        from monarch._src.actor.actor_mesh import MethodSpecifier

        orig_check, orig_pickle = actor_mesh._check_endpoint_arguments, actor_mesh.pickle
        init = MethodSpecifier.Init
    except Exception as e:  # noqa: BLE001 - another Monarch: calls are not linked, only inferred
        logger.info("forge_obs: endpoint calls carry no trace context (%r)", e)
        return False

    @functools.wraps(orig_check)
    def check(method_name: Any, signature: Any, args: Any, kwargs: Any) -> Any:
        out = orig_check(method_name, signature, args, kwargs)
        if in_span() and type(args) is tuple and not isinstance(method_name, init):
            link = call_link()
            if link is not None:
                _pending.args, _pending.link = args, link
        return out

    @functools.wraps(orig_pickle)
    def pickle(obj: Any, *a: Any, **kw: Any) -> Any:
        args = _pending.args
        if args is not None:
            _pending.args = None
            if type(obj) is tuple and len(obj) == 2 and obj[0] is args:
                obj = (_ArgsWithParent(args, _pending.link), obj[1])
        return orig_pickle(obj, *a, **kw)

    _orig[0] = (orig_check, orig_pickle)
    set_link_check(_is_current)
    actor_mesh._check_endpoint_arguments, actor_mesh.pickle = check, pickle
    return True


def uninstall() -> None:
    """Restore Monarch's message builder."""
    orig = _orig[0]
    if orig is None:
        return
    from monarch._src.actor import actor_mesh

    actor_mesh._check_endpoint_arguments, actor_mesh.pickle = orig
    _orig[0] = None


def installed() -> bool:
    return _orig[0] is not None
