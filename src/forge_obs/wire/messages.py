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
