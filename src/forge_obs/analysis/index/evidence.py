"""The doctor's per-step evidence, read from the index: what its timeline rules need of every
span, aggregated by DuckDB over the stored rows, so that only aggregates reach Python.

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
    >>> [(key, c["step"], c["rank"]) for key, c in ev.cells({sid: "main" for sid in ev.run.by_sid})]
    [((0, 'main', 'train_step'), [2], [0])]

Every answer is keyed by the process session (``sid``, :func:`forge_obs.analysis.index.timeline.sessions`)
and comes in the reader's order (the files in their reading order, then each record's byte
offset), the order in which a pass over the records (:func:`forge_obs.analysis.reader.walk`)
meets them. ``skip(name)`` drops spans by name (the doctor's start-up and teardown spans) from
everything but :meth:`Evidence.longest`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from forge_obs.analysis.index.timeline import extras, sessions
from forge_obs.analysis.reader import OPEN

__all__ = ["Evidence"]

#: a row's position in the reader's order: its file's rank, then its byte offset
_ORDER = "(f.rnk::BIGINT << 40) + x.off"


class Evidence:
    """Queries over one index (see the module docstring); ``run``: its sessions as a
    :class:`~forge_obs.analysis.reader.Run` (``run.by_sid``)."""

    def __init__(self, idx: Any, skip: Callable[[str], bool], con: Any = None) -> None:
        self.idx = idx
        self.con = con or idx.connect()
        self.run = sessions(idx, self.con)
        names = [r[0] for r in self.con.execute("SELECT DISTINCT name FROM _spans").fetchall()]
        self.names = names
        self.con.execute("CREATE OR REPLACE TEMP TABLE _skip AS SELECT unnest(?::VARCHAR[]) AS name",
                         [[n for n in names if skip(n)]])
        self._keep = "x.name NOT IN (SELECT name FROM _skip)"
        self._from = "FROM _spans x JOIN _streams s ON s.sid = x.sid JOIN _frank f ON f.fid = x.fid"

    def cells(self, group: dict) -> Iterator[tuple]:
        """The summed duration, first start and last end of each rank's spans per (attempt, peer
        group, span name) and step (``group``: sid -> its peer group; spans with a step, those
        ``skip`` keeps): per group, by its first span's position, ``((attempt, group, name),
        columns)``, ``columns`` (``step``, ``rank``, ``dur``, ``lo``, ``hi``; ``cpu`` and
        ``cpu_dur``: the CPU and wall time of the spans that carry their CPU time, None without
        any) as lists, by the position of each cell's first span. One group's columns are in memory at a time."""
        by = self.run.by_sid
        self.con.execute("CREATE OR REPLACE TEMP TABLE _grp AS SELECT unnest(?::INTEGER[]) AS sid, "
                         "unnest(?::INTEGER[]) AS attempt, unnest(?::VARCHAR[]) AS grp, unnest(?::INTEGER[]) AS rank",
                         [list(by), [st.attempt for st in by.values()], [group[sid] for sid in by],
                          [st.rank for st in by.values()]])
        self.con.execute(
            f"CREATE OR REPLACE TEMP TABLE _cells AS SELECT g.attempt, g.grp, x.name, x.step, g.rank, "
            f"sum(x.dur)::BIGINT AS dur, min(x.start + s.offset_us) AS lo, max(x.start + x.dur + s.offset_us) AS hi, "
            f"sum(x.cpu)::BIGINT AS cpu, (sum(x.dur) FILTER (WHERE x.cpu IS NOT NULL))::BIGINT AS cpu_dur, "
            f"min({_ORDER}) AS pos, arg_min(x.sid, {_ORDER}) AS sid {self._from} JOIN _grp g ON g.sid = x.sid "
            f"WHERE x.step IS NOT NULL AND {self._keep} GROUP BY ALL ORDER BY attempt, grp, name, pos")
        groups = self.con.execute("SELECT attempt, grp, name FROM _cells GROUP BY ALL ORDER BY min(pos)").fetchall()
        for attempt, grp, name in groups:
            cols = self.con.execute("SELECT step, rank, dur, lo, hi, cpu, cpu_dur FROM _cells WHERE attempt = ? AND grp = ? "
                                    "AND name = ? ORDER BY pos", [attempt, grp, name]).fetchnumpy()
            yield (attempt, grp, name), {k: v.tolist() for k, v in cols.items()}

    def streams_of_cells(self) -> list:
        """``(attempt, group, rank, sid)``: the session of the latest (by position) cell of each
        rank of a group (after :meth:`cells`)."""
        return self.con.execute("SELECT attempt, grp, rank, arg_max(sid, pos) FROM _cells GROUP BY ALL").fetchall()

    def step_walls(self) -> list:
        """``(attempt, step, first start, last end)`` over the spans :meth:`cells` counts (after it)."""
        return self.con.execute(
            f"SELECT g.attempt, x.step, min(x.start + s.offset_us), max(x.start + x.dur + s.offset_us) {self._from} "
            f"JOIN _grp g ON g.sid = x.sid WHERE x.step IS NOT NULL AND {self._keep} GROUP BY ALL").fetchall()

    def longest(self) -> list:
        """``(sid, name, longest duration)`` over every finished span."""
        return self.con.execute("SELECT sid, name, max(dur) FROM _spans GROUP BY ALL").fetchall()

    def windows(self) -> list:
        """``(sid, first start, last end, spans without a step)`` per session, of the spans
        ``skip`` keeps."""
        return self.con.execute(
            f"SELECT x.sid, min(x.start + s.offset_us), max(x.start + x.dur + s.offset_us), "
            f"count(*) FILTER (WHERE x.step IS NULL) {self._from} WHERE {self._keep} GROUP BY ALL").fetchall()

    def last_steps(self) -> list:
        """``(sid, step)``: the step of each session's last ``set_step`` or stepped span (those
        ``skip`` keeps), in the reader's order (None when that ``set_step`` set none)."""
        return self.con.execute(
            f"SELECT sid, first(step ORDER BY k DESC) FROM ("
            f"SELECT x.sid, x.step, {_ORDER} AS k {self._from} WHERE x.step IS NOT NULL AND {self._keep} "
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
