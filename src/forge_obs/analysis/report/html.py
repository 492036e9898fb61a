"""One self-contained HTML page for a run directory: it opens offline, from a file.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "mode": "global_reduce", "wall_time": 100.0 + s, "metrics": {"trainer/loss": 1.0 / (s + 1)}}
    ...         for s in range(3)]
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> page = render_report(d)
    >>> page.count('<figure class="chart"')   # the loss in the overview, and in its group
    2

The page, top to bottom:

- **Overview**: the run's story — reward, loss, KL, entropy, throughput, staleness (each panel
  shows the keys matching :data:`forge_obs.analysis.report.data.OVERVIEW_PANELS`, with the mean of the
  first and last 10 points), the step-time breakdown (stacked), and the doctor's findings, each
  linked to the charts of the metric keys it names (a chart a finding names carries a badge
  back to it).
- **Critical path** (runs with a timeline): per controller step, the time on its critical path
  stacked by stage (``forge-obs why``), and the slowest steps' one-line answers with the
  commands that open their slice of the trace.
- **Run**: status, times, steps, host; the app's settings (``meta.json``'s ``app_settings``, e.g.
  the GRPO app's command-line flags) and the forge_obs config, both through
  :func:`forge_obs.core.redact.redact`.
- **Groups** (trainer, generator, service, buffer, reference, reward, controller, others; ``obs``
  folded): a chart per varying series, a distribution as one chart of its p50/p90/p99, and the
  constant and single-point series listed compactly under the charts.
- **Per rank**: one chart per key that >= 2 ranks recorded and whose ranks differ, the ranks
  overlaid.
- **Samples**: the latest rows of ``Reduce.SAMPLE`` keys.

Controls in the header: the x-axis (step, or wall time since the run's first step;
``report.html#wall`` opens on wall time) and smoothing (W&B's debiased exponential moving
average; 0 shows the raw series). Every key, label and value from the run is HTML-escaped; the
data travels as JSON inside ``<script type="application/json">`` with ``<``, ``>`` and ``&``
escaped.
"""

from __future__ import annotations

import html
import importlib
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from forge_obs.analysis.report.assets import CSS, JS
from forge_obs.analysis.report.data import RunData, group_of
from forge_obs.core.formatting import QUANTILES, format_value, unit_for

__all__ = [
    "MAX_POINTS",
    "MAX_RANK_LINES",
    "SMOOTHING",
    "COLORS",
    "esc",
    "slug",
    "fmt",
    "Page",
    "figure",
    "doctor_findings",
    "KNOWN_META",
    "render_report",
    "write_report",
]

MAX_POINTS = 1500
MAX_RANK_LINES = 16
#: default smoothing of the page's control (0: raw)
SMOOTHING = 0.6
CHART_H, BIG_H = 140, 180
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", key)


def fmt(v: Any, key: str = "") -> str:
    """A value as the console prints it (units from the key's suffix)."""
    return format_value(v, unit_for(key) if key else "")


def _json_for_script(obj: Any) -> str:
    """JSON that cannot close the ``<script>`` element it sits in."""
    s = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _num(v: float) -> Any:
    if math.isfinite(v):
        r = float(f"{v:.6g}")
        return int(r) if r.is_integer() and abs(r) < 2**53 else r
    return "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _mean(vals: list[float]) -> float | None:
    fin = [v for v in vals if math.isfinite(v)]
    return sum(fin) / len(fin) if fin else None


