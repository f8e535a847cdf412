// fusionllm dashboard: renders a run view (embedded, or kept live from the broker's server-sent
// events) as plain SVG and tables. No libraries, no network access beyond the broker.
"use strict";

const MAX_POINTS = 20000;   // as the broker's view (fusion-monitor's MAX_POINTS)
const MAX_EVENTS = 2000;
const DRAWN = 1500;         // points drawn per curve at most
const SVG = "http://www.w3.org/2000/svg";

let view = null;

// ---- folding patches, as the broker does ----

function pushBounded(list, item, max) {
  list.push(item);
  if (list.length > max) {
    const half = Math.floor(list.length / 2);
    const kept = list.filter((_, i) => i + 1 > half || (i + 1) % 2 === 0);
    list.length = 0;
    list.push(...kept);
  }
}

function pushNewest(list, item, max) {
  list.push(item);
  if (list.length > max) list.shift();
}

function applyPatch(v, p) {
  if (p.seq <= v.seq) return;
  if (p.truncate_after !== null && p.truncate_after !== undefined) {
    v.steps = v.steps.filter(s => s.step <= p.truncate_after);
    v.evals = v.evals.filter(e => e.step <= p.truncate_after);
  }
  for (const [k, value] of Object.entries(p.set)) v[k] = value;
  for (const [k, items] of Object.entries(p.push)) {
    for (const item of items) {
      if (k === "steps" || k === "evals") pushBounded(v[k], item, MAX_POINTS);
      else pushNewest(v[k], item, MAX_EVENTS);
    }
  }
  v.seq = p.seq;
}

// ---- small helpers ----

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(x, digits) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "-";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return x.toFixed(digits === undefined ? (a >= 100 ? 0 : a >= 10 ? 1 : 3) : digits);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function clock(t) {
  const s = Math.max(0, Math.floor(t));
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60, r = s % 60;
  return (h ? h + ":" + String(m).padStart(2, "0") : m) + ":" + String(r).padStart(2, "0");
}

function tick(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(1);
  return String(Number(v.toPrecision(4)));
}

function ticks(lo, hi, n) {
  const span = hi - lo || 1;
  const step = Math.pow(10, Math.floor(Math.log10(span / n)));
  const nice = [1, 2, 5, 10].map(m => m * step).find(s => span / s <= n) || step * 10;
  const out = [];
  for (let v = Math.ceil(lo / nice) * nice; v <= hi + 1e-12; v += nice) out.push(v);
  return out;
}

function thin(points) {
  const stride = Math.max(1, Math.ceil(points.length / DRAWN));
  return stride === 1 ? points : points.filter((_, i) => i % stride === 0 || i === points.length - 1);
}

// ---- charts ----

