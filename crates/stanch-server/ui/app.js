// stanch status page: reads the controller's API with the tokens typed into it.
//
// Every value from the API reaches the page as a text node or an attribute set
// through the DOM, never as markup, so a label such as `<script>` is shown, not run.
// Tokens live in `tokens` below and nowhere else: not in storage, cookies or URLs.
"use strict";

(() => {
  const RUNGS = ["normal", "failover", "degraded", "static"];
  const RUNG_MEANS = {
    normal: "its primary pool",
    failover: "the next healthy pool",
    degraded: "non-VIP traffic on the fallback model",
    static: "answers from the static FAQ",
  };
  const GROUPS = {
    alert_active: "alerts", alert_resolved: "alerts", alert_ignored: "alerts",
    alert_limit: "alerts",
    transition: "decisions", pool_changed: "decisions", shares_changed: "decisions",
    failback_step: "decisions", failback_aborted: "decisions", flap_pinned: "decisions",
    pin_ended: "decisions", blocked: "decisions", block_skipped: "decisions",
    unblocked: "decisions", configured: "decisions",
    override: "overrides", override_ended: "overrides",
    published: "published",
  };
  const HISTORY_KEPT = 500;
  const POLL_MS = 5000;

  // The page's directory: the API is beside it, behind whatever prefix it has.
  const base = new URL(".", location.href);
  const api = (path) => new URL(path, base).toString();

  const tokens = { read: "", admin: "" };
  const state = {
    status: null,
    skewMs: 0,
    history: [],
    locked: false,
    refreshing: null,
    again: false,
    stream: null,
  };

  const $ = (id) => document.getElementById(id);

  // Builds an element; strings and numbers become text nodes, never markup.
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") el.className = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === undefined || c === null || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  // ---- time ---------------------------------------------------------------

  const serverNow = () => Date.now() + state.skewMs;

  function span(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  function relative(iso) {
    const d = Date.parse(iso) - serverNow();
    return d > 0 ? `in ${span(d)}` : `${span(-d)} ago`;
  }

  function clock(iso) {
    const d = new Date(iso);
    return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
  }

  // A time shown as "42 s ago" (or "in 42 s"), kept current by `tick`, with the
  // exact time in its tooltip.
  function when(iso) {
    return h("time", { datetime: iso, title: clock(iso), "data-rel": "" }, relative(iso));
  }

  function tick() {
    for (const t of document.querySelectorAll("time[data-rel]")) {
      t.textContent = relative(t.getAttribute("datetime"));
    }
    for (const el of document.querySelectorAll("[data-countdown]")) {
      el.textContent = span(Date.parse(el.getAttribute("data-countdown")) - serverNow());
    }
  }

  // ---- API ----------------------------------------------------------------

  class Refused extends Error {}

  async function problem(r) {
    try {
      const body = await r.json();
      return `${r.status}: ${body.detail || body.error}`;
    } catch {
      return `${r.status} ${r.statusText}`;
    }
  }

  function auth(role) {
    const t = tokens[role];
    return t ? { Authorization: `Bearer ${t}` } : {};
  }

  async function get(path) {
    const r = await fetch(api(path), { headers: auth("read"), cache: "no-store", credentials: "omit" });
    if (r.status === 401) throw new Refused(await problem(r));
    if (!r.ok) throw new Error(await problem(r));
    return r;
  }

  async function admin(path, body) {
    const r = await fetch(api(path), {
      method: "POST",
      headers: { ...auth("admin"), "Content-Type": "application/json" },
      body: JSON.stringify(body),
      cache: "no-store",
      credentials: "omit",
    });
    if (r.ok) return { ok: true, body: await r.json() };
    return { ok: false, status: r.status, text: await problem(r) };
  }

  // ---- refresh --------------------------------------------------------------

  // One refresh at a time; a request during one runs once more after it.
  function refresh() {
    if (state.refreshing) {
      state.again = true;
      return state.refreshing;
    }
    state.refreshing = (async () => {
      try {
        do {
          state.again = false;
          await load();
        } while (state.again);
      } finally {
        state.refreshing = null;
      }
    })();
    return state.refreshing;
  }

  async function load() {
    try {
      const status = await (await get("v1/status")).json();
      state.status = status;
      state.skewMs = Date.parse(status.now) - Date.now();
      await loadHistory();
      unlock();
      render();
    } catch (e) {
      if (e instanceof Refused) lock(e.message);
      else problemBanner(`Cannot read the controller: ${e.message}`);
    }
  }

  async function loadHistory() {
    const newest = state.history.length ? state.history[state.history.length - 1].seq : null;
    const path = newest === null ? "v1/history?limit=300" : `v1/history?after=${newest}&limit=1000`;
    const r = await get(path);
    const entries = await r.json();
    const oldest = Number(r.headers.get("x-stanch-history-oldest"));
    // A restarted controller or a trimmed history starts the list anew.
    if (newest !== null && oldest > newest + 1) state.history = [];
    const all = state.history.concat(entries);
    all.sort((a, b) => a.seq - b.seq);
    state.history = all.slice(-HISTORY_KEPT);
  }

  // ---- the live stream ------------------------------------------------------

  function setLive(s, text) {
    const el = $("live");
    el.dataset.state = s;
    el.textContent = text || s;
  }

  // Follows `/v1/routes/stream` (SSE read with fetch, so the token can go in a
  // header) and refreshes on every version. Silence past two heartbeats is a dead
  // connection: it is dropped and made anew.
  async function follow() {
    let backoff = 500;
    for (;;) {
      if (state.locked) {
        await new Promise((resolve) => { state.wake = resolve; });
        continue;
      }
      const abort = new AbortController();
      state.stream = abort;
      let watchdog;
      try {
        const r = await fetch(api("v1/routes/stream"), {
          headers: auth("read"), cache: "no-store", credentials: "omit", signal: abort.signal,
        });
        if (r.status === 401) throw new Refused(await problem(r));
        if (!r.ok) throw new Error(await problem(r));
        const silence = 2 * (Number(r.headers.get("x-stanch-heartbeat")) || 15000);
        const arm = () => {
          clearTimeout(watchdog);
          watchdog = setTimeout(() => abort.abort(), silence);
        };
        arm();
        setLive("live");
        backoff = 500;
        const reader = r.body.getReader();
        const decoder = new TextDecoder();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          arm();
          buffer += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const event = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            if (event.split("\n").some((l) => l.startsWith("data:"))) refresh();
          }
        }
      } catch (e) {
        if (e instanceof Refused) {
          lock(e.message);
          continue;
        }
      } finally {
        clearTimeout(watchdog);
      }
      if (state.locked) continue;
      setLive("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, backoff));
      backoff = Math.min(backoff * 2, 10000);
    }
  }

  function restartStream() {
    if (state.stream) state.stream.abort();
    if (state.wake) {
      state.wake();
      state.wake = null;
    }
  }

  // ---- tokens ---------------------------------------------------------------

  function lock(why) {
    const first = !state.locked;
    state.locked = true;
    state.status = null;
    state.history = [];
    setLive("locked", "needs token");
    render();
    banner("info", "A read token is needed.", tokens.read ? `The token was refused (${why}).` : "This controller requires one to show its state.");
    if (first || !$("token-dialog").open) openTokens("Enter the controller's read token to see its state.");
  }

  function unlock() {
    if (!state.locked) return;
    state.locked = false;
    clearBanner();
    restartStream();
  }

  function openTokens(why) {
    $("token-why").textContent = `${why ? `${why} ` : ""}Kept only in this tab's memory: closing or reloading the tab forgets them.`;
    $("read-token").value = tokens.read;
    $("admin-token").value = tokens.admin;
    if (!$("token-dialog").open) $("token-dialog").showModal();
  }

  // ---- banners ----------------------------------------------------------------

  let problemText = "";
  let lockText = null;

  function banner(kind, title, text) {
    lockText = { kind, title, text };
    renderBanners();
  }
  function clearBanner() {
    lockText = null;
    renderBanners();
  }
  function problemBanner(text) {
    problemText = text;
    setLive("error", "unreachable");
    renderBanners();
  }

  function renderBanners() {
    const out = [];
    const s = state.status;
    if (lockText) out.push(h("div", { class: `banner ${lockText.kind}`, role: "alert" }, h("strong", {}, lockText.title), lockText.text));
    if (problemText) out.push(h("div", { class: "banner bad", role: "alert" }, h("strong", {}, "Unreachable."), problemText, " Showing the last state read."));
    if (s) {
      if (s.dry_run) out.push(h("div", { class: "banner warn" }, h("strong", {}, "Dry-run."), `Decisions are reported, not published, since ${clock(s.dry_run.since)}: ${s.dry_run.reason}`, s.dry_run.until ? ` (until ${clock(s.dry_run.until)})` : ""));
      if (s.global_freeze) out.push(h("div", { class: "banner bad" }, h("strong", {}, "Every model is frozen."), `Automation paused since ${clock(s.global_freeze.since)}: ${s.global_freeze.reason}`, s.global_freeze.until ? ` (until ${clock(s.global_freeze.until)})` : ""));
      if (!s.store.healthy) out.push(h("div", { class: "banner bad", role: "alert" }, h("strong", {}, "The state store cannot write."), `Store ${s.store.kind}: decisions are refused until it recovers; gateways keep the last table.`));
      if (s.store.recovered_from_corruption) out.push(h("div", { class: "banner warn" }, h("strong", {}, "State began anew at start."), s.store.recovered_from_corruption));
    }
    $("banners").replaceChildren(...out);
  }

  // ---- rendering ----------------------------------------------------------------

  // Sections are drawn anew only when what they show changed, so a refresh does not
  // take the keyboard focus or an open menu away; times are kept current by `tick`.
  const drawn = new Map();
  function once(section, facts, draw) {
    const key = JSON.stringify(facts);
    if (drawn.get(section) === key) return;
    drawn.set(section, key);
    draw();
  }

  function render() {
    const s = state.status;
    if (s) problemText = "";
    renderBanners();
    renderSummary(s);
    once("models", [state.locked, s && [s.models, s.global_freeze, s.dry_run]], () => renderModels(s));
    once("blocks", [state.locked, s && s.blocked.map((b) => [b.endpoint, b.model, b.until, b.strikes, b.reason, b.source])], () => renderBlocks(s));
    once("gateways", [state.locked, s && [s.version, s.gateways.map((g) => [g.id, g.transport, g.applied_version, g.lag, g.stale, g.converged, g.connected, g.rejected, g.last_seen])]], () => renderGateways(s));
    renderTimeline();
  }

  function gatewayFacts(s) {
    const live = s.gateways.filter((g) => !g.stale);
    return {
      live,
      current: live.filter((g) => g.applied_version === s.version),
      stale: s.gateways.length - live.length,
    };
  }

  function renderSummary(s) {
    const el = $("summary");
    if (!s) {
      el.textContent = state.locked ? "Waiting for the read token." : "Loading…";
      document.title = "stanch";
      return;
    }
    const models = Object.values(s.models);
    const off = models.filter((m) => m.rung !== "normal");
    const parts = [];
    if (off.length === 0) parts.push(`All ${models.length} model${models.length === 1 ? "" : "s"} normal`);
    else parts.push(`${off.length} of ${models.length} model${models.length === 1 ? "" : "s"} degraded`);
    if (s.blocked.length) parts.push(`${s.blocked.length} endpoint${s.blocked.length === 1 ? "" : "s"} blocked`);
    const g = gatewayFacts(s);
    if (g.live.length) parts.push(`gateways ${g.current.length}/${g.live.length} on v${s.version}`);
    if (g.stale) parts.push(`${g.stale} stale`);
    el.textContent = parts.join(" · ");
    document.title = `${off.length ? `⚠ ${off.length} degraded` : "ok"} · stanch`;
  }

  function ladder(m) {
    return h("ol", { class: "ladder", "aria-label": `ladder: ${m.rung}` },
      RUNGS.map((r) => h("li", {
        class: `${r}${m.decided_rung !== m.rung && r === m.decided_rung ? " decided" : ""}`,
        "aria-current": r === m.rung ? "step" : null,
        title: `${r}: ${RUNG_MEANS[r]}${m.decided_rung !== m.rung && r === m.decided_rung ? " (decided, not published: dry-run)" : ""}`,
      }, r)));
  }

  function nextStep(name, m, s) {
    if (m.force) {
      return [`Pinned at ${m.force.rung} by an operator: stays until released`,
        m.force.until ? [" or for ", h("span", { "data-countdown": m.force.until }, span(Date.parse(m.force.until) - serverNow())), " more"] : "", "."];
    }
    const freeze = m.freeze || s.global_freeze;
    if (freeze) {
      return ["Frozen: automation is paused, nothing moves until thawed",
        freeze.until ? [" or for ", h("span", { "data-countdown": freeze.until }, span(Date.parse(freeze.until) - serverNow())), " more"] : "", "."];
    }
    const held = m.pinned ? ` The flap guard holds it at ${m.pinned.rung} or above until ${clock(m.pinned.until)}.` : "";
    if (m.step_down) {
      return [`Steps down to ${m.step_down.to} after `,
        h("span", { "data-countdown": m.step_down.at }, span(Date.parse(m.step_down.at) - serverNow())),
        " more without alerts.", held];
    }
    if (m.rung === "normal" && m.conditions.length === 0) return ["Healthy: nothing to do.", held];
    if (m.conditions.length) {
      return [`Stays at ${m.rung} while ${m.conditions.length === 1 ? "its alert fires" : `its ${m.conditions.length} alerts fire`}; once they resolve, steps down after a ${m.recover_after} window.`, held];
    }
    return [`Recovering: steps down once the ${m.recover_after} window has passed.`, held];
  }

  function labelChips(labels) {
    return h("div", { class: "labels" },
      Object.entries(labels).filter(([k]) => k !== "alertname").map(([k, v]) => h("span", { class: "label" }, `${k}="${v}"`)));
  }

  function renderModels(s) {
    const list = $("model-list");
    if (!s) {
      list.replaceChildren(h("p", { class: "empty" }, state.locked ? "Nothing shown without the read token." : "Loading…"));
      $("global-actions").replaceChildren();
      return;
    }
    const names = Object.keys(s.models).sort();
    // The most degraded first: what needs attention is at the top.
    const order = names.slice().sort((a, b) => RUNGS.indexOf(s.models[b].rung) - RUNGS.indexOf(s.models[a].rung));
    const cards = order.map((name) => {
      const m = s.models[name];
      const badges = [];
      if (m.force) badges.push(h("span", { class: "badge bad", title: m.force.reason }, `forced ${m.force.rung}`));
      if (m.freeze) badges.push(h("span", { class: "badge bad", title: m.freeze.reason }, "frozen"));
      else if (s.global_freeze) badges.push(h("span", { class: "badge bad", title: s.global_freeze.reason }, "frozen (all)"));
      if (m.pinned) badges.push(h("span", { class: "badge warn" }, `flap guard ≥ ${m.pinned.rung}`));
      if (m.decided_rung !== m.rung) badges.push(h("span", { class: "badge warn" }, `dry-run: would be ${m.decided_rung}`));
      if (!badges.length) badges.push(h("span", { class: `badge ${m.rung === "normal" ? "ok" : "warn"}` }, m.rung));
      const override = m.force || m.freeze || s.global_freeze;
      const facts = h("dl", { class: "facts" },
        h("dt", {}, "Pool"), h("dd", { class: "mono" }, m.pool),
        m.shares && m.shares.length
          ? [h("dt", {}, "Shares"), h("dd", { class: "mono" },
              m.shares.map((share) => `${share.pool} ${share.percent}%`).join(" · "))]
          : null,
        h("dt", {}, "Alias"), h("dd", { class: "mono" }, m.alias || "–"),
        h("dt", {}, "Since"), h("dd", {}, when(m.since)),
        h("dt", {}, "Lease"), h("dd", {}, "until ", when(m.lease_until)),
        h("dt", {}, "Why"), h("dd", { class: "reason" }, m.reason),
        m.unhealthy_pools.length ? [h("dt", {}, "Unhealthy"), h("dd", { class: "mono" }, m.unhealthy_pools.join(", "))] : null,
        m.force ? [h("dt", {}, "Forced"), h("dd", {}, `${m.force.reason} (since `, when(m.force.since), ")")] : null,
        m.freeze ? [h("dt", {}, "Frozen"), h("dd", {}, `${m.freeze.reason} (since `, when(m.freeze.since), ")")] : null);
      const conditions = m.conditions.length
        ? h("ul", { class: "conditions", "aria-label": "conditions" }, m.conditions.map((c) => h("li", { class: "condition" },
          h("strong", {}, c.alertname || c.fingerprint), " ", c.effect ? `— ${c.effect}` : "",
          h("div", { class: "muted" }, "started ", when(c.starts_at), " · ", h("span", { class: "mono" }, c.fingerprint)),
          labelChips(c.labels))))
        : null;
      const actions = h("div", { class: "actions" },
        h("button", { type: "button", onclick: () => openAction("force", { model: name }) }, "Force…"),
        m.force ? h("button", { type: "button", onclick: () => openAction("release", { model: name }) }, "Release…") : null,
        m.freeze
          ? h("button", { type: "button", onclick: () => openAction("thaw", { model: name }) }, "Thaw…")
          : h("button", { type: "button", onclick: () => openAction("freeze", { model: name }) }, "Freeze…"),
        h("button", { type: "button", class: "ghost", onclick: () => setFilter({ model: name }) }, "Timeline"));
      return h("article", { class: "card model", "data-model": name, "data-rung": m.rung, "data-overridden": override ? "true" : "false", "aria-labelledby": `model-${name}` },
        h("div", { class: "card-head" }, h("h3", { id: `model-${name}` }, name), h("div", { class: "badges" }, badges)),
        ladder(m),
        h("p", { class: "next" }, nextStep(name, m, s)),
        facts, conditions, actions);
    });
    list.replaceChildren(...(cards.length ? cards : [h("p", { class: "empty" }, "No models configured.")]));
    $("global-actions").replaceChildren(
      s.global_freeze
        ? h("button", { type: "button", onclick: () => openAction("thaw", { model: "" }) }, "Thaw all…")
        : h("button", { type: "button", onclick: () => openAction("freeze", { model: "" }) }, "Freeze all…"),
      h("button", { type: "button", onclick: () => openAction("dry-run", { enabled: !s.dry_run }) }, s.dry_run ? "End dry-run…" : "Dry-run…"));
    const select = $("filter-model");
    const chosen = filter().model;
    select.replaceChildren(h("option", { value: "" }, "all"), ...names.map((n) => h("option", { value: n }, n)));
    select.value = names.includes(chosen) ? chosen : "";
  }

  function table(headers, rows) {
    return h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, headers.map((x) => h("th", { scope: "col" }, x)))),
      h("tbody", {}, rows)));
  }

  function renderBlocks(s) {
    const el = $("block-list");
    const actions = [];
    if (s) actions.push(h("button", { type: "button", onclick: () => openAction("block", {}) }, "Block…"));
    if (s && s.blocked.length) actions.push(h("button", { type: "button", onclick: () => openAction("unblock-all", {}) }, "Unblock all…"));
    $("block-actions").replaceChildren(...actions);
    if (!s) return el.replaceChildren();
    if (!s.blocked.length) return el.replaceChildren(h("p", { class: "empty" }, "No endpoint is blocked."));
    el.replaceChildren(table(["Endpoint", "Model", "Source", "Reason", "Strikes", "Time left", ""],
      s.blocked.map((b) => h("tr", { "data-endpoint": b.endpoint },
        h("td", { class: "mono" }, b.endpoint),
        h("td", {}, b.model || "all models"),
        h("td", {}, b.source === "alert" && b.alert ? `alert ${b.alert}` : b.source),
        h("td", {}, b.reason),
        h("td", {}, b.strikes),
        h("td", {}, h("span", { "data-countdown": b.until }, span(Date.parse(b.until) - serverNow()))),
        h("td", {}, h("button", { type: "button", onclick: () => openAction("unblock", { endpoint: b.endpoint, model: b.model || "" }) }, "Unblock…"))))));
  }

  function renderGateways(s) {
    const el = $("gateway-list");
    if (!s) {
      $("convergence").textContent = "";
      return el.replaceChildren();
    }
    const g = gatewayFacts(s);
    $("convergence").textContent = g.live.length
      ? `${g.current.length} of ${g.live.length} gateway${g.live.length === 1 ? "" : "s"} applied v${s.version}${g.stale ? `; ${g.stale} stale` : ""}`
      : "";
    if (!s.gateways.length) return el.replaceChildren(h("p", { class: "empty" }, "No gateway has watched this controller yet."));
    el.replaceChildren(table(["Gateway", "Transport", "Applied", "Lag", "State", "Last seen", "Last NACK"],
      s.gateways.map((gw) => {
        const st = gw.stale ? "stale" : gw.converged ? "converged" : "behind";
        return h("tr", { "data-gateway": gw.id, "data-state": st },
          h("td", { class: "mono" }, gw.id),
          h("td", {}, gw.transport.replace("_", "-")),
          h("td", {}, gw.applied_version === null ? "–" : `v${gw.applied_version}`),
          h("td", {}, gw.lag === null ? "–" : gw.lag),
          h("td", {}, h("span", { class: `badge ${st === "converged" ? "ok" : st === "stale" ? "bad" : "warn"}` }, st)),
          h("td", {}, gw.connected ? "connected" : when(gw.last_seen)),
          h("td", {}, gw.rejected ? `v${gw.rejected[0]}: ${gw.rejected[1]}` : "–"));
      })));
  }

  // ---- timeline -------------------------------------------------------------

  function filter() {
    const p = new URLSearchParams(location.hash.slice(1));
    return { model: p.get("model") || "", kind: p.get("kind") || "" };
  }

  function setFilter(change) {
    const f = { ...filter(), ...change };
    const p = new URLSearchParams();
    if (f.model) p.set("model", f.model);
    if (f.kind) p.set("kind", f.kind);
    const hash = p.toString();
    history.replaceState(null, "", hash ? `#${hash}` : location.pathname + location.search);
    renderTimeline();
    if (change.model !== undefined) $("timeline").scrollIntoView({ block: "start" });
  }

  function renderTimeline() {
    const f = filter();
    const s = state.status;
    const last = state.history.length ? state.history[state.history.length - 1].seq : 0;
    const applied = s ? s.gateways.map((g) => [g.applied_version, g.stale]) : null;
    const key = JSON.stringify([f, last, state.history.length, applied]);
    if (drawn.get("timeline") === key) return;
    drawn.set("timeline", key);
    $("filter-model").value = f.model;
    $("filter-kind").value = f.kind;
    $("timeline-link").href = location.href;
    const list = $("timeline-list");
    // A model's view keeps what concerns every model: global overrides, new
    // configurations and published versions.
    const global = (e) => e.model === null && ["override", "override_ended", "published", "configured"].includes(e.kind);
    const shown = state.history.filter((e) =>
      (!f.model || e.model === f.model || global(e)) && (!f.kind || GROUPS[e.kind] === f.kind));
    if (!shown.length) {
      list.replaceChildren(h("li", { class: "empty-entry" }, state.status ? "Nothing recorded for this view yet." : ""));
      return;
    }
    list.replaceChildren(...shown.slice().reverse().map((e) => {
      const extra = [];
      if (e.kind === "published" && s && e.detail && typeof e.detail.version === "number") {
        const live = s.gateways.filter((g) => !g.stale);
        const have = live.filter((g) => g.applied_version !== null && g.applied_version >= e.detail.version).length;
        if (live.length) extra.push(h("span", { class: "muted" }, ` — applied by ${have} of ${live.length} gateway${live.length === 1 ? "" : "s"}`));
      }
      return h("li", { "data-seq": e.seq, "data-kind": e.kind, "data-group": GROUPS[e.kind] || "other" },
        h("time", { datetime: e.at, title: e.at }, clock(e.at)),
        h("span", { class: "kind" }, e.kind.replace(/_/g, " "), e.dry_run ? " (dry-run)" : ""),
        h("span", { class: "summary-text" }, e.summary, extra),
        h("details", {}, h("summary", {}, "detail"), h("pre", {}, JSON.stringify(e.detail, null, 2))));
    }));
  }

  // ---- overrides ------------------------------------------------------------

  const ACTIONS = {
    force: {
      title: "Force a rung", path: "v1/admin/force", fields: ["model", "rung", "ttl"],
      effect: (v) => `Pins ${v.model} to ${v.rung} (${RUNG_MEANS[v.rung]}) for ${v.ttl}. Automation stops moving it until the pin ends or is released.`,
      body: (v) => ({ model: v.model, rung: v.rung, ttl: v.ttl, reason: v.reason }),
    },
    release: {
      title: "Release a forced rung", path: "v1/admin/release", fields: ["model"],
      effect: (v) => `Ends the pin on ${v.model}: automation decides its rung again at once, from the alerts in force.`,
      body: (v) => ({ model: v.model, reason: v.reason }),
    },
    freeze: {
      title: "Freeze", path: "v1/admin/freeze", fields: ["model-or-all", "ttl"],
      effect: (v) => `Freezes ${v.model || "every model"} for ${v.ttl}: the route table stays as it is, whatever the alerts say, until thawed.`,
      body: (v) => ({ model: v.model || null, ttl: v.ttl, reason: v.reason }),
    },
    thaw: {
      title: "Thaw", path: "v1/admin/thaw", fields: ["model-or-all"],
      effect: (v) => `Ends the freeze of ${v.model || "every model"}: automation acts on the alerts in force at once.`,
      body: (v) => ({ model: v.model || null, reason: v.reason }),
    },
    block: {
      title: "Block an endpoint", path: "v1/admin/block", fields: ["endpoint", "model-or-all", "ttl"],
      effect: (v) => `Gateways stop sending ${v.model || "any model's"} traffic to ${v.endpoint || "the endpoint"} for ${v.ttl}, unless every other target is blocked too.`,
      body: (v) => ({ endpoint: v.endpoint, model: v.model || null, ttl: v.ttl, reason: v.reason }),
    },
    unblock: {
      title: "Unblock an endpoint", path: "v1/admin/unblock", fields: ["endpoint", "model-or-all"],
      effect: (v) => `Gateways may send ${v.model || "every model's"} traffic to ${v.endpoint} again at once.`,
      body: (v) => ({ endpoint: v.endpoint, model: v.model || null, reason: v.reason }),
    },
    "unblock-all": {
      title: "Unblock every endpoint", path: "v1/admin/unblock-all", fields: [],
      effect: () => `Lifts all ${state.status ? state.status.blocked.length : ""} blocks at once; endpoints still failing will be blocked again by their alerts or reports.`,
      body: (v) => ({ reason: v.reason }),
    },
    "dry-run": {
      title: "Dry-run", path: "v1/admin/dry-run", fields: ["enabled"],
      effect: (v) => (v.enabled === "true"
        ? "Turns dry-run on: decisions are still made and shown, but nothing is published; gateways keep the current table."
        : "Turns dry-run off: the decided rungs are published at once."),
      body: (v) => ({ enabled: v.enabled === "true", reason: v.reason }),
    },
  };

  let current = null;

  function field(name, preset) {
    const models = state.status ? Object.keys(state.status.models).sort() : [];
    const row = (label, input) => [h("label", { for: `action-${name}` }, label), input];
    switch (name) {
      case "model":
        return row("Model", h("select", { id: "action-model", name: "model", required: true }, models.map((m) => h("option", { value: m, selected: m === preset.model }, m))));
      case "model-or-all":
        return row("Model", h("select", { id: "action-model-or-all", name: "model" },
          h("option", { value: "" }, "all models"), models.map((m) => h("option", { value: m, selected: m === preset.model }, m))));
      case "rung":
        return row("Rung", h("select", { id: "action-rung", name: "rung", required: true }, RUNGS.map((r) => h("option", { value: r, selected: r === (preset.rung || "failover") }, `${r}: ${RUNG_MEANS[r]}`))));
      case "ttl":
        return row("For (TTL, e.g. 30m, 2h)", h("input", { id: "action-ttl", name: "ttl", required: true, value: preset.ttl || "30m", pattern: "\\s*\\d+(\\.\\d+)?\\s*(ms|s|m|h|d)\\s*", autocomplete: "off" }));
      case "endpoint":
        return row("Endpoint", h("input", { id: "action-endpoint", name: "endpoint", required: true, value: preset.endpoint || "", maxlength: 512, autocomplete: "off", spellcheck: "false" }));
      case "enabled":
        return row("Dry-run", h("select", { id: "action-enabled", name: "enabled" },
          h("option", { value: "true", selected: preset.enabled !== false }, "on"), h("option", { value: "false", selected: preset.enabled === false }, "off")));
      default:
        return [];
    }
  }

  function values() {
    const form = $("action-form");
    const v = Object.fromEntries(new FormData(form).entries());
    v.reason = (v.reason || "").trim();
    return v;
  }

  function describe() {
    if (!current) return;
    $("action-effect").textContent = current.effect(values());
  }

  function openAction(kind, preset) {
    const a = ACTIONS[kind];
    current = a;
    $("action-title").textContent = a.title;
    $("action-fields").replaceChildren(...a.fields.flatMap((f) => field(f, preset)));
    $("action-reason").value = "";
    $("action-admin-token").value = "";
    $("action-admin").hidden = Boolean(tokens.admin);
    $("action-admin-token").required = !tokens.admin;
    $("action-result").textContent = "";
    $("action-result").removeAttribute("data-ok");
    $("action-confirm").disabled = false;
    $("action-confirm").textContent = "Confirm";
    $("action-cancel").textContent = "Cancel";
    describe();
    $("action-dialog").showModal();
    const first = $("action-fields").querySelector("input, select") || $("action-reason");
    first.focus();
  }

  async function confirmAction(event) {
    event.preventDefault();
    const form = $("action-form");
    if (!form.reportValidity() || !current) return;
    const v = values();
    if (!v.reason) {
      $("action-reason").setCustomValidity("Say why: it is recorded in the history.");
      $("action-reason").reportValidity();
      return;
    }
    if (!tokens.admin) tokens.admin = $("action-admin-token").value.trim();
    const result = $("action-result");
    $("action-confirm").disabled = true;
    result.textContent = "Sending…";
    result.removeAttribute("data-ok");
    let answer;
    try {
      answer = await admin(current.path, current.body(v));
    } catch (e) {
      answer = { ok: false, text: `the controller did not answer: ${e.message}` };
    }
    result.dataset.ok = String(answer.ok);
    if (answer.ok) {
      const b = answer.body;
      result.textContent = b.changed
        ? `Done: version ${b.version}. ${b.effects.join(" ")}`
        : `Nothing changed (version ${b.version}). ${b.effects.join(" ")}`;
      $("action-confirm").textContent = "Done";
      $("action-cancel").textContent = "Close";
      refresh();
    } else {
      if (answer.status === 401) {
        tokens.admin = "";
        $("action-admin").hidden = false;
        $("action-admin-token").required = true;
        result.textContent = `Refused: the admin token was not accepted (${answer.text}).`;
      } else {
        result.textContent = `Refused: ${answer.text}`;
      }
      $("action-confirm").disabled = false;
    }
  }

  // ---- wiring ---------------------------------------------------------------

  function start() {
    $("token-button").addEventListener("click", () => openTokens(""));
    $("token-form").addEventListener("submit", () => {
      tokens.read = $("read-token").value.trim();
      tokens.admin = $("admin-token").value.trim();
      $("read-token").value = "";
      $("admin-token").value = "";
      // A locked page reopens its stream once the status answers.
      if (!state.locked) restartStream();
      refresh();
    });
    $("token-forget").addEventListener("click", () => {
      tokens.read = "";
      tokens.admin = "";
      $("token-dialog").close();
      refresh();
    });
    $("action-form").addEventListener("input", (e) => {
      if (e.target.id === "action-reason") e.target.setCustomValidity("");
      describe();
    });
    $("action-form").addEventListener("submit", confirmAction);
    $("action-cancel").addEventListener("click", () => $("action-dialog").close());
    $("action-dialog").addEventListener("close", () => {
      $("action-admin-token").value = "";
      current = null;
    });
    $("filter-model").addEventListener("change", (e) => setFilter({ model: e.target.value }));
    $("filter-kind").addEventListener("change", (e) => setFilter({ kind: e.target.value }));
    $("timeline-filter").addEventListener("submit", (e) => e.preventDefault());
    window.addEventListener("hashchange", renderTimeline);
    setInterval(tick, 1000);
    setInterval(() => { if (!state.locked) refresh(); }, POLL_MS);
    refresh();
    follow();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
