"""The inbox socket (forge_obs.controller.local_socket): fetchers on the controller's host answer on a Unix
socket instead of the inbox's Monarch port. Its guarantees: each sender's order, whole frames
only, this user only, and a sender that loses it answers on the port with nothing lost."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading

import pytest

from forge_obs.controller.local_socket import LocalInbox, LocalSender, same_host
from tests.support.helpers import run_as_user

USER_SCRIPT = '''
"""A user's loop on two unnamed meshes of 2 procs; with KILL_AT the controller's inbox socket
goes away before that step (the fetchers then answer on the port)."""
import asyncio, json, sys

import provisioner_hooks
from monarch.actor import Actor, current_rank, endpoint, this_host

from forge_obs import Reduce, get_or_create_metric_logger, record_metric


class Worker(Actor):
    @endpoint
    async def work(self, step: int) -> None:
        r = current_rank().rank
        record_metric("work/sum", (r + 1) * (step + 1), Reduce.SUM)
        record_metric("work/calls", 1, Reduce.SUM)
        for i in range(300 if step % 2 else 0):  # odd steps: large cuts (states follow the ack)
            record_metric(f"work/k{i}", float(i), Reduce.MEAN)

    @endpoint
    async def threads(self) -> list:
        import threading
        return sorted(t.name for t in threading.enumerate())


async def main(root: str, kill_at: int) -> None:
    from forge_obs.controller.state import CONTROLLER
    from forge_obs.controller.registry import LOCAL_MESHES

    provisioner_hooks.install()
    mlogger = await get_or_create_metric_logger(process_name="Controller")
    info = await mlogger.init_backends.call_one({"jsonl": {}, "run": {"root": root, "id": "sock"}})
    meshes = [this_host().spawn_procs(per_host={"procs": 2}) for _ in range(2)]
    workers = [m.spawn("worker", Worker) for m in meshes]
    on_socket, routes = [], []  # messages taken on the socket so far; how the last cut went
    for step in range(6):
        if step == kill_at:
            CONTROLLER.local.close()  # the fault: the socket is gone, the port is not
        await asyncio.gather(*(w.work.call(step) for w in workers))
        await mlogger.flush.call_one(step)
        on_socket.append(CONTROLLER.local.messages if CONTROLLER.local else None)
        routes.append(sorted({e.route for e in LOCAL_MESHES.entries()}))
    threads = sorted({n for w in workers for _, names in (await w.threads.call()).items() for n in names})
    await mlogger.shutdown.call_one()
    for m in meshes:
        await m.stop()
    print(json.dumps({"run_dir": info["run_dir"], "on_socket": on_socket, "routes": routes, "threads": threads}), flush=True)


asyncio.run(main(sys.argv[1], int(sys.argv[2])))
'''


def _until(cond, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def _serve():
    got: list = []
    lock = threading.Lock()

    def take(msg):
        with lock:
            got.append(msg)
    return LocalInbox.start(take), got


def _drive_cpu_clock(monkeypatch, thread_time):
    """The socket module's CPU charges read ``thread_time``, the test's clock, instead of the thread's."""
    import types

    from forge_obs.controller import local_socket

    monkeypatch.setattr(local_socket, "time", types.SimpleNamespace(thread_time=thread_time))


def test_each_senders_order_holds_with_frames_split_and_joined():
    """3 senders on threads, 300 messages each, every 50th one 1 MB (split across reads), the
    others a few bytes (joined in one read): every message taken once, each sender's in order."""
    inbox, got = _serve()
    big = b"x" * (1 << 20)

    def send(i):
        s = LocalSender.connect(inbox.address)
        for n in range(300):
            assert s.send(("ack", i, n, big if n % 50 == 0 else b""))
        s.close()
    ts = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert inbox.close(timeout_s=10.0)
    for i in range(3):
        mine = [m for m in got if m[1] == i]
        assert [m[2] for m in mine] == list(range(300))
        assert all(len(m[3]) == (1 << 20 if m[2] % 50 == 0 else 0) for m in mine)
    assert inbox.messages == 900


