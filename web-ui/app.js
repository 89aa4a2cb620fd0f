// tessera web UI: catalog, checkpoint, tensor and plan preview pages over the /v1 API.
// No build step, no dependencies: hash routes render into #view.
"use strict";

const view = document.getElementById("view");
const crumbs = document.getElementById("crumbs");

// ---------- helpers ----------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
}
const fmtInt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
const shapeText = (shape) => "[" + shape.join(", ") + "]";
const enc = encodeURIComponent;
const ckptPath = (run, step) => `/v1/checkpoints/${enc(run)}/${enc(step)}`;

class ApiError extends Error {
  constructor(status, kind, detail) {
    super(detail);
    this.status = status;
    this.kind = kind;
  }
}

// Fetches JSON; a non-2xx answer becomes an ApiError carrying the server's `detail`.
async function api(path, init) {
  const headers = Object.assign({ Accept: "application/json" }, (init && init.headers) || {});
  const token = sessionStorage.getItem("tessera-token");
  if (token) headers.Authorization = "Bearer " + token;
  let res;
  try {
    res = await fetch(path, Object.assign({}, init, { headers }));
  } catch (e) {
    throw new ApiError(0, "network", `cannot reach the server: ${e.message}`);
  }
  const text = await res.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (_) { /* not JSON */ }
  if (!res.ok) {
    const detail = body && body.detail ? body.detail : text || res.statusText;
    throw new ApiError(res.status, body && body.error ? body.error : "http", detail);
  }
  return body;
}

function showError(err, where) {
  const box = h("div", { class: "error", role: "alert" },
    h("strong", {}, err.status ? `Error ${err.status}${err.kind ? " (" + err.kind + ")" : ""}: ` : "Error: "),
    err.message);
  if (err.status === 401) {
    const input = h("input", { type: "password", placeholder: "bearer token", "aria-label": "token" });
    box.append(h("p", {}, "This server needs a token: ", input, " ",
      h("button", { onclick: () => { sessionStorage.setItem("tessera-token", input.value); route(); } }, "Use token")));
  }
  fill(where || view, box);
}

// replaceChildren without the null/false placeholders of optional parts.
function fill(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
}

function setCrumbs(parts) {
  const out = [];
  parts.forEach(([label, href], i) => {
    if (i) out.push(h("span", { class: "sep" }, "/"));
    out.push(href ? h("a", { href }, label) : h("span", {}, label));
  });
  fill(crumbs, ...out);
}

// A table whose header cells sort it (click again to reverse).
function sortableTable(columns, rows, rowAttrs) {
  let sortKey = null;
  let dir = 1;
  const tbody = h("tbody");
  const head = h("tr");
  const table = h("table", {}, h("thead", {}, head), tbody);
  function render() {
    const sorted = rows.slice();
    if (sortKey !== null) {
      const col = columns[sortKey];
      sorted.sort((a, b) => {
        const x = col.sort(a), y = col.sort(b);
        return (x < y ? -1 : x > y ? 1 : 0) * dir;
      });
    }
    fill(tbody, ...sorted.map((r) =>
      h("tr", rowAttrs ? rowAttrs(r) : {}, ...columns.map((c) => h("td", { class: c.num ? "num" : "" }, c.cell(r))))));
    head.querySelectorAll("th").forEach((th, i) => {
      th.setAttribute("aria-sort", i === sortKey ? (dir > 0 ? "ascending" : "descending") : "none");
      th.querySelector(".arrow").textContent = i === sortKey ? (dir > 0 ? " ▲" : " ▼") : "";
    });
  }
  columns.forEach((c, i) => {
    head.append(h("th", {
      class: "sortable" + (c.num ? " num" : ""), "data-col": c.key, scope: "col",
      onclick: () => { if (sortKey === i) dir = -dir; else { sortKey = i; dir = 1; } render(); },
    }, c.title, h("span", { class: "arrow" })));
  });
  table.setRows = (r) => { rows = r; render(); };
  render();
  return table;
}

// ---------- catalog ----------

