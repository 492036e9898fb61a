"""Run directories written in the documented on-disk formats (``events/*.jsonl`` schema v1,
``metrics.jsonl``) with planted faults, for doctor and alert tests that need exact timings.

    write_timeline(run_dir, {"trainer": 2}, steps=40, spans=lambda mesh, rank, step: [("train", 0.01)])
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

T0_US = 1_763_860_000_000_000
START = 1_763_860_000.0

SpanFn = Callable[[str, int, int], "list[tuple[str, float]]"]


def _header(mesh: str, rank: int, ws: int, actor: str, pid: int, ctl: bool = False) -> dict:
    return {"h": 1, "v": 1, "run": "t", "start": START, "session": f"s{pid}", "host": "node0", "pid": pid,
            "mesh": mesh, "actor": actor, "rank": rank, "coords": {"procs": rank}, "ws": ws, "ctl": ctl,
            "ranks": "all", "t0": T0_US, "file": 0}


def write_timeline(run_dir: Path, meshes: dict[str, int], steps: int, spans: SpanFn, *,
                   gap_s: float = 0.002, startup_s: float = 0.0, wait_s: Callable[[int], float] | None = None,
                   actors: dict[str, str] | None = None, open_at: dict | None = None,
                   dead: dict | None = None, coords: "Callable[[str, int], dict] | None" = None) -> None:
    """One file per (mesh, rank) plus the controller's. Every step starts when the slowest rank of
    the previous one ended (+ ``gap_s``); a rank's spans run back to back from the step's start.

    ``spans(mesh, rank, step)`` -> ``[(name, seconds), ...]``; ``wait_s(step)``: the controller's
    ``wait_for_batch`` at the start of its ``controller_step`` (concurrent with the ranks' work); ``startup_s``: a one-off ``startup`` span on
    the controller before step 0; ``open_at[(mesh, rank)] = (step, name)``: that span never ends
    and the process writes nothing after it; ``dead[(mesh, rank)] = step``: the process stops
    writing at that step without closing its file. ``coords(mesh, rank)``: the rank's coordinates
    in the header (default ``{"procs": rank}``)."""
    ev = Path(run_dir) / "events"
    ev.mkdir(parents=True, exist_ok=True)
    actors = actors or {}
    open_at = open_at or {}
    dead = dead or {}
    streams: dict[tuple, dict] = {}
    pid = 100
    for mesh, n in meshes.items():
        for r in range(n):
            pid += 1
            streams[(mesh, r)] = {"h": _header(mesh, r, n, actors.get(mesh, mesh.capitalize()), pid), "lines": [],
                                  "names": {}, "stopped": False}
            if coords is not None:
                streams[(mesh, r)]["h"]["coords"] = coords(mesh, r)
    ctl = {"h": _header("controller", 0, 1, "", 1, ctl=True), "lines": [], "names": {}, "stopped": False}

    def name_id(s: dict, name: str) -> int:
        if name not in s["names"]:
            s["names"][name] = len(s["names"]) + 1
            s["lines"].append(["N", s["names"][name], name])
        return s["names"][name]

    for s in [*streams.values(), ctl]:
        s["lines"].append(["L", 0, "main", 1])
    t = 0
    if startup_s:
        ctl["lines"].append([0, int(startup_s * 1e6), 0, name_id(ctl, "startup"), None])
        t = int(startup_s * 1e6) + 1000
    for step in range(steps):
        start = t
        end = start
        ctl["lines"].append(["S", start, 0, step])
        w = int((wait_s(step) if wait_s else 0.0) * 1e6)
        for (mesh, r), s in streams.items():
            if s["stopped"]:
                continue
            if dead.get((mesh, r)) == step:
                s["stopped"] = True
                continue
            s["lines"].append(["S", start, 0, step])
            ts = start
            for name, sec in spans(mesh, r, step):
                if open_at.get((mesh, r)) == (step, name):
                    s["lines"].append(["B", 1, ts, 0, name_id(s, name), step])
                    s["stopped"] = True
                    break
                d = max(1, int(sec * 1e6))
                s["lines"].append([ts, d, 0, name_id(s, name), step])
                ts += d
            end = max(end, ts)
        end += int(gap_s * 1e6)
        wid = name_id(ctl, "wait_for_batch")
        sid = name_id(ctl, "controller_step")
        if w:
            ctl["lines"].append([start, w, 0, wid, step])
        ctl["lines"].append([start, end - start, 0, sid, step])
        t = end
    for s in [*streams.values(), ctl]:
        if not s["stopped"]:
            s["lines"].append(["Z", t])
    for (mesh, r), s in [*streams.items(), (("controller", 0), ctl)]:
        path = ev / f"node0_{s['h']['pid']}_{mesh}_{r}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in [s["h"], *s["lines"]]))


def write_metrics(run_dir: Path, steps: int, sources: list[dict], values: Callable[[dict, int], dict],
                  missing: Callable[[int], list] | None = None) -> None:
    """``metrics.jsonl``: per step, one per_rank_reduce row per source (``values(source, step)``,
    skipped when empty) and the global row (mean over the sources that reported the key)."""
    rows = []
    for step in range(steps):
        acc: dict[str, list] = {}
        per = []
        for src in sources:
            v = values(src, step)
            if not v:
                continue
            per.append({"run_id": "t", "step": step, "mode": "per_rank_reduce", "wall_time": START + step,
                        "source": src, "metrics": v})
            for k, x in v.items():
                acc.setdefault(k, []).append(x)
        g = {k: (math.nan if any(isinstance(x, float) and math.isnan(x) for x in xs) else sum(xs) / len(xs))
             for k, xs in acc.items()}
        row: dict[str, Any] = {"run_id": "t", "step": step, "mode": "global_reduce", "wall_time": START + step,
                               "metrics": g}
        m = missing(step) if missing else []
        if m:
            row["missing"] = m
        rows.append(row)
        rows.extend(per)
    with open(Path(run_dir) / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def source(mesh: str, rank: int, actor: str = "", pid: int = 0) -> dict:
    label = f"{mesh}/{actor}/r{rank}" if actor else f"{mesh}/r{rank}"
    return {"host": "node0", "pid": pid or 200 + rank, "mesh": mesh, "actor": actor, "rank": rank,
            "coords": {"procs": rank}, "world_size": 0, "label": label}
