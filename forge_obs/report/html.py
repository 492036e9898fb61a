"""One self-contained HTML page for a run directory: inline SVG charts, no network needed.

    >>> import json, tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"step": s, "mode": "global_reduce", "wall_time": 100.0 + s, "metrics": {"trainer/loss": 1.0 / (s + 1)}}
    ...         for s in range(3)]
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> page = render_report(d)
    >>> page.count('<figure class="chart"')
    1

Sections: run metadata (``meta.json``), the doctor's findings (``forge_obs.timeline.doctor``, when
available), one chart per global metric grouped by prefix (trainer, generator, buffer, …), per-rank
charts (one line per rank) where ``per_rank_reduce`` rows exist, and the latest SAMPLE rows. Every
chart has a step and a wall-time version; the buttons at the top switch all of them (``report.html#wall``
opens on wall time). Every key and
value from the run is HTML-escaped. The only script is the axis switch and an error counter
(``#js-errors``, set by ``window.onerror``).
"""

from __future__ import annotations

import html
import json
import math
import time
from pathlib import Path
from typing import Any

W, H = 460, 200
PAD_L, PAD_R, PAD_T, PAD_B = 58, 12, 10, 30
MAX_POINTS = 1500
MAX_RANK_LINES = 16
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")
GROUP_ORDER = ("trainer", "generator", "buffer", "reference", "reward", "controller")


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flatten(key: str, v: Any, out: dict[str, Any]) -> None:
    if isinstance(v, bool):
        out[key] = float(v)
    elif _is_num(v):
        out[key] = float(v)
    elif isinstance(v, dict):
        for k, x in v.items():
            _flatten(f"{key}/{k}", x, out)


# ----------------------------------------------------------------------------- data
class RunData:
    """What the report shows, read from the run directory."""

    def __init__(self, run_dir: Path) -> None:
        from forge_obs.store import read_jsonl

        self.run_dir = run_dir
        self.meta: dict[str, Any] = {}
        if (run_dir / "meta.json").exists():
            try:
                self.meta = json.loads((run_dir / "meta.json").read_text())
            except (OSError, json.JSONDecodeError):
                self.meta = {"error": "meta.json is not valid JSON"}
        # key -> [(step, wall, value)]
        self.series: dict[str, list[tuple[int, float | None, float]]] = {}
        # key -> label -> [(step, wall, value)]
        self.rank_series: dict[str, dict[str, list[tuple[int, float | None, float]]]] = {}
        self.samples: dict[str, tuple[int, list[dict]]] = {}
        self.missing_steps = 0
        self.raw_values = 0
        self.t0: float | None = None
        path = run_dir / "metrics.jsonl"
        if not path.exists():
            return
        for row in read_jsonl(path):
            mode = row.get("mode", "global_reduce")
            step = row.get("step")
            if not isinstance(step, int):
                continue
            wall = row.get("wall_time") if _is_num(row.get("wall_time")) else None
            if wall is not None and (self.t0 is None or wall < self.t0):
                self.t0 = wall
            if mode == "global_reduce":
                if row.get("missing"):
                    self.missing_steps += 1
                for key, v in (row.get("metrics") or {}).items():
                    if isinstance(v, list):
                        if v and all(isinstance(r, dict) for r in v):
                            self.samples[key] = (step, v)
                        continue
                    flat: dict[str, float] = {}
                    _flatten(key, v, flat)
                    for k, x in flat.items():
                        self.series.setdefault(k, []).append((step, wall, x))
            elif mode == "per_rank_reduce":
                label = str((row.get("source") or {}).get("label") or "?")
                for key, v in (row.get("metrics") or {}).items():
                    flat = {}
                    _flatten(key, v, flat)
                    for k, x in flat.items():
                        self.rank_series.setdefault(k, {}).setdefault(label, []).append((step, wall, x))
            elif mode == "per_rank_no_reduce":
                self.raw_values += len(row.get("values") or ())

    def groups(self) -> list[tuple[str, list[str]]]:
        by: dict[str, list[str]] = {}
        for key in self.series:
            g = key.split("/", 1)[0] if "/" in key else "(top level)"
            by.setdefault(g, []).append(key)

        def order(g: str) -> tuple:
            return (g == "obs", GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g)

        return [(g, sorted(by[g])) for g in sorted(by, key=order)]


