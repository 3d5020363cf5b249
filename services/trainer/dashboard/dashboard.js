// sparsecast dashboard: polls the trainer's REST API and draws hand-written SVG charts.
// No build step and no dependencies; URLs are relative so the page also works behind a path prefix.
"use strict";

const POLL_MS = 2000;
const VERSIONS_EVERY_MS = 6000; // versions change once per step; the list is re-read less often
const COLORS = ["#2f6fdf", "#e07b24", "#2a9d5c", "#b4457f", "#7b61c9", "#8a8f24"];

const state = {
  history: [],          // /v1/metrics/history rows, by step
  versions: [],         // /v1/versions rows
  status: null,
  throughput: [],       // /v1/metrics/throughput samples: {time, workers: {id: tokens/s}}, server-sampled
  leases: null,         // /v1/leases: {lease_ttl_s, leases, dead_letters}
  versionsAt: 0,
  versionSeen: null,
};

// -- formatting --

const $ = (id) => document.getElementById(id);
const isNum = (x) => typeof x === "number" && Number.isFinite(x);
const pct = (x, d = 1) => (isNum(x) ? `${(100 * x).toFixed(d)}%` : "-");
const fix = (x, d = 3) => (isNum(x) ? x.toFixed(d) : "-");

function bytes(n) {
  if (!isNum(n)) return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return i === 0 ? `${n.toFixed(0)} B` : `${n.toFixed(n < 10 ? 2 : 1)} ${units[i]}`;
}

function ago(seconds) {
  if (!isNum(seconds)) return "-";
  if (seconds < 60) return `${Math.max(0, seconds).toFixed(0)} s ago`;
  return `${(seconds / 60).toFixed(0)} min ago`;
}

function el(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- charts --

const BOX = { w: 600, h: 230, left: 58, right: 14, top: 26, bottom: 28 };

function niceTicks(lo, hi, count = 4) {
  if (hi <= lo) hi = lo + 1;
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) ticks.push(+v.toPrecision(12));
  return ticks;
}

// xPad widens the x range on both sides (in x units) so bars at the ends are not cut in half.
function frame(svg, xs, yLo, yHi, fmtY, fmtX, xPad = 0) {
  svg.replaceChildren();
  const { w, h, left, right, top, bottom } = BOX;
  const xMin = Math.min(...xs), xMax = Math.max(...xs);
  const xLo = xMin - xPad, xHi = xMax + xPad;
  const sx = (x) => left + (xHi === xLo ? 0.5 : (x - xLo) / (xHi - xLo)) * (w - left - right);
  const sy = (y) => h - bottom - ((y - yLo) / (yHi - yLo || 1)) * (h - top - bottom);
  for (const t of niceTicks(yLo, yHi)) {
    svg.append(el("line", { class: "grid", x1: left, x2: w - right, y1: sy(t), y2: sy(t) }));
    svg.append(el("text", { x: left - 6, y: sy(t) + 4, "text-anchor": "end" }, fmtY(t)));
  }
  const xTicks = xMax === xMin ? [xMin] : niceTicks(xMin, xMax, 6).filter((t) => Number.isInteger(t));
  for (const t of xTicks) svg.append(el("text", { x: sx(t), y: h - bottom + 16, "text-anchor": "middle" }, fmtX(t)));
  svg.append(el("line", { class: "axis", x1: left, x2: w - right, y1: h - bottom, y2: h - bottom }));
  svg.append(el("line", { class: "axis", x1: left, x2: left, y1: top, y2: h - bottom }));
  return { sx, sy };
}

function legend(svg, names) {
  let x = BOX.left;
  names.forEach(([name, color]) => {
    svg.append(el("rect", { x, y: 8, width: 10, height: 10, fill: color, rx: 2 }));
    const label = el("text", { class: "legend", x: x + 14, y: 17 }, name);
    svg.append(label);
    x += 24 + 7 * name.length;
  });
}

function empty(svg, message) {
  svg.replaceChildren(el("text", { class: "empty", x: BOX.w / 2, y: BOX.h / 2, "text-anchor": "middle" }, message));
}

// series: [{name, color, points: [[x, y], ...]}]; y range from the data unless given.
function lineChart(svg, series, { yMin, yMax, fmtY = (v) => fix(v, 2), fmtX = (v) => String(v), waiting }) {
  const live = series.filter((s) => s.points.length);
  if (!live.length) return empty(svg, waiting || "waiting for the first step…");
  const xs = live.flatMap((s) => s.points.map((p) => p[0]));
  const ys = live.flatMap((s) => s.points.map((p) => p[1]));
  const lo = yMin ?? Math.min(...ys), hi = yMax ?? Math.max(...ys);
  const pad = hi === lo ? Math.abs(hi) * 0.1 || 1 : 0;
  const { sx, sy } = frame(svg, xs, lo - (yMin === undefined ? pad : 0), hi + pad, fmtY, fmtX);
  for (const s of live) {
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svg.append(el("path", { class: "series", d, stroke: s.color, "data-name": s.name }));
    if (s.points.length === 1) {
      const [x, y] = s.points[0];
      svg.append(el("circle", { cx: sx(x), cy: sy(y), r: 3, fill: s.color }));
    }
  }
  legend(svg, live.map((s) => [s.name, s.color]));
}

