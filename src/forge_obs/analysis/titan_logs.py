"""TorchTitan's own structured-logger files, read as a forge_obs timeline.

TorchTitan (``torchtitan.observability.structured_logger``) writes one JSONL file per rank,
``<output_dir>/structured_logs/<source>.global_rank_<rank>.<time>-<id>.jsonl``, one JSON object
per record (``log_type_name``, ``step``, ``step_tags``, ``time_us``, ``value``, ``task_name``,
``rank``, ``source``, ``host_name``, ``pid``, ``tid``). :func:`timeline_dirs` turns each such file
into the records of a forge_obs timeline file, in memory (:func:`timeline_records`), so that
``forge-obs trace`` / ``sql`` / ``doctor`` read a TorchTitan run that never used forge_obs:

- ``X_start`` / ``X_end`` pairs (matched last-in first-out per thread and task, as TorchTitan's
  own analysis does) are spans ``X``; an ``X_error`` between them marks the span with the error;
  a start without an end is a span still open at the end of the data;
- instants are events; a scalar (``metric_value``) is an event named after the scalar, its
  ``value`` an attribute;
- a record whose step differs from the last is preceded by a step record; new step tags are
  tag records. The source is the mesh, the global rank the rank, each thread (and asyncio task) a lane.

Nothing is written beside the run: :func:`convert_file` writes a converted file where asked.

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp()); (d / "structured_logs").mkdir()
    >>> recs = [{"rank": 0, "source": "trainer", "step": 1, "log_type": "event", "log_type_name": "fwd_start", "time_us": 1000},
    ...         {"rank": 0, "source": "trainer", "step": 1, "log_type": "event", "log_type_name": "fwd_end", "time_us": 3000, "value": 2.0}]
    >>> _ = (d / "structured_logs" / "trainer.global_rank_0.x.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in recs))
    >>> from forge_obs.analysis import reader
    >>> [(i[3], i[4], i[6]) for i in reader.walk(reader.scan(d)) if i[0] is reader.SPAN]
    [('fwd', 1, 2000)]
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.jsonl_reader import json_lines
from forge_obs.recording.timeline.records import BEGIN, CLOSE, INSTANT, LANE, NAME, STEP, TAG, X_ATTRS, X_ERROR

__all__ = ["titan_files", "is_titan", "timeline_records", "header_of", "timeline_lines", "convert_file", "PREFIX"]

#: converted files are named ``titan_<TorchTitan file name>``
PREFIX = "titan_"


def titan_files(run_dir: "str | Path") -> list[Path]:
    """TorchTitan's per-rank files of ``run_dir`` (in ``structured_logs/`` or the directory itself)."""
    run_dir = Path(run_dir)
    out: list[Path] = []
    for d in (run_dir / "structured_logs", run_dir):
        if d.is_dir():
            out.extend(p for p in sorted(d.glob("*.global_rank_*.jsonl")) if p.is_file())
    return out


def is_titan(path: Path) -> bool:
    """Whether ``path`` is one of TorchTitan's per-rank files (not a forge_obs timeline file)."""
    return ".global_rank_" in path.name


def timeline_records(src: Path, run_id: str) -> list:
    """``src`` (one TorchTitan rank's records) as the records of a forge_obs timeline file,
    header first, in memory (nothing is written; the last file converted is kept for the next
    call while it is unchanged)."""
    st = src.stat()
    key = (str(src), st.st_size, st.st_mtime_ns, run_id)
    if _last[0] != key:
        recs = [r for r in json_lines(src, lambda line, why: None) if isinstance(r, dict) and r.get("log_type_name")]
        _last[:] = [key, list(_records(recs, run_id, src.name))]
    return _last[1]


_last: list = [None, None]


def header_of(src: Path, run_id: str) -> dict:
    """The timeline header of TorchTitan file ``src`` (see :func:`timeline_records`)."""
    return timeline_records(src, run_id)[0]


def timeline_lines(src: Path, run_id: str) -> Iterator[tuple]:
    """``(record, 1)`` for each record of :func:`timeline_records`: what the timeline reader
    reads from a file, a record at a time (the second value counts records, not bytes)."""
    return ((r, 1) for r in timeline_records(src, run_id))


