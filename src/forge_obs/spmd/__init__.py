"""forge_obs in an SPMD job (``torchrun``, Slurm, ``torch.distributed``), without Monarch.

    from forge_obs import record_metric, Reduce, spmd

    obs = spmd.init({"console": {"logging_mode": "global_reduce"}},      # every rank, once
                    coords={"dp_shard": dp_rank, "pp": pp_rank})          # or device_mesh=mesh
    for step in range(steps):
        record_metric("loss", loss, Reduce.MEAN)                          # unchanged
        obs.flush(step)                                                   # every rank: a local swap
    obs.shutdown()                                                        # every rank

``flush(step)``, called by every rank at the same program point, is the exact cut: the values a
rank recorded before it are in ``step``, those after it in a later step. It swaps the rank's
collector and enqueues what it took; no collective, no barrier, no wait on the caller's path.
A background thread per rank ships each cut to the logger rank (rank 0 by default) over the
job's TCPStore (:mod:`forge_obs.spmd.transport`; never the training process group); there
the Monarch mode's pipeline merges each step exactly and hands it to the backends once, in step
order. A rank that is dead or late costs one ``timeout_s`` and is named in
``obs/missing_ranks``; what it sends later is counted (``obs/late_states``) and joins the next
step emitted. ``shutdown()`` on every rank ships what is left and, on the logger rank, logs every
step and finishes the backends (bounded by ``timeout_s``).

A key recorded on some ranks only (the loss on the last pipeline stage) is reduced over the
ranks that recorded it. Labels carry each rank's parallel coordinates
(``trainer/r5[pp=1,dp_shard=0,tp=1]``); the timeline, SQL and the doctor can group by them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.controller.config import LoggerConfig
from forge_obs.core.env import env_flag
from forge_obs.recording.collector import MetricCollector
from forge_obs.spmd.session import SpmdSession, identity_for
from forge_obs.spmd.transport import POP_WAIT_S, StoreTransport, job_namespace, store_endpoint

__all__ = ["init", "flush", "shutdown", "current", "SpmdSession", "rank_and_world", "coords_from_mesh",
           "DEFAULT_TIMEOUT_S", "INIT_WAIT_S"]

#: how long the logger rank waits for a rank's states of a step (once: then it is named missing)
DEFAULT_TIMEOUT_S = 30.0
#: how long ``init`` waits for the other ranks' ``init`` (it is the one point where ranks meet)
INIT_WAIT_S = 300.0

_lock = threading.Lock()
_current: list = [None]
_sessions = [0]  # spmd.init calls in this process: every rank counts the same


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): from ``torch.distributed`` when initialized, else ``RANK`` /
    ``WORLD_SIZE`` (torchrun, Slurm with ``env://``), else (0, 1)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - the environment below
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def coords_from_mesh(device_mesh: Any) -> dict[str, int]:
    """This rank's coordinates in a ``torch.distributed.DeviceMesh`` (by its dim names)."""
    names = getattr(device_mesh, "mesh_dim_names", None)
    coord = device_mesh.get_coordinate()
    if not names or coord is None:
        raise ValueError("device_mesh needs mesh_dim_names (e.g. ('dp_shard', 'tp')) and must include this rank")
    return {str(n): int(c) for n, c in zip(names, coord)}


