// forge-obs serve: the page. Every value from a run reaches the DOM through textContent or an
// attribute set by name (never parsed as HTML), so a key or a SAMPLE row holding markup stays text.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
const S = { run: null, info: null, version: -1, charts: new Map(), byId: new Map(), timer: null, observer: null, groupObserver: null,
            x: "step", smooth: 0, drillStep: null, drillKeys: [] };
window.forgeObs = S;  // for tests and the curious: the page's state

function el(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null) continue;
    if (k === "text") e.textContent = String(v);
    else if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, String(v));
  }
  for (const c of kids.flat()) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

async function api(name, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (Array.isArray(v)) v.forEach((x) => q.append(k, x)); else if (v !== undefined && v !== null) q.append(k, v);
  }
  const r = await fetch("/api/" + name + "?" + q.toString());
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
  return String(Math.round(v * 1e4) / 1e4);
}

function dur(a, b) {
  if (typeof a !== "number" || typeof b !== "number") return "–";
  const s = Math.max(0, b - a);
  return s < 120 ? s.toFixed(0) + " s" : s < 7200 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h";
}

function setStatus(st) {
  const s = document.getElementById("status");
  s.className = "status " + (st ? st.state : "");
  s.textContent = st ? st.state + (st.why ? " — " + st.why : "") : "";
}

// ------------------------------------------------------------------ routing
function route() {
  stopRun();
  const h = decodeURIComponent(location.hash.slice(1) || "/");
  const parts = h.split("/").filter(Boolean);
  document.getElementById("drill").hidden = true;
  const shown = parts[0] === "run" && parts.length >= 2 ? runPage(parts.slice(1).join("/"))
    : parts[0] === "compare" && parts.length === 3 ? comparePage(parts[1], parts[2]) : runsPage();
  shown.catch((e) => document.getElementById("main").replaceChildren(el("p", { class: "muted", text: "could not load: " + e.message })));
}

function stopRun() {
  if (S.timer) { clearInterval(S.timer); clearTimeout(S.timer); }
  S.timer = null;
  for (const c of S.charts.values()) if (c.u) c.u.destroy();
  S.charts.clear();
  S.byId.clear();
  if (S.observer) S.observer.disconnect();
  if (S.groupObserver) S.groupObserver.disconnect();
  S.run = null; S.info = null; S.version = -1;
  setStatus(null);
}

// ------------------------------------------------------------------ runs list
async function runsPage() {
  const main = document.getElementById("main");
  document.getElementById("crumb").textContent = "runs";
  const data = await api("runs");
  const picked = new Set();
  const cmp = el("button", { text: "compare the two selected runs", disabled: "" });
  cmp.addEventListener("click", () => { const [a, b] = [...picked]; location.hash = "#/compare/" + encodeURIComponent(a) + "/" + encodeURIComponent(b); });
  const rows = data.runs.map((r) => {
    const box = el("input", { type: "checkbox" });
    box.addEventListener("change", () => { box.checked ? picked.add(r.id) : picked.delete(r.id); cmp.disabled = picked.size !== 2; });
    return el("tr", {}, el("td", {}, box), el("td", {}, el("a", { href: "#/run/" + encodeURIComponent(r.id), text: r.id, class: "runlink" })),
      el("td", {}, el("span", { class: "status " + r.status, text: r.status })), el("td", { class: "num", text: fmt(r.steps) }),
      el("td", { class: "num", text: dur(r.start_time, r.end_time || r.last_wall) }),
      el("td", { class: "num", text: (r.alerts || 0) + (r.findings !== undefined ? " / " + r.findings : "") }));
  });
  main.replaceChildren(el("h2", { text: "runs under " + data.root }),
    rows.length ? el("table", { id: "runs" }, el("tr", {}, ["", "run", "status", "steps", "duration", "alerts / findings"].map((t) => el("th", { text: t }))), rows)
      : el("p", { class: "muted", text: "no run directories here yet (a run directory holds metrics.jsonl, meta.json or events/)" }),
    el("p", {}, cmp));
  if (data.single && data.runs.length === 1) location.hash = "#/run/" + encodeURIComponent(data.runs[0].id);
}

