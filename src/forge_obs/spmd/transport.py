"""How the processes of an SPMD job reach each other: a rendezvous on the job's TCPStore, then
sockets of their own.

    >>> a, b = socket.socketpair()
    >>> x, y = Conn(a), Conn(b)
    >>> x.send([("hello", 1), b"states"]); x.send([("bye",)])
    >>> _ = y.wait_readable(5.0); y.read()
    [('hello', 1), b'states', ('bye',)]
    >>> x.close(); y.read() is None        # the peer closed: after every whole message
    True

- :class:`StoreClient`: the job's TCPStore (``MASTER_ADDR`` / ``MASTER_PORT``, or the default
  process group's store), on a client connection of this process's own, under a namespace of
  the torchrun run, restart and session. Ranks meet there at ``init`` only (labels, the run's
  directory, where each helper listens): no store operation per step, so the job's store
  serves no one's metrics. It counts its operations (``ops``).
- :class:`Conn`: one socket carrying *frames* (a 4-byte length, then a pickled list of
  messages, :mod:`forge_obs.wire.messages`), in order. Sends block (a peer that does not read
  holds its sender back, which a rank's bounded queue then counts); reads never block and take
  whatever whole frames arrived. ``drained_at``: the last time every byte the peer had sent was
  read (what the merge tree's horizon is made of).
- A rank reaches its node's helper on a Unix socket in a directory only its user can enter (a
  peer of another user is refused); a helper reaches its parent over TCP, its first message the
  session's token (a peer without it is refused). The training process group is never used.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import os
import pickle
import select
import socket
import struct
import tempfile
import time
import uuid
from typing import Any

__all__ = ["StoreClient", "Conn", "store_endpoint", "job_namespace", "node_id", "listen_unix", "connect_unix",
           "listen_tcp", "connect_tcp", "accept", "reachable_host", "peer_is_us"]

logger = logging.getLogger("forge_obs")

_LEN = struct.Struct("!I")
_MAX_FRAME = (1 << 32) - 1
#: how much one ``read`` takes from a socket at most (the others' turn comes after)
READ_BUDGET = 8 << 20


def store_endpoint() -> tuple[str, int]:
    """(host, port) of the job's TCPStore: ``MASTER_ADDR`` / ``MASTER_PORT`` (torchrun, Slurm with
    ``env://``), else the store of the initialized default process group. Raises ValueError
    saying what to set when there is none."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and port.isdigit():
        return host, int(port)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            store: Any = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            if hasattr(store, "host") and hasattr(store, "port"):
                return str(store.host), int(store.port)
    except Exception:  # noqa: BLE001 - reported below
        pass
    raise ValueError("forge_obs.spmd: no TCPStore for the ranks to meet on: run under torchrun, or set MASTER_ADDR and "
                     "MASTER_PORT (as torch.distributed's env:// does), or init the default process group with a TCPStore")


def job_namespace(session: int) -> str:
    """The store keys of one ``spmd.init`` session of this job (every rank computes the same one):
    torchrun's run id (or Slurm's job id) and restart count, and the session's number in the process."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "job"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return f"forge_obs/{run}/{restart}/{session}"


def node_id() -> str:
    """This process's node: ``FORGE_OBS_SPMD_NODE`` if set, else torchrun's ``GROUP_RANK`` or
    Slurm's ``SLURM_NODEID`` (with the host name), else the host name."""
    explicit = os.environ.get("FORGE_OBS_SPMD_NODE")
    if explicit:
        return explicit
    host = socket.gethostname()
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var):
            return f"{host}/{os.environ[var]}"
    return host


