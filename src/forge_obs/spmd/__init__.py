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
A shipper thread per rank ships each cut, stamped with the rank's flush time, to its node's
*helper* process (:mod:`forge_obs.spmd.helper`, one per node, started by one of the node's
ranks at ``init``). Helpers merge their node's ranks exactly and form a tree
(:mod:`forge_obs.spmd.layout`); the root, on the logger rank's node, merges at most its node
and :data:`~forge_obs.spmd.layout.FANIN` pieces per step and runs the backends: per step, once,
in step order. No training thread does the logger's work, and the job's TCPStore is used at
``init`` only.

A rank is named missing in a step (``obs/missing_ranks``) only when it did not ship the step
within ``timeout_s`` of its flush (judged by when the ranks shipped, never by when a helper
read); it is then not waited for until it sends again; a rank whose process ended is named at
once. What arrives after its step left is counted (``obs/late_states``) and joins the next step
logged. ``shutdown()`` on every rank ships what is left; on the logger rank it returns once
every step was logged and the backends finished (bounded by ``timeout_s``).

A key recorded on some ranks only (the loss on the last pipeline stage) is reduced over the
ranks that recorded it. Labels carry each rank's parallel coordinates
(``trainer/r5[pp=1,dp_shard=0,tp=1]``); the timeline, SQL and the doctor can group by them.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.controller.config import LoggerConfig
from forge_obs.core.env import env_flag
from forge_obs.recording.collector import MetricCollector
from forge_obs.spmd import rendezvous, sampling
from forge_obs.spmd.layout import FANIN
from forge_obs.spmd.root import RootSetup
from forge_obs.spmd.session import MAX_QUEUED_VALUES, SpmdSession, identity_for

__all__ = ["init", "flush", "shutdown", "current", "SpmdSession", "rank_and_world", "coords_from_mesh",
           "DEFAULT_TIMEOUT_S", "INIT_WAIT_S", "FANIN", "MAX_QUEUED_VALUES"]

#: how long the logger helper waits for a rank's states of a step (once: then it is named missing)
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
         name: str = "trainer", max_queued_values: int = MAX_QUEUED_VALUES) -> SpmdSession:
    """Start forge_obs on this rank of an SPMD job; every rank calls it once, with the same
    ``config`` (the backend configs of ``init_backends``: ``{"console": {...}, "jsonl": {...},
    "run": {...}, "timeline": {...}}``). The logger helper (a process on the logger rank's node)
    runs the backends. ``run_dir``: the run's directory (default ``<root>/<run id>`` as in the
    Monarch mode). ``coords`` (or ``device_mesh``): this rank's coordinates in the parallel
    dimensions (``dp_shard``, ``dp_replicate``, ``tp``, ``pp``, ``cp``), carried in its label.
    ``timeout_s``: how long a step waits for a rank's states (from the step's flush).
    ``name``: the ranks' label prefix. ``max_queued_values``: values (keys and raw values) of
    this rank's cuts not shipped yet, at most; a flush beyond holds its values back into the
    next one (counted per step, ``obs/held_back_flushes``, and in ``meta.json``).

    Config mistakes raise ValueError at init (on every rank) with the valid choices; backends
    that fail to start raise RuntimeError on every rank. With ``FORGE_DISABLE_METRICS=true`` it
    returns a session whose calls do nothing."""
    timeout_s = _positive(timeout_s, "timeout_s")
    if isinstance(max_queued_values, bool) or not isinstance(max_queued_values, int) or max_queued_values < 1:
        raise ValueError(f"max_queued_values must be an int >= 1, got {max_queued_values!r}")
    config = dict(config or {})
    if run_dir is not None:
        p = Path(run_dir)
        config["run"] = {"id": p.name, "root": str(p.parent)}
    cfg = LoggerConfig.parse(config)  # raises ValueError on every rank
    backend_classes = _checked_backends(cfg)  # so do the backends' own config mistakes
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
    s = _join(cfg, rank, world, int(logger_rank), ident, timeout_s, session_no, backend_classes)
    s.max_queued_values = max_queued_values
    s.on_shutdown = lambda: _forget(s)
    _configure_rank(s, cfg)
    s.start()
    with _lock:
        _current[0] = s
    return s