# ----------------------------------------------------------------------------- charts
def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi == lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.ceil(lo / step) * step
    out = []
    v = start
    while v <= hi + step * 1e-9 and len(out) < 20:
        out.append(round(v, 12))
        v += step
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _fmt_dt(s: float) -> str:
    if abs(s) < 120:
        return f"{s:.0f}s" if abs(s) >= 10 or s == 0 else f"{s:.1f}s"
    if abs(s) < 7200:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def svg_chart(lines: list[tuple[str, str, list[tuple[float, float]]]], xlabel: str, wall: bool) -> str:
    """``lines``: (name, color, [(x, y)]) -> an inline SVG line chart (escaped)."""
    pts = [(x, y) for _n, _c, ps in lines for x, y in ps if math.isfinite(x) and math.isfinite(y)]
    cls = "ax-wall" if wall else "ax-step"
    if not pts:
        return f'<svg class="{cls}" width="{W}" height="{H}" role="img"><text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="muted">no finite values</text></svg>'
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def sx(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return PAD_T + ph - (y - y0) / (y1 - y0) * ph

    parts = [f'<svg class="{cls}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    parts.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" class="plot"/>')
    for t in _nice_ticks(y0, y1):
        y = sy(t)
        parts.append(f'<line x1="{PAD_L}" x2="{PAD_L + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{PAD_L - 4}" y="{y + 4:.1f}" text-anchor="end">{esc(_fmt(t))}</text>')
    for t in _nice_ticks(x0, x1, 5):
        x = sx(t)
        label = _fmt_dt(t) if wall else _fmt(t)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{PAD_T + ph}" class="grid"/>')
        parts.append(f'<text x="{x:.1f}" y="{PAD_T + ph + 14}" text-anchor="middle">{esc(label)}</text>')
    parts.append(f'<text x="{PAD_L + pw}" y="{H - 2}" text-anchor="end" class="muted">{esc(xlabel)}</text>')
    for name, color, ps in lines:
        seg: list[str] = []
        segs: list[list[str]] = []
        for x, y in _thin(ps):
            if math.isfinite(x) and math.isfinite(y):
                seg.append(f"{sx(x):.1f},{sy(y):.1f}")
            elif seg:
                segs.append(seg)
                seg = []
        if seg:
            segs.append(seg)
        for s in segs:
            if len(s) == 1:
                cx, cy = s[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"><title>{esc(name)}</title></circle>')
            else:
                parts.append(f'<polyline points="{" ".join(s)}" fill="none" stroke="{color}" stroke-width="1.6">'
                             f'<title>{esc(name)}</title></polyline>')
    parts.append("</svg>")
    return "".join(parts)


def _xy(series: list[tuple[int, float | None, float]], t0: float | None, wall: bool) -> list[tuple[float, float]]:
    if wall:
        return [(w - (t0 or 0.0), v) for _s, w, v in series if w is not None]
    return [(float(s), v) for s, _w, v in series]


def chart_figure(title: str, lines: list[tuple[str, str, list[tuple[int, float | None, float]]]], t0: float | None,
                 caption: str = "", legend: bool = False) -> str:
    step_svg = svg_chart([(n, c, _xy(s, t0, False)) for n, c, s in lines], "step", wall=False)
    wall_svg = svg_chart([(n, c, _xy(s, t0, True)) for n, c, s in lines], "wall time since start", wall=True)
    leg = ""
    if legend:
        leg = '<div class="legend">' + "".join(
            f'<span><i style="background:{c}"></i>{esc(n)}</span>' for n, c, _s in lines) + "</div>"
    cap = f'<figcaption><b>{esc(title)}</b> <span class="muted">{esc(caption)}</span></figcaption>'
    return f'<figure class="chart" data-key="{esc(title)}">{cap}{step_svg}{wall_svg}{leg}</figure>'


def _summary(series: list[tuple[int, float | None, float]]) -> str:
    vals = [v for _s, _w, v in series]
    finite = [v for v in vals if math.isfinite(v)]
    bad = len(vals) - len(finite)
    if not finite:
        return f"{len(vals)} points, none finite"
    s = f"last {_fmt(vals[-1]) if math.isfinite(vals[-1]) else vals[-1]} · min {_fmt(min(finite))} · max {_fmt(max(finite))} · {len(vals)} points"
    return s + (f" · {bad} non-finite" if bad else "")


# ----------------------------------------------------------------------------- sections
def _meta_section(data: RunData) -> str:
    meta = data.meta
    if not meta:
        return '<section id="meta"><h2>Run</h2><p class="muted">no meta.json</p></section>'
    rows = []
    for k in sorted(meta):
        v = meta[k]
        if k in ("start_time", "end_time") and _is_num(v):
            v = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v))
        elif k == "starts" and isinstance(v, list):
            v = ", ".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x)) if _is_num(x) else str(x) for x in v)
        if isinstance(v, (dict, list)):
            cell = f"<pre>{esc(json.dumps(v, indent=1, default=str))}</pre>"
        else:
            cell = esc(v)
        rows.append(f"<tr><th>{esc(k)}</th><td>{cell}</td></tr>")
    extra = f"<p class='muted'>{data.missing_steps} step(s) with missing ranks · {data.raw_values} raw values streamed</p>"
    return f'<section id="meta"><h2>Run</h2><table class="meta">{"".join(rows)}</table>{extra}</section>'


