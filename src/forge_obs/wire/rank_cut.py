"""The rank side of a cut, one definition for the Monarch fetcher and the SPMD shipper.

    >>> from forge_obs.recording.collector import record_metric
    >>> from forge_obs.recording.reduce import Reduce
    >>> from forge_obs.wire import rank_cut
    >>> from forge_obs.wire.snapshot import loads
    >>> _ = rank_cut.take(6)                      # what was recorded before: step 6's
    >>> record_metric("doc/loss", 2.0, Reduce.MEAN)
    >>> taken = rank_cut.take(7)                  # the cut: O(1), on the caller's thread
    >>> record_metric("doc/loss", 9.0, Reduce.MEAN)  # after the cut: the next step's
    >>> snap = loads(rank_cut.export(taken))      # later, off the caller's path
    >>> snap["packed"]["mean"][0], "self_cpu" in snap
    (['doc/loss'], True)
    >>> _ = rank_cut.take(8)

A cut is two calls, in this order:

1. :func:`take` (on the thread that asked for the cut): swap the process's collector, so that
   a value recorded before it is in the cut and one recorded after it is in the next one, and
   let the timeline follow (spans that begin from now on are the next step's). No export, no
   device sync, no I/O.
2. :func:`export` (later, off the caller's thread: the fetcher, the SPMD shipper thread): the
   per-cut extras added (:func:`add_extras`), the states the cut took exported packed, and
   pickled per key (:func:`forge_obs.wire.snapshot.dumps`), ready to travel as one bytes object.

:func:`add_extras` is the one place where what a cut carries besides the recorded values
belongs, so that both the Monarch and the SPMD route carry the same: the process's telemetry
(:mod:`forge_obs.recording.telemetry`: ``obs/sys/...`` values of the cut, merged and reduced like
any value on every route; sampled at the steps its stride picks: :func:`take` names the cut's step) and
forge_obs's own CPU since the previous cut (``self_cpu``).
"""

from __future__ import annotations

from typing import Any

from forge_obs.core.selfobs import SELF_OBS
from forge_obs.recording import telemetry
from forge_obs.recording.collector import MetricCollector, Taken
from forge_obs.recording.timeline import follow_cut
from forge_obs.wire.snapshot import dumps

__all__ = ["take", "export", "add_extras"]

_COLLECTOR = MetricCollector()


def take(step: int) -> Taken:
    """The cut of ``step`` in this process: what was recorded so far, taken in O(1) (see
    :meth:`~forge_obs.recording.collector.MetricCollector.swap`); spans that begin from now on
    are in ``step + 1``."""
    taken = _COLLECTOR.swap()
    follow_cut(step + 1)
    taken.step = step
    return taken


def export(taken: Taken) -> bytes:
    """What ``taken`` holds, ready to travel: its states exported packed, the per-cut extras
    added (:func:`add_extras`), pickled per key. A state that cannot be exported or pickled is
    left out and counted in the snapshot's counters; raises only where the export itself fails
    (the caller counts that cut as lost)."""
    snap = _COLLECTOR.export(taken, packed=True)
    add_extras(snap, taken.step)
    return dumps(snap, lambda key, reason, n: taken.drop(reason, n))


def add_extras(snapshot: dict[str, Any], step: int | None = None) -> None:
    """What every cut carries besides the recorded values, added to its exported ``snapshot``:
    this process's telemetry sample, when the cut of ``step`` takes one, as values of the cut
    (:func:`forge_obs.recording.telemetry.add_to`: ``obs/sys/...`` rows of its packed groups, not
    counted as recorded values); and forge_obs's own CPU in this process since the previous cut
    (``self_cpu``; the pipeline reports it as ``obs/cpu_<part>_s``, apart from the user's keys)."""
    telemetry.add_to(snapshot, step)
    snapshot["self_cpu"] = SELF_OBS.take()