def test_a_read_allocates_about_what_it_read_not_a_buffer_each_time():
    """Both ends read into a buffer they keep: 200 small messages each way, taken one at a time,
    allocate a few dozen KiB in all (a ``recv`` of 1 MiB on the controller's side, or of 64 KiB
    on a sender's reader, allocated that much at every read: a peak of 1.1 MB, or of 70 KB)."""
    import tracemalloc

    cv = threading.Condition()
    got = {"inbox": 0, "sender": 0}

    def counter(side):
        def take(_msg):
            with cv:
                got[side] += 1
                cv.notify_all()
        return take

    def taken(n):
        with cv:
            assert cv.wait_for(lambda: got["inbox"] == n and got["sender"] == n, timeout=10.0), got

    inbox = LocalInbox.start(counter("inbox"))
    sender = LocalSender.connect(inbox.address, name=("m", 0), on_message=counter("sender"))
    assert sender.send(("ack", -1))  # taken after the sender's name: it takes messages from now on
    with cv:
        assert cv.wait_for(lambda: got["inbox"] == 1, timeout=10.0)
    assert inbox.send_to(("m", 0), ("cut", -1))
    taken(1)
    tracemalloc.start()
    try:
        for i in range(200):
            assert sender.send(("ack", i, b"x" * 300)) and inbox.send_to(("m", 0), ("cut", i, b"y" * 100))
            taken(i + 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        sender.close()
        inbox.close()
    assert peak < 48 * 1024, peak


def test_a_read_is_charged_before_its_messages_are_taken(monkeypatch):
    """The inbox thread's CPU for reading a message is handed to ``account`` before the message
    is taken, so a step assembled once that message closed its cut counts it (it was charged
    after the take, and a step could be assembled in between: obs/cpu_inbox_s 0 at step 0)."""
    clock = [0.0]  # the reader thread's CPU clock, advanced by the test
    _drive_cpu_clock(monkeypatch, lambda: clock[0])
    cv = threading.Condition()
    events: list = []

    def record(kind):
        def cb(x):
            with cv:
                events.append((kind, x))
                cv.notify_all()
        return cb

    def wait_for(pred):
        with cv:
            assert cv.wait_for(lambda: pred(events), timeout=10.0), events

    inbox = LocalInbox.start(record("take"), account=record("charge"))
    sender = LocalSender.connect(inbox.address)
    try:
        assert sender.send(("ack", 1))
        # its take, then the charge that ends that pass of the reader: nothing is left uncharged
        wait_for(lambda ev: ("take", ("ack", 1)) in ev and ev[-1][0] == "charge")
        clock[0] += 1.0  # the next read's CPU
        assert sender.send(("ack", 2))
        wait_for(lambda ev: ("take", ("ack", 2)) in ev)
        with cv:
            before = events[:events.index(("take", ("ack", 2)))]
        assert sum(x for kind, x in before if kind == "charge") == 1.0, events
    finally:
        sender.close()
        inbox.close()


def test_a_senders_reader_thread_charges_a_read_before_handing_its_messages_over(monkeypatch):
    """A sender read by a thread of its own (connected off its actor's loop) charges a read
    before the message goes to the loop, as a loop's reader does: the cut it starts counts it
    (it was charged after, so the cut's export could run first)."""
    import time

    clock = [0.0]  # the reader thread's CPU clock, advanced by the test
    _drive_cpu_clock(monkeypatch, lambda: clock[0])
    cv = threading.Condition()
    charged: list = []
    taken: list = []  # (message, what was charged when it was handed over)

    def account(x):
        with cv:
            charged.append(x)
            cv.notify_all()

    def on_message(msg):
        with cv:
            taken.append((msg, sum(charged)))
            cv.notify_all()

    def wait_for(pred):
        with cv:
            assert cv.wait_for(pred, timeout=10.0), (charged, taken)

    inbox, _got = _serve()
    sender = LocalSender.connect(inbox.address, name=("m", 0), on_message=on_message, account=account)
    try:
        assert sender._reader is not None
        deadline = time.monotonic() + 10.0
        while not inbox.named([("m", 0)]):  # its name frame is read by the inbox's thread
            assert time.monotonic() < deadline
            threading.Event().wait(0.001)
        assert inbox.send_to(("m", 0), ("cut", 0))
        wait_for(lambda: len(taken) == 1 and len(charged) == 1)  # one read, charged, handed over
        clock[0] += 1.0  # the next read's CPU
        assert inbox.send_to(("m", 0), ("cut", 1))
        wait_for(lambda: len(taken) == 2)
        assert taken[1] == (("cut", 1), 1.0), (charged, taken)
    finally:
        sender.close()
        inbox.close()


def test_a_frame_cut_short_is_dropped_and_the_whole_ones_before_it_are_taken():
    inbox, got = _serve()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(inbox.address[1])
    s = LocalSender(sock)
    assert s.send(("ack", 1)) and s.send(("ack", 2))
    sock.sendall(struct.pack("!I", 1000) + b"only part of it")  # the sender died mid-frame
    sock.close()
    assert inbox.close(timeout_s=10.0)
    assert got == [("ack", 1), ("ack", 2)]


def test_a_gone_inbox_makes_send_return_false_never_raise():
    inbox, got = _serve()
    s = LocalSender.connect(inbox.address)
    assert s.send(("ack", 0))
    assert inbox.close(timeout_s=10.0)
    results = [s.send(("ack", n, b"y" * 65536)) for n in range(1, 50)]  # the kernel's buffer fills, then fails
    assert results[-1] is False and s.closed and s.send(("ack", 99)) is False
    assert got[0] == ("ack", 0)
    assert LocalSender.connect(inbox.address) is None  # its file is gone: senders use the port


def test_the_socket_is_this_users_alone_and_of_this_host():
    inbox, _got = _serve()
    try:
        path = inbox.address[1]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert same_host(inbox.address)
        assert not same_host(("another-host", path)) and LocalSender.connect(("another-host", path)) is None
        assert not same_host(None) and LocalSender.connect(None) is None
    finally:
        inbox.close()


def test_a_value_of_a_class_plain_pickle_cannot_take_travels_by_value():
    """A class pickle cannot reach by name (defined in a function, as in a user's script) goes
    as cloudpickle sends it, on the same socket (so the order holds)."""
    class Local:
        def __init__(self, v):
            self.v = v
    inbox, got = _serve()
    s = LocalSender.connect(inbox.address)
    assert s.send(("stream", 1)) and s.send(("stream", Local(7))) and s.send(("stream", 3))
    s.close()
    assert inbox.close(timeout_s=10.0)
    assert [m[1] if not hasattr(m[1], "v") else ("Local", m[1].v) for m in got] == [1, ("Local", 7), 3]


def _steps(run_dir: str) -> dict[int, dict]:
    """step -> global metrics of the run the script printed (``global_rows`` of its directory)."""
    from pathlib import Path

    from tests.support.helpers import global_rows

    d = Path(run_dir)
    return {step: row["metrics"] for step, row in global_rows(d.parent, d.name).items()}


@pytest.mark.parametrize("kill_at", [-1, 3])
def test_a_users_loop_is_exact_on_the_socket_and_after_it_goes(tmp_path, kill_at):
    """Two unnamed meshes of 2 procs, 6 steps, small and large cuts. Every step has its values
    (work/sum = 2 meshes x (1 + 2) x (step + 1), work/calls = 4), whether the ranks answer on the
    socket throughout or lose it before step 3 and answer on the port from then on."""
    import json

    script = tmp_path / "loop.py"
    script.write_text(USER_SCRIPT)
    # the direct route (through group leaders, the answers and cuts go through Monarch anyway)
    out = run_as_user(script, tmp_path, str(tmp_path / "runs"), str(kill_at), env={"FORGE_OBS_AGGREGATE": "off"}).stdout
    res = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    steps = _steps(res["run_dir"])
    assert sorted(steps) == list(range(6))
    for step, m in steps.items():
        assert m["work/sum"] == 2 * 3 * (step + 1) and m["work/calls"] == 4, (step, m)
        assert (m.get("work/k299") == 299.0) == (step % 2 == 1), (step, sorted(m)[:5])
    on, routes = res["on_socket"], res["routes"]
    if kill_at < 0:  # every rank's ack (and a large cut's states) came on the socket, and the cuts went there
        assert all(b - a >= 4 for a, b in zip([0] + on, on)), on
        assert routes[1:] == [["socket"]] * 5, routes
        # each rank's actor loop reads its cuts off the socket itself: no reader thread of its own
        assert "forge_obs-local-cuts" not in res["threads"], res["threads"]
    else:  # before the fault on the socket; after it, nothing more there (the port took over)
        assert on[kill_at - 1] >= 4 * kill_at and len(set(on[kill_at:])) == 1, on
        assert routes[kill_at - 1] == ["socket"] and routes[kill_at:] == [["monarch"]] * (6 - kill_at), routes


def test_with_the_switch_off_every_rank_answers_on_the_port(tmp_path):
    import json

    script = tmp_path / "loop.py"
    script.write_text(USER_SCRIPT.replace("CONTROLLER.local.close()", "pass"))
    out = run_as_user(script, tmp_path, str(tmp_path / "runs"), "-1", env={"FORGE_OBS_LOCAL_SOCKET": "0", "FORGE_OBS_AGGREGATE": "off"}).stdout
    res = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert res["on_socket"] == [None] * 6 and res["routes"] == [["monarch"]] * 6
    steps = _steps(res["run_dir"])
    assert [steps[s]["work/sum"] for s in range(6)] == [6 * (s + 1) for s in range(6)]


class _Local:
    def __init__(self, named):
        self.peers = set(named)

    def named(self, keys):
        return all(k in self.peers for k in keys)


class _Pipeline:
    def __init__(self, lagging=()):
        self.lagging = set(lagging)


class _Cut:
    def __init__(self, closed):
        self.closed = closed


def test_a_mesh_moves_to_the_socket_only_with_no_cut_in_flight_and_back_at_once(monkeypatch):
    """The cut's route per mesh: a cut on the socket never overtakes an earlier cast to the same
    ranks (a rank moves only once the mesh's last cut closed and it does not lag); losing a
    rank's connection, or a plan (the aggregated route), moves it back to Monarch at once. While
    the mesh starts, its connected ranks take their cuts on the socket ("split"): a cast is held
    back until every rank spawned its fetcher."""
    from forge_obs.controller.flush import cut_route
    from forge_obs.controller.registry import MeshEntry
    from forge_obs.controller.state import CONTROLLER

    e = MeshEntry("m", "gen", 2, None)
    both = [("m", 0), ("m", 1)]
    monkeypatch.setattr(CONTROLLER, "local", _Local([]))
    assert cut_route(e, None, _Pipeline()) == "monarch"  # no rank connected yet
    monkeypatch.setattr(CONTROLLER, "local", _Local(both[:1]))
    assert cut_route(e, None, _Pipeline()) == "split" and e.socket_ranks == {0}  # rank 1 not connected yet
    e.last_cut = _Cut(closed=False)
    assert cut_route(e, None, _Pipeline()) == "split" and e.socket_ranks == {0}
    monkeypatch.setattr(CONTROLLER, "local", _Local(both))
    assert cut_route(e, None, _Pipeline()) == "split" and e.socket_ranks == {0}  # rank 1: a cast in flight
    e.last_cut = _Cut(closed=True)
    assert cut_route(e, None, _Pipeline(lagging=[("m", 1)])) == "split"  # rank 1 may still hold a cast
    assert cut_route(e, None, _Pipeline()) == "socket" and e.socket_ranks == {0, 1}
    e.last_cut = _Cut(closed=False)
    assert cut_route(e, None, _Pipeline(lagging=[("m", 1)])) == "socket"  # stays: one channel per rank
    assert cut_route(e, {"groups": {}}, _Pipeline()) == "monarch"  # a plan: through the leaders
    e.socket_ranks = frozenset({0, 1})  # on the socket
    monkeypatch.setattr(CONTROLLER, "local", _Local(both[1:]))
    assert cut_route(e, None, _Pipeline()) == "monarch"  # rank 0's connection is gone
    e.last_cut = _Cut(closed=True)
    assert cut_route(e, None, _Pipeline(lagging=[("m", 1)])) == "monarch"  # rank 1 lags: by cast too
    monkeypatch.setattr(CONTROLLER, "local", None)
    e.socket_ranks = frozenset({0, 1})  # on the socket
    assert cut_route(e, None, _Pipeline()) == "monarch"  # no socket in this process


def test_a_message_to_a_sender_that_went_away_is_refused_never_raised():
    """What a cut on the socket meets when its rank stopped (its connection closed): send_to
    says False, and the sender is forgotten; through Monarch the same message would fail the
    controller's actor that sent it."""
    inbox, _got = _serve()
    taken: list = []
    s = LocalSender.connect(inbox.address, name=("m", 0), on_message=taken.append)
    try:
        _until(lambda: inbox.named([("m", 0)]))  # its name came (a flush checks this first)
        assert inbox.send_to(("m", 0), ("cut", 1, 0, "A", 0))
        _until(lambda: taken)
        s.close()
        results = [inbox.send_to(("m", 0), ("cut", n, 0, "A", 0)) for n in range(2, 200)]
        assert results[-1] is False
        _until(lambda: ("m", 0) not in inbox.peers)
        assert taken == [("cut", 1, 0, "A", 0)]
        assert inbox.send_to(("m", 1), ("cut", 1, 0, "A", 0)) is False  # never connected
        assert inbox.send_each([("m", 0), ("m", 1)], ("cut", 300, 0, "A", 0)) == [("m", 0), ("m", 1)]
    finally:
        inbox.close()


def test_a_sender_read_by_its_event_loop_takes_every_message_in_order_on_that_loop(monkeypatch):
    """Connected from a running event loop, the loop reads the socket itself (no reader thread):
    every message the inbox sends comes in order, on the loop's thread, and each read is charged
    its own CPU, never its handler's; when the inbox goes, the loop stops reading; a close from
    another thread releases the socket through the loop."""
    import asyncio

    # each thread's CPU clock ticks 1 at each reading, and the handler adds 1000: a read is
    # charged exactly 1 (its start and its end), whatever else the machine does meanwhile
    ticks = threading.local()

    def thread_time():
        ticks.now = getattr(ticks, "now", 0) + 1
        return ticks.now

    _drive_cpu_clock(monkeypatch, thread_time)

    async def main():
        inbox, _got = _serve()
        loop = asyncio.get_running_loop()
        taken, spent, where = [], [], set()

        def on_message(msg):
            where.add(threading.current_thread() is threading.main_thread())
            taken.append(msg)
            if msg[1] == 0:  # a handler's own CPU (a cut's export) is the handler's, not the read's
                ticks.now += 1000

        s = LocalSender.connect(inbox.address, name=("m", 0), on_message=on_message, account=spent.append, loop=loop)
        assert s._reader is None and s._loop is loop
        while not inbox.named([("m", 0)]):
            await asyncio.sleep(0.001)
        def send_all():  # from another thread, as the controller's process sends
            return [inbox.send_to(("m", 0), ("cut", n, n, "A", 0, b"z" * (4096 if n % 7 else 200_000)))
                    for n in range(300)]

        assert all(await asyncio.to_thread(send_all))
        while len(taken) < 300:
            await asyncio.sleep(0.001)
        assert [m[1] for m in taken] == list(range(300)) and where == {True}
        assert spent and set(spent) == {1}, spent
        inbox.close()
        while s._loop is not None:  # the end of the stream: it stops reading
            await asyncio.sleep(0.001)
        assert not s.send(("ack", 1))  # the inbox is gone: refused, the fetcher uses the port
        # a second sender, closed from another thread while its loop reads it
        inbox2, _ = _serve()
        s2 = LocalSender.connect(inbox2.address, name=("m", 1), on_message=taken.append, loop=loop)
        fd = s2._sock.fileno()
        await asyncio.to_thread(s2.close)
        while s2._loop is not None:
            await asyncio.sleep(0.001)
        assert s2._sock.fileno() == -1 and fd not in loop._selector.get_map()
        inbox2.close()

    asyncio.run(main())


def test_a_senders_reader_accounts_its_cpu():
    """A rank's reader of the inbox socket counts its CPU (the fetcher adds it to ``obs/cpu_inbox_s``)."""
    inbox, _got = _serve()
    taken: list = []
    spent: list = []
    s = LocalSender.connect(inbox.address, name=("m", 0), on_message=taken.append, account=spent.append)
    try:
        _until(lambda: inbox.named([("m", 0)]))
        for n in range(200):
            assert inbox.send_to(("m", 0), ("cut", n, n, "A", 0, b"z" * 4096))
        _until(lambda: len(taken) == 200)
        assert [m[1] for m in taken] == list(range(200))
        _until(lambda: spent and sum(spent) > 0)
        assert all(x >= 0 for x in spent)
    finally:
        s.close()
        inbox.close()


def test_closing_while_a_sender_sends_takes_every_message_it_sent_and_refuses_the_rest():
    """Every message is either taken (its send returned True) or refused (False: the sender then
    sends it on the port), never lost in between, whenever the inbox closes."""
    for trial in range(5):
        inbox, got = _serve()
        s = LocalSender.connect(inbox.address)
        ok: list = []
        closed = threading.Event()

        def send_all():
            for n in range(20000):
                if not s.send(("ack", n, b"p" * 512)):
                    break
                ok.append(n)
                if n == 300 * (trial + 1):
                    closed.set()
        t = threading.Thread(target=send_all)
        t.start()
        closed.wait(10)
        assert inbox.close(timeout_s=10.0)
        t.join(30)
        assert [m[1] for m in got] == ok, (trial, len(got), len(ok))
        assert len(ok) < 20000  # the close came before the last message


def _python_for_everyone() -> str | None:
    """A Python interpreter another user may run (the test's own may sit in root's home)."""
    import shutil

    for p in ("/usr/bin/python3", shutil.which("python3")):
        if p and os.access(p, os.X_OK) and os.stat(os.path.realpath(p)).st_mode & 0o001:
            return p
    return None


@pytest.mark.skipif(os.getuid() != 0 or _python_for_everyone() is None,
                    reason="needs root and a Python any user may run, to run a peer as another user")
def test_a_process_of_another_user_cannot_send_to_the_inbox(tmp_path):
    """The socket's directory is this user's alone: another user's process cannot connect (and a
    peer that did would be refused by its credentials); nothing it tries is taken."""
    import subprocess

    inbox, got = _serve()
    try:
        code = ("import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('refused', type(e).__name__); sys.exit(0)\n"
                "s.sendall(b'\\x00\\x00\\x00\\x05hello')\nprint('connected')\n")
        res = subprocess.run([_python_for_everyone(), "-c", code, inbox.address[1]], capture_output=True, text=True,
                             timeout=60, preexec_fn=lambda: os.setuid(65534), cwd="/")
        assert res.stdout.startswith("refused PermissionError"), res.stdout + res.stderr
    finally:
        assert inbox.close(timeout_s=10.0)
    assert got == [] and inbox.messages == 0
