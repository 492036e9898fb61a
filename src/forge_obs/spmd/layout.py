"""Where an SPMD job's cuts go: each rank to its node's helper, each helper to its parent.

    >>> lay = Layout.plan(["a", "a", "b", "b", "c", "c"], logger_rank=2, fanin=8)
    >>> lay.helper_of                       # the logger rank's node is helper 0, the tree's root
    (1, 1, 0, 0, 2, 2)
    >>> lay.ranks_of(0), lay.children_of(0), lay.parent_of(2), lay.subtree(1)
    ([2, 3], [1, 2], 0, [0, 1])
    >>> lay.spawner_of(0), lay.spawner_of(1)    # who starts each helper
    (2, 0)

One helper process per node merges its node's ranks exactly; helpers form a tree of fan-in
``fanin`` (helper ``i``'s parent is ``(i - 1) // fanin``), so that a helper merges at most its
node's ranks and ``fanin`` pieces per step, whatever the job's size. Helper 0 runs on the
logger rank's node and is the root: it runs the backends. The logger rank starts helper 0; the
lowest rank of each other node starts that node's helper.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "FANIN"]

#: child helpers per helper: the root merges its node's ranks and at most this many pieces a step
FANIN = 8


@dataclass(frozen=True)
class Layout:
    """``helper_of``: rank -> its node's helper; ``logger_rank``; ``fanin``."""

    helper_of: tuple
    logger_rank: int = 0
    fanin: int = FANIN

    @classmethod
    def plan(cls, nodes: list, logger_rank: int = 0, fanin: int = FANIN) -> "Layout":
        """The layout of ranks whose nodes are ``nodes`` (rank -> node name): the logger rank's
        node first, then the others in the order of their lowest rank."""
        order = {nodes[logger_rank]: 0}
        for n in nodes:
            order.setdefault(n, len(order))
        return cls(tuple(order[n] for n in nodes), logger_rank, fanin)

    @property
    def n_helpers(self) -> int:
        return max(self.helper_of) + 1 if self.helper_of else 0

    def ranks_of(self, index: int) -> list[int]:
        return [r for r, h in enumerate(self.helper_of) if h == index]

    def parent_of(self, index: int) -> "int | None":
        return None if index == 0 else (index - 1) // self.fanin

    def children_of(self, index: int) -> list[int]:
        first = index * self.fanin + 1
        return list(range(first, min(first + self.fanin, self.n_helpers)))

    def subtree(self, index: int) -> list[int]:
        """The ranks whose cuts reach the root through helper ``index`` (its node's included)."""
        helpers, todo = set(), [index]
        while todo:
            h = todo.pop()
            helpers.add(h)
            todo.extend(self.children_of(h))
        return [r for r, h in enumerate(self.helper_of) if h in helpers]

    def spawner_of(self, index: int) -> int:
        """The rank that starts helper ``index``."""
        return self.logger_rank if index == 0 else min(self.ranks_of(index))
