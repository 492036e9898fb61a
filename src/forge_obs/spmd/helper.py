"""The node helper of an SPMD job: one process per node, started by one of its ranks at ``init``.

It takes its node's ranks' cuts (Unix socket) and its child helpers' pieces (TCP), and hands
each step on once every source is in or the step's time is up (:mod:`forge_obs.spmd.tree`):
a helper with a parent merges the step exactly (:mod:`forge_obs.wire.bundle`) and sends one
piece up; the root (helper 0, the *logger helper*, on the logger rank's node) hands it to the
backends (:mod:`forge_obs.spmd.root`). No training process does any of this: a training
thread's cost is its cut (:mod:`forge_obs.wire.rank_cut`), its rank's shipper thread pickles
and sends. What a helper does per step grows with its node's ranks and its children (at most
:data:`~forge_obs.spmd.layout.FANIN`), not with the job.

One thread reads every connection (whatever has arrived, whole frames, without blocking) and
keeps the tree; the root's pipeline and backends have threads of their own. A helper ends when
every source finished or is gone (after handing everything on); the root also when the logger
rank's shutdown leaves it no more time (ranks still out are then named unfinished). A helper
ends on SIGTERM too, after handing on what it has. It never outlives its sources: a helper
whose ranks and children all closed their connections ends. It runs ``HELPER_NICE`` below its
ranks: on a node whose cores are busy, the ranks' threads come first.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from forge_obs.core.selfobs import SELF_OBS, add_cpu
from forge_obs.recording.reduce import KeyDrops, adopt_reductions
from forge_obs.spmd.layout import Layout
from forge_obs.spmd.root import MAX_BACKLOG_STEPS, MESH_ID, Root, RootSetup
from forge_obs.spmd.sampling import AlertWatch
from forge_obs.spmd.transport import Conn, accept, connect_tcp
from forge_obs.spmd.tree import Late, Step, Tree
from forge_obs.wire.bundle import dumps_bundle, loads_bundle, make_bundle, merge_bundles
from forge_obs.wire.messages import Control, Done, HelperHello, Piece, RankCut, RankHello, Ready, Status
from forge_obs.wire.snapshot import loads

__all__ = ["Setup", "Helper", "main", "HEARTBEAT_S", "INIT_WAIT_S"]

logger = logging.getLogger("forge_obs")

#: a helper tells its parent its horizon at least this often (also when it has nothing to send)
HEARTBEAT_S = 0.25
#: how long a helper waits for its parent and for its first rank
INIT_WAIT_S = 300.0
#: how much lower than its ranks a helper runs (``os.nice``)
HELPER_NICE = 10
#: how often the logger helper looks for live alerts that point at a rank
ALERT_LOOK_S = 0.2


@dataclass
class Setup:
    """What the rank that starts a helper hands it (on its stdin, cloudpickled)."""

    index: int
    layout: Layout
    timeout_s: float
    token: bytes
    unix_fd: int  # the listening Unix socket its node's ranks connect to
    unix_path: "str | None" = None  # ... its path (removed when the helper ends)
    tcp_fd: "int | None" = None  # the listening TCP socket of its children, if it has any
    parent: "tuple | None" = None  # the parent's TCP address
    sys_path: "list | None" = None
    reductions: "dict | None" = None  # the user's reductions (classes travel by value)
    root: "RootSetup | None" = None
    need_per_rank: bool = False  # a backend shows per-rank views: pieces carry each rank's states


class Helper:
    """One helper's loop (see the module docstring)."""

    def __init__(self, setup: Setup) -> None:
        lay, i = setup.layout, setup.index
        self.setup = setup
        self.tree = Tree(local_ranks=lay.ranks_of(i), children={c: lay.subtree(c) for c in lay.children_of(i)},
                         timeout_s=setup.timeout_s, root=i == 0)
        self.sel = selectors.DefaultSelector()
        self.conns: dict[Conn, tuple] = {}  # conn -> ("rank", r) | ("child", index) | ("new", None)
        self.rank_conn: dict[int, Conn] = {}
        self.child_horizon: dict[int, float] = {}
        self.parent: "Conn | None" = None
        self.root = Root(setup.root, setup.timeout_s, len(lay.helper_of)) if setup.root is not None else None
        self.ready: "Ready | None" = None  # sent to the ranks and children (once every child connected)
        self.ready_in: "Ready | None" = None  # the parent's (the root: its own)
        self.stop_at: "float | None" = None  # the root: the logger rank's shutdown leaves it until then
        self.shutdown_by: "float | None" = None  # the root: when the logger rank's shutdown returns at the latest
        self.gone_told: set = set()
        self.next_beat = 0.0
        self.counts = {"undecodable_cuts": 0, "lost_pieces": 0}  # this helper's own
        self.child_counts: dict[int, dict] = {}  # each child's, its subtree's summed
        self.first_rank_by = time.monotonic() + INIT_WAIT_S
        self.alerts = _alert_watch(setup.root)
        self.next_alert_look = 0.0
        for fd, kind in ((setup.unix_fd, "unix"), (setup.tcp_fd, "tcp")):
            if fd is not None:
                s = socket.socket(fileno=fd)
                s.setblocking(False)
                self.sel.register(s, selectors.EVENT_READ, (kind, None))

    # ------------------------------------------------------------ start, loop, end
    def run(self) -> int:
        if self.setup.parent is not None:
            self.parent = connect_tcp(self.setup.parent, self.setup.token, INIT_WAIT_S)
            self.parent.send([HelperHello(self.setup.index)])
            self.sel.register(self.parent, selectors.EVENT_READ, ("parent", None))
        elif self.root is not None:
            self._set_ready(Ready(self.root.start()))
        while not self._over():
            self._turn()
        self._end()
        return 0

    def _turn(self) -> None:
        """One pass: read whatever arrived, hand on what is ready, tell the parent."""
        if self.root is not None and self.root.backlog() > MAX_BACKLOG_STEPS:
            time.sleep(0.002)  # the pipeline catches up first; nothing is read meanwhile
        else:
            t = time.time()
            events = self.sel.select(self._timeout())
            cpu0 = time.thread_time()
            readable = set()
            for key, _mask in events:
                kind = key.data[0]
                if kind in ("unix", "tcp"):
                    self._accept(key.fileobj, kind)
                else:
                    readable.add(key.fileobj)
                    self._read(key.fileobj)
            for conn in list(self.conns):
                if conn not in readable:
                    conn.idle(t)
            SELF_OBS.add("inbox", time.thread_time() - cpu0)
        cpu0 = time.thread_time()
        self._hand_on(self.tree.ready(time.time(), self._horizon()))
        if self.alerts is not None and time.time() >= self.next_alert_look:
            self._point_spans()
        SELF_OBS.add("aggregate", time.thread_time() - cpu0)

    def _point_spans(self) -> None:
        """The ranks a live alert points at write their spans (until it resolves)."""
        self.next_alert_look = time.time() + ALERT_LOOK_S
        for rank, on in self.alerts.changes():
            self._send_down([Control((rank,), on)])

    def _over(self) -> bool:
        if self.tree.done():
            return True
        if self.stop_at is not None and time.time() >= self.stop_at:
            return True
        if self.parent is not None and self.parent.closed:
            return True
        return not self.conns and time.monotonic() > self.first_rank_by

    def _end(self) -> None:
        """Hand on everything pending; the root finishes the backends and answers the logger rank."""
        self._hand_on(self.tree.drain())
        if self.root is not None and self.root.pipeline is not None:
            left = self.shutdown_by - time.time() if self.shutdown_by is not None else self.setup.timeout_s
            summary = self.root.finish(self.tree, left, self._subtree_counts())
            conn = self.rank_conn.get(self.setup.layout.logger_rank)
            if conn is not None and not conn.closed:
                try:
                    conn.send([Done(summary)])
                except OSError:
                    pass
        elif self.parent is not None and not self.parent.closed:
            self._beat(force=True)
            self.parent.close()
        for conn in list(self.conns):
            conn.close()
        if self.setup.unix_path:
            try:
                os.unlink(self.setup.unix_path)
            except OSError:
                pass

    def _timeout(self) -> float:
        now = time.time()
        wake = [now + 0.5]
        due = self.tree.next_due()
        if due is not None:
            wake.append(max(due, now + 0.002))
        if self.parent is not None:
            wake.append(self.next_beat)
        if self.stop_at is not None:
            wake.append(self.stop_at)
        return max(0.0, min(wake) - now)

    # ------------------------------------------------------------ connections
    def _accept(self, listener: socket.socket, kind: str) -> None:
        try:
            conn, first = accept(listener, self.setup.token if kind == "tcp" else None, 5.0)
        except OSError as e:
            logger.warning("forge_obs.spmd: a connection was refused: %r", e)
            return
        if conn is not None:
            self.conns[conn] = ("new", None)
            self.sel.register(conn, selectors.EVENT_READ, ("conn", None))
            self._take_all(conn, first)

    def _read(self, conn: Conn) -> None:
        msgs = conn.read()
        if msgs is None:
            self._closed(conn)
            return
        self._take_all(conn, msgs)

    def _take_all(self, conn: Conn, msgs: list) -> None:
        for m in msgs:
            try:
                self._take(conn, m)
            except Exception as e:  # noqa: BLE001 - one message costs only itself
                logger.error("forge_obs.spmd: helper %s could not take %s: %r", self.setup.index, type(m).__name__, e)

    def _take(self, conn: Conn, m: Any) -> None:
        t = type(m)
        if t is RankCut:
            r = self.conns[conn][1]
            self.tree.cut(r, step=m.step, flushed_at=m.flushed_at, data=m.data, held_back=m.held_back, final=m.final,
                          report=m.report)
            if m.final and r == self.setup.layout.logger_rank and self.root is not None:
                # the ranks still out are waited for 60 % of the logger rank's time left; the rest
                # is for the steps and backends
                self.shutdown_by = (m.report or {}).get("shutdown_by") or (time.time() + self.setup.timeout_s)
                self.stop_at = time.time() + 0.6 * max(0.0, self.shutdown_by - time.time())
        elif t is Piece:
            self.tree.piece(self.conns[conn][1], m)
        elif t is Status:
            i = self.conns[conn][1]
            self.child_horizon[i] = m.horizon
            self.child_counts[i] = dict(m.counts or {})
            self.tree.status(i, m.gone)
        elif t is RankHello:
            self._hello(conn, ("rank", m.rank))
        elif t is HelperHello:
            self._hello(conn, ("child", m.index))
        elif t is Ready:
            self._set_ready(m)
        elif t is Control:
            self._send_down([m])

    def _hello(self, conn: Conn, who: tuple) -> None:
        self.conns[conn] = who
        conn.name = who
        if who[0] == "rank":
            self.rank_conn[who[1]] = conn
        if self.ready is not None:
            self._send(conn, [self.ready])
        else:
            self._maybe_ready()

    def _set_ready(self, ready: Ready) -> None:
        self.ready_in = ready
        if ready.error is not None and self.root is not None:
            self.stop_at = time.time() + 1.0  # nothing will be logged: every rank's init raises
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        """Ranks start flushing once their helper says it is ready; it says so once its parent
        did and every child helper connected (a step then waits only for ranks, never for a
        helper still starting)."""
        children = {i for kind, i in self.conns.values() if kind == "child"}
        if self.ready_in is None or self.ready is not None or not children.issuperset(self.setup.layout.children_of(self.setup.index)):
            return
        self.ready = self.ready_in
        self._send_down([self.ready])

    def _send_down(self, msgs: list) -> None:
        for conn, who in list(self.conns.items()):
            if who[0] in ("rank", "child"):
                self._send(conn, msgs)

    def _send(self, conn: Conn, msgs: list) -> None:
        try:
            conn.send(msgs)
        except OSError:
            pass  # its reader sees the connection close

    def _closed(self, conn: Conn) -> None:
        who = self.conns.pop(conn, ("new", None))
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        if conn is self.parent:
            return
        if who[0] == "rank":
            self.tree.rank_gone(who[1])
        elif who[0] == "child":
            self.tree.child_gone(who[1])
            self.child_horizon.pop(who[1], None)

    # ------------------------------------------------------------ horizon, hand-on
    def _horizon(self) -> float:
        """Every cut the ranks below shipped before this time has been read (by this helper or
        by the child that reported it); a child silent for ``timeout_s`` with nothing unread
        does not hold it back."""
        now = time.time()
        h = now
        for conn, (kind, i) in self.conns.items():
            if kind == "rank":
                h = min(h, conn.drained_at)
            elif kind == "child":
                silent = now - conn.read_at > self.setup.timeout_s and conn.drained_at >= conn.read_at
                if not silent:
                    h = min(h, self.child_horizon.get(i, 0.0))
        return h

    def _hand_on(self, steps: list[Step]) -> None:
        if self.root is not None:
            for st in steps:
                self.root.emit(st, self.tree)
            return
        # later pieces first: a rank's cut of a step reaches the parent before its cut of a later step
        msgs: list = [self._piece(late, main=False) for late in self.tree.take_late()]
        msgs.extend(self._piece(st, main=True) for st in steps)
        msgs = [m for m in msgs if m is not None]
        if msgs:
            msgs.append(self._status())
            self._to_parent(msgs)
        elif time.time() >= self.next_beat:
            self._beat()

    def _beat(self, force: bool = False) -> None:
        if force or time.time() >= self.next_beat:
            self._to_parent([self._status()])

    def _status(self) -> Status:
        gone = tuple(sorted(self.tree.gone - self.gone_told))
        self.gone_told.update(gone)
        self.next_beat = time.time() + HEARTBEAT_S
        return Status(self._horizon(), gone, self._subtree_counts())

    def _subtree_counts(self) -> dict[str, int]:
        """What this helper and the helpers below it could not hand on, or handed on early."""
        out = dict(self.counts, early_steps=0 if self.root is not None else self.tree.counts["early_steps"])
        for counts in self.child_counts.values():
            for k, v in counts.items():
                out[k] = out.get(k, 0) + v
        return out

    def _to_parent(self, msgs: list) -> None:
        try:
            self.parent.send(msgs)
        except OSError as e:
            self.counts["lost_pieces"] += sum(1 for m in msgs if type(m) is Piece)
            logger.error("forge_obs.spmd: helper %s lost its parent: %r", self.setup.index, e)
            self.parent.closed = True

    def _piece(self, st: "Step | Late", main: bool) -> "Piece | None":
        """A step's (or late cuts') states merged into one piece for the parent."""
        if not st.cuts and not st.pieces and not (main and (st.missing or st.skipped)):
            return None
        bundle = self._merge(st)
        if main:
            return Piece(st.step, st.t0, True, st.n_ranks, (), tuple(sorted(st.missing)), tuple(sorted(st.skipped)),
                         st.held_back, tuple(st.finished), dict(st.reports), bundle)
        return Piece(st.step, st.t0, False, st.n_ranks, tuple(sorted(st.ranks)), (), (), st.held_back,
                     tuple(st.finished), dict(st.reports), bundle)

    def _merge(self, st: "Step | Late") -> bytes:
        drops = KeyDrops()
        snaps = {}
        for r, data in st.cuts:
            try:
                snaps[(MESH_ID, r)] = loads(data, drops.add)
            except Exception as e:  # noqa: BLE001 - one rank's step; counted, the others arrive
                self.counts["undecodable_cuts"] += 1
                drops.add(("states", r), "undecodable")
                logger.error("forge_obs.spmd: rank %s's states of step %s could not be read: %r", r, st.step, e)
        bundles = [make_bundle(snaps, per_rank=self.setup.need_per_rank)]
        for b in st.pieces:
            try:
                bundles.append(loads_bundle(b, drops.add))
            except Exception as e:  # noqa: BLE001 - counted, the other groups arrive
                drops.add(("bundle", st.step), "undecodable")
                logger.error("forge_obs.spmd: a piece of step %s could not be read: %r", st.step, e)
        merged = bundles[0] if len(bundles) == 1 else merge_bundles(bundles)
        merged["drops"].merge(drops)
        cpu = dict(merged["merged"].get("self_cpu") or {})
        add_cpu(cpu, SELF_OBS.take())  # this helper's own CPU goes up with the states
        merged["merged"]["self_cpu"] = cpu
        return dumps_bundle(merged)


def _alert_watch(root: "RootSetup | None") -> "AlertWatch | None":
    """The logger helper of a session with the ``"alerts"`` backend watches the alerts' file."""
    if root is None or "alerts" not in root.config.backends:
        return None
    mesh = next(iter(root.identities.values()), {}).get("mesh", "trainer")
    return AlertWatch(root.run_dir, mesh)


def main() -> None:
    """The helper process: its setup on stdin (cloudpickled), then its loop."""
    import cloudpickle

    setup: Setup = cloudpickle.loads(sys.stdin.buffer.read())
    os.environ["FORGE_OBS_SPMD_HELPER"] = str(setup.index)
    try:  # below the ranks: on a node whose cores are busy, a rank's thread is never the one that waits
        os.nice(HELPER_NICE)
    except OSError:
        pass
    adopt_reductions(setup.reductions or {})
    helper = Helper(setup)
    signal.signal(signal.SIGTERM, lambda *_: setattr(helper, "stop_at", time.time()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job's Ctrl-C reaches the ranks; they shut down
    sys.exit(helper.run())
