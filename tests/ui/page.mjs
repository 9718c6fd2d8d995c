// The status page in a real browser (Debian's Chromium, driven by playwright-core):
// an incident driven through the controller's API, checked as a person would check
// it. Run by tests/it/ui.rs, which starts the controller and nginx and passes:
//   STANCH_URL        the controller, e.g. http://127.0.0.1:9797/
//   STANCH_PREFIXED   the same through nginx under a path prefix, e.g. http://127.0.0.1:8080/stanch/
//   STANCH_READ, STANCH_ADMIN, STANCH_INGEST   its tokens
//   NODE_MODULES      where playwright-core is installed
//   ARTEFACTS         where screenshots go
import { createRequire } from "node:module";
import { mkdirSync } from "node:fs";
import assert from "node:assert/strict";

const require = createRequire(`${process.env.NODE_MODULES}/`);
const { chromium } = require("playwright-core");

const URL_ = process.env.STANCH_URL;
const PREFIXED = process.env.STANCH_PREFIXED;
const READ = process.env.STANCH_READ;
const ADMIN = process.env.STANCH_ADMIN;
const INGEST = process.env.STANCH_INGEST;
const ARTEFACTS = process.env.ARTEFACTS;
mkdirSync(ARTEFACTS, { recursive: true });

// What a label that tries to inject markup must be shown as, character for character.
const HOSTILE = `<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">`;

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});

let page;
const problems = [];

async function step(name, fn) {
  const started = Date.now();
  try {
    await fn();
    // Whatever the step did, the page it leaves shows no value rendered wrong.
    if (page && !page.isClosed()) await noJunk(page);
    console.log(`ok - ${name} (${Date.now() - started} ms)`);
  } catch (e) {
    console.log(`not ok - ${name}`);
    if (page) await page.screenshot({ path: `${ARTEFACTS}/failure.png`, fullPage: true }).catch(() => {});
    await browser.close();
    throw e;
  }
}

async function api(method, path, token, body) {
  const r = await fetch(new URL(path, URL_), {
    method,
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

function alert(status, labels, startsAt) {
  return {
    version: "4", status, receiver: "stanch", groupKey: "{}:{}", truncatedAlerts: 0,
    groupLabels: {}, commonLabels: {}, commonAnnotations: {}, externalURL: "http://alertmanager:9093",
    alerts: [{
      status, labels, annotations: { summary: "failure rate above 5%" }, startsAt,
      endsAt: status === "resolved" ? new Date().toISOString() : "0001-01-01T00:00:00Z",
      generatorURL: "http://prometheus:9090/graph",
    }],
  };
}

const FAILOVER = {
  alertname: "LLMModelHighFailureRate", action: "trigger-failover", target_model: "qwen-72b",
  pool: "dc-a", severity: "critical", note: HOSTILE,
};
const started = new Date(Date.now() - 90_000).toISOString();

async function newPage(url, options = {}) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 }, ...options });
  const p = await context.newPage();
  p.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  p.on("console", (m) => {
    if (m.type() === "error") problems.push(`console: ${m.text()}`);
  });
  const response = await p.goto(url);
  return { p, response, context };
}

async function enterReadToken(p, token) {
  await p.locator("#token-dialog").waitFor({ state: "visible" });
  await p.fill("#read-token", token);
  await p.click("#token-dialog button[type=submit]");
}

// Nothing the page shows is a placeholder that leaked: no "null", "undefined", "NaN".
async function noJunk(p) {
  const text = await p.evaluate(() => document.body.innerText);
  // A value rendered the wrong way: missing, not a number, or an object stringified.
  assert.doesNotMatch(text, /\b(null|undefined|NaN)\b|\[object \w+\]|,,/);
}

// A full-page screenshot from the top, so the sticky header is where a person sees it.
async function shot(p, name) {
  await p.evaluate(() => window.scrollTo(0, 0));
  await p.screenshot({ path: `${ARTEFACTS}/${name}.png`, fullPage: true });
}

const card = (name) => `article.model[data-model="${name}"]`;
const current = (name) => `${card(name)} .ladder li[aria-current="step"]`;

