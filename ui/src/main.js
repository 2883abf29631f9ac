// Perch's window: wires the views (chat, dashboard, models, settings) to the Rust commands.

import "./locale.js"; // first: before uPlot reads the locale
import "./style.css";
import { api } from "./api.js";
import { ChatView } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { SettingsView } from "./settings.js";
import { describeModelStatus, mib } from "./format.js";

const $ = (id) => document.getElementById(id);

/** Shows `text` above the views until dismissed. */
function notice(text) {
  const item = document.createElement("p");
  item.className = "notice";
  item.textContent = text;
  const close = document.createElement("button");
  close.textContent = "Dismiss";
  close.onclick = () => item.remove();
  item.append(" ", close);
  $("notices").append(item);
}

// A failure no view handled is still said, not lost in a console nobody sees.
window.addEventListener("unhandledrejection", (event) => notice(String(event.reason)));
window.addEventListener("error", (event) => notice(event.message));
const chat = new ChatView($("view-chat"), api);
const dashboard = new Dashboard($("view-dashboard"), api);
const settings = new SettingsView($("view-settings"), api);

function show(view) {
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  for (const button of document.querySelectorAll("nav button")) {
    button.classList.toggle("active", button.dataset.view === view);
  }
  dashboard.setVisible(view === "dashboard");
  if (view === "models") refreshModels();
  if (view === "settings") settings.load();
}

let loadingSince = null;
async function refreshStatus() {
  const status = await api.modelStatus();
  if (status.state === "loading") loadingSince ??= Date.now();
  else loadingSince = null;
  const seconds = loadingSince ? (Date.now() - loadingSince) / 1000 : 0;
  $("model-status").textContent = describeModelStatus(status, seconds);
  $("model-status").classList.toggle("loading", status.state === "loading");
  const bar = $("model-progress");
  bar.hidden = !(status.state === "loading" && status.bytes_total > 0);
  if (!bar.hidden) bar.value = status.bytes_read / status.bytes_total;
}

async function refreshModels() {
  const list = $("models");
  list.replaceChildren();
  for (const model of await api.listModels()) {
    const item = document.createElement("li");
    const bits = model.quantization_bits ? `, ${model.quantization_bits}-bit` : "";
    item.textContent = `${model.name} (${model.model_type ?? "?"}${bits}, ${mib(model.size_bytes)}, ${model.source}) `;
    const load = document.createElement("button");
    load.textContent = "Load";
    load.onclick = async () => {
      const poll = setInterval(refreshStatus, 250);
      try {
        await api.loadModel(model.path);
      } catch {
        // The status line shows the error (model_status is `failed`).
      } finally {
        clearInterval(poll);
        refreshStatus();
      }
    };
    item.append(load);
    list.append(item);
  }
  if (!list.children.length) list.textContent = "No models found in Perch's models directory or the Hugging Face cache.";
}


for (const button of document.querySelectorAll("nav button")) {
  button.onclick = () => show(button.dataset.view);
}
$("unload").onclick = () => api.unloadModel().then(refreshStatus);
api.onNavigate(show);

api.startupNotices().then((notices) => notices.forEach(notice));
chat.init().catch((error) => chat.showError(String(error)));
dashboard.start();
refreshStatus();
setInterval(refreshStatus, 1000);
