"""Where every rank answers the controller: :class:`ObsInbox` (the actor that owns the port), the
thread that drains it (:class:`InboxDrain`), the same-host socket beside it
(:func:`start_local_inbox`), and :func:`take`, which hands each message to the session's
:class:`~forge_obs.controller.pipeline.FlushPipeline`.

    >>> from forge_obs.wire.messages import HELLO, Hello, wire
    >>> take(wire(Hello(HELLO, ("doc-mesh", 0), "doc-host", None)))   # noted for the aggregated route
    >>> CONTROLLER.planner.hosts[("doc-mesh", 0)]
    ('doc-host', None)

The inbox's port and socket are drained on threads of their own, whatever the user's event loop
is doing; both take each sender's messages in the order it sent them. A message that arrives
before ``init_backends`` started a session is kept for its first cut when it carries values (a
rank's states, a stopping rank's final states); one that cannot be taken is logged and never
stops the drain.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Callable

from monarch.actor import Actor, Channel, endpoint

from forge_obs.controller.local_socket import LocalInbox
from forge_obs.controller.monarch_internals import receiver_with_timeout
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.controller.registry import LOCAL_MESHES
from forge_obs.controller.state import CONTROLLER
from forge_obs.core.env import local_socket_enabled
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.threads import STOP, stop_port_thread
from forge_obs.wire.messages import (ACK, ACKB, BUNDLE, FINAL, HELLO, RESENT, STATES, STREAM, Ack, AckBatch,
                                     Bundle, States, Stream, view)
from forge_obs.wire.snapshot import has_values

logger = logging.getLogger("forge_obs")

__all__ = ["INBOX_NAME", "ObsInbox", "InboxDrain", "take", "start_local_inbox", "local_port"]

INBOX_NAME = "obs_inbox"


# -------------------------------------------------------------------- taking a message
def take(raw: tuple) -> None:
    """One message of the inbox (:mod:`forge_obs.wire.messages`): an ack, a rank's states, a
    stopping rank's final states, raw values streamed, a rank's hello; from group leaders, ack
    batches and bundles (:mod:`forge_obs.controller.aggregate`). Never raises."""
    try:
        msg = view(raw)
        st = CONTROLLER
        if msg.kind == HELLO:  # a fetcher's host and port, kept across sessions
            st.planner.hello(msg.rank, msg.host, msg.port)
            return
        with st.lock:
            pipeline = st.pipeline
            if pipeline is None:
                _keep_early(msg)
                return
        _TAKE[msg.kind](pipeline, msg)
    except Exception:  # noqa: BLE001 - one bad message never stops the drain
        logger.exception("forge_obs: could not take a fetcher message")


def _keep_early(msg: Any) -> None:
    """Under the lock, with no session: values, and every stopped rank's final states (the
    first cut after ``init_backends`` expects them, values or not), kept for that cut. A raw
    stream with no session has its values' states in the collector's next cut."""
    if msg.kind == FINAL or (msg.kind == STATES and has_values(msg.states)):
        CONTROLLER.early.append((msg.rank, msg.identity, msg.states))


def _ack(pipeline: FlushPipeline, msg: Ack) -> None:
    states = (msg.identity, msg.states) if msg.states is not None else None
    pipeline.ack(msg.seq, msg.rank, msg.children, msg.stamp, states)


def _stream(pipeline: FlushPipeline, msg: Stream) -> None:
    pipeline.stream(msg.rank, _stream_label(msg.rank, msg.label), msg.step, msg.rows, msg.pickled)


def _bundle(pipeline: FlushPipeline, msg: Bundle) -> None:
    # a replaced leader's is dropped: its members resent their states to the controller
    current = CONTROLLER.planner.current(msg.leader, msg.version)
    pipeline.bundle(msg.seq, msg.ranks, msg.bundle, msg.identities, leader=msg.leader, current=current)


def _ack_batch(pipeline: FlushPipeline, msg: AckBatch) -> None:
    pipeline.ack_batch(msg.seq, msg.items, msg.given_up)


def _states(pipeline: FlushPipeline, msg: States) -> None:
    pipeline.states(msg.seq, msg.rank, msg.identity, msg.states)


def _final(pipeline: FlushPipeline, msg: States) -> None:
    pipeline.final(msg.seq, msg.rank, msg.identity, msg.states)


def _resent(pipeline: FlushPipeline, msg: States) -> None:
    pipeline.states_resent(msg.seq, msg.rank, msg.identity, msg.states)


#: kind -> how the session's pipeline takes it
_TAKE: dict[str, Callable[[FlushPipeline, Any], None]] = {
    ACK: _ack, STATES: _states, FINAL: _final, STREAM: _stream, ACKB: _ack_batch, BUNDLE: _bundle, RESENT: _resent}


def _stream_label(rank_key: Any, label: str) -> str:
    """The label of a rank that streamed raw values: as the registry names it now (a rank may
    stream before the first cut tells it the actors spawned on its mesh), else as it sent it."""
    try:
        e = LOCAL_MESHES.get(rank_key[0])
        if e is not None:
            return e.label(int(rank_key[1]))
    except Exception:  # noqa: BLE001 - a key of another shape: the rank's own label
        pass
    return label


# -------------------------------------------------------------------- draining the port
class InboxDrain:
    """The thread that takes every message of an inbox's port, in each sender's order, apart
    from every event loop, and hands it to ``take``; all of its CPU is counted in
    ``obs/cpu_inbox_s``. Its owner (the :class:`ObsInbox`) stops it when the actor stops, or,
    for the process's port (which outlives the actor that opened it), at process exit:
    :meth:`stop` sends ``core.threads.STOP`` on the port, so every message sent before it is
    still taken."""

    def __init__(self, port: Any, receiver: Any, take: Callable[[Any], None]) -> None:
        self._port = port
        self._recv = _receive_blocking(receiver)
        self._take = take
        self._thread = threading.Thread(target=self._run, name="forge_obs-inbox", daemon=True)

    def start(self) -> "InboxDrain":
        self._thread.start()
        atexit.register(self.stop)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the messages already sent; True if the thread ended within ``timeout_s``."""
        atexit.unregister(self.stop)
        return stop_port_thread(self._thread, self._port, timeout_s)

    def _run(self) -> None:
        cpu = time.thread_time()
        recv, take_one = self._recv, self._take
        while True:
            try:
                msg = recv()
            except Exception as e:  # noqa: BLE001 - the process is going away
                logger.debug("forge_obs: inbox port closed: %r", e)
                return
            if msg == STOP:
                return
            # charged before the message is taken, so a step assembled once it closed its cut
            # counts it (the take's own CPU is charged with the next message)
            now = time.thread_time()
            SELF_OBS.add("inbox", now - cpu)
            cpu = now
            take_one(msg)