def convert_file(src: Path, out: Path, run_id: str) -> int:
    """Write ``src`` (one TorchTitan rank's records) as a forge_obs timeline file ``out``
    (atomically). Returns how many records were converted."""
    recs = [r for r in json_lines(src, lambda line, why: None) if isinstance(r, dict) and r.get("log_type_name")]
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in _records(recs, run_id, src.name):
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    os.replace(tmp, out)
    return len(recs)


def _int(v: Any) -> "int | None":
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _records(recs: list[dict], run_id: str, session: str) -> Iterator[Any]:
    first = recs[0] if recs else {}
    times = [t for t in (_int(r.get("time_us")) for r in recs) if t is not None]
    t0 = min(times) if times else 0
    yield {"h": 1, "v": 1, "run": run_id, "start": None, "session": session, "host": str(first.get("host_name") or "?"),
           "pid": _int(first.get("pid")) or 0, "mesh": str(first.get("source") or "titan"), "actor": "",
           "rank": _int(first.get("global_rank", first.get("rank"))) or 0, "coords": {}, "ws": 0, "ctl": False,
           "ranks": "all", "t0": t0, "clk": None, "file": 0, "format": "torchtitan"}
    names: dict[str, int] = {}
    lanes: dict[tuple, int] = {}
    stacks: dict[int, list] = {}  # lane -> open spans [name, start_us, step, error]
    last_step: Any = object()
    tags_seen: set = set()
    end = t0
    for r in recs:
        ts = _int(r.get("time_us"))
        if ts is None:
            continue
        end = max(end, ts)
        rel = ts - t0
        lk = (r.get("tid"), r.get("task_name"))
        lane = lanes.get(lk)
        if lane is None:
            lane = lanes[lk] = len(lanes) + 1
            yield [LANE, lane, str(r.get("task_name") or f"thread {r.get('tid')}")]
        step = _int(r.get("step"))
        if step != last_step and step is not None:
            last_step = step
            yield [STEP, rel, lane, step]
        for tag in r.get("step_tags") or ():
            if (step, tag) not in tags_seen:
                tags_seen.add((step, tag))
                yield [TAG, rel, lane, step, str(tag)]
        yield from _record(r, rel, lane, step, names, stacks)
    sid = 0
    for lane, stack in stacks.items():  # never ended: open at the end of the data
        for name, start, step, err in stack:
            nid = yield from _name(names, name)
            sid += 1
            yield [BEGIN, sid, start, lane, nid, step, {X_ERROR: err} if err else None]
    yield [CLOSE, end - t0]


def _record(r: dict, rel: int, lane: int, step: Any, names: dict, stacks: dict) -> Iterator[Any]:
    kind = str(r.get("log_type_name"))
    stack = stacks.setdefault(lane, [])
    if r.get("log_type") == "event" and kind.endswith("_start"):
        stack.append([kind[:-6], rel, step, None])
    elif r.get("log_type") == "event" and kind.endswith("_error"):
        for s in reversed(stack):
            if s[0] == kind[:-6]:
                s[3] = str(r.get("message") or kind)[:300]
                break
    elif r.get("log_type") == "event" and kind.endswith("_end"):
        base = kind[:-4]
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == base:
                name, start, s_step, err = stack.pop(i)
                nid = yield from _name(names, name)
                yield [start, max(rel - start, 0), lane, nid, s_step, {X_ERROR: err} if err else None]
                break
    elif kind == "metric_value" and r.get("event_name") is not None:
        nid = yield from _name(names, str(r["event_name"]))
        yield [INSTANT, rel, lane, nid, step, {X_ATTRS: {"value": r.get("value")}}]
    else:
        nid = yield from _name(names, kind)
        yield [INSTANT, rel, lane, nid, step, None]


def _name(names: dict, name: str) -> Iterator[Any]:
    nid = names.get(name)
    if nid is None:
        nid = names[name] = len(names) + 1
        yield [NAME, nid, name]
    return nid