// ---------------------------------------------------------------------------

let context;
await step("the page and its files load without a token, under a strict CSP", async () => {
  ({ p: page, context } = await newPage(URL_));
  const csp = (await page.goto(URL_)).headers()["content-security-policy"];
  assert.match(csp, /default-src 'none'/);
  assert.match(csp, /script-src 'self'/);
  assert.doesNotMatch(csp, /unsafe-inline|unsafe-eval/);
  for (const f of ["ui/app.js", "ui/app.css", "ui/icon.svg"]) {
    const r = await fetch(new URL(f, URL_));
    assert.equal(r.status, 200, f);
  }
});

await step("without the read token nothing is shown and the token is asked for", async () => {
  await page.locator("#token-dialog").waitFor({ state: "visible" });
  assert.equal(await page.locator("article.model").count(), 0);
  await page.screenshot({ path: `${ARTEFACTS}/token-prompt.png` });
});

await step("a wrong read token is refused and still shows nothing", async () => {
  await enterReadToken(page, "not-the-token");
  await page.locator("#token-dialog").waitFor({ state: "visible" });
  await page.locator(".banner.info", { hasText: "was refused" }).waitFor();
  assert.equal(await page.locator("article.model").count(), 0);
});

await step("with the read token every model is shown on its rung, and the stream is live", async () => {
  await enterReadToken(page, READ);
  await page.locator(card("qwen-72b")).waitFor();
  assert.equal(await page.locator(current("qwen-72b")).innerText(), "normal");
  assert.equal(await page.locator(current("qwen-14b")).innerText(), "normal");
  await page.locator("#live[data-state=live]").waitFor({ timeout: 3000 });
  assert.match(await page.locator("#summary").innerText(), /All 2 models normal/);
});

await step("a failover alert shows within a second, without reloading", async () => {
  const navigations = [];
  page.on("framenavigated", (f) => navigations.push(f.url()));
  const sent = Date.now();
  await api("POST", "v1/alerts/alertmanager", INGEST, alert("firing", FAILOVER, started));
  await page.waitForFunction(
    (sel) => document.querySelector(sel)?.textContent === "failover", current("qwen-72b"), { timeout: 1000 });
  console.log(`# the page showed failover ${Date.now() - sent} ms after the alert was accepted`);
  assert.deepEqual(navigations, [], "the page reloaded");
  const c = page.locator(card("qwen-72b"));
  assert.equal(await c.getAttribute("data-rung"), "failover");
  assert.match(await c.locator(".facts").innerText(), /dc-b/);
  assert.match(await page.locator("#summary").innerText(), /1 of 2 models degraded/);
});

await step("the condition names its alert, its labels and its start; markup in a label is text", async () => {
  const cond = page.locator(`${card("qwen-72b")} li.condition`);
  assert.equal(await cond.count(), 1);
  const text = await cond.innerText();
  assert.match(text, /LLMModelHighFailureRate/);
  assert.match(text, /qwen-72b pool dc-a failing/);
  assert.match(text, /started 1 min \d+ s ago/);
  assert.ok(text.includes(`note="${HOSTILE}"`), `the label is shown as written: ${text}`);
  assert.equal(await page.evaluate(() => window.__pwned), undefined, "markup from a label ran");
  assert.equal(await page.locator("script").count(), 1, "only the page's own script");
  assert.equal(await page.locator("img").count(), 1, "only the page's own icon");
  assert.match(await page.locator(`${card("qwen-72b")} .next`).innerText(), /Stays at failover while its alert fires/);
});

