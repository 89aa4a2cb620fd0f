// tessera web UI: catalog (checkpoints and live publications), checkpoint, tensor, plan preview
// and live publication pages over the /v1 API.
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
// One timestamp format everywhere: UTC, to the second. The API gives RFC 3339 (any offset) or, for
// old native manifests, Unix seconds as a decimal string.
function fmtTime(t) {
  if (t === null || t === undefined || t === "") return "–";
  const d = /^\d+$/.test(String(t)) ? new Date(Number(t) * 1000) : new Date(t);
  if (Number.isNaN(d.getTime())) return String(t);
  return d.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
}
// Large counts the way people say them: 405.9 B parameters.
function fmtCount(n) {
  if (n === null || n === undefined) return "–";
  const v = Number(n);
  for (const [d, u] of [[1e12, " T"], [1e9, " B"], [1e6, " M"], [1e3, " K"]]) {
    if (v >= d) return (v / d).toFixed(v / d < 10 ? 2 : 1) + u;
  }
  return String(v);
}
const meshText = (mesh) => mesh.map((d) => `${d.name}=${d.size}`).join(" × ");
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
  // Live publications (a server started with --registry) are listed next to the checkpoints.
  const live = cat.live ? liveSection(cat.live) : null;
  if (!cat.checkpoints.length) {
    fill(view, title, h("div", { class: "empty", id: "empty-catalog" },
      h("p", {}, h("strong", {}, "The catalog is empty.")),
      h("p", {}, "No checkpoints under this server's root yet. Create some with ",
        h("code", {}, "tessera demo"), " or ",
        h("code", {}, "tessera synth --model gpt-tiny --layout l.json --out <root>/<run>/step-000100"), ".")),
      live);
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
        c.latest ? [" ", h("span", { class: "badge latest" }, "latest")] : null,
        c.data === "absent" ? [" ", h("span", { class: "badge metadata-only", title: "no data files: plans can be previewed, nothing can be loaded" }, "metadata only")] : null],
      sort: (c) => c.status,
    },
    { key: "format", title: "format", cell: (c) => c.format || "–", sort: (c) => c.format || "" },
    { key: "tensors", title: "tensors", num: true, cell: (c) => fmtInt(c.tensors), sort: (c) => c.tensors ?? -1 },
    { key: "size", title: "size", num: true, cell: (c) => fmtBytes(c.bytes), sort: (c) => c.bytes ?? -1 },
    { key: "created", title: "created", cell: (c) => fmtTime(c.created), sort: (c) => c.created ? (/^\d+$/.test(c.created) ? Number(c.created) * 1000 : Date.parse(c.created)) : -1 },
  ];
  const rows = cat.checkpoints.map((c) => Object.assign({}, c));
  const table = sortableTable(cols, rows, (c) => ({ class: "ckpt-row", "data-id": c.id }));
  table.id = "catalog";
  // The listing reads no foreign metadata (DCP, safetensors, …), so their rows come without tensor
  // counts and, in directories not named by step, without a step: fill them in from each one's
  // summary, a few at a time, without holding up the page.
  const missing = rows.filter((c) => c.status === "committed" && (c.tensors === null || c.tensors === undefined));
  (async () => {
    let next = 0;
    const worker = async () => {
      while (next < missing.length) {
        const c = missing[next++];
        try {
          const sum = await api(ckptPath(c.run, c.name));
          c.tensors = sum.tensors;
          if (c.step === null || c.step === undefined) c.step = sum.step;
          if (!c.writer) c.writer = sum.writer;
        } catch (_) { /* the row keeps its dash; its page shows the error */ }
      }
    };
    await Promise.all(Array.from({ length: Math.min(4, missing.length) }, worker));
    if (missing.length) { table.setRows(rows); table.dataset.filled = "true"; }
  })();
  if (!missing.length) table.dataset.filled = "true";
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
  fill(view, title, runs, problems, table, live, h("h2", {}, "Runs"), runList);
}

// ---------- live publications ----------

const livePath = (name) => `/v1/live/${enc(name)}`;
const rankList = (ranks) => (ranks && ranks.length ? ranks.join(", ") : "–");

