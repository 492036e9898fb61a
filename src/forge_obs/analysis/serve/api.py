"""The JSON API of ``forge-obs serve``: one method per endpoint, over :class:`Runs`.

Every endpoint takes a run by its id (a directory name directly under the runs root, as listed
by :meth:`Runs.ids`); nothing else of a request names a file. Values that JSON cannot carry
(NaN, inf) travel as text. A run is read only through :class:`~.state.RunState`'s data-access
interface (see :mod:`.state`).
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

from forge_obs.analysis.report.data import group_of, group_sort_key, overview_panels
from forge_obs.analysis.serve.analyses import Findings, TraceSlot, critical_path_at, jsonable
from forge_obs.analysis.serve.indexed import IndexedRun
from forge_obs.analysis.serve.files import Confined
from forge_obs.analysis.serve.series import align
from forge_obs.analysis.serve.meta import read_meta, run_labels
from forge_obs.analysis.serve.held import ServeConfig
from forge_obs.analysis.serve.state import RunState
from forge_obs.analysis.store import RUN_MARKERS

__all__ = ["Runs", "jsonable", "named_keys", "critical_path_at", "MAX_CHART_POINTS", "MAX_RANK_LINES",
           "MAX_COMPARED", "MAX_BADGES"]

#: points a chart may ask for (about its width in pixels)
MAX_CHART_POINTS = 4000
#: ranks drawn on one per-rank chart (the rest are listed as left out)
MAX_RANK_LINES = 64
#: runs compared (and overlaid on one chart) at once
MAX_COMPARED = 8
#: alerts and findings marked on one chart, the most relevant first
MAX_BADGES = 200


def named_keys(obj: Any, keys: "list[str]") -> list[str]:
    """The keys of ``keys`` that ``obj`` (a finding or an alert) names, longest first, a key not
    counted when only a longer key containing it is named."""
    text = json.dumps(obj, default=str)
    out: list[str] = []
    for key in sorted((k for k in keys if k in text), key=len, reverse=True):
        if re.search(r"(?<![\w/])" + re.escape(key) + r"(?![\w/])", text) and not any(k.startswith(key + "/") for k in out):
            out.append(key)
    return out


class Runs:
    """The runs under ``root`` (or ``root`` itself when it is a run directory), opened lazily,
    at most ``max_open`` at once (least recently used closed first)."""

    def __init__(self, root: "str | Path", config: ServeConfig | None = None, max_open: int = 8,
                 index: bool = True) -> None:
        self.root = Path(root).resolve()
        self.index = index  # keep an indexer process for each open run that has a timeline
        self.files = Confined(self.root)
        self.cfg = config or ServeConfig()
        self.single = self._is_run(self.root)
        self.max_open = max_open
        self._open: OrderedDict[str, tuple[RunState, Findings]] = OrderedDict()
        self._ix: dict[str, IndexedRun] = {}  # run id -> its index, as read here (with its indexer)
        self._lock = threading.Lock()
        self._trace = TraceSlot()
        self._info: dict[str, tuple] = {}  # run id -> (version, state, the last /api/run answer)
        self.poll_s = 0.25
        self._stop, self._wake = threading.Event(), threading.Event()
        self._reader = threading.Thread(target=self._read_on, name="forge_obs-serve-reader", daemon=True)
        self._reader.start()
        if index:  # the index's modules (DuckDB) loaded before the first page asks for a run's steps
            threading.Thread(target=_load_index_modules, name="forge_obs-serve-imports", daemon=True).start()

    # ------------------------------------------------------------------ runs and their state
    def ids(self) -> list[str]:
        if self.single:
            return [self.root.name]
        try:
            kids = sorted(self.root.iterdir(), key=lambda p: p.name)
        except OSError:
            return []
        return [p.name for p in kids if not p.is_symlink() and self._is_run(p)]

    def _is_run(self, p: Path) -> bool:
        """A directory holding one of the run markers (not through a link out of the root)."""
        return p.is_dir() and any(self.files.exists(p / m) for m in RUN_MARKERS)

    def path(self, run_id: Any) -> Path | None:
        """The directory of ``run_id``, or None: only a listed name, never a path."""
        if not isinstance(run_id, str) or not run_id or run_id in (".", "..") or any(c in run_id for c in "/\\\0"):
            return None
        if self.single:
            return self.root if run_id == self.root.name else None
        p = self.root / run_id
        if p.is_symlink() or not self._is_run(p) or p.resolve().parent != self.root:
            return None
        return p

    def get(self, run_id: Any) -> tuple[RunState, Findings] | None:
        p = self.path(run_id)
        if p is None:
            return None
        with self._lock:
            ent = self._open.get(run_id)
            if ent is None:
                ent = self._open[run_id] = (RunState(p, self.cfg, self.files), Findings(p, self.files))
                self._ix[run_id] = IndexedRun(p, self.files, start=self.index and (p / "events").is_dir())
                while len(self._open) > self.max_open:
                    old, (_st, fi) = self._open.popitem(last=False)
                    fi.close()
                    self._ix.pop(old).close(wait=False)
            self._open.move_to_end(run_id)
        st, fi = ent
        if st.metrics.offset or st.metrics.file_size() <= st.metrics.max_bytes:
            st.update(chunks=1, wait=False)  # what was appended; a large run is read by the reader thread
        if fi.generation != st.generation:
            fi.reset(st.generation)
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
            meta = read_meta(p, self.files)
            ent = self._open.get(rid)
            row: dict[str, Any] = {"id": rid, "status": meta.get("status") or "?", "start_time": meta.get("start_time"),
                                   "end_time": meta.get("end_time"), "steps": meta.get("steps_logged"), **run_labels(meta)}
            if ent is not None:
                st = ent[0]
                row.update(status=st.status()["state"], steps=st.facts()["steps"], last_wall=st.facts()["last_wall"],
                           alerts=sum(1 for a in _alert_states(st.alert_list()) if a["state"] == "firing"),
                           findings=len(ent[1].result.get("findings") or []))
            else:
                row["alerts"] = _count_firing(self.files, p / "alerts.jsonl")
            out.append(jsonable(row))
        return {"root": str(self.root), "single": self.single, "runs": out}

    def info(self, rid: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        slowest = self._ix[rid].slowest(10)  # the controller steps of the index, when it has some
        with st.lock:
            cached = self._info.get(rid)
            if cached is not None and cached[0] == st.version and cached[1] is st:  # nothing read since
                return dict(cached[2], status=jsonable(st.status()), reading=st.reading(), labels=st.labels(),
                            slowest=jsonable(slowest or st.slowest(10)))
            keys = st.keys()
            charts = [k for k in keys if st.dist_of(k) is None]
            groups: dict[str, list] = {}
            for k in charts:
                groups.setdefault(group_of(k), []).append(st.summary(k))
            for d in sorted(st.distributions):
                groups.setdefault(group_of(d), []).append({**st.summary(f"{d}/p50"), "key": d, "dist": True})
            panels = [{"title": p.title, "keys": p.keys + ([p.total] if p.total else []), "stacked": p.stacked}
                      for p in overview_panels(charts)]
            meta = st.meta()
            out = jsonable({
                "id": rid, "run_dir": str(st.run_dir), "status": st.status(), "version": st.version,
                "generation": st.generation, **st.facts(), "reading": st.reading(), "labels": st.labels(),
                "meta": {k: meta.get(k) for k in ("run_id", "status", "start_time", "end_time", "steps_logged",
                                                  "process_name") if k in meta},
                "panels": panels,
                "groups": [{"group": g, "keys": sorted(groups[g], key=lambda r: r["key"])}
                           for g in sorted(groups, key=group_sort_key)],
                "rank_keys": st.rank_keys(), "samples": st.sample_key_names(), "slowest": slowest or st.slowest(10),
            })
            self._info[rid] = (st.version, st, out)
            return out

    def poll(self, rid: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        return jsonable({"version": st.version, "generation": st.generation, "last_step": st.facts()["last_step"],
                         "status": st.status(), "reading": st.reading(), "alerts": len(st.alert_list()),
                         "index": self._ix[rid].state()})

    def series(self, rid: str, keys: list[str], n: int, axis: str, lo: int | None, hi: int | None) -> dict | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        cols, res = st.points(keys, _points(n), lo, hi)
        names = [k for k in keys if k in cols]
        return self._aligned(st, ent[1], names, [cols[k] for k in names], axis, res)

    def ranks(self, rid: str, key: str, n: int, axis: str, lo: int | None, hi: int | None) -> dict | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st = ent[0]
        every = st.rank_labels(key)
        labels = every[:MAX_RANK_LINES]
        cols, res = st.rank_points(key, labels, max(2, _points(n) // 2), lo, hi)
        out = self._aligned(st, ent[1], labels, [cols.get(lb, ([], [])) for lb in labels], axis, res, marks_for=[key])
        out["left_out"] = max(0, len(every) - len(labels))
        return out

    def _aligned(self, st: RunState, findings: Findings, names: list[str], cols: list, axis: str,
                 resolution: dict, marks_for: list[str] | None = None) -> dict[str, Any]:
        steps, xs, ys = _on_axis(st, cols, axis)
        marks = _marks(st, findings, marks_for or names, st.x_of(axis))
        return jsonable({"names": names, "x": xs, "steps": steps, "y": ys, "marks": marks, "version": st.version,
                         "resolution": resolution})

    def overlay(self, ids: list[str], key: str, n: int, axis: str, lo: int | None, hi: int | None) -> dict | None:
        """``key`` of several runs on one x axis (step, or seconds since each run's first step,
        or policy version), one line a run."""
        ents = [self.get(r) for r in ids[:MAX_COMPARED]]
        if not ids or any(e is None for e in ents):
            return None
        lines, versions = [], []
        for st, _fi in ents:
            cols, _res = st.points([key], _points(n), lo, hi)
            _steps, xs, ys = _on_axis(st, [cols.get(key, ([], []))], axis)
            lines.append((xs, ys[0]))
            versions.append(st.version)
        xs, ys = align(lines)
        return jsonable({"names": ids[:MAX_COMPARED], "key": key, "x": xs, "y": ys, "steps": xs if axis == "step" else [],
                         "marks": [], "versions": versions})

    def step(self, rid: str, step: int) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        st, fi = ent
        with st.lock:
            d = st.step_detail(step)
            keys = st.keys()
            alerts = [dict(a, keys=named_keys(a, keys)) for a in st.alert_list() if _at_step(a, step)]
        found = [dict(f, keys=named_keys(f, keys)) for f in fi.get()["findings"] if _at_step(f, step)]
        ix = self._ix[rid]
        d.update(alerts=alerts, findings=found, critical_path=ix.critical_path(step), spans=ix.spans(step),
                 trace_command=f"forge-obs trace {st.run_dir} --steps {step} --open")
        return jsonable(d)

    def findings(self, rid: str) -> dict[str, Any] | None:
        """The doctor's findings and the alerts (one per alert: its latest state, onset and
        last step), each with the keys it names; the newest first."""
        ent = self.get(rid)
        if ent is None:
            return None
        st, fi = ent
        res = fi.get()
        keys = st.keys()
        alerts = [dict(a, keys=named_keys(a, keys)) for a in _alert_states(st.alert_list())]
        alerts.sort(key=lambda a: (a["state"] == "firing", _onset(a) or 0), reverse=True)
        found = sorted((dict(f, keys=named_keys(f, keys)) for f in res["findings"]), key=lambda f: -(_onset(f) or 0))
        return jsonable({"findings": found, "notes": res["notes"], "state": res["state"], "computing": res["computing"],
                         "alerts": alerts})

    def samples(self, rid: str, key: str) -> dict[str, Any] | None:
        ent = self.get(rid)
        if ent is None:
            return None
        step, rows = ent[0].samples(key)
        return jsonable({"key": key, "step": step, "rows": rows})

    def compare(self, ids: list[str]) -> dict[str, Any] | None:
        """Every key of the runs ``ids`` side by side (last value, min, max), with how far each
        run is read and its version (the page refreshes while they change)."""
        ents = [self.get(r) for r in ids[:MAX_COMPARED]]
        if len(ids) < 2 or any(e is None for e in ents):
            return None
        states = [e[0] for e in ents]
        runs = [{"id": r, **st.labels(), "version": st.version, "reading": st.reading(), "steps": st.facts()["steps"]}
                for r, st in zip(ids, states)]
        keysets = []
        for st in states:
            with st.lock:
                keysets.append({k: st.summary(k) for k in st.keys()})
        rows = [{"key": k, "values": [ks.get(k) for ks in keysets]} for k in sorted(set().union(*keysets))]
        return jsonable({"ids": ids[:MAX_COMPARED], "runs": runs, "rows": rows})

    def csv(self, rid: str, keys: list[str], lo: int | None, hi: int | None, rank_key: str | None,
            name: str) -> tuple[str, Iterator[bytes]] | None:
        """A chart's data as CSV, every step's exact value read back from ``metrics.jsonl``
        (the range ``[lo, hi]`` when given): its file name and its lines."""
        ent = self.get(rid)
        if ent is None:
            return None
        rows = ent[0].csv_rows(keys, lo, hi, rank_key)
        return _filename(f"{rid}-{name or '-'.join(keys)}") + ".csv", _csv_lines(rows)

    def perfetto(self, rid: str, step: int) -> dict[str, Any] | None:
        p = self.path(rid)
        if p is None:
            return None
        return self._trace.open(p, step, self.files)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._reader.join(timeout=10)
        with self._lock:
            for _st, fi in self._open.values():
                fi.close()
            for ix in self._ix.values():
                ix.close(wait=False)
        self._trace.close()


def _load_index_modules() -> None:
    """Loads DuckDB, pyarrow and the index's views (once, in the background)."""
    from forge_obs.analysis.index import available

    if available():
        for name in ("forge_obs.analysis.index.answers", "forge_obs.analysis.index.views"):
            importlib.import_module(name)


