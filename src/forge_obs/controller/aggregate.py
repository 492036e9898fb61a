"""Reduce on the way up: a leader's aggregator, and the route a rank's answer to a cut takes.

    # nothing to call: init_backends({"aggregate": "on", ...}) (or "auto") turns it on, and
    # each fetcher answers the cut on the port its mesh's plan (forge_obs.wire.plan) names

A flush is the same cut whether aggregated or not (:mod:`forge_obs.controller.fetcher`): each rank swaps its
collector, acknowledges, then sends the states it took. What the plan changes is *where* those
two messages go: to the controller's inbox (the direct route), or to the port of its group's
*leader* (one rank per (mesh, host)), whose :class:`Aggregator` thread forwards, for the whole
group, ONE ack batch (``ackb``) once every member it waits for acknowledged (or ``ack_wait_s``
after the cut: the rest are named as given up) and ONE bundle (``bundle``, the members' states
merged exactly, :mod:`forge_obs.wire.bundle`) once the states of every member that acknowledged are in
(or ``step_wait_s`` after the cut). Acks and states that arrive for a cut already forwarded go
on alone, at once.

A member keeps what it sent each leader (its last 32 cuts); when the plan names another leader,
or a message to the leader comes back undeliverable (its process is gone), it resends that to
the controller (a ``resent`` message), which keeps the states of a (rank, cut) it did not get and drops
the others. The controller drops bundles of a leader replaced since (its plan ``version``).
When a leader's bundle of a cut is not in ``BYPASS_FRACTION`` of ``flush_timeout_s`` after the
cut (the leader is dead, hung or slow), the controller asks its group's ranks to resend their
answer to that cut directly (:meth:`Route.resend_cut`) and drops that leader's bundles of the
cut: the live ranks' values keep their step, only the failed leader is named late and missing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Iterable

from forge_obs.controller.monarch_internals import receiver_with_timeout
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.core.threads import STOP, stop_port_thread
from forge_obs.recording.reduce import KeyDrops
from forge_obs.wire.bundle import dumps_bundle, make_bundle
from forge_obs.wire.messages import (ACK, ACKB, BUNDLE, EXPECT, HELLO, STATES, AckBatch, Bundle, Expect, Hello, resent,
                                     view, wire)
from forge_obs.wire.snapshot import loads

logger = logging.getLogger("forge_obs")

__all__ = ["host_key", "Aggregator", "Route"]

#: messages kept per leader, to resend if it fails: ack + states of the last 32 cuts
KEEP_SENT = 64
#: messages for a cut a leader never learnt it leads are dropped after this long
ORPHAN_S = 60.0


def host_key() -> str:
    """This process's Monarch host: the host name and the pid of the host agent that spawned it
    (every proc of a host is its child; localhost test hosts share a host name)."""
    return f"{socket.gethostname()}:{os.getppid()}"


# ------------------------------------------------------------------ member side
class Route:
    """Where this rank's answer to a cut goes (the controller's port, or its leader's), and what
    it sent each leader, to resend if that leader fails. Owned by the rank's fetcher."""

    def __init__(self, rank_key: tuple, controller_port: Any) -> None:
        from monarch.actor import Channel

        self.key = rank_key
        self.ctl = controller_port
        self.port, self._receiver = Channel.open()  # this rank's port, listened to once it leads
        self.plan: dict | None = None
        self.aggregator: Aggregator | None = None
        self.sent: dict[str, list] = {}  # leader's port -> what was sent to it, newest last
        self.dead_ports: set[str] = set()
        self.direct_upto = 0  # cuts up to this one are answered directly (the controller asked)

    def hello(self) -> None:
        """Tell the controller this rank's host and port (before its first cut)."""
        self.ctl.send(wire(Hello(HELLO, self.key, host_key(), self.port)))

    def target(self, seq: int, plan: dict | None) -> Any:
        """The port to answer cut ``seq`` on (``plan``: the mesh's new plan, if it changed)."""
        old = self._leader_port()
        if plan is not None:
            self.plan = plan
        new = self._leader_port()
        if old is not None and (new is None or port_key(new) != port_key(old)):
            self.resend(port_key(old))  # a new leader: the old one may not have forwarded it all
        if new is None or port_key(new) in self.dead_ports or seq <= self.direct_upto:
            return self.ctl
        rank = self.key[1]
        if self.plan["leader"].get(rank) == rank:
            self._lead(seq)
        return new

    def send(self, target: Any, msg: tuple) -> None:
        if target is not self.ctl:
            sent = self.sent.setdefault(port_key(target), [])
            sent.append(msg)
            del sent[:-KEEP_SENT]
        target.send(msg)

    def _leader_port(self) -> Any:
        plan = self.plan or {}
        lead = plan.get("leader", {}).get(self.key[1])
        return plan["ports"][lead] if lead is not None else None

    def _lead(self, seq: int) -> None:
        plan = self.plan
        rank = self.key[1]
        if self.aggregator is None:
            self.aggregator = Aggregator(self._receiver, self.ctl, self.key)
        self.port.send(wire(Expect(EXPECT, seq, plan["groups"][rank], plan["per_rank"], plan["ack_wait_s"],
                                   plan["step_wait_s"], plan["lagging"].get(rank, ()), plan["version"][rank])))

    def stop(self) -> None:
        """Stop this rank's aggregator thread, if it leads (the fetcher is stopping)."""
        if self.aggregator is not None:
            self.aggregator.stop(self.port)

    def resend(self, key: str) -> None:
        """What is kept of what this rank sent that leader, to the controller: it takes the
        states it has not got (by rank and cut) and drops the others."""
        self._to_controller(self.sent.pop(key, ()))

    def resend_cut(self, seq: int) -> None:
        """The controller did not get this rank's answer to cut ``seq`` from its leader in time:
        what this rank sent for that cut goes to the controller now, and, if it has not taken
        the cut yet, it answers it directly."""
        self.direct_upto = max(self.direct_upto, seq)
        for sent in self.sent.values():
            mine = [m for m in sent if view(m).seq == seq]
            if mine:
                sent[:] = [m for m in sent if view(m).seq != seq]
                self._to_controller(mine)

    def _to_controller(self, msgs: Iterable[tuple]) -> None:
        for raw in msgs:
            msg = view(raw)
            if msg.kind != ACK:
                msg = resent(msg)
            try:
                self.ctl.send(wire(msg))
            except Exception:  # noqa: BLE001 - a gone controller
                pass

    def undeliverable(self, message: Any) -> bool:
        """A message to a leader whose process is gone: resend what is kept for that port and
        do not use it again. False if it was not one of this route's."""
        try:
            key = str(message.dest())
        except Exception:  # noqa: BLE001
            return False
        if key not in self.sent and key not in self.dead_ports:
            return False
        self.dead_ports.add(key)
        self.resend(key)
        return True




