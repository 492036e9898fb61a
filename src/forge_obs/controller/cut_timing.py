"""Where a cut's time went, as the step's ``obs/cut/...`` keys.

A rank's ack carries :func:`rank_stamp`: its clock domain, when its cut handler began and when
it acknowledged. The controller notes when the flush was called, when every mesh was cast to,
when the ack that closed the cut was taken and when the caller resumed. :func:`breakdown` splits
the caller's wait along the path of the rank whose ack closed the cut::

    blocked = send + to_rank + rank + ack + resume      (to_rank, ack: same host only)

``time.monotonic()`` of two processes compares only on one host since the same boot; the
clock domain says which. For a rank of another host, ``to_rank + ack`` is ``transit`` (the two
flights and the queueing at both ends).

    >>> parts = breakdown(called_at=0.0, sent_at=0.001, closed_at=0.005, resumed_at=0.006,
    ...                   stamp=(CLOCK_DOMAIN, 0.002, 0.0025))
    >>> {k: round(v * 1e3, 3) for k, v in parts.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'obs/cut/blocked_s': 6.0, 'obs/cut/send_s': 1.0, 'obs/cut/rank_s': 0.5, 'obs/cut/transit_s': 3.5,
     'obs/cut/resume_s': 1.0, 'obs/cut/to_rank_s': 1.0, 'obs/cut/ack_s': 2.5}

On the inbox socket the closing ack can be taken before the sender notes that it sent every
mesh its cut; the sends were done by then, so ``send`` ends at the close at the latest:

    >>> parts = breakdown(called_at=0.0, sent_at=0.0022, closed_at=0.0021, resumed_at=None)
    >>> parts["obs/cut/send_s"] <= parts["obs/cut/blocked_s"]
    True
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CLOCK_DOMAIN", "rank_stamp", "breakdown", "KEYS"]

#: the keys :func:`breakdown` may return, and ``obs/raw_round_trip_s`` (the probe's)
KEYS = ("obs/cut/blocked_s", "obs/cut/send_s", "obs/cut/rank_s", "obs/cut/transit_s", "obs/cut/resume_s",
        "obs/cut/to_rank_s", "obs/cut/ack_s", "obs/raw_round_trip_s")


def _clock_domain() -> str:
    """This host's boot: processes that share it share ``time.monotonic()``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        import socket

        return f"{socket.gethostname()}:{time.time() - time.monotonic():.0f}"


CLOCK_DOMAIN = _clock_domain()


def rank_stamp(entered: float) -> tuple[str, float, float]:
    """What a rank's ack carries: its clock domain, when its cut handler began (``entered``,
    ``time.monotonic()``) and now, when it acknowledges."""
    return (CLOCK_DOMAIN, entered, time.monotonic())


def breakdown(called_at: float, sent_at: float, closed_at: float, resumed_at: float | None,
              stamp: Any = None) -> dict[str, float]:
    """The cut's parts in seconds (see the module's docstring). ``resumed_at`` is None when no
    caller awaited the cut (then it ends when it closed); ``stamp`` is the closing rank's
    :func:`rank_stamp`, None for a cut closed by its timeout or by an aggregated ack."""
    # every mesh was sent its cut before the cut closed (the last ack needs its cut); a closing
    # ack taken by another thread before the sender noted ``sent_at`` does not move that
    sent_at = min(sent_at, closed_at)
    end = closed_at if resumed_at is None else resumed_at
    out = {"obs/cut/blocked_s": end - called_at, "obs/cut/send_s": sent_at - called_at}
    try:
        domain, entered, acked = stamp
        entered, acked = float(entered), float(acked)
    except (TypeError, ValueError):
        return out
    out["obs/cut/rank_s"] = acked - entered
    out["obs/cut/transit_s"] = max(0.0, closed_at - sent_at - (acked - entered))
    out["obs/cut/resume_s"] = end - closed_at
    if domain == CLOCK_DOMAIN:
        out["obs/cut/to_rank_s"] = max(0.0, entered - sent_at)
        out["obs/cut/ack_s"] = max(0.0, closed_at - acked)
    return out
