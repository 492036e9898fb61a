"""The doctor's per-step evidence, read from the index: what its timeline rules need of every
span, aggregated by DuckDB over the cells stored beside the spans (:mod:`.cells`), so that only
aggregates reach Python and what they cost grows with the cells (ranks, span names, steps), not
with the spans.

    >>> import tempfile
    >>> from forge_obs import timeline
    >>> from forge_obs.analysis.index import open_index
    >>> run_dir = tempfile.mkdtemp()
    >>> timeline.configure(run_dir)
    True
    >>> timeline.set_step(2)
    >>> with timeline.record_span("train_step"):
    ...     pass
    >>> timeline.close()
    >>> ev = Evidence(open_index(run_dir), skip=lambda name: False)
    >>> [(key, c["step"].tolist(), c["rank"].tolist()) for key, c in ev.cells({sid: "main" for sid in ev.run.by_sid})]
    [((0, 'main', 'train_step'), [2], [0])]

Every answer is keyed by the process session (``sid``, :func:`forge_obs.analysis.index.timeline.sessions`)
and comes in the reader's order (the files in their reading order, then each record's byte
offset), the order in which a pass over the records (:func:`forge_obs.analysis.reader.walk`)
meets them. ``skip(name)`` drops spans by name (the doctor's start-up and teardown spans) from
everything but :meth:`Evidence.longest`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from forge_obs.analysis.index.timeline import extras, sessions
from forge_obs.analysis.reader import OPEN

__all__ = ["Evidence"]

#: a row's position in the reader's order: its file's rank, then its byte offset
_ORDER = "(f.rnk::BIGINT << 40) + x.off"
_COLS = ("step", "rank", "dur", "lo", "hi", "cpu", "cpu_dur")
_NULLABLE = ("cpu", "cpu_dur")


class Evidence:
    """Queries over one index (see the module docstring); ``run``: its sessions as a
    :class:`~forge_obs.analysis.reader.Run` (``run.by_sid``)."""

    def __init__(self, idx: Any, skip: Callable[[str], bool], con: Any = None) -> None:
        self.idx = idx
        self.con = con or idx.connect()
        self.run = sessions(idx, self.con)
        names = [r[0] for r in self.con.execute("SELECT DISTINCT name FROM _cells ORDER BY name").fetchall()]
        self.names = names
        self.con.execute("CREATE OR REPLACE TEMP TABLE _skip AS SELECT unnest(?::VARCHAR[]) AS name",
                         [[n for n in names if skip(n)]])
        self._keep = "x.name NOT IN (SELECT name FROM _skip)"
        self._from = "FROM _spans x JOIN _streams s ON s.sid = x.sid JOIN _frank f ON f.fid = x.fid"
        self._cells = "FROM _cells x JOIN _streams s ON s.sid = x.sid JOIN _frank f ON f.fid = x.fid"
        self._parts: list = []

    def cells(self, group: dict) -> Iterator[tuple]:
        """The summed duration, first start and last end of each rank's spans per (attempt, peer
        group, span name) and step (``group``: sid -> its peer group; spans with a step, those
        ``skip`` keeps): per group, by its first span's position, ``((attempt, group, name),
        columns)``, ``columns`` (``step``, ``rank``, ``dur``, ``lo``, ``hi``; ``cpu`` and
        ``cpu_dur``: the CPU and wall time of the spans that carry their CPU time, None without
        any, as lists; None when no cell of the group has any), by the position of each cell's
        first span, as NumPy arrays. Read from the stored cells (:mod:`.cells`: one row per
        session, span name and step of each segment)."""
        by = self.run.by_sid
        parts = self._parts = list(dict.fromkeys((st.attempt, group[sid]) for sid, st in by.items()))
        code = {p: i for i, p in enumerate(parts)}
        self.con.execute("CREATE OR REPLACE TEMP TABLE _grp AS SELECT unnest(?::INTEGER[]) AS sid, "
                         "unnest(?::INTEGER[]) AS gcode, unnest(?::INTEGER[]) AS attempt, unnest(?::INTEGER[]) AS rank",
                         [list(by), [code[(st.attempt, group[sid])] for sid, st in by.items()],
                          [st.attempt for st in by.values()], [st.rank for st in by.values()]])
        self.con.execute("CREATE OR REPLACE TEMP TABLE _nid AS SELECT unnest(?::VARCHAR[]) AS name, "
                         "unnest(?::INTEGER[]) AS nid", [self.names, list(range(len(self.names)))])
        self.con.execute(
            f"CREATE OR REPLACE TEMP TABLE _dcells AS SELECT g.gcode, n.nid, x.step, g.rank, sum(x.dur)::BIGINT AS dur, "
            f"min(x.lo + s.offset_us) AS lo, max(x.hi + s.offset_us) AS hi, sum(x.cpu)::BIGINT AS cpu, "
            f"sum(x.cpu_dur)::BIGINT AS cpu_dur, min({_ORDER}) AS pos, arg_min(x.sid, {_ORDER}) AS sid {self._cells} "
            f"JOIN _grp g ON g.sid = x.sid JOIN _nid n ON n.name = x.name WHERE x.step IS NOT NULL AND {self._keep} "
            "GROUP BY ALL")
        t = self.con.execute("SELECT gcode, nid, step, rank, dur, lo, hi, cpu, cpu_dur, pos FROM _dcells").fetchnumpy()
        for (gc, nid), cols in _by_group(t, len(self.names)):
            yield (*parts[gc], self.names[nid]), cols

    def streams_of_cells(self) -> list:
        """``(attempt, group, rank, sid)``: the session of the latest (by position) cell of each
        rank of a group (after :meth:`cells`)."""
        rows = self.con.execute("SELECT gcode, rank, arg_max(sid, pos) FROM _dcells GROUP BY ALL").fetchall()
        return [(*self._parts[gc], rank, sid) for gc, rank, sid in rows]

    def step_walls(self) -> list:
        """``(attempt, step, first start, last end)`` over the spans :meth:`cells` counts (after it)."""
        return self.con.execute("SELECT p.attempt, c.step, min(c.lo), max(c.hi) FROM _dcells c JOIN "
                                "(SELECT DISTINCT gcode, attempt FROM _grp) p USING (gcode) GROUP BY ALL").fetchall()

    def drop_cells(self) -> None:
        """Frees what :meth:`cells` computed (after :meth:`streams_of_cells` and :meth:`step_walls`)."""
        self.con.execute("DROP TABLE IF EXISTS _dcells")

    def longest(self) -> list:
        """``(sid, name, longest duration)`` over every finished span."""
        return self.con.execute("SELECT sid, name, max(dur_max) FROM _cells GROUP BY ALL").fetchall()

    def windows(self) -> list:
        """``(sid, first start, last end, spans without a step)`` per session, of the spans
        ``skip`` keeps."""
        return self.con.execute(
            f"SELECT x.sid, min(x.lo + s.offset_us), max(x.hi + s.offset_us), "
            f"coalesce(sum(x.n) FILTER (WHERE x.step IS NULL), 0) {self._cells} WHERE {self._keep} GROUP BY ALL").fetchall()

    def last_steps(self) -> list:
        """``(sid, step)``: the step of each session's last ``set_step`` or stepped span (those
        ``skip`` keeps), in the reader's order (None when that ``set_step`` set none)."""
        return self.con.execute(
            f"SELECT sid, first(step ORDER BY k DESC) FROM ("
            f"SELECT x.sid, x.step, (f.rnk::BIGINT << 40) + x.off_last AS k {self._cells} "
            f"WHERE x.step IS NOT NULL AND {self._keep} "
            f"UNION ALL SELECT x.sid, x.step, {_ORDER} FROM _events x JOIN _frank f ON f.fid = x.fid "
            f"WHERE x.kind = 'step') GROUP BY sid").fetchall()

    def intervals(self, names: list, sids: "list | None" = None) -> list:
        """``(sid, name, start, end, step)`` of every span named one of ``names`` (of sessions
        ``sids``: all when None) that ``skip`` keeps, in the reader's order."""
        where = f"x.name IN (SELECT unnest(?::VARCHAR[])) AND {self._keep}"
        params: list = [list(names)]
        if sids is not None:
            where += " AND x.sid IN (SELECT unnest(?::INTEGER[]))"
            params.append(list(sids))
        return self.con.execute(f"SELECT x.sid, x.name, x.start + s.offset_us, x.start + x.dur + s.offset_us, x.step "
                                f"{self._from} WHERE {where} ORDER BY {_ORDER}", params).fetchall()

    def marks(self, sids: list) -> list:
        """``(sid, step, time, position)`` of the first ``set_step`` of each step (in the reader's
        order: its position), per session of ``sids``."""
        return self.con.execute(
            f"SELECT x.sid, x.step, first(x.ts + s.offset_us ORDER BY {_ORDER}), min({_ORDER}) FROM _events x "
            "JOIN _streams s ON s.sid = x.sid JOIN _frank f ON f.fid = x.fid WHERE x.kind = 'step' "
            "AND x.sid IN (SELECT unnest(?::INTEGER[])) GROUP BY ALL", [list(sids)]).fetchall()

    def opens(self) -> list:
        """The spans still open as the reader's ``OPEN`` items, per session in the order the
        reader ends them (its last file's), then in the order they began."""
        rows = self.con.execute(
            "SELECT x.sid, x.lane, x.name, x.step, x.start + s.offset_us, x.flow, x.flow_t, x.attrs FROM _opens x "
            "JOIN _streams s ON s.sid = x.sid LEFT JOIN _frank f ON f.fid = x.fid ORDER BY f.rnk, x.sid, x.off").fetchall()
        by = self.run.by_sid
        return [(OPEN, by[sid], lane, name, step, ts, extras(None, flow, ft, attrs, None))
                for sid, lane, name, step, ts, flow, ft, attrs in rows]


