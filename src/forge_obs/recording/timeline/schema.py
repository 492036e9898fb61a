"""The compact JSONL schema of ``runs/<run_id>/events/*.jsonl`` (version 1).

One file per process (``<host>_<pid>_<mesh>_<rank>.jsonl``, rotated files add ``.<k>`` before
``.jsonl``). Every file starts with a header object; a header in the middle of a file starts a
new session (a restarted process that reused the pid). Then one JSON array per line; times are
integer microseconds relative to the header's ``t0`` (epoch µs), ``step`` is an int or null::

    {"h": 1, "v": 1, "run": "exp1", "start": 1.7e9, "session": "a1b2c3", "host": "node0",
     "pid": 4242, "mesh": "trainer", "actor": "TrainActor", "rank": 3, "coords": {"gpus": 3},
     "ws": 4, "ctl": false, "ranks": "all", "t0": 1763860000000000, "clk": [recv_us, ctl_us],
     "file": 0}
    ["N", 1, "train_step"]                   name 1 (defined once per file)
    ["L", 0, "Task-3", 1403]                 track 0 = asyncio task "Task-3" (or a thread)
    [1200, 950, 0, 1, 42]                    complete span: ts, dur, track, name, step
    [1200, 950, 0, 1, 42, {"f": "ep-7", "a": {"n": 4}, "e": "ValueError: x"}]   + flow/attrs/error
    ["B", 17, 5000, 0, 1, 43]                span 17 began (still open when written; a hang)
    ["E", 17, 9000]                          ... and ended later (optionally {"e": error}, or
                                             {"x": "shutdown"}: cut short by a clean close)
    ["I", 5100, 0, 2, 43, {"f": "ep-7"}]     instant event: ts, track, name, step[, extras]
    ["I", 5100, 0, 3, 43, {"p": "9f3a.7"}]   "call": an endpoint call sent under the open span of
                                             track 0; the callee's top-level spans of that call
                                             carry {"p": "9f3a.7"} in their extras (the link)
    ["S", 5000, 0, 43]                       set_step(43)
    ["T", 5000, 0, 43, "eval"]               add_step_tag("eval") at step 43
    ["M", {"actor": "TrainActor"}]           identity update (the actor name is learnt late)
    ["D", 120]                               120 records were dropped (buffer overflow)
    ["C", 1763860000000950, 1763860000000100]   clock sample: local receive / controller send (epoch µs)
    ["A", 9050]                              alive at 9050, a span of its "B" records still open
    ["Z", 9100]                              the process closed the file cleanly

A complete span is one record (its size per record: ``bench/bench_timeline.py``); a span is written as ``B`` (then ``E``) only
when it stays open longer than ``open_after_s`` or when the file is closed, so that the span a
hang is stuck in is on disk. A span younger than ``open_after_s`` when the process closes its file
cleanly gets ``["E", sid, close_ts, {"x": "shutdown"}]`` right after its ``B``: the shutdown cut
it short; it is not a hang. While a span written as ``B`` is open, a writer pass with nothing
else to write writes ``A`` (alive at that time): a process killed inside the span leaves data
up to its last pass, so the span shows how long it was open.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from forge_obs.core.options import parse_options

__all__ = [
    "VERSION",
    "TimelineOptions",
    "DEFAULT_OPTIONS",
    "validate_options",
    "parse_ranks",
    "rank_selected",
]

VERSION = 1

@dataclass
class TimelineOptions:
    """The ``"timeline"`` key of ``init_backends`` (and of :func:`forge_obs.recording.timeline.configure`)."""

    enabled: bool = True
    ranks: Any = "all"  # "all" | "0,3" | "0-3,8" | "every:4" (rank % 4 == 0, per mesh)
    max_file_mb: float = 64.0  # rotate a process's file past this size
    max_files: int = 0  # keep at most this many files per process (0: all)
    flush_interval_s: float = 0.5  # writer pass period (what a killed process can lose)
    open_after_s: float = 1.0  # write spans still open after this long as "B" records
    meshes: Any = None  # None: every mesh; or a list / comma string of mesh names that write

    def __post_init__(self) -> None:
        parse_ranks(self.ranks)  # raises on a bad spec
        for k in ("max_file_mb", "flush_interval_s", "open_after_s"):
            v = getattr(self, k)
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"timeline {k} must be a number, got {v!r}") from None
            if v < 0 or (k != "open_after_s" and v == 0):
                raise ValueError(f"timeline {k} must be > 0, got {v!r}")
            setattr(self, k, v)
        self.max_files = int(self.max_files)
        if isinstance(self.meshes, str):
            self.meshes = [m.strip() for m in self.meshes.split(",") if m.strip()]
        self.enabled = bool(self.enabled)


#: the defaults, as the plain dict the writer and the fetchers are given
DEFAULT_OPTIONS: dict[str, Any] = {f.name: f.default for f in fields(TimelineOptions)}
#: keys the controller adds to the options it pushes (clock and run identity)
_PRIVATE_KEYS = ("_ctl_us", "_run_id", "_start", "_ctl")


def validate_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults filled in; ValueError naming the key for an unknown key or a bad value."""
    if options is None:
        return dict(DEFAULT_OPTIONS)
    if options is False:
        return dict(DEFAULT_OPTIONS, enabled=False)
    if not isinstance(options, dict):
        raise ValueError(f"'timeline' config must be a dict, got {type(options).__name__}")
    opts = asdict(parse_options(TimelineOptions, "timeline", options, also=_PRIVATE_KEYS))
    opts.update((k, options[k]) for k in _PRIVATE_KEYS if k in options)
    return opts


def parse_ranks(spec: Any) -> Any:
    """``"all"`` -> None; ``"0,3"`` / ``"0-3,8"`` -> set of ranks; ``"every:4"`` -> ("every", 4).

    >>> parse_ranks("all"), parse_ranks("0-2,8"), parse_ranks("every:4")
    (None, {0, 1, 2, 8}, ('every', 4))
    >>> parse_ranks("0,x")
    Traceback (most recent call last):
    ...
    ValueError: bad ranks '0,x': use 'all', '0,3', '0-3,8' or 'every:4'
    """
    if spec is None or spec == "all" or spec == "*":
        return None
    if isinstance(spec, int):
        return {spec}
    if isinstance(spec, (list, tuple, set)):
        return {int(r) for r in spec}
    s = str(spec).strip().replace(" ", "")
    m = re.fullmatch(r"(?:every:|%)(\d+)", s)
    if m:
        n = int(m.group(1))
        if n <= 0:
            raise ValueError(f"bad ranks {spec!r}: every:N needs N > 0")
        return ("every", n)
    out: set[int] = set()
    for part in s.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"bad ranks {spec!r}: use 'all', '0,3', '0-3,8' or 'every:4'")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        out.update(range(lo, hi + 1))
    return out


def rank_selected(spec: Any, rank: int) -> bool:
    sel = parse_ranks(spec)
    if sel is None:
        return True
    if isinstance(sel, tuple):
        return rank % sel[1] == 0
    return rank in sel
