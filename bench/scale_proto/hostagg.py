"""Prototype: per-host aggregation of the cut (acks and states), public Monarch API only.

    from bench.scale_proto import hostagg
    hostagg.enable()            # before get_or_create_metric_logger / spawning meshes
    # ... the library as usual: provisioner_hooks.install(), init_backends, flush(step) ...

What changes against today's protocol (forge_obs.fetcher / controller / pipeline), and nothing else:

- Each fetcher opens a port of its own at start (``Channel.open``; nothing listens until the
  fetcher is made a leader) and says ``hello`` to the controller with its *host key* (host name and
  the pid of the Monarch host agent that spawned its process: one per Monarch host).
- The controller groups each mesh's ranks by host key and makes the highest live rank of each
  group (of at least ``MIN_GROUP`` ranks) its *leader*. The plan rides on the ``cut`` cast only
  when it changes.
- A member sends its ack and its states to its leader's port instead of the controller's. The
  leader's thread (started when it first leads) forwards ONE ack batch per group and cut, as soon
  as every member that is not lagging acknowledged (or ``ack_wait_s`` after the cut: the rest
  are lagging for the leader from then on, as for the controller), then ONE bundle (the members'
  states merged, :mod:`bench.scale_proto.bundle`) once the states of every member that acked are in
  (or ``step_wait_s`` after the cut). Late acks and states are forwarded alone, at once.
- The controller's pipeline takes ack batches (each rank acknowledged, as today) and bundles (the
  ranks they cover count as received; the merged states are reduced once), so the cut, its
  deadline, lagging ranks, missing/late labels and late placement are today's code.
- A group whose leader missed a cut goes direct (today's path) from the next cut on, and gets a
  new leader (a new plan version) once its ranks answer again. A member whose leader changed, or
  whose messages to it came back undeliverable (its process is gone), resends what it kept for
  that leader (its last 32 cuts) to the controller, which takes the states of a (rank, cut) it
  did not get and drops the rest; bundles from a leader that is no longer current for its
  version are dropped. Nothing is lost or counted twice but the dead leader's own values.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from typing import Any

from monarch.actor import Channel, endpoint

import forge_obs.client as _client
import forge_obs.controller as _controller
from forge_obs.collector import Taken
from forge_obs.fetcher import ACK, FINAL, STATES, LocalFetcherActor, _clock_sample, _COLLECTOR, _cut_children
from forge_obs.metric import Metric
from forge_obs.identity import rank_label
from forge_obs.pipeline import _COUNTERS, CPU_PARTS, RESUME_GRACE_S, FlushPipeline, _count, _run
from forge_obs.record import RankViews, StepRecord
from forge_obs.reduce import Reduce
from forge_obs.registry import LOCAL_MESHES
from forge_obs.reduce import merge_snapshots, reduce_snapshots
from forge_obs.snapshot import dumps, loads

from bench.scale_proto.bundle import make_bundle

logger = logging.getLogger("forge_obs")

HELLO, ACKB, BUNDLE, EXPECT, RESENT = "hello", "ackb", "bundle", "expect", "resent"
#: smallest group worth a leader (a lone rank answers directly)
MIN_GROUP = 2
#: fractions of flush_timeout_s a leader waits for acks / states before forwarding what it has
ACK_WAIT_FRACTION = 0.9
STEP_WAIT_FRACTION = 0.95
#: messages counted at the controller's inbox (benchmark read-out)
INBOX_COUNT = [0]


def host_key() -> str:
    """One Monarch host: its procs are children of the same host agent process."""
    return f"{socket.gethostname()}:{os.getppid()}"


# ------------------------------------------------------------------ rank side
class AggFetcher(LocalFetcherActor):
    """Today's fetcher, plus: answers a cut to its group's leader when the plan names one, and
    leads its group when the plan says so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.agg_port, self._agg_receiver = Channel.open()
        self.aggregator: HostAggregator | None = None
        self.plan: dict | None = None
        # what this rank sent to each leader's port, newest last (bounded): an undeliverable
        # message is resent to the controller from here; a port that failed is not used again
        self.sent: dict[str, list] = {}
        self.dead_ports: set[str] = set()
        self.ident_sent: tuple | None = None
        super().__init__(*args, **kwargs)

    def _connect(self, port: Any, mesh_id: str, options: dict | None) -> None:
        super()._connect(port, mesh_id, options)
        try:
            port.send((HELLO, self.key, host_key(), self.agg_port))
        except Exception as e:  # noqa: BLE001
            logger.warning("forge_obs: could not say hello: %r", e)

    @endpoint
    async def cut(self, seq: int, step: int, actor: str, ctl_us: int | None = None, plan: dict | None = None) -> None:
        cpu0 = time.thread_time()
        taken = _COLLECTOR.swap()
        self.last_seq = seq
        self.last_step = step
        if actor and self.identity.actor != actor:
            self.identity.actor = actor
        children = _cut_children(seq, step)
        old_target = self._leader_port()
        if plan is not None:
            self.plan = plan
        leader_rank = (self.plan or {}).get("leader", {}).get(self.rank)
        target = self._leader_port()
        if old_target is not None and (target is None or _port_key(target) != _port_key(old_target)):
            # a new leader (the old one missed a cut): what the old one may not have forwarded goes
            # to the controller, which keeps what it did not get yet and drops the rest
            self._resend(_port_key(old_target))
        if target is not None and _port_key(target) in self.dead_ports:
            target = None  # that leader's process is gone: direct until the plan names another
        if target is None:  # direct: today's path
            self._direct(seq, children, taken)
        else:
            if leader_rank == self.rank:
                self._lead(seq)
            self._to_leader(target, (ACK, seq, self.key, children))
            snap = dumps(_COLLECTOR.export(taken, packed=True))
            ident = self.identity.to_dict()
            sig = tuple(sorted((k, str(v)) for k, v in ident.items()))
            self._to_leader(target, (STATES, seq, self.key, ident if sig != self.ident_sent else None, snap))
            self.ident_sent = sig
        if ctl_us is not None:
            _clock_sample(ctl_us)
        _COLLECTOR.add_obs_cpu("export", time.thread_time() - cpu0)

    def _direct(self, seq: int, children: list, taken: Taken) -> None:
        try:
            self.port.send((ACK, seq, self.key, children))
        except Exception as e:  # noqa: BLE001
            logger.error("forge_obs: %s could not acknowledge cut %s: %r", self.identity.label, seq, e)
        self._send(STATES, seq, taken)
        self.ident_sent = None  # the controller got it with the states

    def _leader_port(self) -> Any:
        plan = self.plan or {}
        lead = plan.get("leader", {}).get(self.rank)
        return plan["ports"][lead] if lead is not None else None

    def _lead(self, seq: int) -> None:
        if self.aggregator is None:
            self.aggregator = HostAggregator(self._agg_receiver, self.port, self.key)
        plan = self.plan
        self.agg_port.send((EXPECT, seq, plan["groups"][self.rank], plan["per_rank"], plan["ack_wait_s"],
                            plan["step_wait_s"], plan["lagging"].get(self.rank, ()), plan["version"][self.rank]))

    def _resend(self, port_key: str) -> None:
        """Everything still kept of what this rank sent to that leader, to the controller: it takes
        the states it has not got (by rank and cut) and drops the others."""
        for msg in self.sent.pop(port_key, ()):
            if msg[0] == STATES:
                msg = (RESENT, msg[1], msg[2], msg[3] or self.identity.to_dict(), msg[4])
            try:
                self.port.send(msg)
            except Exception:  # noqa: BLE001
                pass

    def _to_leader(self, target: Any, msg: tuple) -> None:
        sent = self.sent.setdefault(_port_key(target), [])
        sent.append(msg)
        del sent[:-64]  # the last 32 cuts: what Monarch may still return before its delivery timeout
        try:
            target.send(msg)
        except Exception as e:  # noqa: BLE001 - an exception in a handler aborts the actor
            logger.error("forge_obs: %s could not send to its leader: %r", self.identity.label, e)

    def _handle_undeliverable_message(self, message: Any) -> bool:
        """A message to a leader whose process is gone: resend what is kept for that port to the
        controller (which drops what it already got), and do not use that port again."""
        try:
            key = str(message.dest())
        except Exception:  # noqa: BLE001
            return False
        if key not in self.sent and key not in self.dead_ports:
            return False
        self.dead_ports.add(key)
        self._resend(key)
        return True


