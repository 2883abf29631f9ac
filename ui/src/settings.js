// The settings view: a form over the `Settings` of perch-store (src/settings.rs there), read
// with `get_settings` and saved with `save_settings`, which validates and says what is wrong.
// Each input names its setting with data-setting="path.in.settings"; data-scale turns the
// shown unit into the stored one (MiB into bytes).

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

export class SettingsView {
  constructor(root, api) {
    this.root = root;
    this.api = api;
    this.view = null; // SettingsView from Rust: {settings, models_dir, total_memory_bytes, defaults}
    this.message = root.querySelector("#settings-message");
    root.querySelector("#settings-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.save();
    });
    root.querySelector("#settings-reset").addEventListener("click", () => this.fill(this.view.defaults));
  }

  inputs() {
    return [...this.root.querySelectorAll("[data-setting]")];
  }

  async load() {
    this.view = await this.api.getSettings();
    this.fill(this.view.settings);
    this.message.textContent = "";
  }

  fill(settings) {
    for (const input of this.inputs()) writeInput(input, getPath(settings, input.dataset.setting));
    const models = this.root.querySelector("[data-setting=models_dir]");
    models.placeholder = this.view.models_dir;
    const kv = this.root.querySelector("[data-setting=kv_cache_bytes]");
    kv.max = String(Math.floor(this.view.total_memory_bytes / 2 ** 20));
  }

  /** The form's settings, over the loaded ones (fields the form does not show are kept). */
  read() {
    let settings = this.view.settings;
    for (const input of this.inputs()) settings = setPath(settings, input.dataset.setting, readInput(input));
    return settings;
  }

  async save() {
    try {
      this.view = await this.api.saveSettings(this.read());
      this.fill(this.view.settings);
      this.message.textContent = "Saved. The KV cache budget and block size apply when a model is next loaded.";
      this.message.classList.remove("error");
    } catch (error) {
      this.message.textContent = String(error);
      this.message.classList.add("error");
    }
  }
}