def doctor_findings(run_dir: Path) -> tuple[str, list[dict[str, Any]] | None]:
    """(status, findings): findings is None when the doctor is not available."""
    try:
        from forge_obs.timeline import doctor  # optional: built separately
    except ImportError:
        return "timeline not available (forge_obs.timeline.doctor is not installed)", None
    fn = getattr(doctor, "diagnose", None) or getattr(doctor, "run_doctor", None)
    if fn is None:
        return "timeline not available (the doctor has no diagnose())", None
    try:
        found = fn(run_dir)
    except Exception as e:  # noqa: BLE001 - the report still renders
        return f"the doctor failed: {e!r}", None
    out = []
    for f in found or []:
        d = f.to_dict() if hasattr(f, "to_dict") else (dict(f) if isinstance(f, dict) else {"message": str(f)})
        out.append(d)
    status = "" if (run_dir / "events").is_dir() else "timeline not available (no events/ in the run directory); metric checks only"
    return status, out


def _doctor_section(run_dir: Path) -> str:
    status, findings = doctor_findings(run_dir)
    body = f'<p class="muted">{esc(status)}</p>' if status else ""
    if findings is not None:
        if not findings:
            body += '<p class="ok">doctor: no findings</p>'
        else:
            items = []
            for f in findings:
                where = "/".join(str(x) for x in (f.get("mesh"), f.get("actor"),
                                                  None if f.get("rank") is None else f"r{f.get('rank')}") if x)
                steps = f.get("steps") or []
                st = f" steps {steps[0]}..{steps[-1]}" if len(steps) > 1 and steps[0] != steps[-1] else (
                    f" step {steps[0]}" if steps else "")
                items.append(f'<li><span class="kind">{esc(f.get("kind", "?"))}</span> <b>{esc(where or "-")}</b>'
                             f'{esc(st)}: {esc(f.get("message", ""))}</li>')
            body += f'<ul class="findings">{"".join(items)}</ul>'
    return f'<section id="doctor"><h2>Doctor</h2>{body}</section>'


def _samples_section(data: RunData) -> str:
    if not data.samples:
        return ""
    out = ['<section id="samples"><h2>Samples (latest step)</h2>']
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


CSS = """
body{font:13px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 16px;z-index:1}
header h1{font-size:16px;margin:0 12px 0 0;display:inline}
main{padding:8px 16px}
section{margin:12px 0}
h2{font-size:15px;border-bottom:1px solid #ddd;padding-bottom:2px}
h3{font-size:13px;margin:10px 0 4px}
.charts{display:flex;flex-wrap:wrap;gap:10px}
figure.chart{margin:0;background:#fff;border:1px solid #e3e3e3;border-radius:4px;padding:6px}
figcaption{font-size:12px;max-width:460px;overflow-wrap:anywhere}
svg text{font-size:10px;fill:#555}
svg .plot{fill:#fff;stroke:#ccc}
svg .grid{stroke:#eee}
.muted{color:#888}
.ok{color:#2a7}
body.axis-step .ax-wall,body.axis-wall .ax-step{display:none}
button{margin-left:4px}
button.on{font-weight:bold}
table.meta th{text-align:left;vertical-align:top;padding-right:12px}
table.meta pre{margin:0;max-height:240px;overflow:auto}
table.samples{border-collapse:collapse}
table.samples td,table.samples th{border:1px solid #ddd;padding:2px 6px;max-width:420px;overflow-wrap:anywhere}
.legend span{margin-right:10px;font-size:11px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:3px;margin-right:3px;vertical-align:middle}
.kind{background:#fde8e8;color:#a22;padding:0 4px;border-radius:3px}
"""