// ------------------------------------------------------------------ compare
async function comparePage(a, b) {
  const main = document.getElementById("main");
  document.getElementById("crumb").textContent = "compare " + a + " and " + b;
  const d = await api("compare", { a, b });
  const filter = el("input", { class: "filter", placeholder: "filter keys" });
  const body = el("tbody");
  const show = () => {
    const f = filter.value;
    body.replaceChildren(...d.rows.filter((r) => r.key.includes(f)).slice(0, 2000).map((r) => el("tr", {},
      el("td", { text: r.key }),
      ...[r.a, r.b].flatMap((s) => [el("td", { class: "num", text: s ? fmt(s.last) : "–" }), el("td", { class: "num", text: s ? fmt(s.min) + " … " + fmt(s.max) : "–" })]))));
  };
  filter.addEventListener("input", show);
  show();
  main.replaceChildren(el("h2", { text: "keys side by side" }), filter,
    el("table", { id: "compare" }, el("thead", {}, el("tr", {}, ["key", a + ": last", a + ": min … max", b + ": last", b + ": min … max"].map((t) => el("th", { text: t })))), body));
}

// ------------------------------------------------------------------ one run
async function runPage(id) {
  S.run = id;
  document.getElementById("crumb").textContent = id;
  const main = document.getElementById("main");
  const listed = (await api("runs")).runs.some((r) => r.id === id);
  if (!listed) {  // not written yet (a run that is starting): look again in a second
    main.replaceChildren(el("p", { class: "muted", text: "waiting for run " + id + " to appear under the runs root…" }));
    S.timer = setTimeout(() => { if (S.run === id) runPage(id); }, 1000);
    return;
  }
  const info = await api("run", { id });
  S.info = info; S.version = info.version;
  setStatus(info.status);
  S.observer = new IntersectionObserver((ents) => {
    for (const e of ents) { const c = S.charts.get(e.target); if (c) { c.visible = e.isIntersecting; if (c.visible) loadChart(c); } }
  }, { rootMargin: "200px" });
  const findings = el("ul", { class: "alerts", id: "findings" });
  const samples = el("div", { id: "samples" });
  main.replaceChildren(
    el("div", { class: "muted", id: "runline", text: runLine(info) }),
    el("h2", { text: "overview" }), el("div", { class: "grid", id: "overview" }),
    el("h2", { text: "alerts and doctor findings" }), findings,
    el("h2", { text: "metric groups" }), el("div", { id: "groups" }),
    el("h2", { text: "per rank" }), el("div", { id: "ranks" }),
    el("h2", { text: "SAMPLE rows" }), samples);
  document.getElementById("xaxis").querySelector("option[value=policy]").disabled = !info.policy_axis;
  for (const p of info.panels) addChart(document.getElementById("overview"), { title: p.title, keys: p.keys, kind: "series" });
  renderGroups(info);
  renderRanks(info);
  renderSamples(info);
  refreshFindings();
  S.timer = setInterval(poll, 1000);
}