// bars: [{x, y}] drawn against a zero baseline.
function barChart(svg, bars, { color, fmtY, fmtX = (v) => `v${v}`, waiting }) {
  if (!bars.length) return empty(svg, waiting);
  const xs = bars.map((b) => b.x);
  const hi = Math.max(...bars.map((b) => b.y));
  const { sx, sy } = frame(svg, xs, 0, hi * 1.08 || 1, fmtY, fmtX, 0.6);
  const slot = (BOX.w - BOX.left - BOX.right) / (Math.max(...xs) - Math.min(...xs) + 1.2);
  const width = Math.max(2, Math.min(28, slot * 0.7));
  const d = bars.map((b) => {
    const x = sx(b.x) - width / 2;
    const top = sy(b.y), base = sy(0);
    return `M${x.toFixed(1)},${base.toFixed(1)}V${top.toFixed(1)}H${(x + width).toFixed(1)}V${base.toFixed(1)}Z`;
  }).join("");
  svg.append(el("path", { class: "bars", d, fill: color, "data-name": "patch bytes" }));
}

// -- rendering --

function series(name, key, color, scale = 1) {
  return {
    name, color,
    points: state.history.filter((r) => isNum(r[key])).map((r) => [r.step, r[key] * scale]),
  };
}

function renderCharts() {
  const rows = state.history;
  lineChart($("chart-reward"), [series("reward", "reward_mean", COLORS[0]), series("accuracy", "accuracy", COLORS[1])],
    { yMin: Math.min(0, ...rows.map((r) => r.reward_mean).filter(isNum)), fmtY: (v) => fix(v, 2) });

  const patches = state.versions.filter((v) => isNum(v.patch_bytes));
  const dense = patches.length ? patches[patches.length - 1].dense_bytes : null;
  $("dense-note").textContent = dense ? `(dense weights: ${bytes(dense)})` : "";
  barChart($("chart-patch"), patches.map((v) => ({ x: v.version, y: v.patch_bytes })),
    { color: COLORS[0], fmtY: bytes, waiting: "no patch published yet" });

  const changed = state.versions.filter((v) => isNum(v.changed_fraction)).map((v) => [v.version, v.changed_fraction]);
  lineChart($("chart-changed"), [{ name: "changed", color: COLORS[2], points: changed }],
    { yMin: 0, fmtY: (v) => pct(v, 2), fmtX: (v) => `v${v}`, waiting: "no patch published yet" });

  // Dense-equivalent KV: the sparse peak divided by the share kept (kv_saved = 1 − kept/dense).
  const kvRows = rows.filter((r) => isNum(r.kv_peak_bytes_mean) && r.kv_peak_bytes_mean > 0);
  const policies = [...new Set((state.status?.workers || []).map((w) =>
    w.kv_policy + (w.kv_budget ? `@${w.kv_budget}` : "")))];
  $("kv-note").textContent = policies.length ? `(policies: ${policies.join(", ")})` : "";
  lineChart($("chart-kv"), [
    { name: `sampled (${policies.join(", ") || "workers"})`, color: COLORS[3],
      points: kvRows.map((r) => [r.step, r.kv_peak_bytes_mean]) },
    { name: "dense cache", color: "#9aa1a6",
      points: kvRows.filter((r) => isNum(r.kv_saved) && r.kv_saved < 1)
        .map((r) => [r.step, r.kv_peak_bytes_mean / (1 - r.kv_saved)]) },
  ], { yMin: 0, fmtY: bytes });

  lineChart($("chart-loss"), [series("loss", "loss", COLORS[0]), series("grad norm", "grad_norm", COLORS[1])],
    { fmtY: (v) => fix(v, 3) });
  lineChart($("chart-kl"), [
    series("KL old‖sampler", "kl_old_sampler", COLORS[4]),
    series("KL to reference", "kl_ref", COLORS[5]),
    series("entropy", "entropy", COLORS[2]),
  ], { fmtY: (v) => fix(v, 3) });
  lineChart($("chart-steptime"), [
    series("step", "step_seconds", COLORS[0]),
    series("extract patch", "extract_seconds", COLORS[1]),
    series("train", "train_seconds", COLORS[2]),
    series("upload", "upload_seconds", COLORS[3]),
  ], { yMin: 0, fmtY: (v) => `${fix(v, 1)}s` });

  lineChart($("chart-corrections"), [
    series("rejected sequences", "rejection_rate", COLORS[5]),
    series("masked tokens", "token_mask_rate", COLORS[4]),
    series("PPO clipped", "clip_fraction", COLORS[1]),
  ], { yMin: 0, fmtY: (v) => pct(v, 0) });

  // x: minutes before the newest sample (the server keeps the last hour).
  const samples = state.throughput;
  const tEnd = samples.length ? samples[samples.length - 1].time : 0;
  const ids = [...new Set(samples.flatMap((r) => Object.keys(r.workers)))].sort();
  const workerSeries = ids.map((id, i) => ({
    name: id, color: COLORS[i % COLORS.length],
    points: samples.filter((r) => isNum(r.workers[id])).map((r) => [(r.time - tEnd) / 60, r.workers[id]]),
  }));
  lineChart($("chart-throughput"), workerSeries, {
    yMin: 0, fmtY: (v) => v.toFixed(0), fmtX: (v) => `${v.toFixed(0)} min`, waiting: "no workers registered",
  });
}

