// maitre's dashboard: every view is built from the coordinator's event log alone
// (GET /v1/events, then /v1/events/stream while live), so a replay of a run shows what its
// live page showed. No library: the views are SVG and one canvas.
"use strict";

const STATES = ["PENDING", "ADMITTED", "RENDEZVOUS", "RUNNING", "RESIZING", "SUSPENDING",
  "SUSPENDED", "COMPLETED", "FAILED", "CANCELLED"];
const ENDED = new Set(["COMPLETED", "FAILED", "CANCELLED"]);
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
// The model: the cluster as the events up to a time describe it

class Model {
  constructor() {
    this.nodes = new Map();
    this.jobs = new Map();
    this.prices = null;
    this.t0 = null;
    this.t = null;
    this.seq = 0;
    this.capacity = []; // {t, od, spot, rate, odRate}: alive slots by capacity type
    this.held = []; // {t, slots}
    this.notices = [];
    this.recoveries = [];
    this.heldSlots = 0;
    this.contrib = new Map(); // node -> what it adds to the capacity totals
    this.totals = { od: 0, spot: 0, rate: 0 };
    this.maxOnDemandPrice = null;
  }

  node(name) {
    let n = this.nodes.get(name);
    if (!n) {
      n = { name, slots: 0, labels: {}, price: null, state: "up", history: [], open: new Map(),
            segments: [], events: [], notice: null };
      this.nodes.set(name, n);
    }
    return n;
  }

  job(id) {
    let j = this.jobs.get(id);
    if (!j) {
      j = { id, queue: "", priority: null, state: "PENDING", states: [], placement: {},
            replicas: [], epochs: [], recoveries: [], checkpoints: [], restores: [],
            progress: [], events: [], caughtUp: [], submitted: null, cost: 0, odCost: 0,
            lastCostT: null };
      this.jobs.set(id, j);
    }
    return j;
  }

  move(j, state, t, why) {
    if (j.state === state && j.states.length) return;
    j.states.push({ t, from: j.states.length ? j.state : null, to: state, why: why || "" });
    j.state = state;
  }

  isSpot(n) { return (n.labels || {}).capacity_type === "spot"; }

  onDemandPrice() {
    if (this.prices && this.prices["on-demand"] != null) return this.prices["on-demand"];
    return this.maxOnDemandPrice;
  }

  capacityPoint(t, n) { // node n's capacity changed at t: the totals move by its difference
    const alive = n.state !== "dead" && n.state !== "reclaimed";
    const now = { od: 0, spot: 0, rate: 0 };
    if (alive) {
      if (this.isSpot(n)) now.spot = n.slots; else now.od = n.slots;
      now.rate = n.slots * (n.price ?? 0);
    }
    if (!this.isSpot(n) && n.price != null) {
      this.maxOnDemandPrice = Math.max(this.maxOnDemandPrice ?? 0, n.price);
    }
    const was = this.contrib.get(n.name) || { od: 0, spot: 0, rate: 0 };
    this.contrib.set(n.name, now);
    const c = this.totals;
    c.od += now.od - was.od; c.spot += now.spot - was.spot; c.rate += now.rate - was.rate;
    const odp = this.onDemandPrice();
    const point = { t, od: c.od, spot: c.spot, rate: c.rate,
                    odRate: odp != null ? (c.od + c.spot) * odp : c.rate };
    const last = this.capacity[this.capacity.length - 1];
    if (last && last.t === t) this.capacity[this.capacity.length - 1] = point;
    else this.capacity.push(point);
  }

  lastNotice(node) {
    for (let k = this.notices.length - 1; k >= 0; k--) if (this.notices[k].node === node) return this.notices[k];
    return null;
  }

  accrue(j, t) { // a job's cost: the slots it holds at their node's price
    if (j.lastCostT !== null) {
      const dt = (t - j.lastCostT) / 3600;
      const odp = this.onDemandPrice();
      if (dt <= 0) { j.lastCostT = t; return; }
      for (const [node, count] of Object.entries(j.placement)) {
        const n = this.nodes.get(node);
        const price = n ? n.price : null;
        if (price != null) j.cost += dt * count * price;
        if (odp != null || price != null) j.odCost += dt * count * (odp ?? price);
      }
    }
    j.lastCostT = t;
  }

  place(j, placement, t) {
    placement = placement || {};
    this.accrue(j, t);
    const names = new Set([...Object.keys(j.placement), ...Object.keys(placement)]);
    for (const name of names) {
      const before = j.placement[name] || 0, after = placement[name] || 0;
      if (before === after) continue;
      const n = this.node(name);
      const open = n.open.get(j.id);
      if (open) { open.t1 = t; n.open.delete(j.id); }
      if (after > 0) {
        const seg = { job: j.id, t0: t, t1: null, n: after };
        n.segments.push(seg);
        n.open.set(j.id, seg);
      }
      this.heldSlots += after - before;
    }
    j.placement = { ...placement };
    const replicas = Object.values(j.placement).reduce((a, b) => a + b, 0);
    j.replicas.push({ t, n: replicas });
    const last = this.held[this.held.length - 1];
    if (last && last.t === t) last.slots = this.heldSlots;
    else this.held.push({ t, slots: this.heldSlots });
  }

