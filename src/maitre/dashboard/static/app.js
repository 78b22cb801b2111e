// maitre's dashboard: every view is built from the coordinator's event log alone
// (GET /v1/events, then /v1/events/stream while live), so a replay of a run shows what its
// live page showed. No library: the views are SVG and one canvas.
"use strict";


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
    m.stragglers.length ? h("div", { class: "stat", id: "stat-stragglers" }, h("b", {}, m.stragglers.length),
      " slow rank(s) found") : null,
    h("div", { class: "stat recoveries" }, last.length ? ["last recoveries: ", ...last.map((r) =>
      h("a", { href: `#/job/${encodeURIComponent(r.job)}` }, `${r.job} ${fmtS(r.to_next_step_s)}`))] :
      "no recoveries"));
}

// ---------------------------------------------------------------------------------------------

window.addEventListener("error", (e) => window.__maitre.errors.push(String(e.message)));
window.addEventListener("hashchange", route);
window.addEventListener("resize", schedule);
document.addEventListener("DOMContentLoaded", () => {
  route();
  load();
});
