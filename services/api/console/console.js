// vidq console: plain JavaScript against the /v1 API of the origin that serves it (no build step, no library).
// The API key stays in this browser (sessionStorage, or localStorage when "remember" is ticked) and goes out only
// in the Authorization header. Progress streams are read with fetch(), since EventSource cannot send that header.
"use strict";

const KEY_STORE = "vidq.apiKey";
const PAGE_SIZE = 12;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const FORM_FIELDS = [
  "prompt", "negative_prompt", "width", "height", "duration_s", "fps", "steps", "guidance_scale", "seed", "webhook_url",
];

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const state = {
  key: null,
  cursor: null,
  selected: null, // the job shown in the detail panel
  stream: null, // AbortController of its progress stream
  webhookTimer: null,
  webhookLooks: 0, // how often the deliveries of the selected job were looked at without a settled answer
  cards: new Map(), // job id → its card in the list
};

class ApiError extends Error {
  constructor(status, error) {
    super((error && error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = error && error.code;
    this.details = error && error.details;
  }
}

// ---- API ------------------------------------------------------------------------------------------------------

async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { Authorization: `Bearer ${state.key}`, Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, { method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, { code: "network", message: "the API did not answer (network error)" });
  }
  if (response.ok) return response.status === 204 ? null : response.json();
  let error = null;
  try {
    error = (await response.json()).error;
  } catch (_) {
    // not the API's envelope (a proxy's page): the status says enough
  }
  const failure = new ApiError(response.status, error);
  if (response.status === 401) keyRejected(failure);
  throw failure;
}

// ---- the API key ----------------------------------------------------------------------------------------------

function storedKey() {
  return sessionStorage.getItem(KEY_STORE) || localStorage.getItem(KEY_STORE);
}

function setKeyStatus(text, kind) {
  const el = $("key-status");
  el.textContent = text;
  el.className = `key-status ${kind || ""}`;
}

function keyRejected(err) {
  setKeyStatus(`Invalid API key: ${err.message}. Paste a key from \`vidq create-key\`.`, "bad");
  $("api-key").setAttribute("aria-invalid", "true");
}

async function useKey(key, { remember }) {
  state.key = key;
  sessionStorage.setItem(KEY_STORE, key);
  if (remember) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
  $("api-key").removeAttribute("aria-invalid");
  setKeyStatus("Checking the key…");
  clearDetail();
  try {
    await loadJobs({ reset: true });
  } catch (err) {
    if (err.status !== 401) setKeyStatus(`Could not list jobs: ${err.message}`, "bad");
    return;
  }
  setKeyStatus("Key accepted.", "ok");
  const wanted = jobIdFromHash();
  if (wanted) selectJob(wanted);
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORE);
  localStorage.removeItem(KEY_STORE);
  state.key = null;
  $("api-key").value = "";
  clearDetail();
  clearJobs();
  setKeyStatus("Key forgotten.");
}

// ---- submitting a job -----------------------------------------------------------------------------------------

function formBody() {
  const value = (name) => $(`f-${name}`).value.trim();
  const number = (name) => (value(name) === "" ? undefined : Number(value(name)));
  const body = { prompt: value("prompt") };
  if (value("negative_prompt")) body.negative_prompt = value("negative_prompt");
  const size = $("f-size").value;
  if (size === "custom") {
    body.width = number("width");
    body.height = number("height");
  } else {
    body.resolution = size;
  }
  for (const name of ["duration_s", "fps", "steps", "guidance_scale", "seed"]) {
    const n = number(name);
    if (n !== undefined) body[name] = n;
  }
  if (value("webhook_url")) body.webhook_url = value("webhook_url");
  body.cache = $("f-cache").checked;
  return body;
}

function clearFormErrors() {
  $("form-error").hidden = true;
  $("form-error").replaceChildren();
  for (const name of FORM_FIELDS) {
    const input = $(`f-${name}`);
    input.removeAttribute("aria-invalid");
    input.removeAttribute("aria-describedby");
    const note = $(`err-${name}`);
    if (note) note.remove();
  }
}

function showFormError(err) {
  const box = $("form-error");
  const title = document.createElement("strong");
  title.textContent = err.status === 422 ? "The API refused this request: " : "Could not submit: ";
  box.append(title, document.createTextNode(err.message));
  // Validation errors name their field (loc ["body", "width"]): mark that field and say why next to it.
  const general = [];
  for (const detail of Array.isArray(err.details) ? err.details : []) {
    const field = Array.isArray(detail.loc) ? detail.loc[detail.loc.length - 1] : null;
    const input = FORM_FIELDS.includes(field) ? $(`f-${field}`) : null;
    const msg = String(detail.msg || "").replace(/^Value error, /, "");
    if (!input) {
      general.push(msg);
      continue;
    }
    input.setAttribute("aria-invalid", "true");
    let note = $(`err-${field}`);
    if (!note) {
      note = document.createElement("span");
      note.id = `err-${field}`;
      note.className = "field-error";
      input.after(note);
      input.setAttribute("aria-describedby", note.id);
    }
    note.textContent = msg;
  }
  if (general.length > 1) {
    const list = document.createElement("ul");
    for (const msg of general) {
      const li = document.createElement("li");
      li.textContent = msg;
      list.append(li);
    }
    box.append(list);
  }
  box.hidden = false;
}

