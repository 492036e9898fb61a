"""Background writer: drains the per-process buffer into ``<run_dir>/events/<proc>.jsonl``.

One daemon thread per process, a pass every ``flush_interval_s``: complete spans become one short
record, spans open longer than ``open_after_s`` are written as ``B`` (so a hang is on disk; at a
clean close too), spans younger than that when the file is closed cleanly as ``B`` + ``E`` marked
``{"x": "shutdown"}`` (cut short by the shutdown, not a hang), the
file is rotated past ``max_file_mb``, and the process identity is resolved when the file is
opened (and re-checked every pass: a new mesh/rank opens a new file). See
:mod:`forge_obs.recording.timeline.schema` for the format.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

from forge_obs.core.identity import current_identity, mesh_selected
from forge_obs.core.selfobs import SELF_OBS
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

# the recording state this writer drains (not `from forge_obs import timeline`: importing through
# the root package can deadlock with another thread that is still initialising it)
_tl = importlib.import_module("forge_obs.recording.timeline")

logger = logging.getLogger("forge_obs")

_WALL0_NS = time.time_ns()
_PC0_NS = time.perf_counter_ns()
#: epoch ns = perf_counter_ns + _BASE_NS
_BASE_NS = _WALL0_NS - _PC0_NS
#: one id per process lifetime: a restarted process (even with the same pid) is a new session
SESSION = secrets.token_hex(4)

_writer: "Writer | None" = None
_lock = threading.Lock()
_last_seq = [0]
_lane_defs: dict[int, tuple] = {}  # lane -> (label, thread id), for the whole process


def epoch_us(pc_ns: int) -> int:
    return (pc_ns + _BASE_NS) // 1000


def now_us() -> int:
    return time.time_ns() // 1000


def _safe(s: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]", "-", str(s)) or "x"


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)  # holds no state between calls


def _dumps(o: Any) -> str:
    return _ENCODER.encode(o)


class Writer:
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
        self.open: dict[int, tuple] = {}  # sid -> begin entry, not written yet
        self.written_open: dict[int, bool] = {}  # sid -> B written, waiting for its E
        self.dropped = 0
        self.ident_key: tuple | None = None
        self.actor = ""
        self.selected = True
        self.thread = threading.Thread(target=self._run, name="forge_obs-timeline", daemon=True)

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
            _tl._set_on(False)
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
        s = _dumps(header) + "\n"
        self.f.write(s)
        self.nbytes = len(s)
        self.names = {}
        self.lanes_in_file = set()

    def _close_file(self, clean: bool) -> None:
        if self.f is None:
            return
        try:
            if clean:
                self.f.write(f'["Z",{now_us() - self.t0}]\n')
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

    def clock_sample(self, clk: list) -> None:
        """A later (local receive, controller send) pair: written when it narrows the estimate
        of this host's clock offset (readers take the minimum of ``recv - send``)."""
        if self.clk is not None and clk[0] - clk[1] >= self.clk[0] - self.clk[1]:
            return
        self.clk = clk
        with self.lock:
            if self.f is not None:
                try:
                    self.f.write(f'["C",{int(clk[0])},{int(clk[1])}]\n')
                except (OSError, ValueError):
                    pass

    # ------------------------------------------------------------ records
    def _nid(self, name: str, out: list) -> int:
        nid = self.names.get(name)
        if nid is None:
            nid = len(self.names) + 1
            self.names[name] = nid
            out.append(f'["N",{nid},{_dumps(name)}]\n')
        return nid

    def _lane(self, lane: int, out: list) -> int:
        if lane not in self.lanes_in_file:
            self.lanes_in_file.add(lane)
            label, tid = self.lane_defs.get(lane, (f"track-{lane}", 0))
            out.append(f'["L",{lane},{_dumps(label)},{tid}]\n')
        return lane

    def _seq(self, seq: int) -> None:
        last = _last_seq[0]
        if seq > last:
            if seq > last + 1:
                self.dropped += seq - last - 1
            _last_seq[0] = seq
        elif self.dropped:
            self.dropped -= 1  # out of order between threads, not lost

    def _drain(self, final: bool = False) -> None:
        """Write what the buffer holds (one pass per tick, under the writer's lock). One function
        on purpose: it is the per-record loop of the writer thread, its lookups bound once."""
        with self.lock:
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
                    self.f.write(f'["M",{_dumps({"actor": ident.actor})}]\n')
            if not self.selected or self.f is None:
                _tl._buf.clear()
                return
            buf = _tl._buf
            pop = buf.popleft
            out: list[str] = []
            t0 = self.t0
            base = _BASE_NS
            dropped0 = self.dropped
            n = 0
            while n < 400_000:
                try:
                    e = pop()
                except IndexError:
                    break
                n += 1
                k = e[0]
                if k == 1:  # begin
                    self._seq(e[1])
                    self.open[e[1]] = e
                elif k == 2:  # end
                    b = self.open.pop(e[1], None)
                    if b is not None:
                        ts = (b[2] + base) // 1000 - t0
                        dur = (e[2] + base) // 1000 - t0 - ts  # floors of both ends: nesting survives
                        lane = self._lane(b[3], out)
                        nid = self._nid(b[4], out)
                        st = "null" if b[5] is None else b[5]
                        ex = b[6]
                        if e[3] is not None:
                            ex = dict(ex or {}, e=e[3])
                        if ex:
                            out.append(f"[{ts},{dur},{lane},{nid},{st},{_dumps(ex)}]\n")
                        else:
                            out.append(f"[{ts},{dur},{lane},{nid},{st}]\n")
                    elif self.written_open.pop(e[1], None) is not None:
                        ts = (e[2] + base) // 1000 - t0
                        if e[3] is not None:
                            out.append(f'["E",{e[1]},{ts},{_dumps({"e": e[3]})}]\n')
                        else:
                            out.append(f'["E",{e[1]},{ts}]\n')
                elif k == 6:  # event
                    self._seq(e[1])
                    ts = (e[2] + base) // 1000 - t0
                    lane = self._lane(e[3], out)
                    nid = self._nid(e[4], out)
                    st = "null" if e[5] is None else e[5]
                    if e[6]:
                        out.append(f'["I",{ts},{lane},{nid},{st},{_dumps(e[6])}]\n')
                    else:
                        out.append(f'["I",{ts},{lane},{nid},{st}]\n')
                elif k == 4:  # step
                    self._seq(e[1])
                    ts = (e[2] + base) // 1000 - t0
                    out.append(f'["S",{ts},{self._lane(e[3], out)},{e[4]}]\n')
                elif k == 5:  # tag
                    self._seq(e[1])
                    ts = (e[2] + base) // 1000 - t0
                    st = "null" if e[4] is None else e[4]
                    out.append(f'["T",{ts},{self._lane(e[3], out)},{st},{_dumps(e[5])}]\n')
                elif k == 3:  # lane definition
                    self.lane_defs[e[1]] = (e[2], e[3])
            if self.open:
                now_ns = _tl._clock_ns()  # the recording clock: the one span starts were taken with
                lim = now_ns - self.open_after_ns
                for sid, b in list(self.open.items()):
                    old = b[2] <= lim
                    if final or old:
                        del self.open[sid]
                        ts = (b[2] + base) // 1000 - t0
                        lane = self._lane(b[3], out)
                        nid = self._nid(b[4], out)
                        st = "null" if b[5] is None else b[5]
                        tail = f",{_dumps(b[6])}" if b[6] else ""
                        out.append(f'["B",{sid},{ts},{lane},{nid},{st}{tail}]\n')
                        if old:
                            self.written_open[sid] = True  # open past open_after_s: a possible hang
                        else:
                            # younger than open_after_s when the timeline closes cleanly: cut short by
                            # the shutdown (or the end of the run), not a hang; ends at the close
                            out.append(f'["E",{sid},{(now_ns + base) // 1000 - t0},{{"x":"shutdown"}}]\n')
            if self.dropped > dropped0:
                out.append(f'["D",{self.dropped - dropped0}]\n')
            if out:
                s = "".join(out)
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
            _tl._torch_loaded[0] = "torch" in sys.modules
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


