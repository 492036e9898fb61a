"""What the controller's actors share in the controller process: :data:`CONTROLLER`.

The logger (:mod:`forge_obs.controller.logger`), its inbox (:mod:`forge_obs.controller.inbox`),
the flush entry points (:mod:`forge_obs.controller.flush`) and the client's handle
(:mod:`forge_obs.controller.client`) run in one process, each on its own thread and loop (Monarch
runs every actor apart); this object is what they have in common, one per process. ``lock``
guards the hand-over of ``pipeline`` between the inbox's threads and a session's start or end.

    >>> from forge_obs.controller.state import CONTROLLER
    >>> CONTROLLER.pipeline is None or CONTROLLER.run is not None
    True
"""

from __future__ import annotations

import threading
from typing import Any

from forge_obs.backends.record import RunContext
from forge_obs.controller.cuts import RankBook
from forge_obs.controller.local_socket import LocalInbox
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.wire.plan import Planner

__all__ = ["ControllerState", "CONTROLLER"]


class ControllerState:
    """The controller process's logging state (see the module's docstring)."""

    def __init__(self) -> None:
        # this process
        self.process_name = "Controller"
        self.in_this_process = False  # the GlobalLoggingActor lives in this process
        # the session (init_backends .. shutdown)
        self.disabled = False  # init_backends saw FORGE_DISABLE_METRICS: flush is a silent no-op
        self.shut_down = False  # shutdown() ended the last session (no init_backends since)
        self.pipeline: FlushPipeline | None = None
        self.run: RunContext | None = None
        self.last_step: int | None = None
        self.early: list[tuple] = []  # (rank, identity, states) that arrived with no pipeline (before init_backends)
        self.aggregate = "off"  # init_backends' "aggregate": "auto" | "on" | "off"
        self.probe_round_trip = False  # init_backends' "probe_round_trip"
        self.stream_interval_s = 0.0  # the controller's own raw values: pushed this often (0: off)
        self.stream_timer: Any = None
        # across sessions
        self.book = RankBook()  # what is known of ranks
        self.planner = Planner()  # the aggregated route's groups and leaders
        self.lock = threading.Lock()
        # where ranks answer
        self.inbox: Any = None  # the ObsInbox of this process, and its port (see inbox.local_port)
        self.port: Any = None
        self.local: LocalInbox | bool | None = None  # this process's inbox socket (False: none can be made here)


#: the controller state of this process
CONTROLLER = ControllerState()
