"""Per controller step, computed once when the step is indexed: its critical path, stages,
slack, and the stage its one-line answer names (:mod:`forge_obs.analysis.critical_path`, whose
walk and summary are used as they are).

A step is computed again when rows arrive that could change it: the update knows the earliest
time of its new rows (and of the spans still open, which end at the end of the data), and every
stored step that ends after that time (less a margin: a dependency on another host may overshoot
by ``skew_tol_s``) is replaced. The graph it is computed on holds every span that ends after the
first replaced step began, and everything those spans need: the spans that contain them (their
ancestors), the spans inside those (their waits), and the spans that made the endpoint calls
they serve.
"""

from __future__ import annotations

import json
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.critical_path.summary import Busy, cause_index, idle_of, step_tables
from forge_obs.analysis.critical_path.graph import Graph, Span, build_spans, controller_streams, stream_who
from forge_obs.analysis.critical_path.walk import PathConfig, Walker
from forge_obs.analysis.index.rows import FLOW_INT, FLOW_STR, Columns

__all__ = ["step_rows", "graph_from", "MARGIN_US", "StepSet"]

#: how far before a new row a stored step may still change (2 x the default skew_tol_s, + tie_s)
MARGIN_US = 2 * int(PathConfig().skew_tol_s * 1e6) + int(PathConfig().tie_s * 1e6)


def _flow(text: Any, ft: Any) -> Any:
    if text is None:
        return None
    return int(text) if ft == FLOW_INT else text


class StepSet:
    """The rows of the computed steps (``steps``, ``path``, ``stages``, ``slack``)."""

    def __init__(self) -> None:
        self.cols = Columns("steps", "path", "stages", "slack")

    def add(self, g: Graph, walker: Walker, busy: Busy, w: Any) -> None:
        root, total_s, unfinished, segs, stages, slack = step_tables(g, walker, busy, w)
        n = w.step
        cols = self.cols
        add = cols["path"].append
        for i, p in enumerate(segs):  # p: mesh actor rank host pid name task step start end dur link ctl wait unf gap
            add((n, i, p[0], p[1], p[2], p[3], p[4], p[6], p[5], p[7] if type(p[7]) is int else None, p[8], p[9],
                 p[10], p[11], p[12], p[13], p[14], p[15]))
        add = cols["stages"].append
        for i, a in enumerate(stages):  # a: mesh actor rank name path_s controller wait root unfinished share
            add((n, i, a[0], a[1], a[2], a[3], a[4], a[9], a[5], a[6], a[7], a[8]))
        cols["slack"] += [(n, *x) for x in slack]
        c = cause_index([(a[7], a[6]) for a in stages])
        idle = idle_of([(x[0], x[7], x[5]) for x in slack], stages[c][0]) if c is not None else None
        cols.add("steps", (n, root, w.start, w.end, total_s, unfinished, c, idle[0] if idle else None,
                           idle[1] if idle else None))


def step_rows(g: Graph, windows: list, cfg: PathConfig | None = None) -> StepSet:
    """The rows of ``windows`` (of ``g``)."""
    out = StepSet()
    if windows:
        walker = Walker(g, cfg)
        busy = Busy(g, walker)
        for w in windows:
            out.add(g, walker, busy, w)
    return out


def streams_of(sessions: list, lanes: dict, offsets: dict, attempts: list) -> dict:
    """sid -> :class:`~forge_obs.analysis.reader.Stream` of the manifest's sessions, with their
    clock offsets and attempts applied (times corrected), and their lane labels."""
    out = {}
    for s in sessions:
        h = s["header"]
        st = reader.Stream(key=tuple(s["key"]), header=h, actor=s["actor"])
        st.offset_us = offsets.get(st.host, 0)
        st.attempt = attempts.index(h.get("start")) if h.get("start") in attempts else 0
        st.first_ts = None if s["first_ts"] is None else s["first_ts"] + st.offset_us
        st.last_ts = None if s["last_ts"] is None else s["last_ts"] + st.offset_us
        st.clean, st.records, st.dropped = s["clean"], s["records"], s["dropped"]
        st.lanes = lanes.get(s["sid"], {})
        out[s["sid"]] = st
    return out


def graph_from(run: reader.Run, by_sid: dict, spans: list, opens: list, calls: dict, steps: list,
               end: int) -> Graph:
    """The span graph of index rows (in reading order): ``spans`` and ``opens`` as rows of sid,
    lane, name, step, start (corrected), dur, flow, flow_t, link; ``calls`` link -> (sid, lane,
    ts); ``steps`` [(sid, step, ts)] of ``set_step`` records, by reading order."""
    def tuples(rows: list) -> list:
        return [(by_sid[sid], lane, name, step, ts, dur, f if ft == FLOW_STR or f is None else _flow(f, ft), link)
                for sid, lane, name, step, ts, dur, f, ft, link in rows]

    ctl = controller_streams(by_sid.values())
    ctl_ids = {id(st) for st in ctl}
    first: dict[int, int] = {}
    for sid, n, ts in steps:
        if id(by_sid[sid]) in ctl_ids and n is not None:
            first.setdefault(n, ts)
    who = {sid: stream_who(st) for sid, st in by_sid.items()}
    made = [Span(by_sid[sid], lane, name, step, ts, max(dur, 0), f if ft == FLOW_STR or f is None else _flow(f, ft),
                 False, who[sid], link) for sid, lane, name, step, ts, dur, f, ft, link in spans]
    call_t = {link: (by_sid[sid], lane, ts) for link, (sid, lane, ts) in calls.items()}
    return build_spans(run, ctl, made, tuples(opens), call_t, first, end)


def offsets_key(offsets: dict) -> str:
    return json.dumps(sorted(offsets.items()))
