"""Load a Chrome/Perfetto JSON trace the way Perfetto's JSON importer does, and check it.

Perfetto's ``trace_processor`` (PyPI ``perfetto``) downloads its ``trace_processor_shell``
binary on first use; where that is impossible (no internet) this module is the fallback check.
It applies the importer's rules that matter for our traces: every ``X`` slice has numeric
``ts``/``dur`` and an integer ``pid``/``tid``; slices on one thread track nest strictly (Perfetto
drops a slice that partially overlaps its parent); flow ``s``/``f`` pairs share an id and each
end binds to a slice that encloses its timestamp on its thread; every process has a name.

    summary = load("trace.json")   # raises TraceError on a violation
    summary.slices["train_step"], summary.process_names[pid], summary.flows, summary.unfinished
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TraceError(ValueError):
    pass


@dataclass
class TraceSummary:
    slices: Counter = field(default_factory=Counter)  # name -> count
    process_names: dict = field(default_factory=dict)  # pid -> name
    thread_names: dict = field(default_factory=dict)  # (pid, tid) -> name
    flows: list = field(default_factory=list)  # [(src slice name, src pid, dst slice name, dst pid)]
    unfinished: list = field(default_factory=list)  # X events with args.unfinished
    errors: list = field(default_factory=list)  # X events with args.error
    instants: Counter = field(default_factory=Counter)
    events: list = field(default_factory=list)


def load(path: "str | Path") -> TraceSummary:
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    s = TraceSummary(events=evs)
    by_track: dict[tuple, list] = defaultdict(list)
    flow_ends: dict[Any, dict] = defaultdict(dict)
    for e in evs:
        ph = e.get("ph")
        if ph == "X":
            for k in ("ts", "dur"):
                if not isinstance(e.get(k), (int, float)) or e[k] < 0:
                    raise TraceError(f"slice without a valid {k}: {e}")
            if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
                raise TraceError(f"slice without integer pid/tid: {e}")
            s.slices[e["name"]] += 1
            by_track[(e["pid"], e["tid"])].append(e)
            args = e.get("args") or {}
            if args.get("unfinished"):
                s.unfinished.append(e)
            if "error" in args:
                s.errors.append(e)
        elif ph == "i":
            s.instants[e["name"]] += 1
            by_track[(e["pid"], e["tid"])].append(dict(e, dur=0))
        elif ph == "M":
            if e["name"] == "process_name":
                s.process_names[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                s.thread_names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif ph in ("s", "f"):
            if ph in flow_ends[e["id"]]:
                raise TraceError(f"flow id {e['id']} has two '{ph}' events")
            flow_ends[e["id"]][ph] = e
    # strict nesting per thread track (what Perfetto's slice tracker requires)
    for track, sl in by_track.items():
        sl.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []
        for e in sl:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                raise TraceError(f"slice {e['name']}@{e['ts']} overlaps its parent {stack[-1]['name']} on {track}")
            if e["dur"] > 0:
                stack.append(e)
    for pid, _tid in by_track:
        if pid not in s.process_names:
            raise TraceError(f"process {pid} has no process_name")

    def enclosing(ev: dict) -> dict:
        best = None
        for c in by_track.get((ev["pid"], ev["tid"]), ()):
            if c["ts"] <= ev["ts"] <= c["ts"] + c["dur"] and (best is None or c["dur"] <= best["dur"]):
                best = c
        if best is None:
            raise TraceError(f"flow event binds to no slice: {ev}")
        return best

    for fid, ends in flow_ends.items():
        if set(ends) != {"s", "f"}:
            raise TraceError(f"flow {fid} is missing an end: {sorted(ends)}")
        a, b = enclosing(ends["s"]), enclosing(ends["f"])
        s.flows.append((a["name"], a["pid"], b["name"], b["pid"]))
    return s


def perfetto_shell() -> str | None:
    """Path of a usable ``trace_processor_shell``: ``$FORGE_OBS_TRACE_PROCESSOR`` or on PATH."""
    import os
    import shutil

    p = os.environ.get("FORGE_OBS_TRACE_PROCESSOR") or shutil.which("trace_processor_shell")
    return p if p and os.path.isfile(p) and os.access(p, os.X_OK) else None