# -------------------------------------------------------------------- module API
def configure(run_dir: Any, options: dict[str, Any], clk: list | None = None) -> bool:
    """(Re)configure this process's writer. Same run dir: keeps the writer running."""
    global _writer
    if _tl.DISABLED:
        return False
    opts = validate_options(options)
    if run_dir is None:
        return _tl._ON
    run_dir = Path(run_dir)
    with _lock:
        w = _writer
        if w is not None and w.run_dir == run_dir and w.f is not None:
            if clk is not None:
                w.clock_sample(clk)
            return _tl._ON
        if w is not None:
            _writer = None
            w.close()
        if not opts["enabled"]:
            _tl._set_on(False)
            return False
        _tl._set_on(True)
        _tl._torch_loaded[0] = "torch" in sys.modules
        _tl._swap_buffer(_tl.BUFFER_CAP)
        w = Writer(run_dir, opts, clk)
        _writer = w
        w.start()
        if not w.selected:
            _writer = None
            w.stop_ev.set()
            w.thread.join(timeout=5)
            _tl._swap_buffer(_tl.PRECONFIG_CAP)
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
        _tl._swap_buffer(_tl.PRECONFIG_CAP)


def current_writer() -> "Writer | None":
    return _writer


def _after_fork_in_child() -> None:
    """A forked child has no writer thread: forget the parent's writer (and its buffered
    records); the child records into the small pre-configuration buffer until configured."""
    global _writer
    _writer = None
    _tl._buf.clear()
    _tl._swap_buffer(_tl.PRECONFIG_CAP)


atexit.register(close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