def _port_key(port: Any) -> str:
    """A port as the undeliverable envelope names it."""
    try:
        return str(port._port_ref.port_id)
    except Exception:  # noqa: BLE001
        return repr(port)


class _GroupCut:
    __slots__ = ("members", "acked", "states", "ack_sent", "t0", "per_rank", "ack_wait_s", "step_wait_s")

    def __init__(self) -> None:
        self.members: set | None = None
        self.acked: dict = {}
        self.states: dict = {}
        self.ack_sent = False
        self.t0 = time.monotonic()
        self.per_rank = False
        self.ack_wait_s = 5.0
        self.step_wait_s = 8.0


class HostAggregator:
    """A leader's thread: one ack batch and one bundle per cut for its group, to the controller."""

    def __init__(self, receiver: Any, controller_port: Any, own_key: tuple) -> None:
        self.receiver = receiver
        self.ctl = controller_port
        self.own_key = own_key
        self.cuts: dict[int, _GroupCut] = {}
        self.done: list[int] = []  # recently completed cuts (their late messages go alone)
        self.lagging: set = set()
        self.cuts_seen = 0
        self.version = 0  # of the plan that made this rank the leader: the controller fences older ones
        threading.Thread(target=self._run, name="forge_obs-aggregator", daemon=True).start()

    def _run(self) -> None:
        base = self.receiver._receiver
        process = self.receiver._process
        cpu = time.thread_time()
        while True:
            timeout = self._next_deadline()
            try:
                task = base.recv_task()
                msg = process((task.with_timeout(timeout) if timeout is not None else task).block_on())
            except TimeoutError:
                msg = None
            except Exception as e:  # noqa: BLE001 - the process is going away
                logger.debug("forge_obs: aggregator port closed: %r", e)
                return
            try:
                if msg is not None:
                    self._take(msg)
                self._expire()
            except Exception:  # noqa: BLE001 - one bad message never stops the aggregator
                logger.exception("forge_obs: aggregator could not take a message")
            now = time.thread_time()
            _COLLECTOR.add_obs_cpu("aggregate", now - cpu)
            cpu = now

    def _next_deadline(self) -> float | None:
        if not self.cuts:
            return None
        now = time.monotonic()
        ds = []
        for gc in self.cuts.values():
            if gc.members is None:
                continue
            ds.append(gc.t0 + (gc.step_wait_s if gc.ack_sent else gc.ack_wait_s))
        return max(0.0005, min(ds) - now) if ds else 0.05

    def _take(self, msg: tuple) -> None:
        kind, seq = msg[0], msg[1]
        if seq in self.done:  # late for a cut already forwarded: alone, at once
            if kind == ACK:
                self.lagging.discard(msg[2])
                self.ctl.send((ACKB, seq, [(msg[2], msg[3])], []))
            elif kind == STATES:
                self._send_bundle(seq, {msg[2]: (msg[3], msg[4])}, False)
            return
        gc = self.cuts.get(seq)
        if gc is None:
            gc = self.cuts[seq] = _GroupCut()
        if kind == EXPECT:
            _, _, members, per_rank, ack_wait_s, step_wait_s, lagging, self.version = msg
            gc.members = {tuple(m) for m in members}
            if lagging and not self.cuts_seen:  # a new leader: the controller's view of its group
                self.lagging |= {tuple(m) for m in lagging}
            self.cuts_seen += 1
            gc.per_rank, gc.ack_wait_s, gc.step_wait_s = per_rank, ack_wait_s, step_wait_s
            gc.t0 = time.monotonic()
        elif kind == ACK:
            self.lagging.discard(msg[2])
            gc.acked[msg[2]] = msg[3]
        elif kind == STATES:
            gc.states[msg[2]] = (msg[3], msg[4])
        self._progress(seq, gc)

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
        self.ctl.send((ACKB, seq, list(gc.acked.items()), sorted(gc.members - gc.acked.keys())))

    def _finish(self, seq: int, gc: _GroupCut) -> None:
        del self.cuts[seq]
        self.done.append(seq)
        del self.done[:-64]
        if gc.states:
            self._send_bundle(seq, gc.states, gc.per_rank)

    def _send_bundle(self, seq: int, states: dict, per_rank: bool) -> None:
        snaps, idents = {}, {}
        drops = 0
        for key, (ident, snap) in states.items():
            try:
                snaps[key] = loads(snap)
            except Exception:  # noqa: BLE001 - counted; the others arrive
                drops += 1
                continue
            if ident:
                idents[key] = ident
        bundle = make_bundle(snaps, idents, per_rank)
        if drops:
            bundle["drops"]["undecodable"] = bundle["drops"].get("undecodable", 0) + drops
        bundle["ranks"] = list(states)  # every rank it answers for, decodable or not
        self.ctl.send((BUNDLE, seq, self.own_key, pickle.dumps(bundle, protocol=pickle.HIGHEST_PROTOCOL), self.version))

    def _expire(self) -> None:
        now = time.monotonic()
        for seq, gc in list(self.cuts.items()):
            if gc.members is None:
                continue
            if not gc.ack_sent and now >= gc.t0 + gc.ack_wait_s:
                self.lagging |= gc.members - gc.acked.keys()
                self._send_acks(seq, gc)
            if gc.ack_sent and (now >= gc.t0 + gc.step_wait_s or not (gc.acked.keys() - gc.states.keys())):
                self._finish(seq, gc)


