"""Structured per-rank timeline: spans, instant events and step tags, cheap enough for every step.

    from forge_obs.recording.timeline import record_span, record_event, set_step, add_step_tag

    set_step(7)
    with record_span("train_step", flow=f"policy-v{version}"):
        ...                                   # the caller pays two appends to a buffer

    @record_span("generate")                  # also decorates sync and async functions
    async def generate(prompt): ...

    record_event("weights_pushed", version=3, flow="policy-v3")
    add_step_tag("eval")

The package, one module per job:

- :mod:`~forge_obs.recording.timeline.recorder`: the hot path (one span mechanism under
  ``record_span``, ``@trace`` / ``Tracer`` and ``titan.log_trace_span``; events, steps, call
  links, CPU time) and the per-process bounded buffer it appends to;
- :mod:`~forge_obs.recording.timeline.records`: every record defined once (buffer entries, file
  records and their codes);
- :mod:`~forge_obs.recording.timeline.writer`: the background thread that turns the buffer into
  compact JSONL under ``runs/<run_id>/events/<host>_<pid>_<mesh>_<rank>.jsonl``;
- :mod:`~forge_obs.recording.timeline.schema`: the ``"timeline"`` options.

The run directory comes from ``init_backends`` (the controller configures itself and pushes the
configuration to every fetcher mesh), or from :func:`configure` in a standalone script. Until
configured, records are kept in a small bounded buffer. ``FORGE_DISABLE_METRICS=true`` or
``FORGE_DISABLE_TIMELINE=true`` turns every call into a no-op. Nothing here imports Monarch or
torch. The views of what it writes (``forge-obs trace`` / ``sql`` / ``doctor``) are in
:mod:`forge_obs.analysis`.
"""

from __future__ import annotations

from typing import Any

from forge_obs.core.lazy import lazy_exports
from forge_obs.recording.timeline import writer

__all__ = [
    "record_span",
    "record_event",
    "set_step",
    "add_step_tag",
    "get_step",
    "configure",
    "flush",
    "close",
    "is_enabled",
    "follow_cut",
    "Span",
    "new_span",
    "wrap",
    "call_link",
    "in_span",
    "set_incoming",
    "link_check",
    "set_link_check",
]
#: the hot path's names, served from :mod:`~forge_obs.recording.timeline.recorder` on first use
_EXPORTS = dict.fromkeys(("record_span", "record_event", "set_step", "add_step_tag", "get_step", "is_enabled",
                          "follow_cut", "Span", "new_span", "wrap", "call_link", "in_span", "set_incoming",
                          "link_check", "set_link_check"), "forge_obs.recording.timeline.recorder")
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__, globals())


def configure(run_dir: Any = None, **options: Any) -> bool:
    """Start writing this process's timeline under ``<run_dir>/events/`` (a standalone script;
    with the actors, ``init_backends`` does this in every process). Options: ``ranks``
    (``"all"``, ``"0,3"``, ``"0-3,8"``, ``"every:4"``), ``max_file_mb``, ``max_files``,
    ``flush_interval_s``, ``open_after_s``, ``enabled``. Returns whether this process records."""
    return writer.configure(run_dir, dict(options))


def flush() -> None:
    """Write everything recorded so far (blocks until written)."""
    writer.flush()


def close() -> None:
    """Write everything, mark the file as cleanly closed and stop the writer thread. A later
    :func:`configure` starts a new file."""
    writer.close()