# ----------------------------------------------------------------------------- page model
class Page:
    """Row-aligned data for the script, chart ids, and the findings' links."""

    def __init__(self, data: RunData, findings: list[dict[str, Any]] | None, smoothing: float) -> None:
        self.data = data
        self.findings = findings or []
        self.t0 = data.t0 or 0.0
        self.js: dict[str, Any] = {"smoothing": smoothing, "s": {}, "r": {}, "rl": {}, "x": {}}
        self._global_rows()
        self.rank_keys = data.rank_chart_keys()
        self._rank_rows()
        self.chart_keys = set(data.chart_keys())
        self.flat_keys = set(data.flat_keys())
        # finding index -> [(key, anchor)], key -> [finding index]
        self.has_paths = False  # the report has a critical-path section
        self.links: list[list[tuple[str, str]]] = []
        self.badges: dict[str, list[int]] = {}
        self._link_findings()

    # -- data
    def _rows_of(self, pts_lists: list[list]) -> list[tuple[int, float | None]]:
        rows = {(s, w) for pts in pts_lists for s, w, _v in pts}
        if all(w is not None for _s, w in rows):
            return sorted(rows, key=lambda r: (r[1], r[0]))
        return sorted(rows, key=lambda r: (r[0], r[1] if r[1] is not None else 0.0))

    def _axis(self, rows: list[tuple[int, float | None]]) -> dict[str, list]:
        return {"s": [s for s, _w in rows], "w": [None if w is None else round(w - self.t0, 3) for _s, w in rows]}

    def _aligned(self, pts: list, index: dict, n: int, stride: int) -> list:
        out: list[Any] = [None] * n
        for s, w, v in pts:
            i = index.get((s, w))
            if i is not None:
                out[i] = _num(v)
        return out[::stride] if stride > 1 else out

    def _stride(self, n: int) -> int:
        return max(1, math.ceil(n / MAX_POINTS))

    def _global_rows(self) -> None:
        rows = self._rows_of(list(self.data.series.values()))
        self.n_rows = len(rows)
        self.stride = self._stride(len(rows))
        index = {r: i for i, r in enumerate(rows)}
        kept = rows[:: self.stride]
        self.js["g"] = self._axis(kept)
        for key, pts in self.data.series.items():
            self.js["s"][key] = self._aligned(pts, index, len(rows), self.stride)
        self._index = index

    def _rank_rows(self) -> None:
        labels: dict[str, list] = {}
        for key in self.rank_keys:
            for label, pts in self.data.rank_series[key].items():
                labels.setdefault(label, []).append(pts)
        for label, lists in labels.items():
            rows = self._rows_of(lists)
            stride = self._stride(len(rows))
            index = {r: i for i, r in enumerate(rows)}
            self.js["rl"][label] = self._axis(rows[::stride])
            for key in self.rank_keys:
                pts = self.data.rank_series[key].get(label)
                if pts is not None:
                    self.js["r"].setdefault(key, {})[label] = self._aligned(pts, index, len(rows), stride)

    def derived(self, name: str, values: list[float | None]) -> str:
        """A series computed here (the breakdown's "other"), aligned with the global rows."""
        self.js["x"][name] = [None if v is None else _num(v) for v in values][:: self.stride]
        return name

    def global_values(self, key: str) -> list[float | None]:
        out: list[float | None] = [None] * self.n_rows
        for s, w, v in self.data.series.get(key, []):
            out[self._index[(s, w)]] = v
        return out

    # -- findings
    def _link_findings(self) -> None:
        known = sorted(self.chart_keys | self.flat_keys | set(self.rank_keys), key=len, reverse=True)
        for i, f in enumerate(self.findings):
            text = json.dumps({k: v for k, v in f.items() if k != "kind"}, default=str)
            found: list[tuple[str, str]] = []
            for key in known:
                if not re.search(r"(?<![\w/])" + re.escape(key) + r"(?![\w/])", text):
                    continue
                if any(key != k and k.startswith(key + "/") for k, _a in found):
                    continue  # a longer key already matched here
                if key in self.chart_keys or key in self.flat_keys:
                    found.append((key, ("c-" if key in self.chart_keys else "k-") + slug(key)))
                    self.badges.setdefault(key, []).append(i)
                if key in self.rank_keys:
                    found.append((key, "r-" + slug(key)))
                    self.badges.setdefault("rank:" + key, []).append(i)
            self.links.append(found)