# ------------------------------------------------------------------ controller side
AGG_INFO: dict[tuple, tuple[str, Any]] = {}  # rank key -> (host key, its port)
_PLANS: dict[str, tuple] = {}  # mesh id -> (signature, plan)
#: the current leaders and the plan version that made each one: a bundle from any other (a leader
#: replaced since, that resumed) is dropped; its members resent their states when they saw it replaced
_LEADS: dict[tuple, int] = {}
_VERSION = [0]
_BUNDLED = object()


def plan_for(entry: Any, pipeline: FlushPipeline) -> dict | None:
    """The mesh's plan if it changed since the last cut (else None): ranks grouped by host,
    the highest live rank of each group of >= MIN_GROUP leads it."""
    groups: dict[str, list[int]] = {}
    for r in range(entry.size):
        info = AGG_INFO.get((entry.mesh_id, r))
        if info is not None:
            groups.setdefault(info[0], []).append(r)
    lagging = pipeline.lagging
    leader: dict[int, int] = {}
    members: dict[int, list] = {}
    ports: dict[int, Any] = {}
    for ranks in groups.values():
        live = [r for r in ranks if (entry.mesh_id, r) not in lagging]
        if len(ranks) < MIN_GROUP or not live:
            continue
        lead = live[-1]  # not the host's first proc: Monarch's cast to the host goes through that one
        ports[lead] = AGG_INFO[(entry.mesh_id, lead)][1]
        members[lead] = [(entry.mesh_id, r) for r in ranks]
        for r in ranks:
            leader[r] = lead
    sig = (tuple(sorted(leader.items())), pipeline._need_per_rank)
    old = _PLANS.get(entry.mesh_id)
    if old is not None and old[0] == sig:
        return None
    old_leaders = set(old[1]["ports"]) if old is not None else set()
    version = {}
    for lead in members:
        key = (entry.mesh_id, lead)
        old_members = old[1]["groups"].get(lead) if old is not None else None
        if lead in old_leaders and key in _LEADS and old_members == members[lead]:
            version[lead] = _LEADS[key]  # the same leader of the same group: its bundles stay good
        else:
            _VERSION[0] += 1
            version[lead] = _LEADS[key] = _VERSION[0]
    for lead in old_leaders - set(members):
        _LEADS.pop((entry.mesh_id, lead), None)  # replaced: fenced
    t = pipeline.flush_timeout_s
    lag = {lead: [k for k in ks if k in lagging] for lead, ks in members.items()}
    plan = {"leader": leader, "ports": ports, "groups": members, "lagging": lag, "version": version,
            "per_rank": pipeline._need_per_rank, "ack_wait_s": t * ACK_WAIT_FRACTION,
            "step_wait_s": t * STEP_WAIT_FRACTION}
    _PLANS[entry.mesh_id] = (sig, plan)
    return plan


