"""The leaf of forge_obs: what every other part uses and that imports nothing else of forge_obs.

- :mod:`~forge_obs.core.types`: ``Metric``, ``LoggingMode``, ``BackendRole``
- :mod:`~forge_obs.core.env`: the environment switches and their one parser
- :mod:`~forge_obs.core.identity`: who a process is, its rank label, unique mesh names
- :mod:`~forge_obs.core.run`: the run directory, ``meta.json`` and the one redaction
- :mod:`~forge_obs.core.selfobs`: forge_obs's own CPU cost
- :mod:`~forge_obs.core.procs`: whether the process that started this one still runs
- :mod:`~forge_obs.core.safe`, :mod:`~forge_obs.core.warn`, :mod:`~forge_obs.core.threads`,
  :mod:`~forge_obs.core.plain`: never-raising text, rate-limited warnings, stopping a port's
  thread, rows every backend can write
"""

__all__: list[str] = []