await step("the timeline has the alert, the decision with its rule and the published version, in order", async () => {
  const entries = page.locator("#timeline-list li[data-seq]");
  await page.waitForFunction(() => document.querySelector('#timeline-list li[data-kind="published"]'));
  const rows = await entries.evaluateAll((els) => els.map((e) => ({ seq: Number(e.dataset.seq), kind: e.dataset.kind, text: e.innerText })));
  const seqs = rows.map((r) => r.seq);
  assert.deepEqual(seqs, [...seqs].sort((a, b) => b - a), "newest first, by sequence");
  const at = (kind) => rows.findIndex((r) => r.kind === kind);
  assert.ok(at("alert_active") > at("transition") && at("transition") > at("published"), JSON.stringify(rows.map((r) => r.kind)));
  assert.match(rows[at("transition")].text, /qwen-72b: normal -> failover \(pool dc-b\) escalated: pool dc-a failing/);
  await noJunk(page);
  await shot(page, "incident");
});

await step("a gateway watching the controller is listed with its transport and applied version", async () => {
  const table = await api("GET", "v1/routes", READ);
  await fetch(new URL(`v1/routes?after=${table.version}&wait=1ms&epoch=${encodeURIComponent(table.epoch)}`, URL_), {
    headers: { Authorization: `Bearer ${READ}`, "x-stanch-gateway": "gw-<b>bold</b>", "x-stanch-applied-version": String(table.version) },
  });
  const row = page.locator('#gateway-list tr[data-gateway="gw-<b>bold</b>"]');
  await row.waitFor({ timeout: 7000 });
  const text = await row.innerText();
  assert.match(text, /long-poll/);
  assert.equal(await page.locator("#gateway-list b").count(), 0, "a gateway id is text");
});

await step("resolving the alert shows when the model steps down", async () => {
  await api("POST", "v1/alerts/alertmanager", INGEST, alert("resolved", FAILOVER, started));
  const next = page.locator(`${card("qwen-72b")} .next`);
  await page.waitForFunction(
    (sel) => /Steps down to normal after \d+ s more without alerts/.test(document.querySelector(sel)?.textContent || ""),
    `${card("qwen-72b")} .next`, { timeout: 1500 });
  const first = await next.innerText();
  await page.waitForTimeout(2100);
  const later = await next.innerText();
  const secs = (t) => Number(/after (\d+) s/.exec(t)[1]);
  assert.ok(secs(later) < secs(first), `the countdown runs: ${first} then ${later}`);
  assert.equal(await page.locator(`${card("qwen-72b")} li.condition`).count(), 0);
});

