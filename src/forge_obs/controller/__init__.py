"""The controller side: the actors that cut every rank at a flush, the pipeline that assembles
each step and hands it to the backends, and the one module that touches Monarch's internals.

- :mod:`~forge_obs.controller.client`: ``get_or_create_metric_logger``, attaching fetchers
- :mod:`~forge_obs.controller.logger`: ``GlobalLoggingActor`` and the inbox every rank answers on
- :mod:`~forge_obs.controller.fetcher`: ``LocalFetcherActor``, a process's part of a cut
- :mod:`~forge_obs.controller.registry`: the meshes a process cuts
- :mod:`~forge_obs.controller.pipeline`: which ranks a cut waits for; step assembly
- :mod:`~forge_obs.controller.aggregate`: a group leader's thread (reduce on the way up)
- :mod:`~forge_obs.controller.backend_worker`: one thread and bounded queue per backend
- :mod:`~forge_obs.controller.config`: the typed ``init_backends`` config
- :mod:`~forge_obs.controller.monarch_internals`: Monarch's private hooks and patches
"""

__all__: list[str] = []
