// The "New video" form: its body for POST /v1/jobs, and the API's refusals shown next to the fields they name.
// The API is the one validator; only what a number field cannot even hand over is caught here.

const $ = (id) => document.getElementById(id);

export const FIELDS = [
  "prompt", "negative_prompt", "width", "height", "duration_s", "fps", "steps", "guidance_scale", "seed", "webhook_url",
];

export function showCustomSize() {
  for (const el of document.querySelectorAll(".custom-size")) el.hidden = $("f-size").value !== "custom";
}

export function jobBody() {
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

// Fields whose text the browser cannot read as a number (their value would silently be empty), as error details.
export function unreadableFields() {
  return FIELDS.filter((name) => $(`f-${name}`).validity.badInput).map((name) => ({
    loc: ["body", name],
    msg: "not a number",
  }));
}

export function clearErrors() {
  $("form-error").hidden = true;
  $("form-error").replaceChildren();
  for (const name of FIELDS) {
    const input = $(`f-${name}`);
    input.removeAttribute("aria-invalid");
    input.removeAttribute("aria-describedby");
    const note = $(`err-${name}`);
    if (note) note.remove();
  }
}

// err: an ApiError (status, message, details as the error envelope has them).
export function showError(err) {
  const box = $("form-error");
  const title = document.createElement("strong");
  title.textContent = err.status === 422 ? "The API refused this request: " : "Could not submit: ";
  box.append(title, document.createTextNode(err.message));
  // Validation errors name their field (loc ["body", "width"]): mark that field and say why next to it.
  const general = [];
  for (const detail of Array.isArray(err.details) ? err.details : []) {
    const field = Array.isArray(detail.loc) ? detail.loc[detail.loc.length - 1] : null;
    const input = FIELDS.includes(field) ? $(`f-${field}`) : null;
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
