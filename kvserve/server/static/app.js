// kvserve's page: a chat playground over /v1/chat/completions and a live view of
// the engine from /kv-cache/stream. No dependencies, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "kvserve-api-key";
const VIEW_INTERVAL_MS = 500;
const HISTORY_LEN = 120;

const state = {
  model: null,
  history: [],            // chat messages sent so far, OpenAI shape
  controller: null,       // AbortController of the answer streaming now
  hitHistory: [],         // per view update: {cumulative, interval} prefix-cache hit rates (tokens)
  lastPrefix: null,
  viewGeneration: 0,      // bumped to restart the engine view (e.g. a new key)
};

function apiHeaders(extra = {}) {
  const key = $("api-key").value.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Calls onEvent(parsed JSON) for each `data:` event of a text/event-stream body.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// ---------------------------------------------------------------- chat

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function sampling() {
  const params = {
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") params.seed = Number($("seed").value);
  return params;
}

function chatMessages(userText) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  return messages.concat(state.history, [{ role: "user", content: userText }]);
}

async function sendChat(userText) {
  $("chat-error").textContent = "";
  if (!state.model) await loadModel();
  addMessage("user", userText);
  const answer = addMessage("assistant", "");
  const text = answer.querySelector(".text");
  const body = {
    model: state.model, messages: chatMessages(userText), stream: true,
    stream_options: { include_usage: true }, ...sampling(),
  };
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let firstTokenAt = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          if (firstTokenAt === null) firstTokenAt = performance.now();
          text.textContent += piece;
        }
      }
    });
    state.history.push({ role: "user", content: userText }, { role: "assistant", content: text.textContent });
  } catch (err) {
    if (err.name !== "AbortError") $("chat-error").textContent = err.message;
  } finally {
    setBusy(false);
    state.controller = null;
    showAnswerStats(answer, started, firstTokenAt, usage);
  }
}