// The catalog's section: one row per publication, its newest complete step (what live://NAME
// loads) with its publisher ranks and bytes.
function liveSection(live) {
  const pubs = live.publications || [];
  const head = [h("h2", { id: "live-title" }, "Live publications"),
    h("p", { class: "muted" }, `registry `, h("code", {}, live.registry), `: ${pubs.length} publication(s)`)];
  const problems = (live.problems || []).length
    ? h("div", { class: "problems", id: "live-problems" },
      h("ul", {}, ...live.problems.map((p) => h("li", {}, p))))
    : null;
  if (!pubs.length) {
    return h("section", { id: "live" }, head, problems, h("div", { class: "empty", id: "empty-live" },
      h("p", {}, "Nothing published in this registry yet: ", h("code", {}, "tessera.publish(state, name, step=..., registry=...)"), ".")));
  }
  const cols = [
    { key: "name", title: "name", cell: (p) => h("a", { href: `#/live/${enc(p.name)}` }, p.name), sort: (p) => p.name },
    {
      key: "newest", title: "newest complete step", num: true,
      cell: (p) => p.newest_complete === null || p.newest_complete === undefined
        ? h("span", { class: "badge incomplete" }, "none")
        : fmtInt(p.newest_complete),
      sort: (p) => p.newest_complete ?? -1,
    },
    { key: "steps", title: "steps", num: true, cell: (p) => fmtInt(p.steps_total), sort: (p) => p.steps_total },
    {
      key: "ranks", title: "publisher ranks", num: true,
      cell: (p) => (p.world === null || p.world === undefined ? "–" : fmtInt(p.world)),
      sort: (p) => p.world ?? -1,
    },
    { key: "size", title: "size", num: true, cell: (p) => fmtBytes(p.bytes), sort: (p) => p.bytes ?? -1 },
    { key: "tensors", title: "tensors", num: true, cell: (p) => fmtInt(p.tensors), sort: (p) => p.tensors ?? -1 },
  ];
  const table = sortableTable(cols, pubs, (p) => ({ class: "live-row", "data-name": p.name }));
  table.id = "live-table";
  return h("section", { id: "live" }, head, problems, table);
}

