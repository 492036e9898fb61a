"""The child process of the ``critical_path`` backend: it reads each controller step's critical path
once the step settled and writes it to its stdout as one JSON line (:func:`step_line`).

    python -m forge_obs.alerts.path_worker RUN_DIR [--interval-s 1.0] [--settle-s 2.0] [--update]
                                           [--cpu-share 0.02] [--parent PID] [--since EPOCH_S]

A step's spans reach ``events/*.jsonl`` as each process's timeline writer passes (every
``flush_interval_s``, 0.5 s by default; a span open longer than ``open_after_s`` as a "begun"
record), so a step is *settled* ``settle_s`` after it ended: its path is read then, once. The
source is the run's index (:func:`forge_obs.analysis.index.open_index`, the stored per-step
results: a lookup), brought up to date here (``--update``) unless the ``index`` backend's live
indexer does it; without DuckDB and pyarrow the files are walked directly (every pass reads the
run). A pass waits longer after a pass that cost more: ``cpu_share`` of a core at most (up to
:data:`MAX_WAIT_S` between passes; the steps of a longer wait are read in one pass). It runs at a low
priority, apart from the controller's GIL: it never delays a flush. On SIGTERM (the backend's
``finish``) or when the controller is gone, it waits one writer pass, writes every step left
(settled or not, unfinished ones too) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from forge_obs.core.procs import StopSignals, parent_alive

__all__ = ["step_line", "results", "follow", "main", "TOP_STAGES", "MAX_WAIT_S"]

#: stages (mesh, actor, span name: over the ranks) a line carries, the largest first
TOP_STAGES = 24
#: the longest wait between two passes (the CPU budget makes a costly pass wait longer)
MAX_WAIT_S = 10.0


def _label(mesh: str, actor: Any, name: str) -> str:
    """``trainer/forward_backward``: a stage over its ranks, and over the replicas of a replicated
    mesh (``generator/generate`` for ``generator_0`` and ``generator_1``); ``mesh/actor/name``
    when the actor's name is not the mesh's."""
    from forge_obs.analysis.doctor.subjects import replica_family

    fam = replica_family(str(mesh))
    act = str(actor or "")
    if fam != mesh or not act or act.lower() == str(mesh).lower():
        return f"{fam}/{name}"
    return f"{mesh}/{act}/{name}"


def step_line(r: dict) -> dict:
    """One step's result (:func:`forge_obs.analysis.critical_path.why`'s) as the compact line the
    backend reads: time on the path per stage over its ranks and replicas (the largest :data:`TOP_STAGES`,
    the rest as ``"other"``), per replica family its ranks' mean idle and largest waiting time,
    the cause, the answer and how much of the step the spans explain."""
    from forge_obs.analysis.doctor.subjects import replica_family

    by: dict[str, float] = {}
    for a in r["stages"]:
        k = _label(a["mesh"], a["actor"], a["name"])
        by[k] = by.get(k, 0.0) + a["path_s"]
    top = sorted(by.items(), key=lambda kv: -kv[1])
    stages = dict(top[:TOP_STAGES])
    if len(top) > TOP_STAGES:
        stages["other"] = sum(v for _k, v in top[TOP_STAGES:])
    fam: dict[str, list] = {}
    for s in r["slack"]:
        f = fam.setdefault(replica_family(s["mesh"]), [0.0, 0.0, 0])
        f[0] += s["idle_s"]
        f[1] = max(f[1], s["waiting_s"])
        f[2] += 1
    c = r.get("cause")
    u = r.get("unexplained") or {}
    return {"step": r["step"], "duration_s": r["duration_s"], "end_us": r["end_us"], "unfinished": r["unfinished"],
            "explained": r.get("explained", 1.0), "unexplained_s": u.get("total_s", 0.0),
            "unexplained_where": (u.get("top") or {}).get("where") if u.get("leads") else None,
            "answer": r.get("answer", ""),
            "cause": None if c is None else {k: c.get(k) for k in ("mesh", "actor", "rank", "name", "path_s", "share",
                                                                    "ratio_to_median", "unfinished")},
            "stages": stages, "slack": {k: [v[0] / v[2], v[1]] for k, v in fam.items()}}


def results(run_dir: Path, after: "int | None", update: bool) -> list:
    """The results of the steps after ``after`` (every step when None), with their answers."""
    from forge_obs.analysis.critical_path import analyse
    from forge_obs.analysis.index import available, open_index

    first = -(1 << 62) if after is None else after + 1
    if not available():
        return analyse(run_dir, index=False, first=first)
    if update:
        open_index(run_dir, warn=False)
    return analyse(run_dir, first=first, update=False)


def _pass(run_dir: Path, after: "int | None", settle_us: int, final: bool, update: bool,
          write: Callable[[dict], None], since_us: int = 0) -> "int | None":
    """Write the settled steps after ``after`` (``final``: every step) that began after
    ``since_us`` (a resumed run's earlier steps were another session's); the last step written."""
    now_us = int(time.time() * 1e6)
    for r in results(run_dir, after, update):
        if r["start_us"] < since_us:
            after = r["step"] if after is None else max(after, r["step"])
            continue
        if not final and r["end_us"] > now_us - settle_us:
            break  # steps are written in order: a later one waits for this one (a hung step's end
            # is the end of the data: it settles when the data stops growing)
        write(step_line(r))
        after = r["step"]
    return after


def follow(run_dir: Path, write: Callable[[dict], None], interval_s: float = 1.0, settle_s: float = 2.0,
           update: bool = True, cpu_share: float = 0.02, parent: "int | None" = None,
           stop: "threading.Event | None" = None, final_wait_s: float = 1.0, since: float = 0.0) -> int:
    """Write each settled step's line until ``stop`` is set or process ``parent`` is gone; then,
    ``final_wait_s`` later (the timeline writers' last pass), every step left. Only the steps
    that began after ``since`` (epoch seconds: the backend's start). Returns the number of steps
    written."""
    stop = stop or threading.Event()
    signals = StopSignals(stop)
    after: "int | None" = None
    n = [0]
    passes = 0

    def counted(line: dict) -> None:
        n[0] += 1
        write(line)

    while True:
        final = stop.is_set() or (parent is not None and not parent_alive(parent))
        if final:
            time.sleep(final_wait_s)
        cost = time.process_time()
        if (run_dir / "events").is_dir():
            try:
                after = _pass(run_dir, after, int(settle_s * 1e6), final, update, counted, int(since * 1e6))
            except Exception as e:  # noqa: BLE001 - the next pass tries again; the files are the record
                print(f"forge_obs critical_path: {run_dir}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if final:
            return n[0]
        cost = time.process_time() - cost
        passes += 1  # the first pass pays the imports: not a pass's cost
        wait = max(interval_s, cost / cpu_share - cost) if cpu_share > 0 and passes > 1 else interval_s
        signals.wait(min(wait, MAX_WAIT_S))



def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forge_obs.alerts.path_worker", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--interval-s", type=float, default=1.0)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--cpu-share", type=float, default=0.02)
    ap.add_argument("--update", action="store_true", help="bring the index up to date (no live indexer runs)")
    ap.add_argument("--parent", type=int, default=None)
    ap.add_argument("--since", type=float, default=0.0, help="only the steps that began after (epoch seconds)")
    args = ap.parse_args(argv)
    stop = threading.Event()
    out = sys.stdout

    def write(line: dict) -> None:
        out.write(json.dumps(line, default=str) + "\n")
        out.flush()

    follow(args.run_dir, write, args.interval_s, args.settle_s, args.update, args.cpu_share, args.parent, stop,
           since=args.since)
    return 0


if __name__ == "__main__":
    sys.exit(main())
