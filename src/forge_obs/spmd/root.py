"""The logger helper's own part: the backends, the steps handed to them, and ``meta.json``.

The root of the merge tree (:mod:`forge_obs.spmd.helper`) hands each step it emits here: its
ranks' cuts, its children's pieces, the late ones that join it, who is missing. They go to the
Monarch mode's :class:`~forge_obs.controller.pipeline.FlushPipeline` as a step gathered
elsewhere (:meth:`~forge_obs.controller.pipeline.FlushPipeline.submit`): one worker thread
merges it exactly (``wire.merge``) and each backend gets it on a thread of its own, in step
order. The step's ``obs/...`` keys say what the SPMD route did (see :meth:`Root.emit`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_obs.backends.base import register_backend
from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.controller.startup import create_backends, make_run_dir, start_backends
from forge_obs.core.redact import redact
from forge_obs.core.run import release_meta_space, reserve_meta_space, write_meta
from forge_obs.spmd.tree import Step, Tree

__all__ = ["RootSetup", "Root", "MESH_ID", "MAX_BACKLOG_STEPS"]

logger = logging.getLogger("forge_obs")

#: the mesh id of every SPMD rank's key in the pipeline (a rank key is ``(MESH_ID, rank)``)
MESH_ID = "spmd"
#: steps handed to the pipeline and not built yet, at most: beyond, the helper reads nothing
#: until the pipeline caught up (the ranks' sends then wait, and their queues count what they
#: hold back)
MAX_BACKLOG_STEPS = 512


@dataclass
class RootSetup:
    """What the logger rank hands its helper to run the backends."""

    config: LoggerConfig
    run_id: str
    run_dir: Path
    start_time: float
    label: str  # the logger rank's label (the process name the backends see)
    identities: dict  # rank -> its identity (label, coords, host, pid)
    backend_classes: dict = field(default_factory=dict)  # config name -> class (travel by value)


class Root:
    """The backends and their pipeline, in the logger helper."""

    def __init__(self, setup: RootSetup, timeout_s: float, world_size: int) -> None:
        self.setup = setup
        self.timeout_s = timeout_s
        self.world_size = world_size
        self.pipeline: "FlushPipeline | None" = None
        self.submitted = 0
        self.reports: dict[int, dict] = {}  # rank -> its final report
        self.finished: list[int] = []
        self.labels = {r: (i or {}).get("label") or f"trainer/r{r}" for r, i in setup.identities.items()}

    def start(self) -> "str | None":
        """Create and start the backends; the error text if that fails (every rank raises it)."""
        s, cfg = self.setup, self.setup.config
        from forge_obs.backends.record import RunContext

        try:
            for name, cls in s.backend_classes.items():
                register_backend(name, cls)
            run = RunContext(run_id=s.run_id, run_dir=s.run_dir, process_name=s.label, config=redact(cfg.backends),
                             start_time=s.start_time, flush_timeout_s=self.timeout_s)
            backends = create_backends(cfg.backends)
            make_run_dir(s.run_dir)
            asyncio.run(start_backends(backends, run, cfg.backend_init_timeout_s))
        except Exception as e:  # noqa: BLE001 - handed to every rank's init
            return f"{type(e).__name__}: {e}"
        write_meta(s.run_dir, run_id=s.run_id, process_name=s.label, config=cfg.backends, start_time=s.start_time,
                   status="running", mode="spmd", world_size=self.world_size, **cfg.run.labels())
        reserve_meta_space(s.run_dir)
        p = FlushPipeline(backends, s.run_id, self.timeout_s, s.label, shutdown_timeout_s=cfg.shutdown_timeout_s,
                          queue_steps=cfg.backend_queue_steps, batch_s=cfg.backend_batch_s)
        for r, ident in s.identities.items():
            p.book.labels[(MESH_ID, r)] = self.labels[r]
            p.book.identities[(MESH_ID, r)] = ident
        p.start()
        self.pipeline = p
        return None

    def backlog(self) -> int:
        """Steps handed to the pipeline and not built yet."""
        return self.submitted - self.pipeline.assembled if self.pipeline is not None else 0

    def emit(self, st: Step, tree: Tree) -> None:
        """Hand step ``st`` (just left the tree) to the pipeline. Its ``obs/`` keys:
        ``obs/step_delay_s`` (from its first flush on any rank to now), ``obs/late_states``
        (late states so far), ``obs/held_back_flushes`` (flushes the ranks' bounded queues held
        back into this step), ``obs/skipped_ranks``, ``obs/closed_early`` (1: the logger's
        memory bound made it leave before its time), ``obs/pending_steps``."""
        ids = self.setup.identities
        states = [((MESH_ID, r), ids.get(r), data) for r, data in st.cuts]
        extra, bundles = [], list(st.pieces)
        for late in st.late_in:
            extra.extend(((MESH_ID, r), ids.get(r), data) for r, data in late.cuts)
            bundles.extend(late.pieces)
            self._note_finals(late.finished, late.reports)
        self._note_finals(st.finished, st.reports)
        held = st.held_back + sum(late.held_back for late in st.late_in)
        obs = {"obs/late_states": tree.counts["late_states"], "obs/step_delay_s": max(0.0, time.time() - st.t0) if st.t0 else 0.0,
               "obs/held_back_flushes": held, "obs/skipped_ranks": len(st.skipped), "obs/closed_early": int(st.early),
               "obs/pending_steps": len(tree.pending) + self.backlog()}
        final = bool(st.finished) and len(st.finished) == st.n_ranks or (st.n_ranks == 0 and not st.pieces)
        self.pipeline.submit(st.step, states=states, extra=extra, bundles=bundles, reported=st.n_ranks,
                             missing=[self.label(r) for r in sorted(st.missing)],
                             late=[self.label(r) for r in sorted(st.late)], final=final, obs=obs)
        self.submitted += 1

    def label(self, rank: int) -> str:
        return self.labels.get(rank) or f"trainer/r{rank}"

    def _note_finals(self, ranks: list, reports: dict) -> None:
        for r in ranks:
            self.finished.append(r)
            if reports.get(r):
                self.reports[r] = reports[r]

    def finish(self, tree: Tree, timeout_s: float, counts: dict) -> dict[str, Any]:
        """Build every step handed over, let the backends finish (at most ``timeout_s``), write
        ``meta.json``; returns the session's summary (for the logger rank)."""
        p, s = self.pipeline, self.setup
        left = asyncio.run(p.close(max(1.0, timeout_s)))
        unfinished = [r for r in range(self.world_size) if r not in tree.finished]
        bounds = {"held_back_flushes": {self.label(r): rep.get("held_back_flushes", 0) for r, rep in self.reports.items()
                                        if rep.get("held_back_flushes")},
                  "lost_cuts": {self.label(r): rep.get("ship_errors", 0) for r, rep in self.reports.items()
                                if rep.get("ship_errors")},
                  "steps_closed_early": tree.counts["early_steps"],
                  "steps_sent_early_below": counts.pop("early_steps", 0), **counts}
        write_meta(s.run_dir, end_time=time.time(), status="finished", steps_logged=p.steps_logged,
                   backend_errors=p.backend_errors, backends=p.backend_report(), unfinished_backends=left,
                   unfinished_ranks=[self.label(r) for r in unfinished],
                   finished_ranks=[self.label(r) for r in sorted(tree.finished)],
                   gone_ranks=[self.label(r) for r in sorted(tree.gone)], late_states=tree.counts["late_states"],
                   bounds=bounds)
        release_meta_space(Path(s.run_dir))
        return {"steps_logged": p.steps_logged, "unfinished_ranks": unfinished, "unfinished_backends": left,
                "late_states": tree.counts["late_states"], "gone_ranks": sorted(tree.gone), "bounds": bounds}
