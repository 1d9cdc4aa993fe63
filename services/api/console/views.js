// Rendering: jobs as the API returns them → the page's elements. Text goes in as text (textContent), never as HTML.

const $ = (id) => document.getElementById(id);

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

function el(tag, { className, text } = {}) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function relativeTime(iso) {
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  if (seconds < 60) return "just now";
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return new Date(iso).toLocaleDateString();
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

// One job of the list: its poster (or its progress), status, age and prompt; a button that calls onSelect.
export function jobCard(job, { selected, onSelect }) {
  const card = el("button", { className: "job-card" });
  card.type = "button";
  card.dataset.jobId = job.id;
  card.setAttribute("aria-label", `${job.status}: ${job.prompt}`);
  if (selected) card.setAttribute("aria-current", "true");
  const thumb = el("div", { className: "thumb" });
  if (job.output && job.output.poster_url) {
    const img = el("img");
    img.src = job.output.poster_url;
    img.alt = `poster of job ${job.id}`;
    img.loading = "lazy";
    thumb.append(img);
  } else {
    thumb.textContent = job.status === "succeeded" ? "no poster" : `${job.progress.percent}%`;
  }
  const line = el("div", { className: "line" });
  const time = el("time", { text: relativeTime(job.created_at) });
  time.dateTime = job.created_at;
  line.append(el("span", { className: `badge ${job.status}`, text: job.status }), time);
  const meta = el("div", { className: "meta" });
  meta.append(line, el("span", { className: "text", text: job.prompt }));
  card.append(thumb, meta);
  card.addEventListener("click", () => onSelect(job.id));
  const li = el("li");
  li.append(card);
  return li;
}

// A progress event's fields (or a job's status and progress).
export function showProgress({ status, step, total, percent }) {
  $("job-progress").value = percent;
  const label = total ? `step ${step} / ${total} · ${percent}%` : `${percent}%`;
  $("job-progress-label").textContent = status === "queued" ? `queued · ${label}` : label;
  $("job-status").textContent = status;
  $("job-status").className = `badge ${status}`;
}

function fact(label, value) {
  const div = el("div");
  div.append(el("dt", { text: label }), el("dd", { text: value }));
  return div;
}

function showVideo(job, { changed }) {
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
    hideVideo();
  }
}

export function hideVideo() {
  const video = $("job-video");
  video.hidden = true;
  video.removeAttribute("src");
  video.removeAttribute("poster");
  video.load();
}

// The detail panel. changed: another job than the one shown before.
export function showJobDetail(job, { changed }) {
  $("job-empty").hidden = true;
  $("job-detail").hidden = false;
  $("job-id").textContent = job.id;
  $("job-prompt").textContent = job.prompt;
  showProgress({ status: job.status, ...job.progress });
  $("cancel-job").hidden = TERMINAL.has(job.status) || job.cancel_requested;
  $("job-error").hidden = !job.error;
  $("job-error").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
  showVideo(job, { changed });

  const facts = [
    fact("size", `${job.width}×${job.height}`),
    fact("frames", `${job.num_frames} @ ${job.fps} fps (${job.duration_s} s)`),
    fact("steps", String(job.steps)),
    fact("guidance", String(job.guidance_scale)),
    fact("seed", String(job.seed)),
    fact("model", job.model),
    fact("priority", `${job.priority_class} (score ${job.score.value.toFixed(2)})`),
    fact("worker pool", job.routed_by === "default" ? job.pool : `${job.pool} (${job.routed_by})`),
    fact("attempt", String(job.attempt)),
    fact("created", new Date(job.created_at).toLocaleString()),
  ];
  if (job.negative_prompt) facts.push(fact("negative prompt", job.negative_prompt));
  if (job.finished_at && job.started_at) {
    const seconds = (Date.parse(job.finished_at) - Date.parse(job.started_at)) / 1000;
    facts.push(fact("render time", `${seconds.toFixed(1)} s`));
  }
  if (job.output) facts.push(fact("file", formatBytes(job.output.bytes)));
  const context = job.output && job.output.context;
  if (context) {
    const { label, prototype } = context.motion;
    facts.push(fact("motion", prototype ? `${label.replace("_", " ")} (${prototype})` : label.replace("_", " ")));
  }
  if (job.result_of) facts.push(fact("reuses the video of", job.result_of));
  if (job.webhook_url) facts.push(fact("webhook", job.webhook_url));
  $("job-facts").replaceChildren(...facts);
  $("job-webhooks").hidden = !job.webhook_url;
}

export function showEmptyDetail(message) {
  $("job-detail").hidden = true;
  $("job-empty").hidden = false;
  $("job-empty").textContent = message;
  hideVideo();
}

// The delivery log of a job (GET /v1/jobs/{id}/webhooks), oldest attempt first.
export function showDeliveries(rows, { finished }) {
  $("webhook-rows").replaceChildren(
    ...rows.map((d) => {
      const tr = el("tr");
      const result = d.ok ? `delivered · ${d.status_code}` : d.status_code ? `HTTP ${d.status_code}` : d.error || "failed";
      const cells = [
        String(d.attempt),
        d.event_type,
        result,
        `${new Date(d.created_at).toLocaleTimeString()} · ${d.duration_ms} ms`,
        d.next_attempt_at ? new Date(d.next_attempt_at).toLocaleTimeString() : "—",
      ];
      for (const [i, text] of cells.entries()) {
        const td = el("td", { text });
        if (i === 2) td.className = d.ok ? "ok" : "bad";
        if (i === 2 && d.error) td.title = d.error;
        tr.append(td);
      }
      return tr;
    }),
  );
  $("webhook-empty").textContent = finished ? "No delivery attempt yet." : "Sent when the job finishes.";
  $("webhook-empty").hidden = rows.length > 0;
}

export function showDeliveriesError(message) {
  $("webhook-empty").hidden = false;
  $("webhook-empty").textContent = message;
}

// The tenant's videos most like the shown one (GET /v1/jobs/{id}/similar), each a card with its similarity.
export function showSimilar(items, { onSelect }) {
  $("job-similar").hidden = false;
  $("similar-list").replaceChildren(
    ...items.map(({ similarity, job }) => {
      const li = jobCard(job, { selected: false, onSelect });
      const score = el("span", { className: "score", text: `${Math.round(similarity * 100)}% alike` });
      li.firstChild.querySelector(".line").append(score);
      return li;
    }),
  );
  $("similar-empty").hidden = items.length > 0;
  $("similar-empty").textContent = "No other video of this model yet.";
}

export function showSimilarMessage(message) {
  $("job-similar").hidden = message === null;
  $("similar-list").replaceChildren();
  $("similar-empty").hidden = message === null;
  $("similar-empty").textContent = message || "";
}
