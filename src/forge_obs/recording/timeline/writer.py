"""Background writer: drains the per-process buffer into ``<run_dir>/events/<proc>.jsonl``.

One daemon thread per process, a pass every ``flush_interval_s``: complete spans become one short
record, spans open longer than ``open_after_s`` are written as ``B`` (so a hang is on disk; at a
clean close too), spans younger than that when the file is closed cleanly as ``B`` + ``E`` marked
``{"x": "shutdown"}`` (cut short by the shutdown, not a hang), the
file is rotated past ``max_file_mb``, and the process identity is resolved when the file is
opened (and re-checked every pass: a new mesh/rank opens a new file). It takes the entries
through the buffer's API (:mod:`forge_obs.recording.timeline.recorder`) and reads and writes
them as :mod:`forge_obs.recording.timeline.records` defines them.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.core.identity import current_identity, mesh_selected
from forge_obs.core.selfobs import SELF_OBS
from forge_obs.recording.timeline import recorder
from forge_obs.recording.timeline.records import (
    CUT_SHUTDOWN,
    K_BEGIN,
    K_END,
    K_EVENT,
    K_LANE,
    K_STEP,
    K_TAG,
    X_CPU,
    X_CUT,
    X_ERROR,
    AliveRecord,
    BeginEntry,
    BeginRecord,
    ClockRecord,
    CloseRecord,
    DroppedRecord,
    EndEntry,
    EndRecord,
    EventEntry,
    InstantRecord,
    LaneEntry,
    LaneRecord,
    MetaRecord,
    NameRecord,
    SpanRecord,
    StepEntry,
    StepRecord,
    TagEntry,
    TagRecord,
    dumps,
    entry_kind,
)
from forge_obs.recording.timeline.schema import VERSION, rank_selected, validate_options

__all__ = [
    "SESSION",
    "epoch_us",
    "now_us",
    "Writer",
    "configure",
    "configure_from_push",
    "controller_options",
    "flush",
    "close",
    "current_writer",
]

logger = logging.getLogger("forge_obs")

_WALL0_NS = time.time_ns()
_PC0_NS = time.perf_counter_ns()
#: epoch ns = perf_counter_ns + _BASE_NS
_BASE_NS = _WALL0_NS - _PC0_NS
#: one id per process lifetime: a restarted process (even with the same pid) is a new session
SESSION = secrets.token_hex(4)
#: entries one pass takes at most (the rest waits for the next pass)
PASS_MAX = 400_000

_writer: "Writer | None" = None
_lock = threading.Lock()
_last_seq = 0  # the highest entry number taken so far (gaps: entries dropped)
_lane_defs: dict[int, tuple] = {}  # lane -> (label, thread id), for the whole process


def epoch_us(pc_ns: int) -> int:
    return (pc_ns + _BASE_NS) // 1000


def now_us() -> int:
    return time.time_ns() // 1000


def _safe(s: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "-", str(s)) or "x"


class Writer:
    """One process's timeline file: opened, rotated, reopened for a new identity, closed."""

    def __init__(self, run_dir: Path, opts: dict[str, Any], clk: list | None) -> None:
        self.run_dir = Path(run_dir)
        self.opts = opts
        self.clk = clk
        self.max_bytes = int(opts["max_file_mb"] * 1024 * 1024)
        self.open_after_ns = int(opts["open_after_s"] * 1e9)
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.f: Any = None
        self.path: Path | None = None
        self.paths: list[Path] = []
        self.file_index = 0
        self.nbytes = 0
        self.t0 = 0
        self.names: dict[str, int] = {}
        self.lanes_in_file: set[int] = set()
        self.lane_defs = _lane_defs  # process-wide: lanes outlive writers
        self.open: dict[int, BeginEntry] = {}  # sid -> begin entry, not written yet
        self.written_open: dict[int, BeginEntry] = {}  # sid -> its "B" is written, waiting for its "E"
        self.dropped = 0
        self.ident_key: tuple | None = None
        self.actor = ""
        self.selected = True
        self.thread = threading.Thread(target=self._run, name="forge_obs-timeline", daemon=True)
        #: entry kind -> (its definition, the method that writes it)
        self._handlers = {K_BEGIN: (BeginEntry, self._begin), K_END: (EndEntry, self._end),
                          K_EVENT: (EventEntry, self._event), K_STEP: (StepEntry, self._step),
                          K_TAG: (TagEntry, self._tag), K_LANE: (LaneEntry, self._lane_entry)}

    # ------------------------------------------------------------ files
    def _select(self) -> bool:
        ident = current_identity()
        if self.opts.get("_ctl") or ident.mesh == "controller":
            return True
        meshes = self.opts.get("meshes")
        if meshes and not mesh_selected(ident.mesh, meshes):
            return False
        return rank_selected(self.opts.get("ranks"), ident.rank)

    def _open(self, reason: str = "") -> None:
        ident = current_identity()
        self.ident_key = (ident.mesh, ident.rank)
        self.actor = ident.actor
        self.selected = self._select()
        if not self.selected:
            recorder.set_recording(False)
            return
        ev = self.run_dir / "events"
        ev.mkdir(parents=True, exist_ok=True)
        base = "_".join(_safe(x) for x in (ident.host, ident.pid, ident.mesh, ident.rank))
        name = f"{base}.jsonl" if self.file_index == 0 else f"{base}.{self.file_index}.jsonl"
        self.path = ev / name
        self.paths.append(self.path)
        self.f = open(self.path, "a", encoding="utf-8")
        self.t0 = now_us()
        header = {
            "h": 1,
            "v": VERSION,
            "run": self.opts.get("_run_id") or self.run_dir.name,
            "start": self.opts.get("_start"),
            "session": SESSION,
            "host": ident.host,
            "pid": ident.pid,
            "mesh": ident.mesh,
            "actor": ident.actor,
            "rank": ident.rank,
            "coords": ident.coords,
            "ws": ident.world_size,
            "ctl": bool(self.opts.get("_ctl")),
            "ranks": str(self.opts.get("ranks")),
            "t0": self.t0,
            "clk": self.clk,
            "file": self.file_index,
        }
        s = dumps(header) + "\n"
        self.f.write(s)
        self.nbytes = len(s)
        self.names = {}
        self.lanes_in_file = set()

    def _close_file(self, clean: bool) -> None:
        if self.f is None:
            return
        try:
            if clean:
                self.f.write(CloseRecord.encode(now_us() - self.t0))
            self.f.flush()
            os.fsync(self.f.fileno())
        except (OSError, ValueError):
            pass
        try:
            self.f.close()
        except OSError:
            pass
        self.f = None

    def _rotate(self) -> None:
        self._close_file(clean=False)
        self.file_index += 1
        self._open("rotate")
        keep = int(self.opts.get("max_files") or 0)
        if keep > 0:
            while len(self.paths) > keep:
                old = self.paths.pop(0)
                try:
                    old.unlink()
                except OSError:
                    pass

    def _ready(self) -> bool:
        """Whether the file is open for this process's identity (opened, or reopened when the
        mesh or rank changed; an actor name learnt late is written as an identity update)."""
        if self.f is None and self.selected:
            self._open()
        elif self.f is not None:
            ident = current_identity()
            if (ident.mesh, ident.rank) != self.ident_key:
                self._close_file(clean=True)
                self.file_index = 0
                self.paths = []
                self._open("identity")
            elif ident.actor != self.actor:
                self.actor = ident.actor
                self.f.write(MetaRecord.encode({"actor": ident.actor}))
        return self.selected and self.f is not None

    def clock_sample(self, clk: list) -> None:
        """A later (local receive, controller send) pair: written when it narrows the estimate
        of this host's clock offset (readers take the minimum of ``recv - send``)."""
        recv_us, ctl_us = clk
        if self.clk is not None and recv_us - ctl_us >= _offset(self.clk):
            return
        self.clk = clk
        with self.lock:
            if self.f is not None:
                try:
                    self.f.write(ClockRecord.encode(recv_us, ctl_us))
                except (OSError, ValueError):
                    pass

    # ------------------------------------------------------------ records
    def _us(self, t_ns: int) -> int:
        """A recording-clock time as µs since this file's ``t0`` (floored: nesting survives)."""
        return (t_ns + _BASE_NS) // 1000 - self.t0

    def _nid(self, name: str, out: list) -> int:
        nid = self.names.get(name)
        if nid is None:
            nid = len(self.names) + 1
            self.names[name] = nid
            out.append(NameRecord.encode(nid, name))
        return nid

    def _lane(self, lane: int, out: list) -> int:
        if lane not in self.lanes_in_file:
            self.lanes_in_file.add(lane)
            label, tid = self.lane_defs.get(lane, (f"track-{lane}", 0))
            out.append(LaneRecord.encode(lane, label, tid))
        return lane

    def _seq(self, seq: int) -> None:
        global _last_seq
        last = _last_seq
        if seq > last:
            if seq > last + 1:
                self.dropped += seq - last - 1
            _last_seq = seq
        elif self.dropped:
            self.dropped -= 1  # out of order between threads, not lost

    def _begin(self, b: BeginEntry, out: list) -> None:
        self._seq(b.sid)
        self.open[b.sid] = b

    def _end(self, e: EndEntry, out: list) -> None:
        b = self.open.pop(e.sid, None)
        if b is not None:  # begin and end in one pass: one complete record
            ts = self._us(b.t_ns)
            dur = self._us(e.t_ns) - ts
            ex = _end_extras(b.extras, e, b.cpu_ns, dur)
            out.append(SpanRecord.encode(ts, dur, self._lane(b.lane, out), self._nid(b.name, out), b.step, ex))
            return
        b = self.written_open.pop(e.sid, None)
        if b is not None:  # its "B" is on disk
            ts = self._us(e.t_ns)
            out.append(EndRecord.encode(e.sid, ts, _end_extras(None, e, b.cpu_ns, ts - self._us(b.t_ns))))

    def _event(self, e: EventEntry, out: list) -> None:
        self._seq(e.seq)
        out.append(InstantRecord.encode(self._us(e.t_ns), self._lane(e.lane, out), self._nid(e.name, out), e.step,
                                        e.extras))

    def _step(self, e: StepEntry, out: list) -> None:
        self._seq(e.seq)
        out.append(StepRecord.encode(self._us(e.t_ns), self._lane(e.lane, out), e.step))

    def _tag(self, e: TagEntry, out: list) -> None:
        self._seq(e.seq)
        out.append(TagRecord.encode(self._us(e.t_ns), self._lane(e.lane, out), e.step, e.tag))

    def _lane_entry(self, e: LaneEntry, out: list) -> None:
        self.lane_defs[e.lane] = (e.label, e.tid)

    def _open_spans(self, final: bool, out: list) -> None:
        """Spans still open: written as "B" once open past ``open_after_s`` (a possible hang), or
        at a clean close (then also "E" at the close: cut short by the shutdown, not a hang)."""
        now_ns = recorder.clock_ns()  # the recording clock: the one span starts were taken with
        lim = now_ns - self.open_after_ns
        for sid, b in list(self.open.items()):
            old = b.t_ns <= lim
            if not (final or old):
                continue
            del self.open[sid]
            out.append(BeginRecord.encode(sid, self._us(b.t_ns), self._lane(b.lane, out), self._nid(b.name, out),
                                          b.step, b.extras))
            if old:
                self.written_open[sid] = b
            else:
                out.append(EndRecord.encode(sid, self._us(now_ns), {X_CUT: CUT_SHUTDOWN}))

    def _drain(self, final: bool = False) -> None:
        """Write what the buffer holds (one pass per tick, under the writer's lock)."""
        with self.lock:
            if not self._ready():
                recorder.clear()
                return
            out: list[str] = []
            dropped0 = self.dropped
            handlers = self._handlers
            for e in recorder.take(PASS_MAX):
                entry, write = handlers[entry_kind(e)]
                write(entry._make(e), out)
            if self.open:
                self._open_spans(final, out)
            if self.dropped > dropped0:
                out.append(DroppedRecord.encode(self.dropped - dropped0))
            if not out and self.written_open and not final:  # a span on disk as "B" still open
                out.append(AliveRecord.encode(self._us(recorder.clock_ns())))
            if out:
                self._write("".join(out))

    def _write(self, s: str) -> None:
        try:
            self.f.write(s)
            self.f.flush()
        except (OSError, ValueError) as err:
            logger.warning("forge_obs: timeline write to %s failed: %r", self.path, err)
            return
        self.nbytes += len(s)
        if self.nbytes > self.max_bytes:
            self._rotate()

    def _run(self) -> None:
        interval = self.opts["flush_interval_s"]
        while not self.stop_ev.wait(interval):
            if _writer is not self and self.selected:
                break  # replaced or abandoned: never drain another writer's buffer
            recorder.refresh_compile_check()
            cpu0 = time.thread_time()
            try:
                self._drain()
            except Exception as e:  # noqa: BLE001 - never die silently, never raise
                logger.warning("forge_obs: timeline writer pass failed: %r", e)
            SELF_OBS.add("timeline", time.thread_time() - cpu0)

    def start(self) -> None:
        with self.lock:
            self._open()
        self.thread.start()

    def close(self) -> None:
        self.stop_ev.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)
        try:
            self._drain(final=True)
        except Exception as e:  # noqa: BLE001
            logger.warning("forge_obs: timeline final write failed: %r", e)
        with self.lock:
            self._close_file(clean=True)


