"""What travels between processes, as pure functions: how a rank's states are encoded, the
message kinds, a group's bundle, the plan of who answers through whom, and the one exact
cross-rank merge. No Monarch, no threads.

- :mod:`~forge_obs.wire.snapshot`: encoding a rank's states (each SAMPLE/custom key on its own)
- :mod:`~forge_obs.wire.bundle`: a (mesh, host) group's states merged on the way up
- :mod:`~forge_obs.wire.plan`: groups and their leaders
"""

__all__: list[str] = []
