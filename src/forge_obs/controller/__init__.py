"""The controller side: the actors that cut every rank at a flush, the pipeline that assembles
each step and hands it to the backends, and the one module that touches Monarch's internals.

- :mod:`~forge_obs.controller.client`: ``get_or_create_metric_logger``, attaching fetchers
- :mod:`~forge_obs.controller.logger`: ``GlobalLoggingActor``, thin endpoints over a session and a flush
- :mod:`~forge_obs.controller.session`: a session's start (``init_backends``) and end (``shutdown``)
- :mod:`~forge_obs.controller.flush`: ``start_flush`` and what its caller awaits
- :mod:`~forge_obs.controller.inbox`: ``ObsInbox``, the port and socket every rank answers on, and
  ``take``, each message into the pipeline
- :mod:`~forge_obs.controller.state`: ``CONTROLLER``, what those share in the controller process
- :mod:`~forge_obs.controller.pipeline`: ``FlushPipeline``, the lock, the worker thread, the cut API
- :mod:`~forge_obs.controller.cuts`: which ranks a cut waits for; late and final states
- :mod:`~forge_obs.controller.assembly`: a cut that left becomes a ``StepRecord``
- :mod:`~forge_obs.controller.backend_worker`: one thread and bounded queue per backend
- :mod:`~forge_obs.controller.fetcher`: ``LocalFetcherActor``, a process's part of a cut
- :mod:`~forge_obs.controller.aggregate`: a group leader's thread (reduce on the way up)
- :mod:`~forge_obs.controller.registry`: the meshes a process cuts
- :mod:`~forge_obs.controller.config`: the typed ``init_backends`` config
- :mod:`~forge_obs.controller.monarch_internals`: Monarch's private hooks and patches
"""

__all__: list[str] = []
