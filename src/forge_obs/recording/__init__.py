"""Recording, in every process: cheap, no I/O, no RPC, no GPU sync; neither Monarch nor torch is
imported when it loads.

- :mod:`~forge_obs.recording.collector`: ``record_metric`` and the per-process collector
- :mod:`~forge_obs.recording.reduce`: the reductions (each one's arithmetic, once)
- :mod:`~forge_obs.recording.sketch`: the ``distribution`` reduction
- :mod:`~forge_obs.recording.device`: tensor values accumulated on their device
- :mod:`~forge_obs.recording.tracer`: ``Tracer`` and ``@trace``
- :mod:`~forge_obs.recording.timeline`: ``record_span``, ``record_event``, ``set_step`` and the
  timeline's writer
"""

__all__: list[str] = []