async function catalogPage() {
  setCrumbs([["catalog", null]]);
  const cat = await api("/v1/checkpoints");
  const title = h("h1", {}, "Checkpoints");
  if (!cat.checkpoints.length) {
    fill(view, title, h("div", { class: "empty", id: "empty-catalog" },
      h("p", {}, h("strong", {}, "The catalog is empty.")),
      h("p", {}, "No checkpoints under this server's root yet. Create some with ",
        h("code", {}, "tessera demo"), " or ",
        h("code", {}, "tessera synth --model gpt-tiny --layout l.json --out <root>/<run>/step-000100"), ".")));
    return;
  }
  const runs = h("p", { class: "muted" }, `${cat.runs.length} run(s), ${cat.checkpoints.length} checkpoint(s)`);
  // A run's latest pointer, as the id of the checkpoint it names (`<run>/<step>`).
  const latestOf = Object.fromEntries(cat.runs.map((r) => [r.run, r.latest]));
  const cols = [
    { key: "run", title: "run", cell: (c) => c.run, sort: (c) => c.run },
    {
      key: "checkpoint", title: "checkpoint",
      cell: (c) => c.status === "committed"
        ? h("a", { href: `#/ckpt/${enc(c.run)}/${enc(c.name)}` }, c.name)
        : h("span", {}, c.name),
      sort: (c) => c.name,
    },
    { key: "step", title: "step", num: true, cell: (c) => fmtInt(c.step), sort: (c) => c.step ?? -1 },
    {
      key: "status", title: "status",
      cell: (c) => [h("span", { class: "badge " + c.status, title: c.error || "" }, c.status),
        c.latest ? [" ", h("span", { class: "badge latest" }, "latest")] : null],
      sort: (c) => c.status,
    },
    { key: "format", title: "format", cell: (c) => c.format || "–", sort: (c) => c.format || "" },
    { key: "tensors", title: "tensors", num: true, cell: (c) => fmtInt(c.tensors), sort: (c) => c.tensors ?? -1 },
    { key: "size", title: "size", num: true, cell: (c) => fmtBytes(c.bytes), sort: (c) => c.bytes ?? -1 },
    { key: "created", title: "created", cell: (c) => c.created || "–", sort: (c) => c.created || "" },
  ];
  const table = sortableTable(cols, cat.checkpoints, (c) => ({ class: "ckpt-row", "data-id": c.id }));
  table.id = "catalog";
  const runList = h("ul", { class: "runs" }, ...cat.runs.map((r) =>
    h("li", {}, h("strong", {}, r.run), `: ${r.checkpoints} checkpoint(s), latest `,
      latestOf[r.run] ? h("a", { class: "latest-link", href: "#/ckpt/" + latestOf[r.run].split("/").map(enc).join("/") }, latestOf[r.run]) : "none")));
  // Entries the server could not read (a symlink loop, a permission error) are skipped from the
  // table; say which, so a missing checkpoint is not a mystery.
  const problems = (cat.problems || []).length
    ? h("div", { class: "problems", id: "catalog-problems" },
      h("p", {}, h("strong", {}, `${cat.problems.length} catalog entr${cat.problems.length === 1 ? "y" : "ies"} could not be read and ${cat.problems.length === 1 ? "is" : "are"} not listed:`)),
      h("ul", {}, ...cat.problems.map((p) => h("li", {}, h("code", {}, p.path), ": ", p.error))))
    : null;
  fill(view, title, runs, problems, table, h("h2", {}, "Runs"), runList);
}

// ---------- checkpoint ----------

