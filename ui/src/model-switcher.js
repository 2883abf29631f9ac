// The chat header's model switcher: the models on this machine (`list_models`) with their size,
// whether they fit in memory (its `fit`) and whether Perch runs them; choosing one loads it (main.js shows
// the progress in the status line).

import { decimalBytes, describeFit } from "./format.js";

/** One option's text: "SmolLM2-135M · 104 MB · fits in memory", "… · too large for this machine",
 * "… · not supported" (`fit`: list_models' rule, the Hub search's). */
export function optionLabel(model) {
  const parts = [model.name, decimalBytes(model.size_bytes)];
  if (model.architecture_note) parts.push("not supported");
  else if (model.fit && model.fit !== "unknown") parts.push(describeFit(model.fit));
  return parts.join(" · ");
}

export class ModelSwitcher {
  /** `select`: the header's <select>; `onLoad(path)` loads a model. */
  constructor(select, api, onLoad) {
    this.select = select;
    this.api = api;
    this.path = null; // the loaded model's directory, from model_status
    select.addEventListener("change", () => {
      if (select.value && select.value !== this.path) onLoad(select.value);
    });
  }

  /** Lists the models on this machine again (after a download, a load, a new models directory). */
  async refresh() {
    const models = await this.api.listModels();
    const doc = this.select.ownerDocument;
    const options = models.map((model) => {
      const option = doc.createElement("option");
      option.value = model.path;
      option.textContent = optionLabel(model);
      option.disabled = Boolean(model.architecture_note);
      if (model.architecture_note) option.title = model.architecture_note;
      return option;
    });
    const none = doc.createElement("option");
    none.value = "";
    none.textContent = models.length ? "Choose a model" : "No models on this machine: see Models";
    none.disabled = true;
    this.select.replaceChildren(none, ...options);
    this.show();
  }

  /** Follows `status` (model_status): the loaded model selected, the switcher off while loading. */
  setStatus(status) {
    const path = status?.state === "loaded" ? status.path : null;
    this.select.disabled = status?.state === "loading";
    if (path === this.path) return; // polled every second: leave an open menu alone
    this.path = path;
    this.name = status?.name ?? path;
    this.show();
  }

  /** Selects the loaded model: listed, or added (one loaded from elsewhere, e.g. $PERCH_MODEL). */
  show() {
    if (this.path && ![...this.select.options].some((o) => o.value === this.path)) {
      const option = this.select.ownerDocument.createElement("option");
      option.value = this.path;
      option.textContent = this.name;
      this.select.append(option);
      const none = this.select.options[0];
      if (none?.value === "" && this.select.options.length === 2) none.textContent = "Choose a model";
    }
    this.select.value = this.path ?? "";
  }
}