  apply(e) {
    const t = e.t;
    if (this.t0 === null) this.t0 = t;
    this.t = t;
    this.seq = e.seq;
    const j = e.job ? this.job(e.job) : null;
    if (j) j.events.push(e);
    const nodeName = e.node;
    if (nodeName && typeof nodeName === "string") this.node(nodeName).events.push(e);
    switch (e.kind) {
      case "prices": this.prices = e.prices || null; break;
      case "node_registered": case "node_changed": case "node_shrunk": {
        const n = this.node(e.node);
        n.slots = e.slots ?? n.slots;
        if (e.labels) n.labels = e.labels;
        if (e.price !== undefined) n.price = e.price;
        if (n.state !== "up") n.history.push({ t, state: "up" });
        n.state = "up";
        n.notice = null;
        if (!n.history.length) n.history.push({ t, state: "up" });
        this.capacityPoint(t, n);
        break;
      }
      case "node_recovered": {
        const n = this.node(e.node);
        n.state = "up"; n.history.push({ t, state: "up" }); n.notice = null;
        this.capacityPoint(t, n);
        break;
      }
      case "node_dead": {
        const n = this.node(e.node);
        n.state = n.notice ? "reclaimed" : "dead"; n.history.push({ t, state: n.state });
        this.capacityPoint(t, n);
        break;
      }
      case "node_suspect": { const n = this.node(e.node); n.state = "suspect"; n.history.push({ t, state: "suspect" }); break; }
      case "spot_notice": {
        const n = this.node(e.node);
        n.notice = { t, deadline: e.deadline ?? (t + (e.notice_s || 0)), notice_s: e.notice_s };
        if (n.state === "up") { n.state = "noticed"; n.history.push({ t, state: "noticed" }); }
        this.notices.push({ t, node: e.node, notice_s: e.notice_s, deadline: n.notice.deadline,
                            source: e.source, drained: null, reclaimed: null });
        break;
      }
      case "node_drained": {
        const notice = this.lastNotice(e.node);
        if (notice) { notice.drained = e.seconds ?? (t - notice.t); notice.workers = e.workers; }
        break;
      }
      case "node_reclaimed": {
        const n = this.node(e.node);
        n.state = "reclaimed"; n.history.push({ t, state: "reclaimed" });
        const notice = this.lastNotice(e.node);
        if (notice) notice.reclaimed = t;
        this.capacityPoint(t, n);
        break;
      }
      case "submitted":
        j.queue = e.queue ?? j.queue; j.priority = e.priority ?? j.priority; j.submitted = t;
        j.min = e.min_replicas ?? (e.replicas || [])[0]; j.max = e.max_replicas ?? (e.replicas || [])[1];
        this.move(j, "PENDING", t, "submitted");
        break;
      case "admit":
        this.place(j, e.placement, t);
        this.move(j, "ADMITTED", t, e.reason || "admitted");
        break;
      case "grow": case "shrink": case "repair": case "scale":
        if (e.placement) this.place(j, e.placement, t);
        if (j.state === "RUNNING" || j.state === "RENDEZVOUS") this.move(j, "RESIZING", t, `${e.kind}: ${e.reason || ""}`);
        break;
      case "preempting": // it waits for the slots its victims give up (not held yet)
        j.waitingFor = e.reason || "preempting";
        break;
      case "suspend": case "suspending":
        this.move(j, "SUSPENDING", t, e.reason || e.kind);
        break;
      case "epoch": {
        if (j.state !== "SUSPENDING") this.move(j, "RUNNING", t, `epoch ${e.epoch}`);
        j.epochs.push({ epoch: e.epoch, t, members: e.members || [], reason: e.reason,
                        closedFor: e.closed_for_s, closed: null, closeReason: null, reports: [],
                        caughtUp: [] });
        break;
      }
      case "epoch_closed": {
        const ep = j.epochs.find((x) => x.epoch === e.epoch);
        if (ep) { ep.closed = t; ep.closeReason = e.reason; }
        if (j.state !== "SUSPENDING" && !ENDED.has(j.state)) this.move(j, "RENDEZVOUS", t, e.reason);
        break;
      }
      case "report": {
        if (e.kind === "report" && e.rendezvous_s !== undefined) {
          const rec = { t, job: j.id, epoch: e.epoch, rank: e.rank, reason: e.reason,
                        detected_at: e.detected_at, rendezvous_s: e.rendezvous_s,
                        group_s: e.group_s, state_s: e.state_s, to_next_step_s: e.to_next_step_s,
                        state_source: e.state_source, state_bytes: e.state_bytes,
                        world_size: e.world_size };
          const ep = j.epochs.find((x) => x.epoch === e.epoch);
          if (ep) ep.reports.push(rec);
          if (!j.recoveries.some((r) => r.epoch === rec.epoch)) {
            j.recoveries.push(rec);
            this.recoveries.push(rec);
          }
          // A restore: the state came from disk, or moved from a live peer (a survivor that
          // kept its own state restored nothing; a streamed join is its caught_up event).
          if (e.state_source === "disk" || (e.state_source === "peer" && e.state_bytes > 0)) {
            if (!j.restores.some((r) => r.epoch === e.epoch && r.source === e.state_source)) {
              j.restores.push({ t, epoch: e.epoch, step: e.step, source: e.state_source,
                                seconds: e.state_s, bytes: e.state_bytes });
            }
          }
        }
        break;
      }
      case "caught_up": {
        const ep = j.epochs.find((x) => x.epoch === e.epoch);
        if (ep) ep.caughtUp.push(e);
        j.caughtUp.push(e);
        j.restores.push({ t, epoch: e.epoch, step: e.step, source: "peer", seconds: e.transfer_s,
                          bytes: e.state_bytes, streamed: true });
        break;
      }
      case "checkpoint":
        if (e.restored) j.restores.push({ t, step: e.step, source: "disk", seconds: e.seconds ?? e.load_s, bytes: e.bytes });
        else j.checkpoints.push(e);
        break;
      case "restore":
        j.restores.push({ t, step: e.step, source: e.source || "disk", seconds: e.seconds, bytes: e.bytes });
        break;
      case "progress": j.progress.push(e); break;
      case "job_suspended":
        this.place(j, {}, t); this.move(j, "SUSPENDED", t, "checkpointed and stopped"); break;
      case "job_completed": case "completed":
        this.place(j, {}, t); this.move(j, "COMPLETED", t, e.reason || ""); break;
      case "job_failed": case "failed":
        this.place(j, {}, t); this.move(j, "FAILED", t, e.reason || e.failure || ""); break;
      case "job_cancelled": case "cancelled":
        this.place(j, {}, t); this.move(j, "CANCELLED", t, "cancelled"); break;
      default: break;
    }
  }

  finish(t) { // close the accounting at the view's time
    for (const j of this.jobs.values()) this.accrue(j, t);
  }