async function checkpointPage(run, step) {
  setCrumbs([["catalog", "#/"], [`${run}/${step}`, null]]);
  const [sum, page] = await Promise.all([
    api(ckptPath(run, step)),
    api(ckptPath(run, step) + "/tensors?limit=10000"),
  ]);
  const facts = h("dl", { class: "facts" },
    h("dt", {}, "status"), h("dd", {}, sum.status, sum.latest ? " (latest)" : ""),
    h("dt", {}, "format"), h("dd", {}, sum.format || "–"),
    h("dt", {}, "written by"), h("dd", { id: "writer" }, sum.writer || "–"),
    h("dt", {}, "step"), h("dd", {}, fmtInt(sum.step)),
    h("dt", {}, "size"), h("dd", {}, `${fmtBytes(sum.bytes)} (tensor bytes ${fmtBytes(sum.tensor_bytes)})`),
    h("dt", {}, "tensors"), h("dd", {}, fmtInt(sum.tensors)),
    h("dt", {}, "saved boxes"), h("dd", {}, fmtInt(sum.chunks)),
    h("dt", {}, "files"), h("dd", {}, fmtInt(sum.files)),
    // What plans made from this page are bound to: a loader refuses a plan for another identity.
    h("dt", {}, "identity"), h("dd", { class: "mono", id: "identity" }, sum.identity || "–"));
  const base = `#/ckpt/${enc(run)}/${enc(step)}`;
  const cols = [
    { key: "fqn", title: "fqn", cell: (t) => h("a", { class: "mono", href: `${base}/tensor/${enc(t.fqn)}` }, t.fqn), sort: (t) => t.fqn },
    { key: "dtype", title: "dtype", cell: (t) => t.dtype, sort: (t) => t.dtype },
    { key: "shape", title: "shape", cell: (t) => shapeText(t.shape), sort: (t) => t.shape.reduce((a, b) => a * b, 1) },
    { key: "boxes", title: "saved boxes", num: true, cell: (t) => fmtInt(t.boxes), sort: (t) => t.boxes },
    { key: "bytes", title: "bytes", num: true, cell: (t) => fmtBytes(t.bytes), sort: (t) => t.bytes },
  ];
  const all = page.tensors;
  const table = sortableTable(cols, all, () => ({ class: "tensor-row" }));
  table.id = "tensors";
  const count = h("span", { id: "tensor-count", class: "muted" });
  const filter = h("input", { type: "search", id: "filter", placeholder: "filter by fqn (substring or glob * ?)", size: 40, "aria-label": "filter tensors" });
  const apply = () => {
    const f = filter.value.trim();
    let keep;
    if (!f) keep = all;
    else if (/[*?]/.test(f)) {
      const re = new RegExp("^" + f.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, ".*").replace(/\?/g, ".") + "$");
      keep = all.filter((t) => re.test(t.fqn));
    } else keep = all.filter((t) => t.fqn.includes(f));
    table.setRows(keep);
    count.textContent = `${keep.length} of ${page.total} tensors`;
  };
  filter.addEventListener("input", apply);
  apply();
  fill(view, 
    h("h1", {}, `${run}/${sum.name || step}`),
    facts,
    h("p", {}, h("a", { href: `${base}/plan`, id: "plan-link" }, "Plan preview →")),
    h("h2", {}, "Tensors"),
    h("div", { class: "toolbar" }, filter, count),
    page.total > all.length ? h("p", { class: "muted" }, `showing the first ${all.length} tensors`) : null,
    table);
}

// ---------- tensor ----------

const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

// The saved boxes over the tensor's shape: 2-D as rectangles, 1-D as a bar, more dims flattened
// to the first two (each box projected onto them), 0-dim as one cell.
function boxesSvg(shape, saved) {
  const W = 760;
  const pad = 30;
  const rows = shape.length >= 2 ? shape[0] : 1;
  const cols = shape.length >= 2 ? shape[1] : shape.length === 1 ? shape[0] : 1;
  const H = shape.length === 1 || shape.length === 0 ? 60 : Math.max(80, Math.min(460, Math.round(W * rows / Math.max(cols, 1))));
  const sx = W / Math.max(cols, 1);
  const sy = H / Math.max(rows, 1);
  const files = [...new Set(saved.map((b) => b.file))];
  const svg = s("svg", { id: "boxes", width: W + 2 * pad, height: H + 2 * pad, viewBox: `0 0 ${W + 2 * pad} ${H + 2 * pad}`, role: "img", "aria-label": "saved boxes" });
  svg.append(s("rect", { class: "outline", x: pad, y: pad, width: W, height: H, fill: "none", stroke: "#999", "stroke-dasharray": "4 3" }));
  svg.append(s("text", { x: pad, y: pad - 8 }, shape.length >= 2 ? `dim 1: ${cols}` : shape.length === 1 ? `dim 0: ${cols}` : "scalar"));
  if (shape.length >= 2) svg.append(s("text", { x: 4, y: pad + H / 2, transform: `rotate(-90 12 ${pad + H / 2})` }, `dim 0: ${rows}`));
  saved.forEach((b, i) => {
    let r0 = 0, rl = 1, c0 = 0, cl = 1;
    if (shape.length >= 2) { r0 = b.offsets[0]; rl = b.lengths[0]; c0 = b.offsets[1]; cl = b.lengths[1]; }
    else if (shape.length === 1) { c0 = b.offsets[0]; cl = b.lengths[0]; }
    const color = PALETTE[files.indexOf(b.file) % PALETTE.length];
    const box = `offsets [${b.offsets.join(", ")}] lengths [${b.lengths.join(", ")}]`;
    const range = `bytes ${fmtInt(b.byte_offset)}–${fmtInt(b.byte_offset + b.byte_length)} (${fmtBytes(b.byte_length)})`;
    const rect = s("rect", {
      class: "box", "data-index": i, "data-file": b.file,
      x: pad + c0 * sx, y: pad + r0 * sy, width: Math.max(cl * sx, 1), height: Math.max(rl * sy, 1), fill: color,
    }, s("title", {}, `box ${i}: ${box}\nfile ${b.file}\n${range}`));
    svg.append(rect);
  });
  return { svg, files };
}