function renderHeader() {
  const s = state.status;
  $("run").textContent = s ? `run ${s.run}` : "";
  const badge = $("state");
  badge.textContent = s ? s.state + (s.paused ? " (paused)" : "") : "offline";
  badge.className = `badge ${s ? s.state : "offline"}`;
  if (s) {
    const steps = s.max_steps ? `${s.step}/${s.max_steps}` : `${s.step}`;
    $("progress").textContent = `step ${steps} · version ${s.version ?? "-"}`;
  }
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  // Cards: the big number is the last step's, the line below the mean over the run so far.
  const rows = state.history;
  const last = rows[rows.length - 1] || {};
  const mean = (key) => {
    const xs = rows.map((r) => r[key]).filter(isNum);
    return xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null;
  };
  const card = (id, lastText, meanText) => {
    $(id).textContent = lastText;
    $(`${id}-mean`).textContent = rows.length ? `last step · mean of ${rows.length}: ${meanText}` : "";
  };
  card("kpi-reward", fix(last.reward_mean), fix(mean("reward_mean")));
  card("kpi-accuracy", pct(last.accuracy), pct(mean("accuracy")));
  const patch = (bytesValue, ratio, suffix) => (isNum(ratio) ? `${bytes(bytesValue)} · ${ratio.toFixed(0)}x${suffix}` : "-");
  card("kpi-patch", patch(last.patch_bytes, last.payload_ratio, " smaller"),
    patch(mean("patch_bytes"), mean("payload_ratio"), ""));
  card("kpi-changed", pct(last.changed_fraction, 2), pct(mean("changed_fraction"), 2));
  card("kpi-kv", pct(last.kv_saved), pct(mean("kv_saved")));
  const vetoes = (rejected, masked) => (isNum(rejected) ? `${pct(rejected)} / ${pct(masked)}` : "-");
  card("kpi-corrections", vetoes(last.rejection_rate, last.token_mask_rate),
    vetoes(mean("rejection_rate"), mean("token_mask_rate")));
  card("kpi-step", isNum(last.step_seconds) ? `${fix(last.step_seconds, 1)} s` : "-",
    isNum(mean("step_seconds")) ? `${fix(mean("step_seconds"), 1)} s` : "-");
  // The queue's numbers and the lease table come from the same Redis list, so they agree.
  const q = s?.queue || {};
  $("kpi-queue").textContent = s ? `${q.prompts_queued ?? 0} waiting · ${q.leases_pending ?? 0} leased · `
    + `${q.trajectories_queued ?? 0} results unread · ${q.groups_completed ?? 0} done · `
    + `${q.dead_letter_depth ?? 0} dead` : "-";
  const notes = [];
  if (q.leases_expired) {
    notes.push(`${q.leases_expired} of the waiting are expired or released leases, reclaimed next`);
  }
  const finished = s && s.state === "finished";
  if (finished && q.trajectories_queued) {
    notes.push(`the run finished: ${q.trajectories_queued} results generated in flight will not be trained on`);
  }
  if (finished && q.prompts_queued) notes.push(`${q.prompts_queued} groups were never trained on`);
  $("kpi-queue-note").textContent = notes.join("; ");
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map(({ cells, className }) => {
    const tr = document.createElement("tr");
    if (className) tr.className = className;
    for (const c of cells) {
      const td = document.createElement("td");
      if (c !== null && typeof c === "object") {
        td.textContent = c.text;
        td.className = c.className;
      } else {
        td.textContent = c;
      }
      tr.append(td);
    }
    return tr;
  }));
}

