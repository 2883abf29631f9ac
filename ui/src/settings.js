// The settings view: a form over the `Settings` of perch-store (src/settings.rs there), read
// with `get_settings` and saved with `save_settings`, which validates and says what is wrong.
// Each input names its setting with data-setting="path.in.settings"; data-scale turns the
// shown unit into the stored one (MiB into bytes).

import { errorElement } from "./errors.js";
import { bindPresets } from "./presets.js";

/** The value at dotted `path` of `object`. */
export function getPath(object, path) {
  return path.split(".").reduce((value, key) => value?.[key], object);
}

/** A copy of `object` with `value` at dotted `path`. */
export function setPath(object, path, value) {
  const [key, ...rest] = path.split(".");
  return { ...object, [key]: rest.length ? setPath(object?.[key] ?? {}, rest.join("."), value) : value };
}

/** Reads `input` as its setting's value: numbers scaled, empty optional fields as null. */
export function readInput(input) {
  const scale = Number(input.dataset.scale ?? 1);
  if (input.type === "checkbox") return input.checked;
  if (input.dataset.optional !== undefined && input.value.trim() === "") return null;
  if (input.type === "number" || input.dataset.type === "number") {
    return Math.round(Number(input.value) * scale * 1e6) / 1e6;
  }
  return input.value;
}

/** Shows `value` in `input`, scaled to the shown unit. */
export function writeInput(input, value) {
  const scale = Number(input.dataset.scale ?? 1);
  if (input.type === "checkbox") input.checked = Boolean(value);
  else if (value == null) input.value = "";
  else if (input.type === "number" || input.dataset.type === "number") input.value = String(value / scale);
  else input.value = value;
}

/** Sampling fields that follow the model when the source is "model" (SamplingDefaults' names). */
export const SAMPLING_DEFAULT_FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty"];

/**
 * Where a chat's sampling comes from, in a sentence: `status` is the `model_status` command's
 * ModelStatus (its `sampling_defaults` when a model is loaded).
 */
export function describeSamplingDefaults(status) {
  if (status?.state !== "loaded" || !status.sampling_defaults) {
    return "The loaded model's defaults: its generation_config.json's values, else Perch's. No model is loaded.";
  }
  if (status.sampling_defaults.source === "model") return `From ${status.name}'s generation_config.json.`;
  return `Perch's defaults: ${status.name}'s generation_config.json names none.`;
}

/**
 * Shows the sampling source's effect on a form: with "model", the sampling inputs (`inputs`:
 * [name, input] pairs) are read-only and show the loaded model's defaults; with "custom", they are
 * editable. `note` says where the values come from.
 */
export function showSamplingSource(source, inputs, note, status) {
  const followModel = source === "model";
  for (const [name, input] of inputs) {
    input.disabled = followModel;
    if (followModel) {
      const value = status?.state === "loaded" ? status.sampling_defaults?.[name] : undefined;
      input.value = value == null ? "" : String(value);
    }
  }
  note.textContent = followModel ? describeSamplingDefaults(status) : "";
}

export class SettingsView {
  constructor(root, api) {
    this.root = root;
    this.api = api;
    this.view = null; // SettingsView from Rust: {settings, models_dir, total_memory_bytes, defaults}
    this.modelStatus = null; // the last model_status, for the model's sampling defaults
    this.message = root.querySelector("#settings-message");
    this.samplingSource = root.querySelector("[data-setting='chat.sampling_source']");
    this.samplingSource.addEventListener("change", () => this.showSampling());
    this.showPreset = bindPresets(
      root.querySelector("#settings-preset"),
      this.samplingSource,
      () => this.samplingInputs(),
      () => this.showSampling(),
      () => (root.querySelector("#settings-advanced").open = true),
      () => this.view?.settings?.chat?.sampling,
    );
    root.querySelector("#settings-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.save();
    });
    root.querySelector("#settings-reset").addEventListener("click", () => this.fill(this.view.defaults));
  }

  inputs() {
    return [...this.root.querySelectorAll("[data-setting]")];
  }

  /**
   * Reads the saved settings into the form. Until they arrive the form cannot be saved (its
   * Save button is disabled and the view's `data-ready` is "false"), so that edits made to the
   * form's previous contents are never overwritten by, or saved over, the settings on disk.
   */
  async load() {
    const submit = this.root.querySelector("#settings-form button[type=submit]");
    this.root.dataset.ready = "false";
    submit.disabled = true;
    try {
      this.view = await this.api.getSettings();
      this.modelStatus = await this.api.modelStatus?.().catch(() => null);
      this.fill(this.view.settings);
      this.message.textContent = "";
      submit.disabled = false;
      this.root.dataset.ready = "true";
    } catch (error) {
      this.message.replaceChildren(errorElement(document, error, "span"));
    }
  }

  fill(settings) {
    for (const input of this.inputs()) writeInput(input, getPath(settings, input.dataset.setting));
    const models = this.root.querySelector("[data-setting=models_dir]");
    models.placeholder = this.view.models_dir;
    const kv = this.root.querySelector("[data-setting=kv_cache_bytes]");
    kv.max = String(Math.floor(this.view.total_memory_bytes / 2 ** 20));
    this.showSampling();
  }

  /** [name, input] of the sampling fields that a preset or the model's defaults set. */
  samplingInputs() {
    return SAMPLING_DEFAULT_FIELDS.map((name) => [name, this.root.querySelector(`[data-setting='chat.sampling.${name}']`)]);
  }

  /** The sampling inputs follow the source select (read-only model defaults, or custom). */
  showSampling() {
    showSamplingSource(this.samplingSource.value, this.samplingInputs(), this.root.querySelector("#settings-sampling-note"), this.modelStatus);
    this.showPreset();
  }

  /**
   * The form's settings, over the loaded ones (fields the form does not show are kept; sampling
   * values shown read-only from the model are not saved as the user's).
   */
  read() {
    let settings = this.view.settings;
    for (const input of this.inputs()) {
      if (!input.disabled) settings = setPath(settings, input.dataset.setting, readInput(input));
    }
    return settings;
  }

  async save() {
    try {
      this.view = await this.api.saveSettings(this.read());
      this.fill(this.view.settings);
      this.message.textContent = "Saved. The KV cache budget, block size and draft model apply when a model is next loaded.";
    } catch (error) {
      this.message.replaceChildren(errorElement(document, error, "span"));
    }
  }
}
