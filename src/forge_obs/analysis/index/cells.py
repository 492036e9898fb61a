"""The doctor's per-step evidence, stored when spans are indexed: each segment of ``spans`` gets
a segment of ``cells`` beside it, its spans summed per process session, source file, span name
and step (the spans without a step: one cell per name).

    >>> import pyarrow as pa
    >>> from forge_obs.analysis.index.schema import TABLES, arrow_schema
    >>> rows = [(0, "", 0, "fwd", 3, 10, 15, 5, None, None, None, None, None, False, None, 0, 100),
    ...         (0, "", 0, "fwd", 3, 20, 22, 2, None, None, None, None, None, False, 7, 0, 200)]
    >>> spans = pa.Table.from_pylist([dict(zip(TABLES["spans"], r)) for r in rows], schema=arrow_schema("spans"))
    >>> c = span_cells(spans).to_pylist()[0]
    >>> c["n"], c["dur"], c["dur_max"], c["lo"], c["hi"], c["cpu"], c["cpu_dur"], c["off"], c["off_last"]
    (2, 7, 5, 10, 22, 7, 2, 100, 200)

Every column is a sum, a minimum or a maximum, so the cells of several segments (a step's spans
indexed by two updates, a large file indexed in parts) add up to the cells of all their spans:
:mod:`.evidence` aggregates them again when the doctor reads them. The doctor then reads one
row per rank, span name and step however many spans each has, and what it reads about every
span (its longest, each process's active window, its last step) is here too.
"""

from __future__ import annotations

from typing import Any

from forge_obs.analysis.index.schema import arrow_schema

__all__ = ["span_cells"]

_KEYS = ["sid", "fid", "name", "step"]


def span_cells(spans: Any) -> Any:
    """The ``cells`` rows (:data:`~forge_obs.analysis.index.schema.TABLES`) of the Arrow table
    ``spans`` (rows of the ``spans`` table): per key, the spans' count, summed and longest
    duration, first start, last end (``start + dur``), summed CPU time and the wall time of the
    spans that carry it (null: none does), first and last byte offset."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pa.table({**{k: spans[k] for k in _KEYS}, "dur": spans["dur"], "start": spans["start"],
                  "end": pc.add(spans["start"], spans["dur"]), "cpu": spans["cpu"],
                  "cpu_dur": pc.if_else(pc.is_valid(spans["cpu"]), spans["dur"], pa.scalar(None, pa.int64())),
                  "off": spans["off"]})
    agg = t.group_by(_KEYS, use_threads=False).aggregate([
        ("off", "count", pc.CountOptions(mode="all")), ("dur", "sum"), ("dur", "max"), ("start", "min"), ("end", "max"),
        ("cpu", "sum"), ("cpu_dur", "sum"), ("off", "min"), ("off", "max")])
    cols = [agg[k] for k in _KEYS] + [agg[c] for c in ("off_count", "dur_sum", "dur_max", "start_min", "end_max",
                                                       "cpu_sum", "cpu_dur_sum", "off_min", "off_max")]
    schema = arrow_schema("cells")
    return pa.Table.from_arrays([c.cast(f.type) for c, f in zip(cols, schema)], schema=schema)
