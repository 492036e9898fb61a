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
from forge_obs.analysis.critical_path.summary import Busy, cause, idle_mesh, step_result
from forge_obs.analysis.critical_path.graph import Graph, build, controller_streams
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
        r = step_result(g, walker, busy, w)
        n = r["step"]
        for i, p in enumerate(r["path"]):
            self.cols.add("path", (n, i, p["mesh"], p["actor"], p["rank"], p["host"], p["pid"], p["task"], p["name"],
                                   p["step"] if type(p["step"]) is int else None, p["start_us"], p["end_us"],
                                   p["duration_s"], p["link"], p["controller"], p["wait"], p["unfinished"],
                                   p["unexplained"]))
        for i, a in enumerate(r["stages"]):
            self.cols.add("stages", (n, i, a["mesh"], a["actor"], a["rank"], a["name"], a["path_s"], a["share"],
                                     a["controller"], a["wait"], a["root"], a["unfinished"]))
        for x in r["slack"]:
            self.cols.add("slack", (n, x["mesh"], x["actor"], x["rank"], x["host"], x["pid"], x["busy_s"],
                                    x["waiting_s"], x["idle_s"], x["on_path_s"]))
        c = cause(r)
        idle = idle_mesh(r, c["mesh"]) if c is not None else None
        self.cols.add("steps", (n, r["root"], r["start_us"], r["end_us"], r["duration_s"], r["unfinished"],
                                r["stages"].index(c) if c is not None else None,
                                idle["mesh"] if idle else None, idle["idle_s"] if idle else None))


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
    span_t = tuples(spans)
    open_t = tuples(opens)
    call_t = {link: (by_sid[sid], lane, ts) for link, (sid, lane, ts) in calls.items()}
    return build(run, ctl, span_t, open_t, call_t, first, end)


def offsets_key(offsets: dict) -> str:
    return json.dumps(sorted(offsets.items()))