async function tensorPage(run, step, fqn) {
  const base = `#/ckpt/${enc(run)}/${enc(step)}`;
  setCrumbs([["catalog", "#/"], [`${run}/${step}`, base], [fqn, null]]);
  const d = await api(`${ckptPath(run, step)}/tensors/${enc(fqn)}`);
  const t = d; // the tensor entry is flattened into the answer
  const { svg, files } = boxesSvg(t.shape, d.saved);
  const note = t.shape.length > 2 ? h("p", { class: "muted" }, `${t.shape.length}-D tensor: boxes drawn over the first two dims.`) : null;
  const legend = h("p", { class: "legend" }, "files: ", ...files.map((f, i) =>
    h("span", {}, h("span", { style: `color:${PALETTE[i % PALETTE.length]}` }, "■ "), h("code", {}, f), "  ")));
  const rows = d.saved.map((b, i) => h("tr", { class: "box-row" },
    h("td", { class: "num" }, i), h("td", { class: "mono" }, `[${b.offsets.join(", ")}]`), h("td", { class: "mono" }, `[${b.lengths.join(", ")}]`),
    h("td", { class: "mono" }, b.file), h("td", { class: "num" }, fmtInt(b.byte_offset)), h("td", { class: "num" }, fmtBytes(b.byte_length))));
  fill(view, 
    h("h1", { class: "mono" }, t.fqn),
    h("p", {}, `${t.dtype} ${shapeText(t.shape)}, ${fmtBytes(t.bytes)}, `, h("span", { id: "box-count" }, `${d.saved.length} saved box(es)`)),
    note, svg, legend,
    h("p", { class: "muted" }, "Hover a box for its file and byte range."),
    h("table", { id: "saved" }, h("thead", {}, h("tr", {}, ...["#", "offsets", "lengths", "file", "byte offset", "byte length"].map((c) => h("th", {}, c)))), h("tbody", {}, rows)));
}

// ---------- plan preview ----------

function fsdpLayout(dp) {
  return { mesh: [{ name: "dp", size: dp }], rules: [{ match: "*", placements: ["shard(0)"] }] };
}

// Mirrors `tessera layout megatron-gpt` (planner presets).
function megatronLayout(tp, pp, dp, numLayers, zero1) {
  const col = ["*attn.qkv.weight*", "*mlp.fc1.weight*", "*embed_tokens.weight*", "*lm_head.weight*"];
  const row = ["*attn.proj.weight*", "*mlp.fc2.weight*"];
  const rules = [];
  if (zero1) {
    for (const m of col) rules.push({ match: "optim.state." + m.slice(1, -1) + ".*", placements: ["stage(layer)", "shard(0)", "shard(0)"] });
    for (const m of row) rules.push({ match: "optim.state." + m.slice(1, -1) + ".*", placements: ["stage(layer)", "shard(0)", "shard(1)"] });
    rules.push({ match: "optim.state.*", placements: ["stage(layer)", "shard(0)", "replicate"] });
  }
  for (const m of col) rules.push({ match: m, placements: ["stage(layer)", "replicate", "shard(0)"] });
  for (const m of row) rules.push({ match: m, placements: ["stage(layer)", "replicate", "shard(1)"] });
  rules.push({ match: "*", placements: ["stage(layer)", "replicate", "replicate"] });
  return {
    mesh: [{ name: "pp", size: pp }, { name: "dp", size: dp }, { name: "tp", size: tp }],
    rules,
    stages: { layer_pattern: "layers\\.(\\d+)\\.", num_layers: numLayers, first: ["*embed*"], last: ["*lm_head*", "*final_norm*"] },
  };
}

