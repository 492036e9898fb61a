"""torchforge's ``forge.observability`` machinery: the modules behind the import paths
``forge_obs.metrics``, ``.perf_tracker``, ``.utils`` and ``.env`` (those paths are bare
re-exports of these modules), and the patch points torchforge's tests use. Nothing of the
recording path depends on this package: it plugs in through
:func:`forge_obs.recording.collector.set_record_route` and
:func:`forge_obs.recording.tracer.set_record_hook`."""

__all__: list[str] = []
