// The mqlog console: polls /api/v1/console and redraws. Plain JavaScript, no library.
// Every text that comes from the broker (client ids, topic filters) is set through
// textContent, never as HTML: client ids are chosen by clients.
"use strict";

// Resolved against the origin, not the document: a page opened as http://user:pw@host/
// has a URL with credentials, and fetch() refuses a URL that carries them. The browser
// sends the credentials it was given for the page along with the request anyway.
const SOURCE = new URL("/api/v1/console", window.location.origin).href;
const SVG = "http://www.w3.org/2000/svg";
let intervalMs = 2000;

const $ = (id) => document.getElementById(id);

function count(n) {
  return Math.round(n).toLocaleString("en-US");
}

function rate(n) {
  if (n === 0) return "0";
  if (n >= 100) return count(n);
  if (n >= 10) return n.toFixed(1);
  return n.toFixed(2);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i === 0 ? String(n) : n.toFixed(1)) + " " + units[i];
}

function duration(seconds) {
  seconds = Math.floor(seconds);
  const d = Math.floor(seconds / 86400), h = Math.floor(seconds / 3600) % 24;
  const m = Math.floor(seconds / 60) % 60, s = seconds % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return s ? `${m}m ${s}s` : `${m}m`;
  return `${s}s`;
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tableId, items, columns, emptyText) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren();
  if (items.length === 0) {
    const row = body.insertRow();
    row.className = "empty";
    cell(row, emptyText).colSpan = columns;
    return body;
  }
  return body;
}

function lags(td, positions) {
  if (positions.length === 0) { td.textContent = "–"; return; }
  for (const p of positions) {
    const span = document.createElement("span");
    span.className = p.lag > 0 ? "lag behind" : "lag";
    const who = p.consumer && p.consumer !== "main" ? ` (${p.consumer})` : "";
    span.textContent = `${p.stream}/${p.partition}: ${count(p.lag)}${who}`;
    span.title = `offset ${p.offset}, high-water mark ${p.high_water_mark}`;
    td.appendChild(span);
  }
}

function drawCards(doc) {
  const t = doc.throughput, b = doc.broker;
  $("rate-received").textContent = rate(t.received);
  $("rate-sent").textContent = rate(t.sent);
  $("rate-stored").textContent = rate(t.stored);
  $("messages-received").textContent = count(b.messages_received);
  $("messages-sent").textContent = count(b.messages_sent);
  $("disk-log").textContent = bytes(doc.disk.log_bytes);
  $("disk-free").textContent = doc.disk.free_bytes === null ? "" : `${bytes(doc.disk.free_bytes)} free`;
  $("uptime").textContent = duration(b.uptime_seconds);
  $("workers").textContent = doc.workers === 1 ? "1 worker" : `${doc.workers_up} of ${doc.workers} workers up`;
}

function drawConnections(doc) {
  const b = doc.broker;
  const dropped = Object.entries(b.dropped).map(([k, v]) => `${k} ${count(v)}`).join(", ");
  const rows = [
    ["open connections", count(b.connections)],
    ["clients connected", count(b.clients_connected)],
    ["connections accepted (total)", count(b.connections_opened)],
    ["sessions (connected and offline)", count(b.sessions)],
    ["subscriptions", count(b.subscriptions)],
    ["bytes in /s · out /s", `${bytes(doc.throughput.bytes_received)} · ${bytes(doc.throughput.bytes_sent)}`],
    ["refused logins", count(b.auth_failures)],
    ["messages dropped", dropped || "0"],
    ["fsyncs", `${count(b.fsyncs)} (${(b.fsyncs ? (1000 * b.fsync_seconds) / b.fsyncs : 0).toFixed(2)} ms mean)`],
  ];
  const body = $("connections").tBodies[0];
  body.replaceChildren();
  for (const [k, v] of rows) {
    const row = body.insertRow();
    cell(row, k);
    cell(row, v, "num");
  }
}

function drawStreams(doc) {
  const body = $("streams").tBodies[0];
  body.replaceChildren();
  for (const s of doc.streams) {
    s.partitions.forEach((p, i) => {
      const row = body.insertRow();
      if (s.internal) row.className = "internal";
      const name = cell(row, i === 0 ? s.name : "");
      if (i === 0) name.title = s.topic_filters.join(", ");
      cell(row, String(p.partition));
      cell(row, count(p.earliest_offset), "num");
      cell(row, count(p.high_water_mark), "num").dataset.key = `${s.name}/${p.partition}`;
      cell(row, rate(p.records_per_s), "num");
      cell(row, count(p.segments), "num");
      cell(row, bytes(p.disk_bytes), "num");
    });
  }
}

function listed(id, shown, total) {
  $(id).textContent = total > shown ? `${shown} of ${count(total)}, furthest behind first` : "";
}

