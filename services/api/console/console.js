// vidq console: plain JavaScript modules against the /v1 API of the origin that serves them (no build step, no
// library). The API key stays in this browser (sessionStorage, or localStorage when "remember" is ticked) and goes
// out only in the Authorization header. This module holds the page's state and flow; api.js talks to the API,
// form.js reads the form, views.js renders.
import { ApiError, apiClient } from "./api.js";
import * as form from "./form.js";
import * as views from "./views.js";

const KEY_STORE = "vidq.apiKey";
const PAGE_SIZE = 12;
const { TERMINAL } = views;

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const jobPath = (id, rest = "") => `/v1/jobs/${encodeURIComponent(id)}${rest}`;

const state = {
  key: null,
  cursor: null, // next_cursor of the last page of the list
  cards: new Map(), // job id → its <li> in the list
  selected: null, // the job shown in the detail panel
  stream: null, // AbortController of its progress stream
  webhookTimer: null,
  webhookLooks: 0, // looks at its deliveries without a settled answer (for the back-off)
  webhookLook: 0, // the latest look's number: an older answer arriving late is dropped
  similarTimer: null,
  similarLook: 0, // the latest look at similar videos: an older answer arriving late is dropped
};

const api = apiClient({ getKey: () => state.key, onUnauthorized: keyRejected });

// ---- the API key ----------------------------------------------------------------------------------------------