// One publication: what live://NAME loads now, its publishers, and its newest steps.
async function livePage(name) {
  setCrumbs([["catalog", "#/"], [`live://${name}`, null]]);
  const pub = await api(livePath(name) + "?steps=50");
  const loads = pub.newest_complete === null || pub.newest_complete === undefined
    ? h("span", { class: "badge incomplete" }, "no complete step yet")
    : h("span", {}, `step ${fmtInt(pub.newest_complete)}`);
  const facts = h("dl", { class: "facts", id: "live-facts" },
    h("dt", {}, "live://" + name + " loads"), h("dd", {}, loads),
    h("dt", {}, "publisher ranks"), h("dd", {}, pub.world === null || pub.world === undefined ? "–" : fmtInt(pub.world)),
    h("dt", {}, "size"), h("dd", {}, fmtBytes(pub.bytes)),
    h("dt", {}, "tensors"), h("dd", {}, fmtInt(pub.tensors)),
    h("dt", {}, "steps"), h("dd", {}, `${fmtInt(pub.steps_total)}` + (pub.steps_truncated ? ` (the newest ${pub.steps.length} listed)` : "")));
  const publishers = pub.publishers.length
    ? h("table", { id: "live-publishers" },
      h("thead", {}, h("tr", {}, h("th", { class: "num" }, "rank"), h("th", {}, "serves at"), h("th", { class: "num" }, "bytes"))),
      h("tbody", {}, ...pub.publishers.map((p) => h("tr", { class: "publisher-row", "data-rank": p.rank },
        h("td", { class: "num" }, fmtInt(p.rank)), h("td", { class: "mono" }, `${p.url}/${p.path}`), h("td", { class: "num" }, fmtBytes(p.bytes))))))
    : null;
  const stateCell = (st) => {
    const notes = [];
    if (st.detail) notes.push(h("div", { class: "muted" }, st.detail));
    for (const p of st.problems || []) notes.push(h("div", { class: "problem" }, p));
    return [h("span", { class: "badge " + st.state }, st.state), notes];
  };
  const cols = [
    { key: "step", title: "step", num: true, cell: (st) => fmtInt(st.step), sort: (st) => st.step },
    { key: "state", title: "state", cell: stateCell, sort: (st) => st.state },
    {
      key: "ranks", title: "ranks published", num: true,
      cell: (st) => (st.world === null || st.world === undefined ? "–" : `${st.ranks.length} of ${st.world}`),
      sort: (st) => st.ranks.length,
    },
    { key: "missing", title: "missing ranks", cell: (st) => rankList(st.missing_ranks), sort: (st) => st.missing_ranks.length },
    { key: "size", title: "size", num: true, cell: (st) => fmtBytes(st.bytes), sort: (st) => st.bytes ?? -1 },
    { key: "tensors", title: "tensors", num: true, cell: (st) => fmtInt(st.tensors), sort: (st) => st.tensors ?? -1 },
    { key: "published", title: "published", cell: (st) => fmtTime(st.published), sort: (st) => st.published || "" },
    { key: "committed", title: "committed", cell: (st) => fmtTime(st.committed), sort: (st) => st.committed || "" },
    { key: "leases", title: "leases", num: true, cell: (st) => fmtInt(st.leases), sort: (st) => st.leases },
  ];
  const steps = sortableTable(cols, pub.steps, (st) => ({ class: "step-row", "data-step": st.step, "data-state": st.state }));
  steps.id = "live-steps";
  fill(view, h("h1", {}, "live://" + name), facts,
    publishers ? [h("h2", {}, `Publishers of step ${fmtInt(pub.newest_complete)}`), publishers] : null,
    h("h2", {}, "Steps"),
    h("p", { class: "muted" }, "A step is loadable once every publisher rank has published it and rank 0 committed it; retired steps are no longer served."),
    h("div", { class: "scroll" }, steps));
}

// ---------- checkpoint ----------

