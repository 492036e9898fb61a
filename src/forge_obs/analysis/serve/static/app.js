// forge-obs serve: the page. Every value from a run reaches the DOM through textContent or an
// attribute set by name (never parsed as HTML), so a key or a SAMPLE row holding markup stays text.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
  "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
const BADGES = 3;  // badges in a chart's title; the rest behind "+N more"
const S = { run: null, info: null, version: -1, generation: -1, charts: new Map(), byId: new Map(), timer: null,
            observer: null, groupObserver: null, x: "step", smooth: 0, zoom: null, match: null,
            drillStep: null, drillKeys: [], compare: null };
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

function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    if (Array.isArray(v)) v.forEach((x) => q.append(k, x)); else if (v !== undefined && v !== null) q.append(k, v);
  }
  return q.toString();
}

async function api(name, params) {
  const r = await fetch("/api/" + name + "?" + query(params));
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// ------------------------------------------------------------------ numbers as a person writes them
// 0.00067, 1.5e-7, 123,456,789, 0.5, 1.2346: at most 5 significant digits, no padding zeros.
function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number" || !Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e15 || a < 1e-4) return expo(v, 4);
  if (Number.isInteger(v) || a >= 1e5) return Math.round(v).toLocaleString("en-US");
  return String(Number(v.toPrecision(5)));
}

function expo(v, digits) {
  const [m, e] = v.toExponential(digits - 1).split("e");
  return String(Number(m)) + "e" + Number(e);
}

// An axis's labels, all with the decimals their spacing needs: 115k 120k 125k, 0.25 0.5 0.75, 2e-5 4e-5.
function ticks(splits, log) {
  const vals = splits.filter((v) => v !== null && Number.isFinite(v));
  const top = Math.max(0, ...vals.map(Math.abs));
  const incr = vals.length > 1 ? Math.min(...vals.slice(1).map((v, i) => Math.abs(v - vals[i])).filter((d) => d > 0)) : top;
  return splits.map((v) => {
    if (v === null || !Number.isFinite(v)) return "";
    if (log) return isPow10(v) ? (Math.abs(v) >= 1e-4 && Math.abs(v) < 1e5 ? String(v) : expo(v, 1)) : "";
    if (v === 0) return "0";
    if (top >= 1e4) {
      const [scale, unit] = top >= 1e12 ? [1e12, "T"] : top >= 1e9 ? [1e9, "G"] : top >= 1e6 ? [1e6, "M"] : [1e3, "k"];
      return String(Number((v / scale).toFixed(decimals(incr / scale)))) + unit;
    }
    if (top < 1e-3) return expo(v, Math.min(4, Math.max(1, decimals(incr / 10 ** Math.floor(Math.log10(top))) + 1)));
    return String(Number(v.toFixed(decimals(incr))));
  });
}

function decimals(incr) { return incr > 0 && Number.isFinite(incr) ? Math.min(12, Math.max(0, -Math.floor(Math.log10(incr) + 1e-9))) : 0; }
function isPow10(v) { const l = Math.log10(Math.abs(v)); return Math.abs(l - Math.round(l)) < 1e-9; }

// uPlot's axis size: the widest label plus the tick and the gap (the default 50 px cut "120,000" to "0,000").
function axisSize(u, values, i) {
  const ax = u.axes[i];
  if (!values || !values.length) return 40;
  u.ctx.font = ax.font[0];
  const w = Math.max(...values.map((t) => u.ctx.measureText(t || "").width)) / (window.devicePixelRatio || 1);
  return Math.ceil(w + ax.ticks.size + ax.gap + 6);
}

function dur(a, b) {
  if (typeof a !== "number" || typeof b !== "number") return "–";
  return secs(Math.max(0, b - a));
}

function secs(s) {
  return s < 120 ? fmt(Number(s.toPrecision(3))) + " s" : s < 7200 ? (s / 60).toFixed(1) + " min" : (s / 3600).toFixed(1) + " h";
}

function fileName(s) { return s.replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^[._]+|[._]+$/g, "").slice(0, 120) || "chart"; }

function setStatus(st, extra) {
  const s = document.getElementById("status");
  s.className = "status " + (st ? st.state : "");
  s.textContent = st ? st.state + (st.why ? " — " + st.why : "") + (extra || "") : "";
  s.hidden = !s.textContent;
}

// ------------------------------------------------------------------ routing
function route() {
  stopRun();
  const h = decodeURIComponent(location.hash.slice(1) || "/");
  const parts = h.split("/").filter(Boolean);
  document.getElementById("drill").hidden = true;
  const shown = parts[0] === "run" && parts.length >= 2 ? runPage(parts.slice(1).join("/"))
    : parts[0] === "compare" && parts.length >= 3 ? comparePage(parts.slice(1)) : runsPage();
  shown.catch(loadFailed);
}

function loadFailed(e) {
  document.getElementById("main").replaceChildren(el("p", { class: "muted", text: "could not load: " + e.message }));
}