class StoreClient:
    """This process's own client connection to the job's TCPStore, under ``namespace``."""

    def __init__(self, host: str, port: int, namespace: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.timeout_s = float(timeout_s)
        self.ops = 0
        self._client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout_s),
                                     wait_for_workers=False)
        self._store = dist.PrefixStore(namespace, self._client)

    def set(self, key: str, value: bytes) -> None:
        self.ops += 1
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it at most the client's timeout (then raises)."""
        self.ops += 1
        return bytes(self._store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in one round trip (each waited for, as :meth:`get`)."""
        self.ops += 1
        self._store.wait(keys)
        return [bytes(v) for v in self._store.multi_get(keys)]

    def add(self, key: str, n: int) -> int:
        self.ops += 1
        return int(self._store.add(key, n))

    def close(self) -> None:
        self._store = None
        self._client = None


class Conn:
    """One framed socket (see the module docstring). ``send`` blocks; ``read`` never does."""

    def __init__(self, sock: socket.socket, name: Any = None) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.name = name
        self._buf = bytearray(1 << 16)
        self._end = 0
        self.closed = False
        self.drained_at = time.time()  # every byte sent before this was read
        self.read_at = self.drained_at  # the last time a whole message arrived
        self.bad_frames = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msgs: list) -> None:
        """``msgs`` as one frame (raises OSError once the peer is gone)."""
        data = pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > _MAX_FRAME:
            raise ValueError(f"a frame of {len(data)} bytes is too large")
        self.sock.sendall(_LEN.pack(len(data)) + data)

    def wait_readable(self, timeout_s: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout_s)[0])

    def read(self) -> "list | None":
        """Every message of the whole frames that arrived (``[]`` if none); None once the peer
        closed and every whole frame before that was returned. A frame that does not unpickle
        is counted (``bad_frames``) and skipped."""
        if self.closed:
            return None
        taken, eof, drained = 0, False, None
        while taken < READ_BUDGET:
            if self._end == len(self._buf):
                self._buf.extend(bytes(len(self._buf)))
            t = time.time()
            try:
                n = self.sock.recv_into(memoryview(self._buf)[self._end:], 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                drained = t
                break
            except OSError:
                eof = True
                break
            if n == 0:
                eof = True
                break
            self._end += n
            taken += n
        msgs = self._frames()
        if drained is not None and self._end == 0:
            self.drained_at = drained
        if msgs:
            self.read_at = time.time()
        if eof:
            self.closed = True
            if msgs:
                return msgs
            return None
        return msgs

    def idle(self, t: float) -> None:
        """Nothing was readable at ``t`` (a poll said so): every byte sent before it was read,
        unless a frame is still half here."""
        if self._end == 0:
            self.drained_at = t

    def _frames(self) -> list:
        out: list = []
        buf, pos, end = self._buf, 0, self._end
        view = memoryview(buf)
        while end - pos >= 4:
            (n,) = _LEN.unpack_from(buf, pos)
            if end - pos - 4 < n:
                break
            try:
                out.extend(pickle.loads(view[pos + 4:pos + 4 + n]))
            except Exception as e:  # noqa: BLE001 - one frame costs itself only
                self.bad_frames += 1
                logger.error("forge_obs.spmd: a frame from %s could not be read: %r", self.name, e)
            pos += 4 + n
        view.release()
        if pos:
            buf[:end - pos] = buf[pos:end]
            self._end = end - pos
        return out

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def _socket_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), f"forge_obs-spmd-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return d


def listen_unix() -> tuple[socket.socket, str]:
    """A listening Unix socket in a directory only this user can enter; (socket, path)."""
    path = os.path.join(_socket_dir(), f"{uuid.uuid4().hex[:16]}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1024)
    return s, path


def connect_unix(path: str, timeout_s: float) -> Conn:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    s.connect(path)
    return Conn(s, path)


def reachable_host() -> str:
    """The address of this host that the job's store host reaches it at (the interface a packet
    to ``MASTER_ADDR`` leaves by; loopback when the job runs on one host)."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(os.environ.get("MASTER_PORT") or 29500)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def listen_tcp(host: str) -> tuple[socket.socket, tuple[str, int]]:
    """A listening TCP socket on ``host`` (an address of this host), port chosen by the system."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen(1024)
    return s, s.getsockname()[:2]


def connect_tcp(address: tuple[str, int], token: bytes, timeout_s: float) -> Conn:
    """A connection to a helper's TCP socket; the session's ``token`` goes first."""
    s = socket.create_connection(tuple(address), timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c = Conn(s, tuple(address))
    c.send([token])
    return c


def accept(listener: socket.socket, token: "bytes | None", timeout_s: float) -> "tuple[Conn | None, list]":
    """The next connection on ``listener`` and the messages that came with its first read, or
    (None, []) if it is refused: over Unix, a peer of another user; over TCP, a peer whose first
    message is not ``token`` (within ``timeout_s``)."""
    s, _addr = listener.accept()
    if s.family == socket.AF_UNIX:
        if not peer_is_us(s):
            s.close()
            return None, []
        return Conn(s), []
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c = Conn(s)
    deadline = time.monotonic() + timeout_s
    got: "list | None" = []
    while got == [] and time.monotonic() < deadline:
        c.wait_readable(max(0.0, deadline - time.monotonic()))
        got = c.read()
    if not got or not isinstance(got[0], bytes) or token is None or not hmac.compare_digest(got[0], token):
        c.close()
        return None, []
    return c, got[1:]


def peer_is_us(sock: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this process's user (``SO_PEERCRED``)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid == os.getuid()
    except OSError:
        return False