async function submitJob(event) {
  event.preventDefault();
  clearFormErrors();
  if (!state.key) {
    showFormError(new ApiError(0, { message: "paste an API key first (top right)" }));
    return;
  }
  // The API validates everything it receives; only what a number field cannot even hand over is caught here.
  const unreadable = FORM_FIELDS.filter((name) => $(`f-${name}`).validity.badInput);
  if (unreadable.length) {
    const details = unreadable.map((name) => ({ loc: ["body", name], msg: "not a number" }));
    showFormError(new ApiError(0, { message: "some fields do not hold a number", details }));
    return;
  }
  const button = $("submit-job");
  button.disabled = true;
  try {
    const job = await api("/v1/jobs", { method: "POST", body: formBody() });
    upsertCard(job, { first: true });
    $("jobs-empty").hidden = true;
    showJob(job);
  } catch (err) {
    showFormError(err);
  } finally {
    button.disabled = false;
  }
}

// ---- the list of jobs -----------------------------------------------------------------------------------------

function clearJobs() {
  $("job-list").replaceChildren();
  state.cards.clear();
  state.cursor = null;
  $("more-jobs").hidden = true;
  $("jobs-empty").hidden = false;
}

async function loadJobs({ reset }) {
  const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if ($("status-filter").value) params.set("status", $("status-filter").value);
  if (!reset && state.cursor) params.set("cursor", state.cursor);
  let page;
  try {
    page = await api(`/v1/jobs?${params}`);
  } catch (err) {
    if (reset) clearJobs();
    throw err;
  }
  if (reset) clearJobs();
  for (const job of page.data) upsertCard(job, { first: false });
  state.cursor = page.next_cursor;
  $("more-jobs").hidden = !page.next_cursor;
  $("jobs-empty").hidden = state.cards.size > 0;
}

function relativeTime(iso) {
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  if (seconds < 60) return "just now";
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return new Date(iso).toLocaleDateString();
}

function badge(status) {
  const el = document.createElement("span");
  el.className = `badge ${status}`;
  el.textContent = status;
  return el;
}

function upsertCard(job, { first }) {
  const li = document.createElement("li");
  const card = document.createElement("button");
  card.type = "button";
  card.className = "job-card";
  card.dataset.jobId = job.id;
  card.setAttribute("aria-label", `${job.status}: ${job.prompt}`);
  if (state.selected && state.selected.id === job.id) card.setAttribute("aria-current", "true");
  const thumb = document.createElement("div");
  thumb.className = "thumb";
  if (job.output && job.output.poster_url) {
    const img = document.createElement("img");
    img.src = job.output.poster_url;
    img.alt = `poster of job ${job.id}`;
    img.loading = "lazy";
    thumb.append(img);
  } else {
    thumb.textContent = job.status === "succeeded" ? "no poster" : `${job.progress.percent}%`;
  }
  const meta = document.createElement("div");
  meta.className = "meta";
  const line = document.createElement("div");
  line.className = "line";
  const time = document.createElement("time");
  time.dateTime = job.created_at;
  time.textContent = relativeTime(job.created_at);
  line.append(badge(job.status), time);
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = job.prompt;
  meta.append(line, text);
  card.append(thumb, meta);
  card.addEventListener("click", () => selectJob(job.id));
  li.append(card);

  const old = state.cards.get(job.id);
  if (old) old.replaceWith(li);
  else if (first) $("job-list").prepend(li);
  else $("job-list").append(li);
  state.cards.set(job.id, li);
}

// ---- the selected job -----------------------------------------------------------------------------------------

function jobIdFromHash() {
  const match = /^#job=([0-9a-fA-F-]{36})$/.exec(location.hash);
  return match ? match[1] : null;
}

function stopWatching() {
  if (state.stream) state.stream.abort();
  state.stream = null;
  clearTimeout(state.webhookTimer);
  state.webhookTimer = null;
  state.webhookLooks = 0;
}

function clearDetail() {
  stopWatching();
  state.selected = null;
  $("job-detail").hidden = true;
  $("job-empty").hidden = false;
  $("job-empty").textContent = "Submit a prompt or pick a job from the list.";
  const video = $("job-video");
  video.removeAttribute("src");
  video.load();
}