function renderTables() {
  const s = state.status;
  const now = Date.now() / 1000;
  const workers = (s?.workers || []).slice().sort((a, b) => a.worker_id.localeCompare(b.worker_id));
  fillTable("workers", workers.map((w) => {
    const lag = isNum(s.version) ? Math.max(0, s.version - w.weight_version) : null;
    return {
      className: lag > 1 ? "lagging" : "",
      cells: [w.worker_id, w.engine, w.kv_policy + (w.kv_budget ? ` @${w.kv_budget}` : ""), `v${w.weight_version}`,
        lag ?? "-", w.leases_held ?? w.leases, w.tokens_per_s.toFixed(0),
        `${w.download_mbps.toFixed(1)} Mbit/s`, ago(now - w.updated_at)],
    };
  }));
  const table = state.leases?.leases || [];
  const live = table.filter((r) => r.expires_in_s > 0).length;
  $("leases-note").textContent = state.leases ? `(${live} held, ${table.length - live} expired or released; `
    + `a lease lasts ${state.leases.lease_ttl_s} s between heartbeats)` : "";
  fillTable("leases", table.map((r) => ({
    className: r.expires_in_s > 0 ? "" : "expired",
    cells: [r.entry_id, r.holder === "~released" ? "(released)" : r.holder,
      r.expires_in_s > 0 ? `${r.expires_in_s.toFixed(1)} s` : "expired: waits for a claim", r.reclaims],
  })));
  const dead = (state.leases?.dead_letters || []).slice().reverse();
  $("dead-note").textContent = state.leases ? `(${dead.length})` : "";
  fillTable("dead", dead.map((d) => ({
    cells: [d.group_id || d.entry_id, d.worker_id || "-", d.attempts ?? "-",
      { text: d.reason || "-", className: "left" }, ago(now - d.time)],
  })));
  const versions = state.versions.slice(-20).reverse();
  fillTable("versions", versions.map((v) => ({
    cells: [`v${v.version}`, v.base_version == null ? "-" : `v${v.base_version}`, bytes(v.patch_bytes),
      bytes(v.snapshot_bytes), bytes(v.dense_bytes), isNum(v.payload_ratio) ? `${v.payload_ratio.toFixed(0)}x` : "-",
      pct(v.changed_fraction, 2), fix(v.metrics?.reward_mean), pct(v.metrics?.accuracy), ago(now - v.created_at)],
  })));
}

// -- polling --

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${path}: ${response.status} ${detail}`);
  }
  return response.json();
}

async function poll() {
  try {
    const since = state.history.length ? state.history[state.history.length - 1].step : 0;
    const tSince = state.throughput.length ? state.throughput[state.throughput.length - 1].time : 0;
    const [status, history, throughput, leases] = await Promise.all([
      getJSON("v1/status"), getJSON(`v1/metrics/history?since=${since}`),
      getJSON(`v1/metrics/throughput?since=${tSince}`), getJSON("v1/leases").catch(() => null)]);
    state.status = status;
    state.history.push(...history.history.filter((r) => r.step > since));
    state.throughput = state.throughput.concat(throughput.samples).slice(-720);
    state.leases = leases;
    const now = Date.now();
    if (status.version !== state.versionSeen || now - state.versionsAt > VERSIONS_EVERY_MS) {
      state.versions = (await getJSON("v1/versions")).versions.sort((a, b) => a.version - b.version);
      state.versionSeen = status.version;
      state.versionsAt = now;
    }
    const error = status.error ? `trainer: ${status.error}` : "";
    $("error").hidden = !error;
    $("error").textContent = error;
  } catch (err) {
    state.status = null;
    $("error").hidden = false;
    $("error").textContent = `cannot read the trainer's API (${err.message}); retrying every ${POLL_MS / 1000} s`;
  }
  renderHeader();
  renderCharts();
  renderTables();
  setTimeout(poll, POLL_MS);
}

// -- controls --

// Pause and resume are write calls: they need the API token, asked once and kept for this tab.
async function control(action) {
  let token = sessionStorage.getItem("sparsecast-token");
  if (!token) {
    token = window.prompt("API token (SPARSECAST_API_TOKEN) for pause/resume:");
    if (!token) return;
  }
  const headers = { Authorization: `Bearer ${token}` };
  const response = await fetch(`v1/train/${action}`, { method: "POST", headers });
  const notice = $("notice");
  notice.hidden = false;
  if (response.ok) {
    sessionStorage.setItem("sparsecast-token", token);
    const body = await response.json();
    notice.textContent = `training ${body.paused ? "paused" : "resumed"} at step ${body.step}`;
  } else {
    if (response.status === 401) sessionStorage.removeItem("sparsecast-token");
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    notice.textContent = `${action} failed: ${response.status} ${detail}`;
  }
}

$("pause").addEventListener("click", () => control("pause"));
$("resume").addEventListener("click", () => control("resume"));

poll();
