// maitre's dashboard: the views (scaling, rendezvous, checkpoints, spot, a job, a node), each
// drawn from the model alone.
"use strict";

function jobLink(id) {
  return h("a", { href: `#/job/${encodeURIComponent(id)}`, class: "job-link" },
    h("i", { class: "swatch", style: `background:${colour(id)}` }), id);
}

// -- Scaling ----------------------------------------------------------------------------------

function viewScaling(m, end) {
  const nodes = [...m.nodes.values()].sort((a, b) => natural(a.name, b.name));
  const sec = h("section", { id: "scaling" }, h("h2", {}, "Scaling"),
    h("p", { class: "hint" }, "Each row is a node, its height its slots; colour: the job holding them. " +
      "Orange: a spot node (hatched while under notice); red mark: a slow rank was found there; " +
      "purple mark: a health probe failed there, or it was suspect (hatched while it was); grey: down. " +
      "Click a row for the node."));
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
    if (n.slow.length) { ctx.fillStyle = "#b3261e"; ctx.fillRect(gutter - 12, y, 4, Math.max(1, rh - (rh > 3 ? 1 : 0))); }
    const sick = sickIntervals(n, end);
    if (sick.length) {
      ctx.fillStyle = "#7b3fa0"; ctx.fillRect(gutter - 18, y, 4, Math.max(1, rh - (rh > 3 ? 1 : 0)));
      ctx.fillStyle = "rgba(123,63,160,0.45)";
      for (const [a, b] of sick) for (let x = X(Math.max(a, t0)); x < X(b); x += 4) ctx.fillRect(x, y, 1.5, rh);
    }
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
      (j.cost ? ` · cost ${fmtMoney(j.cost)}` : "") +
      (j.spares.size ? ` · ${j.spares.size} warm spare(s), not in the slots held` : "")),
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
  if (j.stragglers.length) sec.append(h("h3", {}, `Slow ranks (${j.stragglers.length})`), slowTable(j.stragglers, t0));
  if (j.spares.size || j.promotions.length) sec.append(h("h3", {}, `Warm spares (${j.spares.size} waiting)`), sparesTable(j, t0));
  sec.append(h("h3", {}, "Epochs"), epochsTable(j, 30));
  if (j.checkpoints.length || j.restores.length) sec.append(h("h3", {}, "Checkpoints"), checkpointTimeline(j, t0, end, 880));
  sec.append(h("h3", {}, "Events"), eventList(j.events, t0));
  return sec;
}

function slowTable(rows, t0) {
  return h("table", { class: "table", id: "stragglers" },
    h("tr", {}, h("th", {}, "found"), h("th", {}, "worker"), h("th", {}, "rank"), h("th", {}, "node"),
      h("th", {}, "slower than the median"), h("th", {}, "since step"), h("th", {}, "policy")),
    rows.slice(-30).reverse().map((e) => h("tr", {}, h("td", {}, fmtS(e.t - t0)), h("td", {}, e.worker || "–"),
      h("td", {}, e.rank ?? "–"), h("td", {}, e.node ? h("a", { href: `#/node/${encodeURIComponent(e.node)}` }, e.node) : "–"),
      h("td", {}, e.ratio != null ? `${e.ratio.toFixed(2)}x` : "–"), h("td", {}, e.since_step ?? "–"),
      h("td", {}, e.policy || "report"))));
}

function sparesTable(j, t0) { // apart from the slots held: a spare is no training capacity
  const waiting = [...j.spares.entries()].map(([w, s]) => h("tr", { class: "waiting" },
    h("td", {}, fmtS(s.t - t0)), h("td", {}, w), h("td", {}, s.node || "–"),
    h("td", {}, s.ready !== null ? `warm (ready in ${fmtS(s.ready - s.t)})` : "starting"), h("td", {}, "–"), h("td", {}, "–")));
  const promoted = j.promotions.slice(-30).reverse().map((e) => h("tr", { class: "promoted" },
    h("td", {}, fmtS(e.t - t0)), h("td", {}, e.worker), h("td", {}, e.node || "–"),
    h("td", {}, `in epoch ${e.epoch}`), h("td", {}, e.replacing || "–"),
    h("td", {}, e.seconds != null ? `${e.seconds.toFixed(2)} s` : "–")));
  return h("table", { class: "table", id: "spares" },
    h("tr", {}, h("th", {}, "since"), h("th", {}, "worker"), h("th", {}, "node"), h("th", {}, "state"),
      h("th", {}, "replacing"), h("th", {}, "loss to epoch")), waiting, promoted);
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

function sickIntervals(n, end) { // [from, to] while the node was unhealthy or suspect
  const out = [];
  let from = null;
  for (const x of n.history) {
    const sick = x.state === "unhealthy" || x.state === "suspect";
    if (sick && from === null) from = x.t;
    else if (!sick && from !== null) { out.push([from, x.t]); from = null; }
  }
  if (from !== null) out.push([from, end]);
  return out;
}

function healthSection(n, t0) {
  const sec = h("div", { id: "health" });
  if (n.health) {
    const r = n.health;
    sec.append(h("p", { class: r.ok ? "" : "bad" },
      `Latest health probe (${r.probe}, ${r.seconds ?? "–"} s) at ${fmtS(r.t - t0)}: `,
      h("b", {}, r.ok ? "ok" : "FAILED"), r.detail ? ` — ${r.detail}` : ""));
  }
  if (n.suspect && !n.suspect.cleared) {
    const s = n.suspect;
    sec.append(h("p", { class: "bad" }, `Suspect since ${fmtS(s.t - t0)}` +
      (s.until !== null ? ` (avoided until ${fmtS(s.until - t0)} unless a probe passes first)` : "") +
      `: ${s.reason}`));
  } else if (n.suspect) {
    sec.append(h("p", {}, `Was suspect from ${fmtS(n.suspect.t - t0)} (${n.suspect.reason}); cleared at ` +
      `${fmtS(n.suspect.cleared - t0)}: ${n.suspect.why}`));
  }
  const failed = n.probes.filter((r) => !r.ok);
  if (failed.length) {
    sec.append(h("table", { class: "table", id: "probes" },
      h("tr", {}, h("th", {}, "at"), h("th", {}, "probe"), h("th", {}, "seconds"), h("th", {}, "detail")),
      failed.slice(-50).map((r) => h("tr", {}, h("td", {}, fmtS(r.t - t0)), h("td", {}, r.probe),
        h("td", {}, String(r.seconds ?? "–")), h("td", {}, r.detail)))));
  }
  return sec;
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
  if (n.slow.length) sec.append(h("h3", {}, `Slow ranks found here (${n.slow.length})`), slowTable(n.slow, t0));
  if (n.health || n.suspect) sec.append(h("h3", {}, "Health"), healthSection(n, t0));
  sec.append(h("h3", {}, "Events"), eventList(n.events, t0));
  return sec;
}

