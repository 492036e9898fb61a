"""Streaming export of a run's timeline to the Chrome / Perfetto JSON trace format.

    forge-obs trace runs/exp1 -o trace.json [--steps 10:20] [--ranks 0,3] [--meshes trainer]

One process track per (mesh, rank) -- per process session, so a restarted job is a separate
track -- named with metadata events (mesh, actor, rank, host, pid, attempt); one thread track per
asyncio task / thread; flow arrows between spans/events that share a ``flow`` id (each point is
linked from the latest earlier point in another mesh, else from the previous point); spans still
open at the end of the data are drawn up to the last timestamp with ``args.unfinished = true``
(category ``unfinished``: a possible hang); a span its process's clean shutdown cut short (younger
than ``open_after_s`` then) ends at the shutdown with ``args.cut_by_shutdown = true`` (category
``shutdown``) and is not counted as unfinished; spans that raised carry ``args.error`` and
category ``error``. Per-host clock offsets (estimated
against the controller) are applied. Memory: per-process state, flow points and open spans; the
records themselves are streamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forge_obs.analysis import reader
from forge_obs.analysis.reader import END, INSTANT, OPEN, SPAN, STEP, TAG

_dumps = json.dumps



def _with_extras(args: dict, ex: dict | None, flows: dict, point: tuple) -> dict:
    """Add a record's attributes to ``args`` and note its flow point ``(ts, pid, tid, mesh)``."""
    if ex:
        args.update(ex.get("a") or {})
        if "f" in ex:
            args["flow"] = ex["f"]
            flows.setdefault(_dumps(ex["f"], default=str), []).append(point)
    return args

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
    """Write ``out`` (Chrome JSON trace). Returns counts (slices, unfinished, cut_by_shutdown, flows, tracks)."""
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
    stats = {"slices": 0, "instants": 0, "unfinished": 0, "cut_by_shutdown": 0, "errors": 0, "flows": 0, "tracks": 0}
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

        INF = 2**62
        qnames: dict[str, str] = {}

        def qname(name: str) -> str:
            q = qnames.get(name)
            if q is None:
                q = qnames[name] = _dumps(name)
            return q

        def flush_stream(st: reader.Stream | None, items: list) -> None:
            """Pack the process's tasks onto as few thread tracks as overlap requires (every
            endpoint call of an actor is a new asyncio task), then emit its records."""
            if st is None or not items:
                return
            span: dict[int, list] = {}
            for it in items:
                k = it[0]
                if k is SPAN:
                    a, b = it[5], it[5] + it[6]
                elif k is OPEN:
                    a, b = it[5], INF
                elif k is INSTANT:
                    a = b = it[5]
                else:
                    a = b = it[-1]
                lane = it[2]
                iv = span.get(lane)
                if iv is None:
                    span[lane] = [a, b]
                else:
                    if a < iv[0]:
                        iv[0] = a
                    if b > iv[1]:
                        iv[1] = b
            ends: list[int] = []  # per track: end of its last lane
            tid_of: dict[int, int] = {}
            labels: dict[int, list] = {}
            for lane, (a, b) in sorted(span.items(), key=lambda kv: (kv[1][0], kv[0])):
                for t, e in enumerate(ends):
                    if e <= a:
                        break
                else:
                    t = len(ends)
                    ends.append(0)
                ends[t] = b
                tid_of[lane] = t + 1
                labels.setdefault(t + 1, []).append(st.lanes.get(lane, f"track-{lane}"))
            st.tid_names = {t: (ls[0] if len(ls) == 1 else f"{ls[0]} +{len(ls) - 1} tasks") for t, ls in labels.items()}
            pid = track(st)
            st.emitted = True
            lines = chunk
            for it in items:
                kind = it[0]
                if kind is SPAN:
                    _k, _st, lane, name, step, ts, dur, ex = it
                    tid = tid_of[lane]
                    if ex:
                        args = {"step": step}
                        cat = "span"
                        if "a" in ex:
                            args.update(ex["a"])
                        if "f" in ex:
                            args["flow"] = ex["f"]
                            flows.setdefault(_dumps(ex["f"], default=str), []).append((ts, pid, tid, st.mesh))
                        if "e" in ex:
                            args["error"] = ex["e"]
                            cat = "error"
                            stats["errors"] += 1
                        elif ex.get("x") == "shutdown":
                            args["cut_by_shutdown"] = True
                            cat = "shutdown"
                            stats["cut_by_shutdown"] += 1
                        lines.append(
                            f'{{"ph":"X","cat":"{cat}","pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur},'
                            f'"name":{qname(name)},"args":{_dumps(args, default=str)}}}'
                        )
                    else:
                        lines.append(
                            f'{{"ph":"X","pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur},'
                            f'"name":{qname(name)},"args":{{"step":{"null" if step is None else step}}}}}'
                        )
                    stats["slices"] += 1
                elif kind is INSTANT:
                    _k, _st, lane, name, step, ts, ex = it
                    tid = tid_of[lane]
                    args = _with_extras({"step": step}, ex, flows, (ts, pid, tid, st.mesh))
                    lines.append(
                        f'{{"ph":"i","s":"t","pid":{pid},"tid":{tid},"ts":{ts},'
                        f'"name":{qname(name)},"args":{_dumps(args, default=str)}}}'
                    )
                    stats["instants"] += 1
                elif kind is STEP:
                    _k, _st, lane, step, ts = it
                    lines.append(f'{{"ph":"i","s":"t","cat":"step","pid":{pid},"tid":{tid_of[lane]},"ts":{ts},'
                                 f'"name":"step","args":{{"step":{step}}}}}')
                    stats["instants"] += 1
                elif kind is TAG:
                    _k, _st, lane, step, tag, ts = it
                    lines.append(f'{{"ph":"i","s":"t","cat":"tag","pid":{pid},"tid":{tid_of[lane]},"ts":{ts},'
                                 f'"name":{_dumps("tag:" + str(tag))},"args":{{"step":{_dumps(step)},"tag":{_dumps(tag)}}}}}')
                    stats["instants"] += 1
                elif kind is OPEN:
                    opens.append((it, tid_of[it[2]]))
            emit(lines)
            lines.clear()

        cur: reader.Stream | None = None
        items: list = []
        for it in reader.walk(run):
            kind = it[0]
            st = it[1]
            if st is not cur:
                flush_stream(cur, items)
                cur, items = st, []
            if kind is END:
                flush_stream(cur, items)
                cur, items = None, []
                continue
            if lo is not None:
                step = it[3] if (kind is STEP or kind is TAG) else it[4]
                if step is None or step < lo or step > hi:
                    continue
            items.append(it)
        flush_stream(cur, items)
        end = reader.run_end(run) or 0
        for (_k, st, lane, name, step, ts, ex), tid in opens:
            pid = track(st)
            st.emitted = True
            args = _with_extras(
                {"step": step, "unfinished": True, "open_for_s": round((end - ts) / 1e6, 6)}, ex, flows, (ts, pid, tid, st.mesh)
            )
            chunk.append(
                f'{{"ph":"X","cat":"unfinished","pid":{pid},"tid":{tid},"ts":{ts},"dur":{max(end - ts, 0)},'
                f'"name":{qname(name)},"args":{_dumps(args, default=str)}}}'
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
            if st.track is None or not getattr(st, "emitted", False):
                continue
            pid = st.track
            actor = f"/{st.actor}" if st.actor else ""
            att = f" [attempt {st.attempt}]" if multi else ""
            pname = f"{st.mesh}{actor} r{st.rank}{att} ({st.host}:{st.pid})"
            labels = f"host={st.host},pid={st.pid},mesh={st.mesh},actor={st.actor},rank={st.rank},attempt={st.attempt}"
            chunk.append(f'{{"ph":"M","name":"process_name","pid":{pid},"args":{{"name":{_dumps(pname)}}}}}')
            chunk.append(f'{{"ph":"M","name":"process_labels","pid":{pid},"args":{{"labels":{_dumps(labels)}}}}}')
            chunk.append(f'{{"ph":"M","name":"process_sort_index","pid":{pid},"args":{{"sort_index":{pid}}}}}')
            for tid, label in sorted((getattr(st, "tid_names", None) or {}).items()):
                chunk.append(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":{_dumps(label)}}}}}')
            stats["tracks"] += 1
        emit(chunk)
        other = {"run_dir": str(run.run_dir), "clock_offsets_us": run.offsets, "attempts": run.attempts,
                 "generator": "forge_obs.timeline"}
        f.write(f'\n],"displayTimeUnit":"ms","otherData":{_dumps(other, default=str)}}}\n')
    tmp.replace(out)
    return stats