async function checkpointPage(run, step) {
  setCrumbs([["catalog", "#/"], [`${run}/${step}`, null]]);
  const [sum, page] = await Promise.all([
    api(ckptPath(run, step)),
    api(ckptPath(run, step) + "/tensors?limit=10000"),
  ]);
  const mesh = sum.source_layout && Array.isArray(sum.source_layout.mesh) ? sum.source_layout.mesh : null;
  const world = mesh ? mesh.reduce((a, d) => a * d.size, 1) : null;
  const comp = sum.composition;
  const metadataOnly = sum.data === "absent";
  const facts = h("dl", { class: "facts" },
    h("dt", {}, "status"), h("dd", {}, sum.status, sum.latest ? " (latest)" : ""),
    h("dt", {}, "format"), h("dd", {}, sum.format || "–"),
    h("dt", {}, "written by"), h("dd", { id: "writer" }, sum.writer || "–"),
    h("dt", {}, "step"), h("dd", {}, fmtInt(sum.step)),
    h("dt", {}, "created"), h("dd", { id: "created" }, fmtTime(sum.created)),
    h("dt", {}, "data"), h("dd", { id: "data-presence" }, metadataOnly
      ? [h("span", { class: "badge metadata-only" }, "metadata only"), " no data files: plans can be previewed, nothing can be loaded"]
      : sum.data === "present" ? "present" : "–"),
    h("dt", {}, "saved layout"), h("dd", { id: "saved-layout" }, mesh
      ? [h("span", { id: "saved-mesh" }, `${meshText(mesh)} (${fmtInt(world)} ranks)`), " ",
        h("details", { class: "inline" }, h("summary", {}, "layout JSON"), h("pre", { id: "saved-layout-json" }, JSON.stringify(sum.source_layout, null, 2)))]
      : "not recorded"),
    h("dt", {}, "parameters"), h("dd", { id: "param-count" }, comp
      ? `${fmtCount(comp.model.elements)} (${fmtInt(comp.model.elements)})`
      : "–"),
    h("dt", {}, "tensor bytes"), h("dd", { id: "bytes-split" }, comp
      ? [h("span", { id: "model-bytes" }, `model ${fmtBytes(comp.model.bytes)} in ${fmtInt(comp.model.tensors)} tensors`), ", ",
        h("span", { id: "optimizer-bytes" }, comp.optimizer.tensors
          ? `optimizer state ${fmtBytes(comp.optimizer.bytes)} in ${fmtInt(comp.optimizer.tensors)} tensors`
          : "no optimizer state")]
      : fmtBytes(sum.tensor_bytes)),
    h("dt", {}, "size"), h("dd", {}, `${fmtBytes(sum.bytes)} stored`),
    h("dt", {}, "tensors"), h("dd", {}, fmtInt(sum.tensors)),
    h("dt", {}, "saved boxes"), h("dd", {}, fmtInt(sum.chunks)),
    h("dt", {}, "files"), h("dd", {}, fmtInt(sum.files)),
    // What plans made from this page are bound to: a loader refuses a plan for another identity.
    h("dt", {}, "identity"), h("dd", { class: "mono", id: "identity" }, sum.identity || "–"));
  const objectList = sum.object_list || [];
  const objects = h("section", { id: "objects" },
    h("h2", {}, `Non-tensor objects (${fmtInt(sum.objects || 0)})`),
    objectList.length
      ? h("table", { id: "object-table" }, h("thead", {}, h("tr", {}, h("th", {}, "key"), h("th", { class: "num" }, "bytes"))),
        h("tbody", {}, ...objectList.map((o) => h("tr", { class: "object-row" }, h("td", { class: "mono" }, o.key), h("td", { class: "num" }, fmtBytes(o.bytes))))))
      : h("p", { class: "muted", id: "no-objects" }, "This checkpoint saved no non-tensor objects."),
    (sum.objects || 0) > objectList.length ? h("p", { class: "muted" }, `showing the first ${objectList.length}`) : null);
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
  const noMatch = h("p", { id: "no-match", class: "empty", hidden: true });
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
    table.hidden = keep.length === 0;
    noMatch.hidden = keep.length !== 0;
    noMatch.textContent = `No tensors match “${f}”. A filter is a substring of the FQN, or a glob when it has * or ? (matched against the whole FQN).`;
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
    noMatch,
    table,
    objects);
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

// ----- plan preview: aggregated views that stay readable at thousands of ranks -----

// The per-rank metrics of `GET /v1/plans/{plan}/ranks`, as people read them.
const METRICS = [
  { key: "bytes_read", title: "read", fmt: fmtBytes },
  { key: "bytes_sent", title: "sent", fmt: fmtBytes },
  { key: "bytes_received", title: "received", fmt: fmtBytes },
  { key: "bytes_needed", title: "needed", fmt: fmtBytes },
  { key: "pieces", title: "pieces", fmt: fmtInt },
  { key: "pieces_read", title: "pieces read", fmt: fmtInt },
  { key: "rounds", title: "rounds", fmt: fmtInt },
];
const BUSIEST = 10;
const TABLE_PAGE = 100;

// A rank's coordinates over the mesh (row-major, last dim fastest), e.g. "pp=1 dp=3 tp=0".
function coordsOf(rank, mesh) {
  const out = [];
  let r = rank;
  for (let i = mesh.length - 1; i >= 0; i--) { out[i] = r % mesh[i].size; r = Math.floor(r / mesh[i].size); }
  return out;
}
const coordText = (rank, mesh) => coordsOf(rank, mesh).map((c, i) => `${mesh[i].name}=${c}`).join(" ");

