// The dashboard page's code: polls /api, fills the cards and tables, and draws the rate charts as inline SVG.
"use strict";

(function () {
  const REASON_COLORS = { overrule: "#e8871e", policy: "#8e44ad", unparsed: "#7f8c8d", state: "#2980b9", forced: "#a0522d" };
  const SERIES = [
    { key: "forwarded", label: "forwarded (hw)", color: "#2e9d57", get: (p) => p.forwarded },
    { key: "dropped", label: "dropped (hw)", color: "#d2433a", get: (p) => p.dropped },
  ];
  const SVGNS = "http://www.w3.org/2000/svg";
  // The rate chart's scale follows the last RECENT points, so a flood minutes ago does not flatten live traffic;
  // older points above it are drawn at the top edge and marked.
  const RECENT = 30;
  const PAGE = 50; // rule rows per page
  const view = { offset: 0, sort: "index", order: null, q: "" };
  const interval = Math.max(0.2, parseFloat(document.body.dataset.interval) || 1);
  // A token given as ?token= in the page address is passed on as a bearer token (header, not the URL).
  const token = new URLSearchParams(window.location.search).get("token");
  const fmt = new Intl.NumberFormat("en-US");
  const fmtRate = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });

  if (token) {
    for (const a of document.querySelectorAll("footer a")) {
      a.href = a.getAttribute("href") + "?token=" + encodeURIComponent(token);
    }
  }

  async function api(path) {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const res = await fetch(path, { headers, cache: "no-store" });
    if (!res.ok) throw new Error(path + ": HTTP " + res.status);
    return res.json();
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function setNum(id, value, formatter) {
    const e = document.getElementById(id);
    if (!e) return;
    if (value === null || value === undefined) {
      e.dataset.value = "";
      e.textContent = "–";
    } else {
      e.dataset.value = String(value);
      e.textContent = (formatter || fmt).format(value);
    }
  }

  function pct(x) {
    return x === null || x === undefined ? "–" : (100 * x).toFixed(2) + " %";
  }

  function setRatio(id, x) {
    const e = document.getElementById(id);
    e.dataset.value = x === null || x === undefined ? "" : String(x);
    e.textContent = pct(x);
  }

  function renderSummary(s) {
    document.getElementById("generation").textContent = s.generation === null ? "none" : s.generation;
    document.getElementById("updated").textContent = s.time ? new Date(s.time * 1000).toLocaleTimeString() : "–";
    const t = s.totals || {};
    setNum("total-forwarded", t.forwarded);
    setNum("total-dropped", t.dropped);
    setNum("total-shunted", t.shunted);
    setNum("total-mirrored", t.mirrored);
    for (const r of Object.keys(REASON_COLORS)) {
      setNum("total-shunt-" + r, t.shunted_by_reason ? t.shunted_by_reason[r] : null);
    }
    setRatio("ratio-total", t.shunt_ratio);
    const r = s.rates && s.rates.valid ? s.rates : null;
    setNum("rate-forwarded", r ? r.forwarded : null, fmtRate);
    setNum("rate-dropped", r ? r.dropped : null, fmtRate);
    setNum("rate-shunted", r ? r.shunted : null, fmtRate);
    setNum("rate-mirrored", r ? r.mirrored : null, fmtRate);
    for (const reason of Object.keys(REASON_COLORS)) {
      setNum("rate-shunt-" + reason, r ? r.shunted_by_reason[reason] : null, fmtRate);
    }
    setRatio("ratio-interval", r ? r.shunt_ratio : null);
    const errors = document.getElementById("errors");
    errors.hidden = !s.errors.length;
    errors.textContent = s.errors.join(" · ");
  }

  function chart(container, points, lines, yMax, yFmt, w) {
    const h = 220, left = 64, right = 8, top = 8, bottom = 22;
    const svg = document.createElementNS(SVGNS, "svg");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("role", "img");
    svg.dataset.ymax = String(yMax);
    const pw = w - left - right, ph = h - top - bottom;
    const t0 = points.length ? points[0].time : 0;
    const t1 = points.length ? points[points.length - 1].time : 1;
    const span = Math.max(t1 - t0, interval);
    const x = (t) => left + (pw * (t - t0)) / span;
    const y = (v) => top + ph - (ph * Math.min(v, yMax)) / yMax;
    const add = (tag, attrs, text) => {
      const e = document.createElementNS(SVGNS, tag);
      for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
      if (text !== undefined) e.textContent = text;
      svg.appendChild(e);
      return e;
    };
    for (let i = 0; i <= 4; i++) {
      const v = (yMax * i) / 4;
      add("line", { x1: left, x2: w - right, y1: y(v), y2: y(v), class: "gridline" });
      add("text", { x: left - 6, y: y(v) + 4, class: "tick", "text-anchor": "end" }, yFmt(v));
    }
    add("text", { x: left, y: h - 6, class: "tick" }, points.length ? `${Math.round(span)} s` : "no data yet");
    for (const line of lines) {
      const pts = points.filter((p) => p.valid && line.get(p) !== null).map((p) => `${x(p.time).toFixed(1)},${y(line.get(p)).toFixed(1)}`);
      if (pts.length) {
        add("polyline", { points: pts.join(" "), fill: "none", stroke: line.color, "stroke-width": 2, "data-series": line.key });
      }
    }
    // Points above the scale: a marker on the top edge, with the value on hover, and the highest one named.
    let clipped = 0, peak = 0;
    for (const p of points) {
      if (!p.valid) continue;
      for (const line of lines) {
        const v = line.get(p);
        if (v === null || v <= yMax) continue;
        clipped++;
        peak = Math.max(peak, v);
        const m = add("path", { d: `M${x(p.time).toFixed(1)},${top} l-4,7 h8 z`, fill: line.color, class: "clipped" });
        const t = document.createElementNS(SVGNS, "title");
        t.textContent = `${line.label}: ${yFmt(v)} (above the scale)`;
        m.appendChild(t);
      }
    }
    svg.dataset.clipped = String(clipped);
    if (clipped) add("text", { x: w - right, y: top + 18, class: "tick clipnote", "text-anchor": "end" }, `▲ peak ${yFmt(peak)} off scale`);
    container.replaceChildren(svg);
  }

  function niceMax(v) {
    if (v <= 0) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function renderSeries(series) {
    const points = series.points;
    const lines = SERIES.concat(
      series.reasons.map((r) => ({ key: "shunt-" + r, label: "shunted: " + r, color: REASON_COLORS[r], get: (p) => p.shunted_by_reason[r] })),
    );
    let max = 0;
    for (const p of points.slice(-RECENT)) if (p.valid) for (const l of lines) max = Math.max(max, l.get(p));
    const yMax = niceMax(max);
    const tick = yMax < 10 ? (v) => v.toFixed(2) : (v) => fmtRate.format(v);
    chart(document.getElementById("chart-rates"), points, lines, yMax, tick, 640);
    chart(
      document.getElementById("chart-ratio"),
      points,
      [{ key: "ratio", label: "shunt ratio", color: "#e8871e", get: (p) => p.shunt_ratio }],
      1,
      (v) => Math.round(v * 100) + "%",
      320,
    );
    const legend = document.getElementById("legend-rates");
    if (!legend.childElementCount) {
      for (const l of lines) {
        const item = el("span", { class: "key" }, l.label);
        item.style.setProperty("--c", l.color);
        legend.appendChild(item);
      }
    }
  }

  function rulesPath() {
    const q = new URLSearchParams({ offset: view.offset, limit: PAGE, sort: view.sort });
    if (view.order) q.set("order", view.order);
    if (view.q) q.set("q", view.q);
    return "api/rules?" + q.toString();
  }

  function renderRules(v) {
    const body = document.querySelector("#rules tbody");
    const maxHits = Math.max(1, v.max_hits); // over all rules, so bars compare across pages
    const rows = v.rules.map((r) => {
      const tr = el("tr", { "data-rule": r.index, "data-id": r.id, class: r.kind });
      tr.appendChild(el("td", { class: "num" }, r.index));
      tr.appendChild(el("td", { class: "where", title: "id " + r.id }, r.where));
      tr.appendChild(el("td", { class: "text" }, r.text));
      tr.appendChild(el("td", { class: "kind" }, r.kind));
      tr.appendChild(el("td", { class: "entry num" }, r.entry === null ? "–" : r.entry));
      tr.appendChild(el("td", { class: "shunting" }, r.shunting === null ? "–" : r.shunting ? "yes" : "no"));
      tr.appendChild(el("td", { class: "num hw", "data-value": r.hw_hits }, fmt.format(r.hw_hits)));
      tr.appendChild(el("td", { class: "num nf", "data-value": r.nf_packets }, fmt.format(r.nf_packets)));
      tr.appendChild(el("td", { class: "num hits", "data-value": r.hits }, fmt.format(r.hits)));
      tr.appendChild(el("td", { class: "num rate" }, r.hits_rate === null ? "–" : fmtRate.format(r.hits_rate)));
      const bar = el("td", { class: "bar" });
      const fill = el("span");
      fill.style.width = ((100 * r.hits) / maxHits).toFixed(1) + "%";
      bar.appendChild(fill);
      tr.appendChild(bar);
      return tr;
    });
    body.replaceChildren(...rows);
    const first = v.matched ? v.offset + 1 : 0;
    const pager = document.getElementById("rules-page");
    pager.textContent = `${fmt.format(first)}–${fmt.format(v.offset + v.rules.length)} of ${fmt.format(v.matched)}` + (v.matched !== v.total ? ` (filtered from ${fmt.format(v.total)})` : "");
    pager.dataset.total = String(v.total);
    pager.dataset.matched = String(v.matched);
    document.getElementById("rules-prev").disabled = v.offset <= 0;
    document.getElementById("rules-next").disabled = v.offset + v.rules.length >= v.matched;
    for (const th of document.querySelectorAll("#rules th[data-sort]")) {
      th.classList.toggle("sorted", th.dataset.sort === v.sort);
      th.dataset.order = th.dataset.sort === v.sort ? v.order : "";
    }
    const pe = document.getElementById("policy-entry");
    const p = v.policy_entry;
    pe.querySelector(".entry").textContent = p ? p.entry : "";
    pe.querySelector(".shunting").textContent = p ? (p.shunting ? "yes" : "no") : "";
    pe.querySelector(".hw").textContent = p ? fmt.format(p.hw_hits) : "";
    pe.querySelector(".hw").dataset.value = p ? p.hw_hits : "";
    pe.querySelector(".hits").textContent = p ? p.default : "";
  }

  async function reloadRules() {
    try {
      renderRules(await api(rulesPath()));
    } catch (e) {
      console.error(e);
    }
  }

  document.getElementById("rules-prev").addEventListener("click", () => {
    view.offset = Math.max(0, view.offset - PAGE);
    reloadRules();
  });
  document.getElementById("rules-next").addEventListener("click", () => {
    view.offset += PAGE;
    reloadRules();
  });
  let filterTimer = null;
  document.getElementById("rules-filter").addEventListener("input", (ev) => {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(() => {
      view.q = ev.target.value.trim();
      view.offset = 0;
      reloadRules();
    }, 250);
  });
  for (const th of document.querySelectorAll("#rules th[data-sort]")) {
    th.addEventListener("click", () => {
      const same = view.sort === th.dataset.sort;
      view.sort = th.dataset.sort;
      view.order = same ? (th.dataset.order === "asc" ? "desc" : "asc") : null;
      view.offset = 0;
      reloadRules();
    });
  }

  function renderDrift(s) {
    const banner = document.getElementById("drift");
    const drift = s.drift || [];
    banner.hidden = !drift.length;
    const list = document.getElementById("drift-list");
    list.replaceChildren(...drift.map((d) => el("li", {}, d)));
    document.body.dataset.drift = s.drift === null ? "unknown" : String(drift.length);
  }

  function renderDeployment(d) {
    const dl = document.getElementById("deployment");
    const items = d.deployed
      ? [
          ["generation", d.generation],
          ["policy", d.policy],
          ["policy hash", (d.policy_hash || "").slice(0, 16)],
          ["target", d.target],
          ["shunt mode", d.mode],
          ["strategy", d.strategy],
          ["chain policy", d.default],
          ["chains", `${d.chains} in ${d.netns}`],
          ["rules", `${d.partition.rules} (${d.partition.simple} simple, ${d.partition.complex} complex)`],
          ["hardware entries", `${d.partition.hardware_entries} (+ policy entry), ${d.partition.shunting_entries} shunting`],
        ]
      : [["deployed", "nothing"]];
    dl.replaceChildren();
    for (const [k, v] of items) {
      dl.appendChild(el("dt", {}, k));
      dl.appendChild(el("dd", { "data-key": k }, v === undefined || v === null ? "" : String(v)));
    }
    const body = document.querySelector("#history tbody");
    body.replaceChildren(
      ...d.history
        .slice()
        .reverse()
        .map((u) => {
          const tr = el("tr", { "data-generation": u.generation });
          tr.appendChild(el("td", { class: "num" }, u.generation));
          tr.appendChild(el("td", {}, u.kind));
          tr.appendChild(el("td", {}, u.started ? new Date(u.started * 1000).toLocaleString() : "–"));
          tr.appendChild(el("td", { class: "num duration", "data-value": u.duration }, u.duration.toFixed(2) + " s"));
          tr.appendChild(el("td", { class: u.ok ? "ok" : "failed" }, u.ok ? "ok" : "failed" + (u.error ? ": " + u.error : "")));
          tr.appendChild(el("td", { class: "hash" }, (u.policy_hash || "").slice(0, 12)));
          return tr;
        }),
    );
  }

  function renderFlowsync(f) {
    const state = document.getElementById("flowsync-state");
    if (!f) {
      state.textContent = "nothing deployed";
    } else if (!f.wanted) {
      state.textContent = "not running: " + (f.reason || "not wanted by this deployment");
    } else if (!f.running) {
      state.textContent = "DOWN: the flow cache does not follow conntrack";
    } else {
      state.textContent = "running, pid " + f.pid + (f.last_error ? " · last error: " + f.last_error : "");
    }
    const live = f && f.running ? f : null;
    setNum("fs-offloaded", live ? live.offloaded : null);
    setNum("fs-occupancy", live ? live.occupancy : null);
    for (const c of ["inserts", "deletes", "evictions", "insert_failures", "refreshes"]) {
      setNum("fs-" + c, f && f.counters ? f.counters[c] : null);
    }
    const lag = document.getElementById("fs-lag");
    lag.textContent = live && live.lag_p50_ms !== null ? live.lag_p50_ms + " / " + live.lag_max_ms + " ms" : "–";
  }

  function renderPolicysync(p) {
    const state = document.getElementById("policysync-state");
    const expired = p && p.lease && p.lease.expired ? " · LEASE EXPIRED: the fast path shunts everything" : "";
    if (!p) state.textContent = "nothing deployed";
    else if (!p.running) state.textContent = "DOWN: changes to the live ruleset are not followed" + expired;
    else if (expired) state.textContent = "following, pid " + p.pid + expired;
    else if (p.error) state.textContent = "CANNOT FOLLOW: " + p.error + " · the fast path shunts everything";
    else state.textContent = "following, pid " + p.pid + (p.safe ? " · applying a change (everything to software)" : "");
    const live = p && p.running ? p : null;
    for (const c of ["changes", "applied", "failed", "own"]) setNum("ps-" + c, live ? live[c] : null);
    const lag = (d) => (d && d.n ? d.p50 + " / " + d.p99 + " ms" : "–");
    document.getElementById("ps-lag-safe").textContent = live ? lag(live.lag_safe_ms) : "–";
    document.getElementById("ps-lag-apply").textContent = live ? lag(live.lag_apply_ms) : "–";
    document.getElementById("ps-buffer").textContent = p && p.buffer ? p.buffer.used + " / " + p.buffer.depth : "–";
    document.getElementById("ps-kind").textContent = live && live.last_kind ? live.last_kind : "–";
  }

  function setStatus(cls, text) {
    const s = document.getElementById("status");
    s.className = "badge " + cls;
    s.textContent = text;
  }

  let tick = 0;
  async function refresh() {
    try {
      // Summary, series and rules are fetched together so that the page shows one snapshot at a time.
      const wantDeployment = tick % 5 === 0 || !document.getElementById("deployment").childElementCount;
      const [summary, series, rules, deployment] = await Promise.all([
        api("api/summary"),
        api("api/series?last=300"),
        api(rulesPath()),
        wantDeployment ? api("api/deployment") : null,
      ]);
      if (deployment) renderDeployment(deployment);
      tick++;
      renderSummary(summary);
      renderSeries(series);
      renderRules(rules);
      renderDrift(summary);
      renderFlowsync(summary.flowsync);
      renderPolicysync(summary.policysync);
      document.body.dataset.seq = String(summary.seq);
      document.body.dataset.rulesSeq = String(rules.seq);
      if (!summary.deployed) setStatus("wait", "nothing deployed");
      else if (summary.drift && summary.drift.length) setStatus("bad", "live, drift");
      else if (summary.errors.length) setStatus("bad", "live, with errors");
      else setStatus("live", "live");
    } catch (e) {
      setStatus("bad", "no connection");
      console.error(e);
    } finally {
      setTimeout(refresh, interval * 1000);
    }
  }
  refresh();
})();
