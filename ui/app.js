// Perch's window: chat, local models, engine numbers. Everything shown comes from the Rust
// commands in src-tauri/src/commands.rs; text from the model is inserted as text, never as HTML.
"use strict";

const { invoke, Channel } = window.__TAURI__.core;
const { listen } = window.__TAURI__.event;

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content}
let running = null; // request id of the answer being generated

function show(view) {
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("active", button.dataset.view === view);
  }
  if (view === "models") refreshModels();
}

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = role;
  const body = document.createElement("span");
  body.textContent = text;
  item.append(body);
  $("messages").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, body };
}

function describeStats(stats, reason) {
  const parts = [`${stats.generation_tokens} tokens`];
  if (stats.ttft_s !== undefined) parts.push(`TTFT ${(stats.ttft_s * 1000).toFixed(0)} ms`);
  parts.push(`${stats.generation_tps.toFixed(1)} tok/s`);
  if (stats.cached_prompt_tokens) parts.push(`${stats.cached_prompt_tokens} prompt tokens cached`);
  if (reason !== "stop" && reason !== "length") parts.push(reason);
  return parts.join(" · ");
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const { item, body } = addMessage("assistant", "");
  let answer = "";
  const events = new Channel();
  events.onmessage = (event) => {
    if (event.event === "token") {
      answer += event.text;
      body.textContent = answer;
      item.scrollIntoView({ block: "end" });
    } else if (event.event === "finished") {
      running = null;
      $("stop").disabled = true;
      $("send").disabled = false;
      conversation.push({ role: "assistant", content: answer });
      const meta = document.createElement("span");
      meta.className = "meta";
      meta.textContent = event.error ?? describeStats(event.stats, event.finish_reason);
      item.append(meta);
    }
  };
  try {
    $("send").disabled = true;
    running = await invoke("chat", { messages: conversation, options: null, onEvent: events });
    $("stop").disabled = false;
  } catch (error) {
    $("send").disabled = false;
    body.textContent = String(error);
    item.classList.add("error");
    conversation.pop();
  }
}

async function refreshStatus() {
  const status = await invoke("model_status");
  const text = {
    not_loaded: () => "No model loaded.",
    loading: () => `Loading ${status.name}…`,
    loaded: () => `Model: ${status.name}`,
    failed: () => `Could not load ${status.name}: ${status.error}`,
  }[status.state]();
  $("model-status").textContent = text;
}

async function refreshModels() {
  const list = $("models");
  list.replaceChildren();
  for (const model of await invoke("list_models")) {
    const item = document.createElement("li");
    const size = (model.size_bytes / 2 ** 20).toFixed(0);
    const bits = model.quantization_bits ? `, ${model.quantization_bits}-bit` : "";
    item.textContent = `${model.name} (${model.model_type ?? "?"}${bits}, ${size} MiB, ${model.source}) `;
    const load = document.createElement("button");
    load.textContent = "Load";
    load.onclick = async () => {
      $("model-status").textContent = `Loading ${model.name}…`;
      try {
        await invoke("load_model", { path: model.path });
      } catch (error) {
        $("model-status").textContent = String(error);
        return;
      }
      refreshStatus();
    };
    item.append(load);
    list.append(item);
  }
  if (!list.children.length) list.textContent = "No models found in Perch's models directory or the Hugging Face cache.";
}

const mib = (bytes) => `${(bytes / 2 ** 20).toFixed(0)} MiB`;

async function refreshStats() {
  const stats = await invoke("engine_stats").catch(() => null);
  const system = await invoke("system_stats").catch(() => null);
  const systemRows = system
    ? [
        ["System RAM used / total", `${mib(system.ram_used_bytes)} / ${mib(system.ram_total_bytes)}`],
        ["Perch resident memory", system.process_rss_bytes == null ? "not reported" : mib(system.process_rss_bytes)],
      ]
    : [];
  const rows = stats
    ? [
        ["Running / waiting", `${stats.running} / ${stats.waiting}`],
        ["Prompt tok/s", stats.prompt_tps.toFixed(1)],
        ["Generation tok/s", stats.generation_tps.toFixed(1)],
        ["KV blocks used / cached / empty", `${stats.kv_cache.blocks_used} / ${stats.kv_cache.blocks_cached_free} / ${stats.kv_cache.blocks_empty}`],
        ["Prefix-cache hit rate", `${(stats.kv_cache.prefix_cache_hit_rate * 100).toFixed(0)}%`],
        ["MLX active / peak / cache", [stats.memory.active_bytes, stats.memory.peak_bytes, stats.memory.cache_bytes].map((b) => `${(b / 2 ** 20).toFixed(0)} MiB`).join(" / ")],
        ["Metal wired limit", stats.memory.wired_limit_bytes == null ? "not available" : `${(stats.memory.wired_limit_bytes / 2 ** 20).toFixed(0)} MiB`],
      ]
    : [["Engine", "no model loaded"]];
  const list = $("stats");
  list.replaceChildren();
  for (const [name, value] of [...rows, ...systemRows]) {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = value;
    list.append(dt, dd);
  }
}

for (const button of document.querySelectorAll("nav button")) {
  button.onclick = () => show(button.dataset.view);
}
$("composer").onsubmit = (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || running !== null) return;
  $("input").value = "";
  send(text);
};
$("input").onkeydown = (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
};
$("stop").onclick = () => running !== null && invoke("stop", { requestId: running });
$("new-chat").onclick = () => {
  conversation.length = 0;
  $("messages").replaceChildren();
};
$("clear-cache").onclick = () => invoke("clear_cache").then(refreshStats);
$("reset-peak").onclick = () => invoke("reset_peak_memory").then(refreshStats);
$("unload").onclick = () => invoke("unload_model").then(refreshStatus);
listen("navigate", (event) => show(event.payload));

refreshStatus();
setInterval(refreshStatus, 2000);
setInterval(() => !$("view-dashboard").hidden && refreshStats(), 1000);
