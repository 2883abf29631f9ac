// Perch's window: wires the views (chat, dashboard, models, settings) to the Rust commands.

import "./locale.js"; // first: before uPlot reads the locale
import "./style.css";
import { api } from "./api.js";
import { ChatView } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { SettingsView } from "./settings.js";
import { ModelsView } from "./models.js";
import { ModelSwitcher } from "./model-switcher.js";
import { Onboarding } from "./onboarding.js";
import { describeModelStatus } from "./format.js";
import { errorElement } from "./errors.js";
import { addIcons } from "./icons.js";

const $ = (id) => document.getElementById(id);
addIcons(document);

/** Shows `content` (a sentence or an element) above the views until dismissed. */
function notice(content) {
  const item = document.createElement("div");
  item.className = "notice";
  item.append(content);
  const close = document.createElement("button");
  close.textContent = "Dismiss";
  close.onclick = () => item.remove();
  item.append(" ", close);
  $("notices").append(item);
}

// A failure no view handled is still said, not lost in a console nobody sees.
window.addEventListener("unhandledrejection", (event) => notice(errorElement(document, event.reason, "span")));
window.addEventListener("error", (event) => notice(errorElement(document, event.error ?? event.message, "span")));
const chat = new ChatView($("view-chat"), api);
const dashboard = new Dashboard($("view-dashboard"), api);
const settings = new SettingsView($("view-settings"), api);
const models = new ModelsView($("view-models"), api, loadModel);
const switcher = new ModelSwitcher($("chat-model"), api, loadModel);
const onboarding = new Onboarding($("onboarding"), api, {
  onLoad: loadModel,
  onDone: () => {
    show("chat");
    $("input").focus();
  },
  storage: window.localStorage,
});

function show(view) {
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== `view-${view}`;
  }
  for (const button of document.querySelectorAll("nav button")) {
    const current = button.dataset.view === view;
    button.classList.toggle("active", current);
    if (current) button.setAttribute("aria-current", "page");
    else button.removeAttribute("aria-current");
  }
  dashboard.setVisible(view === "dashboard");
  if (view === "models") models.show();
  if (view === "chat") switcher.refresh().catch(() => {});
  if (view === "settings") settings.load();
}

let loadingSince = null;
async function refreshStatus() {
  const status = await api.modelStatus();
  if (status.state === "loading") loadingSince ??= Date.now();
  else loadingSince = null;
  const seconds = loadingSince ? (Date.now() - loadingSince) / 1000 : 0;
  $("model-status").textContent = describeModelStatus(status, seconds);
  chat.setModelStatus(status);
  switcher.setStatus(status);
  $("model-status").classList.toggle("loading", status.state === "loading");
  const bar = $("model-progress");
  bar.hidden = !(status.state === "loading" && status.bytes_total > 0);
  if (!bar.hidden) bar.value = status.bytes_read / status.bytes_total;
}

/** Loads the model in `path`, showing its progress in the status line. */
async function loadModel(path) {
  const poll = setInterval(refreshStatus, 250);
  try {
    await api.loadModel(path);
  } catch {
    // The status line shows the error (model_status is `failed`).
  } finally {
    clearInterval(poll);
    refreshStatus();
    switcher.refresh().catch(() => {});
  }
}

for (const button of document.querySelectorAll("nav button")) {
  button.onclick = () => show(button.dataset.view);
}
$("unload").onclick = () => api.unloadModel().then(refreshStatus);
api.onNavigate(show);
api.onNewChat(() => chat.newConversation().catch((error) => chat.showError(error)));
api.onNotice((error) => notice(errorElement(document, error, "span")));
// The tray switched the local server: the form shows it, so a later Save keeps it.
api.onSettingsChanged(() => settings.load());

api.startupNotices().then((notices) => notices.forEach(notice));
chat.init().catch((error) => chat.showError(error));
switcher.refresh().catch(() => {}); // the Models view says why the list is unavailable
onboarding
  .pending()
  .then((pending) => pending && onboarding.open())
  .catch((error) => onboarding.showError(error));
dashboard.start();
refreshStatus();
setInterval(refreshStatus, 1000);
