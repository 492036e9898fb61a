"""Merging rank snapshots on the way up: what a host's aggregator sends instead of N snapshots.

    >>> from forge_obs.wire.bundle import make_bundle, bundle_snapshot
    >>> from forge_obs.wire.merge import reduce_snapshots
    >>> a = {"packed": {"mean": (["loss"], [(1.0, 1)])}, "states": {}, "counters": {"values_recorded": 1}}
    >>> b = {"packed": {"mean": (["loss"], [(3.0, 1)])}, "states": {}, "counters": {"values_recorded": 1}}
    >>> bundle = make_bundle({("m", 0): a, ("m", 1): b}, identities={}, per_rank=False)
    >>> [(m.key, m.value) for m in reduce_snapshots([bundle_snapshot(bundle)])]
    [('loss', 2.0)]

A *bundle* is the merge of several ranks' snapshots (one step's cut, one group of ranks):

``{"ranks": [rank_key, ...], "merged": snapshot, "conflicts": {key: [reductions]},
"drops": {reason: {key, ...}}, "per_rank": {rank_key: snapshot} | None, "raw": {rank_key: [...]},
"identities": {rank_key: identity}, "streamed": [(values streamed early, their step), ...]}``

``merged`` is an ordinary packed snapshot, so the controller reduces bundles with the same
:func:`forge_obs.recording.reduce.reduce_snapshots` it uses for ranks, and bundles merge into bundles
(a tree of aggregators). Exactness:

- SUM and MEAN sums travel as Shewchuk partials (non-overlapping floats whose exact sum is the
  exact sum of the ranks' values): a MEAN/SUM key's rows are ``[(p0, count), (p1, 0), ...]``
  with the key repeated, so ``math.fsum`` at the controller returns exactly the value it returns
  over every rank's row — bit for bit, whatever the grouping.
- COUNT, MAX, MIN (NaN sticks), LAST (latest wall time) merge exactly, with their accumulator's
  ``merge_rows``; STD merges with Chan's formula over the rows in one canonical order (so a
  group's merge does not depend on the order its members' states arrived; the last bits depend
  on the grouping, which the plan fixes); SAMPLE and custom reductions merge with their class's
  ``merge_states``, which must be associative (it is already applied to merged states when a
  rank's late states meet its own).
- A key recorded with different reductions is reported in ``conflicts`` and the controller
  drops it for the step, as it drops it today; a key whose states fail to merge is dropped and
  named in ``drops`` under the same reasons the controller uses (each key counts once per step
  and reason, however many groups dropped it: the same count as on the direct route).

No Monarch, no torch: this runs on a leader's aggregator thread (:mod:`forge_obs.controller.aggregate`).
"""

from __future__ import annotations

import math
import pickle
from typing import Any, Iterable

from forge_obs.recording.reduce import ROW_CLASSES, ROW_FIELDS, KeyDrops, accumulator_for

from forge_obs.core.counters import merge_counters
from forge_obs.core.selfobs import add_cpu
from forge_obs.wire.merge import Grouper
from forge_obs.wire.snapshot import OnDrop, decode, decode_raw, encode, encode_raw, pickle_value

__all__ = ["exact_parts", "merge_packed", "make_bundle", "merge_bundles", "bundle_snapshot", "dumps_bundle",
           "loads_bundle"]

SUM_LIKE = ("sum", "mean")
#: per-rank counters that do not add up (the step a rank streamed raw values under): kept per rank
_PER_RANK_COUNTERS = ("streamed_early", "streamed_step")


def exact_parts(values: Iterable[float]) -> list[float]:
    """Non-overlapping partials whose exact sum is the exact sum of ``values`` (Shewchuk), so
    that ``math.fsum(exact_parts(a) + exact_parts(b)) == math.fsum(a + b)``. Non-finite values are
    kept (one of each kind), and values whose running sum overflows are returned as they came,
    so that ``math.fsum`` behaves exactly as it would on the original values."""
    vals = list(values)
    special: list[float] = []
    partials: list[float] = []
    for x in vals:
        x = float(x)
        if not math.isfinite(x):
            if not any((s != s and x != x) or s == x for s in special):
                special.append(x)
            continue
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            if not math.isfinite(hi):
                return vals  # overflow: fsum on these raw values raises where it would on the originals
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]
    return partials + special


def merge_packed(snaps: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list], KeyDrops]:
    """Merge decoded packed snapshots (ranks' or bundles' ``merged``) into one.

    Returns ``(merged, conflicts, drops)``: ``conflicts`` maps a key recorded with different
    reductions to those reductions (the controller drops it for the step); ``drops`` names the
    keys whose states could not be merged, by reason (:class:`~forge_obs.recording.reduce.KeyDrops`)."""
    grouper = Grouper()  # key -> [rt, items]; conflicting reductions and malformed states set aside
    counters: dict[str, Any] = {}
    self_cpu: dict[str, float] = {}  # forge_obs's own CPU (forge_obs.core.selfobs), summed
    for snap in snaps:
        add_cpu(self_cpu, snap.get("self_cpu"))
        grouper.add_snapshot(snap)
        merge_counters(counters, snap.get("counters") or {}, skip=_PER_RANK_COUNTERS)
    groups = grouper.groups
    conflicts = {k: c[0] for k, c in grouper.conflicts.items()}
    packed: dict[str, tuple[list, list]] = {}
    states: dict[str, Any] = {}
    drops = KeyDrops()
    for k, (reason, _n, _err) in grouper.bad.items():
        drops.add(k, reason)
    for k, (rt, items) in groups.items():
        if k in conflicts:
            continue
        if rt in ROW_FIELDS:
            ks, rows = packed.setdefault(rt, ([], []))
            if len(items) == 1:
                ks.append(k)
                rows.append(items[0])
            elif rt == "mean":
                parts = exact_parts(r[0] for r in items)
                count = sum(r[1] for r in items)
                ks.extend([k] * max(1, len(parts)))
                rows.append((parts[0] if parts else 0.0, count))
                rows.extend((p, 0) for p in parts[1:])
            elif rt == "sum":
                parts = exact_parts(items) or [0.0]
                ks.extend([k] * len(parts))
                rows.extend(parts)
            else:  # one merge per reduction: its accumulator's (canonical order, exact where it can be)
                ks.append(k)
                rows.append(ROW_CLASSES[rt].merge_rows(items))
        else:
            try:
                states[k] = items[0] if len(items) == 1 else accumulator_for(rt).merge_states(items)
            except Exception as e:  # noqa: BLE001 - one key never costs the others
                reason = "unknown_reduction" if "unknown reduction" in str(e) else (
                    "overflow" if isinstance(e, OverflowError) else "merge_error")
                drops.add(k, reason)
    merged = {"packed": packed, "states": states, "counters": counters, "self_cpu": self_cpu}
    return merged, {k: sorted(v) for k, v in conflicts.items()}, drops


