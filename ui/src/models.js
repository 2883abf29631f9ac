// The models view: the models on this machine (Perch's models directory and the Hugging Face
// cache, `list_models`) with Load, and the model picker: search the Hugging Face Hub
// (`search_models`, mlx-community by default), see size and whether it fits, download at a
// revision with progress and cancel (`download_model`, `cancel_download`) into the Hugging Face
// cache; downloads that stopped before their end (`partial_downloads`) resume or are discarded.

import { errorElement } from "./errors.js";
import { downloadProgress } from "./download-progress.js";
import { decimalBytes, describeContext, describeFit, mib } from "./format.js";

/** Where a local model was found (`ModelSource` of perch-hub). */
const SOURCES = { perch: "Perch's models", hugging_face: "Hugging Face cache" };

export class ModelsView {
  /** `onLoad(path)` loads a model (main.js shows its progress in the status line). */
  constructor(root, api, onLoad) {
    this.root = root;
    this.api = api;
    this.onLoad = onLoad;
    this.local = root.querySelector("#models");
    this.results = root.querySelector("#hub-results");
    this.message = root.querySelector("#hub-message");
    this.searched = false;
    /** repo id → {bytes_done, bytes_total, ...} of the downloads running in this window. */
    this.downloads = new Map();
    /** repo id → the shown bars of its download ({show(progress)}: download-progress.js), in the
     * results and in the stopped downloads. */
    this.progressViews = new Map();
    this.partialViews = new Map();
    this.partials = root.querySelector("#partial-downloads");
    /** The stopped downloads the last listing found. */
    this.partialList = [];
    /** repo id → the error of its last failed download. */
    this.failures = new Map();
    /** repo id → the snapshot directory of a download finished in this window (results of a
     * search that was answered while it ran do not know it yet). */
    this.snapshots = new Map();
    /** Counts searches: only the latest one's answer is shown. */
    this.searches = 0;
    this.lastResults = [];
    for (const id of ["hub-only-fits", "hub-only-supported"]) {
      root.querySelector(`#${id}`).addEventListener("change", () => this.renderResults());
    }
    root.querySelector("#hub-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.search();
    });
  }

  /** Refreshes the local list; the first time, also lists the Hub's most downloaded models. */
  async show() {
    await this.refreshLocal();
    if (!this.searched) await this.search();
  }

  async refreshLocal() {
    await this.refreshPartials();
    const models = await this.api.listModels();
    this.local.replaceChildren();
    for (const model of models) {
      const item = document.createElement("li");
      const bits = model.quantization_bits ? `, ${model.quantization_bits}-bit` : "";
      const source = SOURCES[model.source] ?? model.source;
      item.textContent = `${model.name} (${model.model_type ?? "?"}${bits}, ${mib(model.size_bytes)}, ${source}) `;
      const load = this.button("Load", () => this.onLoad(model.path));
      // A model of an architecture Perch does not run says so, and which ones it runs.
      load.disabled = Boolean(model.architecture_note);
      item.append(load, " ", this.deleteButton(model));
      if (model.architecture_note) item.append(this.architectureNote(model.architecture_note));
      this.local.append(item);
    }
    if (!models.length) this.local.textContent = "No models found in Perch's models directory or the Hugging Face cache.";
    const total = models.reduce((sum, model) => sum + (model.size_bytes ?? 0), 0);
    this.root.querySelector("#models-disk").textContent = models.length
      ? `${models.length} ${models.length === 1 ? "model" : "models"}, ${decimalBytes(total)} on disk`
      : "";
  }

  /** Lists the downloads that stopped before their end (a failed listing shows as none). */
  async refreshPartials() {
    const status = this.root.querySelector("#partial-status");
    try {
      this.partialList = await this.api.partialDownloads();
      if (status.querySelector(".error")) status.replaceChildren();
    } catch (error) {
      this.partialList = [];
      this.root.querySelector("#partial-status").replaceChildren(errorElement(document, error));
    }
    this.renderPartials();
  }

  renderPartials() {
    this.partialViews.clear();
    const status = this.root.querySelector("#partial-status");
    // Shown while there are some, or a listing's failure to say.
    this.root.querySelector("#partial-section").hidden = this.partialList.length === 0 && !status.hasChildNodes();
    this.partials.replaceChildren(...this.partialList.map((download) => this.partialItem(download)));
  }

  /** A stopped download: what it fetched, Resume and Discard, or its bar while it resumes. */
  partialItem(download) {
    const id = download.repo_id;
    const item = document.createElement("li");
    item.dataset.repo = id;
    const fetched = `${decimalBytes(download.bytes_present)} fetched`;
    const snapshot = download.has_snapshot ? ", another revision complete" : "";
    const at = download.revision && download.revision !== "main" ? `, at ${download.revision}` : "";
    item.textContent = `${id} (${fetched}${at}${snapshot}) `;
    const progress = this.downloads.get(id);
    if (progress) {
      const view = downloadProgress(document, id, progress);
      this.partialViews.set(id, view);
      item.append(view.bar, view.text, this.button("Cancel", () => this.api.cancelDownload(id)));
    } else {
      // At the revision it asked for; one not started here (mlx-lm's) at the field's.
      const revision = download.revision ?? (this.root.querySelector("#hub-revision").value.trim() || "main");
      const resume = this.button("Resume", () => this.download({ id }, revision));
      resume.setAttribute("aria-label", `Resume downloading ${id} at ${revision}`);
      const discard = this.button("Discard", () => this.discard(id, discard));
      discard.setAttribute("aria-label", `Discard what was fetched of ${id}`);
      item.append(resume, " ", discard);
    }
    if (this.failures.has(id)) item.append(errorElement(document, this.failures.get(id)));
    return item;
  }

  async discard(id, button) {
    button.disabled = true;
    const status = this.root.querySelector("#partial-status");
    try {
      const freed = await this.api.discardPartialDownload(id);
      status.textContent = `Discarded the download of ${id}: ${decimalBytes(freed)} freed.`;
      await this.refreshPartials();
    } catch (error) {
      status.replaceChildren(errorElement(document, error));
      button.disabled = false;
    }
  }

  async search() {
    this.searched = true;
    const search = ++this.searches;
    const text = this.root.querySelector("#hub-search").value.trim();
    const author = this.root.querySelector("#hub-author").value;
    this.message.textContent = "Searching…";
    let found;
    try {
      found = await this.api.searchModels(text, author);
    } catch (error) {
      found = error;
    }
    // An older search answered late (searches fetch every result's config) changes nothing.
    if (search !== this.searches) return;
    this.lastResults = Array.isArray(found) ? found : [];
    if (Array.isArray(found)) this.message.textContent = found.length ? "" : "No models found.";
    else this.message.replaceChildren(errorElement(document, found));
    this.renderResults();
  }

  /** The results the filters keep ("Fits in memory", "Runs in Perch"); a download under way always shows. */
  shownResults() {
    const onlyFits = this.root.querySelector("#hub-only-fits").checked;
    const onlySupported = this.root.querySelector("#hub-only-supported").checked;
    return this.lastResults.filter(
      (model) =>
        this.downloads.has(model.id) ||
        ((!onlyFits || model.fit === "fits") && (!onlySupported || !model.architecture_note)),
    );
  }

  renderResults() {
    this.progressViews.clear();
    const shown = this.shownResults();
    this.results.replaceChildren(...shown.map((model) => this.resultItem(model)));
    const hidden = this.lastResults.length - shown.length;
    this.root.querySelector("#hub-hidden").textContent = hidden > 0 ? `${hidden} more hidden by the filters.` : "";
  }

  resultItem(model) {
    const item = document.createElement("li");
    item.dataset.repo = model.id;
    const title = document.createElement("span");
    title.className = "repo";
    title.textContent = model.id;
    const fit = describeFit(model.fit);
    const details = document.createElement("span");
    details.className = `details fit-${model.fit}`;
    const size = model.weights_bytes == null ? "size unknown" : decimalBytes(model.weights_bytes);
    const architecture = model.model_type ? ` · ${model.model_type}` : "";
    const context = describeContext(model.context_tokens);
    details.textContent = ` ${size} · ${fit}${context} · ${model.downloads.toLocaleString()} downloads${architecture} `;
    item.append(title, details);
    // Said before any byte is downloaded; downloading stays possible (the cache is mlx-lm's too).
    if (model.architecture_note) item.append(this.architectureNote(model.architecture_note));

    const progress = this.downloads.get(model.id);
    const snapshot = model.snapshot_dir ?? this.snapshots.get(model.id);
    if (progress) {
      const view = downloadProgress(document, model.id, progress);
      this.progressViews.set(model.id, view);
      item.append(view.bar, view.text, this.button("Cancel", () => this.api.cancelDownload(model.id)));
    } else if (snapshot) {
      item.append(this.button("Load", () => this.onLoad(snapshot)));
    } else {
      item.append(this.button("Download", () => this.download(model)));
    }
    if (this.failures.has(model.id)) item.append(errorElement(document, this.failures.get(model.id)));
    return item;
  }

  /** Downloads `model` at `revision`, else at the revision field's (`main` when empty). */
  async download(model, revision) {
    this.failures.delete(model.id);
    this.downloads.set(model.id, { bytes_done: 0, bytes_total: 0, files_done: 0, files_total: 0 });
    this.renderResults();
    this.renderPartials();
    revision ??= this.root.querySelector("#hub-revision").value.trim();
    try {
      const done = await this.api.downloadModel(
        model.id,
        (progress) => {
          this.downloads.set(model.id, progress);
          this.updateProgress(model.id, progress);
        },
        revision || undefined,
      );
      this.snapshots.set(model.id, done.snapshot_dir);
    } catch (error) {
      this.failures.set(model.id, error);
    } finally {
      this.downloads.delete(model.id);
      this.renderResults();
    }
    // A cancelled or failed download is listed as stopped now; a finished one as local.
    try {
      await this.refreshLocal();
    } catch (error) {
      this.local.replaceChildren(errorElement(document, error));
    }
  }

  /** Moves one download's bars without rebuilding the lists (they update ten times a second). */
  updateProgress(repo, progress) {
    this.progressViews.get(repo)?.show(progress);
    this.partialViews.get(repo)?.show(progress);
  }

  /** "Not supported yet", with the sentence that names the architecture and those Perch runs. */
  architectureNote(sentence) {
    const note = document.createElement("span");
    note.className = "unsupported";
    note.textContent = "Not supported yet ";
    note.title = sentence;
    const why = document.createElement("small");
    why.textContent = `(${sentence}) `;
    note.append(why);
    return note;
  }

  /** "Delete", then "Confirm delete" for 4 s; deleting says the space freed (or why not). */
  deleteButton(model) {
    const button = this.button("Delete", async () => {
      if (button.textContent === "Delete") {
        button.textContent = "Confirm delete";
        button.setAttribute("aria-label", `Confirm delete ${model.name}`);
        button.classList.add("confirm");
        setTimeout(() => {
          button.textContent = "Delete";
          button.setAttribute("aria-label", `Delete ${model.name}`);
          button.classList.remove("confirm");
        }, 4000);
        return;
      }
      button.disabled = true;
      const status = this.root.querySelector("#models-deleted");
      try {
        const freed = await this.api.deleteModel(model.path);
        status.textContent = `Deleted ${model.name}: ${decimalBytes(freed)} freed.`;
        await this.refreshLocal();
      } catch (error) {
        status.replaceChildren(errorElement(document, error));
        button.disabled = false;
      }
    });
    button.setAttribute("aria-label", `Delete ${model.name}`);
    return button;
  }

  button(label, onClick) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.onclick = onClick;
    return button;
  }
}
