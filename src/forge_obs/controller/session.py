"""A logging session on the controller: from ``init_backends`` to ``shutdown`` (or to the next
``init_backends``, which hands the run over to new backends).

    mlogger = await get_or_create_metric_logger()
    await mlogger.init_backends.call_one({"console": {}})   # start_session
    await mlogger.shutdown.call_one()                        # end_session(final=True)

:func:`start_session` validates the config, creates and starts the new backends, and only then
ends the running session (so a mistake changes nothing), writes ``meta.json``, opens the
controller's timeline, starts the session's :class:`~forge_obs.controller.pipeline.FlushPipeline`
(its collaborators passed in), and configures every observed mesh before it returns.
:func:`end_session` logs what is left (on ``shutdown``, as the step after the last), drains the
pipeline and finishes the backends within ``shutdown_timeout_s``. A timer on the logger actor's
loop streams the controller's own raw values to ``per_rank_no_reduce`` backends every
``stream_interval_s``, as the fetchers do theirs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from forge_obs.backends.base import LoggerBackend
from forge_obs.backends.record import RunContext
from forge_obs.controller.config import LoggerConfig
from forge_obs.controller.fetcher import configure_all, store_options
from forge_obs.controller.flush import ask_exports, ask_resend, start_flush
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.controller.startup import create_backends, make_run_dir, start_backend, start_backends
from forge_obs.controller.state import CONTROLLER, ControllerState
from forge_obs.core.env import env_flag
from forge_obs.core.identity import start_naming_run
from forge_obs.core.redact import redact
from forge_obs.core.run import release_meta_space, reserve_meta_space, write_meta
from forge_obs.core.types import LoggingMode
from forge_obs.recording import telemetry
from forge_obs.recording.collector import MetricCollector

logger = logging.getLogger("forge_obs")

__all__ = ["start_session", "end_session", "configure_meshes"]

_COLLECTOR = MetricCollector()


async def start_session(config: dict[str, Any]) -> dict[str, Any]:
    """``init_backends(config)`` (see :meth:`~forge_obs.controller.logger.GlobalLoggingActor.init_backends`):
    returns ``{"run_id": ..., "run_dir": ...}``."""
    st = CONTROLLER
    if env_flag("FORGE_DISABLE_METRICS"):
        logger.info("forge_obs: FORGE_DISABLE_METRICS is set: init_backends starts no backend")
        st.disabled = True
        return {"run_id": None, "run_dir": None}
    st.disabled = False
    if isinstance(config, dict) and st.pipeline is not None and "run" not in config and st.run is not None:
        config = {**config, "run": {"id": st.run.run_id, "root": str(st.run.run_dir.parent)}}
    cfg = LoggerConfig.parse(config)
    run = RunContext(run_id=cfg.run.run_id, run_dir=cfg.run.run_dir, process_name=st.process_name,
                     config=redact(cfg.backends), start_time=time.time(), flush_timeout_s=cfg.flush_timeout_s)
    backends, failed = await _take_over(st, cfg, run)
    st.shut_down = False
    timeline = _open_run(st, cfg, run)
    pipeline = FlushPipeline(backends, run.run_id, cfg.flush_timeout_s, st.process_name, st.book,
                             shutdown_timeout_s=cfg.shutdown_timeout_s, queue_steps=cfg.backend_queue_steps,
                             batch_s=cfg.backend_batch_s, leader_of=st.planner.leader_of, ask_resend=ask_resend, ask_exports=ask_exports)
    st.aggregate = cfg.aggregate
    st.probe_round_trip = cfg.probe_round_trip
    pipeline.start()
    streaming = any(LoggingMode.PER_RANK_NO_REDUCE in be.modes for be in backends.values())
    _COLLECTOR.set_streaming(streaming)
    _COLLECTOR.initialized = True
    options = {"streaming": streaming, "run_dir": str(run.run_dir), "timeline": timeline,
               "stream_interval_s": cfg.stream_interval_s, "last_step": st.last_step,
               "telemetry": cfg.telemetry.to_dict()}
    telemetry.configure(cfg.telemetry, str(run.run_dir))  # the controller's own
    store_options(options)
    with st.lock:
        for item in st.early:
            pipeline.final(0, *item)
        st.early.clear()
        st.pipeline = pipeline
    st.stream_interval_s = cfg.stream_interval_s if streaming else 0.0
    _start_stream_timer(st)
    await configure_meshes(options, cfg.flush_timeout_s)
    if failed:
        now = ", ".join(backends) or "no backend: flushed steps are not logged"
        raise RuntimeError(f"{'; '.join(map(str, failed))} (it replaced the running backend of that name, which "
                           f"has finished; from now on logging continues with {now})") from failed[0].__cause__
    return {"run_id": run.run_id, "run_dir": str(run.run_dir)}


async def _take_over(st: ControllerState, cfg: LoggerConfig,
                     run: RunContext) -> tuple[dict[str, LoggerBackend], list[RuntimeError]]:
    """The new session's backends, started, and the running session ended. Every new backend is
    created, and every one that replaces no running backend is started, before the running
    session ends: a mistake there raises and changes nothing. A backend of the same name as a
    running one (two W&B runs with one id cannot be open at once) is started after the running
    one finished; those that fail then are left out and returned as errors."""
    running = set(st.pipeline.backends) if st.pipeline is not None else set()
    unchanged = "the running backends keep logging" if running else "no backend was started"
    try:
        backends = create_backends(cfg.backends)
        make_run_dir(run.run_dir)
        await start_backends({n: b for n, b in backends.items() if n not in running}, run, cfg.backend_init_timeout_s)
    except (ValueError, RuntimeError) as e:
        raise type(e)(f"{e} ({unchanged})") from e
    failed: list[RuntimeError] = []
    if st.pipeline is not None:  # called again: the current backends get what was flushed, then finish
        await end_session(final=False)
        for name in [n for n in backends if n in running]:
            error = await start_backend(name, backends[name], run, cfg.backend_init_timeout_s)
            if error is not None:
                failed.append(error)
                del backends[name]
    return backends, failed


def _open_run(st: ControllerState, cfg: LoggerConfig, run: RunContext) -> dict[str, Any]:
    """``meta.json`` says the run is running (with room kept for its final status), a new run is
    announced, and the controller's timeline is open; returns the timeline options the meshes get."""
    write_meta(run.run_dir, run_id=run.run_id, process_name=st.process_name, config=cfg.backends,
               start_time=run.start_time, status="running", **cfg.run.labels())
    reserve_meta_space(run.run_dir)  # room for the final status, should the disk fill up
    from forge_obs.recording.timeline import writer as timeline_writer

    if st.run is None or st.run.run_dir != run.run_dir:
        start_naming_run(LOCAL_MESHES.live_names())
        _announce(run)
    st.run = run
    timeline = timeline_writer.controller_options(run.run_id, run.start_time, cfg.timeline)
    if timeline_writer.configure(run.run_dir, dict(timeline, _ctl=True)):
        from forge_obs.controller.call_context import install as link_calls

        link_calls()
    return timeline