function stopRun() {
  if (S.timer) { clearInterval(S.timer); clearTimeout(S.timer); }
  S.timer = null;
  for (const c of S.charts.values()) if (c.u) c.u.destroy();
  S.charts.clear();
  S.byId.clear();
  if (S.observer) S.observer.disconnect();
  if (S.groupObserver) S.groupObserver.disconnect();
  S.run = null; S.info = null; S.version = -1; S.generation = -1; S.indexed = undefined; S.compare = null; S.zoom = null; S.match = null;
  document.getElementById("resetzoom").hidden = true;
  setStatus(null);
}

// ------------------------------------------------------------------ runs list
async function runsPage() {
  const main = document.getElementById("main");
  document.getElementById("crumb").textContent = "runs";
  const data = await api("runs");
  const picked = new Set();
  const cmp = el("button", { text: "compare the selected runs", disabled: "" });
  cmp.addEventListener("click", () => { location.hash = "#/compare/" + [...picked].map(encodeURIComponent).join("/"); });
  const rows = data.runs.map((r) => {
    const box = el("input", { type: "checkbox" });
    box.addEventListener("change", () => { box.checked ? picked.add(r.id) : picked.delete(r.id); cmp.disabled = picked.size < 2 || picked.size > 8; });
    const tr = el("tr", { title: r.notes },
      el("td", {}, box),
      el("td", {}, el("a", { href: "#/run/" + encodeURIComponent(r.id), text: r.name || r.id, class: "runlink" }),
        r.name ? el("span", { class: "muted", text: " " + r.id }) : null),
      el("td", {}, (r.tags || []).map((t) => el("span", { class: "tag", text: t }))),
      el("td", {}, el("span", { class: "status " + r.status, text: r.status })), el("td", { class: "num", text: fmt(r.steps) }),
      el("td", { class: "num", text: dur(r.start_time, r.end_time || r.last_wall) }),
      el("td", { class: "num", text: (r.alerts || 0) + (r.findings !== undefined ? " / " + r.findings : "") }));
    tr.searchText = [r.id, r.name, r.notes, ...(r.tags || [])].filter(Boolean).join(" ").toLowerCase();
    return tr;
  });
  const filter = el("input", { id: "runfilter", class: "filter", placeholder: "filter runs: id, name, tag, notes" });
  filter.addEventListener("input", () => { const f = keyMatcher(filter.value); for (const tr of rows) tr.hidden = !!f && !f(tr.searchText); });
  main.replaceChildren(el("h2", { text: "runs under " + data.root }), filter,
    rows.length ? el("table", { id: "runs" }, el("tr", {}, ["", "run", "tags", "status", "steps", "duration", "alerts / findings"].map((t) => el("th", { text: t }))), rows)
      : el("p", { class: "muted", text: "no run directories here yet (a run directory holds metrics.jsonl, meta.json or events/)" }),
    el("p", {}, cmp));
  if (data.single && data.runs.length === 1) location.hash = "#/run/" + encodeURIComponent(data.runs[0].id);
}

// Text search over keys: words that must all appear (any case), or /a regular expression/flags.
function keyMatcher(q) {
  q = (q || "").trim();
  if (!q) return null;
  const m = /^\/(.+)\/([a-z]*)$/.exec(q);
  if (m) {
    try { const re = new RegExp(m[1], m[2].replace(/[^imsu]/g, "")); return (k) => re.test(k); } catch (e) { /* not a regex: words */ }
  }
  const words = q.toLowerCase().split(/\s+/);
  return (k) => { const lk = k.toLowerCase(); return words.every((w) => lk.includes(w)); };
}

// ------------------------------------------------------------------ compare
async function comparePage(ids) {
  const main = document.getElementById("main");
  document.getElementById("crumb").textContent = "compare " + ids.join(", ");
  S.compare = { ids, rows: [], versions: "" };
  makeObserver();
  const filter = el("input", { class: "filter", id: "cmpfilter", placeholder: "filter keys (text or /regex/)" });
  const body = el("tbody");
  const charts = el("div", { class: "grid", id: "cmpcharts" });
  const legend = el("div", { id: "cmplegend" });
  filter.addEventListener("input", () => showCompare(filter.value, body, charts));
  main.replaceChildren(el("h2", { text: "runs side by side" }), legend, filter,
    el("p", { class: "muted", text: "one chart per key, each run a line (the keys that match the filter; the first 24)" }), charts,
    el("table", { id: "compare" }, el("thead", {}, el("tr", {}, ["key", ...ids.flatMap((r) => [r + ": last", r + ": min … max"])].map((t) => el("th", { text: t })))), body));
  await refreshCompare(filter, body, charts, legend);
  S.timer = setInterval(() => refreshCompare(filter, body, charts, legend), 1000);
}

async function refreshCompare(filter, body, charts, legend) {
  const cmp = S.compare;
  if (!cmp || cmp.busy) return;
  cmp.busy = true;
  try {
    const d = await api("compare", { id: cmp.ids });
    const versions = d.runs.map((r) => r.version + ":" + (r.reading ? r.reading.bytes : "")).join();
    const reading = d.runs.filter((r) => r.reading).map((r) => r.id + " " + Math.round(100 * r.reading.bytes / Math.max(1, r.reading.of)) + " %");
    setStatus(reading.length ? { state: "reading", why: reading.join(", ") } : null);
    if (versions === cmp.versions) return;
    cmp.versions = versions; cmp.rows = d.rows; S.version = versions;
    legend.replaceChildren(...d.runs.map((r, i) => el("span", { class: "runkey" }, el("span", { class: "swatch", style: "background:" + COLORS[i % COLORS.length] }),
      r.name ? r.name + " (" + r.id + ")" : r.id, " · " + fmt(r.steps) + " steps")));
    showCompare(filter.value, body, charts);
  } catch (e) { setStatus({ state: "unreachable", why: String(e.message) }); }
  finally { cmp.busy = false; }
}

