"""Every forge_obs call of the TorchTitan app, in one place.

Per rank: ``start`` joins the run (``forge_obs.spmd.init``) with the rank's coordinates in
TorchTitan's parallel dimensions; ``record_train_step`` records what TorchTitan's metrics
processor logs for a step; ``span`` times a region on the rank's timeline; the trainer calls
``flush(step)`` at the same program point on every rank, and ``shutdown()`` at the end.

Keys (reductions over the ranks that recorded them, per step):

==============================  ========  =================================================
``loss``                        MEAN      TorchTitan's ``global_avg_loss``; recorded only by
                                          ranks that hold the loss (the last pipeline stage)
``loss/max``                    MAX       TorchTitan's ``global_max_loss`` (same ranks)
``grad_norm``                   MEAN      TorchTitan's ``grad_norm`` (equal on every rank)
``throughput/tps_per_device``   MEAN      TorchTitan's ``throughput(tps)``
``throughput/tokens``           SUM       tokens every rank loaded since the last log
``time/step_s``                 MAX       wall time since the last log (slowest rank)
``time/data_loading_s``         MEAN      one value per batch fetched
``memory/max_reserved_gib``     MAX       TorchTitan's device memory monitor
``memory/max_active_gib``       MAX
==============================  ========  =================================================
"""

from __future__ import annotations

from typing import Any

from forge_obs import Reduce, record_metric, record_span, set_step

__all__ = ["PARALLEL_DIMS", "coords_of", "start", "span", "set_step", "record_train_step", "backends"]

#: TorchTitan's parallel dimensions, in the order a rank's label lists them
PARALLEL_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def coords_of(parallel_dims: Any) -> dict[str, int]:
    """This rank's coordinate in each parallel dimension of degree > 1, read from TorchTitan's
    DeviceMeshes (``dp_shard`` from the ``fsdp`` mesh, which spans ``dp_shard x cp``, ``cp``
    fastest)."""
    coords: dict[str, int] = {}
    for dim in PARALLEL_DIMS:
        if dim == "dp_shard":
            mesh = parallel_dims.get_optional_mesh("fsdp") if parallel_dims.dp_shard > 1 else None
            if mesh is not None:
                coords[dim] = mesh.get_local_rank() // parallel_dims.cp
            continue
        mesh = parallel_dims.get_optional_mesh(dim)
        if mesh is not None:
            coords[dim] = mesh.get_local_rank()
    return coords


def backends(run_dir: str) -> dict[str, Any]:
    """Rank 0's console shows the reduced values each step; metrics.jsonl keeps them, and each
    rank's own values (per-rank rows, what the doctor compares)."""
    return {"console": {"logging_mode": "global_reduce"}, "jsonl": {}}


def start(*, run_dir: str, parallel_dims: Any, timeout_s: float) -> Any:
    """Join the forge_obs run on this rank; returns the handle with ``flush(step)`` / ``shutdown()``."""
    from forge_obs import spmd

    return spmd.init(backends(run_dir), run_dir=run_dir, logger_rank=0, coords=coords_of(parallel_dims),
                     timeout_s=timeout_s)


def span(name: str, **attrs: Any) -> Any:
    """A span on this rank's timeline (``with span("step"):``)."""
    return record_span(name, **attrs)


def record_train_step(*, loss: "float | None", max_loss: "float | None", grad_norm: float, ntokens: int,
                      elapsed_s: float, non_data_parallel_size: int, data_loading_s: list[float],
                      memory: Any, extra: "dict[str, Any] | None" = None) -> None:
    """The values TorchTitan's metrics processor logs for one step, from the same inputs."""
    if loss is not None:
        record_metric("loss", loss, Reduce.MEAN)
        record_metric("loss/max", max_loss, Reduce.MAX)
    record_metric("grad_norm", grad_norm, Reduce.MEAN)
    record_metric("throughput/tps_per_device", ntokens / (elapsed_s * non_data_parallel_size), Reduce.MEAN)
    record_metric("throughput/tokens", ntokens, Reduce.SUM)
    record_metric("time/step_s", elapsed_s, Reduce.MAX)
    for t in data_loading_s:
        record_metric("time/data_loading_s", t, Reduce.MEAN)
    record_metric("memory/max_reserved_gib", memory.max_reserved_gib, Reduce.MAX)
    record_metric("memory/max_active_gib", memory.max_active_gib, Reduce.MAX)
    for k, v in (extra or {}).items():
        if k.startswith("lr"):
            record_metric(f"optim/{k}", v, Reduce.MEAN)
