// The web UI in real headless Chromium (system Chromium driven by playwright-core): a person's
// path through catalog → checkpoint → tensor → plan preview against `tessera serve` on a
// synthetic catalog, plus the empty-catalog and API-error messages.
//
// Env: TESSERA_BIN (default ../../target/debug/tessera), CHROMIUM (default /usr/bin/chromium),
// SCREENSHOTS (default ../../target/webui-screenshots), TESSERA_PYTHON (default
// ../../target/pyenv/bin/python, with tessera and torch: the live publication's publishers).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync, mkdirSync, rmSync, writeFileSync, existsSync, symlinkSync, cpSync, readFileSync } from "node:fs";
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
// The DCP and safetensors fixtures (shared/fixtures/dcp next to the workspace).
const FIXTURES = process.env.TESSERA_DCP_FIXTURES || path.join(repo, "../shared/fixtures/dcp");
const PYTHON = process.env.TESSERA_PYTHON || path.join(repo, "target/pyenv/bin/python");

let work;
let servers = [];
let browser;

function tessera(...args) {
  return execFileSync(BIN, args, { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
}

// Starts `tessera serve` on a free port and resolves with its base URL once it prints it.
function serve(root, ...flags) {
  return new Promise((resolve, reject) => {
    const child = spawn(BIN, ["serve", "--root", root, "--addr", "127.0.0.1:0", ...flags], { stdio: ["ignore", "pipe", "pipe"] });
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

// One publisher rank of the live publication `policy` (tests/webui/publish_live.py: the real
// `tessera.publish`), resolved with its output once it has published `steps`.
function publishRank(registry, rank, world, steps, timeout) {
  return new Promise((resolve, reject) => {
    const child = spawn(PYTHON, [path.join(here, "publish_live.py"), registry, String(rank), String(world), steps, String(timeout)],
      { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    child.stdout.on("data", (d) => { out += d; });
    child.stderr.on("data", (d) => { out += d; });
    const timer = setTimeout(() => { child.kill("SIGKILL"); reject(new Error(`publisher rank ${rank} hung: ${out}`)); }, 180_000);
    child.on("exit", (code) => {
      clearTimeout(timer);
      if (code === 0) resolve(out); else reject(new Error(`publisher rank ${rank} exited ${code}: ${out}`));
    });
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
  // Foreign formats read in place: a DCP save (with optimizer states) and a safetensors file,
  // whose catalog rows get their tensor counts from their summaries.
  assert.ok(existsSync(FIXTURES), `no DCP fixtures at ${FIXTURES} (set TESSERA_DCP_FIXTURES)`);
  cpSync(path.join(FIXTURES, "e_w2_fsdp2_adamw"), path.join(work, "root/dcp/step-000050"), { recursive: true });
  mkdirSync(path.join(work, "root/hf/step-000010"), { recursive: true });
  cpSync(path.join(FIXTURES, "h_reference_full_safetensors/model.safetensors"), path.join(work, "root/hf/step-000010/model.safetensors"));
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
  // Foreign rows are filled in from their summaries once they arrive.
  await page.locator('#catalog[data-filled="true"]').waitFor();
  const allRows = await page.locator("#catalog tr.ckpt-row").allInnerTexts();
  const rows = allRows.filter((r) => r.startsWith("gpt"));
  assert.equal(allRows.length, 5, allRows.join("\n"));
  assert.equal(rows.length, 3, rows.join("\n"));
  assert.match(rows[0], /gpt\s+step-000100\s+100\s+committed/);
  assert.match(rows[1], /gpt\s+step-000200\s+200\s+committed latest/);
  assert.match(rows[2], /gpt\s+step-000300\s+300\s+incomplete/);
  // Only committed checkpoints can be opened.
  assert.equal(await page.locator('#catalog tr.ckpt-row[data-id="gpt/step-000300"] a').count(), 0);
  assert.match(rows[1], /\tnative\t/);
  // DCP and safetensors rows: format, step and tensor count (from their summaries).
  for (const [id, format, step] of [["dcp/step-000050", "dcp", 50], ["hf/step-000010", "safetensors", 10]]) {
    const sum = await api(`/v1/checkpoints/${id}`);
    assert.ok(sum.tensors > 0, id);
    const cells = await page.locator(`#catalog tr.ckpt-row[data-id="${id}"] td`).allInnerTexts();
    assert.equal(cells[2], String(step), `${id}: ${cells}`);
    assert.equal(cells[4], format, `${id}: ${cells}`);
    assert.equal(cells[5], sum.tensors.toLocaleString("en-US"), `${id}: ${cells}`);
  }
  // One timestamp format for every row: native manifests and foreign listings alike.
  const createdCells = await page.locator("#catalog tr.ckpt-row td:nth-child(8)").allInnerTexts();
  for (const [i, c] of createdCells.entries()) {
    assert.ok(c === "–" || /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/.test(c), `row ${i}: ${c}`);
  }
  assert.ok(createdCells.filter((c) => c !== "–").length >= 4, createdCells.join(", "));
  // The page has an icon, and the server serves it.
  const icon = await page.locator('link[rel="icon"]').getAttribute("href");
  const iconAnswer = await page.request.get(base + icon);
  assert.equal(iconAnswer.status(), 200);
  assert.equal(iconAnswer.headers()["content-type"], "image/svg+xml");
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
  // The saved layout, data presence, and the model / optimizer split.
  assert.equal(await page.locator("#saved-mesh").innerText(), "pp=2 × dp=1 × tp=2 (4 ranks)");
  assert.equal(await page.locator("#data-presence").innerText(), "present");
  const comp = summary.composition;
  assert.ok(comp.model.elements > 0 && comp.optimizer.tensors > 0, JSON.stringify(comp));
  assert.match(await page.locator("#param-count").innerText(), new RegExp(`\\(${comp.model.elements.toLocaleString("en-US")}\\)$`));
  assert.match(await page.locator("#model-bytes").innerText(), new RegExp(`in ${comp.model.tensors} tensors$`));
  assert.match(await page.locator("#optimizer-bytes").innerText(), new RegExp(`^optimizer state .* in ${comp.optimizer.tensors.toLocaleString("en-US")} tensors$`));
  assert.match(await page.locator("#created").innerText(), /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/);
  assert.equal(await page.locator("#no-objects").innerText(), "This checkpoint saved no non-tensor objects.");
  // A filter nothing matches says so instead of showing an empty table.
  await page.fill("#filter", "no.such.tensor*");
  await page.locator("#no-match").waitFor();
  assert.match(await page.locator("#no-match").innerText(), /^No tensors match “no\.such\.tensor\*”/);
  assert.equal(await page.locator("#tensors").isVisible(), false);
  assert.equal(await page.locator("#tensor-count").innerText(), `0 of ${all.total} tensors`);
  await page.fill("#filter", "attn.qkv.weight");
  assert.equal(await page.locator("#no-match").isVisible(), false);
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
  // Per-rank totals, as the API gives them: one heat-map cell and one table row per rank.
  const planId = (await page.locator("#plan-id").innerText()).replace("plan ", "");
  const totals = await api(`/v1/plans/${planId}/ranks`);
  assert.equal(totals.world, 4);
  assert.deepEqual(totals.mesh, [{ name: "dp", size: 4 }]);
  assert.equal(await page.locator("#heatmap rect.heat-cell").count(), 4);
  assert.equal(await page.locator("#rank-table tr.rank-row").count(), 4);
  assert.ok(totals.ranks.bytes_read.every((b) => b > 0), String(totals.ranks.bytes_read));
  const maxRead = Math.max(...totals.ranks.bytes_read);
  const readRow = await page.locator('#rank-stats tr[data-metric="bytes_read"] td').allInnerTexts();
  assert.equal(readRow[3], String(totals.ranks.bytes_read.indexOf(maxRead)), readRow.join(" | "));
  assert.equal(await page.locator("#busiest li").count(), 4);
  assert.match(await page.locator("#busiest li").first().innerText(), new RegExp(`^rank ${totals.ranks.bytes_read.indexOf(maxRead)} \\(dp=`));
  // Sorting the table by bytes read puts the busiest rank first.
  await page.locator('#rank-table th[data-col="bytes_read"]').click();
  assert.equal(await page.locator("#rank-table tr.rank-row").first().getAttribute("data-rank"), String(totals.ranks.bytes_read.indexOf(maxRead)));
  // Drill-down into rank 2: its reads by file, as its overview gives them.
  await page.locator('#heatmap rect.heat-cell[data-rank="2"]').click();
  await page.locator("#rank-title").waitFor();
  assert.equal(await page.locator("#rank-title").innerText(), "Rank 2 (dp=2)");
  const overview = await api(`/v1/plans/${planId}/ranks/2/overview`);
  assert.equal(await page.locator("#rank-reads tr.read-row").count(), overview.reads.length);
  assert.ok(overview.reads.length > 0);
  assert.equal((await page.locator("#rank-reads tr.read-row td").first().innerText()), overview.reads[0].file);
  // The CLI command and the layout JSON of what is previewed.
  assert.equal(await page.locator("#cli-command").innerText(),
    'tessera layout fsdp --dp 4 > layout.json\ntessera plan "$ROOT/gpt/step-000200" --layout layout.json  # ROOT: the server\'s --root');
  await browser.grantPermissions(["clipboard-read", "clipboard-write"], { origin: base });
  await page.click("#copy-cli");
  await page.waitForFunction(() => document.getElementById("copy-note").textContent === "copied");
  assert.equal(await page.evaluate(() => navigator.clipboard.readText()), await page.locator("#cli-command").innerText());
  const [download] = await Promise.all([page.waitForEvent("download"), page.click("#download-layout")]);
  assert.equal(download.suggestedFilename(), "layout.json");
  const downloaded = JSON.parse(readFileSync(await download.path(), "utf8"));
  assert.deepEqual(downloaded, { mesh: [{ name: "dp", size: 4 }], rules: [{ match: "*", placements: ["shard(0)"] }] });
  await shot(page, "plan.png");

  // Megatron preset: tp2 pp2 dp2 = 8 ranks, drawn over the mesh; a rank's ring partners.
  await page.selectOption("#preset", "megatron");
  await page.fill("#meg-tp", "2");
  await page.fill("#meg-pp", "2");
  await page.fill("#meg-dp", "2");
  await page.click("#plan-button");
  await page.waitForFunction(() => document.querySelectorAll("#heatmap rect.heat-cell").length === 8);
  assert.equal(await page.locator("#amplification").innerText(), "read amplification 1.00");
  assert.match(await page.locator("#plan-shape").innerText(), /^8 ranks \(pp=2 × dp=2 × tp=2\)/);
  assert.match(await page.locator("#cli-command").innerText(), /^tessera layout megatron-gpt --tp 2 --pp 2 --dp 2 --num-layers 4 > layout\.json\n/);
  await page.locator('#rank-table tr.rank-row[data-rank="1"]').click();
  await page.waitForFunction(() => (document.getElementById("rank-title") || {}).textContent === "Rank 1 (pp=0 dp=0 tp=1)");
  // Rank 1's DP replica is rank 3: a ring of the two, sending to and receiving from it.
  const rounds = await page.locator("#rank-exchanges li.round").allInnerTexts();
  assert.ok(rounds.some((r) => /→ rank 3, receive .* ← rank 3$/.test(r)), rounds.join("\n"));

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

  // A DCP checkpoint: its non-tensor objects (optimizer param groups), model vs optimizer state,
  // and no saved layout recorded.
  await page.goto(`${base}/#/ckpt/dcp/step-000050`);
  await page.locator("#object-table").waitFor();
  const dcp = await api("/v1/checkpoints/dcp/step-000050");
  assert.ok(dcp.object_list.length > 0 && dcp.object_list.length === dcp.objects, JSON.stringify(dcp.object_list));
  assert.equal(await page.locator("#object-table tr.object-row").count(), dcp.objects);
  assert.equal(await page.locator("#object-table tr.object-row td").first().innerText(), dcp.object_list[0].key);
  assert.match(await page.locator("#objects h2").innerText(), new RegExp(`^Non-tensor objects \\(${dcp.objects}\\)$`));
  assert.equal(await page.locator("#saved-layout").innerText(), "not recorded");
  assert.match(await page.locator("#optimizer-bytes").innerText(), new RegExp(`in ${dcp.composition.optimizer.tensors} tensors$`));
  assert.equal(await page.locator("#writer").innerText(), "PyTorch DCP (version 1.0.0)");
  // No commit time in DCP's files: the newest file's, in the one format.
  assert.match(await page.locator("#created").innerText(), /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/);
  await shot(page, "checkpoint-dcp.png");

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

// Llama 3 405B, metadata only (5 TiB of tensors, no data files), previewed at 2,048 ranks
// (Megatron tp8 pp16 dp16): the aggregated views, a drill-down, and how long the preview took
// (logged, not asserted: the suite runs a debug build).
test("a 405B metadata-only checkpoint previewed at 2,048 ranks", { timeout: 600_000 }, async () => {
  const big = path.join(work, "big");
  const saved = path.join(work, "l405.json");
  writeFileSync(saved, tessera("layout", "megatron-gpt", "--tp", "8", "--pp", "16", "--dp", "64", "--num-layers", "126", "--zero1"));
  let t = performance.now();
  tessera("synth", "--model", "llama3-405b", "--layout", saved, "--out", path.join(big, "405b/step-000001"), "--metadata-only");
  console.log(`# 405B metadata-only synth: ${((performance.now() - t) / 1000).toFixed(1)} s`);
  const base = await serve(big);
  const page = await newPage();
  try {
    // The catalog marks it metadata-only.
    await page.goto(base + "/");
    await page.locator('#catalog tr.ckpt-row[data-id="405b/step-000001"]').waitFor();
    assert.match(await page.locator('#catalog tr.ckpt-row[data-id="405b/step-000001"] td').nth(3).innerText(), /^committed latest metadata only$|^committed metadata only$/);
    await page.goto(`${base}/#/ckpt/405b/step-000001`);
    await page.locator("#data-presence").waitFor();
    const sum = await (await page.request.get(`${base}/v1/checkpoints/405b/step-000001`)).json();
    assert.equal(sum.data, "absent");
    assert.match(await page.locator("#data-presence").innerText(), /^metadata only\s+no data files/);
    assert.equal(await page.locator("#saved-mesh").innerText(), "pp=16 × dp=64 × tp=8 (8,192 ranks)");
    // 405.9 B parameters, and three f32 optimizer states each.
    assert.ok(sum.composition.model.elements > 405e9 && sum.composition.model.elements < 406e9, JSON.stringify(sum.composition));
    assert.match(await page.locator("#param-count").innerText(), /^405\.9 B \(405,853,388,80\d\)$/);
    assert.match(await page.locator("#optimizer-bytes").innerText(), /^optimizer state 4\.\d+ TiB in 2,277 tensors$/);

    await page.locator("#plan-link").click();
    await page.locator("#plan-form").waitFor();
    await page.selectOption("#preset", "megatron");
    await page.fill("#meg-tp", "8");
    await page.fill("#meg-pp", "16");
    await page.fill("#meg-dp", "16");
    assert.equal(await page.locator("#meg-layers").inputValue(), "126", "the saved layout's layer count");
    const cells = () => document.querySelectorAll("#heatmap rect.heat-cell").length === 2048;
    t = performance.now();
    await page.click("#plan-button");
    await page.waitForFunction(cells, null, { timeout: 500_000 });
    const first = performance.now() - t;
    // Again, the plan now cached by the server: what the page itself takes.
    await page.evaluate(() => document.getElementById("plan-result").replaceChildren());
    t = performance.now();
    await page.click("#plan-button");
    await page.waitForFunction(cells, null, { timeout: 60_000 });
    const again = performance.now() - t;
    console.log(`# 405B at 2,048 ranks: preview rendered in ${(first / 1000).toFixed(2)} s with planning, ${(again / 1000).toFixed(2)} s with the plan cached (page's own count: ${await page.locator("#plan-result").getAttribute("data-render-ms")} ms)`);
    assert.match(await page.locator("#plan-shape").innerText(), /^2,048 ranks \(pp=16 × dp=16 × tp=8\)/);
    // Readable at this size: 16 rows (pp) of 128 cells (dp × tp), one page of the table.
    const mapText = await page.locator("#heatmap").textContent();
    assert.match(mapText, /rows: pp \(16\)/);
    assert.match(mapText, /columns: dp × tp \(128\)/);
    assert.equal(await page.locator("#rank-table tr.rank-row").count(), 100);
    assert.equal(await page.locator("#rank-page").innerText(), "ranks 1–100 of 2048");
    await page.click("#rank-next");
    assert.equal(await page.locator("#rank-page").innerText(), "ranks 101–200 of 2048");
    assert.equal(await page.locator("#busiest li").count(), 10);
    const planId = (await page.locator("#plan-id").innerText()).replace("plan ", "");
    const totals = await (await page.request.get(`${base}/v1/plans/${planId}/ranks`)).json();
    const reads = totals.ranks.bytes_read;
    const max = Math.max(...reads);
    const median = reads.slice().sort((a, b) => a - b);
    const row = await page.locator('#rank-stats tr[data-metric="bytes_read"] td').allInnerTexts();
    assert.equal(row[3], String(reads.indexOf(max)), row.join(" | "));
    assert.ok(median[0] <= median[1023] && median[1023] <= max);
    // The heat map's colour is the value: the busiest rank's cell darkest, the least busy lightest.
    const minRank = reads.indexOf(Math.min(...reads));
    assert.equal(await page.locator("#heatmap").getAttribute("data-metric"), "bytes_read");
    assert.ok(Math.min(...reads) < max, "ranks read different amounts");
    assert.equal(await page.locator(`#heatmap rect.heat-cell[data-rank="${reads.indexOf(max)}"]`).getAttribute("fill"), "#08306b");
    assert.equal(await page.locator(`#heatmap rect.heat-cell[data-rank="${minRank}"]`).getAttribute("fill"), "#f7fbff");
    assert.match(await page.locator(`#heatmap rect.heat-cell[data-rank="${minRank}"] title`).textContent(), new RegExp(`^rank ${minRank} \\(pp=\\d+ dp=\\d+ tp=\\d\\): read `));
    await page.selectOption("#heatmap-metric", "bytes_sent");
    await page.locator('#heatmap[data-metric="bytes_sent"]').waitFor();
    // Drill into the busiest rank: reads by file and its rings.
    await page.locator("#busiest li a").first().click();
    await page.locator("#rank-title").waitFor({ timeout: 60_000 });
    assert.match(await page.locator("#rank-title").innerText(), new RegExp(`^Rank ${reads.indexOf(max)} \\(pp=\\d+ dp=\\d+ tp=\\d\\)$`));
    assert.ok(await page.locator("#rank-reads tr.read-row").count() > 0);
    assert.ok(await page.locator("#rank-exchanges li.exchange").count() > 0);
    await shot(page, "plan-405b-2048.png");
    assert.deepEqual(page.problems, []);
  } catch (e) {
    await page.screenshot({ path: path.join(SHOTS, "failure-405b.png"), fullPage: true }).catch(() => {});
    throw new Error(`${e.message}\npage problems: ${page.problems.join("; ")}\nview: ${(await page.locator("#view").innerText().catch(() => "?")).slice(0, 2000)}`, { cause: e });
  } finally {
    await page.close();
  }
});

test("live publications next to the checkpoints, and one publication's steps", { timeout: 300_000 }, async () => {
  assert.ok(existsSync(PYTHON), `no Python at ${PYTHON} (make python-env, or set TESSERA_PYTHON to one with tessera and torch)`);
  // A 2-rank job publishes steps 1 and 2 (both committed); then rank 0 alone publishes step 3
  // (rank 1 never does: incomplete, rank 1 missing) and step 4, whose rank-1 part is garbage.
  const registry = path.join(work, "registry");
  mkdirSync(registry);
  const both = await Promise.all([publishRank(registry, 0, 2, "1,2", 60), publishRank(registry, 1, 2, "1,2", 60)]);
  assert.match(both[0], /rank 0 step 2: \d+ bytes served/, both[0]);
  const alone = await publishRank(registry, 0, 2, "3,4", 1);
  assert.match(alone, /rank 0 step 3: not committed/, alone);
  const badPart = path.join(registry, "policy/step-000004/parts/rank-1.json");
  writeFileSync(badPart, '{"rank": 1, "world": 2, "step"');
  const base = await serve(path.join(work, "root"), "--registry", registry);
  const page = await newPage();
  try {
    const api = async (p) => (await page.request.get(base + p)).json();
    const listed = await api("/v1/live/policy");
    assert.equal(listed.newest_complete, 2);

    // The catalog: the checkpoints' table, and the live publications' next to it.
    await page.goto(base + "/");
    await page.locator("#catalog tr.ckpt-row").first().waitFor();
    await page.locator("#live-table tr.live-row").first().waitFor();
    const section = await page.locator("#live").innerText();
    assert.ok(section.includes(`registry ${registry}: 1 publication(s)`), section);
    const cells = await page.locator('#live-table tr.live-row[data-name="policy"] td').allInnerTexts();
    // name, newest complete step, steps, publisher ranks, size, tensors: the API's numbers.
    assert.deepEqual(cells.slice(0, 4), ["policy", "2", "4", "2"], cells.join(" | "));
    const size = await page.evaluate((n) => fmtBytes(n), listed.bytes);
    assert.equal(cells[4], size);
    assert.equal(cells[5], String(listed.tensors));
    assert.equal(listed.tensors, 2);
    await shot(page, "catalog-live.png");

    // One publication: what live://policy loads, its publishers, its steps and their states.
    await page.locator('#live-table a', { hasText: "policy" }).click();
    await page.locator("#live-steps tr.step-row").first().waitFor();
    assert.equal(await page.locator("main h1").innerText(), "live://policy");
    assert.match(await page.locator("#live-facts").innerText(), /live:\/\/policy loads\s+step 2\b/);
    const publishers = await page.locator("#live-publishers tr.publisher-row td:nth-child(2)").allInnerTexts();
    assert.deepEqual(publishers, listed.publishers.map((p) => `${p.url}/${p.path}`));
    assert.equal(publishers.length, 2);
    const states = await page.locator("#live-steps tr.step-row").evaluateAll((rows) => rows.map((r) => `${r.dataset.step}:${r.dataset.state}`));
    assert.deepEqual(states, ["4:incomplete", "3:incomplete", "2:complete", "1:complete"]);
    const waiting = await page.locator('#live-steps tr.step-row[data-step="3"] td').allInnerTexts();
    assert.equal(waiting[2], "1 of 2", waiting.join(" | "));
    assert.equal(waiting[3], "1", waiting.join(" | "));
    assert.match(waiting[1], /publisher ranks \[1\] of 2 have not published it/);
    const malformed = await page.locator('#live-steps tr.step-row[data-step="4"] td').allInnerTexts();
    assert.ok(malformed[1].includes(`${badPart}: not a part`), malformed[1]);
    const committed = await page.locator('#live-steps tr.step-row[data-step="2"] td:nth-child(8)').innerText();
    assert.match(committed, /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$/);
    await shot(page, "live-policy.png");

    // An unknown publication: the server's 404, named, on the page.
    await page.goto(base + "/#/live/reward");
    await page.locator(".error").waitFor();
    assert.match(await page.locator(".error").innerText(), /Error 404 \(unknown_publication\): no live publication reward in registry/);
    assert.deepEqual(page.problems, []);
  } catch (e) {
    await page.screenshot({ path: path.join(SHOTS, "failure-live.png"), fullPage: true }).catch(() => {});
    throw new Error(`${e.message}\npage problems: ${page.problems.join("; ")}\nview: ${await page.locator("#view").innerText().catch(() => "?")}`, { cause: e });
  } finally {
    await page.close();
  }
});