function drawSessions(doc) {
  listed("sessions-listed", doc.sessions.length, doc.sessions_total);
  const body = fill("sessions", doc.sessions, 5, "no persistent session");
  for (const s of doc.sessions) {
    const row = body.insertRow();
    cell(row, s.client_id);
    cell(row, s.connected ? "connected" : "offline", s.connected ? "on" : "off");
    cell(row, s.subscriptions.map((x) => `${x.filter} (QoS ${x.qos})`).join(", ") || "–");
    cell(row, count(s.inflight), "num");
    lags(cell(row, ""), s.positions);
  }
}

function drawGroups(doc) {
  listed("groups-listed", doc.shared_groups.length, doc.shared_groups_total);
  const body = fill("groups", doc.shared_groups, 4, "no shared subscription");
  for (const g of doc.shared_groups) {
    const row = body.insertRow();
    cell(row, g.group);
    cell(row, g.filter);
    cell(row, g.members.length ? g.members.join(", ") : "none");
    lags(cell(row, ""), g.positions);
  }
}

function drawCluster(doc) {
  const c = doc.cluster;
  $("cluster-mode").textContent = c.mode;
  const single = c.nodes.length === 0;
  $("cluster-note").textContent = single
    ? "This broker is a single node: no [cluster] section, so every partition is led here and has no follower."
    : `node ${c.node_id} · ${c.nodes.length} nodes`;
  $("cluster-nodes").hidden = single;
  $("cluster-partitions").hidden = single;
  if (single) return;
  const nodes = $("cluster-nodes").tBodies[0];
  nodes.replaceChildren();
  for (const n of c.nodes) {
    const row = nodes.insertRow();
    cell(row, String(n.id));
    cell(row, n.address || "");
    cell(row, n.state || "");
  }
  const parts = $("cluster-partitions").tBodies[0];
  parts.replaceChildren();
  for (const p of c.partitions) {
    const row = parts.insertRow();
    cell(row, `${p.stream}/${p.partition}`);
    cell(row, String(p.leader ?? "none"));
    cell(row, String(p.term ?? ""), "num");
    cell(row, count(p.commit_index ?? 0), "num");
    cell(
      row,
      p.replica === false
        ? `remote (replicas ${(p.replicas || []).join(", ")})`
        : (p.followers || []).map((f) => `${f.node} (${count(f.lag)})`).join(", "),
    );
  }
}

function drawChart(history) {
  const svg = $("chart");
  const w = Math.max(300, svg.clientWidth || 900), h = 220;
  const left = 56, right = 8, top = 10, bottom = 22;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const span = historySpan(history);
  $("chart-span").textContent = `last ${duration(span)}`;
  // Stored first: it often equals received, and received is drawn over it.
  const series = ["stored", "sent", "received"];
  let max = 1;
  for (const name of series) for (const v of history[name]) max = Math.max(max, v);
  const x = (t) => left + ((t + span) / span) * (w - left - right);
  const y = (v) => top + (1 - v / max) * (h - top - bottom);
  const line = (tag, attrs) => {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    svg.appendChild(el);
    return el;
  };
  for (let i = 0; i <= 4; i += 1) {
    const v = (max * i) / 4;
    line("line", { class: "grid", x1: left, x2: w - right, y1: y(v), y2: y(v) });
    line("text", { class: "axis", x: left - 6, y: y(v) + 4, "text-anchor": "end" }).textContent = rate(v);
  }
  for (let i = 0; i <= 5; i += 1) {
    const t = -span + (span * i) / 5;
    line("text", { class: "axis", x: x(t), y: h - 6, "text-anchor": i === 0 ? "start" : i === 5 ? "end" : "middle" })
      .textContent = i === 5 ? "now" : `-${duration(-t)}`;
  }
  for (const name of series) {
    const points = history.t.map((t, i) => `${x(t).toFixed(1)},${y(history[name][i]).toFixed(1)}`);
    line("polyline", { class: name, points: points.join(" ") });
  }
}

function historySpan(history) {
  // The whole window the broker keeps once full; until then the span sampled so far.
  const sampled = history.t.length ? -history.t[0] + history.interval : history.interval;
  return Math.max(60, Math.min(sampled, 600));
}

function draw(doc) {
  intervalMs = doc.history.interval * 1000;
  $("interval").textContent = String(doc.history.interval);
  drawCards(doc);
  drawChart(doc.history);
  drawConnections(doc);
  drawStreams(doc);
  drawSessions(doc);
  drawGroups(doc);
  drawCluster(doc);
  $("updated").textContent = `updated ${new Date(doc.time * 1000).toLocaleTimeString()}`;
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  const status = $("status");
  try {
    const response = await fetch(SOURCE, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`/api/v1/console: HTTP ${response.status}`);
    draw(await response.json());
    status.textContent = "live";
    status.className = "status ok";
  } catch (error) {
    status.textContent = `no answer: ${error.message}`;
    status.className = "status error";
  }
  setTimeout(poll, intervalMs);
}

poll();