  cost(t) { // the cluster's bill: alive capacity at its price, and all of it on-demand
    let cost = 0, od = 0;
    const out = [];
    for (let i = 0; i < this.capacity.length; i++) {
      const p = this.capacity[i];
      const end = Math.min(i + 1 < this.capacity.length ? this.capacity[i + 1].t : t, t);
      out.push({ t: p.t, cost, od });
      cost += Math.max(0, end - p.t) / 3600 * p.rate;
      od += Math.max(0, end - p.t) / 3600 * p.odRate;
    }
    out.push({ t, cost, od });
    return out;
  }
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

// ---------------------------------------------------------------------------------------------
// The app

const app = {
  meta: { live: false },
  events: [],
  model: new Model(),
  at: null, // the slider's time; null: the newest
  view: "scaling",
  arg: null,
  pending: false,
  error: null,
};
window.__maitre = { ready: false, seq: 0, renderedSeq: 0, renderedAt: 0, errors: [],
                   model: () => app.model, // (for tests and the curious: the page's state)
                   seen: {} }; // seq -> Date.now() when a render first showed it

function tEnd() {
  const last = app.events.length ? app.events[app.events.length - 1].t : 0;
  if (app.meta.live && app.meta.now && app.meta.serverOffset !== undefined) {
    return Math.max(last, Date.now() / 1000 - app.meta.serverOffset);
  }
  return last;
}

function rebuild() {
  const m = new Model();
  const until = app.at;
  for (const e of app.events) {
    if (until !== null && e.t > until) break;
    m.apply(e);
  }
  app.model = m;
}

function schedule() {
  if (app.pending) return;
  app.pending = true;
  requestAnimationFrame(() => { app.pending = false; render(); });
}

function showError(message) {
  app.error = message;
  const el = document.getElementById("error");
  el.textContent = message;
  el.hidden = !message;
}

async function fetchJSON(url) {
  const r = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  const text = await r.text();
  let body = null;
  try { body = JSON.parse(text); } catch (err) { body = null; }
  if (!r.ok) {
    const why = body && body.error ? body.error : `${r.status} ${r.statusText}`;
    if (r.status === 401) { location.href = `/dashboard/login?next=${encodeURIComponent(location.pathname)}`; }
    throw new Error(`${url}: ${why}`);
  }
  if (body === null) throw new Error(`${url}: the answer is not JSON`);
  return body;
}

async function load() {
  try {
    const meta = await fetchJSON("/dashboard/meta.json");
    app.meta = meta;
    if (meta.live && meta.now) meta.serverOffset = Date.now() / 1000 - meta.now;
    if (meta.error) throw new Error(meta.error);
    document.getElementById("source").textContent = meta.live ? "live" : `replay of ${meta.source}`;
    let since = 0;
    for (;;) {
      const page = await fetchJSON(`/v1/events?since=${since}&limit=10000`);
      for (const e of page.events) app.events.push(e);
      if (page.events.length) since = page.events[page.events.length - 1].seq;
      if (!page.events.length || since >= page.last) break;
    }
    const fetched = performance.now();
    for (const e of app.events) app.model.apply(e);
    const modelled = performance.now();
    window.__maitre.seq = since;
    window.__maitre.loadedSeq = since; // what came later came by the stream
    setupSlider();
    render();
    const rendered = performance.now();
    window.__maitre.ready = true;
    window.__maitre.loadedMs = rendered;
    window.__maitre.timings = { fetchedMs: fetched, modelMs: modelled - fetched,
                                renderMs: rendered - modelled };
    if (meta.live) stream(since);
  } catch (err) {
    showError(`The dashboard could not load its data: ${err.message}`);
    window.__maitre.ready = true;
    window.__maitre.failed = String(err.message);
  }
}

function stream(since) {
  const source = new EventSource(`/v1/events/stream?since=${since}`);
  source.onmessage = (msg) => {
    let e;
    try { e = JSON.parse(msg.data); } catch (err) { return; }
    if (e.seq <= window.__maitre.seq) return;
    app.events.push(e);
    window.__maitre.seq = e.seq;
    if (app.at === null) app.model.apply(e);
    schedule();
  };
  source.onerror = () => {
    document.getElementById("source").textContent = "live (reconnecting…)";
  };
  source.onopen = () => { document.getElementById("source").textContent = "live"; };
  setInterval(schedule, 1000); // the clock moves even when nothing happens
}

function setupSlider() {
  const slider = document.getElementById("slider");
  const follow = document.getElementById("follow");
  const play = document.getElementById("play");
  slider.addEventListener("input", () => {
    const t0 = app.events.length ? app.events[0].t : 0;
    const t = t0 + (Number(slider.value) / 1000) * (tEnd() - t0);
    app.at = Number(slider.value) >= 1000 ? null : t;
    follow.checked = app.at === null;
    rebuild();
    render();
  });
  follow.addEventListener("change", () => {
    if (follow.checked) { app.at = null; rebuild(); render(); }
  });
  let timer = null;
  play.addEventListener("click", () => {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "▶"; return; }
    play.textContent = "⏸";
    if (app.at === null) slider.value = 0;
    timer = setInterval(() => {
      const v = Math.min(1000, Number(slider.value) + 5);
      slider.value = v;
      slider.dispatchEvent(new Event("input"));
      if (v >= 1000) { clearInterval(timer); timer = null; play.textContent = "▶"; }
    }, 50);
  });
}

function route() {
  const hash = location.hash.replace(/^#\/?/, "");
  const [view, ...rest] = hash.split("/");
  app.view = view || "scaling";
  app.arg = rest.length ? decodeURIComponent(rest.join("/")) : null;
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.dataset.view === app.view);
  }
  render();
}

