// maitre's dashboard: DOM and SVG helpers, formats, colours and the charts (no library).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
// ---------------------------------------------------------------------------------------------
// DOM helpers

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function s(tag, attrs, ...kids) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) el.setAttribute(k, v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function fmtS(x) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  if (Math.abs(x) < 1) return `${Math.round(x * 1000)} ms`;
  if (Math.abs(x) < 120) return `${x.toFixed(x < 10 ? 2 : 1)} s`;
  if (Math.abs(x) < 7200) return `${(x / 60).toFixed(1)} min`;
  if (Math.abs(x) < 172800) return `${(x / 3600).toFixed(1)} h`;
  return `${(x / 86400).toFixed(1)} d`;
}
const fmtPct = (x) => (x === null || !isFinite(x) ? "–" : `${(100 * x).toFixed(0)}%`);
const fmtMoney = (x) => (x === null || !isFinite(x) ? "–" : x < 100 ? x.toFixed(2) : x.toFixed(0));
const natural = (a, b) => a.localeCompare(b, undefined, { numeric: true });

function colour(job) {
  let hash = 0;
  for (let i = 0; i < job.length; i++) hash = (hash * 31 + job.charCodeAt(i)) >>> 0;
  return `hsl(${(hash * 137.508) % 360}, 62%, ${46 + (hash % 3) * 8}%)`;
}

// ---------------------------------------------------------------------------------------------
// Charts

function chart({ width = 640, height = 180, x0, x1, series = [], markers = [], yLabel = "",
                 yMax = null, title = "", stacked = false, xLabel = null }) {
  const m = { l: 48, r: 12, t: title ? 20 : 8, b: 22 };
  const W = width - m.l - m.r, H = height - m.t - m.b;
  let ymax = yMax ?? 0;
  if (yMax === null) {
    for (const ser of series) for (const [, y] of ser.points) if (isFinite(y)) ymax = Math.max(ymax, y);
  }
  if (!(ymax > 0)) ymax = 1;
  if (!(x1 > x0)) x1 = x0 + 1;
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * W;
  const Y = (y) => m.t + H - (y / ymax) * H;
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, width, height,
                         role: "img", "aria-label": title || yLabel });
  if (title) svg.append(s("text", { x: m.l, y: 13, class: "chart-title" }, title));
  for (let k = 0; k <= 4; k++) {
    const y = (ymax * k) / 4;
    svg.append(s("line", { x1: m.l, x2: m.l + W, y1: Y(y), y2: Y(y), class: "grid" }));
    svg.append(s("text", { x: m.l - 4, y: Y(y) + 3, class: "tick", "text-anchor": "end" },
                 ymax >= 100 ? y.toFixed(0) : ymax >= 10 ? y.toFixed(1) : y.toFixed(2)));
  }
  for (let k = 0; k <= 4; k++) {
    const x = x0 + ((x1 - x0) * k) / 4;
    svg.append(s("text", { x: X(x), y: height - 6, class: "tick", "text-anchor": "middle" },
                 xLabel ? xLabel(x) : fmtS(x - x0)));
  }
  if (yLabel) svg.append(s("text", { x: 4, y: m.t + 8, class: "tick" }, yLabel));
  const vertices = (ser, pts) => { // a series' corners, a step function's included
    const out = [];
    for (const [x, y] of pts) {
      if (ser.step && out.length) out.push([x, out[out.length - 1][1]]);
      out.push([x, y]);
    }
    if (ser.step && out.length) out.push([x1, out[out.length - 1][1]]);
    return out;
  };
  const path = (vs) => vs.map(([x, y], k) => `${k ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join("");
  for (const ser of series) {
    if (!ser.points.length) continue;
    const upper = vertices(ser, ser.points);
    if (ser.fill) {
      const lower = ser.lower ? vertices(ser, ser.lower).reverse() :
        [[upper[upper.length - 1][0], 0], [upper[0][0], 0]];
      svg.append(s("path", { d: path(upper) + path(lower).replace(/^M/, "L") + "Z", fill: ser.colour,
                             "fill-opacity": 0.35, stroke: "none" }));
    }
    svg.append(s("path", { d: path(upper), fill: "none", stroke: ser.colour, "stroke-width": ser.width || 1.6,
                           "stroke-dasharray": ser.dash || null, class: "series" }));
  }
  const labelled = markers.length <= 8;
  if (markers.length > 100) { // one path per colour: thousands of lines, no titles
    const byColour = {};
    for (const mk of markers) {
      const x = X(mk.x).toFixed(1);
      byColour[mk.colour || "#c60"] = (byColour[mk.colour || "#c60"] || "") + `M${x},${m.t}V${m.t + H}`;
    }
    for (const [col, d] of Object.entries(byColour)) {
      svg.append(s("path", { d, stroke: col, "stroke-opacity": 0.3, "stroke-width": 0.7, class: "marker" }));
    }
    markers = [];
  }
  for (const mk of markers) {
    const x = X(mk.x);
    svg.append(s("line", { x1: x, x2: x, y1: m.t, y2: m.t + H, stroke: mk.colour || "#c60",
                           "stroke-dasharray": "3 2", "stroke-opacity": labelled ? 1 : 0.45,
                           class: "marker" }, mk.label ? s("title", {}, mk.label) : null));
    if (mk.label && labelled) svg.append(s("text", { x: x + 3, y: m.t + 10, class: "marker-label" }, mk.label));
  }
  return svg;
}

function legend(items) {
  return h("div", { class: "legend" }, items.map(([name, col]) =>
    h("span", { class: "key" }, h("i", { style: `background:${col}` }), name)));
}

function bars({ width = 360, height = 160, items, title = "", yLabel = "" }) {
  const m = { l: 48, r: 8, t: title ? 20 : 8, b: 22 };
  const W = width - m.l - m.r, H = height - m.t - m.b;
  const ymax = Math.max(1e-9, ...items.map((i) => i.value));
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, width, height,
                         role: "img", "aria-label": title });
  if (title) svg.append(s("text", { x: m.l, y: 13, class: "chart-title" }, title));
  if (yLabel) svg.append(s("text", { x: 4, y: m.t + 8, class: "tick" }, yLabel));
  const bw = items.length ? W / items.length : W;
  items.forEach((it, k) => {
    const bh = (it.value / ymax) * H;
    svg.append(s("rect", { x: m.l + k * bw + 4, y: m.t + H - bh, width: Math.max(2, bw - 8),
                           height: bh, fill: it.colour || "#3a7" }));
    svg.append(s("text", { x: m.l + k * bw + bw / 2, y: height - 6, class: "tick",
                           "text-anchor": "middle" }, it.label));
    svg.append(s("text", { x: m.l + k * bw + bw / 2, y: m.t + H - bh - 3, class: "tick",
                           "text-anchor": "middle" }, it.value >= 100 ? it.value.toFixed(0) : it.value.toFixed(2)));
  });
  return svg;
}