// series: [{name, points: [[x, y]], color, dots}]; markers: [{x, kind, text}]
function lineChart(id, series, opts) {
  const box = document.getElementById(id);
  const W = 560, H = 230, L = 56, R = 12, T = 10, B = 34;
  const all = series.flatMap(s => s.points).filter(p => Number.isFinite(p[0]) && Number.isFinite(p[1]));
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  box.setAttribute("data-points", String(series[0] ? series[0].points.length : 0));
  if (all.length === 0) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "waiting for data"));
    box.replaceChildren(svg);
    return;
  }
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  for (const v of ticks(y0, y1, 5)) {
    svg.appendChild(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }));
    svg.appendChild(svgEl("text", { x: L - 6, y: sy(v) + 4, "text-anchor": "end" }, tick(v)));
  }
  for (const v of ticks(x0, x1, 6)) {
    svg.appendChild(svgEl("line", { class: "axis", x1: sx(v), x2: sx(v), y1: H - B, y2: H - B + 4 }));
    svg.appendChild(svgEl("text", { x: sx(v), y: H - B + 16, "text-anchor": "middle" },
      opts.time ? clock(v) : fmt(v, 0)));
  }
  svg.appendChild(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  svg.appendChild(svgEl("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  svg.appendChild(svgEl("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, opts.xLabel));
  for (const m of opts.markers || []) {
    if (m.x < x0 || m.x > x1) continue;
    const line = svgEl("line", { class: "marker " + m.kind, x1: sx(m.x), x2: sx(m.x), y1: T, y2: H - B });
    line.appendChild(svgEl("title", {}, m.text));
    svg.appendChild(line);
  }
  series.forEach((s, i) => {
    const pts = thin(s.points.filter(p => Number.isFinite(p[0]) && Number.isFinite(p[1])));
    if (s.dots) {
      for (const p of pts.slice(-400)) {
        svg.appendChild(svgEl("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: s.color }));
      }
    } else if (pts.length) {
      const d = pts.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join("");
      svg.appendChild(svgEl("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.6 }));
    }
    svg.appendChild(svgEl("text", { x: W - R - 4, y: T + 12 + 14 * i, "text-anchor": "end", fill: s.color }, s.name));
  });
  box.replaceChildren(svg);
}

function markers(v, byTime) {
  const shown = ["lost", "recovered", "island-out", "reshaped", "placed", "resumed"];
  return v.events.filter(e => shown.includes(e.kind))
    .map(e => ({ x: byTime ? e.t : e.step, kind: e.kind, text: e.text }));
}

function drawCharts(v) {
  const train = v.steps.map(s => [s.step, s.loss]);
  const evals = v.evals.map(e => [e.step, e.loss]);
  lineChart("loss-step", [
    { name: "train", points: train, color: "#2f6fd6" },
    { name: "eval", points: evals, color: "#d6572f", dots: true },
  ], { xLabel: "step", markers: markers(v, false) });
  lineChart("loss-time", [
    { name: "train", points: v.steps.map(s => [s.t, s.loss]), color: "#2f6fd6" },
    { name: "eval", points: v.evals.map(e => [e.t, e.loss]), color: "#d6572f", dots: true },
  ], { xLabel: "wall-clock time", time: true, markers: markers(v, true) });
  lineChart("throughput-step", [
    { name: v.info.unit || "items/s", points: v.steps.map(s => [s.step, s.throughput]), color: "#2e9d5b" },
  ], { xLabel: "step", markers: markers(v, false) });
  lineChart("lr-step", [
    { name: "learning rate", points: v.steps.map(s => [s.step, s.lr]), color: "#1d2330" },
  ], { xLabel: "step" });
  lineChart("norm-step", [
    { name: "|g|", points: v.steps.map(s => [s.step, s.grad_norm]), color: "#d6572f" },
  ], { xLabel: "step", markers: markers(v, false) });
  drawNodeBars(v);
}

function drawNodeBars(v) {
  const box = document.getElementById("node-bars");
  const nodes = Object.values(v.nodes).filter(n => n.stage !== null);
  const W = 560, rowH = 22, L = 90, R = 90;
  const H = Math.max(40, 20 + rowH * nodes.length);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}` });
  const most = Math.max(1e-9, ...nodes.map(n => n.compute_s + n.wait_s));
  nodes.forEach((n, i) => {
    const y = 10 + i * rowH;
    const cw = n.compute_s / most * (W - L - R), ww = n.wait_s / most * (W - L - R);
    svg.appendChild(svgEl("text", { x: L - 6, y: y + 13, "text-anchor": "end" }, n.node));
    svg.appendChild(svgEl("rect", { x: L, y, width: cw, height: 16, fill: "#2f6fd6" }));
    svg.appendChild(svgEl("rect", { x: L + cw, y, width: ww, height: 16, fill: "#d6572f" }));
    svg.appendChild(svgEl("text", { x: W - R + 4, y: y + 13 },
      `${fmt(n.compute_s, 2)} + ${fmt(n.wait_s, 2)} s`));
  });
  if (!nodes.length) svg.appendChild(svgEl("text", { x: W / 2, y: 24, "text-anchor": "middle" }, "no placement yet"));
  box.replaceChildren(svg);
}

// ---- placement picture ----

function drawPlacement(v) {
  const box = document.getElementById("placement");
  const nodes = Object.values(v.nodes);
  const sites = [...new Set(nodes.map(n => n.site || "(no site)"))].sort();
  const nodeW = 240, nodeH = 58, gap = 14, siteW = nodeW + 2 * gap, colGap = 60;
  const rows = Math.max(1, ...sites.map(s => nodes.filter(n => (n.site || "(no site)") === s).length));
  const W = Math.max(600, sites.length * (siteW + colGap)), H = 40 + rows * (nodeH + gap) + gap;
  // Drawn at its natural size (scrolling when wider than the page), not stretched.
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H });
  const at = {};
  sites.forEach((site, c) => {
    const x = c * (siteW + colGap) + 10;
    svg.appendChild(svgEl("rect", { class: "site", x, y: 8, width: siteW, height: H - 16, rx: 8 }));
    svg.appendChild(svgEl("text", { x: x + gap, y: 26, "font-weight": 600 }, "site " + site));
    const here = nodes.filter(n => (n.site || "(no site)") === site)
      .sort((a, b) => (a.replica ?? 1e9) - (b.replica ?? 1e9) || (a.stage ?? 1e9) - (b.stage ?? 1e9) || a.node.localeCompare(b.node));
    here.forEach((n, r) => {
      const y = 36 + r * (nodeH + gap);
      at[n.node] = [x + gap + nodeW / 2, y + nodeH / 2];
      const g = svgEl("g", { class: "node " + n.status, "data-node": n.node, "data-status": n.status });
      g.appendChild(svgEl("rect", { x: x + gap, y, width: nodeW, height: nodeH, rx: 6 }));
      g.appendChild(svgEl("text", { x: x + gap + 8, y: y + 16, "font-weight": 600 }, n.node + "  (" + n.status + ")"));
      const role = n.stage === null ? "not placed" : `stage ${n.stage} · replica ${n.replica}`;
      g.appendChild(svgEl("text", { x: x + gap + 8, y: y + 32 }, role));
      g.appendChild(svgEl("text", { x: x + gap + 8, y: y + 48 }, `${n.backend} on ${n.device}`));
      g.appendChild(svgEl("title", {}, `${n.node}: ${n.operators} operators, ${n.params} parameters, ${fmt(n.gflops, 0)} GFLOP/s`));
      svg.appendChild(g);
    });
  });
  const most = Math.max(1, ...v.links.map(l => l.bytes_last_step));
  for (const l of v.links) {
    const a = at[l.from], b = at[l.to];
    if (!a || !b || l.bytes_total === 0) continue;
    const bend = a[0] === b[0] ? 60 : 0;
    const path = svgEl("path", {
      class: "link", d: `M${a[0]} ${a[1]} Q${(a[0] + b[0]) / 2 + bend} ${(a[1] + b[1]) / 2} ${b[0]} ${b[1]}`,
      "stroke-width": 1 + 5 * l.bytes_last_step / most,
    });
    path.appendChild(svgEl("title", {}, `${l.from} → ${l.to}: ${bytes(l.bytes_last_step)} last step`));
    svg.insertBefore(path, svg.firstChild.nextSibling);
  }
  box.replaceChildren(svg);
}

// ---- tables and lists ----

function table(id, head, rows) {
  const t = document.getElementById(id);
  const tr = el("tr");
  for (const [h, num] of head) tr.appendChild(el("th", num ? { class: "num" } : {}, h));
  const body = [tr];
  for (const r of rows) {
    const row = el("tr");
    r.forEach((cell, i) => row.appendChild(el("td", head[i][1] ? { class: "num" } : {}, cell)));
    body.push(row);
  }
  t.replaceChildren(...body);
}

function drawTables(v) {
  const perStep = v.source === "report" ? "mean bytes/step" : "bytes last step";
  table("links", [["from", 0], ["to", 0], ["Mbit/s", 1], ["latency ms", 1], [perStep, 1], ["bytes in all", 1], ["utilisation", 1], ["codecs", 0]],
    v.links.map(l => [l.from, l.to, fmt(l.bandwidth_mbps, 1), fmt(l.latency_ms, 2), bytes(l.bytes_last_step), bytes(l.bytes_total),
      l.utilisation === null ? "-" : (100 * l.utilisation).toFixed(1) + "%",
      Object.entries(l.codecs).map(([d, c]) => d + ": " + c).join(", ") || "-"]));
  const idle = (v.probed || []).filter(p => !v.links.some(l => l.from === p.from && l.to === p.to));
  if (idle.length) {
    const slowest = idle.reduce((a, b) => (b.bandwidth_mbps < a.bandwidth_mbps ? b : a));
    document.getElementById("links").appendChild(el("caption", { class: "muted" },
      `${idle.length} more probed links carry no data (slowest: ${slowest.from} → ${slowest.to}, ` +
      `${fmt(slowest.bandwidth_mbps, 1)} Mbit/s, ${fmt(slowest.latency_ms, 2)} ms)`));
  }
  table("nodes", [["node", 0], ["site", 0], ["status", 0], ["stage", 1], ["replica", 1], ["backend", 0],
    ["compute s", 1], ["wait s", 1], ["peak memory", 1], ["heartbeat age s", 1]],
    Object.values(v.nodes).map(n => [n.node, n.site, n.status, n.stage ?? "-", n.replica ?? "-",
      n.backend, fmt(n.compute_s, 3), fmt(n.wait_s, 3),
      n.peak_memory_bytes ? bytes(n.peak_memory_bytes) : "-", fmt(n.heartbeat_age_s, 2)]));
  if (!v.codec_history.length) {
    document.getElementById("codecs").replaceChildren(el("caption", {}, "no codec set on any link yet (dense)"));
  } else table("codecs", [["time", 0], ["step", 1], ["from", 0], ["to", 0], ["direction", 0], ["codec", 0], ["density", 1]],
    v.codec_history.slice(-200).reverse().map(c => [clock(c.t), c.step, c.from, c.to, c.direction, c.codec,
      (100 * c.density).toFixed(2) + "%"]));
  const plan = v.plan.length ? v.plan : ["(no plan yet)"];
  document.getElementById("plan").replaceChildren(...plan.map(line =>
    el("div", { class: line.startsWith("bottleneck") ? "line bottleneck" : "line" }, line)));
  const list = document.getElementById("events");
  list.replaceChildren(...v.events.slice(-300).reverse().map(e => {
    const li = el("li", { "data-kind": e.kind });
    li.appendChild(el("span", { class: "muted" }, clock(e.t) + "  step " + e.step + "  "));
    li.appendChild(el("span", { class: "kind " + e.kind }, e.kind));
    li.appendChild(document.createTextNode(e.text));
    return li;
  }));
}

function drawSummary(v) {
  const last = v.steps[v.steps.length - 1], eval_ = v.evals[v.evals.length - 1];
  const status = document.getElementById("status");
  status.textContent = v.status;
  status.className = "pill " + v.status;
  document.getElementById("step").textContent = v.step;
  document.getElementById("steps-total").textContent = v.info.steps;
  document.getElementById("throughput").textContent = last ? fmt(last.throughput, 0) + " " + v.info.unit : "-";
  document.getElementById("loss").textContent = last ? fmt(last.loss, 4) : "-";
  document.getElementById("eval-loss").textContent = eval_ ? fmt(eval_.loss, 4) : "-";
  document.getElementById("elapsed").textContent = last ? clock(last.t) : "-";
  document.getElementById("snapshot").textContent = v.snapshot_step;
}

// ---- drawing, at most every 250 ms ----

let drawPending = false, lastDraw = 0;

function draw() {
  if (drawPending || !view) return;
  drawPending = true;
  const wait = Math.max(0, 250 - (Date.now() - lastDraw));
  setTimeout(() => requestAnimationFrame(() => {
    drawPending = false;
    lastDraw = Date.now();
    drawSummary(view); drawCharts(view); drawPlacement(view); drawTables(view);
    document.body.setAttribute("data-seq", String(view.seq));
  }), wait);
}

function connect() {
  const token = new URLSearchParams(location.search).get("token");
  const url = "api/events" + (token ? "?token=" + encodeURIComponent(token) : "");
  const conn = document.getElementById("connection");
  const es = new EventSource(url);
  es.addEventListener("snapshot", e => { view = JSON.parse(e.data); conn.textContent = "live"; draw(); });
  es.addEventListener("patch", e => {
    if (!view) return;
    applyPatch(view, JSON.parse(e.data));
    if (view.status === "finished" || view.status === "failed") { es.close(); conn.textContent = "run over"; }
    draw();
  });
  es.onerror = () => {
    conn.textContent = es.readyState === EventSource.CLOSED
      ? "disconnected (the run is over, or the token is wrong): reload to retry"
      : "disconnected; retrying";
  };
}

const embedded = JSON.parse(document.getElementById("run-data").textContent);
if (embedded) { view = embedded; document.getElementById("connection").textContent = "from a report"; draw(); }
else connect();