function render() {
  const m = app.model;
  const end = app.at ?? tEnd();
  m.finish(end);
  renderHeader(m, end);
  const main = document.getElementById("view");
  const views = { scaling: viewScaling, rendezvous: viewRendezvous, checkpoints: viewCheckpoints,
                  spot: viewSpot, job: viewJob, node: viewNode };
  const build = views[app.view];
  let content;
  try {
    content = build ? build(m, end) : h("section", { class: "missing" },
      h("h2", {}, "Not found"), h("p", {}, `There is no view “${app.view}”.`));
  } catch (err) {
    content = h("p", { class: "error" }, `This view failed: ${err.message}`);
    window.__maitre.errors.push(String(err.stack || err));
  }
  main.replaceChildren(content);
  const slider = document.getElementById("slider");
  const t0 = app.events.length ? app.events[0].t : 0;
  if (app.at === null) slider.value = 1000;
  document.getElementById("clock").textContent = app.events.length ?
    `${fmtS(end - t0)} from the log's start` + (app.meta.live ? ` · ${new Date(end * 1000).toLocaleTimeString()}` : "") : "no events yet";
  const now = Date.now();
  const from = Math.max(window.__maitre.renderedSeq, window.__maitre.loadedSeq ?? Infinity);
  for (let seq = from + 1; seq <= m.seq && app.at === null; seq++) {
    if (Object.keys(window.__maitre.seen).length < 20000) window.__maitre.seen[seq] = now;
  }
  window.__maitre.renderedSeq = Math.max(window.__maitre.renderedSeq, app.at === null ? m.seq : 0);
  window.__maitre.renderedAt = now;
}

function renderHeader(m, end) {
  const alive = [...m.nodes.values()].filter((n) => n.state !== "dead" && n.state !== "reclaimed");
  const capacity = alive.reduce((a, n) => a + n.slots, 0);
  const byState = {};
  let training = 0;
  for (const j of m.jobs.values()) {
    byState[j.state] = (byState[j.state] || 0) + 1;
    if (j.state === "RUNNING") training += Object.values(j.placement).reduce((a, b) => a + b, 0);
  }
  const stats = document.getElementById("stats");
  const last = m.recoveries.slice(-3).reverse();
  stats.replaceChildren(
    h("div", { class: "stat" }, h("b", {}, `${alive.length}/${m.nodes.size}`), " nodes up"),
    h("div", { class: "stat", id: "stat-allocation" }, h("b", {}, fmtPct(capacity ? m.heldSlots / capacity : null)),
      " allocation", h("small", {}, ` ${m.heldSlots}/${capacity} slots held`)),
    h("div", { class: "stat", id: "stat-utilization" }, h("b", {}, fmtPct(capacity ? training / capacity : null)),
      " utilization", h("small", {}, " (slots training)")),
    h("div", { class: "stat jobs" }, STATES.filter((st) => byState[st]).map((st) =>
      h("span", { class: `pill st-${st.toLowerCase()}` }, `${byState[st]} ${st.toLowerCase()}`))),
    h("div", { class: "stat recoveries" }, last.length ? ["last recoveries: ", ...last.map((r) =>
      h("a", { href: `#/job/${encodeURIComponent(r.job)}` }, `${r.job} ${fmtS(r.to_next_step_s)}`))] :
      "no recoveries"));
}

function jobLink(id) {
  return h("a", { href: `#/job/${encodeURIComponent(id)}`, class: "job-link" },
    h("i", { class: "swatch", style: `background:${colour(id)}` }), id);
}

// -- Scaling ----------------------------------------------------------------------------------

