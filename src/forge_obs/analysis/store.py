"""Read the local store back: JSONL files that tolerate a torn last line and malformed lines.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "m.jsonl"
    >>> _ = p.write_text('{"step": 0}\\n{"step": 1}\\n{"step": 2, "metr')
    >>> [r["step"] for r in read_jsonl(p)]
    [0, 1]

Only well-formed rows come out, so every reader (``forge-obs show`` / ``sql`` / ``report`` /
``doctor``) can trust their shape: a line that is not valid UTF-8 / JSON, not an object, or an
object whose fields have the wrong types (see :func:`metric_row_problem`) is skipped and counted,
with one warning per file read; a torn last line (a writer died mid-line) is skipped silently.
Lines are read by :func:`forge_obs.analysis.jsonl_reader.json_lines`, the timeline reader's line reader too.
The public names are importable as ``forge_obs.analysis.store`` (``read_metrics``, ``read_jsonl``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator

from forge_obs.analysis.jsonl_reader import NOT_JSON, json_lines

__all__ = ["RUN_MARKERS", "metric_row_problem", "read_jsonl", "read_metrics"]

#: what makes a directory a run directory: any of these in it
RUN_MARKERS = ("metrics.jsonl", "meta.json", "events", "structured_logs")

logger = logging.getLogger("forge_obs")

#: ints beyond this do not fit the SQL views' BIGINT columns (and no writer writes them)
_BIG = 1 << 62


def _num(x: Any) -> bool:
    return x is None or (type(x) in (int, float) and (type(x) is float or -_BIG < x < _BIG))


def metric_row_problem(row: dict[str, Any]) -> str | None:
    """Why ``row`` is not a well-formed row of ``metrics.jsonl`` (None: it is). ``step`` is a
    non-negative int; ``metrics`` / ``source`` are objects; ``values`` a list of ``[key, value,
    wall time]``; ``missing`` / ``late`` lists; ``wall_time`` a number."""
    step = row.get("step")
    if type(step) is not int or not 0 <= step < _BIG:
        return f"step {step!r} is not a non-negative integer"
    for name, typ in (("metrics", dict), ("source", dict), ("missing", list), ("late", list), ("values", list)):
        v = row.get(name)
        if v is not None and type(v) is not typ:
            return f"{name!r} is a {type(v).__name__}, not a {typ.__name__}"
    if not _num(row.get("wall_time")):
        return "'wall_time' is not a number"
    if type(row.get("mode", "")) is not str or type(row.get("run_id", "")) not in (str, type(None)):
        return "'mode' / 'run_id' is not a string"
    src = row.get("source")
    if src and not (src.get("rank") is None or (type(src["rank"]) is int and -(1 << 31) < src["rank"] < 1 << 31)):
        return "'source.rank' is not an integer"
    for item in row.get("values") or ():
        if not (type(item) is list and len(item) >= 2 and type(item[0]) is str and (len(item) < 3 or _num(item[2]))):
            return "'values' holds an item that is not [key, value, wall time]"
    return None


def read_jsonl(
    path: "str | Path",
    check: Callable[[dict], "str | None"] | None = metric_row_problem,
    stats: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield each well-formed JSON object of ``path`` (``check(row)`` returns why a row is not
    well-formed, None if it is; ``check=None`` accepts any object). Malformed lines are skipped,
    counted in ``stats["malformed"]`` (when a dict is given) and reported in one warning once the
    file is read; a torn last line is skipped silently."""
    bad = 0
    first = ""

    def malformed(line: int, why: str) -> None:
        nonlocal bad, first
        bad += 1
        first = first or (f"line {line} is {why}" if why is NOT_JSON else f"line {line}: {why}")

    yield from json_lines(path, malformed, (dict,), check)
    if stats is not None:
        stats["malformed"] = stats.get("malformed", 0) + bad
    if bad:
        logger.warning("forge_obs: %s: %d malformed line(s) skipped (first: %s)", path, bad, first)


def read_metrics(run_dir: "str | Path", mode: str | None = "global_reduce") -> list[dict[str, Any]]:
    """Rows of ``<run_dir>/metrics.jsonl`` (of one mode, or all when ``mode`` is None)."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if mode is None or r.get("mode") == mode]
