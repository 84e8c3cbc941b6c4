"""The HTML of the advisory-lock page: one self-contained document, no build step, no CDN.

It polls ``api/locks`` (relative to itself, so any ``[api] base_url`` works), renders
the same entries as ``airflow-pglock locks --output json`` (each pool of slots as one row:
"2 of 3 held" and its holders, slot by slot) and links each Airflow holder
to its DAG run (``run_url``, from the server) in the Airflow UI (``target=_top``: the page
runs inside the UI's iframe).
Every value is inserted with ``textContent``: nothing from the database is parsed as HTML.
"""

from __future__ import annotations

import html
import json

_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Advisory locks - airflow-pglock</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  :root { color-scheme: light dark; --line: #d0d7de; --muted: #57606a; --warn: #9a6700; --bad: #cf222e; }
  body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 16px; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .meta { color: var(--muted); margin-bottom: 12px; }
  form { display: flex; gap: 12px; align-items: end; flex-wrap: wrap; margin-bottom: 12px; }
  label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); }
  input, select { font: inherit; padding: 3px 6px; }
  table { border-collapse: collapse; width: 100%; }
  th, td { border-bottom: 1px solid var(--line); padding: 6px 8px; text-align: left; vertical-align: top; }
  th { font-size: 12px; text-transform: uppercase; color: var(--muted); }
  td.num, .numbers { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
  .numbers, .sub { color: var(--muted); display: block; }
  .waiting { color: var(--warn); font-weight: 600; }
  .holding { font-weight: 600; }
  .collision { color: var(--bad); font-weight: 600; }
  .slot { display: block; }
  #error { color: var(--bad); font-weight: 600; white-space: pre-wrap; }
  #empty { color: var(--muted); padding: 12px 0; }
</style>
</head>
<body data-conn-ids='__CONN_IDS__' data-refresh="__REFRESH__">
<h1>Advisory locks</h1>
<div class="meta" id="meta">loading...</div>
<form id="filters" onsubmit="return false">
  <label>Connection <select id="conn"></select></label>
  <label>DAG <input id="dag" placeholder="any DAG" size="18"></label>
  <label>Key <input id="key" placeholder="name, int64 or A,B" size="22"></label>
  <label><span><input type="checkbox" id="paused"> pause refresh</span></label>
</form>
<div id="error"></div>
<table id="locks" hidden>
  <thead><tr>
    <th>Key</th><th>State</th><th>Waiters</th><th>Holder (DAG / task / run)</th><th>Deployment @ host</th>
    <th>PID</th><th>Client</th>
    <th>Since</th><th>For</th>
  </tr></thead>
  <tbody></tbody>
</table>
<div id="empty" hidden>No advisory lock is held or awaited.</div>
<script>
(function () {
  "use strict";
  const body = document.body;
  const refreshMs = Number(body.dataset.refresh) * 1000;
  const connIds = JSON.parse(body.dataset.connIds);
  const el = (id) => document.getElementById(id);
  const conn = el("conn");
  connIds.forEach((id) => {
    const o = document.createElement("option");
    o.value = o.textContent = id;
    conn.append(o);
  });
  const params = new URLSearchParams(window.location.search);
  ["dag", "key"].forEach((name) => { if (params.get(name)) el(name).value = params.get(name); });
  if (params.get("conn_id")) conn.value = params.get("conn_id");

  function node(tag, text, cls) {
    const n = document.createElement(tag);
    if (text !== undefined && text !== null) n.textContent = String(text);
    if (cls) n.className = cls;
    return n;
  }
  function duration(s) {
    if (s === null || s === undefined) return "?";
    if (s < 60) return s.toFixed(1) + " s";
    const m = Math.floor(s / 60), sec = Math.floor(s % 60);
    if (m < 60) return m + " min " + sec + " s";
    const h = Math.floor(m / 60);
    if (h < 24) return h + " h " + (m % 60) + " min";
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  }
  function holderCell(e, cell) {
    if (!e.airflow) {
      cell.append(node("span", e.application_name || "(no application_name)"));
      return;
    }
    const a = e.airflow;
    const label = a.dag_id + " / " + a.task_id + (a.map_index >= 0 ? "[" + a.map_index + "]" : "");
    if (e.run_url) {
      const link = node("a", label);
      link.href = e.run_url;
      link.target = "_top";
      link.className = "run-link";
      cell.append(link);
    } else {
      cell.append(node("span", label));
    }
    cell.append(node("span", a.run_id, "sub"));
  }
  function where(e) {
    if (!e.host) return "-";
    return !e.deployment || e.deployment === e.host ? e.host : e.deployment + " @ " + e.host;
  }
  function poolRow(p) {
    const tr = node("tr");
    tr.className = "pool";
    tr.dataset.pool = p.name;
    const key = node("td");
    key.append(node("span", p.name, "keyname"));
    key.append(node("span", "pool of " + p.slots + " slots", "sub"));
    tr.append(key);
    tr.append(node("td", p.summary, "holding"));
    const behind = (w) => (w.blocked_by.length ? " behind " + w.blocked_by.join(",") : "");
    const waiters = p.waiting.map((w) => "pid " + w.pid + behind(w));
    tr.append(node("td", waiters.length ? waiters.length + " waiting (" + waiters.join(", ") + ")" : "-", "num"));
    const holders = node("td");
    p.holders.forEach((h) => {
      const line = node("span", null, "slot");
      line.append(node("span", "slot " + h.slot + ": "));
      holderCell(h, line);
      holders.append(line);
    });
    tr.append(holders);
    tr.append(node("td", [...new Set(p.holders.map(where))].join("; ") || "-"));
    tr.append(node("td", p.holders.map((h) => h.pid).join(", "), "num"));
    const clients = new Set(p.holders.map((h) => h.client));
    tr.append(node("td", [...clients].join(", "), "num"));
    const dated = p.holders.filter((h) => h.since);
    const oldest = dated.reduce((a, b) => (a && a.since <= b.since ? a : b), null);
    tr.append(node("td", oldest ? oldest.since.replace("T", " ").slice(0, 19) : "-", "num"));
    tr.append(node("td", oldest ? duration(oldest.seconds) : "-", "num"));
    return tr;
  }
  function scopeRow(s) {
    const tr = node("tr");
    tr.className = "scope";
    const key = node("td");
    key.append(node("span", s.key.name || "(name unknown)", "keyname"));
    key.append(node("span", s.deferred ? "deferred task (the triggerer holds it; a lease row between processes)"
                                       : "lock scope (a lease row between its tasks)", "sub"));
    key.append(node("span", s.key.numbers.join(", "), "numbers"));
    tr.append(key);
    tr.append(node("td", s.deferred ? "deferred: held by the triggerer"
                                    : s.task_now ? "scope: task running" : "scope: between tasks", "holding"));
    tr.append(node("td", "-", "num"));
    const holder = node("td");
    holder.append(node("span", s.run));
    holder.append(node("span", s.deferred ? "deferred: " + s.task_now
                                          : s.task_now ? "running now: " + s.task_now : "no task running now", "sub"));
    tr.append(holder);
    tr.append(node("td", "-", "where"));
    tr.append(node("td", "-", "num"));
    tr.append(node("td", "-", "num"));
    tr.append(node("td", "lease until " + s.lease_until.replace("T", " ").slice(0, 19), "num"));
    tr.append(node("td", s.fencing_token === null ? "-" : "token " + s.fencing_token, "num"));
    return tr;
  }
  function slotId(e) {
    const c = e.key.pg_locks;
    return e.database + " " + e.pid + " " + c.classid + " " + c.objid + " " + c.objsubid + " " + e.state;
  }
  function row(e) {
    const tr = node("tr");
    tr.dataset.pid = e.pid;
    const key = node("td");
    const name = e.key.names.length ? e.key.names.join(" | ") : "(name unknown)";
    key.append(node("span", name, e.key.collision ? "collision" : "keyname"));
    if (!e.key.names.length && e.key.name_unknown_reason) {
      key.append(node("span", e.key.name_unknown_reason, "sub name-unknown"));
    }
    if (e.key.collision) key.append(node("span", "COLLISION: these names share one lock", "sub collision"));
    key.append(node("span", (e.key.kind === "pair" ? "pair " : "") + e.key.numbers.join(", "), "numbers"));
    tr.append(key);
    tr.append(node("td", e.state + (e.mode === "shared" ? " (shared)" : ""), e.state));
    const queue = e.blocked_by.length ? "behind " + e.blocked_by.join(", ") : "-";
    tr.append(node("td", e.state === "holding" ? e.waiters : queue, "num"));
    const holder = node("td");
    holderCell(e, holder);
    tr.append(holder);
    tr.append(node("td", where(e), "where"));
    tr.append(node("td", e.pid === null ? "prepared xact" : e.pid, "num"));
    tr.append(node("td", e.client, "num"));
    const approximate = e.since_basis && e.since_basis.startsWith("session start") ? "~" : "";
    const since = node("td", e.since ? approximate + e.since.replace("T", " ").slice(0, 19) : "?", "num");
    if (e.since_basis) since.title = e.since_basis;
    tr.append(since);
    tr.append(node("td", duration(e.seconds), "num"));
    return tr;
  }
  async function refresh() {
    const query = new URLSearchParams();
    if (conn.value) query.set("conn_id", conn.value);
    if (el("dag").value.trim()) query.set("dag", el("dag").value.trim());
    if (el("key").value.trim()) query.set("key", el("key").value.trim());
    try {
      const response = await fetch("api/locks?" + query.toString(), {
        credentials: "same-origin",
        headers: { Accept: "application/json" },
      });
      const text = await response.text();
      let data;
      try { data = JSON.parse(text); } catch (_) { data = { detail: text.slice(0, 200) }; }
      if (!response.ok) throw new Error(data.detail || response.statusText);
      el("error").textContent = data.warning || "";
      const tbody = el("locks").querySelector("tbody");
      const pools = data.pools || [];
      const pooled = new Set(pools.flatMap((p) => [...p.holders, ...p.waiting].map(slotId)));
      const rest = data.locks.filter((e) => !pooled.has(slotId(e)));  // a pool's sessions: in its row
      const scopes = data.scopes || [];
      tbody.replaceChildren(...scopes.map(scopeRow), ...pools.map(poolRow), ...rest.map(row));
      el("locks").hidden = data.locks.length === 0 && scopes.length === 0;
      el("empty").hidden = data.locks.length !== 0 || scopes.length !== 0;
      el("meta").textContent = data.locks.length + " session(s) holding or awaiting an advisory lock in " +
        data.server + " - key-name registry: " + data.registry + " - updated " +
        new Date().toLocaleTimeString() + " (every " + refreshMs / 1000 + " s)";
    } catch (err) {
      // Rows from an earlier read may be gone by now (a stopped server holds nothing): none stay up.
      el("locks").querySelector("tbody").replaceChildren();
      el("locks").hidden = true;
      el("empty").hidden = true;
      el("meta").textContent = "No current data: the last read failed at " + new Date().toLocaleTimeString();
      el("error").textContent = "Could not read the locks: " + err.message;
    }
  }
  ["dag", "key"].forEach((name) => el(name).addEventListener("change", refresh));
  conn.addEventListener("change", refresh);
  refresh();
  setInterval(() => { if (!el("paused").checked && !document.hidden) refresh(); }, refreshMs);
})();
</script>
</body>
</html>
"""


def render_page(*, conn_ids: list[str], refresh_seconds: int) -> str:
    """The page, with the selectable connections and the refresh period.

    :param conn_ids: the connections the page may read (the first is the default).
    :param refresh_seconds: seconds between two refreshes.
    """
    return _TEMPLATE.replace("__CONN_IDS__", html.escape(json.dumps(conn_ids), quote=True)).replace(
        "__REFRESH__", str(int(refresh_seconds))
    )
