"""Every message kind of the flush protocol, in one place. A message is a tuple whose first item
is its kind; the second is the cut's number ``seq`` for every kind but ``stream`` and ``hello``.

==========  ===============================  ==========================================================
kind        from -> to                       what it says
==========  ===============================  ==========================================================
``ack``     a rank -> controller or leader   the rank swapped its collector for the cut ``seq``; it
                                             carries the rank's timing stamp and, for a small cut
                                             answered directly, the rank's identity and states
``states``  a rank -> controller or leader   what the rank's cut took (its snapshot)
``final``   a rank -> controller             what a stopping mesh's rank recorded since its last cut
``stream``  a rank -> controller             raw values recorded between flushes
``hello``   a rank -> controller             the rank's host and port (for the aggregated route)
``expect``  a rank -> its leader             the members and waits of a cut (from the cut's plan)
``ackb``    a leader -> controller           its group's acknowledgements, and who did not answer
``bundle``  a leader -> controller           its group's states, merged exactly
``resent``  a rank -> controller             a state sent again directly (its leader was bypassed)
``cut``     controller -> a rank             take cut ``seq`` of ``step`` (on the inbox socket; through
                                             Monarch it is the fetcher's ``cut`` endpoint)
``export``  controller -> a rank             cut ``seq`` closed: send the states held for it (on the
                                             inbox socket; through Monarch the ``export`` endpoint)
==========  ===============================  ==========================================================

    >>> from forge_obs.wire.messages import ACK, KINDS
    >>> ACK in KINDS
    True
"""

from __future__ import annotations

__all__ = ["ACK", "STATES", "FINAL", "STREAM", "HELLO", "ACKB", "BUNDLE", "RESENT", "EXPECT", "CUT", "EXPORT", "KINDS",
           "DEFAULT_STREAM_INTERVAL_S"]

ACK, STATES, FINAL, STREAM = "ack", "states", "final", "stream"
HELLO, ACKB, BUNDLE, RESENT, EXPECT = "hello", "ackb", "bundle", "resent", "expect"
CUT, EXPORT = "cut", "export"
KINDS = frozenset({ACK, STATES, FINAL, STREAM, HELLO, ACKB, BUNDLE, RESENT, EXPECT, CUT, EXPORT})

#: how often a rank streams raw values (``per_rank_no_reduce``) unless ``init_backends`` says
DEFAULT_STREAM_INTERVAL_S = 1.0


# ============================================================================================
# SPMD (forge_obs.spmd): ranks -> their node's helper -> the helpers' tree -> the logger helper
# ============================================================================================
# Each connection carries frames; a frame is a list of these messages, in order. A rank talks to
# its node's helper over a Unix socket; a helper to its parent helper over TCP (the logger
# helper, on the logger rank's node, is the root). Times are wall clock (``time.time()``) of the
# process that took them.

from typing import Any, NamedTuple  # noqa: E402 - the SPMD section's own imports

__all__ += ["RankHello", "HelperHello", "Ready", "RankCut", "Piece", "Status", "Control", "Done", "SPMD_MESSAGES"]


class RankHello(NamedTuple):
    """A rank -> its node's helper, first on its connection: who it is."""

    rank: int


class HelperHello(NamedTuple):
    """A helper -> its parent, first after the session's token: its index in the tree."""

    index: int


class Ready(NamedTuple):
    """A helper -> a rank, in answer to :class:`RankHello`: the helper is up (the logger helper:
    its backends started). ``error``: why it could not start (the rank's ``init`` raises it)."""

    error: "str | None"


class RankCut(NamedTuple):
    """A rank -> its node's helper: what one ``flush(step)`` took.

    ``flushed_at``: when the rank's ``flush(step)`` ran; ``data``: the states
    (:func:`forge_obs.wire.rank_cut.export`); ``held_back``: the flushes the rank's bounded queue
    held back into this cut since its previous one (their values are in this step); ``final``:
    the rank's last cut (its ``shutdown``), with ``report``, the rank's own counts."""

    step: int
    flushed_at: float
    data: bytes
    held_back: int = 0
    final: bool = False
    report: "dict[str, Any] | None" = None


class Piece(NamedTuple):
    """A helper -> its parent: the cuts of ranks of its subtree for one step, merged exactly
    (:func:`forge_obs.wire.bundle.dumps_bundle`).

    A helper sends one *main* piece per step; it names the subtree's ranks that are not in it:
    ``absent`` (awaited, not there in time), ``skipped`` (they flushed a later step without
    this one: their values are in that step), and ranks that finished before the step are in
    neither. A later piece of the same step (``main`` False) carries ranks that came after the
    main one left, named in ``ranks``. ``n_ranks``: how many ranks' cuts the piece merges;
    ``flushed_at``: the earliest flush among them; ``held_back``: their cuts' ``held_back``
    summed; ``finished``: ranks whose final cut is in it, with their ``reports``."""

    step: int
    flushed_at: float
    main: bool
    n_ranks: int
    ranks: tuple
    absent: tuple
    skipped: tuple
    held_back: int
    finished: tuple
    reports: dict
    bundle: bytes


class Status(NamedTuple):
    """A helper -> its parent, with every frame and at least every heartbeat: ``horizon``: every
    cut its subtree's ranks shipped before this time is in a piece sent before this message;
    ``gone``: ranks of its subtree whose process ended without its final cut (its connection
    closed); ``counts``: the helper's own counts (early forwards, cuts it could not decode)."""

    horizon: float
    gone: tuple = ()
    counts: "dict[str, int] | None" = None


class Control(NamedTuple):
    """The logger helper -> ranks, down the tree: ``spans`` on or off for ``ranks`` (the ranks
    the live alerts point at write their timeline's spans from then on)."""

    ranks: tuple
    spans: bool


class Done(NamedTuple):
    """The logger helper -> the logger rank, at the end of the session: its summary (steps
    logged, ranks that did not finish, what a bound held back or dropped)."""

    summary: dict


SPMD_MESSAGES = (RankHello, HelperHello, Ready, RankCut, Piece, Status, Control, Done)
