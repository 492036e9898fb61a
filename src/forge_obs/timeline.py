"""The timeline's recording API (public path): ``record_span``, ``record_event``, ``set_step``,
``add_step_tag``, ``get_step``, ``configure``, ``flush``, ``close``, ``is_enabled``. The
implementation is :mod:`forge_obs.recording.timeline`."""

from forge_obs.recording.timeline import (  # noqa: F401
    add_step_tag,
    close,
    configure,
    flush,
    get_step,
    is_enabled,
    record_event,
    record_span,
    set_step,
)
__all__ = ["record_span", "record_event", "set_step", "add_step_tag", "get_step", "configure", "flush", "close",
           "is_enabled"]