def _offset(clk: list) -> int:
    recv_us, ctl_us = clk
    return recv_us - ctl_us


def _end_extras(extras: "dict | None", e: EndEntry, cpu0: "int | None", dur_us: int) -> "dict | None":
    """A span's extras at its end: plus its error, and its CPU µs (never more than its ``dur_us``)."""
    if e.error is None and (cpu0 is None or e.cpu_ns is None):
        return extras
    ex = dict(extras) if extras else {}
    if e.error is not None:
        ex[X_ERROR] = e.error
    if cpu0 is not None and e.cpu_ns is not None:
        ex[X_CPU] = max(0, min((e.cpu_ns - cpu0) // 1000, dur_us))
    return ex


# -------------------------------------------------------------------- module API
def configure(run_dir: Any, options: dict[str, Any], clk: list | None = None) -> bool:
    """(Re)configure this process's writer. Same run dir: keeps the writer running."""
    global _writer
    if recorder.DISABLED:
        return False
    opts = validate_options(options)
    if run_dir is None:
        return recorder.is_enabled()
    run_dir = Path(run_dir)
    with _lock:
        w = _writer
        if w is not None and w.run_dir == run_dir and w.f is not None:
            if clk is not None:
                w.clock_sample(clk)
            return recorder.is_enabled()
        if w is not None:
            _writer = None
            w.close()
        if not opts["enabled"]:
            recorder.set_recording(False)
            return False
        recorder.set_recording(True)
        recorder.refresh_compile_check()
        recorder.use_capacity(recorder.BUFFER_CAP)
        w = Writer(run_dir, opts, clk)
        _writer = w
        w.start()
        if not w.selected:
            _writer = None
            w.stop_ev.set()
            w.thread.join(timeout=5)
            recorder.use_capacity(recorder.PRECONFIG_CAP)
            return False
    return True


def configure_from_push(run_dir: str | None, options: dict[str, Any], recv_us: int | None = None) -> bool:
    """Called in a mesh process by the fetcher when the controller pushes its configuration
    (``options["_ctl_us"]`` is the controller's clock when it sent it)."""
    if run_dir is None:
        close()
        return False
    recv = recv_us if recv_us is not None else now_us()
    ctl = options.get("_ctl_us") if isinstance(options, dict) else None
    clk = [recv, int(ctl)] if ctl is not None else None
    opts = {k: v for k, v in (options or {}).items() if k != "_ctl"}
    return configure(run_dir, opts, clk)


def controller_options(run_id: str, start_time: float, options: dict[str, Any] | None) -> dict[str, Any]:
    """The options the controller configures itself with and pushes to meshes."""
    opts = validate_options(options)
    opts["_run_id"] = run_id
    opts["_start"] = start_time
    return opts


def flush() -> None:
    w = _writer
    if w is not None:
        w._drain()
        if w.f is not None:
            with w.lock:
                try:
                    w.f.flush()
                except (OSError, ValueError):
                    pass


def close() -> None:
    global _writer
    with _lock:
        w, _writer = _writer, None
    if w is not None:
        w.close()
        recorder.use_capacity(recorder.PRECONFIG_CAP)


def current_writer() -> "Writer | None":
    return _writer


def _after_fork_in_child() -> None:
    """A forked child has no writer thread: forget the parent's writer (and its buffered
    records); the child records into the small pre-configuration buffer until configured."""
    global _writer
    _writer = None
    recorder.clear()
    recorder.use_capacity(recorder.PRECONFIG_CAP)


atexit.register(close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
