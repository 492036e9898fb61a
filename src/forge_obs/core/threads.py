"""Stopping a thread that drains a Monarch port: its owner sends :data:`STOP` on that port.

    >>> import queue, threading
    >>> from forge_obs.core.threads import STOP, stop_port_thread
    >>> q = queue.Queue()
    >>> def drain():
    ...     for msg in iter(q.get, STOP):  # every message sent before STOP is taken
    ...         pass
    >>> t = threading.Thread(target=drain)
    >>> t.start()
    >>> class Port:
    ...     send = q.put
    >>> stop_port_thread(t, Port(), timeout_s=5)
    True

The thread ends once it meets :data:`STOP`, so every message sent to the port before it is still
taken (a port keeps each sender's order).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["STOP", "stop_port_thread"]

logger = logging.getLogger("forge_obs")

#: the message that stops a port-draining thread
STOP = ("stop",)


def stop_port_thread(thread: threading.Thread, port: Any, timeout_s: float) -> bool:
    """Send :data:`STOP` on ``port`` and wait up to ``timeout_s`` for ``thread`` to end; True if
    it ended. A port that is gone has taken its thread's receive with it."""
    if thread.is_alive() and thread is not threading.current_thread():
        try:
            port.send(STOP)
        except Exception as e:  # noqa: BLE001 - the port is gone
            logger.debug("forge_obs: could not stop thread %s: %r", thread.name, e)
        thread.join(timeout_s)
    return not thread.is_alive()