# ----------------------------------------------------------------------------- charts
def figure(fid: str, key: str, title: str, stat: str, lines: list[dict[str, Any]], height: int,
           legend: list[tuple[str, str]] | None = None, badges: str = "", stack: bool = False) -> str:
    spec = {"h": height, "lines": lines, "stack": stack}
    leg = ""
    if legend:
        leg = '<div class="legend">' + "".join(f'<span><i style="background:{c}"></i>{esc(t)}</span>'
                                               for c, t in legend) + "</div>"
    cap = (f'<figcaption title="{esc(title)}: {esc(stat)}"><b>{esc(title)}</b>{badges}'
           f'<span class="stat">{esc(stat)}</span></figcaption>')
    return (f'<figure class="chart" id="{esc(fid)}" data-key="{esc(key)}" data-spec="{esc(json.dumps(spec))}">'
            f'{cap}<div class="plot" style="height:{height}px"></div>{leg}</figure>')


def _badges(page: Page, key: str) -> str:
    return "".join(f' <a class="badge" href="#f-{i}" title="doctor finding">&#9888; {esc(page.findings[i].get("kind", "?"))}</a>'
                   for i in page.badges.get(key, []))


def _stat(data: RunData, key: str) -> str:
    sm = data.summary(key)
    if not sm["points"]:
        return ""
    parts = [f"last {fmt(sm['last'], key)}"]
    if "min" in sm:
        parts.append(f"range {fmt(sm['min'], key)} … {fmt(sm['max'], key)}")
    if sm["nonfinite"]:
        parts.append(f"{sm['nonfinite']} non-finite")
    return " · ".join(parts)