async function selectJob(id) {
  try {
    showJob(await api(`/v1/jobs/${encodeURIComponent(id)}`));
  } catch (err) {
    if (err.status === 401) return;
    clearDetail();
    $("job-empty").textContent = err.status === 404 ? `Job ${id} not found.` : `Could not load job ${id}: ${err.message}`;
  }
}

function showJob(job) {
  const changed = !state.selected || state.selected.id !== job.id;
  if (changed) {
    stopWatching();
    history.replaceState(null, "", `#job=${job.id}`);
    for (const [id, li] of state.cards) {
      if (id === job.id) li.firstChild.setAttribute("aria-current", "true");
      else li.firstChild.removeAttribute("aria-current");
    }
  }
  state.selected = job;
  renderJob(job, { changed });
  if (!TERMINAL.has(job.status) && !state.stream) watch(job.id);
  if (changed) loadWebhooks();
}

function setProgress({ status, step, total, percent }) {
  $("job-progress").value = percent;
  const label = total ? `step ${step} / ${total} · ${percent}%` : `${percent}%`;
  $("job-progress-label").textContent = status === "queued" ? `queued · ${label}` : label;
  const badgeEl = $("job-status");
  badgeEl.textContent = status;
  badgeEl.className = `badge ${status}`;
}

function fact(label, value) {
  const div = document.createElement("div");
  const dt = document.createElement("dt");
  dt.textContent = label;
  const dd = document.createElement("dd");
  dd.textContent = value;
  div.append(dt, dd);
  return div;
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

function renderJob(job, { changed }) {
  $("job-empty").hidden = true;
  $("job-detail").hidden = false;
  $("job-id").textContent = job.id;
  $("job-prompt").textContent = job.prompt;
  setProgress({ status: job.status, ...job.progress });
  $("cancel-job").hidden = TERMINAL.has(job.status) || job.cancel_requested;

  const error = $("job-error");
  error.hidden = !job.error;
  error.textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";

  const video = $("job-video");
  if (job.output) {
    // Presigned URLs are signed per time bucket: a re-read gives the same URL, so the player is not restarted.
    if (video.getAttribute("src") !== job.output.url) {
      video.poster = job.output.poster_url || "";
      video.src = job.output.url;
      video.play().catch(() => {}); // autoplay may be refused; the controls are there
    }
    video.setAttribute("aria-label", `video of job ${job.id}`);
    video.hidden = false;
  } else if (changed || !video.hidden) {
    video.hidden = true;
    video.removeAttribute("src");
    video.removeAttribute("poster");
    video.load();
  }

  const facts = [
    fact("size", `${job.width}×${job.height}`),
    fact("frames", `${job.num_frames} @ ${job.fps} fps (${job.duration_s} s)`),
    fact("steps", String(job.steps)),
    fact("guidance", String(job.guidance_scale)),
    fact("seed", String(job.seed)),
    fact("model", job.model),
    fact("priority", `${job.priority_class} (score ${job.score.value.toFixed(2)})`),
    fact("attempt", String(job.attempt)),
    fact("created", new Date(job.created_at).toLocaleString()),
  ];
  if (job.negative_prompt) facts.push(fact("negative prompt", job.negative_prompt));
  if (job.finished_at && job.started_at) {
    facts.push(fact("render time", `${((Date.parse(job.finished_at) - Date.parse(job.started_at)) / 1000).toFixed(1)} s`));
  }
  if (job.output) facts.push(fact("file", formatBytes(job.output.bytes)));
  if (job.result_of) facts.push(fact("reuses the video of", job.result_of));
  if (job.webhook_url) facts.push(fact("webhook", job.webhook_url));
  $("job-facts").replaceChildren(...facts);
  $("job-webhooks").hidden = !job.webhook_url;
  if (state.cards.has(job.id)) upsertCard(job, { first: false });
}

// ---- progress: Server-Sent Events read with fetch() -----------------------------------------------------------

async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = "message";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop(); // an incomplete last line waits for the next chunk
    for (const line of lines) {
      if (line === "") {
        if (data.length) yield { event, data: data.join("\n") };
        event = "message";
        data = [];
      } else if (line.startsWith(":")) {
        // a keep-alive comment
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
      }
    }
  }
}

