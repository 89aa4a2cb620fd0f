// The web UI in real headless Chromium (system Chromium driven by playwright-core): a person's
// path through catalog → checkpoint → tensor → plan preview against `tessera serve` on a
// synthetic catalog, plus the empty-catalog and API-error messages.
//
// Env: TESSERA_BIN (default ../../target/debug/tessera), CHROMIUM (default /usr/bin/chromium),
// SCREENSHOTS (default ../../target/webui-screenshots).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, writeFileSync, existsSync, symlinkSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../..");
const BIN = process.env.TESSERA_BIN || path.join(repo, "target/debug/tessera");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const SHOTS = process.env.SCREENSHOTS || path.join(repo, "target/webui-screenshots");
// Every wait is bounded: a hung page fails the test instead of the suite.
const STEP_MS = 20_000;

let work;
let servers = [];
let browser;

function tessera(...args) {
  return execFileSync(BIN, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

// Starts `tessera serve` on a free port and resolves with its base URL once it prints it.
function serve(root) {
  return new Promise((resolve, reject) => {
    const child = spawn(BIN, ["serve", "--root", root, "--addr", "127.0.0.1:0"], { stdio: ["ignore", "pipe", "pipe"] });
    servers.push(child);
    let out = "";
    let err = "";
    const timer = setTimeout(() => reject(new Error(`tessera serve did not start: ${out}${err}`)), STEP_MS);
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/127\.0\.0\.1:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    child.stderr.on("data", (d) => { err += d; });
    child.on("exit", (code) => { clearTimeout(timer); reject(new Error(`tessera serve exited ${code}: ${err}`)); });
  });
}

async function newPage() {
  const page = await browser.newPage();
  page.setDefaultTimeout(STEP_MS);
  const problems = [];
  page.on("pageerror", (e) => problems.push(`page error: ${e.message}`));
  page.on("console", (m) => { if (m.type() === "error" && !/status of 4\d\d/.test(m.text())) problems.push(`console: ${m.text()}`); });
  page.problems = problems;
  return page;
}

async function shot(page, name) {
  // No placeholder leaks into what a person reads.
  const text = await page.locator("body").innerText();
  assert.ok(!/\b(null|undefined|NaN)\b|\[object /.test(text), `${name}: ${text}`);
  await page.screenshot({ path: path.join(SHOTS, name), fullPage: true });
}

before(async () => {
  assert.ok(existsSync(BIN), `no tessera binary at ${BIN} (cargo build first)`);
  // No silent skip: without Chromium this suite fails.
  assert.ok(existsSync(CHROMIUM), `no Chromium at ${CHROMIUM} (apt-get install -y chromium)`);
  rmSync(path.join(SHOTS, "failure.png"), { force: true });
  mkdirSync(SHOTS, { recursive: true });
  work = mkdtempSync(path.join(tmpdir(), "tessera-webui-"));
  const layout = path.join(work, "tp2pp2.json");
  writeFileSync(layout, tessera("layout", "megatron-gpt", "--tp", "2", "--pp", "2", "--dp", "1", "--num-layers", "4"));
  for (const step of ["step-000100", "step-000200"]) {
    tessera("synth", "--model", "gpt-tiny", "--layout", layout, "--out", path.join(work, "root/gpt", step));
  }
  // A save that did not finish: data but no manifest.
  mkdirSync(path.join(work, "root/gpt/step-000300/data"), { recursive: true });
  writeFileSync(path.join(work, "root/gpt/step-000300/data/rank-00000.bin"), "partial");
  // An entry the server cannot read: a symlink pointing at itself (skipped and reported).
  symlinkSync("loop", path.join(work, "root/loop"));
  mkdirSync(path.join(work, "empty"));
  // A fresh profile per run (playwright takes it as the persistent context's directory).
  browser = await chromium.launchPersistentContext(path.join(work, "chromium-profile"), {
    executablePath: CHROMIUM,
    headless: true,
    timeout: STEP_MS,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    viewport: { width: 1280, height: 900 },
  });
});

after(async () => {
  if (browser) await browser.close();
  for (const s of servers) s.kill("SIGTERM");
  if (work) rmSync(work, { recursive: true, force: true });
});

test("catalog → checkpoint → tensor → plan preview", { timeout: 120_000 }, async () => {
  const base = await serve(path.join(work, "root"));
  const page = await newPage();
  try {
    await journey(base, page);
  } catch (e) {
    // What the page showed when it failed, next to the other screenshots.
    await page.screenshot({ path: path.join(SHOTS, "failure.png"), fullPage: true }).catch(() => {});
    throw new Error(`${e.message}\npage problems: ${page.problems.join("; ")}\nview: ${await page.locator("#view").innerText().catch(() => "?")}`, { cause: e });
  }
});

async function journey(base, page) {
  const api = async (p) => (await page.request.get(base + p)).json();

  // Catalog: one row per checkpoint, with run, step, status and the latest marker.
  await page.goto(base + "/");
  await page.locator("#catalog tr.ckpt-row").first().waitFor();
  const rows = await page.locator("#catalog tr.ckpt-row").allInnerTexts();
  assert.equal(rows.length, 3, rows.join("\n"));
  assert.match(rows[0], /gpt\s+step-000100\s+100\s+committed/);
  assert.match(rows[1], /gpt\s+step-000200\s+200\s+committed latest/);
  assert.match(rows[2], /gpt\s+step-000300\s+300\s+incomplete/);
  // Only committed checkpoints can be opened.
  assert.equal(await page.locator("#catalog tr.ckpt-row").nth(2).locator("a").count(), 0);
  assert.match(rows[1], /\tnative\t/);
  // The unreadable entry is named above the table, not silently dropped.
  assert.match(await page.locator("#catalog-problems").innerText(), /1 catalog entry could not be read[\s\S]*loop/);
  await shot(page, "catalog.png");
  // The run's latest pointer leads to its checkpoint.
  assert.equal(await page.locator("a.latest-link").innerText(), "gpt/step-000200");
  await page.locator("a.latest-link").click();
  await page.locator("#tensors tr.tensor-row").first().waitFor();
  assert.equal(await page.locator("main h1").innerText(), "gpt/step-000200");
  await page.goBack();
  await page.locator("#catalog tr.ckpt-row").first().waitFor();

  // Checkpoint: every tensor, then the filter box, then sorting by bytes.
  await page.locator("#catalog a", { hasText: "step-000200" }).click();
  await page.locator("#tensors tr.tensor-row").first().waitFor();
  const all = await api("/v1/checkpoints/gpt/step-000200/tensors?limit=10000");
  assert.equal(await page.locator("#tensors tr.tensor-row").count(), all.total);
  assert.equal(await page.locator("#tensor-count").innerText(), `${all.total} of ${all.total} tensors`);
  // The checkpoint's identity (what its plans are bound to), as the API states it.
  const summary = await api("/v1/checkpoints/gpt/step-000200");
  assert.match(summary.identity, /^native:[0-9a-f]{32}$/);
  assert.equal(await page.locator("#identity").innerText(), summary.identity);
  assert.equal(summary.writer, "tessera (version 1)");
  assert.equal(await page.locator("#writer").innerText(), summary.writer);
  await page.fill("#filter", "attn.qkv.weight");
  const qkv = all.tensors.filter((t) => t.fqn.includes("attn.qkv.weight"));
  assert.equal(qkv.length, 4 * 4, "4 layers × (weight + 3 optimizer states)");
  await page.waitForFunction((n) => document.querySelectorAll("#tensors tr.tensor-row").length === n, qkv.length);
  assert.equal(await page.locator("#tensor-count").innerText(), `${qkv.length} of ${all.total} tensors`);
  await page.fill("#filter", "");
  await page.locator('#tensors th[data-col="bytes"]').click();
  await page.locator('#tensors th[data-col="bytes"]').click();
  assert.equal(await page.locator('#tensors th[data-col="bytes"]').getAttribute("aria-sort"), "descending");
  const biggest = all.tensors.reduce((a, b) => (b.bytes > a.bytes ? b : a));
  const first = await page.locator("#tensors tr.tensor-row").first().locator("td").first().innerText();
  assert.equal(all.tensors.find((t) => t.fqn === first).bytes, biggest.bytes);
  await page.fill("#filter", "model.layers.0.attn.qkv.w*"); // a glob: only the parameter, not its optimizer states
  await page.waitForFunction(() => document.querySelectorAll("#tensors tr.tensor-row").length === 1);
  await shot(page, "checkpoint.png");

  // Tensor: one SVG rect per saved box, each naming its file and byte range.
  await page.locator("#tensors a", { hasText: "model.layers.0.attn.qkv.weight" }).click();
  await page.locator("#boxes rect.box").first().waitFor();
  const detail = await api("/v1/checkpoints/gpt/step-000200/tensors/model.layers.0.attn.qkv.weight");
  assert.equal(detail.saved.length, 2, "tp2 saves two boxes");
  assert.equal(await page.locator("#boxes rect.box").count(), detail.saved.length);
  assert.equal(await page.locator("#box-count").innerText(), `${detail.saved.length} saved box(es)`);
  const title = await page.locator("#boxes rect.box title").first().textContent();
  assert.ok(title.includes(`file ${detail.saved[0].file}`), title);
  assert.ok(title.includes(`bytes ${detail.saved[0].byte_offset.toLocaleString("en-US")}–`), title);
  // The boxes split dim 0 in two halves of the drawn shape.
  const heights = await page.locator("#boxes rect.box").evaluateAll((rs) => rs.map((r) => Number(r.getAttribute("height"))));
  assert.ok(Math.abs(heights[0] - heights[1]) < 1, String(heights));
  await page.locator("#boxes rect.box").first().hover();
  await shot(page, "tensor.png");

  // 1-D tensor: a bar.
  await page.goto(`${base}/#/ckpt/gpt/step-000200/tensor/model.final_norm.weight`);
  await page.locator("#boxes rect.box").first().waitFor();
  const norm = await api("/v1/checkpoints/gpt/step-000200/tensors/model.final_norm.weight");
  assert.equal(await page.locator("#boxes rect.box").count(), norm.saved.length);

  // Plan preview: fsdp dp4 reads every byte once; one bar group per rank.
  await page.goto(`${base}/#/ckpt/gpt/step-000200`);
  await page.locator("#plan-link").click();
  await page.locator("#plan-form").waitFor();
  await page.selectOption("#preset", "fsdp");
  await page.fill("#fsdp-dp", "4");
  await page.click("#plan-button");
  await page.locator("#amplification").waitFor();
  assert.equal(await page.locator("#amplification").innerText(), "read amplification 1.00");
  assert.equal(await page.locator("#rank-chart g.rank-bar").count(), 4);
  const readBars = await page.locator("#rank-chart rect.bar-read").evaluateAll((rs) => rs.map((r) => Number(r.getAttribute("height"))));
  assert.ok(readBars.every((h) => h > 0), String(readBars));
  await shot(page, "plan.png");

  // Megatron preset: tp2 pp2 dp2 = 8 ranks.
  await page.selectOption("#preset", "megatron");
  await page.fill("#meg-tp", "2");
  await page.fill("#meg-pp", "2");
  await page.fill("#meg-dp", "2");
  await page.click("#plan-button");
  await page.waitForFunction(() => document.querySelectorAll("#rank-chart g.rank-bar").length === 8);
  assert.equal(await page.locator("#amplification").innerText(), "read amplification 1.00");

  // A layout the planner refuses: the server's detail is shown.
  await page.selectOption("#preset", "json");
  await page.fill("#layout-json", JSON.stringify({ mesh: [{ name: "dp", size: 2 }], rules: [{ match: "nothing*", placements: ["shard(0)"] }] }));
  await page.click("#plan-button");
  const error = page.locator("#plan-result .error");
  await error.waitFor();
  const created = await page.request.post(base + "/v1/plans", {
    data: { checkpoint: "gpt/step-000200", layout: { mesh: [{ name: "dp", size: 2 }], rules: [{ match: "nothing*", placements: ["shard(0)"] }] } },
  });
  const body = await created.json();
  assert.equal(created.status(), 422);
  const text = await error.innerText();
  assert.ok(text.includes("Error 422") && text.includes(body.detail), text);
  await shot(page, "plan-error.png");

  // An unknown checkpoint: the 404 detail.
  await page.goto(`${base}/#/ckpt/gpt/step-009999`);
  await page.locator("#view .error").waitFor();
  assert.match(await page.locator("#view .error").innerText(), /Error 404/);

  assert.deepEqual(page.problems, []);
  await page.close();
}

test("an empty catalog says so", { timeout: 60_000 }, async () => {
  const base = await serve(path.join(work, "empty"));
  const page = await newPage();
  await page.goto(base + "/");
  await page.locator("#empty-catalog").waitFor();
  assert.match(await page.locator("#empty-catalog").innerText(), /The catalog is empty\./);
  assert.deepEqual(page.problems, []);
  await page.close();
});
