"""Streaming export of a run's timeline to the Chrome / Perfetto JSON trace format.

    forge-obs trace runs/exp1 -o trace.json [--steps 10:20] [--ranks 0,3] [--meshes trainer]

    from forge_obs.analysis.trace import export_trace
    stats = export_trace("runs/exp1", "runs/exp1/trace.json", steps=(10, 20), ranks="0,3")
    stats["slices"], stats["flows"], stats["unfinished"]

One process track per (mesh, rank) -- per process session, so a restarted job is a separate
track -- named with metadata events (mesh, actor, rank, host, pid, attempt); one thread track per
asyncio task / thread; flow arrows between spans/events that share a ``flow`` id (each point is
linked from the latest earlier point in another mesh, else from the previous point); spans still
open at the end of the data are drawn up to the last timestamp with ``args.unfinished = true``
(category ``unfinished``: a possible hang); a span its process's clean shutdown cut short (younger
than ``open_after_s`` then) ends at the shutdown with ``args.cut_by_shutdown = true`` (category
``shutdown``) and is not counted as unfinished; spans that raised carry ``args.error`` and
category ``error``. Per-host clock offsets (estimated against the controller) are applied.
Memory: per-process state, flow points and open spans; the records themselves are streamed
from the run's index (:mod:`forge_obs.analysis.index`), filtered on steps, meshes and ranks there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

from forge_obs.analysis import reader
from forge_obs.analysis.reader import END, INSTANT, OPEN, SPAN, STEP, TAG
from forge_obs.core.identity import coords_suffix, mesh_selected
from forge_obs.recording.timeline.schema import parse_ranks, rank_selected

__all__ = ["parse_steps", "parse_names", "make_keep", "export_trace"]

_dumps = json.dumps

#: end of a span that never ended, when packing tasks onto thread tracks
_NEVER = 2**62
#: a flow point is linked from the latest earlier point in another mesh among this many
_FLOW_LOOKBACK = 256


def parse_steps(spec: str | None) -> tuple[int, int] | None:
    """``"10:20"`` (inclusive), ``"10:"``, ``":20"`` or ``"7"``.

    >>> parse_steps("10:20"), parse_steps("7"), parse_steps(None)
    ((10, 20), (7, 7), None)
    """
    if not spec:
        return None
    if ":" in spec:
        lo, hi = spec.split(":", 1)
        return (int(lo) if lo else -(2**62), int(hi) if hi else 2**62)
    return (int(spec), int(spec))


def parse_names(spec: str | None) -> set[str] | None:
    """``"trainer,generator"`` -> the set of names; None / ``""`` -> None (no filter).

    >>> sorted(parse_names("trainer, generator"))
    ['generator', 'trainer']
    """
    names = {part.strip() for part in (spec or "").split(",") if part.strip()}
    return names or None


def make_keep(ranks: Any, meshes: set | None) -> Callable[[dict], bool] | None:
    """The stream filter (on a header): ``ranks`` is a rank spec of
    :func:`~forge_obs.recording.timeline.schema.parse_ranks` (``"0,3"``, ``"0-7"``, ``"every:4"``, a set)."""
    if ranks is not None:
        parse_ranks(ranks)  # raises ValueError on a bad spec, before any file is read
    if ranks is None and meshes is None:
        return None

    def keep(h: dict) -> bool:
        if meshes is not None and not mesh_selected(str(h.get("mesh")), meshes):
            return False
        return ranks is None or rank_selected(ranks, int(h.get("rank", 0)))

    return keep


def export_trace(
    run_dir: "str | Path",
    out: "str | Path",
    steps: tuple[int, int] | None = None,
    ranks: Any = None,
    meshes: set | None = None,
    critical_path: bool = False,
) -> dict[str, Any]:
    """Write ``out`` (Chrome JSON trace), atomically (a ``.tmp`` file renamed at the end). Returns
    counts: slices, instants, unfinished, cut_by_shutdown, errors, flows, tracks (and, with
    ``critical_path``, ``path_slices``: a "critical path" process, see :func:`_path_events`)."""
    run, streams = _read(run_dir, make_keep(ranks, meshes), steps)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        trace = _TraceFile(f)
        trace.number_tracks(run)
        f.write('{"traceEvents":[\n')
        for st, items in streams:
            trace.emit(_stream_events(trace, st, items))
        trace.emit(_unfinished_events(trace, reader.run_end(run) or 0))
        trace.emit(_flow_events(trace))
        trace.emit(_metadata_events(trace, run))
        if critical_path:
            trace.emit(_path_events(trace, run.run_dir, steps))
        other = {"run_dir": str(run.run_dir), "clock_offsets_us": run.offsets, "attempts": run.attempts,
                 "generator": "forge_obs.recording.timeline"}
        f.write(f'\n],"displayTimeUnit":"ms","otherData":{_dumps(other, default=str)}}}\n')
    tmp.replace(out)
    return trace.stats


def _read(run_dir: "str | Path", keep: Any, steps: tuple[int, int] | None) -> tuple:
    """The run's sessions and ``(stream, items)`` per session: from the run's index, or, where it
    cannot be built (no DuckDB or pyarrow), from the files themselves."""
    from forge_obs.analysis.index import available, open_index
    from forge_obs.analysis.index.timeline import items_by_stream, sessions

    if not available():
        run = reader.scan(run_dir, keep)
        return run, _streams_in_steps(run, steps)
    idx = open_index(run_dir)
    con = idx.connect()
    run = sessions(idx, con, keep)
    return run, items_by_stream(con, run, steps)


def _streams_in_steps(run: reader.Run, steps: tuple[int, int] | None) -> Iterator[tuple[reader.Stream, list]]:
    """``(stream, items)`` per contiguous run of one stream's records in :func:`reader.walk`,
    keeping the records whose step is inside ``steps`` (all when None)."""
    lo, hi = steps if steps is not None else (None, None)
    cur: reader.Stream | None = None
    items: list = []
    for it in reader.walk(run):
        kind = it[0]
        st = it[1]
        if st is not cur:
            if cur is not None and items:
                yield cur, items
            cur, items = st, []
        if kind is END:
            if items:
                yield cur, items
            cur, items = None, []
            continue
        if lo is not None:
            step = it[3] if (kind is STEP or kind is TAG) else it[4]
            if step is None or step < lo or step > hi:
                continue
        items.append(it)
    if cur is not None and items:
        yield cur, items


class _TraceFile:
    """The output file and what the export gathers on the way: counts, flow points (keyed by
    flow id) and spans still open at the end."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.first = True
        self.stats = {"slices": 0, "instants": 0, "unfinished": 0, "cut_by_shutdown": 0, "errors": 0, "flows": 0,
                      "tracks": 0}
        self.flows: dict[str, list[tuple]] = {}  # flow id -> [(ts, pid, tid, mesh)]
        self.opens: list[tuple] = []  # (OPEN item, tid)
        self._names: dict[str, str] = {}
        self._next_pid = 1

    def number_tracks(self, run: reader.Run) -> None:
        """One process track per stream of the scan, numbered from 1: the controller first, then
        by attempt, mesh, rank, host and pid."""
        ordered = sorted(run.streams.values(),
                         key=lambda s: (s.attempt, 0 if s.mesh == "controller" else 1, s.mesh, s.rank, s.host, s.pid))
        for st in ordered:
            self.pid_of(st)

    def pid_of(self, st: reader.Stream) -> int:
        """The process track of ``st``; a stream met only while walking (a session that starts
        inside a file) gets the next free number."""
        if st.track is None:
            st.track = self._next_pid
            self._next_pid += 1
        return st.track

    def emit(self, lines: list[str]) -> None:
        """Append JSON events to the ``traceEvents`` array."""
        if not lines:
            return
        if not self.first:
            self.f.write(",\n")
        self.first = False
        self.f.write(",\n".join(lines))

    def name(self, name: str) -> str:
        """``name`` as a JSON string (cached: span names repeat every step)."""
        q = self._names.get(name)
        if q is None:
            q = self._names[name] = _dumps(name)
        return q

    def add_extras(self, args: dict, ex: dict | None, point: tuple) -> dict:
        """Add a record's attributes to ``args`` and note its flow point ``(ts, pid, tid, mesh)``."""
        if ex:
            args.update(ex.get("a") or {})
            if "f" in ex:
                args["flow"] = ex["f"]
                self.flows.setdefault(_dumps(ex["f"], default=str), []).append(point)
        return args