function showCompare(q, body, charts) {
  const f = keyMatcher(q), cmp = S.compare;
  const rows = cmp.rows.filter((r) => !f || f(r.key));
  body.replaceChildren(...rows.slice(0, 2000).map((r) => el("tr", {}, el("td", { text: r.key }),
    ...r.values.flatMap((s) => [el("td", { class: "num", text: s ? fmt(s.last) : "–" }), el("td", { class: "num", text: s ? fmt(s.min) + " … " + fmt(s.max) : "–" })]))));
  const want = new Set(rows.filter((r) => r.values.filter((s) => s && !s.flat).length >= 1).slice(0, 24).map((r) => r.key));
  for (const c of [...S.charts.values()]) if (!want.has(c.keys[0])) removeChart(c);
  for (const k of want) if (!findChart("v:" + k)) addChart(charts, { id: "v:" + k, title: k, keys: [k], kind: "overlay", runs: cmp.ids });
  for (const c of S.charts.values()) if (c.visible) loadChart(c);
}

// ------------------------------------------------------------------ one run
async function runPage(id) {
  S.run = id;
  document.getElementById("crumb").textContent = id;
  const main = document.getElementById("main");
  const listed = (await api("runs")).runs.some((r) => r.id === id);
  if (!listed) {  // not written yet (a run that is starting): look again in a second
    main.replaceChildren(el("p", { class: "muted", text: "waiting for run " + id + " to appear under the runs root…" }));
    S.timer = setTimeout(() => { if (S.run === id) runPage(id).catch(loadFailed); }, 1000);
    return;
  }
  const info = await api("run", { id });
  S.info = info; S.version = info.version; S.generation = info.generation;
  setStatus(info.status);
  makeObserver();
  const search = el("input", { id: "keysearch", class: "filter", placeholder: "search keys (words, or /regex/)" });
  search.addEventListener("input", () => { S.match = keyMatcher(search.value); applySearch(); });
  main.replaceChildren(
    el("div", { id: "runlabels" }), el("div", { class: "muted", id: "runline", text: runLine(info) }), search,
    el("h2", { text: "overview" }), el("div", { class: "grid", id: "overview" }),
    el("h2", { text: "alerts and doctor findings" }), el("ul", { class: "alerts", id: "findings" }),
    el("h2", { text: "slowest steps" }), el("ol", { id: "slowest" }),
    el("h2", { text: "metric groups" }), el("div", { id: "groups" }),
    el("h2", { text: "per rank" }), el("div", { id: "ranks" }),
    el("h2", { text: "SAMPLE rows" }), el("div", { id: "samples" }));
  document.getElementById("xaxis").querySelector("option[value=policy]").disabled = !info.policy_axis;
  renderRun(info);
  renderSamples(info);
  refreshFindings();
  S.timer = setInterval(poll, 1000);
}

function renderRun(info) {
  renderLabels(info.labels || {});
  document.getElementById("runline").textContent = runLine(info);
  for (const p of info.panels) if (!findChart("o:" + p.title)) addChart(document.getElementById("overview"), { title: p.title, keys: p.keys, kind: "series" });
  renderGroups(info);
  renderRanks(info);
  renderSlowest(info.slowest || []);
  applySearch();
}

function renderLabels(lb) {
  const box = document.getElementById("runlabels");
  box.replaceChildren(...[lb.name ? el("strong", { class: "name", text: lb.name }) : null,
    ...(lb.tags || []).map((t) => el("span", { class: "tag", text: t })),
    lb.notes ? el("div", { class: "notes", text: lb.notes }) : null].filter(Boolean));
}

function runLine(info) {
  const m = info.meta || {};
  return "steps: " + fmt(info.steps) + " (last " + (info.last_step ?? "–") + ") · ranks: " + info.ranks +
    " · started " + (m.start_time ? new Date(m.start_time * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "–") +
    " · " + info.run_dir + (info.malformed ? " · " + info.malformed + " malformed lines skipped" : "");
}

function renderSlowest(slowest) {
  const ol = document.getElementById("slowest");
  if (!slowest.length) { ol.replaceChildren(el("li", { class: "muted", text: "no step timed yet (two steps are needed)" })); return; }
  ol.replaceChildren(...slowest.map((s) => el("li", {},
    "step " + s.step + " took " + secs(s.duration_s) + (s.times_median ? " · " + fmt(Number(s.times_median.toPrecision(2))) + "× the median (" + secs(s.median_s) + ")" : ""),
    stepLink(s.step, []))));
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
    det.groupKeys = g.keys;
    if (det.filled) fillGroup(det);
    else det.querySelector(".grid").style.minHeight = Math.ceil(g.keys.filter((k) => !k.flat).length / 2) * 210 + "px";  // its place until filled
  }
}