def _points(n: int) -> int:
    return max(2, min(n, MAX_CHART_POINTS))


def _on_axis(st: RunState, cols: list, axis: str) -> tuple[list, list, list]:
    """Several (steps, values) on one shared axis: (steps, x, one column of values each); a step
    without an x on this axis (no wall time, no policy version) is left out; sorted by x."""
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
    return steps, xs, ys


def _filename(name: str) -> str:
    """``name`` as a file name: letters, digits, ``.``, ``_``, ``-``; other runs of characters ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:120] or "chart"


def _cell(v: Any) -> Any:
    """A CSV cell: numbers exactly (``repr``), text that a spreadsheet would run as a formula
    quoted with a leading ``'``."""
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return "" if v is None else v


def _csv_lines(rows: Iterator[list]) -> Iterator[bytes]:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for i, row in enumerate(rows):
        w.writerow([_cell(v) for v in row])
        if i % 512 == 511:
            yield buf.getvalue().encode()
            buf.seek(0)
            buf.truncate()
    yield buf.getvalue().encode()


def _count_firing(files: Confined, path: Path) -> int:
    """Alerts firing at the end of ``path`` (alerts.jsonl), of a run not opened yet."""
    try:
        with files.open(path) as f:
            alerts = []
            for line in f:
                try:
                    alerts.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        return 0
    return sum(1 for a in _alert_states([a for a in alerts if isinstance(a, dict)]) if a["state"] == "firing")