def start_flush(step: Any, final: bool = False) -> Any:
    """:func:`forge_obs.controller.start_flush`, casting each mesh's plan with the cut."""
    step = _controller.check_step(step)
    st = _controller._STATE
    pipeline = st.pipeline
    if pipeline is None:
        logger.warning("forge_obs: flush(%s) before init_backends", step)
        return _controller.FlushWait(None, None)
    cpu0 = time.thread_time()
    taken = _controller._COLLECTOR.swap()
    live, stopped = LOCAL_MESHES.take_for_cut()
    ranks = {(e.mesh_id, r): e.label(r) for e in live for r in range(e.size)}
    stopping = {(e.mesh_id, r): e.label(r) for e in stopped for r in range(e.size)}
    cut = pipeline.begin_cut(step, taken, ranks, stopping, final=final)
    st.last_step = step
    from forge_obs.timeline.writer import now_us

    ctl_us = now_us()
    for e in live:
        try:
            e.fetchers.cut.broadcast(cut.seq, step, e.actor_label, ctl_us, plan_for(e, pipeline))
        except Exception as ex:  # noqa: BLE001
            logger.warning("forge_obs: could not cut mesh %s: %r", e.name, ex)
    _controller._COLLECTOR.add_obs_cpu("flush", time.thread_time() - cpu0)
    return _controller.FlushWait(cut, pipeline)


_orig_take = _controller._take