function stats(values) {
  const sorted = Float64Array.from(values).sort();
  const n = sorted.length;
  const median = n % 2 ? sorted[(n - 1) / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  let maxRank = 0;
  values.forEach((v, i) => { if (v > values[maxRank]) maxRank = i; });
  return { min: sorted[0], median, max: sorted[n - 1], maxRank };
}

// The mesh split into heat-map rows (the leading dims) and columns (the trailing ones), picking
// the split whose grid is closest to four times as wide as tall, so 2,048 ranks of
// pp16 × dp16 × tp8 draw as 16 rows of 128 cells rather than one strip.
function gridOf(mesh) {
  let best = null;
  for (let k = 0; k <= mesh.length; k++) {
    const rows = mesh.slice(0, k).reduce((a, d) => a * d.size, 1);
    const cols = mesh.slice(k).reduce((a, d) => a * d.size, 1);
    const score = Math.abs(Math.log((cols / rows) / 4));
    if (!best || score < best.score) best = { k, rows, cols, score };
  }
  return best;
}

const HEAT = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];
function heatColor(v, min, max) {
  if (max <= min) return HEAT[4];
  const i = Math.min(HEAT.length - 1, Math.floor(((v - min) / (max - min)) * HEAT.length));
  return HEAT[i];
}

// The heat map of one metric over the mesh: a cell per rank, its colour the metric's value
// between the minimum and maximum over all ranks; a click opens the rank.
function heatMap(mesh, values, metric, onPick) {
  const g = gridOf(mesh);
  const rowDims = mesh.slice(0, g.k), colDims = mesh.slice(g.k);
  const W = 1000, padL = 90, padT = 34;
  const cell = Math.max(3, Math.min(28, Math.floor(W / g.cols)));
  const rowH = Math.max(3, Math.min(28, cell * 1.5));
  // At least wide enough for the axis captions and the legend, however few the columns.
  const width = Math.max(padL + g.cols * cell + 10, padL + HEAT.length * 24 + 260), height = padT + g.rows * rowH + 40;
  const { min, max } = stats(values);
  const svg = s("svg", { id: "heatmap", width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "data-metric": metric.key,
    "aria-label": `${metric.title} per rank over ${meshText(mesh)}` });
  svg.append(s("text", { x: padL + 40, y: 14 }, `columns: ${colDims.length ? colDims.map((d) => d.name).join(" × ") : "–"} (${g.cols})`));
  svg.append(s("text", { x: 4, y: 14 }, `rows: ${rowDims.length ? rowDims.map((d) => d.name).join(" × ") : "–"} (${g.rows})`));
  const labelEvery = Math.ceil(g.rows / 32);
  for (let row = 0; row < g.rows; row++) {
    if (row % labelEvery === 0) {
      const first = row * g.cols;
      const label = rowDims.length ? coordsOf(first, mesh).slice(0, g.k).map((c, i) => `${rowDims[i].name}${c}`).join(" ") : "";
      svg.append(s("text", { x: 4, y: padT + row * rowH + Math.min(rowH, 12) }, label));
    }
  }
  const cells = s("g", { class: "cells" });
  values.forEach((v, rank) => {
    const row = Math.floor(rank / g.cols), col = rank % g.cols;
    cells.append(s("rect", { class: "heat-cell", "data-rank": rank, x: padL + col * cell, y: padT + row * rowH,
      width: Math.max(cell - 1, 1), height: Math.max(rowH - 1, 1), fill: heatColor(v, min, max) },
      s("title", {}, `rank ${rank} (${coordText(rank, mesh)}): ${metric.title} ${metric.fmt(v)}`)));
  });
  cells.addEventListener("click", (ev) => {
    const r = ev.target.getAttribute && ev.target.getAttribute("data-rank");
    if (r !== null && r !== undefined) onPick(Number(r));
  });
  svg.append(cells);
  // Legend: the scale from min to max.
  const ly = padT + g.rows * rowH + 12;
  HEAT.forEach((c, i) => svg.append(s("rect", { x: padL + i * 24, y: ly, width: 24, height: 10, fill: c, stroke: "#ccc" })));
  svg.append(s("text", { x: padL + HEAT.length * 24 + 8, y: ly + 10 }, `${metric.fmt(min)} … ${metric.fmt(max)}`));
  return svg;
}

