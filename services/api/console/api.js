// The /v1 API of the origin that serves the console: JSON requests with the pasted key, and progress streams.
// Streams are read with fetch(), since a browser EventSource cannot send the Authorization header.

export class ApiError extends Error {
  constructor(status, error) {
    super((error && error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = error && error.code;
    this.details = error && error.details;
  }
}

// getKey(): the key to send; onUnauthorized(error): told of every 401 (the key was refused).
export function apiClient({ getKey, onUnauthorized }) {
  const headers = (accept) => ({ Authorization: `Bearer ${getKey()}`, Accept: accept });

  async function failure(response) {
    let error = null;
    try {
      error = (await response.json()).error;
    } catch (_) {
      // not the API's envelope (a proxy's page): the status says enough
    }
    const err = new ApiError(response.status, error);
    if (response.status === 401) onUnauthorized(err);
    return err;
  }

  async function send(path, init) {
    try {
      return await fetch(path, init);
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, { code: "network", message: "the API did not answer (network error)" });
    }
  }

  // A JSON request; resolves to the body, rejects with an ApiError carrying the error envelope's code and details.
  async function request(path, { method = "GET", body, signal } = {}) {
    const init = { method, signal, headers: headers("application/json") };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await send(path, init);
    if (!response.ok) throw await failure(response);
    return response.status === 204 ? null : response.json();
  }

  // The events of a Server-Sent Events stream, as { event, data } until the server ends it.
  async function* events(path, { signal }) {
    const response = await send(path, { signal, headers: headers("text/event-stream") });
    if (!response.ok) throw await failure(response);
    yield* parseEvents(response.body);
  }

  return { request, events };
}

// The text/event-stream format: "field: value" lines, an event ends at a blank line, ":" starts a comment.
async function* parseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
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
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = text;
        else if (field === "data") data.push(text);
      }
    }
  }
}