def make_bundle(
    snaps: dict[Any, dict[str, Any]],
    identities: dict[Any, dict] | None = None,
    per_rank: bool = False,
) -> dict[str, Any]:
    """One group's bundle from its ranks' decoded snapshots (``rank_key -> snapshot``)."""
    merged, conflicts, drops = merge_packed(list(snaps.values()))
    raw = {k: s["raw"] for k, s in snaps.items() if s.get("raw")}
    streamed = [(c["streamed_early"], c.get("streamed_step")) for s in snaps.values()
                if (c := s.get("counters") or {}).get("streamed_early")]
    pr = None
    if per_rank:
        pr = {k: {"packed": s.get("packed") or {}, "states": s.get("states") or {}} for k, s in snaps.items()
              if s.get("packed") or s.get("states")}
    return {"ranks": list(snaps), "merged": merged, "conflicts": conflicts, "drops": drops,
            "per_rank": pr, "raw": raw, "identities": dict(identities or {}), "streamed": streamed}


def merge_bundles(bundles: list[dict[str, Any]]) -> dict[str, Any]:
    """Bundles of disjoint ranks merged into one (an aggregator of aggregators)."""
    merged, conflicts, drops = merge_packed([b["merged"] for b in bundles])
    for b in bundles:
        for k, rts in b["conflicts"].items():
            conflicts[k] = sorted(set(conflicts.get(k, ())) | set(rts))
        drops.merge(b["drops"])
    for k in conflicts:  # a key that conflicts anywhere is dropped everywhere
        for rt, (ks, rows) in list(merged["packed"].items()):
            if k in ks:
                keep = [(kk, r) for kk, r in zip(ks, rows) if kk != k]
                merged["packed"][rt] = ([kk for kk, _ in keep], [r for _, r in keep])
        merged["states"].pop(k, None)
    per_rank = None
    if any(b["per_rank"] is not None for b in bundles):
        per_rank = {}
        for b in bundles:
            per_rank.update(b["per_rank"] or {})
    raw: dict = {}
    identities: dict = {}
    ranks: list = []
    streamed: list = []
    for b in bundles:
        raw.update(b["raw"])
        identities.update(b["identities"])
        ranks.extend(b["ranks"])
        streamed.extend(b.get("streamed", ()))
    return {"ranks": ranks, "merged": merged, "conflicts": conflicts, "drops": drops,
            "per_rank": per_rank, "raw": raw, "identities": identities, "streamed": streamed}


def bundle_snapshot(bundle: dict[str, Any]) -> dict[str, Any]:
    """The bundle's merged states as a snapshot for :func:`~forge_obs.recording.reduce.reduce_snapshots`."""
    return bundle["merged"]


def dumps_bundle(bundle: dict[str, Any]) -> bytes:
    """A bundle as bytes, its snapshots encoded as a rank's are (states and raw values that are
    not numbers pickled one by one: :func:`forge_obs.wire.snapshot.encode`), so that one the
    controller cannot decode costs that key only. What cannot be pickled is named in ``drops``."""
    drops = bundle["drops"]
    raw = {k: encode_raw(rows, drops.add) for k, rows in bundle["raw"].items()}
    per_rank = bundle["per_rank"]
    enc = dict(bundle, merged=encode(bundle["merged"], drops.add), raw={k: r for k, (r, _i) in raw.items()},
               raw_pickled={k: i for k, (_r, i) in raw.items() if i},
               per_rank=None if per_rank is None else {k: encode(s, drops.add) for k, s in per_rank.items()})
    return pickle_value(enc)


def loads_bundle(data: Any, on_drop: OnDrop | None = None) -> dict[str, Any]:
    """The inverse of :func:`dumps_bundle` (bytes, or a bundle already in memory): what cannot be
    decoded here is left out and reported to ``on_drop(key, "undecodable", 1)``."""
    b = pickle.loads(data) if isinstance(data, (bytes, bytearray, memoryview)) else dict(data)
    b["merged"] = decode(b["merged"], on_drop)
    if b.get("per_rank") is not None:
        b["per_rank"] = {k: decode(s, on_drop) for k, s in b["per_rank"].items()}
    idx = b.pop("raw_pickled", None) or {}
    b["raw"] = {k: decode_raw(rows, idx.get(k, ()), on_drop) for k, rows in b["raw"].items()}
    return b