await step("an override needs the admin token: refused without it, nothing changes", async () => {
  await page.click(`${card("qwen-14b")} button:has-text("Force…")`);
  const dialog = page.locator("#action-dialog");
  await dialog.waitFor({ state: "visible" });
  await page.selectOption("#action-rung", "static");
  await page.fill("#action-ttl", "10m");
  await page.fill("#action-reason", "drill: FAQ only");
  assert.match(await page.locator("#action-effect").innerText(), /Pins qwen-14b to static \(answers from the static FAQ\) for 10m/);
  await page.fill("#action-admin-token", "wrong");
  await page.screenshot({ path: `${ARTEFACTS}/override-dialog.png` });
  await page.click("#action-confirm");
  await page.locator("#action-result[data-ok=false]").waitFor();
  assert.match(await page.locator("#action-result").innerText(), /Refused: the admin token was not accepted \(401/);
  const s = await api("GET", "v1/status", READ);
  assert.equal(s.models["qwen-14b"].force, null);
  assert.equal(s.models["qwen-14b"].rung, "normal");
});

await step("with the admin token the override is performed and shown", async () => {
  await page.fill("#action-admin-token", ADMIN);
  await page.click("#action-confirm");
  await page.locator("#action-result[data-ok=true]").waitFor();
  assert.match(await page.locator("#action-result").innerText(), /Done: version \d+/);
  await page.click("#action-cancel");
  await page.waitForFunction((sel) => document.querySelector(sel)?.textContent === "static", current("qwen-14b"), { timeout: 1000 });
  const c = page.locator(card("qwen-14b"));
  assert.equal(await c.getAttribute("data-overridden"), "true");
  assert.match(await c.locator(".badges").innerText(), /FORCED STATIC/i);
  assert.match(await c.locator(".next").innerText(),
    /^Pinned at static by an operator: stays until released or for \d+ min \d+ s more\.$/);
  const s = await api("GET", "v1/status", READ);
  assert.equal(s.models["qwen-14b"].force.reason, "drill: FAQ only");
  await page.locator('#timeline-list li[data-kind="override"]', { hasText: "drill: FAQ only" }).waitFor();
});

await step("the admin token is reused from memory; blocks show their source and are lifted from the page", async () => {
  await api("POST", "v1/admin/block", ADMIN, { endpoint: "http://10.0.0.7:8000", ttl: "15m", reason: "bad GPU" });
  const row = page.locator('#block-list tr[data-endpoint="http://10.0.0.7:8000"]');
  await row.waitFor({ timeout: 1500 });
  const text = await row.innerText();
  assert.match(text, /operator/);
  assert.match(text, /bad GPU/);
  assert.match(text, /1[45] min \d+ s/);
  await row.locator("button").click();
  assert.equal(await page.locator("#action-admin").isHidden(), true, "the token is not asked for again");
  await page.fill("#action-reason", "GPU replaced");
  await page.click("#action-confirm");
  await page.locator("#action-result[data-ok=true]").waitFor();
  await page.click("#action-cancel");
  await page.locator("#block-list .empty").waitFor({ timeout: 1500 });
});

await step("no token is ever shown or stored", async () => {
  const text = await page.evaluate(() => document.documentElement.outerHTML + document.body.innerText);
  for (const t of [READ, ADMIN]) assert.ok(!text.includes(t), "a token is in the page");
  assert.deepEqual(await page.evaluate(() => [localStorage.length, sessionStorage.length, document.cookie]), [0, 0, ""]);
  assert.ok(!page.url().includes(READ) && !page.url().includes(ADMIN));
});

await step("a filtered timeline is a link that opens the same view", async () => {
  await page.selectOption("#filter-model", "qwen-14b");
  await page.selectOption("#filter-kind", "overrides");
  const link = await page.locator("#timeline-link").getAttribute("href");
  assert.match(link, /#model=qwen-14b&kind=overrides$/);
  const { p, context: c2 } = await newPage(link);
  await enterReadToken(p, READ);
  await p.locator("#timeline-list li[data-seq]").first().waitFor();
  assert.equal(await p.locator("#filter-model").inputValue(), "qwen-14b");
  const kinds = await p.locator("#timeline-list li[data-seq]").evaluateAll((els) => els.map((e) => e.dataset.kind));
  assert.ok(kinds.length > 0 && kinds.every((k) => k === "override" || k === "override_ended"), kinds.join());
  const models = await p.locator("#timeline-list li[data-seq] .summary-text").allInnerTexts();
  assert.ok(models.every((t) => !t.includes("qwen-72b")), models.join("\n"));
  await c2.close();
  await page.selectOption("#filter-model", "");
  await page.selectOption("#filter-kind", "");
});

await step("keyboard: an action opens from the keyboard and Escape closes it", async () => {
  await page.locator(`${card("qwen-72b")} button:has-text("Freeze…")`).focus();
  await page.keyboard.press("Enter");
  await page.locator("#action-dialog").waitFor({ state: "visible" });
  assert.equal(await page.evaluate(() => document.activeElement.id), "action-model-or-all");
  await page.keyboard.press("Escape");
  await page.locator("#action-dialog").waitFor({ state: "hidden" });
});

// Every visible form control has a label; every button a name; text keeps a contrast
// of 4.5:1 against what is behind it (WCAG AA), in light and dark.
async function accessible(p, scheme) {
  const bad = await p.evaluate(() => {
    const out = [];
    const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
    const lum = ([r, g, b]) => {
      const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const background = (el) => {
      for (let e = el; e; e = e.parentElement) {
        const c = rgb(getComputedStyle(e).backgroundColor);
        if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3);
      }
      return rgb(getComputedStyle(document.documentElement).backgroundColor).slice(0, 3);
    };
    for (const el of document.querySelectorAll("input, select, textarea")) {
      if (el.offsetParent && !(el.labels && el.labels.length) && !el.getAttribute("aria-label")) out.push(`unlabelled ${el.id || el.name}`);
    }
    for (const b of document.querySelectorAll("button")) {
      if (b.offsetParent && !b.innerText.trim() && !b.getAttribute("aria-label")) out.push("a button without a name");
    }
    for (const el of document.querySelectorAll("body *")) {
      if (!el.offsetParent || ![...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim())) continue;
      const style = getComputedStyle(el);
      if (style.visibility === "hidden" || Number(style.opacity) < 1) continue;
      const [fg, bg] = [lum(rgb(style.color)), lum(background(el))];
      const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
      if (ratio < 4.5) out.push(`contrast ${ratio.toFixed(2)} for "${el.textContent.trim().slice(0, 30)}" (${el.tagName.toLowerCase()}.${el.className})`);
    }
    return out;
  });
  assert.deepEqual(bad, [], `${scheme}: ${bad.join("; ")}`);
}

await step("accessible in light mode", async () => accessible(page, "light"));

await step("dark mode follows the system, and is accessible", async () => {
  await page.emulateMedia({ colorScheme: "dark" });
  const bg = await page.evaluate(() => getComputedStyle(document.body).backgroundColor);
  assert.equal(bg, "rgb(17, 19, 23)");
  await accessible(page, "dark");
  await shot(page, "incident-dark");
  await page.emulateMedia({ colorScheme: "light" });
});

await step("readable at phone width: nothing wider than the screen", async () => {
  const { p, context: c3 } = await newPage(URL_, { viewport: { width: 390, height: 844 }, isMobile: true, hasTouch: true, deviceScaleFactor: 2 });
  await enterReadToken(p, READ);
  await p.locator(card("qwen-72b")).waitFor();
  const [scroll, inner] = await p.evaluate(() => [document.documentElement.scrollWidth, window.innerWidth]);
  assert.ok(scroll <= inner, `the page is ${scroll}px wide on a ${inner}px screen`);
  const width = await p.evaluate((sel) => document.querySelector(sel).getBoundingClientRect().width, card("qwen-72b"));
  assert.ok(width <= 390, `a model card is ${width}px wide`);
  await noJunk(p);
  await shot(p, "phone");
  await c3.close();
});

await step("behind a path prefix (nginx) the page, its files and the live stream work", async () => {
  const { p, context: c4 } = await newPage(PREFIXED);
  await enterReadToken(p, READ);
  await p.locator(card("qwen-14b")).waitFor();
  await p.locator("#live[data-state=live]").waitFor({ timeout: 3000 });
  await api("POST", "v1/admin/force", ADMIN, { model: "qwen-72b", rung: "degraded", ttl: "5m", reason: "through the prefix" });
  await p.waitForFunction((sel) => document.querySelector(sel)?.textContent === "degraded", current("qwen-72b"), { timeout: 1000 });
  await c4.close();
});

await step("a split shows each pool's share", async () => {
  // qwen-14b, held static on its primary by the drill above: a slow dc-a moves three
  // quarters of its traffic to dc-b at once, on whatever rung the model is held.
  const SLOW = { alertname: "PoolLatencyHigh", action: "trigger-failover", target_model: "qwen-14b", pool: "dc-a", shift: "75%" };
  await api("POST", "v1/alerts/alertmanager", INGEST, alert("firing", SLOW, started));
  const facts = `${card("qwen-14b")} .facts`;
  try {
    await page.waitForFunction(
      (sel) => /Shares\s*dc-a 25% · dc-b 75%/.test(document.querySelector(sel)?.innerText || ""), facts, { timeout: 1500 });
  } catch (e) {
    const s = await api("GET", "v1/status", READ);
    throw new Error(`${e.message}\nstatus: ${JSON.stringify(s.models["qwen-14b"])}\npage: ${await page.locator(facts).innerText()}`);
  }
});

await step("nothing went wrong in any page: no script error, no CSP violation", async () => {
  await noJunk(page);
  assert.deepEqual(problems.filter((m) => !/401 \(Unauthorized\)/.test(m)), []);
});

await context.close();
await browser.close();
console.log("all status page checks passed");
