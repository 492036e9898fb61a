"""Every message of the flush protocol, in one place: one :class:`~typing.NamedTuple` per message,
used by the writer (``Ack(ACK, seq, rank, children, stamp)``) and by the reader (``msg.seq``).
A message's first field is its kind; the second is the cut's number ``seq`` for every kind but
``stream``, ``hello`` and ``name``.

==========  ======================  ==============================  ==============================================
kind        message                 from -> to                      what it says
==========  ======================  ==============================  ==============================================
``ack``     :class:`Ack`            a rank -> controller or leader  the rank swapped its collector for the cut
                                                                    ``seq``; it carries the rank's timing stamp
                                                                    and, for a small cut answered directly, the
                                                                    rank's identity and states
``states``  :class:`States`         a rank -> controller or leader  what the rank's cut took (its snapshot)
``final``   :class:`States`         a rank -> controller            what a stopping mesh's rank recorded since its
                                                                    last cut (``seq``: that cut)
``resent``  :class:`States`         a rank -> controller            a state sent again directly (its leader was
                                                                    replaced, is gone, or was bypassed)
``stream``  :class:`Stream`         a rank -> controller            raw values recorded between flushes
``hello``   :class:`Hello`          a rank -> controller            the rank's host and port (for the aggregated
                                                                    route)
``expect``  :class:`Expect`         a rank -> its leader            the members and waits of a cut (from the cut's
                                                                    plan)
``ackb``    :class:`AckBatch`       a leader -> controller          its group's acknowledgements, and who did not
                                                                    answer
``bundle``  :class:`Bundle`         a leader -> controller          its group's states, merged exactly
``cut``     :class:`CutOrder`       controller -> a rank            take cut ``seq`` of ``step`` (on the inbox
                                                                    socket; through Monarch it is the fetcher's
                                                                    ``cut`` endpoint)
``export``  :class:`ExportOrder`    controller -> a rank            cut ``seq`` closed: send the states held for
                                                                    it (on the inbox socket; through Monarch the
                                                                    ``export`` endpoint)
``name``    :class:`SocketName`     a rank -> the inbox socket      the rank's key, its first frame there: the
                                                                    controller may send it cuts on that connection
==========  ======================  ==============================  ==============================================

A message travels as the plain tuple of its fields (:func:`wire`), the pickler's fastest case: a
NamedTuple would carry its class's name in every pickle, and unpickling it would import and call
the class. The reader gives a received tuple its names back with :func:`view`; nothing outside
this module reads a message by position.

    >>> msg = Ack(ACK, 3, ("mesh", 0), [], None)
    >>> raw = wire(msg)
    >>> type(raw) is tuple, raw[:3]
    (True, ('ack', 3, ('mesh', 0)))
    >>> got = view(raw)
    >>> type(got).__name__, got.seq, got.rank, got.states
    ('Ack', 3, ('mesh', 0), None)
    >>> view(resent(States(STATES, 3, ("mesh", 0), None, b"..."))).kind
    'resent'
    >>> sorted(KINDS) == sorted(MESSAGE_OF)
    True
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ACK", "STATES", "FINAL", "RESENT", "STREAM", "HELLO", "EXPECT", "ACKB", "BUNDLE", "CUT", "EXPORT",
           "NAME", "KINDS", "RankKey", "ChildMesh", "Ack", "States", "Stream", "Hello", "Expect", "AckBatch",
           "Bundle", "CutOrder", "ExportOrder", "SocketName", "MESSAGE_OF", "wire", "view", "kind_of", "resent",
           "DEFAULT_STREAM_INTERVAL_S"]

ACK, STATES, FINAL, RESENT, STREAM = "ack", "states", "final", "resent", "stream"
HELLO, EXPECT, ACKB, BUNDLE = "hello", "expect", "ackb", "bundle"
CUT, EXPORT, NAME = "cut", "export", "name"
KINDS = frozenset({ACK, STATES, FINAL, RESENT, STREAM, HELLO, EXPECT, ACKB, BUNDLE, CUT, EXPORT, NAME})

#: a rank, as every message names it: ``(mesh_id, rank)``
RankKey = tuple


class ChildMesh(NamedTuple):
    """A mesh spawned from a rank's process, declared in its :class:`Ack` (the rank cut it in turn)."""

    mesh_id: str
    size: int  # its ranks
    name: str  # the mesh's name
    actor: str  # the actors spawned on it (their label)
    stopping: bool  # stopped since the last cut: its final states answer the cut