// Per-rank bytes read and exchanged (sent) as grouped bars, one group per rank.
function rankChart(ranks) {
  const barW = 14, gap = 10, pad = 50, H = 220;
  const groupW = 2 * barW + gap;
  const W = Math.max(360, pad + ranks.length * groupW + 20);
  const max = Math.max(1, ...ranks.map((r) => Math.max(r.bytes_read, r.bytes_sent)));
  const svg = s("svg", { id: "rank-chart", width: W, height: H + 60, viewBox: `0 0 ${W} ${H + 60}`, role: "img", "aria-label": "bytes per rank" });
  svg.append(s("line", { x1: pad, y1: H + 10, x2: W - 10, y2: H + 10, stroke: "#999" }));
  svg.append(s("text", { x: 4, y: 20 }, fmtBytes(max)));
  svg.append(s("text", { x: 4, y: H + 10 }, "0"));
  ranks.forEach((r, i) => {
    const x = pad + i * groupW;
    const hr = (r.bytes_read / max) * (H - 10);
    const hs = (r.bytes_sent / max) * (H - 10);
    const g = s("g", { class: "rank-bar", "data-rank": r.rank },
      s("rect", { class: "bar-read", x, y: H + 10 - hr, width: barW, height: Math.max(hr, 0) },
        s("title", {}, `rank ${r.rank}: read ${fmtBytes(r.bytes_read)}`)),
      s("rect", { class: "bar-exchanged", x: x + barW, y: H + 10 - hs, width: barW, height: Math.max(hs, 0) },
        s("title", {}, `rank ${r.rank}: exchanged (sent) ${fmtBytes(r.bytes_sent)}, received ${fmtBytes(r.bytes_received)}`)));
    if (ranks.length <= 64 || i % Math.ceil(ranks.length / 32) === 0) g.append(s("text", { x, y: H + 26 }, r.rank));
    svg.append(g);
  });
  svg.append(s("text", { x: pad, y: H + 50 }, "rank"));
  return svg;
}

// Rank plans are fetched a few at a time; a chart of more than this many ranks is not readable.
const MAX_CHART_RANKS = 256;
const FETCH_PARALLEL = 8;

async function planPage(run, step) {
  const base = `#/ckpt/${enc(run)}/${enc(step)}`;
  setCrumbs([["catalog", "#/"], [`${run}/${step}`, base], ["plan preview", null]]);
  // The Megatron preset needs the layer count: the saved layout's, else counted from the FQNs.
  const [sum, norms] = await Promise.all([
    api(ckptPath(run, step)),
    api(ckptPath(run, step) + "/tensors?limit=1&filter=" + enc("model.layers.*.input_norm.weight")),
  ]);
  const numLayers = (sum.source_layout && sum.source_layout.stages && sum.source_layout.stages.num_layers) || norms.total || 1;
  const num = (id, label, value) => h("label", {}, label + " ", h("input", { type: "number", id, min: 1, value }));
  const preset = h("select", { id: "preset", "aria-label": "preset" },
    h("option", { value: "fsdp" }, "fsdp"), h("option", { value: "megatron" }, "megatron"), h("option", { value: "json" }, "layout JSON"));
  const fsdpFields = h("span", { id: "fsdp-fields" }, num("fsdp-dp", "dp", 4));
  const megFields = h("span", { id: "megatron-fields", hidden: true },
    num("meg-tp", "tp", 2), " ", num("meg-pp", "pp", 1), " ", num("meg-dp", "dp", 2), " ", num("meg-layers", "layers", numLayers), " ",
    h("label", {}, h("input", { type: "checkbox", id: "meg-zero1" }), " zero1"));
  const json = h("textarea", { id: "layout-json", hidden: true, "aria-label": "layout JSON", spellcheck: "false" },
    JSON.stringify(fsdpLayout(4), null, 2));
  preset.addEventListener("change", () => {
    fsdpFields.hidden = preset.value !== "fsdp";
    megFields.hidden = preset.value !== "megatron";
    json.hidden = preset.value !== "json";
  });
  const result = h("div", { id: "plan-result" });
  const button = h("button", { id: "plan-button", type: "submit" }, "Preview plan");
  const form = h("form", { id: "plan-form" },
    h("fieldset", {}, h("legend", {}, "Target layout"),
      h("div", { class: "toolbar" }, preset, fsdpFields, megFields), json),
    button);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const val = (id) => Number(document.getElementById(id).value);
    let layout;
    try {
      if (preset.value === "fsdp") layout = fsdpLayout(val("fsdp-dp"));
      else if (preset.value === "megatron") layout = megatronLayout(val("meg-tp"), val("meg-pp"), val("meg-dp"), val("meg-layers"), document.getElementById("meg-zero1").checked);
      else layout = JSON.parse(json.value);
    } catch (e) {
      showError(new ApiError(0, "", `the layout JSON does not parse: ${e.message}`), result);
      return;
    }
    button.disabled = true;
    fill(result, h("p", { class: "muted" }, "Planning…"));
    try {
      await showPlan(`${sum.run}/${sum.name}`, layout, result);
    } catch (e) {
      showError(e, result);
    } finally {
      button.disabled = false;
    }
  });
  fill(view, h("h1", {}, `Plan preview: ${run}/${sum.name || step}`),
    h("p", { class: "muted" }, "What every rank of a target layout would read from storage and exchange with its peers."),
    form, result);
}

