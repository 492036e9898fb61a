"""The timeline's recording API (public path): ``record_span``, ``record_event``, ``set_step``,
``add_step_tag``, ``get_step``, ``configure``, ``flush``, ``close``, ``is_enabled``. The
implementation is :mod:`forge_obs.recording.timeline`."""

from forge_obs.core.lazy import lazy_exports

__all__ = ["record_span", "record_event", "set_step", "add_step_tag", "get_step", "configure", "flush", "close",
           "is_enabled"]
_EXPORTS = dict.fromkeys(__all__, "forge_obs.recording.timeline")
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())