class Ack(NamedTuple):
    """``ack``: a rank swapped its collector for cut ``seq``."""

    kind: str
    seq: int
    rank: RankKey
    children: list  # ChildMesh tuples: the meshes spawned from the rank's process
    stamp: Any  # forge_obs.controller.cut_timing.rank_stamp, or None
    identity: dict | None = None  # with ``states``: a small cut's answer in one message
    states: bytes | None = None  # the rank's snapshot (forge_obs.wire.snapshot.dumps)


class States(NamedTuple):
    """``states``, ``final`` or ``resent``: what a rank took at a cut."""

    kind: str
    seq: int  # the cut (``final``: the last cut the rank took; these states come after it)
    rank: RankKey
    identity: dict | None  # the rank's identity (forge_obs.core.identity.ProcessIdentity.to_dict)
    states: Any  # its snapshot: pickled bytes (forge_obs.wire.snapshot.dumps)


class Stream(NamedTuple):
    """``stream``: raw values (``per_rank_no_reduce``) recorded between flushes."""

    kind: str
    rank: RankKey
    label: str  # the rank's label as it knows it
    step: int  # the predicted step: the last this rank was cut for, + 1
    rows: list  # (key, value, wall time) rows
    pickled: list  # indices of the rows whose value is pickled on its own (forge_obs.wire.snapshot.encode_raw)


class Hello(NamedTuple):
    """``hello``: where a rank runs and listens (for the aggregated route's plan)."""

    kind: str
    rank: RankKey
    host: str  # forge_obs.controller.aggregate.host_key
    port: Any  # the rank's own port (a Monarch port), listened to once it leads a group


class Expect(NamedTuple):
    """``expect``: a leader's own cut of its group (from the mesh's plan, forge_obs.wire.plan)."""

    kind: str
    seq: int
    members: list  # RankKeys of the group
    per_rank: bool  # whether the bundle carries each member's snapshot too
    ack_wait_s: float  # after the cut, the members not acknowledged are given up
    step_wait_s: float  # after the cut, the bundle goes with the states that came
    lagging: list  # members the controller does not wait for
    version: int  # of the plan that made this rank the leader


class AckBatch(NamedTuple):
    """``ackb``: a leader's acknowledgements of its group."""

    kind: str
    seq: int
    items: list  # (rank, children) pairs: the members that acknowledged
    given_up: list  # members the leader stopped waiting for


class Bundle(NamedTuple):
    """``bundle``: a group's states of cut ``seq``, merged on the way up (forge_obs.wire.bundle)."""

    kind: str
    seq: int
    leader: RankKey
    version: int  # of the leader's plan: a replaced leader's bundles are dropped
    ranks: list  # the members it carries
    identities: dict  # the members' identities that changed since their last bundle
    bundle: bytes  # forge_obs.wire.bundle.dumps_bundle


class CutOrder(NamedTuple):
    """``cut``: the controller's cut ``seq`` of ``step``, sent to a rank on the inbox socket."""

    kind: str
    seq: int
    step: int
    actor: str  # the actors on the rank's mesh (its label)
    ctl_us: int | None  # the controller's clock when it sent the cut


class ExportOrder(NamedTuple):
    """``export``: cut ``seq`` closed; the rank sends the states it holds for it."""

    kind: str
    seq: int


class SocketName(NamedTuple):
    """``name``: a rank's first frame on the inbox socket; the controller may send it cuts there."""

    kind: str
    name: Any  # the rank's key


#: kind -> its message
MESSAGE_OF: dict[str, type] = {ACK: Ack, STATES: States, FINAL: States, RESENT: States, STREAM: Stream,
                               HELLO: Hello, EXPECT: Expect, ACKB: AckBatch, BUNDLE: Bundle, CUT: CutOrder,
                               EXPORT: ExportOrder, NAME: SocketName}

_new = tuple.__new__


def wire(msg: tuple) -> tuple:
    """What ``msg`` travels as: the plain tuple of its fields."""
    return tuple(msg)


def view(raw: tuple) -> Any:
    """The message a received tuple is (by its kind, its first item), fields named; KeyError for
    an unknown kind."""
    return _new(MESSAGE_OF[raw[0]], raw)


def kind_of(raw: Any) -> str | None:
    """The kind of a received object, if it is a message (a tuple whose first item is a kind)."""
    if type(raw) is tuple and raw and type(raw[0]) is str and raw[0] in MESSAGE_OF:
        return raw[0]
    return None


def resent(msg: States) -> States:
    """A rank's ``states`` message, to be sent again to the controller directly."""
    return msg._replace(kind=RESENT)


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