async function showPlan(checkpoint, layout, out) {
  const created = await api("/v1/plans", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ checkpoint, layout }),
  });
  const sm = created.summary;
  const shown = Math.min(created.world, MAX_CHART_RANKS);
  const ranks = new Array(shown);
  let next = 0;
  async function worker() {
    while (next < shown) {
      const r = next++;
      const rp = await api(`/v1/plans/${created.plan}/ranks/${r}`);
      ranks[r] = Object.assign({ rank: r }, rp.summary);
    }
  }
  await Promise.all(Array.from({ length: Math.min(FETCH_PARALLEL, shown) }, worker));
  fill(out, 
    h("div", { class: "stats" },
      h("p", { id: "amplification" }, "read amplification ", h("strong", {}, sm.read_amplification.toFixed(2))),
      h("p", {}, `${created.world} ranks, ${fmtInt(sm.pieces)} pieces, ${fmtInt(sm.exchange_groups)} exchange groups, at most ${sm.max_rounds} ring rounds`),
      h("p", {}, `bytes needed ${fmtBytes(sm.bytes_needed)} (unique ${fmtBytes(sm.unique_bytes_needed)}), read ${fmtBytes(sm.bytes_read)}, exchanged ${fmtBytes(sm.bytes_exchanged)}, max read per rank ${fmtBytes(sm.max_read_per_rank)}`),
      h("p", { class: "muted mono" }, `plan ${created.plan}`)),
    h("h2", {}, "Per rank"),
    h("p", { class: "legend" }, h("span", { style: "color:#2f6fde" }, "■"), " bytes read  ", h("span", { style: "color:#f59f00" }, "■"), " bytes exchanged (sent)"),
    created.world > shown ? h("p", { class: "muted" }, `showing the first ${shown} of ${created.world} ranks`) : null,
    rankChart(ranks));
}

// ---------- routing ----------

async function route() {
  const hash = location.hash || "#/";
  const parts = hash.replace(/^#\/?/, "").split("/").filter((p) => p !== "").map(decodeURIComponent);
  fill(view, h("p", { class: "muted" }, "Loading…"));
  try {
    if (parts.length === 0) await catalogPage();
    else if (parts[0] === "ckpt" && parts.length === 3) await checkpointPage(parts[1], parts[2]);
    else if (parts[0] === "ckpt" && parts.length === 4 && parts[3] === "plan") await planPage(parts[1], parts[2]);
    else if (parts[0] === "ckpt" && parts.length === 5 && parts[3] === "tensor") await tensorPage(parts[1], parts[2], parts[4]);
    else throw new ApiError(0, "", `no page at ${hash}`);
  } catch (e) {
    showError(e);
  }
}

window.addEventListener("hashchange", route);
route();