def _forget(s: Any) -> None:
    """``s`` shut down: :func:`init` may be called again."""
    with _lock:
        if _current[0] is s:
            _current[0] = None


def _join(cfg: LoggerConfig, rank: int, world: int, logger_rank: int, ident: Any, timeout_s: float,
          session_no: int, backend_classes: dict) -> SpmdSession:
    """Meet the other ranks, start this node's helper if this rank is the one to, connect to it."""
    store = rendezvous.open_store(session_no, INIT_WAIT_S) if world > 1 else None
    fanin = int(os.environ.get("FORGE_OBS_SPMD_FANIN") or FANIN)
    met = rendezvous.meet(store, cfg, ident, rank, world, logger_rank, time.time(), max(1, fanin))
    cfg.run.run_id, cfg.run.root = met.run_id, Path(met.root)
    index = met.layout.helper_of[rank]
    helper = None
    if met.layout.spawner_of(index) == rank:
        root = None
        if index == 0:
            root = RootSetup(config=cfg, run_id=met.run_id, run_dir=cfg.run.run_dir, start_time=met.start,
                             label=ident.label, identities=met.identities, backend_classes=backend_classes)
        path, helper = rendezvous.start_helper(store, met, index, timeout_s, root, _any_mode(cfg, "PER_RANK_REDUCE"))
    else:
        path = rendezvous.helper_path(store, index)
    conn = rendezvous.connect(path, rank, INIT_WAIT_S, helper)
    s = SpmdSession(cfg, rank=rank, world_size=world, logger_rank=logger_rank, identity=ident, timeout_s=timeout_s,
                    conn=conn, start_time=met.start, helper=helper)
    if store is not None:
        s.store_ops = store.ops  # every operation of this rank on the job's store: none after init
        store.close()
    return s


def _checked_backends(cfg: LoggerConfig) -> dict[str, Any]:
    """Each configured backend's class, once its config was checked by building it here (a
    mistake raises ValueError naming the valid choices, on every rank; nothing is started).
    A class of the user's script travels to the logger helper by value."""
    from forge_obs.backends.base import get_logger_backend_class
    from forge_obs.controller.startup import create_backends

    create_backends(cfg.backends)
    return {name: get_logger_backend_class(name) for name in cfg.backends}


def _configure_rank(s: SpmdSession, cfg: LoggerConfig) -> None:
    """Recording on this rank: values kept for the next flush, raw values kept when a backend
    logs them (they travel with each cut), the timeline written to the run's ``events/`` (spans
    of a sample of the ranks in a large job: :mod:`forge_obs.spmd.sampling`), telemetry sampled
    at each cut."""
    c = MetricCollector()
    c.initialized = True
    c.set_streaming(_any_mode(cfg, "PER_RANK_NO_REDUCE"))
    from forge_obs.recording.timeline import follow_cut, writer
    from forge_obs.recording.timeline.schema import rank_selected

    opts = writer.controller_options(cfg.run.run_id, s.start_time,
                                     sampling.span_ranks(cfg.timeline, s.rank, s.world_size, s.identity.coords))
    sampling.configure(cfg.run.run_dir, opts, s.rank, rank_selected(opts.get("ranks"), s.rank))
    writer.configure(cfg.run.run_dir, opts)
    follow_cut(0)  # spans before the first flush are step 0's, as its values are
    from forge_obs.recording import telemetry

    telemetry.configure(cfg.telemetry, str(cfg.run.run_dir))  # obs/sys/... at each cut (the shipper thread)


def _any_mode(cfg: LoggerConfig, mode: str) -> bool:
    """Whether a configured backend logs in ``LoggingMode.<mode>`` (its config's, else its class's modes)."""
    from forge_obs.backends.base import get_logger_backend_class, parse_modes
    from forge_obs.core.types import LoggingMode

    want = getattr(LoggingMode, mode)
    for name, bcfg in cfg.backends.items():
        try:
            default = getattr(get_logger_backend_class(name), "default_modes", (LoggingMode.GLOBAL_REDUCE,))
            if want in parse_modes((bcfg or {}).get("logging_mode"), tuple(default)):
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
        _forget(self)
        return {}
