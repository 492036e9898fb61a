"""How the ranks of an SPMD job meet at ``init``: once, on the job's TCPStore.

1. Every rank writes its identity and its node (:func:`forge_obs.spmd.transport.node_id`).
2. The logger rank reads them all (one round trip), plans the helpers' tree
   (:class:`~forge_obs.spmd.layout.Layout`) and writes it with the run's id, directory, start
   time and the session's token.
3. The rank that starts a node's helper (the logger rank for the root) opens its listening
   sockets, writes where they are, reads its parent's address and starts the helper
   (:mod:`forge_obs.spmd.helper`; its setup goes on its stdin, the sockets as inherited file
   descriptors). Every rank connects to its node's helper and waits for it to say it is ready
   (the root: once its backends started; its error, if they did not, is raised on every rank).

A job of one process needs no store: it starts its helper and connects.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

from forge_obs.controller.config import LoggerConfig
from forge_obs.core.identity import ProcessIdentity
from forge_obs.spmd.helper import Setup
from forge_obs.spmd.layout import FANIN, Layout
from forge_obs.spmd.root import RootSetup
from forge_obs.spmd.transport import (Conn, StoreClient, connect_unix, job_namespace, listen_tcp, listen_unix, node_id,
                                      reachable_host, store_endpoint)
from forge_obs.wire.messages import RankHello, Ready

__all__ = ["Meeting", "meet", "start_helper", "connect", "helper_path", "open_store"]


class Meeting:
    """What ``init`` learnt: the run (id, directory, start), the layout, and (the logger rank)
    every rank's identity."""

    def __init__(self, run_id: str, root: str, start: float, layout: Layout, token: bytes,
                 identities: "dict[int, dict] | None" = None) -> None:
        self.run_id, self.root, self.start, self.layout, self.token = run_id, root, start, layout, token
        self.identities = identities or {}


def meet(store: "StoreClient | None", cfg: LoggerConfig, ident: ProcessIdentity, rank: int, world: int,
         logger_rank: int, start_time: float, fanin: int = FANIN) -> Meeting:
    """Steps 1 and 2 (see the module docstring); a job of one process meets itself."""
    mine = {"identity": ident.to_dict(), "node": node_id()}
    if store is None:
        return Meeting(cfg.run.run_id, str(cfg.run.root), start_time, Layout((0,), logger_rank, fanin),
                       secrets.token_bytes(16), {rank: mine["identity"]})
    store.set(f"ident/{rank}", json.dumps(mine).encode())
    if rank == logger_rank:
        got = [json.loads(v) for v in store.multi_get([f"ident/{r}" for r in range(world)])]
        layout = Layout.plan([g["node"] for g in got], logger_rank, fanin)
        token = secrets.token_bytes(16)
        store.set("run", json.dumps({"id": cfg.run.run_id, "root": str(cfg.run.root), "start": start_time,
                                     "helper_of": layout.helper_of, "fanin": fanin, "token": token.hex()}).encode())
        return Meeting(cfg.run.run_id, str(cfg.run.root), start_time, layout, token,
                       {r: g["identity"] for r, g in enumerate(got)})
    try:
        run = json.loads(store.get("run").decode())
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"forge_obs.spmd.init: the logger rank {logger_rank} did not call init within "
                           f"{store.timeout_s:g}s: {e!r}") from e
    layout = Layout(tuple(run["helper_of"]), logger_rank, int(run["fanin"]))
    return Meeting(run["id"], run["root"], float(run["start"]), layout, bytes.fromhex(run["token"]))


def start_helper(store: "StoreClient | None", meeting: Meeting, index: int, timeout_s: float,
                 root: "RootSetup | None", need_per_rank: bool) -> tuple[str, subprocess.Popen]:
    """Step 3 for the rank that starts helper ``index``: its sockets, its parent's address, the
    process. Returns (the Unix socket's path, the process)."""
    from forge_obs.recording.reduce import user_reductions

    lay = meeting.layout
    unix, path = listen_unix()
    tcp = None
    if lay.children_of(index):
        tcp, addr = listen_tcp(reachable_host())
        store.set(f"helper/{index}/tcp", json.dumps(list(addr)).encode())
    parent = lay.parent_of(index)
    parent_addr = tuple(json.loads(store.get(f"helper/{parent}/tcp").decode())) if parent is not None else None
    setup = Setup(index=index, layout=lay, timeout_s=timeout_s, token=meeting.token, unix_fd=unix.fileno(), unix_path=path,
                  tcp_fd=tcp.fileno() if tcp is not None else None, parent=parent_addr, sys_path=list(sys.path),
                  reductions=user_reductions(), root=root, need_per_rank=need_per_rank)
    try:
        proc = _spawn(setup, [unix.fileno()] + ([tcp.fileno()] if tcp is not None else []))
    finally:
        unix.close()
        if tcp is not None:
            tcp.close()
    if store is not None:
        store.set(f"helper/{index}/unix", path.encode())
    return path, proc


def _spawn(setup: Setup, fds: list[int]) -> subprocess.Popen:
    """The helper process: this interpreter, this process's import path, its setup on stdin."""
    import cloudpickle

    code = ("import sys; sys.path[:0] = __import__('json').loads(sys.argv[1]); "
            "from forge_obs.spmd.helper import main; main()")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(setup.sys_path)], stdin=subprocess.PIPE,
                            pass_fds=fds, env=env)
    try:
        proc.stdin.write(cloudpickle.dumps(setup))
        proc.stdin.close()
    except OSError as e:
        raise RuntimeError(f"forge_obs.spmd.init: the node's helper did not start: {e!r}") from e
    return proc


def connect(path: str, rank: int, wait_s: float, helper: "subprocess.Popen | None") -> Conn:
    """This rank's connection to its node's helper, once the helper said it is ready; raises
    RuntimeError with the helper's error (the logger helper's backends did not start) or when it
    does not answer within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    conn = connect_unix(path, wait_s)
    conn.send([RankHello(rank)])
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (helper is not None and helper.poll() is not None):
            raise RuntimeError(f"forge_obs.spmd.init: this node's helper did not answer within {wait_s:g}s"
                               if left <= 0 else f"forge_obs.spmd.init: this node's helper ended (rc={helper.returncode})")
        conn.wait_readable(min(left, 0.5))
        msgs = conn.read()
        if msgs is None:
            raise RuntimeError("forge_obs.spmd.init: this node's helper closed the connection")
        for m in msgs:
            if type(m) is Ready:
                if m.error is not None:
                    raise RuntimeError(f"forge_obs.spmd.init: the logger helper could not start the backends: {m.error}")
                return conn


def helper_path(store: StoreClient, index: int) -> str:
    """Where helper ``index`` listens for its node's ranks (written by the rank that starts it)."""
    return store.get(f"helper/{index}/unix").decode()


def open_store(session_no: int, wait_s: float) -> StoreClient:
    host, port = store_endpoint()
    return StoreClient(host, port, job_namespace(session_no), wait_s)