def _pack_tasks(st: reader.Stream, items: list) -> dict[int, int]:
    """Thread track (tid, from 1) of each lane (asyncio task / thread) of a process: lanes share
    a track when their lifetimes do not overlap (every endpoint call of an actor is a new task).
    Sets ``st.tid_names``."""
    extent: dict[int, list] = {}  # lane -> [first ts, last end]
    for it in items:
        k = it[0]
        if k is SPAN:
            a, b = it[5], it[5] + it[6]
        elif k is OPEN:
            a, b = it[5], _NEVER
        elif k is INSTANT:
            a = b = it[5]
        else:
            a = b = it[-1]
        lane = it[2]
        iv = extent.get(lane)
        if iv is None:
            extent[lane] = [a, b]
        else:
            if a < iv[0]:
                iv[0] = a
            if b > iv[1]:
                iv[1] = b
    ends: list[int] = []  # per track: end of its last lane
    tid_of: dict[int, int] = {}
    labels: dict[int, list] = {}
    for lane, (a, b) in sorted(extent.items(), key=lambda kv: (kv[1][0], kv[0])):
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
    return tid_of


def _stream_events(trace: _TraceFile, st: reader.Stream, items: list) -> list[str]:
    """The JSON events of one process's records; spans still open are kept for
    :func:`_unfinished_events`."""
    tid_of = _pack_tasks(st, items)
    pid = trace.pid_of(st)
    st.emitted = True
    stats = trace.stats
    lines: list[str] = []
    for it in items:
        kind = it[0]
        if kind is SPAN:
            lines.append(_span_event(trace, it, pid, tid_of[it[2]]))
            stats["slices"] += 1
        elif kind is INSTANT:
            _k, _st, lane, name, step, ts, ex = it
            tid = tid_of[lane]
            args = trace.add_extras({"step": step}, ex, (ts, pid, tid, st.mesh))
            lines.append(f'{{"ph":"i","s":"t","pid":{pid},"tid":{tid},"ts":{ts},'
                         f'"name":{trace.name(name)},"args":{_dumps(args, default=str)}}}')
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
            trace.opens.append((it, tid_of[it[2]]))
    return lines