def _by_group(t: dict, names: int) -> Iterator[tuple]:
    """``((gcode, nid), columns)`` of the cells in ``t`` (NumPy columns ``gcode``, ``nid``, those
    of :data:`_COLS`, ``pos``; ``cpu`` and ``cpu_dur`` masked where null): per group, by its first
    cell's position; its cells by position."""
    data = {k: np.ma.getdata(v) for k, v in t.items() if k not in _NULLABLE}
    gkey = data["gcode"].astype(np.int64) * max(names, 1) + data["nid"]
    pos = data["pos"]
    order = np.argsort(pos)  # positions are unique: the order is total
    small = gkey.dtype if not len(gkey) or gkey.max() >= 1 << 15 else np.int16  # sorted by radix
    order = order[np.argsort(gkey[order].astype(small), kind="stable")]
    gsorted = gkey[order]
    starts = np.flatnonzero(np.r_[True, gsorted[1:] != gsorted[:-1]]) if len(order) else np.empty(0, np.int64)
    ends = np.r_[starts[1:], len(order)].astype(np.int64)
    for i in np.argsort(pos[order[starts]], kind="stable").tolist():
        idx = order[starts[i]:ends[i]]
        g = int(gsorted[starts[i]])
        cols = {k: _pylist(t[k], idx) if k in _NULLABLE else data[k][idx] for k in _COLS}
        yield divmod(g, max(names, 1)), cols


def _pylist(col: Any, idx: Any) -> "list | None":
    """Rows ``idx`` of a NumPy column, masked where null, as a list (None where it is null), or
    None when every one of them is null."""
    part = col[idx]
    mask = np.ma.getmaskarray(part)
    return None if mask.all() else part.tolist()