function showAnswerStats(answer, started, firstTokenAt, usage) {
  const meta = document.createElement("span");
  meta.className = "meta";
  const end = performance.now();
  const parts = [];
  if (firstTokenAt !== null) parts.push(`TTFT ${Math.round(firstTokenAt - started)} ms`);
  if (usage) {
    const decodeS = firstTokenAt !== null ? (end - firstTokenAt) / 1000 : 0;
    const rate = decodeS > 0 ? (usage.completion_tokens - 1) / decodeS : 0;
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(`${rate.toFixed(1)} tok/s`, `${usage.completion_tokens} tokens`,
               `${cached} of ${usage.prompt_tokens} prompt tokens cached`);
    answer.dataset.cachedTokens = cached;
    answer.dataset.completionTokens = usage.completion_tokens;
  }
  meta.textContent = parts.join(" · ");
  answer.appendChild(meta);
  answer.dataset.done = "true";
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// ---------------------------------------------------------------- engine view

function pct(n, total) {
  return total ? `${(100 * n / total).toFixed(2)}%` : "0%";
}

function renderGroups(doc) {
  const root = $("groups");
  root.textContent = "";
  for (const g of doc.groups) {
    const div = document.createElement("div");
    div.className = "group";
    div.dataset.groupId = g.group_id;
    const window = g.sliding_window ? `, window ${g.sliding_window}` : "";
    // A state group's block holds one recurrent state: a snapshot every block_size tokens.
    const shape = g.kind === "state" ? `recurrent state, snapshot every ${g.block_size} tokens`
      : `block ${g.block_size} tokens${window}`;
    const title = document.createElement("div");
    title.className = "title";
    title.dataset.kind = g.kind;
    title.textContent = `group ${g.group_id}: ${g.kind}, ${shape}, ` +
      `${g.num_layers} layers — in use ${g.blocks_in_use} · cached ${g.blocks_cached} · ` +
      `free ${g.blocks_free} of ${g.num_blocks} blocks (own: ${g.blocks_in_tables} in tables, ` +
      `${g.blocks_cached_for_group} cached, ${g.hit_blocks ?? 0} hit)`;
    const bar = document.createElement("div");
    bar.className = "bar";
    for (const [cls, n] of [["in-use", g.blocks_in_use], ["cached", g.blocks_cached], ["free", g.blocks_free]]) {
      const part = document.createElement("div");
      part.className = cls;
      part.style.width = pct(n, g.num_blocks);
      part.title = `${cls}: ${n}`;
      bar.appendChild(part);
    }
    div.append(title, bar);
    root.appendChild(div);
  }
}

function updateHitHistory(doc) {
  const { queries, hits, hit_rate } = doc.prefix_cache;
  let interval = null;
  if (state.lastPrefix) {
    const dq = queries - state.lastPrefix.queries;
    if (dq > 0) interval = (hits - state.lastPrefix.hits) / dq;
    else if (dq < 0) state.hitHistory = [];  // the server restarted
  }
  state.lastPrefix = { queries, hits };
  state.hitHistory.push({ cumulative: queries ? hit_rate : null, interval });
  state.hitHistory = state.hitHistory.slice(-HISTORY_LEN);
}

// Blue line: hit rate since start; orange dots: hit rate of the prompts looked up in each interval.
function drawHitRate() {
  const canvas = $("hit-rate-chart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const step = canvas.width / Math.max(HISTORY_LEN - 1, 1);
  const y = (rate) => canvas.height - 4 - rate * (canvas.height - 8);
  ctx.strokeStyle = "#1976d2";
  ctx.beginPath();
  let drawing = false;
  state.hitHistory.forEach((point, i) => {
    if (point.cumulative === null) { drawing = false; return; }
    if (drawing) ctx.lineTo(i * step, y(point.cumulative)); else ctx.moveTo(i * step, y(point.cumulative));
    drawing = true;
  });
  ctx.stroke();
  ctx.fillStyle = "#ef6c00";
  state.hitHistory.forEach((point, i) => {
    if (point.interval !== null) ctx.fillRect(i * step - 2, y(point.interval) - 2, 4, 4);
  });
}

function renderEvictionHead(doc) {
  const root = $("eviction-head");
  root.textContent = "";
  for (const entry of doc.eviction_queue_head) {
    const span = document.createElement("span");
    span.className = entry.hashed ? "cached" : "free";
    span.textContent = entry.block_id;
    span.title = entry.hashed ? `block ${entry.block_id}: cached prefix of group ${entry.group_id}`
                              : `block ${entry.block_id}: empty`;
    root.appendChild(span);
  }
}

function drawSteps(doc) {
  const canvas = $("step-chart");
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const steps = doc.steps;
  if (!steps.length) { $("step-summary").textContent = "no steps yet"; return; }
  const maxTokens = Math.max(...steps.map((s) => s.num_tokens));
  const maxMs = Math.max(...steps.map((s) => s.duration_ms));
  const width = canvas.width / steps.length;
  ctx.fillStyle = "#90caf9";
  steps.forEach((s, i) => {
    const h = (s.num_tokens / maxTokens) * (canvas.height - 4);
    ctx.fillRect(i * width, canvas.height - h, Math.max(width - 1, 1), h);
  });
  ctx.strokeStyle = "#e53935";
  ctx.beginPath();
  steps.forEach((s, i) => {
    const y = canvas.height - 2 - (s.duration_ms / maxMs) * (canvas.height - 4);
    if (i === 0) ctx.moveTo(i * width, y); else ctx.lineTo(i * width + width / 2, y);
  });
  ctx.stroke();
  const last = steps[steps.length - 1];
  $("step-summary").textContent = `last step #${last.step_seq}: ${last.num_tokens} tokens, ` +
    `${last.num_requests} requests, ${last.duration_ms.toFixed(1)} ms; max ${maxTokens} tokens, ` +
    `${maxMs.toFixed(1)} ms over the last ${steps.length} steps`;
}

function renderRequests(doc) {
  const body = $("requests").querySelector("tbody");
  body.textContent = "";
  for (const r of doc.requests) {
    const row = document.createElement("tr");
    for (const cell of [r.request_id, r.status, r.num_blocks, `${r.num_computed_tokens} / ${r.num_tokens}`,
                        r.num_preemptions]) {
      const td = document.createElement("td");
      td.textContent = cell;
      row.appendChild(td);
    }
    body.appendChild(row);
  }
}

function renderView(doc) {
  window.kvserveLatestView = doc;  // for debugging from the console (and the browser test)
  $("num-running").textContent = doc.num_running;
  $("num-waiting").textContent = doc.num_waiting;
  $("num-preempted").textContent = doc.num_preempted;
  $("num-preemptions").textContent = doc.num_preemptions;
  $("num-evictions").textContent = doc.num_evictions;
  $("hit-rate").textContent = `${(100 * doc.prefix_cache.hit_rate).toFixed(1)}% ` +
    `(${doc.prefix_cache.hits} / ${doc.prefix_cache.queries})`;
  renderGroups(doc);
  updateHitHistory(doc);
  drawHitRate();
  renderEvictionHead(doc);
  drawSteps(doc);
  renderRequests(doc);
  $("view-status").textContent = `updated ${new Date(doc.timestamp * 1000).toLocaleTimeString()}`;
}

async function runEngineView() {
  const generation = ++state.viewGeneration;
  while (generation === state.viewGeneration) {
    try {
      const response = await fetch(`/kv-cache/stream?interval_ms=${VIEW_INTERVAL_MS}`, { headers: apiHeaders() });
      if (response.status === 401) {
        $("view-status").textContent = "needs the API key";
        $("auth-status").textContent = "enter the server's API key";
        return;  // restarted when the key changes
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      $("auth-status").textContent = "";
      await readEvents(response, (doc) => {
        if (generation !== state.viewGeneration) throw new Error("restarted");
        if (doc.error) throw new Error(doc.error.message);
        renderView(doc);
      });
    } catch (err) {
      if (generation !== state.viewGeneration) return;
      $("view-status").textContent = `disconnected (${err.message}); retrying`;
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: apiHeaders() });
  if (!response.ok) return;
  const body = await response.json();
  state.model = body.data[0].id;
  $("model-name").textContent = state.model;
}

// ---------------------------------------------------------------- wiring

function init() {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModel();
    runEngineView();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("user-input").value.trim();
    if (!text || state.controller) return;
    $("user-input").value = "";
    sendChat(text);
  });
  $("user-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear-chat").addEventListener("click", () => {
    state.history = [];
    $("messages").textContent = "";
  });
  loadModel();
  runEngineView();
}

init();