def _span_event(trace: _TraceFile, it: tuple, pid: int, tid: int) -> str:
    """A finished span as an ``X`` slice: category ``error`` when it raised, ``shutdown`` when a
    clean shutdown cut it short, ``span`` otherwise; its CPU time as the slice's thread
    duration (``tdur``, Perfetto's "Thread duration")."""
    _k, st, _lane, name, step, ts, dur, ex, cpu = it
    tdur = "" if cpu is None else f',"tdur":{cpu}'
    if not ex:
        return (f'{{"ph":"X","pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur}{tdur},'
                f'"name":{trace.name(name)},"args":{{"step":{"null" if step is None else step}}}}}')
    args = {"step": step}
    cat = "span"
    if "a" in ex:
        args.update(ex["a"])
    if "f" in ex:
        args["flow"] = ex["f"]
        trace.flows.setdefault(_dumps(ex["f"], default=str), []).append((ts, pid, tid, st.mesh))
    if "e" in ex:
        args["error"] = ex["e"]
        cat = "error"
        trace.stats["errors"] += 1
    elif ex.get("x") == "shutdown":
        args["cut_by_shutdown"] = True
        cat = "shutdown"
        trace.stats["cut_by_shutdown"] += 1
    return (f'{{"ph":"X","cat":"{cat}","pid":{pid},"tid":{tid},"ts":{ts},"dur":{dur}{tdur},'
            f'"name":{trace.name(name)},"args":{_dumps(args, default=str)}}}')


def _unfinished_events(trace: _TraceFile, end: int) -> list[str]:
    """Spans that never ended, drawn up to ``end`` (the run's last timestamp) with category
    ``unfinished`` and ``args.open_for_s``."""
    lines: list[str] = []
    for (_k, st, _lane, name, step, ts, ex), tid in trace.opens:
        pid = trace.pid_of(st)
        st.emitted = True
        args = trace.add_extras({"step": step, "unfinished": True, "open_for_s": round((end - ts) / 1e6, 6)},
                                ex, (ts, pid, tid, st.mesh))
        lines.append(f'{{"ph":"X","cat":"unfinished","pid":{pid},"tid":{tid},"ts":{ts},"dur":{max(end - ts, 0)},'
                     f'"name":{trace.name(name)},"args":{_dumps(args, default=str)}}}')
        trace.stats["unfinished"] += 1
    return lines