// The per-rank table: sortable by any metric, a page of ranks at a time (2,048 rows at once are
// neither readable nor quick to draw).
function rankTable(cols, mesh, world, onPick) {
  let order = Array.from({ length: world }, (_, i) => i);
  let sortKey = "rank", dir = 1, page = 0;
  const tbody = h("tbody");
  const head = h("tr");
  const info = h("span", { id: "rank-page", class: "muted" });
  const prev = h("button", { type: "button", id: "rank-prev", class: "secondary" }, "← previous");
  const next = h("button", { type: "button", id: "rank-next", class: "secondary" }, "next →");
  const headers = [["rank", "rank"], ["coords", "coordinates"], ...METRICS.map((m) => [m.key, m.title])];
  function sortBy(key) {
    if (key === "coords") key = "rank";
    if (sortKey === key) dir = -dir; else { sortKey = key; dir = key === "rank" ? 1 : -1; }
    const col = key === "rank" ? null : cols[key];
    order.sort((a, b) => ((col ? col[a] - col[b] : a - b) || a - b) * dir);
    page = 0;
    render();
  }
  function render() {
    const pages = Math.max(1, Math.ceil(world / TABLE_PAGE));
    page = Math.max(0, Math.min(page, pages - 1));
    const lo = page * TABLE_PAGE, hi = Math.min(world, lo + TABLE_PAGE);
    fill(tbody, ...order.slice(lo, hi).map((r) => h("tr", { class: "rank-row", "data-rank": r, onclick: () => onPick(r) },
      h("td", { class: "num" }, h("a", { href: "javascript:void 0" }, String(r))),
      h("td", { class: "mono" }, coordText(r, mesh)),
      ...METRICS.map((m) => h("td", { class: "num" }, m.fmt(cols[m.key][r]))))));
    info.textContent = `ranks ${lo + 1}–${hi} of ${world}`;
    prev.disabled = page === 0;
    next.disabled = page >= pages - 1;
    head.querySelectorAll("th").forEach((th) => {
      const k = th.getAttribute("data-col");
      const on = k === sortKey || (k === "coords" && sortKey === "rank");
      th.setAttribute("aria-sort", on ? (dir > 0 ? "ascending" : "descending") : "none");
    });
  }
  headers.forEach(([key, title]) => head.append(h("th", { class: "sortable" + (key === "coords" ? "" : " num"), "data-col": key, scope: "col", onclick: () => sortBy(key) }, title)));
  prev.addEventListener("click", () => { page--; render(); });
  next.addEventListener("click", () => { page++; render(); });
  render();
  return h("div", {}, h("table", { id: "rank-table" }, h("thead", {}, head), tbody), h("div", { class: "toolbar" }, prev, info, next));
}

// One rank's plan, fetched when asked for: its totals, reads by data file and ring partners.
async function showRank(planId, rank, mesh, out) {
  fill(out, h("p", { class: "muted" }, `Loading rank ${rank}…`));
  out.scrollIntoView({ block: "nearest" });
  try {
    const o = await api(`/v1/plans/${planId}/ranks/${rank}/overview`);
    const MAX_ROUNDS = 32;
    fill(out,
      h("h3", { id: "rank-title" }, `Rank ${o.rank} (${coordText(o.rank, mesh)})`),
      h("p", { id: "rank-totals" }, `needs ${fmtBytes(o.bytes_needed)} in ${fmtInt(o.destinations)} buffers of ${fmtInt(o.tensors)} tensors; reads ${fmtBytes(o.bytes_read)}, sends ${fmtBytes(o.bytes_sent)}, receives ${fmtBytes(o.bytes_received)}; ${fmtInt(o.pieces)} pieces`),
      h("h4", {}, "Reads by file"),
      o.reads.length
        ? h("table", { id: "rank-reads" }, h("thead", {}, h("tr", {}, h("th", {}, "file"), h("th", { class: "num" }, "pieces"), h("th", { class: "num" }, "bytes"))),
          h("tbody", {}, ...o.reads.map((r) => h("tr", { class: "read-row" }, h("td", { class: "mono" }, r.file), h("td", { class: "num" }, fmtInt(r.pieces)), h("td", { class: "num" }, fmtBytes(r.bytes))))))
        : h("p", { class: "muted", id: "rank-reads" }, "This rank reads nothing from storage: its peers send it everything."),
      h("h4", {}, "Ring exchanges"),
      o.exchanges.length
        ? h("ul", { id: "rank-exchanges" }, ...o.exchanges.map((e) => h("li", { class: "exchange" },
          `group ${e.group}: ring of ${e.members.length} ranks, this rank at position ${e.position}`,
          e.members.length <= 16 ? ` (${e.members.join(", ")})` : ` (${e.members.slice(0, 8).join(", ")}, … ${e.members[e.members.length - 1]})`,
          e.rounds.length
            ? h("ul", {}, ...e.rounds.slice(0, MAX_ROUNDS).map((r) => h("li", { class: "round" },
              `round ${r.round}: send ${fmtBytes(r.send_bytes)} → rank ${r.send_to}, receive ${fmtBytes(r.recv_bytes)} ← rank ${r.recv_from}`)),
              e.rounds.length > MAX_ROUNDS ? h("li", { class: "muted" }, `… ${e.rounds.length - MAX_ROUNDS} more rounds`) : null)
            : h("span", { class: "muted" }, ": nothing to send or receive"))))
        : h("p", { class: "muted", id: "rank-exchanges" }, "No exchange: no other rank needs what this rank needs."));
  } catch (e) {
    showError(e, out);
  }
}

