"""The process side of a flush: :class:`LocalFetcherActor`, one per proc of every observed mesh.

    procs = this_host().spawn_procs(per_host={"procs": 2}, name="trainer")
    # provisioner_hooks spawns LocalFetcherActor("obs_fetcher") on procs; nothing else to do

At each flush the controller casts ``cut(seq, step)`` to the fetchers. A fetcher then, in order:
swaps its process's collector (the cut: O(1), no export, no device sync), forwards the cut to the
meshes spawned from its own process (meshes spawned inside actors), acknowledges on the
controller's port (a tiny message, declaring those meshes), and only then exports the states it
took and sends them on the same port. The controller's ``flush`` returns when every rank has
acknowledged, so a value recorded by work the controller awaited before ``flush(step)`` is in
``step`` or earlier, and one recorded by work started after ``flush`` returned is in a later step.
With ``"aggregate"`` on, the mesh's plan (cast with the cut when it changes) may route both
messages to the rank's group leader instead, which forwards them batched and merged
(:mod:`forge_obs.controller.aggregate`); the cut itself is the same.

While a ``per_rank_no_reduce`` backend is configured, a timer on the fetcher's actor loop (no
thread of its own) sends the raw values recorded so far every ``stream_interval_s`` (default
1 s) on the same port, under the predicted step: the last step this rank was cut for, + 1 (what
torchforge streams under). Each raw value is taken once, by such a push or by the next cut.

torchforge's construction works too: ``LocalFetcherActor(global_logger, process_name)``, then
``global_logger.register_fetcher.call_one(fetcher, proc_id)``, which connects it to the cut
(:meth:`LocalFetcherActor.connect`). Its ``flush(global_step, return_state)`` endpoint returns the
rank's states as torchforge's does (:meth:`MetricCollector.flush`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

import cloudpickle
from monarch.actor import Actor, context, endpoint

from forge_obs.controller.cut_timing import rank_stamp
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.core.identity import set_identity
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.recording.collector import MetricCollector
from forge_obs.recording import reduce as _reduce
from forge_obs.recording import telemetry
from forge_obs.recording.reduce import adopt_reductions, user_reductions
from forge_obs.recording.timeline import follow_cut
from forge_obs.recording.timeline import writer as _timeline_writer
from forge_obs.wire import rank_cut
from forge_obs.wire.messages import (ACK, CUT, DEFAULT_STREAM_INTERVAL_S, EXPORT, FINAL, STATES, STREAM, Ack, ChildMesh,
                                     States, Stream, view, wire)
from forge_obs.controller.local_socket import LocalSender, running_loop as _running_loop
from forge_obs.wire.snapshot import encode_raw

logger = logging.getLogger("forge_obs")

__all__ = ["LocalFetcherActor", "FETCHER_NAME", "apply_options", "current_options", "store_options", "configure_all",
           "hosts_fetcher", "expect_fetcher", "ACK_STATES_MAX_VALUES"]

FETCHER_NAME = "obs_fetcher"
#: how long a fetcher waits for the meshes it spawned to take a new configuration
CONFIGURE_TIMEOUT_S = 10.0

_COLLECTOR = MetricCollector()
#: this process's current options: what ``init_backends`` configured (streaming, timeline)
_OPTIONS: dict[str, Any] = {"streaming": False, "run_dir": None, "timeline": None}


_hosts_fetcher = [False]


def hosts_fetcher() -> bool:
    """Whether this process has a fetcher (which then cuts the meshes spawned from here)."""
    return _hosts_fetcher[0]


def expect_fetcher() -> None:
    """This process's mesh gets a fetcher (set before any actor is built, by the hook's
    process start-up): meshes spawned from here are cut from here."""
    _hosts_fetcher[0] = True


def current_options() -> dict[str, Any]:
    """Options to give fetchers spawned from this process (and their new processes), with the
    reductions the user registered here (classes defined in a script travel by value)."""
    return {**_OPTIONS, "reductions": _travelling_reductions()}


def _travelling_reductions() -> dict[str, Any]:
    """:func:`~forge_obs.recording.reduce.user_reductions` that can be pickled (one that cannot stays
    here, with a warning, rather than failing the spawn that would carry it)."""
    out = {}
    for name, cls in user_reductions().items():
        try:
            cloudpickle.dumps(cls)
        except Exception as e:  # noqa: BLE001
            logger.warning("forge_obs: reduction %r cannot be sent to new processes: %r", name, e)
            continue
        out[name] = cls
    return out


def store_options(options: dict[str, Any]) -> None:
    """Remember the options fetchers spawned from this process start with (the controller
    process configures itself directly)."""
    _OPTIONS.update(options)


def apply_options(options: dict[str, Any] | None, timeline: bool = True) -> None:
    """Configure this process: raw streaming for ``per_rank_no_reduce`` and (``timeline``) the
    timeline writer, which names its file after the process's identity: the fetcher sets that
    first. Runs when a process starts (before user actors; streaming only), when a fetcher is
    built, and on ``configure``; never raises."""
    if not options:
        return
    try:
        adopt_reductions(options.get("reductions") or {})
        _OPTIONS.update({k: v for k, v in options.items() if k not in ("reductions", "inbox_socket")})
        _COLLECTOR.set_streaming(bool(options.get("streaming")))
        if "run_dir" in options:  # a session's options: init_backends reached this process (or shutdown did)
            _COLLECTOR.initialized = options.get("run_dir") is not None
        if "telemetry" in options:  # the session's telemetry (False: shutdown): obs/sys/... at the cuts
            telemetry.configure(options.get("telemetry") or False, options.get("run_dir"))
        if timeline and "timeline" in options:
            tl = options.get("timeline")
            if _timeline_writer.configure_from_push(options.get("run_dir") if tl is not None else None, tl or {}):
                from forge_obs.controller.call_context import install as _link_calls

                _link_calls()
    except Exception as e:  # noqa: BLE001 - configuration never breaks a process
        logger.error("forge_obs: could not apply options %r: %r", options, e)


class LocalFetcherActor(Actor):
    """Takes its process's values at each cut and hands them to the controller's inbox port.

    Args (torchforge's): ``global_logger`` (the GlobalLoggingActor; kept, not needed: the
    controller connects the fetcher when it is registered), ``process_name`` (names the mesh).
    forge_obs's attach passes ``port``, ``mesh_id``, ``mesh_name`` and ``options`` by keyword.
    """

    def __init__(
        self,
        global_logger: Any = None,
        process_name: str | None = None,
        *,
        port: Any = None,
        mesh_id: str | None = None,
        mesh_name: str | None = None,
        options: dict | None = None,
    ) -> None:
        inst = context().actor_instance
        point = inst.rank
        proc_name = inst.actor_id.proc_name or ""
        name = mesh_name or process_name or (proc_name.rsplit("-", 1)[0] if "-" in proc_name else proc_name) or "mesh"
        self.global_logger = global_logger
        self.process_name = process_name
        self.rank = int(point.rank)
        self.identity = set_identity(
            mesh=name, rank=self.rank, coords={k: int(v) for k, v in dict(point).items()}, world_size=int(point.extent.nelements)
        )
        self.last_seq = 0  # the last cut this rank took (its final states come after it)
        self.last_step: int | None = None  # the step of that cut (raw values stream under last_step + 1)
        self.port: Any = None
        self.local: LocalSender | None = None  # the port's inbox socket, when on its host
        self.route: Any = None  # where cuts are answered (forge_obs.controller.aggregate.Route), once connected
        self.mesh_id: str | None = None
        self.key: tuple | None = None
        self._loop: Any = None
        self._timer: Any = None
        self._held: tuple | None = None  # (seq, taken): a large cut's states, sent once the cut closed
        self._ctx: contextvars.Context | None = None  # the actor's context, for cuts that come on the socket
        self._stream_interval_s = DEFAULT_STREAM_INTERVAL_S
        self._ident_dict: tuple = (None, None)  # (the identity's fields, its to_dict()): sent with every cut's states
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass
        if port is not None:
            self._connect(port, mesh_id or "mesh", options)

    def _connect(self, port: Any, mesh_id: str, options: dict | None) -> None:
        self.port = port  # the controller inbox's port: acks, states, streams and finals, in this order
        try:
            port.return_undeliverable = False  # a gone controller must not fail this actor
        except Exception:  # noqa: BLE001
            pass
        if self.local is not None:
            self.local.close()
        # on the inbox's host, the same messages go on its socket, in the same order; and the
        # controller may send this rank its cuts there (they run on this actor's loop)
        self._ctx = contextvars.copy_context()
        self.local = LocalSender.connect((options or {}).get("inbox_socket"),
                                         (mesh_id, self.rank) if self._loop is not None else None, self._on_local,
                                         lambda cpu_s: SELF_OBS.add("inbox", cpu_s), loop=self._loop)
        self.mesh_id = mesh_id
        self.key = (mesh_id, self.rank)
        try:  # the controller learns this rank's host and port (for the aggregated route)
            from forge_obs.controller.aggregate import Route

            self.route = Route(self.key, port)
            self.route.hello()
        except Exception as e:  # noqa: BLE001 - the direct route needs none of it
            logger.warning("forge_obs: %s answers directly (no aggregation): %r", self.identity.label, e)
            self.route = None
        expect_fetcher()
        if options and options.get("last_step") is not None and self.last_step is None:
            self.last_step = int(options["last_step"])
        follow_cut(0 if self.last_step is None else self.last_step + 1)
        self._apply(options)

    def _close_local(self) -> None:
        """The inbox socket ends after this rank's last message (the controller takes all before it)."""
        if self.local is not None:
            self.local.close()
            self.local = None

    def _apply(self, options: dict | None) -> None:
        apply_options(options)
        if options and options.get("stream_interval_s"):
            self._stream_interval_s = float(options["stream_interval_s"])
        self._schedule_stream()

    # ------------------------------------------------------------ the cut
    @endpoint
    async def cut(self, seq: int, step: int, actor: str, ctl_us: int | None = None, plan: dict | None = None,
                  only: list[int] | None = None) -> None:
        """Swap the collector, cut the meshes spawned here, acknowledge; then export and send (a
        small cut's states go with the ack). The messages go to the controller's port, or to
        this rank's group leader when the mesh's ``plan`` (sent when it changed;
        :mod:`forge_obs.wire.plan`) names one. ``only``: the ranks this cast is for (the others
        took the cut on the inbox socket)."""
        if only is None or self.rank in only:
            self._take_cut(seq, step, actor, ctl_us, plan)

    def _on_local(self, msg: tuple) -> None:
        """A message of the inbox socket: a cut runs on this actor's loop, as the endpoint's
        would, in the order the cuts came. The loop reads the socket itself; where it could not
        (connected off the loop's thread), a reader thread hands each message to it."""
        if _running_loop() is self._loop:
            self._take_local(msg)
            return
        try:
            self._loop.call_soon_threadsafe(self._take_local, msg, context=self._ctx)
        except RuntimeError:  # the actor's loop is closed: it stopped
            pass

    def _take_local(self, raw: tuple) -> None:
        msg = view(raw)
        if msg.kind == CUT:
            self._local_cut(msg)
        elif msg.kind == EXPORT:
            self._send_held_for(msg.seq)

    def _local_cut(self, msg: Any) -> None:
        try:
            self._take_cut(msg.seq, msg.step, msg.actor, msg.ctl_us)
        except Exception as e:  # noqa: BLE001 - the controller names this rank late
            logger.error("forge_obs: %s could not take cut %s: %r", self.identity.label, msg.seq, e)

    def _take_cut(self, seq: int, step: int, actor: str, ctl_us: int | None = None, plan: dict | None = None) -> None:
        cpu0 = time.thread_time()
        entered = time.monotonic()
        self._send_held()  # an earlier cut's, should its export request not have come
        taken = rank_cut.take(step)  # the cut (swap; the timeline follows)
        self.last_seq = seq
        self.last_step = step
        _OPTIONS["last_step"] = step  # fetchers spawned from here start predicting from it
        if actor and self.identity.actor != actor:
            self.identity.actor = actor
        children = _cut_children(seq, step)
        target = self.port
        if self.route is not None and (plan is not None or self.route.plan is not None):
            try:
                target = self.route.target(seq, plan)
            except Exception as e:  # noqa: BLE001 - the direct route always works
                logger.error("forge_obs: %s answers cut %s directly: %r", self.identity.label, seq, e)
        # a small cut's states ride with the ack (one message, sent once they are exported); a
        # large one's, or device values (read back at export), follow it
        with_ack = target is self.port and _small(taken)
        data = self._export_states(seq, taken) if with_ack else None
        ident = self._identity_dict() if data is not None else None
        ack = Ack(ACK, seq, self.key, children, rank_stamp(entered), ident, data)
        try:
            self._post(target, ack)
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not acknowledge step %s: %r", self.identity.label, step, e)
        if ctl_us is not None:
            _clock_sample(ctl_us)
        if not with_ack and target is self.port and ctl_us is not None:
            # a large cut of the controller's: exported once it asks (export), so that the
            # export does not compete with the cut for the machine while other ranks ack
            self._held = (seq, taken)
        elif not with_ack:
            self._send(STATES, seq, taken, target)
        SELF_OBS.add("export", time.thread_time() - cpu0)  # sent with the next cut

    def _post(self, target: Any, msg: tuple) -> None:
        raw = wire(msg)
        if target is self.port:
            self._to_inbox(raw)
        elif self.route is None:
            target.send(raw)
        else:
            self.route.send(target, raw)

    def _to_inbox(self, msg: tuple) -> None:
        """``msg`` to the controller's inbox: on its socket while that works, then (this message
        and every later one, so that their order holds) on its port."""
        local = self.local
        if local is not None:
            try:
                if local.send(msg):
                    return
            except Exception as e:  # noqa: BLE001 - cannot be pickled: the port's pickling decides
                logger.warning("forge_obs: %s answers on the port from now on: %r", self.identity.label, e)
                local.close()
            self.local = None
        self.port.send(msg)

    def _identity_dict(self) -> dict:
        """``self.identity.to_dict()``, made again only when one of its fields changed (a cut
        names the actor). Read-only: every message that carries it is pickled."""
        i = self.identity
        fields = (i.mesh, i.actor, i.rank, i.world_size, i.pid, i.host, tuple(i.coords.items()))
        made_for, d = self._ident_dict
        if made_for != fields:
            d = i.to_dict()
            self._ident_dict = (fields, d)
        return d

    def _send(self, kind: str, seq: int, taken: Any, target: Any = None) -> None:
        data = self._export_states(seq, taken)
        if data is None:
            return
        try:
            self._post(target or self.port, States(kind, seq, self.key, self._identity_dict(), data))
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not send its states (cut %s): %r", self.identity.label, seq, e)

    def _export_states(self, seq: int, taken: Any) -> bytes | None:
        """``taken``'s states, pickled here (:func:`forge_obs.wire.rank_cut.export`: a message
        then carries one bytes object), so that the controller's inbox thread only moves bytes
        while a flush waits (they are decoded once it resumed). None (logged) if they cannot be
        exported."""
        try:
            return rank_cut.export(taken)
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not export its states (cut %s): %r", self.identity.label, seq, e)
            return None

    @endpoint
    async def export(self, seq: int) -> None:
        """Cut ``seq`` closed: send the states held for it (or for an earlier cut)."""
        self._send_held_for(seq)

    def _send_held_for(self, seq: int) -> None:
        if self._held is not None and self._held[0] <= seq:
            cpu0 = time.thread_time()
            self._send_held()
            SELF_OBS.add("export", time.thread_time() - cpu0)

    def _send_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._send(STATES, held[0], held[1])

    @endpoint
    async def ping(self) -> None:
        """Nothing: the raw round trip to this rank that a cut is measured against (the
        ``probe_round_trip`` option of ``init_backends``)."""
        return None

    @endpoint
    async def resend(self, seq: int, ranks: list[int]) -> None:
        """The controller did not get cut ``seq``'s bundle from the group leader of ``ranks``
        in time: if this rank is one of them, what it sent that leader for the cut goes to the
        controller directly (:meth:`forge_obs.controller.aggregate.Route.resend_cut`)."""
        if self.route is not None and self.rank in ranks:
            self.route.resend_cut(seq)

    def _handle_undeliverable_message(self, message: Any) -> bool:
        """A message to a group leader whose process is gone: what this rank sent it goes to the
        controller instead (:meth:`forge_obs.controller.aggregate.Route.undeliverable`)."""
        route = self.route
        return route is not None and route.undeliverable(message)

    # ------------------------------------------------------------ raw streaming
    def _schedule_stream(self) -> None:
        """Keep the stream timer running while this process streams raw values."""
        if self._timer is not None or self._loop is None or self.port is None or not _COLLECTOR.streaming:
            return
        try:
            self._timer = self._loop.call_later(self._stream_interval_s, self._stream_tick)
        except Exception as e:  # noqa: BLE001 - a closed loop: raw values go with the cuts
            logger.debug("forge_obs: stream timer not started: %r", e)

    def _stream_tick(self) -> None:
        self._timer = None
        try:
            self.push_stream()
        except Exception as e:  # noqa: BLE001 - the timer never dies of one push
            logger.error("forge_obs: %s could not stream raw values: %r", self.identity.label, e)
        self._schedule_stream()

    def push_stream(self) -> int:
        """Send the raw values recorded since the last push or cut, under the predicted step.
        Returns how many were sent."""
        if self.port is None:
            return 0
        step = 0 if self.last_step is None else self.last_step + 1
        rows = _COLLECTOR.take_raw(step)
        if not rows:
            return 0
        # values that are not numbers travel pickled one by one: one the controller cannot
        # unpickle costs that value only (counted there), never the message
        rows, pickled = encode_raw(rows, lambda key, reason, n: _COLLECTOR.count_drop(reason, n))
        self._to_inbox(wire(Stream(STREAM, self.key, self.identity.label, step, rows, pickled)))
        return len(rows)

    # ------------------------------------------------------------ configuration, torchforge's endpoints
    @endpoint
    async def configure(self, options: dict) -> None:
        """New options (``init_backends``): applied here and in the meshes spawned from here
        before this returns, so that nothing recorded after ``init_backends`` returns is missed."""
        self._apply(options)
        await configure_all(LOCAL_MESHES.entries(), options, CONFIGURE_TIMEOUT_S)

    @endpoint
    async def connect(self, port: Any, mesh_id: str, options: dict | None = None) -> dict:
        """Join the cut (``GlobalLoggingActor.register_fetcher``): answer on ``port`` as rank
        ``(mesh_id, rank)`` from now on. Returns this rank's identity."""
        self._connect(port, mesh_id, options)
        await configure_all(LOCAL_MESHES.entries(), options or {}, CONFIGURE_TIMEOUT_S)
        return self.identity.to_dict()

    @endpoint
    async def release(self) -> None:
        """Leave the cut (``deregister_fetcher``): hand over what was recorded since the last
        cut as final states (the next flush takes them). From then on this rank is not observed:
        what it records later is not sent, as in torchforge."""
        if self.port is not None:
            self._send_held()
            self._send(FINAL, self.last_seq, _COLLECTOR.swap())
        self._close_local()
        if self.route is not None:
            self.route.stop()
            self.port = None
            self.route = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @endpoint
    async def flush(self, global_step: int, return_state: bool = False) -> dict[str, dict[str, Any]]:
        """torchforge's per-rank flush: this rank's ``{key: state}`` with ``return_state=True``
        (taken out of the collector: the caller owns them), ``{}`` otherwise. forge_obs's own
        flushes use :meth:`cut`. See :meth:`forge_obs.recording.collector.MetricCollector.flush`."""
        return await _COLLECTOR.flush(global_step, return_state=return_state)

    @endpoint
    async def init_backends(self, metadata_per_controller_backend: Any = None, config: Any = None, global_step: int = 0) -> None:
        """torchforge's per-rank backend init. forge_obs runs every backend on the controller
        (per-rank views included), so a rank has nothing to start; ``global_step`` sets the step
        raw values stream under until the first cut."""
        if self.last_step is None and global_step:
            self.last_step = int(global_step) - 1

    @endpoint
    async def shutdown(self) -> None:
        """torchforge's per-rank shutdown: nothing runs here (see :meth:`init_backends`)."""
        return None

    async def __cleanup__(self, exc: Exception | None) -> None:
        """The mesh is stopping: hand over what was recorded since the last cut."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.port is not None:
            self._send_held()
            self._send(FINAL, self.last_seq, _COLLECTOR.swap())
        self._close_local()
        try:
            _timeline_writer.close()
        except Exception:  # noqa: BLE001
            pass


async def configure_all(entries: list, options: dict[str, Any], timeout_s: float) -> None:
    """Configure the fetchers of ``entries`` (live meshes) and wait, at most ``timeout_s``; a
    mesh that is gone or does not answer is skipped (it shows up as missing ranks)."""
    calls = []
    for e in entries:
        if e.stopping:
            continue
        try:
            calls.append(asyncio.ensure_future(e.fetchers.configure.call(options)))
        except Exception as ex:  # noqa: BLE001
            logger.warning("forge_obs: could not configure mesh %s: %r", e.name, ex)
    if not calls:
        return
    done, pending = await asyncio.wait(calls, timeout=timeout_s)
    for f in pending:
        f.cancel()
    for f in done:
        if f.exception() is not None:
            logger.info("forge_obs: a mesh did not take its configuration: %r", f.exception())


#: a cut that took at most this many values (keys and raw values) sends its states with the ack
ACK_STATES_MAX_VALUES = 128
#: ... or at most this many keys, all in columns (exported with slices: a message's cost)
ACK_STATES_MAX_COLUMN_KEYS = 4096
#: forge_obs's own numeric accumulators: exported as packed rows, never running user code
_ROW_TYPES = frozenset(c for c in vars(_reduce).values() if isinstance(c, type) and issubclass(c, _reduce.RowAccumulator))


def _small(taken: Any) -> bool:
    """Whether ``taken`` exports in about a message's cost: few values, all of built-in numeric
    reductions (a SAMPLE or custom reduction's export may take any time), no device values."""
    accs = taken.accs
    if taken.device is not None:
        return False
    if not accs and not taken.raw:
        return sum(t.count() for t in taken.cols) <= ACK_STATES_MAX_COLUMN_KEYS
    if taken.n_keys() + len(taken.raw or ()) > ACK_STATES_MAX_VALUES:
        return False
    return _ROW_TYPES.issuperset(map(type, accs.values()))


def _cut_children(seq: int, step: int) -> list[tuple]:
    """Cast the cut to the meshes spawned from this process; declare them (stopped ones last)."""
    live, stopped = LOCAL_MESHES.take_for_cut()
    out = []
    for e in live:
        try:
            e.fetchers.cut.broadcast(seq, step, e.actor_label)
        except Exception as ex:  # noqa: BLE001 - a dead mesh shows up as missing ranks
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)
        out.append(wire(ChildMesh(e.mesh_id, e.size, e.name, e.actor_label, False)))
    out.extend(wire(ChildMesh(e.mesh_id, e.size, e.name, e.actor_label, True)) for e in stopped)
    return out


def _clock_sample(ctl_us: int) -> None:
    """The controller's clock when it sent the cut: narrows this host's clock-offset estimate."""
    try:
        w = _timeline_writer.current_writer()
        if w is not None:
            w.clock_sample([_timeline_writer.now_us(), int(ctl_us)])
    except Exception:  # noqa: BLE001
        pass
