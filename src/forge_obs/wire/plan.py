"""Which rank leads which group: the controller's plan of the aggregated route, per mesh.

    >>> from forge_obs.wire.plan import Planner
    >>> p = Planner()
    >>> for r in range(4):  # what the fetchers' hello said: 2 hosts x 2 ranks
    ...     p.hello(("m1", r), f"host{r // 2}", port=f"port{r}")
    >>> plan = p.replan("m1", 4, lagging=set(), per_rank=False, flush_timeout_s=10, mode="on", job_ranks=4)
    >>> plan["leader"], plan["ports"]
    ({0: 1, 1: 1, 2: 3, 3: 3}, {1: 'port1', 3: 'port3'})
    >>> p.replan("m1", 4, set(), False, 10, "on", 4) is None  # unchanged: not cast again
    True

A *group* is the ranks of one mesh on one Monarch host (the fetchers' ``hello`` names their host,
:func:`forge_obs.controller.aggregate.host_key`); each group of at least :data:`MIN_GROUP` ranks is led by its
highest rank that is not lagging (Monarch's cast to a host goes through its first proc: another
leader keeps the two failure points apart). A group whose ranks are all lagging, a lone rank, and
every rank when aggregation is off answer directly. The plan rides on the cut's cast only when it
changed. Each leader carries the ``version`` of the plan that made it leader: the controller drops
bundles of a leader replaced since (:meth:`Planner.current`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Planner", "MIN_GROUP", "AUTO_MIN_RANKS", "ACK_WAIT_FRACTION", "STEP_WAIT_FRACTION", "BYPASS_FRACTION",
           "MODES"]

#: smallest group worth a leader (a lone rank answers directly)
MIN_GROUP = 2
#: ``"aggregate": "auto"`` aggregates from this many ranks in the job (below, the direct route
#: has one hop less and the controller's work is small)
AUTO_MIN_RANKS = 32
#: fractions of flush_timeout_s a leader waits for acks / states before forwarding what it has
ACK_WAIT_FRACTION = 0.9
STEP_WAIT_FRACTION = 0.95
#: fraction of flush_timeout_s after which the controller asks the ranks of a group whose leader
#: has not delivered the cut's bundle to resend their answers directly (the rest of the timeout
#: is theirs to answer)
BYPASS_FRACTION = 0.5
MODES = ("auto", "on", "off")


class Planner:
    """The controller's plans, kept across ``init_backends`` sessions (fetchers keep theirs)."""

    def __init__(self) -> None:
        self.hosts: dict[tuple, tuple[str, Any]] = {}  # rank key -> (host key, its port)
        self._plans: dict[str, tuple] = {}  # mesh id -> (signature, plan)
        self._leads: dict[tuple, int] = {}  # current leader -> the plan version that made it leader
        self._version = 0
        #: rank key -> its group leader's key, as last cast (the pipeline does not blame a member
        #: for a cut its leader missed)
        self.leader_of: dict[tuple, tuple] = {}

    def hello(self, rank_key: Any, host: str, port: Any) -> None:
        self.hosts[tuple(rank_key)] = (host, port)

    def current(self, leader_key: Any, version: int) -> bool:
        """Whether a bundle from ``leader_key`` made leader by plan ``version`` is to be taken."""
        return self._leads.get(tuple(leader_key)) == version

    def groups(self, mesh_ids: list[str]) -> dict[tuple, list[tuple]]:
        """The groups the current plans of ``mesh_ids`` aggregate: leader key -> its group's rank
        keys (the leader's included)."""
        out: dict[tuple, list[tuple]] = {}
        for mesh_id in mesh_ids:
            plan = self._plans.get(mesh_id, (None, None))[1]
            if plan is not None:
                out.update(((mesh_id, lead), members) for lead, members in plan["groups"].items())
        return out

    def forget(self, mesh_id: str) -> None:
        self._plans.pop(mesh_id, None)
        for k in [k for k in self._leads if k[0] == mesh_id]:
            del self._leads[k]

    def replan(self, mesh_id: str, size: int, lagging: set, per_rank: bool, flush_timeout_s: float,
               mode: str, job_ranks: int) -> dict | None:
        """Plan mesh ``mesh_id`` for the cut about to be cast: its new plan if it changed since it
        was last cast (else ``None``). The plan is recorded as cast: its leaders' versions, and
        ``leader_of``."""
        groups: dict[str, list[int]] = {}
        if mode == "on" or (mode == "auto" and job_ranks >= AUTO_MIN_RANKS):
            for r in range(size):
                info = self.hosts.get((mesh_id, r))
                if info is not None:
                    groups.setdefault(info[0], []).append(r)
        leader: dict[int, int] = {}
        members: dict[int, list] = {}
        ports: dict[int, Any] = {}
        for ranks in groups.values():
            live = [r for r in ranks if (mesh_id, r) not in lagging]
            if len(ranks) < MIN_GROUP or not live:
                continue
            lead = live[-1]
            ports[lead] = self.hosts[(mesh_id, lead)][1]
            members[lead] = [(mesh_id, r) for r in ranks]
            for r in ranks:
                leader[r] = lead
        sig = (tuple(sorted(leader.items())), per_rank, flush_timeout_s)
        old = self._plans.get(mesh_id)
        if old is None and not leader:
            self._plans[mesh_id] = (sig, None)
            return None  # never aggregated: the fetchers answer directly already
        if old is not None and old[0] == sig:
            return None
        old_plan = old[1] if old is not None and old[1] is not None else {"ports": {}, "groups": {}}
        version = {}
        for lead in members:
            key = (mesh_id, lead)
            if lead in old_plan["ports"] and key in self._leads and old_plan["groups"].get(lead) == members[lead]:
                version[lead] = self._leads[key]  # the same leader of the same group: its bundles stay good
            else:
                self._version += 1
                version[lead] = self._leads[key] = self._version
        for lead in set(old_plan["ports"]) - set(members):
            self._leads.pop((mesh_id, lead), None)  # replaced: fenced
        lag = {lead: [k for k in ks if k in lagging] for lead, ks in members.items()}
        plan = {"leader": leader, "ports": ports, "groups": members, "lagging": lag, "version": version,
                "per_rank": per_rank, "ack_wait_s": flush_timeout_s * ACK_WAIT_FRACTION,
                "step_wait_s": flush_timeout_s * STEP_WAIT_FRACTION}
        self._plans[mesh_id] = (sig, plan)
        for r in range(size):
            self.leader_of.pop((mesh_id, r), None)
        self.leader_of.update({(mesh_id, r): (mesh_id, lead) for r, lead in leader.items()})
        return plan
