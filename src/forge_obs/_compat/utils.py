"""torchforge's ``forge.observability.utils``: :func:`get_proc_name_with_rank`.

    from forge_obs.utils import get_proc_name_with_rank   # was: forge.observability.utils
"""

from __future__ import annotations

__all__ = ["get_proc_name_with_rank"]


def get_proc_name_with_rank(proc_name: str | None = None) -> str:
    """A name for the calling rank, from the Monarch actor context: ``"{actor}_r{rank}"``, or with
    ``proc_name``, ``"{proc_name}_{suffix}_r{rank}"`` where ``suffix`` is what follows the last
    ``_`` of the actor's name (the mesh's hash in torchforge's services), or
    ``"{proc_name}_r{rank}"`` when the name has none. Outside actors (a main script) the actor is
    ``client``: ``"client_r0"``, ``"MyProcess_r0"``."""
    from monarch.actor import context

    inst = context().actor_instance
    actor = inst.actor_id.actor_name
    try:
        rank = int(inst.rank.rank)
    except Exception:  # noqa: BLE001 - no point: the message's rank
        from monarch.actor import current_rank

        rank = int(current_rank().rank)
    if proc_name is None:
        return f"{actor}_r{rank}"
    _head, sep, suffix = actor.rpartition("_")
    return f"{proc_name}_{suffix}_r{rank}" if sep else f"{proc_name}_r{rank}"
