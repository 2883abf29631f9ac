// Form fields as the settings forms read and write them: the Settings form's inputs name their
// setting with data-setting="path.in.settings" (data-scale turns the shown unit into the stored
// one, MiB into bytes); both forms keep their values in the inputs themselves (uncontrolled), so
// what the form shows is what is saved. Pure helpers over elements: tested in tests/settings.test.jsx.

/** The value at dotted `path` of `object`. */
export function getPath(object, path) {
  return path.split(".").reduce((value, key) => value?.[key], object);
}

/** A copy of `object` with `value` at dotted `path`. */
export function setPath(object, path, value) {
  const [key, ...rest] = path.split(".");
  return { ...object, [key]: rest.length ? setPath(object?.[key] ?? {}, rest.join("."), value) : value };
}

/** Reads `input` as its setting's value: numbers scaled, empty optional fields as null, a list
 * (data-type="list") as its comma- or space-separated names. */
export function readInput(input) {
  const scale = Number(input.dataset.scale ?? 1);
  if (input.type === "checkbox") return input.checked;
  if (input.dataset.type === "list") return input.value.split(/[\s,]+/).filter(Boolean);
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
  else if (input.dataset.type === "list") input.value = value.join(", ");
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

/** The loaded model's default for sampling field `name`, or null (no model loaded). */
export function samplingDefault(status, name) {
  const value = status?.state === "loaded" ? status.sampling_defaults?.[name] : undefined;
  return value ?? null;
}