// What the CLI runs for this preview: the layout (by preset, or the JSON downloaded next to it)
// and `tessera plan` on the checkpoint under the server's root.
function cliCommand(checkpoint, preset) {
  const layoutCmd = preset.kind === "fsdp"
    ? `tessera layout fsdp --dp ${preset.dp} > layout.json`
    : preset.kind === "megatron"
      ? `tessera layout megatron-gpt --tp ${preset.tp} --pp ${preset.pp} --dp ${preset.dp} --num-layers ${preset.layers}${preset.zero1 ? " --zero1" : ""} > layout.json`
      : "# layout.json: the layout JSON (Download layout JSON)";
  return `${layoutCmd}\ntessera plan "$ROOT/${checkpoint}" --layout layout.json  # ROOT: the server's --root`;
}

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
    let chosen;
    try {
      if (preset.value === "fsdp") {
        chosen = { kind: "fsdp", dp: val("fsdp-dp") };
        layout = fsdpLayout(chosen.dp);
      } else if (preset.value === "megatron") {
        chosen = { kind: "megatron", tp: val("meg-tp"), pp: val("meg-pp"), dp: val("meg-dp"), layers: val("meg-layers"), zero1: document.getElementById("meg-zero1").checked };
        layout = megatronLayout(chosen.tp, chosen.pp, chosen.dp, chosen.layers, chosen.zero1);
      } else {
        chosen = { kind: "json" };
        layout = JSON.parse(json.value);
      }
    } catch (e) {
      showError(new ApiError(0, "", `the layout JSON does not parse: ${e.message}`), result);
      return;
    }
    button.disabled = true;
    fill(result, h("p", { class: "muted" }, "Planning…"));
    try {
      await showPlan(`${sum.run}/${sum.name}`, layout, result, chosen);
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

async function showPlan(checkpoint, layout, out, preset) {
  const started = performance.now();
  const created = await api("/v1/plans", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ checkpoint, layout }),
  });
  const sm = created.summary;
  const table = await api(`/v1/plans/${created.plan}/ranks`);
  const cols = table.ranks;
  const world = table.world;
  const mesh = table.mesh && table.mesh.length ? table.mesh : [{ name: "rank", size: world }];

  const command = cliCommand(checkpoint, preset);
  const copyNote = h("span", { id: "copy-note", class: "muted" });
  const copy = h("button", { type: "button", id: "copy-cli", class: "secondary", onclick: async () => {
    try { await navigator.clipboard.writeText(command); copyNote.textContent = "copied"; }
    catch (_) { copyNote.textContent = "select the command below and copy it"; }
  } }, "Copy CLI command");
  const layoutUrl = URL.createObjectURL(new Blob([JSON.stringify(layout, null, 2) + "\n"], { type: "application/json" }));
  const download = h("a", { id: "download-layout", class: "button secondary", href: layoutUrl, download: "layout.json" }, "Download layout JSON");

  const distribution = h("table", { id: "rank-stats" },
    h("thead", {}, h("tr", {}, ...["per rank", "min", "median", "max", "busiest rank"].map((t, i) => h("th", { class: i ? "num" : "" }, t)))),
    h("tbody", {}, ...METRICS.map((m) => {
      const st = stats(cols[m.key]);
      return h("tr", { "data-metric": m.key }, h("th", { scope: "row" }, m.title),
        h("td", { class: "num" }, m.fmt(st.min)), h("td", { class: "num" }, m.fmt(st.median)), h("td", { class: "num" }, m.fmt(st.max)),
        h("td", { class: "num" }, String(st.maxRank)));
    })));

  const detail = h("div", { id: "rank-detail", class: "detail" }, h("p", { class: "muted" }, "Click a rank (heat map, busiest list or table) to see its reads by file and its ring partners."));
  const pick = (r) => showRank(created.plan, r, mesh, detail);

  const metricSelect = h("select", { id: "heatmap-metric", "aria-label": "heat map metric" },
    ...METRICS.map((m) => h("option", { value: m.key }, m.title)));
  const mapBox = h("div", { class: "scroll" });
  const drawMap = () => fill(mapBox, heatMap(mesh, cols[metricSelect.value], METRICS.find((m) => m.key === metricSelect.value), pick));
  metricSelect.addEventListener("change", drawMap);
  drawMap();

  const busiest = Array.from({ length: world }, (_, i) => i)
    .sort((a, b) => cols.bytes_read[b] - cols.bytes_read[a] || cols.bytes_sent[b] - cols.bytes_sent[a] || a - b)
    .slice(0, BUSIEST);
  const busiestList = h("ol", { id: "busiest" }, ...busiest.map((r) => h("li", { class: "busy-rank", "data-rank": r },
    h("a", { href: "javascript:void 0", onclick: () => pick(r) }, `rank ${r}`), ` (${coordText(r, mesh)}): read ${fmtBytes(cols.bytes_read[r])}, sent ${fmtBytes(cols.bytes_sent[r])}, received ${fmtBytes(cols.bytes_received[r])}`)));

  fill(out,
    h("div", { class: "stats" },
      h("p", { id: "amplification" }, "read amplification ", h("strong", {}, sm.read_amplification.toFixed(2))),
      h("p", { id: "plan-shape" }, `${fmtInt(created.world)} ranks (${meshText(mesh)}), ${fmtInt(sm.pieces)} pieces, ${fmtInt(sm.exchange_groups)} exchange groups, at most ${sm.max_rounds} ring rounds`),
      h("p", {}, `bytes needed ${fmtBytes(sm.bytes_needed)} (unique ${fmtBytes(sm.unique_bytes_needed)}), read ${fmtBytes(sm.bytes_read)}, exchanged ${fmtBytes(sm.bytes_exchanged)}, max read per rank ${fmtBytes(sm.max_read_per_rank)}`),
      h("p", { class: "muted mono", id: "plan-id" }, `plan ${created.plan}`)),
    h("div", { class: "toolbar" }, copy, download, copyNote),
    h("pre", { id: "cli-command" }, command),
    h("h2", {}, "Per rank"),
    distribution,
    h("h3", {}, "Heat map over the mesh"),
    h("div", { class: "toolbar" }, h("label", {}, "metric ", metricSelect), h("span", { class: "muted" }, "darker is more; hover a cell for its value, click it for the rank's plan")),
    mapBox,
    h("h3", {}, `Busiest ranks (by bytes read)`),
    busiestList,
    detail,
    h("h3", {}, "All ranks"),
    rankTable(cols, mesh, world, pick));
  out.dataset.renderMs = String(Math.round(performance.now() - started));
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
    else if (parts[0] === "live" && parts.length === 2) await livePage(parts[1]);
    else throw new ApiError(0, "", `no page at ${hash}`);
  } catch (e) {
    showError(e);
  }
}

window.addEventListener("hashchange", route);
route();
