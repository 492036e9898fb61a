"""Streaming export of a run's timeline to the Chrome / Perfetto JSON trace format.

    forge-obs trace runs/exp1 -o trace.json [--steps 10:20] [--ranks 0,3] [--meshes trainer]

One process track per (mesh, rank) -- per process session, so a restarted job is a separate
track -- named with metadata events (mesh, actor, rank, host, pid, attempt); one thread track per
asyncio task / thread; flow arrows between spans/events that share a ``flow`` id (each point is
linked from the latest earlier point in another mesh, else from the previous point); spans still
open at the end of the data are drawn up to the last timestamp with ``args.unfinished = true``;
spans that raised carry ``args.error`` and category ``error``. Per-host clock offsets (estimated
against the controller) are applied. Memory: per-process state, flow points and open spans; the
records themselves are streamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forge_obs.timeline import reader
from forge_obs.timeline.reader import END, INSTANT, OPEN, SPAN, STEP, TAG

_dumps = json.dumps


def parse_steps(spec: str | None) -> tuple[int, int] | None:
    """``"10:20"`` (inclusive), ``"10:"``, ``":20"`` or ``"7"``."""
    if not spec:
        return None
    if ":" in spec:
        lo, hi = spec.split(":", 1)
        return (int(lo) if lo else -(2**62), int(hi) if hi else 2**62)
    return (int(spec), int(spec))


def parse_list(spec: str | None, cast: Any = str) -> set | None:
    if not spec:
        return None
    out: set = set()
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        if cast is int and "-" in part:
            lo, hi = part.split("-", 1)
            out.update(range(int(lo), int(hi) + 1))
        else:
            out.add(cast(part))
    return out


def make_keep(ranks: set | None, meshes: set | None) -> Any:
    if ranks is None and meshes is None:
        return None

    def keep(h: dict) -> bool:
        if meshes is not None and h.get("mesh") not in meshes:
            return False
        if ranks is not None and int(h.get("rank", 0)) not in ranks:
            return False
        return True

    return keep


def _mesh_order(mesh: str) -> int:
    return 0 if mesh == "controller" else 1


def export_trace(
    run_dir: "str | Path",
    out: "str | Path",
    steps: tuple[int, int] | None = None,
    ranks: set | None = None,
    meshes: set | None = None,
) -> dict[str, Any]:
    """Write ``out`` (Chrome JSON trace). Returns counts (slices, unfinished, flows, tracks)."""
    run = reader.scan(run_dir, make_keep(ranks, meshes))
    multi = len(run.attempts) > 1
    ordered = sorted(run.streams.values(), key=lambda s: (s.attempt, _mesh_order(s.mesh), s.mesh, s.rank, s.host, s.pid))
    next_pid = [1]

    def track(st: reader.Stream) -> int:
        if st.track is None:
            st.track = next_pid[0]
            next_pid[0] += 1
        return st.track

    for st in ordered:
        track(st)
    lo, hi = steps if steps is not None else (None, None)
    stats = {"slices": 0, "instants": 0, "unfinished": 0, "errors": 0, "flows": 0, "tracks": 0}
    flows: dict[str, list] = {}
    opens: list = []
    chunk: list[str] = []
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write('{"traceEvents":[\n')
        first = [True]

        def emit(lines: list[str]) -> None:
            if not lines:
                return
            if not first[0]:
                f.write(",\n")
            first[0] = False
            f.write(",\n".join(lines))

        for it in reader.walk(run):
            kind = it[0]
            if kind is SPAN:
                _k, st, lane, name, step, ts, dur, ex = it
                if lo is not None and (step is None or step < lo or step > hi):
                    continue
                pid = st.track if st.track is not None else track(st)
                if ex:
                    args = {"step": step}
                    cat = "span"
                    if "a" in ex:
                        args.update(ex["a"])
                    if "f" in ex:
                        args["flow"] = ex["f"]
                        flows.setdefault(_dumps(ex["f"], default=str), []).append((ts, pid, lane + 1, st.mesh))
                    if "e" in ex:
                        args["error"] = ex["e"]
                        cat = "error"
                        stats["errors"] += 1
                    chunk.append(
                        f'{{"ph":"X","cat":"{cat}","pid":{pid},"tid":{lane + 1},"ts":{ts},"dur":{dur},'
                        f'"name":{_dumps(name)},"args":{_dumps(args, default=str)}}}'
                    )
                else:
                    chunk.append(
                        f'{{"ph":"X","pid":{pid},"tid":{lane + 1},"ts":{ts},"dur":{dur},'
                        f'"name":{_dumps(name)},"args":{{"step":{"null" if step is None else step}}}}}'
                    )
                stats["slices"] += 1
            elif kind is INSTANT:
                _k, st, lane, name, step, ts, ex = it
                if lo is not None and (step is None or step < lo or step > hi):
                    continue
                pid = st.track if st.track is not None else track(st)
                args = {"step": step}
                if ex:
                    args.update(ex.get("a") or {})
                    if "f" in ex:
                        args["flow"] = ex["f"]
                        flows.setdefault(_dumps(ex["f"], default=str), []).append((ts, pid, lane + 1, st.mesh))
                chunk.append(
                    f'{{"ph":"i","s":"t","pid":{pid},"tid":{lane + 1},"ts":{ts},'
                    f'"name":{_dumps(name)},"args":{_dumps(args, default=str)}}}'
                )
                stats["instants"] += 1
            elif kind is STEP:
                _k, st, lane, step, ts = it
                if lo is not None and (step is None or step < lo or step > hi):
                    continue
                pid = st.track if st.track is not None else track(st)
                chunk.append(f'{{"ph":"i","s":"t","cat":"step","pid":{pid},"tid":{lane + 1},"ts":{ts},'
                             f'"name":"step","args":{{"step":{step}}}}}')
                stats["instants"] += 1
            elif kind is TAG:
                _k, st, lane, step, tag, ts = it
                if lo is not None and (step is None or step < lo or step > hi):
                    continue
                pid = st.track if st.track is not None else track(st)
                chunk.append(f'{{"ph":"i","s":"t","cat":"tag","pid":{pid},"tid":{lane + 1},"ts":{ts},'
                             f'"name":{_dumps("tag:" + str(tag))},"args":{{"step":{_dumps(step)},"tag":{_dumps(tag)}}}}}')
                stats["instants"] += 1
            elif kind is OPEN:
                _k, st, lane, name, step, ts, ex = it
                if lo is not None and (step is None or step < lo or step > hi):
                    continue
                opens.append(it)
            elif kind is END:
                pass
            if len(chunk) >= 8192:
                emit(chunk)
                chunk = []
        emit(chunk)
        chunk = []
        end = reader.run_end(run) or 0
        for _k, st, lane, name, step, ts, ex in opens:
            pid = track(st)
            args = {"step": step, "unfinished": True, "open_for_s": round((end - ts) / 1e6, 6)}
            if ex:
                args.update(ex.get("a") or {})
                if "f" in ex:
                    args["flow"] = ex["f"]
                    flows.setdefault(_dumps(ex["f"], default=str), []).append((ts, pid, lane + 1, st.mesh))
            chunk.append(
                f'{{"ph":"X","cat":"unfinished","pid":{pid},"tid":{lane + 1},"ts":{ts},"dur":{max(end - ts, 0)},'
                f'"name":{_dumps(name)},"args":{_dumps(args, default=str)}}}'
            )
            stats["unfinished"] += 1
        fid = 0
        for pts in flows.values():
            if len(pts) < 2:
                continue
            pts.sort()
            for i in range(1, len(pts)):
                j = i - 1
                for c in range(i - 1, max(-1, i - 1 - 256), -1):
                    if pts[c][3] != pts[i][3]:
                        j = c
                        break
                a, b = pts[j], pts[i]
                fid += 1
                chunk.append(f'{{"ph":"s","cat":"flow","name":"flow","id":{fid},"pid":{a[1]},"tid":{a[2]},"ts":{a[0]}}}')
                chunk.append(f'{{"ph":"f","bp":"e","cat":"flow","name":"flow","id":{fid},"pid":{b[1]},"tid":{b[2]},"ts":{b[0]}}}')
        stats["flows"] = fid
        # metadata: process / thread names
        for st in sorted(run.streams.values(), key=lambda s: s.track or 0):
            if st.track is None:
                continue
            pid = st.track
            actor = f"/{st.actor}" if st.actor else ""
            att = f" [attempt {st.attempt}]" if multi else ""
            pname = f"{st.mesh}{actor} r{st.rank}{att} ({st.host}:{st.pid})"
            labels = f"host={st.host},pid={st.pid},mesh={st.mesh},actor={st.actor},rank={st.rank},attempt={st.attempt}"
            chunk.append(f'{{"ph":"M","name":"process_name","pid":{pid},"args":{{"name":{_dumps(pname)}}}}}')
            chunk.append(f'{{"ph":"M","name":"process_labels","pid":{pid},"args":{{"labels":{_dumps(labels)}}}}}')
            chunk.append(f'{{"ph":"M","name":"process_sort_index","pid":{pid},"args":{{"sort_index":{pid}}}}}')
            for lane, label in sorted(st.lanes.items()):
                chunk.append(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{lane + 1},"args":{{"name":{_dumps(label)}}}}}')
            stats["tracks"] += 1
        emit(chunk)
        other = {"run_dir": str(run.run_dir), "clock_offsets_us": run.offsets, "attempts": run.attempts,
                 "generator": "forge_obs.timeline"}
        f.write(f'\n],"displayTimeUnit":"ms","otherData":{_dumps(other, default=str)}}}\n')
    tmp.replace(out)
    return stats