def _announce(run: RunContext) -> None:
    """One line on stderr when a run starts: where it is written and the command that shows it
    live, written to work as printed in the shell that started the process
    (:func:`forge_obs.core.shell.printed_command`). ``FORGE_OBS_QUIET=1`` leaves it out."""
    if env_flag("FORGE_OBS_QUIET"):
        return
    import sys

    from forge_obs.core.shell import printed_command

    print(f"forge_obs: run {run.run_id} in {run.run_dir}; view live: {printed_command('serve', run.run_dir.parent)}",
          file=sys.stderr, flush=True)


def _start_stream_timer(st: ControllerState) -> None:
    """The controller's own raw values reach streaming backends every ``stream_interval_s``
    too, from a timer on the running loop (the logger actor's)."""
    if st.stream_timer is not None or not st.stream_interval_s:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def tick() -> None:
        st.stream_timer = None
        pipeline = st.pipeline
        if pipeline is None or not st.stream_interval_s:
            return
        try:
            step = 0 if st.last_step is None else st.last_step + 1
            rows = _COLLECTOR.take_raw(step)
            if rows:
                pipeline.stream(None, st.process_name, step, rows)
        except Exception as e:  # noqa: BLE001 - the timer never dies of one push
            logger.error("forge_obs: the controller's raw values could not be streamed: %r", e)
        st.stream_timer = loop.call_later(st.stream_interval_s, tick)

    st.stream_timer = loop.call_later(st.stream_interval_s, tick)


async def end_session(final: bool) -> None:
    """End the current backends' session. ``final`` (shutdown): what was recorded since the last
    flush is logged as step ``last + 1`` first, and the meshes stop streaming and close their
    timelines; otherwise (``init_backends`` again) it stays for the next flush."""
    st = CONTROLLER
    if final:
        await start_flush((st.last_step + 1) if st.last_step is not None else 0, final=True)
    pipeline = st.pipeline
    st.stream_interval_s = 0.0
    if st.stream_timer is not None:
        st.stream_timer.cancel()
        st.stream_timer = None
    # late states still reach it through the inbox until here; bounded by shutdown_timeout_s
    unfinished = await pipeline.close()
    with st.lock:
        st.pipeline = None
    if st.run is not None:
        write_meta(st.run.run_dir, end_time=time.time(), status="finished" if final else "reconfigured",
                   steps_logged=pipeline.steps_logged,
                   backend_errors=pipeline.backend_errors,  # obs/backend_errors lags a step; this is the total
                   backends=pipeline.backend_report(), unfinished_backends=unfinished)
        if final:
            release_meta_space(st.run.run_dir)
    if final:
        await _close_run(st, pipeline.flush_timeout_s)


async def _close_run(st: ControllerState, timeout_s: float) -> None:
    """After ``shutdown``: stopped meshes' names are free again, the meshes stop streaming and
    close their timelines (awaited: a mesh stopped after ``shutdown`` returns has taken this
    message; one still in flight when its actors stop would fail the logger), and so does the
    controller."""
    st.shut_down = True
    start_naming_run(LOCAL_MESHES.live_names())
    options = {"streaming": False, "run_dir": None, "timeline": None, "telemetry": False}
    store_options(options)
    telemetry.configure(False)
    _COLLECTOR.set_streaming(False)
    _COLLECTOR.initialized = False
    await configure_meshes(options, timeout_s)
    try:
        from forge_obs.recording.timeline.writer import close

        close()
    except Exception:  # noqa: BLE001
        pass
    st.last_step = None


async def configure_meshes(options: dict[str, Any], timeout_s: float) -> None:
    """Apply ``options`` on every observed mesh (and the meshes spawned from them) and wait for
    it, so that every value recorded after ``init_backends`` returns is seen as configured."""
    await configure_all(LOCAL_MESHES.entries(), options, timeout_s)