def init(config: "dict[str, Any] | None" = None, *, run_dir: Any = None, logger_rank: int = 0,
         coords: "dict[str, int] | None" = None, device_mesh: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         name: str = "trainer") -> SpmdSession:
    """Start forge_obs on this rank of an SPMD job; every rank calls it once, with the same
    ``config`` (the backend configs of ``init_backends``: ``{"console": {...}, "jsonl": {...},
    "run": {...}, "timeline": {...}}``). Only the logger rank creates backends. ``run_dir``:
    the run's directory (default ``<root>/<run id>`` as in the Monarch mode). ``coords`` (or
    ``device_mesh``): this rank's coordinates in the parallel dimensions (``dp_shard``,
    ``dp_replicate``, ``tp``, ``pp``, ``cp``), carried in its label. ``timeout_s``: how long the
    logger rank waits for a rank's states of a step. ``name``: the ranks' label prefix.

    Config mistakes raise ValueError at init (on every rank) with the valid choices. With
    ``FORGE_DISABLE_METRICS=true`` it returns a session whose calls do nothing."""
    timeout_s = _positive(timeout_s, "timeout_s")
    config = dict(config or {})
    if run_dir is not None:
        p = Path(run_dir)
        config["run"] = {"id": p.name, "root": str(p.parent)}
    cfg = LoggerConfig.parse(config)  # raises ValueError on every rank
    rank, world = rank_and_world()
    if not 0 <= int(logger_rank) < world:
        raise ValueError(f"logger_rank must be a rank of the job (0..{world - 1}), got {logger_rank!r}")
    dims = dict(coords or {})
    if device_mesh is not None:
        dims.update(coords_from_mesh(device_mesh))
    dims = {k: int(v) for k, v in dims.items()}
    with _lock:
        if _current[0] is not None:
            raise RuntimeError("forge_obs.spmd.init was already called in this process: call shutdown() first")
        _sessions[0] += 1
        session_no = _sessions[0]
    ident = identity_for(name, rank, world, dims)
    if env_flag("FORGE_DISABLE_METRICS"):
        return _Disabled(cfg, rank=rank, world_size=world, identity=ident)
    send = recv = None
    start_time = time.time()
    if world > 1:
        host, port = store_endpoint()
        ns = job_namespace(session_no)
        send = StoreTransport(host, port, ns, INIT_WAIT_S)
        if rank == logger_rank:
            recv = StoreTransport(host, port, ns, POP_WAIT_S)
    cfg, start_time, labels = _agree(cfg, send, rank, world, logger_rank, ident, start_time)
    s = SpmdSession(cfg, rank=rank, world_size=world, logger_rank=logger_rank, identity=ident, timeout_s=timeout_s,
                    transport=send, receiver=recv, start_time=start_time)
    if s.is_logger:
        s.start_logger(labels)
    _configure_rank(s, cfg)
    s.start()
    with _lock:
        _current[0] = s
    return s


def _agree(cfg: LoggerConfig, store: Any, rank: int, world: int, logger_rank: int, ident: Any,
           start_time: float) -> tuple[LoggerConfig, float, dict[int, str]]:
    """Every rank learns the logger rank's run id, directory and start time; the logger rank
    learns every rank's label."""
    if store is None:
        return cfg, start_time, {rank: ident.label}
    store.set(f"ident/{rank}", ident.label.encode())
    if rank == logger_rank:
        store.set("run", json.dumps({"id": cfg.run.run_id, "root": str(cfg.run.root), "start": start_time}).encode())
        labels = {r: store.get(f"ident/{r}").decode() for r in range(world)}
        return cfg, start_time, labels
    try:
        run = json.loads(store.get("run").decode())
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"forge_obs.spmd.init: the logger rank {logger_rank} did not call init within "
                           f"{INIT_WAIT_S:g}s: {e!r}") from e
    cfg.run.run_id, cfg.run.root = run["id"], Path(run["root"])
    return cfg, float(run["start"]), {}


def _configure_rank(s: SpmdSession, cfg: LoggerConfig) -> None:
    """Recording on this rank: values kept for the next flush, raw values kept when a backend
    logs them (they travel with each cut), the timeline written to the run's ``events/``."""
    c = MetricCollector()
    c.initialized = True
    c.set_streaming(_any_raw(cfg))
    from forge_obs.recording.timeline import writer

    writer.configure(cfg.run.run_dir, writer.controller_options(cfg.run.run_id, s.start_time, cfg.timeline))


def _any_raw(cfg: LoggerConfig) -> bool:
    from forge_obs.backends.base import parse_modes
    from forge_obs.core.types import LoggingMode

    for bcfg in cfg.backends.values():
        try:
            if LoggingMode.PER_RANK_NO_REDUCE in parse_modes(bcfg.get("logging_mode"), ()):
                return True
        except ValueError:
            pass
    return False


def _positive(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
    return float(v)


def current() -> "SpmdSession | None":
    """The session :func:`init` started in this process (None before, or after shutdown)."""
    return _current[0]


def flush(step: int) -> None:
    """:meth:`SpmdSession.flush` of the session :func:`init` started (nothing without one)."""
    s = _current[0]
    if s is not None:
        s.flush(step)


def shutdown(timeout_s: "float | None" = None) -> dict[str, Any]:
    """:meth:`SpmdSession.shutdown` of the session :func:`init` started; then ``init`` may be
    called again."""
    with _lock:
        s, _current[0] = _current[0], None
    return s.shutdown(timeout_s) if s is not None else {}


class _Disabled:
    """The session of a process with ``FORGE_DISABLE_METRICS=true``: every call does nothing."""

    def __init__(self, cfg: LoggerConfig, *, rank: int, world_size: int, identity: Any) -> None:
        self.rank, self.world_size, self.identity = rank, world_size, identity
        self.run_id, self.run_dir = cfg.run.run_id, cfg.run.run_dir
        self.is_logger = rank == 0

    def flush(self, step: int) -> None:
        return None

    def shutdown(self, timeout_s: "float | None" = None) -> dict[str, Any]:
        with _lock:
            if _current[0] is self:
                _current[0] = None
        return {}