function fillGroup(det) {
  if (!det.open || !det.groupKeys) return;
  det.filled = true;
  det.querySelector(".grid").style.minHeight = "";
  for (const k of det.groupKeys) {
    if (k.flat) continue;
    const id = (k.dist ? "d:" : "c:") + k.key;
    if (!findChart(id)) addChart(det.querySelector(".grid"), { id, title: k.key, keys: k.dist ? ["p50", "p90", "p99"].map((q) => k.key + "/" + q) : [k.key], kind: k.dist ? "dist" : "series" });
  }
  applySearch();
}

function renderRanks(info) {
  const box = document.getElementById("ranks");
  if (!box.firstChild) box.append(el("div", { class: "grid" }));
  if (!info.rank_keys.length && !box.querySelector(".muted")) box.append(el("p", { class: "muted", text: "no key recorded by two or more ranks yet" }));
  for (const k of info.rank_keys) if (!findChart("r:" + k)) addChart(box.firstChild, { id: "r:" + k, title: k + " per rank", keys: [k], kind: "ranks" });
}

// The key search: charts, groups and constant keys that do not match are hidden.
function applySearch() {
  const f = S.match;
  for (const c of S.charts.values()) {
    const hide = !!f && !c.keys.some(f) && !f(c.title);
    if (c.box.hidden !== hide) { c.box.hidden = hide; if (!hide && c.visible) loadChart(c); }
  }
  for (const det of document.querySelectorAll("details.group")) {
    const keys = det.groupKeys || [];
    const hit = keys.filter((k) => !f || f(k.key));
    det.hidden = !!f && !hit.length;
    det.querySelector("summary").textContent = det.dataset.group + " (" + (f ? hit.length + " of " : "") + keys.length + ")";
    if (det.filled) det.querySelector(".flat").replaceChildren(...hit.filter((k) => k.flat).map((k) => el("span", {}, el("code", { text: k.key }), " = " + fmt(k.last) + "  ")));
  }
}

function renderSamples(info) {
  const box = document.getElementById("samples");
  if (!info.samples.length) { box.replaceChildren(el("p", { class: "muted", text: "no SAMPLE keys" })); return; }
  const sel = el("select", { id: "samplekey" }, info.samples.map((k) => el("option", { value: k, text: k })));
  const table = el("div");
  const show = async () => {
    try { const d = await api("samples", { id: S.run, k: sel.value }); table.replaceChildren(sampleTable(d.rows, "step " + d.step)); }
    catch (e) { table.replaceChildren(el("p", { class: "muted", text: "could not load: " + e.message })); }
  };
  sel.addEventListener("change", show);
  box.replaceChildren(sel, table);
  return show();
}

function sampleTable(rows, caption) {
  const cols = [...new Set(rows.flatMap((r) => Object.keys(r)))].slice(0, 20);
  return el("table", { class: "sample" }, el("caption", { text: caption }), el("tr", {}, cols.map((c) => el("th", { text: c }))),
    rows.slice(0, 200).map((r) => el("tr", {}, cols.map((c) => el("td", { text: typeof r[c] === "string" ? r[c] : JSON.stringify(r[c]) ?? "" })))));
}

async function refreshFindings() {
  if (!S.run) return;
  S.findingsAt = Date.now();
  const ul = document.getElementById("findings");
  let d;
  try { d = await api("findings", { id: S.run }); }
  catch (e) { if (ul) ul.replaceChildren(el("li", { class: "muted", text: "could not load: " + e.message })); return; }  // the run is gone or being written again
  S.findings = d;
  if (!ul) return;
  const items = [];
  for (const a of d.alerts) items.push(el("li", { class: "alert " + a.state }, el("span", { class: "badge", text: "alert " + a.state + " " + a.rule }),
    " step " + (a.onset_step ?? a.step) + (a.state === "resolved" ? "–" + a.step : "") + " " + (a.where || "") + ": " + (a.message || ""),
    stepLink(a.onset_step ?? a.step, a.keys)));
  for (const f of d.findings) items.push(el("li", { class: "finding" }, el("span", { class: "badge", text: "doctor " + f.kind }),
    " " + (f.where || f.mesh || "") + ": " + f.message, stepLink(f.onset_step ?? (f.steps || [])[0], f.keys)));
  if (!items.length) items.push(el("li", { class: "muted", text: d.computing ? "the doctor is reading the run…" : "none" + (d.state !== "ok" ? " (" + d.state + ")" : "") }));
  ul.replaceChildren(...items);
  if (d.computing) setTimeout(refreshFindings, 1000);
}

function stepLink(step, keys) {
  if (typeof step !== "number") return null;
  return el("button", { class: "link", text: "→ step " + step, onclick: () => openDrill(step, keys || []) });
}

// ------------------------------------------------------------------ charts
function makeObserver() {
  S.observer = new IntersectionObserver((ents) => {
    for (const e of ents) { const c = S.charts.get(e.target); if (c) { c.visible = e.isIntersecting; if (c.visible) loadChart(c); } }
  }, { rootMargin: "200px" });
}

function findChart(id) { return S.byId.get(id) || null; }