function setKeyStatus(text, kind = "") {
  $("key-status").textContent = text;
  $("key-status").className = `key-status ${kind}`;
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

async function submitJob(event) {
  event.preventDefault();
  form.clearErrors();
  if (!state.key) {
    form.showError(new ApiError(0, { message: "paste an API key first (top right)" }));
    return;
  }
  const unreadable = form.unreadableFields();
  if (unreadable.length) {
    form.showError(new ApiError(0, { message: "some fields do not hold a number", details: unreadable }));
    return;
  }
  $("submit-job").disabled = true;
  try {
    const job = await api.request("/v1/jobs", { method: "POST", body: form.jobBody() });
    putCard(job, { first: true });
    showJob(job);
  } catch (err) {
    form.showError(err);
  } finally {
    $("submit-job").disabled = false;
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
    page = await api.request(`/v1/jobs?${params}`);
  } finally {
    if (reset) clearJobs(); // a refused key shows no list at all
  }
  for (const job of page.data) putCard(job, { first: false });
  state.cursor = page.next_cursor;
  $("more-jobs").hidden = !page.next_cursor;
}

// Adds the job's card to the list, or replaces the card it has.
function putCard(job, { first }) {
  const selected = state.selected !== null && state.selected.id === job.id;
  const li = views.jobCard(job, { selected, onSelect: selectJob });
  const old = state.cards.get(job.id);
  if (old) old.replaceWith(li);
  else if (first) $("job-list").prepend(li);
  else $("job-list").append(li);
  state.cards.set(job.id, li);
  $("jobs-empty").hidden = true;
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

function clearDetail(message = "Submit a prompt or pick a job from the list.") {
  stopWatching();
  state.selected = null;
  views.showEmptyDetail(message);
}

async function selectJob(id) {
  try {
    showJob(await api.request(jobPath(id)));
  } catch (err) {
    if (err.status === 401) return;
    clearDetail(err.status === 404 ? `Job ${id} not found.` : `Could not load job ${id}: ${err.message}`);
  }
}

function showJob(job) {
  const changed = state.selected === null || state.selected.id !== job.id;
  const hadSucceeded = !changed && state.selected.status === "succeeded";
  if (changed) {
    stopWatching();
    history.replaceState(null, "", `#job=${job.id}`);
    for (const [id, li] of state.cards) {
      if (id === job.id) li.firstChild.setAttribute("aria-current", "true");
      else li.firstChild.removeAttribute("aria-current");
    }
  }
  state.selected = job;
  views.showJobDetail(job, { changed });
  if (state.cards.has(job.id)) putCard(job, { first: false });
  if (!TERMINAL.has(job.status) && !state.stream) watch(job.id);
  if (changed || TERMINAL.has(job.status)) loadWebhooks();
  if (changed || (job.status === "succeeded" && !hadSucceeded)) loadSimilar(0);
}

// Follows the job's progress stream until its final event; the API ends a stream after VIDQ_EVENTS_MAX_S, and a
// broken one is opened again with a back-off.
async function watch(id) {
  const controller = new AbortController();
  state.stream = controller;
  let delay = 1000;
  while (!controller.signal.aborted) {
    try {
      for await (const { event, data } of api.events(jobPath(id, "/events"), { signal: controller.signal })) {
        delay = 1000;
        if (event === "progress") views.showProgress(JSON.parse(data));
        if (event !== "job") continue;
        const job = JSON.parse(data);
        if (TERMINAL.has(job.status)) state.stream = null;
        showJob(job);
        if (TERMINAL.has(job.status)) return;
      }
      await sleep(500); // ended without the final event: open it again
    } catch (err) {
      if (controller.signal.aborted || err.status === 401 || err.status === 404) break;
      await sleep(delay);
      delay = Math.min(delay * 2, 15000);
    }
  }
  if (state.stream === controller) state.stream = null;
}

async function cancelSelected() {
  if (!state.selected) return;
  try {
    showJob(await api.request(jobPath(state.selected.id, "/cancel"), { method: "POST" }));
  } catch (err) {
    $("job-error").hidden = false;
    $("job-error").textContent = `Could not cancel: ${err.message}`;
  }
}

// ---- webhook deliveries ---------------------------------------------------------------------------------------

async function loadWebhooks() {
  const job = state.selected;
  const look = ++state.webhookLook;
  clearTimeout(state.webhookTimer);
  if (!job || !job.webhook_url) return;
  let rows;
  try {
    rows = await api.request(jobPath(job.id, "/webhooks"));
  } catch (err) {
    if (look === state.webhookLook) views.showDeliveriesError(`Could not load deliveries: ${err.message}`);
    return;
  }
  if (look !== state.webhookLook) return; // another look (or another job) came after this one
  const finished = TERMINAL.has(job.status);
  views.showDeliveries(rows, { finished });
  // Look again while a delivery is still to come: none yet for a finished job (2 s, backing off to a minute), or a
  // retry planned (just after it is due; the schedule reaches hours).
  const latest = rows[rows.length - 1];
  if (!finished || (latest && (latest.ok || !latest.next_attempt_at))) return;
  state.webhookLooks += 1;
  let delay = Math.min(2000 * 1.5 ** (state.webhookLooks - 1), 60000);
  if (latest) delay = Math.max(2000, Date.parse(latest.next_attempt_at) - Date.now() + 1000);
  state.webhookTimer = setTimeout(loadWebhooks, delay);
}

// ---- similar videos -------------------------------------------------------------------------------------------

// A succeeded job's video is described just after it finishes: until then the API answers 409, and the page looks
// again (1 s, backing off, five looks).
async function loadSimilar(looks) {
  const job = state.selected;
  const look = ++state.similarLook;
  clearTimeout(state.similarTimer);
  if (!job || job.status !== "succeeded") {
    views.showSimilarMessage(null);
    return;
  }
  let page;
  try {
    page = await api.request(jobPath(job.id, "/similar?limit=6"));
  } catch (err) {
    if (look !== state.similarLook) return;
    if (err.status === 409 && looks < 5) {
      views.showSimilarMessage("Looking at this video…");
      state.similarTimer = setTimeout(() => loadSimilar(looks + 1), 1000 * 2 ** looks);
    } else {
      views.showSimilarMessage(err.status === 409 ? "This video has no description." : `Could not load: ${err.message}`);
    }
    return;
  }
  if (look !== state.similarLook) return;
  views.showSimilar(page.data, { onSelect: selectJob });
  if (!job.output.context) {
    // Shown before it was described: its facts gain its motion.
    try {
      const described = await api.request(jobPath(job.id));
      if (look === state.similarLook) {
        state.selected = described;
        views.showJobDetail(described, { changed: false });
      }
    } catch (_) {
      // the facts stay as they were; the next look at the job shows its motion
    }
  }
}

// ---- wiring ---------------------------------------------------------------------------------------------------

function init() {
  const reload = (reset) => () => loadJobs({ reset }).catch(() => {}); // a failure shows in the key status
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) useKey(key, { remember: $("remember").checked });
  });
  $("forget-key").addEventListener("click", forgetKey);
  $("job-form").addEventListener("submit", submitJob);
  $("f-size").addEventListener("change", form.showCustomSize);
  $("status-filter").addEventListener("change", reload(true));
  $("refresh-jobs").addEventListener("click", reload(true));
  $("more-jobs").addEventListener("click", reload(false));
  $("refresh-webhooks").addEventListener("click", loadWebhooks);
  $("cancel-job").addEventListener("click", cancelSelected);
  window.addEventListener("hashchange", () => {
    const id = jobIdFromHash();
    if (id && state.key && (!state.selected || state.selected.id !== id)) selectJob(id);
  });
  const key = sessionStorage.getItem(KEY_STORE) || localStorage.getItem(KEY_STORE);
  if (key) {
    $("api-key").value = key;
    $("remember").checked = localStorage.getItem(KEY_STORE) !== null;
    useKey(key, { remember: $("remember").checked });
  }
}

init();