def _take(msg: tuple) -> None:
    """The inbox: today's messages, plus hello, ack batches and bundles."""
    INBOX_COUNT[0] += 1
    kind = msg[0]
    if kind == HELLO:
        AGG_INFO[tuple(msg[1])] = (msg[2], msg[3])
        return
    if kind not in (ACKB, BUNDLE, RESENT):
        return _orig_take(msg)
    try:
        pipeline = _controller._STATE.pipeline
        if pipeline is None:
            return
        if kind == ACKB:
            pipeline.ack_batch(msg[1], msg[2], msg[3])
        elif kind == RESENT:
            pipeline.states_resent(msg[1], msg[2], msg[3], msg[4])
        elif _LEADS.get(tuple(msg[2])) == msg[4]:
            pipeline.bundle(msg[1], msg[3])
        else:
            pipeline.fenced_bundles += 1
    except Exception:  # noqa: BLE001
        logger.exception("forge_obs: could not take an aggregated message")


class AggPipeline(FlushPipeline):
    """Today's pipeline, plus ack batches and bundles (several ranks in one message), and
    bookkeeping in O(1) per rank: today's pipeline recomputes ``expected - lagging - acked`` at
    every ack and ``acked - received - lagging`` at every wake-up of its worker, O(ranks) each,
    which makes a step O(ranks^2) (268 ms of controller CPU at 1,024 ranks in the simulation).
    Here each cut keeps the ranks it still waits for in two sets that only shrink lazily: a rank
    is dropped when found acked/received/lagging, so each check is amortised O(1)."""

    # ---- two counters per cut (computed on first use: O(ranks) once per cut), then O(1) per rank:
    # n_left: expected, not lagging, not acked (acks awaited); n_due: acked, not lagging, not
    # received (states awaited). Every change of acked / received / lagging / expected adjusts them.
    def _counts(self, cut: Any) -> dict:
        d = cut.__dict__
        c = d.get("_n")
        if c is None:
            lag = self.lagging
            c = d["_n"] = {
                "left": sum(1 for k in cut.expected if k not in lag and k not in cut.acked),
                "due": sum(1 for k in cut.acked if k not in lag and k not in cut.received),
            }
        return c

    def _maybe_close(self, cut: Any, callbacks: list) -> None:
        if not cut.closed and self._counts(cut)["left"] <= 0:
            self._close(cut, callbacks)

    def _close(self, cut: Any, callbacks: list) -> None:
        if cut.closed:
            return
        super()._close(cut, callbacks)
        self._lagged(cut.late)

    def _lagged(self, keys: Any) -> None:
        """``keys`` just became lagging (already in self.lagging)."""
        for c in self._pending:
            n = c.__dict__.get("_n")
            if n is None:
                continue
            given_up = c.__dict__.get("_given_up", ())
            for k in keys:
                if k in c.expected and k not in c.acked and k not in given_up:
                    n["left"] -= 1
                if k in c.acked and k not in c.received:
                    n["due"] -= 1

    def _unlag(self, rank_key: tuple) -> None:
        """A lagging rank answered: the cuts that expect it wait for it again (as today)."""
        if rank_key not in self.lagging:
            return
        self.lagging.discard(rank_key)
        for c in self._pending:
            n = c.__dict__.get("_n")
            if n is None:
                continue
            if rank_key in c.expected and rank_key not in c.acked and rank_key not in c.__dict__.get("_given_up", ()):
                n["left"] += 1
            if rank_key in c.acked and rank_key not in c.received:
                n["due"] += 1

    def _mark_received(self, cut: Any, rank_key: tuple, value: Any) -> None:
        if rank_key in cut.received:
            return
        cut.received[rank_key] = value
        n = cut.__dict__.get("_n")
        if n is not None and rank_key in cut.acked and rank_key not in self.lagging:
            n["due"] -= 1

    def _states(self, seq: int, rank_key: Any, identity: Any, snapshot: Any) -> None:
        self._got_seq(rank_key, seq)
        self._note_identity(rank_key, identity)
        cut = self._find(seq)
        if cut is not None and rank_key not in cut.received:
            self._mark_received(cut, rank_key, (identity, snapshot))
        else:
            self.late_states += 1
            self._place(seq + 1, rank_key, identity, snapshot)

    def _ack_locked(self, cut: Any, rank_key: tuple, children: Any) -> None:
        self._unlag(rank_key)
        live: list = []
        n = self._counts(cut) if cut is not None else None
        for mesh_id, size, name, actor, stopping in children or ():
            for r in range(int(size)):
                key = (mesh_id, r)
                if key not in self.identities:
                    self.labels[key] = rank_label(name, actor, r)
                if not stopping:
                    live.append(key)
                if cut is not None and not cut.closed:
                    if key not in cut.expected:
                        cut.expected.add(key)
                        if key not in self.lagging and key not in cut.acked:
                            n["left"] += 1
                    if stopping:
                        cut.finals.add(key)
        if children or rank_key in self.tree:
            self.tree[rank_key] = live
        if cut is not None and rank_key not in cut.acked:
            cut.acked.add(rank_key)
            given_up = cut.__dict__.get("_given_up")
            if given_up and rank_key in given_up:
                given_up.discard(rank_key)  # already not waited for
            elif rank_key in cut.expected:
                n["left"] -= 1
            if rank_key not in cut.received:
                n["due"] += 1

    def ack(self, seq: int, rank_key: Any, children: Any = ()) -> None:
        self.ack_batch(seq, [(rank_key, children)])

    def ack_batch(self, seq: int, items: list, late: Any = ()) -> None:
        """Each rank of ``items`` (``(rank_key, children)``) acknowledged cut ``seq``; the ranks
        of ``late`` did not (their aggregator gave up on them): the cut does not wait for them
        any more and names them as late when it closes."""
        callbacks: list = []
        with self._cv:
            cut = self._find(seq)
            if late and cut is not None and not cut.closed:
                n = self._counts(cut)
                given_up = cut.__dict__.setdefault("_given_up", set())
                for k in late:
                    k = tuple(k)
                    if k in cut.expected and k not in cut.acked and k not in self.lagging and k not in given_up:
                        given_up.add(k)
                        n["left"] -= 1
            keys = [tuple(k) for k, _ in items]
            if cut is not None and not any(ch for _, ch in items) and self.lagging.isdisjoint(keys):
                # the common case, in C: no child meshes declared, no lagging rank answering
                n = self._counts(cut)
                new = set(keys) - cut.acked
                given_up = cut.__dict__.get("_given_up")
                if given_up and not given_up.isdisjoint(new):  # already not waited for
                    n["left"] += len(given_up & new & expected) if (expected := cut.expected) else 0
                    given_up -= new
                cut.acked |= new
                received, expected, tree = cut.received, cut.expected, self.tree
                n["left"] -= len(new & expected)
                n["due"] += sum(1 for k in new if k not in received)  # O(batch), not O(received)
                for k in new:
                    if k in tree:
                        tree[k] = []
            else:
                for rank_key, children in items:
                    self._ack_locked(cut, tuple(rank_key), children)
            if cut is not None:
                self._claim_held(cut)
                self._maybe_close(cut, callbacks)
            self._wake(cut)
        _run(callbacks)

    def _wake(self, cut: Any) -> None:
        """Wake the worker (and cut waiters) only when this may complete something: a closed
        cut whose states are all in, or a message for a cut that is gone. A wake-up per message
        costs the controller a thread switch each (~60 us here) for nothing."""
        if cut is None or (cut.closed and self._counts(cut)["due"] <= 0) or cut is not self._pending[0]:
            self._cv.notify_all()
        elif cut.closed and not cut.__dict__.get("_woke"):
            cut.__dict__["_woke"] = True  # FlushWait.wait_cut and the worker's grace period
            self._cv.notify_all()

    def final(self, last_seq: int, rank_key: Any, identity: Any, snapshot: Any) -> None:
        rank_key = tuple(rank_key)
        callbacks: list = []
        with self._cv:
            self._note_identity(rank_key, identity)
            self._unlag(rank_key)
            for cut in self._pending:
                if cut.seq > last_seq and rank_key in cut.finals and rank_key not in cut.received:
                    self._ack_locked(cut, rank_key, ())
                    self._mark_received(cut, rank_key, (identity, snapshot))
                    self._maybe_close(cut, callbacks)
                    break
            else:
                self._place(last_seq + 1, rank_key, identity, snapshot)
            self._cv.notify_all()
        _run(callbacks)

    def forget_mesh(self, mesh_id: str) -> None:
        with self._cv:
            for c in self._pending:
                c.__dict__.pop("_n", None)  # recounted on next use
        super().forget_mesh(mesh_id)

    def _next_step(self) -> Any:
        """:meth:`FlushPipeline._next_step` with the amortised O(1) check of missing states."""
        callbacks: list = []
        try:
            with self._cv:
                while True:
                    if not self._pending:
                        if self._closing:
                            return None
                        self._cv.wait()
                        continue
                    cut = self._pending[0]
                    timeout = cut.deadline - time.monotonic()
                    if not cut.closed:
                        if timeout > 0:
                            self._cv.wait(timeout)
                            continue
                        self._close(cut, callbacks)
                    if timeout > 0 and self._counts(cut)["due"] > 0:
                        self._cv.wait(timeout)
                        continue
                    grace = cut.start + cut.blocked_s + RESUME_GRACE_S - time.monotonic()
                    if cut.awaited and not cut.resumed and grace > 0:
                        self._cv.wait(grace)
                        continue
                    self._pending.pop(0)
                    absent = cut.expected - cut.received.keys()
                    newly = absent - self.lagging
                    self.lagging.update(absent)
                    self._lagged(newly)
                    extra = list(cut.extra)
                    keep = []
                    for item in self._held:
                        if item[1] == ("bundle",):
                            keep.append(item)
                        elif item[0] <= cut.seq:
                            extra.append(item[1:])
                        else:
                            keep.append(item)
                    self._held = keep
                    missing = [self.labels.get(k) or f"{k[0]}/r{k[1]}" for k in sorted(absent, key=str)]
                    late = [self.labels.get(k) or f"{k[0]}/r{k[1]}" for k in cut.late]
                    cut.extra = extra
                    return cut, missing, late, len(self._pending)
        finally:
            _run(callbacks)

    fenced_bundles = 0  # from a replaced leader: dropped (its members resent their states)
    duplicates_dropped = 0  # resent states the controller already had

    def _got_seq(self, rank_key: tuple, seq: int) -> bool:
        """Record that ``rank_key``'s states of cut ``seq`` arrived; False if they already had."""
        got = self.__dict__.setdefault("_got", {}).setdefault(rank_key, set())
        if seq in got:
            return False
        got.add(seq)
        if len(got) > 512:
            got.difference_update(sorted(got)[:256])
        return True

    def states_resent(self, seq: int, rank_key: Any, identity: Any, snapshot: Any) -> None:
        """States a rank sent to a leader that was replaced or is gone, sent again: taken if the
        controller did not get them (by rank and cut), dropped otherwise."""
        rank_key = tuple(rank_key)
        with self._cv:
            if seq in self.__dict__.get("_got", {}).get(rank_key, ()):
                self.duplicates_dropped += 1
                return
            self._states(seq, rank_key, identity, snapshot)
            self._cv.notify_all()

    def bundle(self, seq: int, payload: Any) -> None:
        """The merged states of several ranks for cut ``seq`` (pickled bytes or decoded)."""
        b = pickle.loads(payload) if isinstance(payload, (bytes, bytearray)) else payload
        ranks = [tuple(k) for k in b["ranks"]]
        callbacks: list = []
        with self._cv:
            for k in ranks:
                self._got_seq(k, seq)
            for key, ident in b.get("identities", {}).items():
                self._note_identity(tuple(key), ident)
            cut = self._find(seq)
            if cut is not None and cut.received.keys().isdisjoint(ranks):
                n = self._counts(cut)
                rs = set(ranks)
                n["due"] -= len((rs & cut.acked) - self.lagging)
                cut.received.update(dict.fromkeys(ranks, (None, _BUNDLED)))
                cut.__dict__.setdefault("bundles", []).append(b)
            else:  # its step left (late): the first cut still open takes it
                self.late_states += len(ranks)
                placed = False
                for c in self._pending:
                    if c.seq >= seq + 1:
                        c.__dict__.setdefault("bundles", []).append(b)
                        placed = True
                        break
                if not placed:
                    self._held.append((seq + 1, ("bundle",), {}, b))
            self._wake(cut)
        _run(callbacks)

    def _claim_held(self, cut: Any) -> None:
        """Held bundles and final states that may go into ``cut`` go there now."""
        keep = []
        for item in self._held:
            min_seq, key, ident, snap = item
            if key == ("bundle",):
                if min_seq <= cut.seq:
                    cut.__dict__.setdefault("bundles", []).append(snap)
                else:
                    keep.append(item)
            elif key in cut.finals and key not in cut.received and min_seq <= cut.seq:
                self._ack_locked(cut, key, ())
                self._mark_received(cut, key, (ident, snap))
            else:
                keep.append(item)
        self._held = keep

    def _build(self, p: Any, missing: list, late: list, pending: int) -> StepRecord | None:
        drops: dict[str, int] = {}
        bundles = p.__dict__.get("bundles", [])
        p_received = p.received
        p.received = {k: v for k, v in p_received.items() if v[1] is not _BUNDLED}
        try:
            entries = self._decoded_entries(p, drops)
        finally:
            p.received = p_received
        by_label: dict[str, list[dict]] = {}
        sources: dict[str, dict] = {}
        counters = dict.fromkeys(_COUNTERS, 0)
        rank_drops: dict[str, int] = {}

        def add_counters(snap_counters: dict) -> None:
            for k, v in (snap_counters or {}).items():
                if isinstance(v, dict):
                    for reason, n in v.items():
                        rank_drops[reason] = rank_drops.get(reason, 0) + n
                elif isinstance(v, (int, float)):
                    counters[k] = counters.get(k, 0) + v

        for ident, snap in entries:
            label = ident.get("label") or str(ident)
            by_label.setdefault(label, []).append(snap)
            sources[label] = ident
            add_counters(snap.get("counters"))
        rank_snaps: dict[str, dict] = {}
        raw: dict[str, list] = {}
        for label, snaps in by_label.items():
            for snap in snaps:
                if snap.get("raw"):
                    raw.setdefault(label, []).extend(snap["raw"])
            snap = snaps[0] if len(snaps) == 1 else merge_snapshots(snaps, lambda key, reason, n: _count(drops, reason, n))
            if snap.get("states") or snap.get("packed"):
                rank_snaps[label] = snap
        global_snaps = list(rank_snaps.values())
        conflict_keys: set = set()
        for b in bundles:
            if b["merged"].get("packed") or b["merged"].get("states"):
                global_snaps.append(b["merged"])
            add_counters(b["merged"].get("counters"))
            conflict_keys.update(b["conflicts"])
            for reason, n in b["drops"].items():
                _count(drops, reason, n)
            if self._need_per_rank:  # sources name the ranks of per-rank views
                for key in b["ranks"]:
                    key = tuple(key)
                    label = self.labels.get(key) or f"{key[0]}/r{key[1]}"
                    ident = self.identities.get(key)
                    if ident:
                        sources[label] = ident
            for key, vals in (b["raw"] or {}).items():
                label = self.labels.get(tuple(key)) or str(key)
                raw.setdefault(label, []).extend(vals)
            for key, snap in (b["per_rank"] or {}).items():
                label = self.labels.get(tuple(key)) or str(key)
                if label in rank_snaps:
                    rank_snaps[label] = merge_snapshots([rank_snaps[label], snap], lambda key, reason, n: _count(drops, reason, n))
                else:
                    rank_snaps[label] = snap
        global_metrics = reduce_snapshots(
            global_snaps, on_drop=lambda key, reason, n: _count(drops, reason, n),
            on_overflow=lambda key: _count(drops, "overflow", 1))
        if conflict_keys:
            global_metrics = [m for m in global_metrics if m.key not in conflict_keys]
            _count(drops, "reduction_mismatch", len(conflict_keys))
        per_rank = RankViews(rank_snaps) if self._need_per_rank else {}
        if p.final and not global_snaps and not raw:
            return None
        by_reason = dict(rank_drops)
        for reason, n in drops.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
        obs = {
            "obs/values_recorded": counters["values_recorded"],
            "obs/dropped_values": counters["dropped_values"] + sum(drops.values()),
            **{f"obs/dropped/{reason}": n for reason, n in sorted(by_reason.items()) if n},
            "obs/nonfinite_values": counters["nonfinite_values"],
            "obs/stream_overflow": counters["stream_overflow"],
            "obs/cpu_s": sum(counters.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS + ("aggregate",)),
            **{f"obs/cpu_{part}_s": counters.get(f"cpu_{part}_s", 0.0) for part in CPU_PARTS + ("aggregate",)},
            "obs/flush_blocked_s": p.blocked_s,
            "obs/backend_s": max((w.last_s for w in self.workers), default=0.0),
            "obs/pending_steps": pending,
            "obs/missing_ranks": len(missing),
            "obs/late_ranks": len(late),
            "obs/late_states": self.late_states,
            "obs/backend_errors": self.backend_errors,
            "obs/backend_dropped_steps": sum(w.dropped_steps for w in self.workers),
            "obs/ranks_reported": len(p.received),
            "obs/bundles": len(bundles),
            "obs/fenced_bundles": self.fenced_bundles,
            "obs/duplicates_dropped": self.duplicates_dropped,
        }
        global_metrics.extend(Metric(k, float(v), Reduce.SUM) for k, v in obs.items())
        return StepRecord(step=p.step, run_id=self.run_id, wall_time=time.time(), global_metrics=global_metrics,
                          per_rank=per_rank, raw=raw, sources=sources, missing=missing, late=late)


_enabled = [False]


def enable() -> None:
    """Route the library through this prototype (this process; fetchers spawned from now on)."""
    if _enabled[0]:
        return
    _enabled[0] = True
    _client.LocalFetcherActor = AggFetcher
    _client.start_flush = start_flush
    _controller.start_flush = start_flush
    _controller._take = _take
    _controller.FlushPipeline = AggPipeline


def count_messages() -> None:
    """Count inbox messages without changing the protocol (today's path, for the benchmark)."""
    orig = _controller._take

    def counted(msg: tuple) -> None:
        INBOX_COUNT[0] += 1
        orig(msg)

    _controller._take = counted


__all__ = ["enable", "count_messages", "AggFetcher", "HostAggregator", "AggPipeline", "INBOX_COUNT", "FINAL"]