function viewScaling(m, end) {
  const nodes = [...m.nodes.values()].sort((a, b) => natural(a.name, b.name));
  const sec = h("section", { id: "scaling" }, h("h2", {}, "Scaling"),
    h("p", { class: "hint" }, "Each row is a node, its height its slots; colour: the job holding them. " +
      "Orange: a spot node (hatched while under notice); grey: down. Click a row for the node."));
  if (!nodes.length) { sec.append(h("p", { class: "empty" }, "No node has registered yet.")); return sec; }
  const t0 = m.t0 ?? end;
  const width = Math.max(480, Math.min(1400, (document.getElementById("view").clientWidth || 900) - 8));
  const gutter = 90;
  const rh = Math.max(1, Math.min(28, Math.floor(720 / nodes.length)));
  const height = nodes.length * rh + 22;
  const canvas = h("canvas", { id: "scaling-canvas", width, height, style: `width:${width}px;height:${height}px` });
  const ctx = canvas.getContext("2d");
  const X = (t) => gutter + ((t - t0) / Math.max(1e-9, end - t0)) * (width - gutter - 4);
  ctx.fillStyle = "#fafafa";
  ctx.fillRect(0, 0, width, height);
  nodes.forEach((n, i) => {
    const y = i * rh;
    if (m.isSpot(n)) { ctx.fillStyle = "#f3a43b"; ctx.fillRect(gutter - 6, y, 4, Math.max(1, rh - (rh > 3 ? 1 : 0))); }
    // down intervals
    let downAt = null;
    for (const hst of n.history) {
      if ((hst.state === "dead" || hst.state === "reclaimed") && downAt === null) downAt = hst.t;
      if (hst.state === "up" && downAt !== null) { ctx.fillStyle = "#d5d5d5"; ctx.fillRect(X(downAt), y, X(hst.t) - X(downAt), rh); downAt = null; }
    }
    if (downAt !== null) { ctx.fillStyle = "#d5d5d5"; ctx.fillRect(X(downAt), y, X(end) - X(downAt), rh); }
    const slots = Math.max(1, n.slots);
    const stack = []; // segments stacked within the row by start order
    for (const seg of n.segments) {
      const a = Math.max(seg.t0, t0), b = seg.t1 ?? end;
      if (b < a) continue;
      let off = 0;
      for (const other of stack) if (other.t1 === null || other.t1 > a) { if ((other.t1 ?? end) > a && other.t0 < b) off = Math.max(off, other.off + other.n); }
      seg.off = Math.min(off, slots - Math.min(seg.n, slots));
      stack.push(seg);
      ctx.fillStyle = colour(seg.job);
      const sh = (rh * Math.min(seg.n, slots)) / slots;
      ctx.fillRect(X(a), y + (rh * seg.off) / slots, Math.max(1, X(b) - X(a)), Math.max(1, sh - (rh > 6 ? 0.5 : 0)));
    }
    if (n.notice) {
      const a = n.notice.t, b = n.history.find((x) => x.t >= a && x.state === "reclaimed")?.t ?? end;
      ctx.fillStyle = "rgba(243,164,59,0.45)";
      for (let x = X(a); x < X(b); x += 4) ctx.fillRect(x, y, 1.5, rh);
    }
    if (rh >= 10) {
      ctx.fillStyle = n.state === "dead" || n.state === "reclaimed" ? "#999" : "#333";
      ctx.font = "10px system-ui, sans-serif";
      ctx.fillText(n.name.length > 12 ? n.name.slice(0, 11) + "…" : n.name, 2, y + rh - 3);
    }
  });
  ctx.fillStyle = "#666";
  ctx.font = "10px system-ui, sans-serif";
  for (let k = 0; k <= 4; k++) {
    const t = t0 + ((end - t0) * k) / 4;
    ctx.fillText(fmtS(t - t0), Math.min(width - 40, X(t)), height - 6);
  }
  canvas.addEventListener("click", (ev) => {
    const rect = canvas.getBoundingClientRect();
    const i = Math.floor((ev.clientY - rect.top) / rh);
    if (nodes[i]) location.hash = `#/node/${encodeURIComponent(nodes[i].name)}`;
  });
  const tip = h("div", { class: "tip", hidden: true });
  canvas.addEventListener("mousemove", (ev) => {
    const rect = canvas.getBoundingClientRect();
    const i = Math.floor((ev.clientY - rect.top) / rh);
    const n = nodes[i];
    if (!n) { tip.hidden = true; return; }
    const t = t0 + ((ev.clientX - rect.left - gutter) / (width - gutter - 4)) * (end - t0);
    const held = n.segments.filter((sg) => sg.t0 <= t && (sg.t1 ?? end) >= t).map((sg) => `${sg.job} ×${sg.n}`);
    tip.textContent = `${n.name} (${n.slots} slots, ${n.labels.capacity_type || "on-demand"}, ${n.state}) at ${fmtS(t - t0)}: ${held.join(", ") || "idle"}`;
    tip.style.left = `${ev.clientX - rect.left + 12}px`;
    tip.style.top = `${ev.clientY - rect.top + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  const jobs = [...m.jobs.values()].sort((a, b) => natural(a.id, b.id));
  sec.append(h("div", { class: "canvas-wrap" }, canvas, tip));
  sec.append(legend(jobs.filter((j) => j.replicas.length).slice(0, 40).map((j) => [j.id, colour(j.id)])));
  sec.append(chart({ width: Math.min(width, 900), height: 170, x0: t0, x1: end,
                     series: stacked(jobs.filter((j) => j.replicas.length)),
                     title: "slots held by each job (stacked)", yLabel: "slots" }));
  const queued = jobs.filter((j) => j.state === "PENDING" || j.state === "SUSPENDED");
  sec.append(h("h3", {}, `Queued (${queued.length})`));
  sec.append(queued.length ? h("table", { class: "table", id: "queued" },
    h("tr", {}, h("th", {}, "job"), h("th", {}, "queue"), h("th", {}, "state"), h("th", {}, "waiting")),
    queued.slice(0, 200).map((j) => h("tr", {}, h("td", {}, jobLink(j.id)), h("td", {}, j.queue),
      h("td", {}, j.state.toLowerCase()),
      h("td", {}, fmtS(end - (j.states[j.states.length - 1]?.t ?? end)))))) :
    h("p", { class: "empty" }, "No job waits."));
  const marked = nodes.filter((n) => n.state !== "up");
  if (marked.length) {
    sec.append(h("h3", {}, "Nodes not up"));
    sec.append(h("ul", { class: "marked" }, marked.slice(0, 100).map((n) =>
      h("li", {}, h("a", { href: `#/node/${encodeURIComponent(n.name)}` }, n.name), ` ${n.state}`))));
  }
  return sec;
}

function stacked(jobs, most = 24) { // jobs growing and shrinking, one band each
  const shown = jobs.slice().sort((a, b) => Math.max(...b.replicas.map((r) => r.n)) -
    Math.max(...a.replicas.map((r) => r.n))).slice(0, most);
  const times = [...new Set(shown.flatMap((j) => j.replicas.map((r) => r.t)))].sort((a, b) => a - b);
  if (!times.length) return [];
  let lower = times.map((t) => [t, 0]);
  const out = [];
  for (const j of shown) {
    let k = 0, n = 0;
    const upper = times.map((t, i) => {
      while (k < j.replicas.length && j.replicas[k].t <= t) n = j.replicas[k++].n;
      return [t, lower[i][1] + n];
    });
    out.push({ points: upper, lower, colour: colour(j.id), step: true, fill: true, width: 1 });
    lower = upper;
  }
  return out;
}

// -- Rendezvous -------------------------------------------------------------------------------

const MACHINE = ["PENDING", "ADMITTED", "RENDEZVOUS", "RUNNING", "RESIZING", "SUSPENDED", "COMPLETED", "FAILED"];

function stateMachine(j) {
  const w = 820, bh = 26, bw = 92, gap = 10;
  const svg = s("svg", { class: "machine", viewBox: `0 0 ${w} 58`, width: w, height: 58, role: "img",
                         "aria-label": `${j.id} is ${j.state.toLowerCase()}` });
  const counts = {};
  for (const st of j.states) if (st.from) counts[st.to] = (counts[st.to] || 0) + 1;
  const shown = j.state === "SUSPENDING" ? "SUSPENDED" : j.state === "CANCELLED" ? "FAILED" : j.state;
  MACHINE.forEach((st, k) => {
    const x = 4 + k * (bw + gap);
    const on = st === shown;
    svg.append(s("rect", { x, y: 6, width: bw, height: bh, rx: 6, class: on ? `box on st-${st.toLowerCase()}` : "box",
                           "data-state": st }));
    svg.append(s("text", { x: x + bw / 2, y: 23, "text-anchor": "middle", class: on ? "box-label on" : "box-label" },
      st === "SUSPENDED" && j.state === "SUSPENDING" ? "suspending" : st === "FAILED" && j.state === "CANCELLED" ? "cancelled" : st.toLowerCase()));
    if (counts[st]) svg.append(s("text", { x: x + bw / 2, y: 50, "text-anchor": "middle", class: "tick" }, `entered ×${counts[st]}`));
  });
  return svg;
}

function splitBar(rec, closedAt) {
  const detect = rec.detected_at && closedAt ? Math.max(0, rec.detected_at - closedAt) : 0;
  const parts = [["detect", detect], ["re-shard", (rec.rendezvous_s || 0) + (rec.group_s || 0)],
                 ["state", rec.state_s || 0]];
  const used = parts.reduce((a, p) => a + p[1], 0) - detect;
  parts.push(["first step", Math.max(0, (rec.to_next_step_s || 0) - used)]);
  const total = parts.reduce((a, p) => a + p[1], 0) || 1;
  const cols = { detect: "#c44", "re-shard": "#47a", state: "#a7c", "first step": "#6a4" };
  return h("div", { class: "split", title: parts.map(([k, v]) => `${k} ${fmtS(v)}`).join(", ") },
    parts.map(([k, v]) => h("span", { class: "part", style: `flex:${v / total};background:${cols[k]}` })),
    h("small", {}, parts.map(([k, v]) => `${k} ${fmtS(v)}`).join(" · ")));
}

function epochsTable(j, limit = 12) {
  const rows = j.epochs.slice(-limit).reverse();
  if (!rows.length) return h("p", { class: "empty" }, "No epoch yet.");
  return h("table", { class: "table epochs" },
    h("tr", {}, h("th", {}, "epoch"), h("th", {}, "opened"), h("th", {}, "members (rank: worker)"),
      h("th", {}, "why"), h("th", {}, "lasted"), h("th", {}, "recovery")),
    rows.map((ep) => {
      const prev = j.epochs.find((x) => x.epoch === ep.epoch - 1);
      const rec = ep.reports.find((r) => r.rank === 0) || ep.reports[0];
      return h("tr", { "data-epoch": ep.epoch }, h("td", {}, ep.epoch),
        h("td", {}, fmtS(ep.t - (app.model.t0 ?? ep.t))),
        h("td", { class: "members" }, ep.members.slice(0, 16).map((w, r) => `${r}: ${w}`).join("  ") +
          (ep.members.length > 16 ? `  … ${ep.members.length} in all` : "")),
        h("td", {}, ep.reason || ""),
        h("td", {}, ep.closed ? fmtS(ep.closed - ep.t) : "open"),
        h("td", {}, rec ? splitBar(rec, prev && prev.closed) : ep.caughtUp.length ?
          `${ep.caughtUp.length} caught up while it trained` : "–"));
    }));
}

function viewRendezvous(m, end) {
  const sec = h("section", { id: "rendezvous" }, h("h2", {}, "Rendezvous"),
    h("p", { class: "hint" }, "Each job's state machine (lit: where it is now; ×n: times entered), " +
      "its membership epochs with their members and ranks, and each recovery's time split."));
  const jobs = [...m.jobs.values()].sort((a, b) => (ENDED.has(a.state) - ENDED.has(b.state)) || natural(a.id, b.id));
  if (!jobs.length) { sec.append(h("p", { class: "empty" }, "No job yet.")); return sec; }
  for (const j of jobs.slice(0, 60)) {
    const trans = j.states.slice(-6).reverse();
    sec.append(h("div", { class: "card", "data-job": j.id, "data-state": j.state },
      h("h3", {}, jobLink(j.id), h("span", { class: `pill st-${j.state.toLowerCase()}` }, j.state.toLowerCase()),
        h("small", {}, ` queue ${j.queue || "–"} · ${Object.values(j.placement).reduce((a, b) => a + b, 0)} slot(s)`)),
      stateMachine(j),
      h("ol", { class: "transitions" }, trans.map((st) => h("li", {},
        `${fmtS(st.t - (m.t0 ?? st.t))}: ${st.from ? st.from.toLowerCase() + " → " : ""}${st.to.toLowerCase()}`,
        st.why ? h("small", {}, ` (${st.why})`) : null))),
      epochsTable(j, 6)));
  }
  return sec;
}

// -- Checkpoints ------------------------------------------------------------------------------

function checkpointTimeline(j, t0, end, width = 820) {
  const height = 96, l = 60, W = width - l - 10;
  const X = (t) => l + ((t - t0) / Math.max(1e-9, end - t0)) * W;
  const svg = s("svg", { class: "timeline", viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
                         "aria-label": `${j.id} checkpoints` });
  svg.append(s("text", { x: 2, y: 22, class: "tick" }, "snapshot"));
  svg.append(s("text", { x: 2, y: 50, class: "tick" }, "persist"));
  svg.append(s("text", { x: 2, y: 78, class: "tick" }, "restore"));
  const maxSnap = Math.max(1e-6, ...j.checkpoints.map((c) => c.snapshot_s || 0));
  for (const c of j.checkpoints) {
    const x = X(c.t);
    const hgt = 4 + 16 * ((c.snapshot_s || 0) / maxSnap);
    svg.append(s("rect", { x: x - 1.5, y: 28 - hgt, width: 3, height: hgt, class: c.ok === false ? "ckpt bad" : "ckpt",
                           "data-step": c.step },
      s("title", {}, `step ${c.step}: snapshot ${fmtS(c.snapshot_s)} (blocking)`)));
    const p0 = X(c.t - (c.persist_s || 0));
    svg.append(s("rect", { x: p0, y: 42, width: Math.max(2, x - p0), height: 10, class: c.ok === false ? "persist bad" : "persist" },
      s("title", {}, `step ${c.step}: persisted in ${fmtS(c.persist_s)}${c.ok === false ? " — FAILED: " + (c.error || "") : ""}`)));
  }
  for (const r of j.restores) {
    const x = X(r.t);
    svg.append(s("circle", { cx: x, cy: 74, r: 5, class: `restore ${r.source}` },
      s("title", {}, `restored step ${r.step ?? "?"} from ${r.source} in ${fmtS(r.seconds)}`)));
    svg.append(s("text", { x: x + 7, y: 78, class: "tick" }, r.source));
  }
  svg.append(s("line", { x1: l, x2: l + W, y1: height - 8, y2: height - 8, class: "grid" }));
  return svg;
}

function viewCheckpoints(m, end) {
  const sec = h("section", { id: "checkpoints" }, h("h2", {}, "Checkpoints"),
    h("p", { class: "hint" }, "Per job: snapshots (the part that blocks training; height: its time), " +
      "persists (the background write, fsync and rename, ending at the bar's right edge), " +
      "restores with their source (a live peer, or disk), and the interval the policy chose."));
  const jobs = [...m.jobs.values()].filter((j) => j.checkpoints.length || j.restores.length)
    .sort((a, b) => natural(a.id, b.id));
  if (!jobs.length) { sec.append(h("p", { class: "empty" }, "No checkpoint or restore in this log.")); return sec; }
  const t0 = m.t0 ?? end;
  for (const j of jobs.slice(0, 40)) {
    const last = j.checkpoints[j.checkpoints.length - 1];
    const interval = last ? (last.interval_steps != null ? `every ${last.interval_steps} steps` :
      last.interval_s != null ? `every ${fmtS(last.interval_s)}` : "–") : "–";
    const snaps = j.checkpoints.map((c) => c.snapshot_s || 0);
    const mean = snaps.length ? snaps.reduce((a, b) => a + b, 0) / snaps.length : null;
    sec.append(h("div", { class: "card", "data-job": j.id },
      h("h3", {}, jobLink(j.id), h("small", {},
        ` ${j.checkpoints.length} checkpoint(s) · mean snapshot ${fmtS(mean)} · interval chosen: ${interval} · ` +
        `${j.restores.filter((r) => r.source === "peer").length} restore(s) from a peer, ` +
        `${j.restores.filter((r) => r.source === "disk").length} from disk`)),
      checkpointTimeline(j, t0, end),
      j.checkpoints.some((c) => c.interval_steps != null || c.interval_s != null) ?
        chart({ width: 520, height: 120, x0: t0, x1: end, title: "interval the policy chose",
                series: [{ points: j.checkpoints.map((c) => [c.t, c.interval_steps ?? c.interval_s ?? 0]),
                           colour: "#47a", step: true }],
                yLabel: j.checkpoints[0].interval_steps != null ? "steps" : "s" }) : null));
  }
  return sec;
}

// -- Spot -------------------------------------------------------------------------------------

function viewSpot(m, end) {
  const sec = h("section", { id: "spot" }, h("h2", {}, "Spot capacity and cost"));
  const t0 = m.t0 ?? end;
  if (!m.capacity.length) { sec.append(h("p", { class: "empty" }, "No capacity in this log yet.")); return sec; }
  const pts = [...m.capacity, { ...m.capacity[m.capacity.length - 1], t: end }];
  const markers = m.notices.map((n) => ({ x: n.t, label: `notice ${n.node}`, colour: "#c60" }));
  for (const n of m.notices) if (n.reclaimed) markers.push({ x: n.reclaimed, label: "reclaimed", colour: "#a33" });
  sec.append(legend([["on-demand slots", "#47a"], ["spot slots", "#f3a43b"], ["all slots", "#333"]]));
  sec.append(chart({ width: 860, height: 200, x0: t0, x1: end, title: "capacity by type", yLabel: "slots",
    series: [{ points: pts.map((p) => [p.t, p.od + p.spot]), colour: "#333", step: true, width: 1 },
             { points: pts.map((p) => [p.t, p.od]), colour: "#47a", step: true, fill: true },
             { points: pts.map((p) => [p.t, p.od + p.spot]), lower: pts.map((p) => [p.t, p.od]),
               colour: "#f3a43b", step: true, fill: true }],
    markers }));
  const cost = m.cost(end);
  const spent = cost[cost.length - 1];
  const priced = m.capacity.some((p) => p.rate > 0);
  if (priced) {
    const saved = spent.od - spent.cost;
    sec.append(h("p", { class: "costline", id: "cost-summary" },
      h("b", {}, fmtMoney(spent.cost)), " spent so far against ", h("b", {}, fmtMoney(spent.od)),
      " had every slot been on-demand: ", h("b", {}, `${fmtMoney(saved)} saved`),
      spent.od > 0 ? ` (${fmtPct(saved / spent.od)})` : "", h("small", {}, " (price × slots up, per hour)")));
    sec.append(legend([["cost", "#2a8"], ["all on-demand", "#888"]]));
    sec.append(chart({ width: 860, height: 180, x0: t0, x1: end, title: "cumulative cost", yLabel: "cost",
      series: [{ points: cost.map((c) => [c.t, c.od]), colour: "#888", dash: "5 3" },
               { points: cost.map((c) => [c.t, c.cost]), colour: "#2a8", width: 2 }], markers }));
  } else {
    sec.append(h("p", { class: "empty" }, "No prices in this log: start the coordinator with --price."));
  }
  sec.append(h("h3", {}, `Reclaim notices (${m.notices.length})`));
  sec.append(m.notices.length ? h("table", { class: "table", id: "notices" },
    h("tr", {}, h("th", {}, "node"), h("th", {}, "at"), h("th", {}, "warning"), h("th", {}, "drained in"),
      h("th", {}, "workers"), h("th", {}, "reclaimed")),
    m.notices.slice(-50).reverse().map((n) => h("tr", {},
      h("td", {}, h("a", { href: `#/node/${encodeURIComponent(n.node)}` }, n.node)),
      h("td", {}, fmtS(n.t - t0)), h("td", {}, fmtS(n.notice_s)),
      h("td", {}, n.drained != null ? fmtS(n.drained) : "–"),
      h("td", {}, (n.workers || []).join(", ") || "–"),
      h("td", {}, n.reclaimed != null ? fmtS(n.reclaimed - t0) : "not yet")))) :
    h("p", { class: "empty" }, "No reclaim notice in this log."));
  const jobs = [...m.jobs.values()].filter((j) => j.cost > 0 || j.odCost > 0).sort((a, b) => b.cost - a.cost);
  if (jobs.length) {
    const queues = {};
    for (const j of jobs) {
      const q = (queues[j.queue || "–"] ||= { cost: 0, od: 0 });
      q.cost += j.cost; q.od += j.odCost;
    }
    sec.append(h("h3", {}, "Cost of the slots each job and queue held"));
    sec.append(h("table", { class: "table", id: "job-costs" },
      h("tr", {}, h("th", {}, "job"), h("th", {}, "queue"), h("th", {}, "cost"), h("th", {}, "all on-demand")),
      jobs.slice(0, 50).map((j) => h("tr", {}, h("td", {}, jobLink(j.id)), h("td", {}, j.queue),
        h("td", {}, fmtMoney(j.cost)), h("td", {}, fmtMoney(j.odCost)))),
      Object.entries(queues).map(([q, c]) => h("tr", { class: "total" }, h("td", {}, "queue"), h("td", {}, q),
        h("td", {}, fmtMoney(c.cost)), h("td", {}, fmtMoney(c.od))))));
  }
  return sec;
}

// -- A job, a node ----------------------------------------------------------------------------

function viewJob(m, end) {
  const j = m.jobs.get(app.arg);
  if (!j) return h("section", { class: "missing" }, h("h2", {}, "Not found"),
    h("p", {}, `No job named “${app.arg}” in this log${app.at !== null ? " up to this time" : ""}.`));
  const t0 = m.t0 ?? end;
  const sec = h("section", { id: "job", "data-job": j.id },
    h("h2", {}, jobLink(j.id), " ", h("span", { class: `pill st-${j.state.toLowerCase()}` }, j.state.toLowerCase())),
    h("p", {}, `queue ${j.queue || "–"} · priority ${j.priority ?? "–"} · replicas ${j.min ?? "?"}..${j.max ?? "?"} · ` +
      `${j.epochs.length} epoch(s) · ${j.recoveries.length} recovery(ies) · ${j.checkpoints.length} checkpoint(s)` +
      (j.cost ? ` · cost ${fmtMoney(j.cost)}` : "")),
    stateMachine(j));
  const losses = j.progress.filter((p) => p.loss != null && isFinite(p.loss));
  const row = h("div", { class: "row" });
  row.append(losses.length ? chart({ width: 520, height: 200, x0: losses[0].step, x1: losses[losses.length - 1].step,
    title: "loss by step", series: [{ points: losses.map((p) => [p.step, p.loss]), colour: colour(j.id), width: 2 }],
    xLabel: (x) => x.toFixed(0) }) : h("p", { class: "empty" }, "No loss reported (yet)."));
  const bySize = {};
  for (const p of j.progress) {
    const rate = p.samples_per_s ?? p.steps_per_s;
    if (rate == null || !p.world_size) continue;
    (bySize[p.world_size] ||= []).push(rate);
  }
  const sizes = Object.keys(bySize).map(Number).sort((a, b) => a - b);
  const unit = j.progress.some((p) => p.samples_per_s != null) ? "samples/s" : "steps/s";
  row.append(sizes.length ? bars({ width: 360, height: 200, title: `throughput by world size (${unit})`,
    items: sizes.map((n) => ({ label: `${n}`, value: bySize[n].reduce((a, b) => a + b, 0) / bySize[n].length,
                               colour: colour(j.id) })) }) : h("p", { class: "empty" }, "No throughput reported (yet)."));
  sec.append(row);
  sec.append(chart({ width: 880, height: 140, x0: t0, x1: end, title: "slots held",
    series: [{ points: j.replicas.map((r) => [r.t, r.n]), colour: colour(j.id), step: true, fill: true }] }));
  sec.append(h("h3", {}, "Epochs"), epochsTable(j, 30));
  if (j.checkpoints.length || j.restores.length) sec.append(h("h3", {}, "Checkpoints"), checkpointTimeline(j, t0, end, 880));
  sec.append(h("h3", {}, "Events"), eventList(j.events, t0));
  return sec;
}

function eventList(events, t0) {
  const rows = events.slice(-60).reverse();
  return h("table", { class: "table events" }, rows.map((e) => {
    const { seq, t, job, kind, ...rest } = e;
    const text = JSON.stringify(rest);
    return h("tr", {}, h("td", {}, fmtS(t - t0)), h("td", {}, kind),
      h("td", { class: "body" }, text.length > 200 ? text.slice(0, 200) + "…" : text));
  }));
}

function viewNode(m, end) {
  const n = m.nodes.get(app.arg);
  if (!n) return h("section", { class: "missing" }, h("h2", {}, "Not found"),
    h("p", {}, `No node named “${app.arg}” in this log${app.at !== null ? " up to this time" : ""}.`));
  const t0 = m.t0 ?? end;
  const labels = Object.entries(n.labels || {}).map(([k, v]) => `${k}=${v}`).join(" ") || "no labels";
  const sec = h("section", { id: "node", "data-node": n.name },
    h("h2", {}, n.name, " ", h("span", { class: `pill node-${n.state}` }, n.state)),
    h("p", {}, `${n.slots} slot(s) · ${labels} · price ${n.price ?? "–"} per slot-hour`));
  const byJob = {};
  for (const seg of n.segments) (byJob[seg.job] ||= []).push(seg);
  const series = Object.entries(byJob).map(([job, segs]) => {
    const pts = [];
    for (const sg of segs) { pts.push([sg.t0, sg.n]); pts.push([sg.t1 ?? end, 0]); }
    pts.sort((a, b) => a[0] - b[0]);
    return { points: pts, colour: colour(job), step: true };
  });
  sec.append(legend(Object.keys(byJob).map((job) => [job, colour(job)])));
  sec.append(chart({ width: 880, height: 160, x0: t0, x1: end, title: "slots held by each job", yMax: Math.max(1, n.slots), series,
    markers: n.history.filter((x) => x.state !== "up").map((x) => ({ x: x.t, label: x.state, colour: "#a33" })) }));
  sec.append(h("h3", {}, "Events"), eventList(n.events, t0));
  return sec;
}

// ---------------------------------------------------------------------------------------------

window.addEventListener("error", (e) => window.__maitre.errors.push(String(e.message)));
window.addEventListener("hashchange", route);
window.addEventListener("resize", schedule);
document.addEventListener("DOMContentLoaded", () => {
  route();
  load();
});