def _receive_blocking(receiver: Any) -> Any:
    """The next message of ``receiver``, waiting for it (the one receive fast path)."""
    recv = receiver_with_timeout(receiver)
    return lambda: recv(None)


def start_local_inbox() -> tuple | None:
    """``(host, path)`` of this process's inbox socket (:mod:`forge_obs.controller.local_socket`),
    started on first use: fetchers of this host answer there rather than on the inbox's port
    (the same messages, taken by :func:`take`). None when ``FORGE_OBS_LOCAL_SOCKET`` is false
    or the socket cannot be made here."""
    st = CONTROLLER
    if st.local is None and local_socket_enabled():
        with st.lock:
            if st.local is None:
                try:
                    st.local = LocalInbox.start(take, lambda cpu_s: SELF_OBS.add("inbox", cpu_s))
                    atexit.register(st.local.close)
                except Exception as e:  # noqa: BLE001 - the port serves every fetcher
                    logger.warning("forge_obs: no inbox socket (fetchers answer on the port): %r", e)
                    st.local = False
    return st.local.address if st.local else None


# -------------------------------------------------------------------- the actor
class ObsInbox(Actor):
    """Owns the port every fetcher answers on (acks, states, final states), drained by a thread
    of its own; also registers meshes attached by hand from processes that have no fetcher."""

    def __init__(self) -> None:
        self._port, receiver = Channel.open()
        if CONTROLLER.port is None:  # this process's inbox (a GlobalLoggingActor here registers fetchers on it)
            CONTROLLER.port = self._port
        self.drain = InboxDrain(self._port, receiver, take).start()

    @endpoint
    async def get_port(self) -> Any:
        return self._port

    @endpoint
    async def get_address(self) -> tuple:
        """``(port, socket address or None)``: where fetchers answer (see :func:`start_local_inbox`)."""
        return self._port, start_local_inbox()

    @endpoint
    async def register_mesh(self, fetchers: Any, mesh_id: str, mesh_name: str, num_ranks: int) -> None:
        LOCAL_MESHES.add(mesh_id, mesh_name, num_ranks, fetchers)

    @endpoint
    async def add_actor(self, mesh_id: str, actor: str) -> None:
        LOCAL_MESHES.add_actor(mesh_id, actor)

    @endpoint
    async def stop_mesh(self, mesh_id: str) -> None:
        LOCAL_MESHES.mark_stopping(mesh_id)


async def local_port() -> Any:
    """The port of an :class:`ObsInbox` in this process (the pipeline's): the one the client
    spawned here, or one spawned here now (a GlobalLoggingActor spawned on a mesh by hand)."""
    st = CONTROLLER
    if st.port is None:
        if st.inbox is None:
            from monarch.actor import this_proc

            st.inbox = this_proc().spawn(INBOX_NAME, ObsInbox)
        port = await st.inbox.get_port.call_one()
        st.port = st.port or port
    return st.port