def _flow_events(trace: _TraceFile) -> list[str]:
    """Flow arrows between the points that share a flow id: each point is linked from the latest
    earlier point in another mesh (among the previous ``_FLOW_LOOKBACK``), else from the previous point."""
    lines: list[str] = []
    fid = 0
    for pts in trace.flows.values():
        if len(pts) < 2:
            continue
        pts.sort()
        for i in range(1, len(pts)):
            j = i - 1
            for c in range(i - 1, max(-1, i - 1 - _FLOW_LOOKBACK), -1):
                if pts[c][3] != pts[i][3]:
                    j = c
                    break
            a, b = pts[j], pts[i]
            fid += 1
            lines.append(f'{{"ph":"s","cat":"flow","name":"flow","id":{fid},"pid":{a[1]},"tid":{a[2]},"ts":{a[0]}}}')
            lines.append(f'{{"ph":"f","bp":"e","cat":"flow","name":"flow","id":{fid},"pid":{b[1]},"tid":{b[2]},"ts":{b[0]}}}')
    trace.stats["flows"] = fid
    return lines


def _path_events(trace: _TraceFile, run_dir: Path, steps: tuple[int, int] | None) -> list[str]:
    """A "critical path" process after every other: on thread 1 one slice per controller step
    named with its one-line answer, on thread 2 one slice per segment of its critical path
    (``mesh/rN name``; args: the segment's process, link, wait, unfinished). The segments of a
    step tile it in time order, so the slices never overlap."""
    from forge_obs.analysis.critical_path import analyse

    pid = trace._next_pid
    trace._next_pid += 1
    lines = [f'{{"ph":"M","name":"process_name","pid":{pid},"args":{{"name":"critical path"}}}}',
             f'{{"ph":"M","name":"process_sort_index","pid":{pid},"args":{{"sort_index":-1}}}}',
             f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":1,"args":{{"name":"steps"}}}}',
             f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":2,"args":{{"name":"path"}}}}']
    n = 0
    for r in analyse(run_dir, first=steps[0] if steps else None, last=steps[1] if steps else None):
        lines.append(f'{{"ph":"X","cat":"critical_path","pid":{pid},"tid":1,"ts":{r["start_us"]},'
                     f'"dur":{r["end_us"] - r["start_us"]},"name":{_dumps(r["answer"])},"args":{{"step":{r["step"]}}}}}')
        for sg in r["path"]:
            args = {k: sg[k] for k in ("step", "mesh", "actor", "rank", "host", "pid", "task", "link", "wait", "unfinished")}
            args["step"] = r["step"]
            label = _dumps(f"{sg['mesh']}/r{sg['rank']} {sg['name']}")
            lines.append(f'{{"ph":"X","cat":"critical_path","pid":{pid},"tid":2,"ts":{sg["start_us"]},'
                         f'"dur":{sg["end_us"] - sg["start_us"]},"name":{label},"args":{_dumps(args, default=str)}}}')
            n += 1
    trace.stats["path_slices"] = n
    return lines


def _metadata_events(trace: _TraceFile, run: reader.Run) -> list[str]:
    """Process names (``mesh/actor rN [attempt K] (host:pid)``), labels and sort order, and thread
    names, for every process that has at least one event in the trace."""
    multi = len(run.attempts) > 1
    lines: list[str] = []
    for st in sorted(run.streams.values(), key=lambda s: s.track or 0):
        if st.track is None or not getattr(st, "emitted", False):
            continue
        pid = st.track
        actor = f"/{st.actor}" if st.actor else ""
        att = f" [attempt {st.attempt}]" if multi else ""
        dims = coords_suffix(st.header.get("coords") if isinstance(st.header.get("coords"), dict) else None)
        pname = f"{st.mesh}{actor} r{st.rank}{dims}{att} ({st.host}:{st.pid})"
        labels = f"host={st.host},pid={st.pid},mesh={st.mesh},actor={st.actor},rank={st.rank},attempt={st.attempt}"
        if dims:
            labels += "," + dims[1:-1]
        lines.append(f'{{"ph":"M","name":"process_name","pid":{pid},"args":{{"name":{_dumps(pname)}}}}}')
        lines.append(f'{{"ph":"M","name":"process_labels","pid":{pid},"args":{{"labels":{_dumps(labels)}}}}}')
        lines.append(f'{{"ph":"M","name":"process_sort_index","pid":{pid},"args":{{"sort_index":{pid}}}}}')
        for tid, label in sorted((getattr(st, "tid_names", None) or {}).items()):
            lines.append(f'{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":{_dumps(label)}}}}}')
        trace.stats["tracks"] += 1
    return lines
