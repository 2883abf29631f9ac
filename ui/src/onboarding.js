// First run: what Perch is, what this machine can run (its memory), models that fit — the ones
// already here, and the Hub's most downloaded mlx-community models when it is reachable — a
// download with progress and cancel, and then the chat. Shown until it is finished or skipped
// once (remembered in the settings, `finish_first_run`).

import { errorElement } from "./errors.js";
import { downloadProgress } from "./download-progress.js";
import { decimalBytes } from "./format.js";

const DONE_KEY = "perch.onboarded";

/** How many of the Hub's models that fit are offered. */
const HUB_OFFERS = 4;

/** "This machine has 16 GB of memory: models up to about 12 GB fit." (system_stats' usable memory) */
export function describeMachine(system) {
  if (!(system?.ram_total_bytes > 0)) return "Perch could not read this machine's memory; the sizes below tell what each model needs.";
  return `This machine has ${decimalBytes(system.ram_total_bytes)} of memory: models up to about ${decimalBytes(system.usable_memory_bytes)} fit.`;
}

export class Onboarding {
  /**
   * `root`: the #onboarding element; `onLoad(path)` loads a model (resolves when it is loaded);
   * `onDone()` shows the chat; `storage`: the web view's storage, where earlier versions
   * remembered "finished" (read once, to move it to the settings).
   */
  constructor(root, api, { onLoad, onDone, storage }) {
    this.root = root;
    this.api = api;
    this.onLoad = onLoad;
    this.onDone = onDone;
    this.storage = storage;
    this.downloading = null; // repo id
    this.finished = false;
    this.$ = (id) => root.querySelector(`#${id}`);
    this.$("onboarding-skip").addEventListener("click", () => this.finish());
    this.$("onboarding-start").addEventListener("click", () => this.finish());
  }

  /** Whether the first run is still to be shown: not when the settings say it was done, nor
   * when the web view's storage does (where earlier versions kept it: moved to the settings). */
  async pending() {
    const view = await this.api.getSettings();
    if (view.settings.first_run_done) return false;
    if (this.storage?.getItem(DONE_KEY) === "1") {
      await this.api.finishFirstRun();
      return false;
    }
    return true;
  }

  /** Shows the first-run screen and fills it (the machine, then the models). */
  async open() {
    this.finished = false;
    this.root.hidden = false;
    // A modal screen: the rest of the page cannot be reached (tab, screen readers) behind it.
    for (const element of this.root.ownerDocument.body.children) {
      if (element !== this.root) element.setAttribute("inert", "");
    }
    this.$("onboarding-title").focus?.();
    this.$("onboarding-machine").textContent = describeMachine(await this.api.systemStats().catch(() => null));
    const list = this.$("onboarding-models");
    const message = this.$("onboarding-message");
    list.replaceChildren();
    message.replaceChildren();
    const local = await this.api.listModels().catch(() => []);
    for (const model of local.filter((m) => !m.architecture_note && m.fit !== "too_large")) {
      list.append(this.item(model.name, `${decimalBytes(model.size_bytes)} · on this machine`, "Use", () => this.use(model.path)));
    }
    let offers = [];
    try {
      const found = await this.api.searchModels("", "mlx-community");
      const here = new Set(local.map((m) => m.name));
      offers = found.filter((m) => m.fit === "fits" && !m.architecture_note && !here.has(m.id)).slice(0, HUB_OFFERS);
    } catch (error) {
      message.append(errorElement(this.root.ownerDocument, error));
      if (local.length) message.append("The models already on this machine are ready to use.");
    }
    for (const model of offers) {
      const details = `${decimalBytes(model.weights_bytes)} · ${model.downloads.toLocaleString()} downloads`;
      list.append(this.item(model.id, details, "Download", (item) => this.download(model, item)));
    }
    if (!list.children.length && !message.children.length) message.textContent = "No model that fits was found; you can pick one under Models later.";
  }

  item(title, details, action, onClick) {
    const doc = this.root.ownerDocument;
    const item = doc.createElement("li");
    const name = doc.createElement("span");
    name.className = "repo";
    name.textContent = title;
    const about = doc.createElement("span");
    about.className = "details";
    about.textContent = ` ${details} `;
    const button = doc.createElement("button");
    button.type = "button";
    button.textContent = action;
    button.setAttribute("aria-label", `${action} ${title}`);
    button.addEventListener("click", () => onClick(item));
    item.append(name, about, button);
    return item;
  }

  /** Loads a model already here, then opens the chat (its buttons off meanwhile). */
  async use(path) {
    if (this.finished) return;
    this.setBusy(true);
    this.$("onboarding-message").textContent = "Loading the model…";
    try {
      await this.onLoad(path);
    } finally {
      this.setBusy(false);
    }
    this.finish();
  }

  /** Turns the models' buttons off while a model downloads or loads (one at a time). */
  setBusy(busy) {
    for (const button of this.$("onboarding-models").querySelectorAll("button:not(.cancel)")) button.disabled = busy;
  }

  /** Downloads `model` with progress and Cancel, then loads it and opens the chat. */
  async download(model, item) {
    if (this.downloading) return;
    this.downloading = model.id;
    const doc = this.root.ownerDocument;
    const { bar, text, show } = downloadProgress(doc, model.id);
    const cancel = doc.createElement("button");
    cancel.type = "button";
    cancel.className = "cancel";
    cancel.textContent = "Cancel";
    cancel.addEventListener("click", () => this.api.cancelDownload(model.id));
    const action = item.querySelector("button");
    action.hidden = true;
    item.querySelector(".error")?.remove();
    item.append(bar, text, cancel);
    this.setBusy(true);
    cancel.focus?.();
    try {
      const done = await this.api.downloadModel(model.id, show);
      this.downloading = null;
      this.setBusy(false);
      // Skipped meanwhile: the download stays in the cache, nothing is loaded.
      if (!this.finished) await this.use(done.snapshot_dir);
    } catch (error) {
      if (!this.finished) item.append(errorElement(doc, error));
      action.hidden = false;
      action.focus?.();
    } finally {
      bar.remove();
      text.remove();
      cancel.remove();
      this.downloading = null;
      this.setBusy(false);
    }
  }

  /** Remembers that the first run is done and shows the chat. */
  finish() {
    if (this.finished) return;
    this.finished = true;
    if (this.downloading) this.api.cancelDownload(this.downloading).catch(() => {});
    // Kept in the settings; if that fails the screen comes back at the next start, nothing more.
    this.api.finishFirstRun().catch(() => {});
    this.root.hidden = true;
    for (const element of this.root.ownerDocument.body.querySelectorAll(":scope > [inert]")) element.removeAttribute("inert");
    this.onDone();
  }

  /** Errors of the first run itself, said on its screen (notices are behind it). */
  showError(error) {
    this.$("onboarding-message").replaceChildren(errorElement(this.root.ownerDocument, error));
  }
}