function addChart(parent, spec) {
  const c = Object.assign({ id: spec.id || "o:" + spec.title, visible: false, u: null, version: -1, loading: false,
                            log: false, smoothLocal: null, ticks: null }, spec);
  const logBtn = el("button", { class: "log", title: "logarithmic y axis", text: "log" });
  const sm = el("input", { class: "smooth", placeholder: "smooth", title: "this chart's smoothing, 0–0.99 (empty: the header's)", size: 5 });
  logBtn.addEventListener("click", () => { c.log = !c.log; logBtn.classList.toggle("on", c.log); if (c.data) draw(c, true); });
  sm.addEventListener("input", () => {
    const v = parseFloat(sm.value);
    c.smoothLocal = sm.value.trim() === "" || !Number.isFinite(v) ? null : Math.min(0.999, Math.max(0, v));
    if (c.data) draw(c, true);
  });
  const tools = el("span", { class: "tools" }, logBtn, sm,
    el("button", { class: "csv", title: "every step's exact values, as CSV", text: "CSV", onclick: () => exportCsv(c) }),
    el("button", { class: "png", title: "this chart as a PNG image", text: "PNG", onclick: () => exportPng(c) }));
  c.box = el("div", { class: "chart", "data-kind": spec.kind, "data-title": spec.title },
    el("div", { class: "head" }, el("div", { class: "title", text: spec.title }), tools), el("div", { class: "sub" }), el("div", { class: "plot" }));
  parent.append(c.box);
  S.charts.set(c.box, c);
  S.byId.set(c.id, c);
  S.observer.observe(c.box);
  return c;
}

function removeChart(c) {
  if (c.u) c.u.destroy();
  S.observer.unobserve(c.box);
  c.box.remove();
  S.charts.delete(c.box);
  S.byId.delete(c.id);
}

function zoomKey() { return S.zoom ? S.zoom.lo + ":" + S.zoom.hi : ""; }

