// lily's chat page: plain JavaScript, no build step, no network but this server.
// It speaks the OpenAI chat API the server offers (POST /v1/chat/completions, streamed), keeps the
// conversation in the page (and in this browser's localStorage, until "New chat"), and shows each
// reply's reasoning folded apart from the answer, its tool calls, its speed and cached prompt tokens.
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY_KEY = "lily-chat-history";
const API_KEY = "lily-api-key";

const page = {
  model: null,
  thinks: true,      // whether a request that says nothing of thinking thinks, on this server
  messages: JSON.parse(localStorage.getItem(HISTORY_KEY) || "[]"),
  controller: null,  // the AbortController of the request in flight
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(API_KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

// -- connecting: the model's name, or the API key form ------------------------------------------------
async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    $("model").textContent = "cannot reach the server: " + e.message;
    return;
  }
  if (response.status === 401) {
    const tried = sessionStorage.getItem(API_KEY);
    $("key-form").hidden = false;
    $("key-error").hidden = !tried;
    $("key-error").textContent = tried ? await errorMessage(response) : "";
    $("model").textContent = "waiting for the API key";
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    $("model").textContent = await errorMessage(response);
    return;
  }
  const card = (await response.json()).data[0];
  showDefaults(card);
  page.model = card.id;
  $("model").textContent = page.model;
  $("key-form").hidden = true;
  $("prompt").disabled = false;
  $("send").disabled = false;
  $("prompt").focus();
}

// The settings start from what the server does for a request that leaves them out (its --enable-thinking,
// the checkpoint's generation_config.json): the checkbox shows it, the empty fields name it.
function showDefaults(card) {
  page.thinks = Boolean((card.lily || {}).enable_thinking);
  $("thinking").checked = page.thinks;
  const sampling = card.default_sampling_params || {};
  if (sampling.temperature !== undefined) $("temperature").placeholder = String(sampling.temperature);
  $("max-tokens").placeholder = sampling.max_tokens !== undefined ? String(sampling.max_tokens) : "auto";
  $("temperature").title = "empty: the server's default";
  $("max-tokens").title = "empty: the server's default (auto: up to the end of the context)";
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(API_KEY, $("api-key").value.trim());
  connect();
});

// -- the conversation -----------------------------------------------------------------------------------
function addUserTurn(text) {
  const el = document.createElement("article");
  el.className = "turn user";
  el.textContent = text;
  $("conversation").appendChild(el);
  return el;
}

function addAssistantTurn() {
  const el = $("assistant-turn").content.firstElementChild.cloneNode(true);
  $("conversation").appendChild(el);
  return el;
}

function showToolCalls(el, calls) {
  const box = el.querySelector(".tool-calls");
  box.replaceChildren();
  for (const call of calls) {
    const div = document.createElement("div");
    div.className = "tool-call";
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = call.function.name;
    div.append("call ", name, " " + call.function.arguments);
    box.appendChild(div);
  }
}

function showAssistant(el, message) {
  if (message.reasoning_content) {
    el.querySelector(".reasoning").hidden = false;
    el.querySelector(".reasoning-text").textContent = message.reasoning_content;
  }
  el.querySelector(".content").textContent = message.content || "";
  showToolCalls(el, message.tool_calls || []);
}

function showError(el, text) {
  const p = el.querySelector(".error");
  p.hidden = false;
  p.textContent = text;
}

function render() {
  $("conversation").replaceChildren();
  for (const m of page.messages) {
    if (m.role === "user") addUserTurn(m.content);
    else showAssistant(addAssistantTurn(), m);
  }
}

function save() {
  localStorage.setItem(HISTORY_KEY, JSON.stringify(page.messages));
}

$("new-chat").addEventListener("click", () => {
  if (page.controller) page.controller.abort();
  page.messages = [];
  save();
  render();
});

// -- one request ----------------------------------------------------------------------------------------
// Only what the user set: every field left alone is the server's default, as for any other client.
function requestBody() {
  const body = {
    model: page.model,
    messages: page.messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = $("temperature").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  if ($("thinking").checked !== page.thinks) body.chat_template_kwargs = { enable_thinking: $("thinking").checked };
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);  // a typing mistake is shown as this turn's error
  return body;
}

function statsLine(s) {
  const parts = [];
  if (s.usage) {
    parts.push(`${s.usage.completion_tokens} tokens`);
    const seconds = (s.lastAt - s.firstAt) / 1000;
    if (s.usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${((s.usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    }
    const cached = (s.usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`${cached} of ${s.usage.prompt_tokens} prompt tokens cached`);
  }
  if (s.stopped) parts.push("stopped");
  else if (s.finish) parts.push(`finish: ${s.finish}`);
  return parts.join(" · ");
}

// Reads a server-sent event stream, calling onData with each JSON payload until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const asked = { role: "user", content: text };
  page.messages.push(asked);
  save();
  const userEl = addUserTurn(text);
  const el = addAssistantTurn();
  const reply = { role: "assistant", content: "", reasoning_content: "", tool_calls: [] };
  const stats = { firstAt: null, lastAt: null, usage: null, finish: null, stopped: false };
  page.controller = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  el.querySelector(".stats").textContent = "waiting...";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: page.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server failed");
      if (chunk.usage) stats.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.reasoning_content || d.content || d.tool_calls) {
          stats.lastAt = performance.now();
          if (stats.firstAt === null) stats.firstAt = stats.lastAt;
        }
        if (d.reasoning_content) reply.reasoning_content += d.reasoning_content;
        if (d.content) reply.content += d.content;
        for (const call of d.tool_calls || []) {
          const known = reply.tool_calls[call.index];
          if (known) known.function.arguments += call.function.arguments || "";
          else reply.tool_calls[call.index] = { id: call.id, type: "function", function: { ...call.function } };
        }
        if (choice.finish_reason) stats.finish = choice.finish_reason;
      }
      showAssistant(el, reply);
      const line = el.querySelector(".stats");
      line.textContent = statsLine(stats) || "...";
      // the span the speed is measured over: 0 where every token came in one read (no speed to show)
      if (stats.firstAt !== null) line.dataset.tokenSpanMs = String(stats.lastAt - stats.firstAt);
    });
  } catch (e) {
    if (e.name === "AbortError") stats.stopped = true;
    else showError(el, e.message);
  } finally {
    page.controller = null;
    $("send").hidden = false;
    $("stop").hidden = true;
  }
  el.querySelector(".stats").textContent = statsLine(stats);
  if (!page.messages.includes(asked)) return;  // New chat while it ran: gone with the conversation
  if (reply.content || reply.reasoning_content || reply.tool_calls.length) {
    const kept = { role: "assistant", content: reply.content };
    if (reply.reasoning_content) kept.reasoning_content = reply.reasoning_content;
    if (reply.tool_calls.length) kept.tool_calls = reply.tool_calls;
    page.messages.push(kept);
  } else {
    // nothing came back (an error, or stopped before the first token): the turn leaves the conversation, or
    // the next request would carry two user messages in a row; its text goes back in the box to edit and send
    page.messages.splice(page.messages.indexOf(asked), 1);
    userEl.classList.add("failed");
    el.classList.add("failed");
    const restored = !$("prompt").value;  // not over what the user has typed since
    if (restored) $("prompt").value = text;
    const note = restored ? "not kept: the message is back in the box" : "not kept";
    const line = el.querySelector(".stats");
    line.textContent = [line.textContent, note].filter(Boolean).join(" · ");
    $("prompt").focus();
  }
  save();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || page.controller || !page.model) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => {
  if (page.controller) page.controller.abort();
});

render();
connect();
