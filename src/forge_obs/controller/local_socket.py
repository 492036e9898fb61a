"""A same-host channel for the inbox's messages: a Unix socket, framed pickles, one ordered stream
per sender, read by one thread that hands each message to a callback.

    >>> got = []
    >>> server = LocalInbox.start(got.append)
    >>> sender = LocalSender.connect(server.address)
    >>> sender.send(("ack", 1, ("mesh", 0))) and sender.send(("states", 1, ("mesh", 0), None, b"x"))
    True
    >>> sender.close(); server.close(timeout_s=5.0)
    True
    >>> got
    [('ack', 1, ('mesh', 0)), ('states', 1, ('mesh', 0), None, b'x')]

A fetcher on the controller's host answers here instead of on the inbox's Monarch port: a message
then costs a ``sendall`` on the rank and a read on the controller, and no actor message. What it
guarantees:

- **Order.** One connection per sender, so each sender's messages are taken in the order it sent
  them, as on a Monarch port.
- **Same user only.** The socket lives in a directory only this user can enter (mode 0700), and
  the reader drops a connection whose peer runs as another user (``SO_PEERCRED``).
- **Nothing is taken twice or half.** A message is handed over once its whole frame is read;
  a connection that ends inside a frame drops that frame (its sender saw its ``sendall`` fail
  and sends it again on the port).
- **A gone controller never fails the sender.** :meth:`LocalSender.send` returns False (and
  closes) once the socket fails; the fetcher then answers on the port, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import selectors
import socket
import struct
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import cloudpickle

from forge_obs.wire.messages import NAME, SocketName, kind_of, view, wire

__all__ = ["LocalInbox", "LocalSender", "same_host", "running_loop"]

logger = logging.getLogger("forge_obs")

_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 31  # a frame's length field: 4 bytes
#: bytes the inbox's thread reads at once, into one buffer it reuses (a ``recv`` of this size
#: would allocate, and unmap, that much at every read)
_READ_BYTES = 1 << 20
#: the same for a sender's reader (the cuts it takes are small)
_SENDER_READ_BYTES = 1 << 16
#: how long a message to a sender may wait for room in its socket (it is not reading: its
#: connection is closed, and the caller sends that message another way)
SEND_TIMEOUT_S = 1.0


def _frame(msg: Any) -> bytes:
    """``msg`` as one frame: its length, then its pickle (plain pickle, else cloudpickle, as a
    Monarch port pickles: classes of the user's script travel by value). Raises if it cannot be
    pickled at all."""
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - e.g. a class defined in the user's script
        data = cloudpickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) >= _MAX_FRAME:
        raise ValueError(f"a message of {len(data)} bytes is too large for the inbox socket")
    return _LEN.pack(len(data)) + data


def _take_frames(buf: bytearray, take: Callable[[Any], None]) -> None:
    """Hand every whole frame at the start of ``buf`` to ``take`` (and remove it). A frame that
    does not unpickle, or that ``take`` raises on, is logged and skipped: it never stops the reader."""
    pos, n = 0, len(buf)
    while n - pos >= 4:
        size = _LEN.unpack_from(buf, pos)[0]
        if n - pos - 4 < size:
            break
        frame = buf[pos + 4:pos + 4 + size]  # one copy: pickle reads a bytearray as it is
        pos += 4 + size
        try:
            take(pickle.loads(frame))
        except Exception:  # noqa: BLE001
            logger.exception("forge_obs: could not take a message of the inbox socket")
    if pos:
        del buf[:pos]


def _host() -> str:
    return socket.gethostname()


def same_host(address: Any) -> bool:
    """Whether ``address`` (a :attr:`LocalInbox.address`) is a socket of this host that exists."""
    try:
        host, path = address
        return host == _host() and os.path.exists(path)
    except Exception:  # noqa: BLE001 - not an address
        return False


def _socket_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), f"forge_obs-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not this user's alone")
    return d


class _Conn:
    __slots__ = ("sock", "buf", "name", "lock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.name: Any = None
        self.lock = threading.Lock()


class LocalInbox:
    """Listens on a Unix socket of this host; one thread accepts senders and reads their frames,
    handing every message to ``take`` in each sender's order. ``address``: ``(host, path)``, what
    :meth:`LocalSender.connect` takes. ``account(cpu_s)``: the thread's CPU after each message.
    A sender that connected with a ``name`` also takes messages: :meth:`send_to`."""

    def __init__(self, take: Callable[[Any], None], account: Callable[[float], None] | None = None) -> None:
        self._take = take
        self._account = account
        path = os.path.join(_socket_dir(), f"inbox-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        os.chmod(path, 0o600)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.address = (_host(), path)
        self.messages = 0  # taken so far
        self.peers: dict[Any, _Conn] = {}  # named senders (see send_to)
        self.dropped_peers = 0  # connections refused: another user
        self._rbuf = memoryview(bytearray(_READ_BYTES))  # used by the reading thread only
        self._cpu = 0.0  # that thread's CPU at its last charge (set when it starts)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="forge_obs-inbox-socket", daemon=True)

    @classmethod
    def start(cls, take: Callable[[Any], None], account: Callable[[float], None] | None = None) -> "LocalInbox":
        inbox = cls(take, account)
        inbox._thread.start()
        return inbox

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop listening; the messages already read are taken first. True if the thread ended."""
        self._closing = True
        try:
            os.unlink(self.address[1])
        except OSError:
            pass
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        self._cpu = time.thread_time()
        try:
            while not self._closing:
                for key, _ev in self._sel.select():
                    if key.data is None:
                        self._accept()
                    elif key.data != "wake":
                        self._read(key.data)
                self._charge()
            self._drain()
        except Exception:  # noqa: BLE001 - senders fall back to the port
            logger.exception("forge_obs: the inbox socket stopped")
        finally:
            self.peers.clear()
            for key in list(self._sel.get_map().values()):
                try:
                    key.fileobj.close()
                except OSError:
                    pass
            self._sel.close()
            self._wake_w.close()

    def named(self, names: Any) -> bool:
        """Whether every one of ``names`` is connected and takes messages."""
        peers = self.peers
        return all(n in peers for n in names)

    def send_to(self, name: Any, msg: Any) -> bool:
        """Send ``msg`` to the sender named ``name``; False if it is not connected or the message
        could not be sent whole within :data:`SEND_TIMEOUT_S` (its connection is then closed, so
        it never reads half a message)."""
        return self._send_frame(name, _frame(msg))

    def send_each(self, names: Any, msg: Any) -> list:
        """:meth:`send_to` every one of ``names`` (``msg`` pickled once); returns those it missed."""
        frame = _frame(msg)
        return [n for n in names if not self._send_frame(n, frame)]

    def _send_frame(self, name: Any, frame: bytes) -> bool:
        conn = self.peers.get(name)
        if conn is None:
            return False
        with conn.lock:
            try:
                conn.sock.sendall(frame)
                return True
            except OSError as e:  # a timeout too
                logger.debug("forge_obs: inbox socket to %r failed: %r", name, e)
                if self.peers.get(name) is conn:
                    del self.peers[name]
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return False

    def _drain(self) -> None:
        """Closing: from now on a sender's send fails (it answers on the port); every whole
        frame it sent before is taken."""
        conns = [k.data for k in self._sel.get_map().values() if isinstance(k.data, _Conn)]
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for c in conns:
            while self._read(c):
                pass

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if not _peer_is_us(sock):
            self.dropped_peers += 1
            sock.close()
            return
        sock.settimeout(SEND_TIMEOUT_S)  # reads happen when it is readable; sends wait at most this
        self._sel.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _charge(self) -> None:
        """Hand ``account`` this thread's CPU since the last charge."""
        now = time.thread_time()
        if self._account is not None:
            self._account(now - self._cpu)
        self._cpu = now

    def _read(self, conn: _Conn) -> bool:
        """Take what ``conn`` has; False once nothing more is there now (or it closed). The
        read is charged before its messages are taken: a step assembled once they closed its
        cut counts it."""
        try:
            n = conn.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            n = 0
        if not n:  # the sender is gone; a frame it left half-sent is dropped
            self._sel.unregister(conn.sock)
            if conn.name is not None and self.peers.get(conn.name) is conn:
                del self.peers[conn.name]
            conn.sock.close()
            return False
        conn.buf += self._rbuf[:n]
        self._charge()
        _take_frames(conn.buf, lambda msg: self._take_one(conn, msg))
        return True

    def _take_one(self, conn: _Conn, msg: Any) -> None:
        if kind_of(msg) == NAME:  # a sender's first frame when it takes messages too
            conn.name = view(msg).name
            self.peers[conn.name] = conn
            return
        self.messages += 1
        self._take(msg)


def _peer_is_us(sock: socket.socket) -> bool:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid == os.getuid()
    except (AttributeError, OSError):  # no SO_PEERCRED here: the directory's mode still guards it
        return True


class LocalSender:
    """One sender's connection to a :class:`LocalInbox`; :meth:`send` is thread-safe. Connected
    with a ``name``, it also takes what the inbox sends it (see :meth:`connect`)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._loop: Any = None  # the event loop that reads what the inbox sends, if one does
        self.closed = False

    @classmethod
    def connect(cls, address: Any, name: Any = None, on_message: Callable[[Any], None] | None = None,
                account: Callable[[float], None] | None = None, loop: Any = None) -> "LocalSender | None":
        """A connection to ``address`` if it is a socket of this host that accepts; else None.
        With ``name`` and ``on_message``: the inbox may send to ``name``, and each such message is
        handed to ``on_message``, in order (``account(cpu_s)``: the CPU each read took): by
        ``loop``, an event loop running in the calling thread, which then reads the socket
        itself; else by a thread of this sender's."""
        if not same_host(address):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address[1])
        except OSError as e:
            logger.debug("forge_obs: inbox socket %s refused: %r", address[1], e)
            sock.close()
            return None
        sender = cls(sock)
        if name is not None and on_message is not None:
            if loop is not None and running_loop() is loop:
                sender._watch(loop, on_message, account)
            else:
                sender._reader = threading.Thread(target=sender._listen, args=(on_message, account),
                                                  name="forge_obs-local-cuts", daemon=True)
                sender._reader.start()
            if not sender.send(wire(SocketName(NAME, name))):
                return None
        return sender

    def _watch(self, loop: Any, on_message: Callable[[Any], None], account: Callable[[float], None] | None) -> None:
        """Read on ``loop`` (this thread's): each message is handed over in the loop's turn that
        read it, with no thread of its own and no hop between threads."""
        buf = bytearray()
        rbuf = memoryview(bytearray(_SENDER_READ_BYTES))
        sock, fd = self._sock, self._sock.fileno()

        def readable() -> None:
            cpu = time.thread_time()
            try:
                n = sock.recv_into(rbuf, 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                n = 0
            if not n:  # the inbox is gone, or this sender closed: a half frame is dropped
                self._unwatch(fd)
                return
            buf.extend(rbuf[:n])
            msgs: list = []
            _take_frames(buf, msgs.append)
            if account is not None:  # the read alone: what the messages cost, their handler counts
                account(time.thread_time() - cpu)
            _hand_over(msgs, on_message)

        loop.add_reader(fd, readable)
        self._loop = loop

    def _unwatch(self, fd: int) -> None:
        """On the loop's thread: stop reading, and release the socket if it was closed meanwhile."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.remove_reader(fd)
        with self._lock:
            if self.closed:
                self._sock.close()

    def _listen(self, on_message: Callable[[Any], None], account: Callable[[float], None] | None) -> None:
        """Read on a thread of this sender's; each read is charged before its messages are handed
        over (as on a loop: the cut a message starts counts it)."""
        buf = bytearray()
        rbuf = memoryview(bytearray(_SENDER_READ_BYTES))
        cpu = time.thread_time()
        while True:
            try:
                n = self._sock.recv_into(rbuf)
            except OSError:
                n = 0
            if not n:  # the inbox is gone (or this sender closed): a half frame is dropped
                return
            buf += rbuf[:n]
            msgs: list = []
            _take_frames(buf, msgs.append)
            if account is not None:
                now = time.thread_time()
                account(now - cpu)
                cpu = now
            _hand_over(msgs, on_message)

    def send(self, msg: Any) -> bool:
        """Send ``msg`` whole; False (and closed from then on) if it could not be: the caller
        sends it, and everything after it, another way. Raises if ``msg`` cannot be pickled at
        all (nothing was sent)."""
        frame = _frame(msg)
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(frame)
                return True
            except OSError as e:
                logger.debug("forge_obs: inbox socket failed: %r; answering on the port", e)
                self._close_locked()
                return False

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # ends this sender's reader, if any
            except OSError:
                pass
            loop = self._loop
            if loop is not None:
                if running_loop() is loop:
                    self._loop = None
                    loop.remove_reader(self._sock.fileno())
                elif not loop.is_closed():
                    return  # the loop reads the end of the stream, stops watching, then closes
            try:
                self._sock.close()
            except OSError:
                pass


def _hand_over(msgs: list, on_message: Callable[[Any], None]) -> None:
    """Each of ``msgs`` to ``on_message``, in order; one that raises is logged, never stops the others."""
    for msg in msgs:
        try:
            on_message(msg)
        except Exception:  # noqa: BLE001 - one message never stops the reading
            logger.exception("forge_obs: could not take a message of the inbox socket")


def running_loop() -> Any:
    """The event loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