def _alert_states(events: list[dict]) -> list[dict]:
    """One entry per alert (its ``id``): its latest event, with ``onset_step`` from its first
    firing and ``state`` the latest, in the order they started."""
    by: dict[Any, dict] = {}
    for i, a in enumerate(events):
        key = a.get("id", f"#{i}")
        first = by.get(key)
        onset = first.get("onset_step") if first else _onset(a)
        by[key] = dict(a, onset_step=onset, state=str(a.get("state") or "firing"))
    return list(by.values())


def _onset(item: dict) -> int | None:
    step = item.get("onset_step", item.get("step"))
    if isinstance(step, int):
        return step
    steps = item.get("steps")
    return steps[0] if isinstance(steps, list) and steps and isinstance(steps[0], int) else None


def _at_step(item: dict, step: int) -> bool:
    steps = item.get("steps")
    if isinstance(steps, list) and steps and all(isinstance(s, int) for s in steps):
        return steps[0] <= step <= steps[-1]
    for k in ("step", "onset_step"):
        if item.get(k) == step:
            return True
    return False


def _marks(st: RunState, fi: Findings, keys: list[str], fx) -> list[dict[str, Any]]:
    """The alerts and doctor findings that name one of ``keys`` (or the distribution a quantile
    key belongs to), at their onset step: the most relevant first (an alert still firing and
    the doctor's findings before alerts that resolved), the newest first among equals."""
    want = set(keys) | {d for k in keys if (d := st.dist_of(k))}
    items = [("alert", a) for a in _alert_states(st.alert_list())]
    items += [("finding", dict(f, state="finding")) for f in fi.result.get("findings") or []]
    out = []
    for kind, item in items:
        named = [k for k in want if k in str(item)]
        if not named or not named_keys(item, named):
            continue
        step = _onset(item)
        if step is None or fx(step) is None:
            continue
        out.append({"x": fx(step), "step": step, "kind": kind, "rule": item.get("rule") or item.get("kind"),
                    "state": item["state"], "text": str(item.get("message", ""))[:300]})
    out.sort(key=lambda m: (m["state"] != "resolved", m["step"]), reverse=True)
    return out[:MAX_BADGES]