def port_key(port: Any) -> str:
    """A port as an undeliverable envelope names it."""
    try:
        return str(port._port_ref.port_id)
    except Exception:  # noqa: BLE001
        return repr(port)


# ------------------------------------------------------------------ leader side
class _GroupCut:
    __slots__ = ("members", "acked", "states", "ack_sent", "t0", "per_rank", "ack_wait_s", "step_wait_s")

    def __init__(self) -> None:
        self.members: set | None = None  # known once the leader's own EXPECT arrived
        self.acked: dict = {}
        self.states: dict = {}
        self.ack_sent = False
        self.t0 = time.monotonic()
        self.per_rank = False
        self.ack_wait_s = 5.0
        self.step_wait_s = 8.0


class Aggregator:
    """A leader's thread: one ack batch and one bundle per cut for its group, to the controller.
    Its CPU is counted in ``obs/cpu_aggregate_s``."""

    def __init__(self, receiver: Any, controller_port: Any, own_key: tuple, public_only: bool = False) -> None:
        self.recv = receiver_with_timeout(receiver, public_only)
        self.ctl = controller_port
        self.own_key = own_key
        self.cuts: dict[int, _GroupCut] = {}
        self.done: list[int] = []  # recently forwarded cuts (their late messages go alone)
        self.lagging: set = set()
        self.cuts_seen = 0
        self.version = 0  # of the plan that made this rank the leader: the controller fences older ones
        self.idents: dict = {}  # identity last forwarded per member
        self._thread = threading.Thread(target=self._run, name="forge_obs-aggregator", daemon=True)
        self._thread.start()

    def stop(self, own_port: Any, timeout_s: float = 5.0) -> bool:
        """Stop the thread after what was already sent to ``own_port`` (its owner, the rank's
        :class:`Route`, calls this when the fetcher stops). True if it ended within ``timeout_s``."""
        return stop_port_thread(self._thread, own_port, timeout_s)

    def _run(self) -> None:
        cpu = time.thread_time()
        while True:
            try:
                msg = self.recv(self._next_timeout())
            except Exception as e:  # noqa: BLE001 - the process is going away
                logger.debug("forge_obs: aggregator port closed: %r", e)
                return
            if msg == STOP:
                return
            try:
                if msg is not None:
                    self._take(msg)
                self._expire()
            except Exception:  # noqa: BLE001 - one bad message never stops the aggregator
                logger.exception("forge_obs: aggregator could not take a message")
            now = time.thread_time()
            SELF_OBS.add("aggregate", now - cpu)
            cpu = now

    def _next_timeout(self) -> float | None:
        ds = [gc.t0 + (gc.step_wait_s if gc.ack_sent else gc.ack_wait_s) for gc in self.cuts.values()
              if gc.members is not None]
        if not ds:
            return None if not self.cuts else 1.0
        return max(0.0005, min(ds) - time.monotonic())

    def _take(self, raw: tuple) -> None:
        msg = view(raw)
        kind, seq = msg.kind, msg.seq
        if seq in self.done:  # late for a cut already forwarded: alone, at once
            if kind == ACK:
                self.lagging.discard(msg.rank)
                self.ctl.send(wire(AckBatch(ACKB, seq, [(msg.rank, msg.children)], [])))
            elif kind == STATES:
                self._send_bundle(seq, {msg.rank: (msg.identity, msg.states)}, False)
            return
        gc = self.cuts.get(seq)
        if gc is None:
            gc = self.cuts[seq] = _GroupCut()
        if kind == EXPECT:
            self._expect(gc, msg)
        elif kind == ACK:
            self.lagging.discard(msg.rank)
            gc.acked[msg.rank] = msg.children
        elif kind == STATES:
            gc.states[msg.rank] = (msg.identity, msg.states)
        self._progress(seq, gc)

    def _expect(self, gc: _GroupCut, msg: Expect) -> None:
        """This rank leads the group of ``msg.members`` for the cut (its own cut's plan)."""
        self.version = msg.version
        gc.members = {tuple(m) for m in msg.members}
        if msg.lagging and not self.cuts_seen:  # a new leader: the controller's view of its group
            self.lagging |= {tuple(m) for m in msg.lagging}
        self.cuts_seen += 1
        gc.per_rank, gc.ack_wait_s, gc.step_wait_s = msg.per_rank, msg.ack_wait_s, msg.step_wait_s
        gc.t0 = time.monotonic()

    def _progress(self, seq: int, gc: _GroupCut) -> None:
        if gc.members is None:
            return
        if not gc.ack_sent and not (gc.members - self.lagging - gc.acked.keys()):
            self._send_acks(seq, gc)
        if gc.ack_sent and not (gc.acked.keys() - gc.states.keys()):
            self._finish(seq, gc)

    def _send_acks(self, seq: int, gc: _GroupCut) -> None:
        """The group's acks, and the members it gave up on (named, so that the controller closes
        the cut now and reports them as late, instead of waiting for its own timeout)."""
        gc.ack_sent = True
        self.ctl.send(wire(AckBatch(ACKB, seq, list(gc.acked.items()), sorted(gc.members - gc.acked.keys()))))

    def _finish(self, seq: int, gc: _GroupCut) -> None:
        del self.cuts[seq]
        self.done.append(seq)
        del self.done[:-KEEP_SENT]
        if gc.states:
            self._send_bundle(seq, gc.states, gc.per_rank)

    def _send_bundle(self, seq: int, states: dict, per_rank: bool) -> None:
        snaps, idents = {}, {}
        lost = KeyDrops()  # what cannot be decoded here: keys, or a member's whole snapshot
        for key, (ident, snap) in states.items():
            try:
                snaps[key] = loads(snap, lost.add)
            except Exception:  # noqa: BLE001 - counted; the others arrive
                lost.add(("states", key), "undecodable")
                continue
            if ident and self.idents.get(key) != ident:
                idents[key] = self.idents[key] = ident
        bundle = make_bundle(snaps, None, per_rank)
        bundle["drops"].merge(lost)
        self.ctl.send(wire(Bundle(BUNDLE, seq, self.own_key, self.version, list(states), idents, dumps_bundle(bundle))))

    def _expire(self) -> None:
        now = time.monotonic()
        for seq, gc in list(self.cuts.items()):
            if gc.members is None:  # members' messages for a cut this rank was not told to lead
                if now - gc.t0 > ORPHAN_S:
                    del self.cuts[seq]  # they resend them to the controller at their next plan
                continue
            if not gc.ack_sent and now >= gc.t0 + gc.ack_wait_s:
                self.lagging |= gc.members - gc.acked.keys()
                self._send_acks(seq, gc)
            if gc.ack_sent and (now >= gc.t0 + gc.step_wait_s or not (gc.acked.keys() - gc.states.keys())):
                self._finish(seq, gc)