async function loadChart(c, force) {
  if (c.loading || c.box.hidden || (!force && c.version === S.version && c.axis === S.x && c.zoomed === zoomKey())) return;
  c.loading = true;
  try {
    const n = Math.max(100, Math.floor(c.box.clientWidth || 400));
    const range = S.zoom ? { lo: S.zoom.lo, hi: S.zoom.hi } : {};
    const zoomed = zoomKey(), version = S.version;
    const d = c.kind === "ranks" ? await api("ranks", { id: S.run, k: c.keys[0], n, x: S.x, ...range })
      : c.kind === "overlay" ? await api("overlay", { id: c.runs, k: c.keys[0], n, x: S.x, ...range })
      : await api("series", { id: S.run, k: c.keys, n, x: S.x, ...range });
    c.data = d; c.version = c.kind === "overlay" ? version : d.version; c.axis = S.x; c.zoomed = zoomed;
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

function drawTitle(c) {
  const marks = c.data.marks || [];
  const badge = (m) => el("span", { class: "badge " + m.state, title: m.text,
    text: (m.state === "resolved" ? "✓ " : "⚠ ") + m.kind + " " + m.rule + " @" + m.step });
  const more = marks.slice(BADGES);
  c.box.querySelector(".title").replaceChildren(c.title, ...marks.slice(0, BADGES).map(badge),
    ...(more.length ? [el("span", { class: "badge more", title: more.map((m) => m.kind + " " + m.rule + " @" + m.step + " (" + m.state + "): " + m.text).join("\n"),
      text: "+" + more.length + " more" })] : []));
}

// The series uPlot draws: per key its line, smoothed (with the raw line faint behind it, as in
// W&B); on a log scale the values <= 0 are left out (and counted).
function plotData(c) {
  const d = c.data, a = c.smoothLocal ?? S.smooth;
  const raw = a > 0 && c.kind !== "dist" && c.kind !== "ranks" && d.names.length <= 8;
  const labelOf = (nm) => (c.kind === "dist" ? nm.split("/").pop() : nm);
  let dropped = 0;
  const pos = (ys) => (c.log ? ys.map((y) => { if (y !== null && y <= 0) { dropped++; return null; } return y; }) : ys);
  const series = [{ label: S.x }], data = [d.x];
  d.names.forEach((nm, i) => {
    const color = COLORS[i % COLORS.length], ys = num(d.y[i]);
    if (raw) { series.push({ label: labelOf(nm) + " (raw)", stroke: color + "40", width: 1, spanGaps: true, points: { show: false } }); data.push(pos(ys)); }
    series.push({ label: labelOf(nm), stroke: color, width: 1.25, spanGaps: true, points: { show: false } });
    data.push(pos(smooth(ys, a)));
  });
  c.sm = a;
  return { series, data, dropped };
}

function draw(c, rebuild) {
  const d = c.data;
  drawTitle(c);
  const plot = c.box.querySelector(".plot");
  const width = Math.max(200, plot.clientWidth || c.box.clientWidth - 10);
  const { series, data, dropped } = plotData(c);
  const res = d.resolution;
  c.box.querySelector(".sub").textContent = !d.x.length ? "no data yet" : d.names.length + " series · " + d.x.length + " points drawn" +
    (res ? (res.exact ? " · every step" : " · " + res.width + " steps a point (min and max)") : "") +
    (d.left_out ? " · " + d.left_out + " ranks left out" : "") + (c.log ? " · log scale" + (dropped ? ": " + dropped + " points ≤ 0 not drawn" : "") : "");
  const shape = series.map((s) => s.label).join("\n") + "|" + c.log + "|" + width;
  if (c.u && !rebuild && c.shape === shape) { c.u.setData(data); applyZoom(c); return; }
  if (c.u) c.u.destroy();
  c.u = new uPlot(chartOptions(c, series, width), data, plot);
  c.shape = shape;
  applyZoom(c);
  wireChart(c);
}

function chartOptions(c, series, width) {
  const yvals = (u, splits) => { const t = ticks(splits, c.log); c.ticks = { y: t.filter(Boolean) }; return t; };
  const opts = { width, height: 170, series, legend: { show: series.length <= 17, live: false },
    cursor: { drag: { x: true, y: false, setScale: false } },
    scales: { x: { time: false }, y: c.log ? { distr: 3, log: 10 } : {} },
    axes: [{ values: (u, splits) => ticks(splits, false), size: axisSize }, { values: yvals, size: axisSize }],
    hooks: { draw: [(u) => drawMarks(u, c.data.marks)], setSelect: [(u) => zoomFrom(c, u)] } };
  if (c.kind === "dist" && series.length === 4) opts.bands = [{ series: [3, 2], fill: "rgba(31,119,180,0.10)" }, { series: [2, 1], fill: "rgba(31,119,180,0.18)" }];
  return opts;
}

function wireChart(c) {
  const over = c.u.over;
  over.addEventListener("mousedown", (e) => { c.downX = e.clientX; });
  over.addEventListener("dblclick", () => resetZoom());
  over.addEventListener("click", (e) => {
    if (c.kind === "overlay" || Math.abs(e.clientX - (c.downX ?? e.clientX)) > 3) return;  // a drag zooms; it does not drill down
    const r = over.getBoundingClientRect();
    const i = c.u.posToIdx(e.clientX - r.left);
    if (i === null || i === undefined || i < 0 || i >= c.data.steps.length) return;
    openDrill(c.data.steps[i], c.keys);
  });
}

function drawMarks(u, marks) {
  const ctx = u.ctx;
  ctx.save();
  ctx.setLineDash([4, 3]); ctx.lineWidth = 1.5;
  for (const m of marks || []) {
    const x = Math.round(u.valToPos(m.x, "x", true));
    if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
    ctx.strokeStyle = m.state === "resolved" ? "#e8590c55" : "#e8590c";
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
  }
  ctx.restore();
}

// ------------------------------------------------------------------ zoom: one range for every chart
// A drag on any chart zooms all of them to its x range; the server sends the range again at the
// chart's full resolution (every step when it holds fewer than the chart's width). Reset: the
// header's button or a double click.
function zoomFrom(c, u) {
  const sel = u.select;
  if (!sel || sel.width < 3) return;
  const x0 = u.posToVal(sel.left, "x"), x1 = u.posToVal(sel.left + sel.width, "x");
  u.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
  let lo, hi;
  if (S.x === "step" || c.kind === "overlay") { lo = Math.ceil(x0); hi = Math.floor(x1); }
  else {
    const steps = c.data.steps.filter((s, i) => c.data.x[i] >= x0 && c.data.x[i] <= x1);
    if (!steps.length) return;
    lo = Math.min(...steps); hi = Math.max(...steps);
  }
  if (hi < lo) return;
  S.zoom = { x0, x1, lo, hi };
  rezoom();
}

function resetZoom() {
  if (!S.zoom) return;
  S.zoom = null;
  rezoom();
}

function rezoom() {
  document.getElementById("resetzoom").hidden = !S.zoom;
  for (const c of S.charts.values()) { if (c.visible) loadChart(c, true); else c.version = -1; }
}

function applyZoom(c) {
  if (S.zoom) c.u.setScale("x", { min: S.zoom.x0, max: S.zoom.x1 });
}

// ------------------------------------------------------------------ export
function exportCsv(c) {
  const range = S.zoom ? { lo: S.zoom.lo, hi: S.zoom.hi } : {};
  let href;
  if (c.kind === "overlay") {  // one file per run
    for (const r of c.runs) download("/api/csv?" + query({ id: r, k: c.keys, name: c.title, ...range }), "");
    return;
  }
  href = "/api/csv?" + query(c.kind === "ranks" ? { id: S.run, rank: c.keys[0], name: c.title, ...range }
                                                 : { id: S.run, k: c.keys, name: c.title, ...range });
  download(href, "");
}

function exportPng(c) {
  if (!c.u) return;
  const src = c.u.ctx.canvas, pr = window.devicePixelRatio || 1, head = Math.round(24 * pr);
  const labels = c.u.series.slice(1).filter((s) => s.show !== false);
  const legend = Math.round(18 * pr) * Math.ceil(labels.length / 3);
  const out = el("canvas", { width: src.width, height: src.height + head + legend });
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, out.width, out.height);
  ctx.fillStyle = "#222"; ctx.font = `600 ${13 * pr}px system-ui, sans-serif`;
  ctx.fillText((S.run ? S.run + ": " : "") + c.title, 6 * pr, 16 * pr);
  ctx.drawImage(src, 0, head);
  ctx.font = `${12 * pr}px system-ui, sans-serif`;
  labels.forEach((s, i) => {
    const x = (6 + (i % 3) * 200) * pr, y = src.height + head + (Math.floor(i / 3) * 18 + 13) * pr;
    ctx.fillStyle = typeof s._stroke === "string" ? s._stroke : "#1f77b4"; ctx.fillRect(x, y - 9 * pr, 10 * pr, 10 * pr);
    ctx.fillStyle = "#222"; ctx.fillText(String(s.label), x + 14 * pr, y);
  });
  out.toBlob((blob) => {
    const url = URL.createObjectURL(blob);
    download(url, fileName((S.run || (c.runs || []).join("-")) + "-" + c.title) + ".png");
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }, "image/png");
}

function download(href, name) {
  const a = el("a", { href, download: name, hidden: "" });
  document.body.append(a);
  a.click();
  a.remove();
}

// ------------------------------------------------------------------ live updates
async function poll() {
  if (!S.run || S.polling) return;
  S.polling = true;
  try {
    const p = await api("poll", { id: S.run });
    setStatus(p.status, (p.reading ? " · reading the run: " + Math.round(100 * p.reading.bytes / Math.max(1, p.reading.of)) + " %" : "")
      + (p.index && !p.index.fresh ? " · indexing the timeline (" + p.index.steps + " steps so far)" : ""));
    if (p.generation !== S.generation) { const id = S.run; stopRun(); runPage(id).catch(loadFailed); return; }  // the run was written again: start afresh
    const indexed = p.index ? p.index.gen : null;  // the run's index moved on: its steps, the doctor's findings
    if (p.version !== S.version || indexed !== S.indexed) {
      const info = await api("run", { id: S.run });
      const alertsChanged = info.version !== S.version && p.alerts !== S.alerts;
      S.info = info; S.version = info.version; S.alerts = p.alerts; S.indexed = indexed;
      renderRun(info);
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
  let d;
  try { d = await api("step", { id: S.run, step }); }
  catch (e) { box.replaceChildren(el("p", { class: "muted", text: "could not load step " + step + ": " + e.message })); return; }
  const sec = (title, ...kids) => el("div", { class: "drill-sec" }, el("h2", { text: title }), ...kids);
  const close = el("button", { text: "close", onclick: () => { box.hidden = true; } });
  const parts = [el("div", {}, close), el("h2", { id: "drill-title", text: "step " + d.step }),
    el("div", { class: "muted", text: "wall time " + (d.wall_time ? new Date(d.wall_time * 1000).toISOString() : "–") + (d.policy_version !== null ? " · policy version " + fmt(d.policy_version) : "") + (d.missing.length ? " · missing: " + d.missing.join(", ") : "") })];
  const fs = [...d.alerts.map((a) => el("li", {}, el("span", { class: "badge", text: "alert " + a.state + " " + a.rule }), " " + (a.message || ""))),
              ...d.findings.map((f) => el("li", {}, el("span", { class: "badge", text: "doctor " + f.kind }), " " + f.message))];
  parts.push(sec("findings at this step", fs.length ? el("ul", { id: "drill-findings" }, fs) : el("p", { class: "muted", text: "none" })));
  parts.push(sec("values", drillValues(d)), sec("per rank", drillRanks(d)));
  const sk = Object.keys(d.samples);
  parts.push(sec("SAMPLE rows", sk.length ? sk.map((k) => sampleTable(d.samples[k], k)) : el("p", { class: "muted", text: "none at this step" })));
  const cp = d.critical_path;
  parts.push(sec("critical path and slack", cp.available ? criticalPath(cp.path) : el("p", { class: "muted", text: "not available: " + cp.why })));
  parts.push(sec("spans: wall and CPU time", stepSpans(d.spans)));
  parts.push(sec("timeline", ...timeline(d)));
  box.replaceChildren(...parts);
}

// The step's global values: the keys it was opened for (a chart's, a finding's) first, marked,
// then every other key (a filter narrows them).
function drillValues(d) {
  const first = S.drillKeys.filter((k) => k in d.global);
  const rest = Object.keys(d.global).filter((k) => !first.includes(k)).sort();
  const table = el("table", { id: "drill-values", class: "fit" });
  const filter = el("input", { class: "filter", placeholder: "filter keys" });
  const show = () => {
    const f = keyMatcher(filter.value);
    const keys = [...first, ...rest.filter((k) => !f || f(k)).slice(0, 200)];
    table.replaceChildren(el("tr", {}, el("th", { text: "key" }), el("th", { text: "global" })),
      ...keys.map((k) => el("tr", { class: first.includes(k) ? "picked" : "" }, el("td", { text: k }), el("td", { class: "num", text: fmt(d.global[k]) }))));
  };
  filter.addEventListener("input", show);
  show();
  return el("div", {}, rest.length > 8 ? filter : null, el("div", { class: "tablewrap" }, table));
}

// One row per rank; a column per key: the keys the drill-down was opened for, then the others
// the ranks recorded at this step (at most 8). The table fits the side panel.
function drillRanks(d) {
  // a process whose row holds only forge_obs's own telemetry (obs/...) and none of the keys the
  // drill-down was opened for is not listed (the console does the same)
  const wanted = new Set(S.drillKeys.flatMap((k) => [k, k + "/p50"]));
  const ranks = Object.keys(d.ranks).filter((r) => Object.keys(d.ranks[r]).some((k) => !k.startsWith("obs/") || wanted.has(k))).sort();
  if (!ranks.length) return el("p", { class: "muted", text: "no per-rank rows at this step" });
  const recorded = new Set(ranks.flatMap((r) => Object.keys(d.ranks[r])));
  const picked = S.drillKeys.map((k) => (recorded.has(k) ? k : k + "/p50")).filter((k) => recorded.has(k));
  const keys = [...picked, ...[...recorded].filter((k) => !picked.includes(k)).sort()].slice(0, Math.max(8, picked.length));
  const kp = commonPrefix(keys), rp = commonPrefix(ranks);  // said once, in the corner
  const under = [rp ? "ranks " + rp + "…" : "", kp ? "keys " + kp + "…" : ""].filter(Boolean).join(", ");
  return el("div", { class: "tablewrap" }, under ? el("div", { class: "muted", text: under }) : null, el("table", { id: "drill-ranks", class: "fit" },
    el("tr", {}, el("th", { text: "rank" }),
      keys.map((k) => el("th", { text: k.slice(kp.length), title: k }))),
    ranks.map((r) => el("tr", {}, el("td", { text: r.slice(rp.length), title: r }), keys.map((k) => el("td", { class: "num", text: fmt(d.ranks[r][k]) }))))));
}

// The part up to a "/" that every name of ``names`` (two or more) starts with ("" when none).
function commonPrefix(names) {
  if (names.length < 2) return "";
  let p = names[0].slice(0, names[0].lastIndexOf("/") + 1);
  while (p && !names.every((n) => n.startsWith(p) && n.length > p.length)) p = p.slice(0, p.slice(0, -1).lastIndexOf("/") + 1);
  return p;
}

function timeline(d) {
  const tl = el("div", {}, el("code", { text: d.trace_command }));
  const open = el("button", { text: "open this step in the Perfetto UI", onclick: async () => {
    let r;
    try { r = await api("perfetto", { id: S.run, step: d.step }); } catch (e) { r = { error: e.message }; }
    if (r.url && /^http:\/\/127\.0\.0\.1:\d+\/$/.test(r.url)) { tl.append(el("div", {}, el("a", { href: r.url, target: "_blank", rel: "noopener", text: r.url }))); window.open(r.url, "_blank", "noopener"); }
    else tl.append(el("div", { class: "muted", text: r.error || "no timeline" }));
  } });
  return [open, tl];
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

// The step's longest spans, by start: wall time beside CPU time (the span's thread's). CPU near
// the wall time: the span computed; far below it: it waited (I/O, a lock, another process) or
// its thread was preempted (a busy host).
function stepSpans(sp) {
  if (!sp || !sp.available) return el("p", { class: "muted", text: "not available: " + ((sp && sp.why) || "no timeline") });
  if (!sp.spans.length) return el("p", { class: "muted", text: "no span at this step" });
  const share = (x) => (x.cpu_ms === null || !(x.wall_ms > 0) ? "–" : Math.round(100 * x.cpu_ms / x.wall_ms) + " %");
  const rows = sp.spans.map((x) => el("tr", { class: x.finished ? "" : "open" },
    el("td", { text: x.mesh + "/r" + x.rank, title: x.task || "" }), el("td", { text: x.name + (x.finished ? "" : " (open)") }),
    el("td", { class: "num", text: fmt(Number(x.start_ms.toFixed(3))) }), el("td", { class: "num", text: fmt(Number(x.wall_ms.toFixed(3))) }),
    el("td", { class: "num", text: x.cpu_ms === null ? "–" : fmt(Number(x.cpu_ms.toFixed(3))) }), el("td", { class: "num", text: share(x) })));
  return el("div", {}, el("p", { class: "muted", text: "CPU near the wall time: computing; far below it: waiting or preempted"
      + (sp.left_out ? " · the " + sp.spans.length + " longest of " + (sp.spans.length + sp.left_out) : "") }),
    el("div", { class: "tablewrap" }, el("table", { id: "drill-spans", class: "fit" },
      el("tr", {}, ["where", "span", "start (ms)", "wall (ms)", "CPU (ms)", "CPU / wall"].map((h) => el("th", { text: h }))), rows)));
}

// ------------------------------------------------------------------ controls
document.getElementById("xaxis").addEventListener("change", (e) => { S.x = e.target.value; S.zoom = null; rezoom(); });
document.getElementById("smooth").addEventListener("input", (e) => {
  S.smooth = Number(e.target.value); document.getElementById("smoothv").textContent = S.smooth.toFixed(2);
  for (const c of S.charts.values()) if (c.data && c.smoothLocal === null) draw(c);
});
document.getElementById("resetzoom").addEventListener("click", resetZoom);
window.addEventListener("hashchange", route);
route();