JS = """
var errs=0;window.onerror=function(){errs++;var e=document.getElementById('js-errors');if(e){e.textContent=String(errs);}};
function setAxis(a){document.body.className='axis-'+a;
 var bs=document.querySelectorAll('button[data-axis]');
 for(var i=0;i<bs.length;i++){bs[i].className=bs[i].getAttribute('data-axis')===a?'on':'';}}
document.addEventListener('DOMContentLoaded',function(){
 var bs=document.querySelectorAll('button[data-axis]');
 for(var i=0;i<bs.length;i++){bs[i].addEventListener('click',function(){setAxis(this.getAttribute('data-axis'));});}
 setAxis(location.hash==='#wall'?'wall':'step');
 document.getElementById('js-charts').textContent=String(document.querySelectorAll('figure.chart').length);
 document.getElementById('js-ready').textContent='yes';
});
"""


def render_report(run_dir: "str | Path") -> str:
    run_dir = Path(run_dir)
    data = RunData(run_dir)
    run_id = data.meta.get("run_id") or run_dir.name
    body: list[str] = [_meta_section(data), _doctor_section(run_dir)]
    n_charts = 0
    if data.series:
        body.append('<section id="metrics"><h2>Metrics</h2>')
        for group, keys in data.groups():
            title = "obs (forge_obs self-metrics)" if group == "obs" else group
            figs = [chart_figure(k, [(k, COLORS[0], data.series[k])], data.t0, _summary(data.series[k])) for k in keys]
            n_charts += len(figs)
            inner = f'<h3>{esc(title)} <span class="muted">{len(keys)}</span></h3><div class="charts">{"".join(figs)}</div>'
            if group == "obs":
                inner = f"<details><summary>{esc(title)} ({len(keys)})</summary><div class='charts'>{''.join(figs)}</div></details>"
            body.append(f'<div class="group" data-group="{esc(group)}">{inner}</div>')
        body.append("</section>")
    else:
        body.append('<section id="metrics"><h2>Metrics</h2><p class="muted">no global metrics in metrics.jsonl</p></section>')
    if data.rank_series:
        body.append('<section id="ranks"><h2>Per rank</h2><div class="charts">')
        for key in sorted(data.rank_series, key=lambda k: (k.startswith("obs/"), k)):
            by_label = data.rank_series[key]
            labels = sorted(by_label)
            shown = labels[:MAX_RANK_LINES]
            lines = [(lbl, COLORS[i % len(COLORS)], by_label[lbl]) for i, lbl in enumerate(shown)]
            cap = f"{len(labels)} ranks" + (f", first {MAX_RANK_LINES} shown" if len(labels) > MAX_RANK_LINES else "")
            body.append(chart_figure(key, lines, data.t0, cap, legend=True))
            n_charts += 1
        body.append("</div></section>")
    body.append(_samples_section(data))
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        "<link rel='icon' href='data:,'>"
        f"<title>forge_obs report: {esc(run_id)}</title><style>{CSS}</style><script>{JS}</script></head>"
        f"<body class='axis-step' data-charts='{n_charts}'><header><h1>forge_obs · {esc(run_id)}</h1>"
        "x-axis: <button data-axis='step' class='on'>step</button><button data-axis='wall'>wall time</button>"
        f" <span class='muted'>{n_charts} charts · generated {esc(generated)} · "
        "charts <span id='js-charts'>?</span> · script errors <span id='js-errors'>0</span> · "
        "ready <span id='js-ready'>no</span></span></header>"
        f"<main>{''.join(body)}</main></body></html>\n"
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
