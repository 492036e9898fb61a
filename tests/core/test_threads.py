"""Every background thread forge_obs starts has an owner that stops it."""

import threading

from monarch.actor import Channel

from forge_obs.controller.inbox import InboxDrain
from forge_obs.controller.state import CONTROLLER
from forge_obs.recording.tracer import _GpuTimings
from tests.support.helpers import start_logger


def _obs_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("forge_obs-") and t.is_alive()}


def test_the_inbox_drain_takes_what_was_sent_before_stop_then_ends(monkeypatch):
    taken = []
    port, receiver = Channel.open()
    drain = InboxDrain(port, receiver, taken.append).start()
    assert drain.alive
    for i in range(3):
        port.send(("ack", i))
    assert drain.stop(timeout_s=10)
    assert not drain.alive
    assert taken == [("ack", 0), ("ack", 1), ("ack", 2)]
    assert drain.stop()  # idempotent


def test_the_gpu_timer_poller_stops():
    timings = _GpuTimings()
    timings._start_poller()  # the thread a first GPU timing starts (it waits for pending timings)
    assert timings._thread.is_alive()
    assert timings.stop(timeout_s=10)
    assert not timings._thread.is_alive()


async def test_after_shutdown_only_the_inbox_threads_are_left_and_they_have_owners(tmp_path):
    """The inbox's port drain (its actor's) and its socket's reader (closed at exit, or by
    ``close``) outlive a session; nothing else does."""
    mlogger = await start_logger(tmp_path, {"console": {}, "alerts": {"sinks": ["file"]}})
    await mlogger.flush.call_one(0)
    assert "forge_obs-backends" in _obs_threads()
    await mlogger.shutdown.call_one()
    left = _obs_threads()
    assert left <= {"forge_obs-inbox", "forge_obs-inbox-socket"}, left
    assert CONTROLLER.local is None or CONTROLLER.local.alive


def test_the_inbox_socket_reader_takes_what_was_sent_before_close_then_ends():
    from forge_obs.controller.local_socket import LocalInbox, LocalSender

    taken = []
    inbox = LocalInbox.start(taken.append)
    sender = LocalSender.connect(inbox.address)
    for i in range(3):
        assert sender.send(("ack", i))
    assert inbox.close(timeout_s=10) and not inbox.alive
    assert taken == [("ack", 0), ("ack", 1), ("ack", 2)]
    assert inbox.close()  # idempotent