function runLine(info) {
  const m = info.meta || {};
  return "steps: " + info.steps + " (last " + fmt(info.last_step) + ") · ranks: " + info.ranks +
    " · started " + (m.start_time ? new Date(m.start_time * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "–") +
    " · " + info.run_dir + (info.malformed ? " · " + info.malformed + " malformed lines skipped" : "");
}

// A group's chart slots are made when the group comes near the viewport (a run with a thousand
// keys does not build a thousand slots before drawing its first chart).
function renderGroups(info) {
  const box = document.getElementById("groups");
  if (!S.groupObserver) S.groupObserver = new IntersectionObserver((ents) => {
    for (const e of ents) if (e.isIntersecting) fillGroup(e.target);
  }, { rootMargin: "400px" });
  for (const g of info.groups) {
    let det = box.querySelector(`details[data-group="${CSS.escape(g.group)}"]`);
    if (!det) {
      det = el("details", { class: "group", "data-group": g.group }, el("summary", { text: g.group }),
        el("div", { class: "grid" }), el("div", { class: "flat" }));
      if (g.group !== "obs") det.open = true;
      det.addEventListener("toggle", () => { S.groupObserver.unobserve(det); S.groupObserver.observe(det); });  // fill it if in view
      box.append(det);
      S.groupObserver.observe(det);
    }
    det.querySelector("summary").textContent = g.group + " (" + g.keys.length + ")";
    det.groupKeys = g.keys;
    if (det.filled) fillGroup(det);
    else det.querySelector(".grid").style.minHeight = Math.ceil(g.keys.filter((k) => !k.flat).length / 2) * 210 + "px";  // its place until filled
  }
}

function fillGroup(det) {
  if (!det.open || !det.groupKeys) return;
  det.filled = true;
  const grid = det.querySelector(".grid"), flat = det.querySelector(".flat");
  grid.style.minHeight = "";
  const flats = [];
  for (const k of det.groupKeys) {
    if (k.flat) { flats.push(k); continue; }
    const id = (k.dist ? "d:" : "c:") + k.key;
    if (!findChart(id)) addChart(grid, { id, title: k.key, keys: k.dist ? ["p50", "p90", "p99"].map((q) => k.key + "/" + q) : [k.key], kind: k.dist ? "dist" : "series" });
  }
  flat.replaceChildren(...flats.map((k) => el("span", {}, el("code", { text: k.key }), " = " + fmt(k.last) + "  ")));
}

function renderRanks(info) {
  const box = document.getElementById("ranks");
  if (!box.firstChild) box.append(el("div", { class: "grid" }));
  if (!info.rank_keys.length && !box.querySelector(".muted")) box.append(el("p", { class: "muted", text: "no key recorded by two or more ranks yet" }));
  for (const k of info.rank_keys) if (!findChart("r:" + k)) addChart(box.firstChild, { id: "r:" + k, title: k + " per rank", keys: [k], kind: "ranks" });
}

function renderSamples(info) {
  const box = document.getElementById("samples");
  if (!info.samples.length) { box.replaceChildren(el("p", { class: "muted", text: "no SAMPLE keys" })); return; }
  const sel = el("select", { id: "samplekey" }, info.samples.map((k) => el("option", { value: k, text: k })));
  const table = el("div");
  const show = async () => { const d = await api("samples", { id: S.run, k: sel.value }); table.replaceChildren(sampleTable(d.rows, "step " + d.step)); };
  sel.addEventListener("change", show);
  box.replaceChildren(sel, table);
  show();
}

function sampleTable(rows, caption) {
  const cols = [...new Set(rows.flatMap((r) => Object.keys(r)))].slice(0, 20);
  return el("table", { class: "sample" }, el("caption", { text: caption }), el("tr", {}, cols.map((c) => el("th", { text: c }))),
    rows.slice(0, 200).map((r) => el("tr", {}, cols.map((c) => el("td", { text: typeof r[c] === "string" ? r[c] : JSON.stringify(r[c]) ?? "" })))));
}

async function refreshFindings() {
  if (!S.run) return;
  S.findingsAt = Date.now();
  const d = await api("findings", { id: S.run });
  S.findings = d;
  const ul = document.getElementById("findings");
  if (!ul) return;
  const items = [];
  for (const a of d.alerts) items.push(el("li", { class: "alert" }, el("span", { class: "badge", text: "alert " + a.state + " " + a.rule }),
    " step " + fmt(a.step) + " " + (a.where || "") + ": " + (a.message || ""), stepLink(a.onset_step ?? a.step)));
  for (const f of d.findings) items.push(el("li", { class: "finding" }, el("span", { class: "badge", text: "doctor " + f.kind }),
    " " + (f.where || f.mesh || "") + ": " + f.message, stepLink(f.onset_step ?? (f.steps || [])[0])));
  if (!items.length) items.push(el("li", { class: "muted", text: d.computing ? "the doctor is reading the run…" : "none" + (d.state !== "ok" ? " (" + d.state + ")" : "") }));
  ul.replaceChildren(...items);
  if (d.computing) setTimeout(refreshFindings, 1000);
}

function stepLink(step) {
  if (typeof step !== "number") return null;
  return el("button", { class: "link", text: "→ step " + step, onclick: () => openDrill(step, []) });
}

// ------------------------------------------------------------------ charts
function findChart(id) { return S.byId.get(id) || null; }

function addChart(parent, spec) {
  const box = el("div", { class: "chart", "data-kind": spec.kind, "data-title": spec.title },
    el("div", { class: "title", text: spec.title }), el("div", { class: "sub" }), el("div", { class: "plot" }));
  parent.append(box);
  const c = Object.assign({ id: spec.id || "o:" + spec.title, box, visible: false, u: null, version: -1, loading: false }, spec);
  S.charts.set(box, c);
  S.byId.set(c.id, c);
  S.observer.observe(box);
  return c;
}

async function loadChart(c, force) {
  if (c.loading || (!force && c.version === S.version && c.axis === S.x && c.sm === S.smooth)) return;
  c.loading = true;
  try {
    const n = Math.max(100, Math.floor(c.box.clientWidth || 400));
    const d = c.kind === "ranks" ? await api("ranks", { id: S.run, k: c.keys[0], n, x: S.x })
                                 : await api("series", { id: S.run, k: c.keys, n, x: S.x });
    c.data = d; c.version = d.version; c.axis = S.x; c.sm = S.smooth;
    draw(c);
  } catch (e) {
    c.box.querySelector(".sub").textContent = "could not load: " + e.message;
  } finally { c.loading = false; }
}

function smooth(ys, a) {
  if (!a) return ys;
  let m = 0, w = 0;
  return ys.map((y) => { if (y === null || !Number.isFinite(y)) return y; m = a * m + (1 - a) * y; w = a * w + (1 - a); return m / w; });
}

function num(ys) { return ys.map((y) => (typeof y === "number" ? y : null)); }

function draw(c) {
  const d = c.data;
  const sub = c.box.querySelector(".sub");
  const title = c.box.querySelector(".title");
  title.replaceChildren(c.title, ...d.marks.slice(0, 5).map((m) => el("span", { class: "badge", title: m.text, text: "⚠ " + m.kind + " " + m.rule + " @" + m.step })));
  sub.textContent = d.x.length ? d.names.length + " series · " + d.x.length + " points drawn" + (d.left_out ? " · " + d.left_out + " ranks left out" : "") : "no data yet";
  const plot = c.box.querySelector(".plot");
  const width = Math.max(200, plot.clientWidth || c.box.clientWidth - 10);
  const ys = d.y.map((col) => smooth(num(col), S.smooth));
  const data = [d.x, ...ys];
  const many = d.names.length > 16;
  const series = [{ label: S.x }, ...d.names.map((nm, i) => ({
    label: c.kind === "dist" ? nm.split("/").pop() : nm, stroke: COLORS[i % COLORS.length], width: 1.25, spanGaps: true, points: { show: false } }))];
  const opts = { width, height: 170, series, legend: { show: !many, live: false }, cursor: { drag: { x: true, y: false } },
    scales: { x: { time: false } }, hooks: { draw: [(u) => drawMarks(u, d.marks)] } };
  if (c.kind === "dist" && d.names.length === 3) opts.bands = [{ series: [3, 2], fill: "rgba(31,119,180,0.10)" }, { series: [2, 1], fill: "rgba(31,119,180,0.18)" }];
  if (c.u && c.u.series.length === series.length && c.uw === width) { c.u.setData(data); return; }
  if (c.u) c.u.destroy();
  c.u = new uPlot(opts, data, plot);
  c.uw = width;
  c.u.over.addEventListener("click", (e) => {
    const r = c.u.over.getBoundingClientRect();
    const i = c.u.posToIdx(e.clientX - r.left);
    if (i === null || i === undefined || i < 0 || i >= c.data.steps.length) return;
    openDrill(c.data.steps[i], c.keys);
  });
}

function drawMarks(u, marks) {
  const ctx = u.ctx;
  ctx.save();
  ctx.strokeStyle = "#e8590c"; ctx.setLineDash([4, 3]); ctx.lineWidth = 1.5;
  for (const m of marks || []) {
    const x = Math.round(u.valToPos(m.x, "x", true));
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
  }
  ctx.restore();
}

// ------------------------------------------------------------------ live updates
async function poll() {
  if (!S.run || S.polling) return;
  S.polling = true;
  try {
    const p = await api("poll", { id: S.run });
    setStatus(p.status);
    if (p.reading) document.getElementById("status").textContent += " · reading the run: " + Math.round(100 * p.reading.bytes / Math.max(1, p.reading.of)) + " %";
    if (p.version !== S.version) {
      const info = await api("run", { id: S.run });
      const alertsChanged = info.version !== S.version && p.alerts !== S.alerts;
      S.info = info; S.version = info.version; S.alerts = p.alerts;
      document.getElementById("runline").textContent = runLine(info);
      renderGroups(info); renderRanks(info);
      for (const p2 of info.panels) if (!findChart("o:" + p2.title)) addChart(document.getElementById("overview"), { title: p2.title, keys: p2.keys, kind: "series" });
      if (info.samples.length && !document.getElementById("samplekey")) renderSamples(info);
      for (const c of S.charts.values()) if (c.visible) loadChart(c);
      if (alertsChanged || Date.now() - (S.findingsAt || 0) > 10000) refreshFindings();  // the doctor re-reads at most every 10 s
    }
  } catch (e) { /* the server is gone or restarting: the status says so */ setStatus({ state: "unreachable", why: String(e.message) }); }
  finally { S.polling = false; }
}

// ------------------------------------------------------------------ drill-down
async function openDrill(step, keys) {
  const box = document.getElementById("drill");
  S.drillStep = step; S.drillKeys = keys || [];
  box.hidden = false;
  box.replaceChildren(el("p", { class: "muted", text: "step " + step + "…" }));
  const d = await api("step", { id: S.run, step });
  const sec = (title, ...kids) => el("div", { class: "drill-sec" }, el("h2", { text: title }), ...kids);
  const close = el("button", { text: "close", onclick: () => { box.hidden = true; } });
  const parts = [el("div", {}, close), el("h2", { id: "drill-title", text: "step " + d.step }),
    el("div", { class: "muted", text: "wall time " + (d.wall_time ? new Date(d.wall_time * 1000).toISOString() : "–") + (d.policy_version !== null ? " · policy version " + fmt(d.policy_version) : "") + (d.missing.length ? " · missing: " + d.missing.join(", ") : "") })];
  const fs = [...d.alerts.map((a) => el("li", {}, el("span", { class: "badge", text: "alert " + a.state + " " + a.rule }), " " + (a.message || ""))),
              ...d.findings.map((f) => el("li", {}, el("span", { class: "badge", text: "doctor " + f.kind }), " " + f.message))];
  parts.push(sec("findings at this step", fs.length ? el("ul", { id: "drill-findings" }, fs) : el("p", { class: "muted", text: "none" })));
  const ranks = Object.keys(d.ranks).sort();
  const want = (S.drillKeys.length ? S.drillKeys : Object.keys(d.global).slice(0, 8)).map((k) => k);
  const rankKeys = want.map((k) => (ranks.some((r) => k in d.ranks[r]) ? k : k + "/p50")).filter((k) => ranks.some((r) => k in d.ranks[r]));
  parts.push(sec("values", el("table", { id: "drill-values" }, el("tr", {}, el("th", { text: "key" }), el("th", { text: "global" })),
    want.map((k) => el("tr", {}, el("td", { text: k }), el("td", { class: "num", text: fmt(d.global[k]) }))))));
  parts.push(sec("per rank", rankKeys.length && ranks.length ? el("table", { id: "drill-ranks" },
    el("tr", {}, el("th", { text: "rank" }), rankKeys.map((k) => el("th", { text: k }))),
    ranks.map((r) => el("tr", {}, el("td", { text: r }), rankKeys.map((k) => el("td", { class: "num", text: fmt(d.ranks[r][k]) })))))
    : el("p", { class: "muted", text: ranks.length ? ranks.length + " ranks; none recorded these keys" : "no per-rank rows at this step" })));
  const sk = Object.keys(d.samples);
  parts.push(sec("SAMPLE rows", sk.length ? sk.map((k) => sampleTable(d.samples[k], k)) : el("p", { class: "muted", text: "none at this step" })));
  const cp = d.critical_path;
  parts.push(sec("critical path and slack", cp.available ? criticalPath(cp.path) : el("p", { class: "muted", text: "not available: " + cp.why })));
  const tl = el("div", {}, el("code", { text: d.trace_command }));
  const open = el("button", { text: "open this step in the Perfetto UI", onclick: async () => {
    const r = await api("perfetto", { id: S.run, step: d.step });
    if (r.url && /^http:\/\/127\.0\.0\.1:\d+\/$/.test(r.url)) { tl.append(el("div", {}, el("a", { href: r.url, target: "_blank", rel: "noopener", text: r.url }))); window.open(r.url, "_blank", "noopener"); }
    else tl.append(el("div", { class: "muted", text: r.error || "no timeline" }));
  } });
  parts.push(sec("timeline", open, tl));
  box.replaceChildren(...parts);
}

// The step's critical path (forge_obs.analysis.critical_path's result: answer, stages, slack);
// any other shape is shown as its JSON.
function criticalPath(r) {
  if (!r || !Array.isArray(r.stages)) return el("pre", { text: JSON.stringify(r, null, 1) });
  const table = (cols, rows) => el("table", {}, el("tr", {}, cols.map((c) => el("th", { text: c[0] }))),
    rows.map((x) => el("tr", {}, cols.map((c) => el("td", { class: "num", text: c[1](x) })))));
  const where = (x) => (x.mesh ?? "?") + "/r" + (x.rank ?? "?");
  return el("div", { id: "drill-path" }, el("p", { text: r.answer || "" }),
    table([["on the path (s)", (a) => fmt(a.path_s)], ["share", (a) => Math.round(100 * (a.share || 0)) + " %"],
           ["where", where], ["span", (a) => a.name + (a.wait ? " (wait)" : "")]], r.stages.slice(0, 12)),
    Array.isArray(r.slack) && r.slack.length ? table([["where", where], ["busy (s)", (x) => fmt(x.busy_s)],
      ["waiting (s)", (x) => fmt(x.waiting_s)], ["idle (s)", (x) => fmt(x.idle_s)], ["on the path (s)", (x) => fmt(x.on_path_s)]], r.slack) : null);
}

// ------------------------------------------------------------------ controls
document.getElementById("xaxis").addEventListener("change", (e) => { S.x = e.target.value; for (const c of S.charts.values()) if (c.visible) loadChart(c, true); else c.version = -1; });
document.getElementById("smooth").addEventListener("input", (e) => {
  S.smooth = Number(e.target.value); document.getElementById("smoothv").textContent = S.smooth.toFixed(2);
  for (const c of S.charts.values()) if (c.data) draw(c);
});
window.addEventListener("hashchange", route);
route();