async function watch(id) {
  const controller = new AbortController();
  state.stream = controller;
  let delay = 1000;
  // The API ends a stream after its job's final event, or after VIDQ_EVENTS_MAX_S: then it is opened again.
  while (!controller.signal.aborted) {
    try {
      const response = await fetch(`/v1/jobs/${encodeURIComponent(id)}/events`, {
        headers: { Authorization: `Bearer ${state.key}`, Accept: "text/event-stream" },
        signal: controller.signal,
      });
      if (!response.ok) {
        if (response.status === 401) keyRejected(new ApiError(401, { message: "the key was refused" }));
        if (response.status === 401 || response.status === 404) break;
        throw new Error(`HTTP ${response.status}`);
      }
      delay = 1000;
      for await (const { event, data } of sseEvents(response)) {
        if (controller.signal.aborted) return;
        if (event === "progress") {
          setProgress(JSON.parse(data));
        } else if (event === "job") {
          const job = JSON.parse(data);
          showJob(job);
          if (TERMINAL.has(job.status)) {
            if (job.webhook_url) loadWebhooks();
            state.stream = null;
            return;
          }
        }
      }
      await sleep(500); // ended without the final event (the API's stream deadline): open it again
    } catch (err) {
      if (controller.signal.aborted) return;
      await sleep(delay);
      delay = Math.min(delay * 2, 15000);
    }
  }
  if (state.stream === controller) state.stream = null;
}

// ---- webhook deliveries ---------------------------------------------------------------------------------------

async function loadWebhooks() {
  const job = state.selected;
  clearTimeout(state.webhookTimer);
  if (!job || !job.webhook_url) return;
  let rows;
  try {
    rows = await api(`/v1/jobs/${encodeURIComponent(job.id)}/webhooks`);
  } catch (err) {
    $("webhook-empty").hidden = false;
    $("webhook-empty").textContent = `Could not load deliveries: ${err.message}`;
    return;
  }
  if (!state.selected || state.selected.id !== job.id) return;
  const body = $("webhook-rows");
  body.replaceChildren(
    ...rows.map((d) => {
      const tr = document.createElement("tr");
      const result = d.ok ? `delivered · ${d.status_code}` : d.status_code ? `HTTP ${d.status_code}` : d.error || "failed";
      const cells = [
        String(d.attempt),
        d.event_type,
        result,
        `${new Date(d.created_at).toLocaleTimeString()} · ${d.duration_ms} ms`,
        d.next_attempt_at ? new Date(d.next_attempt_at).toLocaleTimeString() : "—",
      ];
      for (const [i, text] of cells.entries()) {
        const td = document.createElement("td");
        td.textContent = text;
        if (i === 2) td.className = d.ok ? "ok" : "bad";
        if (i === 2 && d.error) td.title = d.error;
        tr.append(td);
      }
      return tr;
    }),
  );
  $("webhook-empty").textContent = TERMINAL.has(job.status) ? "No delivery attempt yet." : "Sent when the job finishes.";
  $("webhook-empty").hidden = rows.length > 0;
  // Look again while a delivery is still to come: none yet for a finished job (2 s, backing off to a minute), or a
  // retry planned (just after it is due; the schedule reaches hours).
  const latest = rows[rows.length - 1];
  if (!TERMINAL.has(job.status) || (latest && (latest.ok || !latest.next_attempt_at))) return;
  state.webhookLooks += 1;
  let delay = Math.min(2000 * 1.5 ** (state.webhookLooks - 1), 60000);
  if (latest) delay = Math.max(2000, Date.parse(latest.next_attempt_at) - Date.now() + 1000);
  state.webhookTimer = setTimeout(loadWebhooks, delay);
}

// ---- wiring ---------------------------------------------------------------------------------------------------

function init() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) useKey(key, { remember: $("remember").checked });
  });
  $("forget-key").addEventListener("click", forgetKey);
  $("job-form").addEventListener("submit", submitJob);
  $("f-size").addEventListener("change", () => {
    for (const el of document.querySelectorAll(".custom-size")) el.hidden = $("f-size").value !== "custom";
  });
  $("status-filter").addEventListener("change", () => loadJobs({ reset: true }).catch(() => {}));
  $("refresh-jobs").addEventListener("click", () => loadJobs({ reset: true }).catch(() => {}));
  $("more-jobs").addEventListener("click", () => loadJobs({ reset: false }).catch(() => {}));
  $("refresh-webhooks").addEventListener("click", loadWebhooks);
  $("cancel-job").addEventListener("click", async () => {
    if (!state.selected) return;
    try {
      showJob(await api(`/v1/jobs/${encodeURIComponent(state.selected.id)}/cancel`, { method: "POST" }));
    } catch (err) {
      $("job-error").hidden = false;
      $("job-error").textContent = `Could not cancel: ${err.message}`;
    }
  });
  window.addEventListener("hashchange", () => {
    const id = jobIdFromHash();
    if (id && state.key && (!state.selected || state.selected.id !== id)) selectJob(id);
  });
  const key = storedKey();
  if (key) {
    $("api-key").value = key;
    $("remember").checked = localStorage.getItem(KEY_STORE) !== null;
    useKey(key, { remember: $("remember").checked });
  }
}

init();
