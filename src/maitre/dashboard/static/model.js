// maitre's dashboard: the model, the cluster as the events up to a time describe it. The page
// folds the event log into it (Model.apply), live or replayed alike.
"use strict";

const STATES = ["PENDING", "ADMITTED", "RENDEZVOUS", "RUNNING", "RESIZING", "SUSPENDING",
  "SUSPENDED", "COMPLETED", "FAILED", "CANCELLED"];
const ENDED = new Set(["COMPLETED", "FAILED", "CANCELLED"]);

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
    this.stragglers = [];
    this.heldSlots = 0;
    this.contrib = new Map(); // node -> what it adds to the capacity totals
    this.totals = { od: 0, spot: 0, rate: 0 };
    this.maxOnDemandPrice = null;
  }

  node(name) {
    let n = this.nodes.get(name);
    if (!n) {
      n = { name, slots: 0, labels: {}, price: null, state: "up", history: [], open: new Map(),
            segments: [], events: [], notice: null, slow: [], health: null, probes: [],
            suspect: null };
      this.nodes.set(name, n);
    }
    return n;
  }

  job(id) {
    let j = this.jobs.get(id);
    if (!j) {
      j = { id, queue: "", priority: null, state: "PENDING", states: [], placement: {},
            replicas: [], epochs: [], recoveries: [], checkpoints: [], restores: [],
            progress: [], events: [], caughtUp: [], stragglers: [], submitted: null, cost: 0,
            spares: new Map(), promotions: [], // warm spares waiting (worker -> {node, t, ready}); promoted ones
            odCost: 0,
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
      case "node_suspect": {
        const n = this.node(e.node);
        n.suspect = { t, reason: e.reason || "", until: e.until ?? null, job: e.job, worker: e.worker };
        if (n.state === "up") { n.state = "suspect"; n.history.push({ t, state: "suspect" }); }
        break;
      }
      case "node_cleared": {
        const n = this.node(e.node);
        if (n.suspect) n.suspect = { ...n.suspect, cleared: t, why: e.reason || "" };
        if (n.state === "suspect") { n.state = "up"; n.history.push({ t, state: "up" }); }
        break;
      }
      case "node_health": { // a probe's result: a failing one drains the node until one passes
        const n = this.node(e.node);
        n.health = { t, ok: !!e.ok, detail: e.detail || "", probe: e.probe || "", seconds: e.seconds };
        n.probes.push(n.health);
        if (!e.ok && (n.state === "up" || n.state === "suspect")) {
          n.state = "unhealthy"; n.history.push({ t, state: "unhealthy" });
        } else if (e.ok && n.state === "unhealthy") {
          n.state = n.suspect && !n.suspect.cleared ? "suspect" : "up";
          n.history.push({ t, state: n.state });
        }
        break;
      }
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
      // Warm spares (issue 15): started on slots no allocation holds, so apart from the
      // placement; one that takes a lost worker's place moves the placement (spare_assigned).
      case "spare_started": j.spares.set(e.worker, { node: e.node, t, ready: null }); break;
      case "spare_ready": { const s = j.spares.get(e.worker); if (s) s.ready = t; break; }
      case "spare_assigned":
        j.spares.delete(e.worker);
        if (e.placement) this.place(j, e.placement, t);
        break;
      case "spare_promoted": j.promotions.push(e); break;
      case "spare_released": j.spares.delete(e.worker); break;
      case "worker_dead": if (e.spare) j.spares.delete(e.worker); break;
      case "straggler": { // a slow rank, as its job's rank 0 found it (issue 15: report)
        j.stragglers.push(e);
        if (e.node) this.node(e.node).slow.push(e);
        this.stragglers.push(e);
        break;
      }
      case "job_suspended":
        this.place(j, {}, t); j.spares.clear(); this.move(j, "SUSPENDED", t, "checkpointed and stopped"); break;
      case "job_completed": case "completed":
        this.place(j, {}, t); j.spares.clear(); this.move(j, "COMPLETED", t, e.reason || ""); break;
      case "job_failed": case "failed":
        this.place(j, {}, t); j.spares.clear(); this.move(j, "FAILED", t, e.reason || e.failure || ""); break;
      case "job_cancelled": case "cancelled":
        this.place(j, {}, t); j.spares.clear(); this.move(j, "CANCELLED", t, "cancelled"); break;
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