def _first_last(data: RunData, key: str, n: int = 10) -> str:
    vals = [v for _s, _w, v in data.series.get(key, [])]
    k = min(n, max(1, len(vals) // 2))
    a, b = _mean(vals[:k]), _mean(vals[-k:])
    if a is None or b is None:
        return key
    return f"{key}: {fmt(a, key)} → {fmt(b, key)}"


def _global_chart(page: Page, key: str, height: int = CHART_H) -> str:
    data = page.data
    if key in data.distributions:
        lines = [{"src": "s", "key": f"{key}/{q}", "name": q, "color": COLORS[i]}
                 for i, q in enumerate(QUANTILES) if f"{key}/{q}" in data.series]
        cnt = data.summary(f"{key}/count")
        stat = f"last p50 {fmt(data.summary(f'{key}/p50').get('last', math.nan), key)}"
        if "last" in cnt:
            stat += f" · n={fmt(cnt['last'])}"
        return figure("c-" + slug(key), key, key, stat, lines, height,
                      legend=[(ln["color"], ln["name"]) for ln in lines], badges=_badges(page, key))
    lines = [{"src": "s", "key": key, "name": key, "color": COLORS[0]}]
    return figure("c-" + slug(key), key, key, _stat(data, key), lines, height, badges=_badges(page, key))


# ----------------------------------------------------------------------------- sections
def _overview(page: Page) -> str:
    data = page.data
    figs = []
    for n, panel in enumerate(data.overview()):
        if panel.stacked:
            lines = [{"src": "s", "key": k, "name": k, "color": COLORS[i % len(COLORS)]} for i, k in enumerate(panel.keys)]
            legend = [(ln["color"], _first_last(data, ln["key"])) for ln in lines]
            if panel.total:
                tot = page.global_values(panel.total)
                parts = [page.global_values(k) for k in panel.keys]
                other = [None if t is None else max(0.0, t - sum(p[i] for p in parts if p[i] is not None and math.isfinite(p[i])))
                         for i, t in enumerate(tot)]
                name = page.derived("other", other)
                c = "#bbbbbb"
                lines.append({"src": "x", "key": name, "name": f"other (rest of {panel.total})", "color": c})
                legend.append((c, f"other: the rest of {panel.total}"))
            stat = f"stacked; total {panel.total}: {_first_last(data, panel.total).split(': ', 1)[-1]}" if panel.total else "stacked"
            figs.append(figure(f"o-{n}", panel.title, panel.title, stat, lines, BIG_H, legend=legend, stack=True))
        else:
            lines = [{"src": "s", "key": k, "name": k, "color": COLORS[i % len(COLORS)]} for i, k in enumerate(panel.keys)]
            legend = [(ln["color"], _first_last(data, ln["key"])) for ln in lines]
            badges = "".join(_badges(page, k) for k in panel.keys)
            figs.append(figure(f"o-{n}", panel.title, panel.title, "mean of the first → last 10 points", lines, BIG_H,
                               legend=legend, badges=badges))
    body = f'<div class="grid big">{"".join(figs)}</div>' if figs else '<p class="muted">no metrics in metrics.jsonl</p>'
    return f'<section id="overview"><h2>Overview</h2>{body}{_findings(page)}</section>'


#: stages drawn in the critical-path chart (the rest is stacked as "other")
PATH_STAGES = 6


def critical_paths(run_dir: Path) -> list[dict[str, Any]]:
    """Every controller step's critical path (:mod:`forge_obs.analysis.critical_path`); [] when
    the run has no controller steps or the walk fails (the rest of the report stands)."""
    if not (run_dir / "events").is_dir():
        return []
    try:
        from forge_obs.analysis.critical_path import analyse

        return analyse(run_dir)
    except Exception:  # noqa: BLE001 - a report is written whatever the timeline holds
        return []


def _path_section(page: Page, results: list[dict[str, Any]], run_dir: Path) -> str:
    """Per step, the critical path's time stacked by stage (mesh and span name; the biggest
    :data:`PATH_STAGES`, then "other"), and the slowest steps' one-line answers with the commands
    that open their slice of the trace."""
    if not results:
        return ""
    totals: dict[str, float] = {}
    per_step: dict[int, dict[str, float]] = {}
    for r in results:
        acc = per_step.setdefault(r["step"], {})
        for a in r["stages"]:
            k = f"{a['mesh']} {a['name']}"
            acc[k] = acc.get(k, 0.0) + a["path_s"]
            totals[k] = totals.get(k, 0.0) + a["path_s"]
    top = sorted(totals, key=lambda k: -totals[k])[:PATH_STAGES]
    rows = sorted(page._index, key=lambda r: page._index[r])
    fig = ""
    if rows:
        lines = []
        for i, k in enumerate([*top, "other"]):
            vals = [None if s not in per_step else (per_step[s].get(k, 0.0) if k != "other" else
                    sum(v for n, v in per_step[s].items() if n not in top)) for s, _w in rows]
            name = page.derived(f"path:{k}", vals)
            lines.append({"src": "x", "key": name, "name": k, "color": COLORS[i % len(COLORS)] if k != "other" else "#bbbbbb"})
        legend = [(ln["color"], f"{ln['name']}: {totals.get(ln['name'], 0.0):.1f} s on the path") for ln in lines]
        fig = figure("p-critical", "critical path", "time on the critical path per step, by stage (s)",
                     "stacked; the stages the controller's step waited on", lines, BIG_H, legend=legend, stack=True)
        fig = f'<div class="grid big">{fig}</div>'
    slow = sorted(results, key=lambda r: (not r["unfinished"], -r["duration_s"]))[:5]
    items = "".join(f'<li id="step-{r["step"]}">{esc(r["answer"])} <span class="muted">· <code>forge-obs why {esc(run_dir)} '
                    f'--step {r["step"]}</code> · <code>forge-obs trace {esc(run_dir)} --steps {r["step"]} '
                    f'--critical-path --open</code></span></li>' for r in slow)
    return (f'<section id="critical-path"><h2>Critical path</h2>{fig}<h3>Slowest steps</h3>'
            f'<ul class="findings">{items}</ul></section>')


def doctor_findings(run_dir: Path) -> tuple[str, list[dict[str, Any]] | None]:
    """(status, findings as dicts): findings is None when the doctor cannot run."""
    try:
        doctor = importlib.import_module("forge_obs.analysis.doctor")
    except ImportError:
        return "doctor not available (forge_obs.analysis.doctor could not be imported)", None
    fn = getattr(doctor, "diagnose", None)
    if fn is None:
        return "doctor not available (forge_obs.analysis.doctor has no diagnose())", None
    try:
        found = fn(run_dir)
    except Exception as e:  # noqa: BLE001 - the report still renders
        return f"the doctor failed: {e!r}", None
    out = []
    for f in found or []:
        d = f.to_dict() if hasattr(f, "to_dict") else (dict(f) if isinstance(f, dict) else {"message": str(f)})
        out.append(d)
    status = "" if (run_dir / "events").is_dir() else "no timeline (events/) in this run: metric checks only"
    return status, out


def _where(f: dict[str, Any]) -> str:
    parts = [str(f[k]) for k in ("mesh", "actor") if f.get(k) not in (None, "")]
    if f.get("rank") is not None:
        parts.append(f"r{f['rank']}")
    if f.get("replica") is not None:
        parts.append(f"replica {f['replica']}")
    return "/".join(parts)


def _steps(steps: Any) -> str:
    if not isinstance(steps, list) or not steps:
        return ""
    if len(steps) == 2 and steps[0] == steps[1]:
        return f"step {steps[0]}"
    if len(steps) == 2:
        return f"steps {steps[0]}–{steps[1]}"
    if len(steps) > 6:
        return f"steps {', '.join(map(str, steps[:5]))}, … ({len(steps)})"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def _findings(page: Page) -> str:
    status, findings = page.doctor_status, page.findings_or_none
    head = '<h3 id="findings">Doctor</h3>'
    body = f'<p class="muted">{esc(status)}</p>' if status else ""
    if findings is None:
        return head + body
    if not findings:
        return head + body + '<p class="ok">no findings</p>'
    items = []
    for i, f in enumerate(findings):
        where = _where(f)
        st = _steps(f.get("steps"))
        links = "".join(f' <a href="#{esc(a)}">{esc(k)}{" (per rank)" if a.startswith("r-") else ""}</a>'
                        for k, a in page.links[i])
        det = f.get("details")
        more = ""
        if det:
            more = f' <details><summary class="muted">details</summary><pre>{esc(json.dumps(det, indent=1, default=str))}</pre></details>'
        items.append(f'<li id="f-{i}"><span class="badge">{esc(f.get("kind", "?"))}</span> '
                     f'{"<b>" + esc(where) + "</b> " if where else ""}{esc(st) + ": " if st else ""}'
                     f'{esc(f.get("message", ""))}{" · charts:" + links if links else ""}{more}</li>')
    return head + body + f'<ul class="findings">{"".join(items)}</ul>'


def _utc(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if isinstance(t, (int, float)) else str(t)


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s")


def _inline(v: Any) -> str:
    if isinstance(v, dict):
        return " ".join(f"{k}={_inline(x)}" for k, x in v.items()) or "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_inline(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return str(v)


KNOWN_META = ("run_id", "status", "start_time", "end_time", "starts", "steps_logged", "backend_errors", "host",
              "python", "platform", "process_name", "config", "app", "app_settings")


def _run_section(page: Page) -> str:
    from forge_obs.core.redact import redact

    data, meta = page.data, page.data.meta
    rows: list[tuple[str, str]] = []
    if meta.get("app"):
        rows.append(("app", str(meta["app"])))
    if meta.get("status"):
        rows.append(("status", str(meta["status"])))
    if meta.get("start_time") is not None:
        rows.append(("started", _utc(meta["start_time"])))
    if isinstance(meta.get("start_time"), (int, float)) and isinstance(meta.get("end_time"), (int, float)):
        rows.append(("ended", f"{_utc(meta['end_time'])} (after {_dur(meta['end_time'] - meta['start_time'])})"))
    starts = meta.get("starts")
    if isinstance(starts, list) and len(starts) > 1:
        rows.append(("restarts", f"{len(starts) - 1} (started at {', '.join(_utc(s) for s in starts)})"))
    if data.last_step is not None:
        rows.append(("steps", f"{meta.get('steps_logged', data.n_global_steps())} logged, last step {data.last_step}"))
    problems = []
    if data.missing_steps:
        problems.append(f"{data.missing_steps} step(s) with missing ranks")
    if meta.get("backend_errors"):
        problems.append(f"{meta['backend_errors']} backend error(s)")
    if data.raw_values:
        problems.append(f"{data.raw_values} raw values streamed")
    if problems:
        rows.append(("notes", " · ".join(problems)))
    host = " · ".join(str(meta[k]) for k in ("host", "platform") if meta.get(k))
    if meta.get("python"):
        host += f" · Python {meta['python']}"
    if host:
        rows.append(("machine", host))
    for k in sorted(meta):
        if k not in KNOWN_META:
            rows.append((k, _inline(redact({k: meta[k]})[k])))
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    out = [f'<section id="run"><h2>Run</h2><table class="kv">{table}</table>']
    settings = meta.get("app_settings")
    if isinstance(settings, dict) and settings:
        cells = "".join(f'<div title="{esc(k)}={esc(_inline(v))}"><b>{esc(k)}</b> {esc(_inline(v))}</div>'
                        for k, v in sorted(redact(settings).items()))
        out.append(f"<h3>App settings</h3><div class=\"settings\">{cells}</div>")
    cfg = meta.get("config")
    if isinstance(cfg, dict) and cfg:
        rows_cfg = "".join(f"<tr><th>{esc(k)}</th><td>{esc(_inline(v))}</td></tr>" for k, v in redact(cfg).items())
        out.append(f'<h3>forge_obs config <span class="muted">init_backends</span></h3><table class="kv">{rows_cfg}</table>')
    out.append("</section>")
    return "".join(out)


def _flat_list(page: Page, keys: list[str]) -> str:
    data = page.data
    items = []
    for key in keys:
        if key in data.distributions:
            sm = data.summary(f"{key}/p50")
            val = f"p50 {fmt(sm.get('last', math.nan), key)}"
            pts = sm["points"]
        else:
            sm = data.summary(key)
            val = fmt(sm.get("last", math.nan), key)
            pts = sm["points"]
        note = f"step {sm.get('first_step')} only" if pts == 1 else f"constant over {pts} steps"
        items.append(f'<div id="k-{esc(slug(key))}" title="{esc(key)} = {esc(val)} ({esc(note)})">'
                     f'<code>{esc(key)}</code> = {esc(val)}{_badges(page, key)} <span class="muted">{esc(note)}</span></div>')
    return f'<div class="flat">{"".join(items)}</div>' if items else ""


def _groups(page: Page) -> str:
    out = ['<section id="metrics"><h2>Metrics by group</h2>']
    for group, charts, flats in page.data.groups():
        figs = "".join(_global_chart(page, k) for k in charts)
        grid = f'<div class="grid">{figs}</div>' if figs else ""
        flat = _flat_list(page, flats)
        count = f"{len(charts)} chart{'s' if len(charts) != 1 else ''}" + (
            f", {len(flats)} constant or single-point" if flats else "")
        if group == "obs":
            inner = (f'<details><summary><b>obs</b> <span class="muted">forge_obs\'s own metrics · {count}</span></summary>'
                     f"{grid}{flat}</details>")
        else:
            inner = f'<h3>{esc(group)} <span class="muted">{esc(count)}</span></h3>{grid}{flat}'
        out.append(f'<div class="group" id="g-{esc(slug(group))}" data-group="{esc(group)}">{inner}</div>')
    out.append("</section>")
    return "".join(out)


def _ranks(page: Page) -> str:
    data = page.data
    if not page.rank_keys:
        return ""
    out = ['<section id="ranks"><h2>Per rank <span class="muted">keys that two or more ranks recorded, '
           "ranks overlaid</span></h2>"]
    current = None
    figs: list[str] = []

    def close() -> None:
        if figs:
            out.append(f'<div class="grid">{"".join(figs)}</div>')
            figs.clear()

    for key in page.rank_keys:
        g = group_of(key)
        if g != current:
            close()
            current = g
            out.append(f"<h3>{esc(g)}</h3>")
        by = data.rank_series[key]
        labels = sorted(by)
        shown = labels[:MAX_RANK_LINES]
        lines = [{"src": "r", "key": key, "label": lb, "name": lb, "color": COLORS[i % len(COLORS)]}
                 for i, lb in enumerate(shown)]
        stat = f"{len(labels)} ranks" + (f", first {MAX_RANK_LINES} shown" if len(labels) > MAX_RANK_LINES else "")
        figs.append(figure("r-" + slug(key), key, key, stat, lines, CHART_H,
                           legend=[(ln["color"], ln["label"]) for ln in lines], badges=_badges(page, "rank:" + key)))
    close()
    out.append("</section>")
    return "".join(out)


def _samples(data: RunData) -> str:
    if not data.samples:
        return ""
    out = ['<section id="samples"><h2>Samples <span class="muted">latest step</span></h2>']
    for key in sorted(data.samples):
        step, rows = data.samples[key]
        cols: list[str] = []
        for r in rows:
            for c in r:
                if c not in cols:
                    cols.append(c)
        head = "".join(f"<th>{esc(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{esc(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows[:20])
        more = f'<p class="muted">{len(rows) - 20} more rows</p>' if len(rows) > 20 else ""
        out.append(f"<h3>{esc(key)} <span class='muted'>step {step}</span></h3><table class='samples'>"
                   f"<tr>{head}</tr>{body}</table>{more}")
    out.append("</section>")
    return "".join(out)


def _header(page: Page, run_id: str) -> str:
    data, meta = page.data, page.data.meta
    facts = []
    if meta.get("status"):
        facts.append(str(meta["status"]))
    if data.last_step is not None:
        facts.append(f"{data.n_global_steps()} steps")
    if isinstance(meta.get("start_time"), (int, float)) and isinstance(meta.get("end_time"), (int, float)):
        facts.append(_dur(meta["end_time"] - meta["start_time"]))
    n = len(page.findings)
    if page.findings_or_none is not None:
        facts.append(f'<a href="#findings">{n} finding{"s" if n != 1 else ""}</a>' if n else "no findings")
    nav = ['<a href="#overview">overview</a>']
    if page.has_paths:
        nav.append('<a href="#critical-path">critical path</a>')
    nav.append('<a href="#run">run</a>')
    nav += [f'<a href="#g-{esc(slug(g))}">{esc(g)}</a>' for g, _c, _f in data.groups()]
    if page.rank_keys:
        nav.append('<a href="#ranks">per rank</a>')
    if data.samples:
        nav.append('<a href="#samples">samples</a>')
    return (f"<header><h1>forge_obs · {esc(run_id)}</h1><span class=\"facts\">{' · '.join(facts)}</span>"
            "<span>x-axis <button data-axis=\"step\" aria-pressed=\"true\">step</button>"
            "<button data-axis=\"wall\" aria-pressed=\"false\">wall time</button></span>"
            '<label>smoothing <input type="range" id="smoothing" min="0" max="0.99" step="0.01" '
            f'value="{page.js["smoothing"]}"> <output id="smoothing-value">{page.js["smoothing"]:.2f}</output></label>'
            f'<nav>{"".join(nav)}</nav></header>')


def render_report(run_dir: "str | Path", smoothing: float = SMOOTHING) -> str:
    """The report page of ``run_dir`` as a string (see the module docstring)."""
    run_dir = Path(run_dir)
    data = RunData(run_dir)
    status, findings = doctor_findings(run_dir)
    page = Page(data, findings, smoothing)
    page.doctor_status, page.findings_or_none = status, findings
    run_id = data.meta.get("run_id") or run_dir.name
    paths = critical_paths(run_dir)
    page.has_paths = bool(paths)
    body = [_overview(page), _path_section(page, paths, run_dir), _run_section(page), _groups(page),
            _ranks(page), _samples(data)]
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        "<link rel='icon' href='data:,'>"
        f"<title>forge_obs report: {esc(run_id)}</title><style>{CSS}</style></head><body>"
        f"{_header(page, run_id)}<main>{''.join(body)}</main>"
        f"<footer>generated {esc(generated)} by forge-obs report from {esc(run_dir)}</footer>"
        f'<script type="application/json" id="run-data">{_json_for_script(page.js)}</script>'
        f"<script>{JS}</script></body></html>\n"
    )


def write_report(run_dir: "str | Path", output: "str | Path | None" = None) -> Path:
    """Write ``<run_dir>/report.html`` (or ``output``) and return its path."""
    run_dir = Path(run_dir)
    out = Path(output) if output else run_dir / "report.html"
    page = render_report(run_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
