// Sampling presets: named sets of the sampling fields a user would otherwise tune one by one
// (LM Studio and Ollama users know them as "precise" and "creative" settings). Choosing one
// makes the chat's sampling "custom" with these values; the model's defaults stay one choice away.

/** name → {label, values}: values of SAMPLING_DEFAULT_FIELDS (settings.js). top_k 0 is off. */
export const SAMPLING_PRESETS = {
  precise: { label: "Precise", values: { temperature: 0.2, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1 } },
  balanced: { label: "Balanced", values: { temperature: 0.7, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1.05 } },
  creative: { label: "Creative", values: { temperature: 1, top_p: 0.95, top_k: 0, min_p: 0.05, repetition_penalty: 1.1 } },
};

/** The preset whose values `values` ({field: number}) hold exactly, or null. */
export function presetOf(values) {
  const same = (a, b) => Math.abs(Number(a) - b) < 1e-9;
  for (const [name, preset] of Object.entries(SAMPLING_PRESETS)) {
    if (Object.entries(preset.values).every(([field, value]) => values?.[field] != null && same(values[field], value))) {
      return name;
    }
  }
  return null;
}

/**
 * Ties a form's Sampling choice (`preset`: an empty <select>, given the options "model", the
 * presets' names and "custom") to its source select (`source`: "model" or "custom") and its sampling inputs
 * (`inputs()`: [field, input] pairs). Choosing a preset makes the source "custom" and writes its
 * values; "custom" keeps the values shown (blank ones from `saved()`, the saved sampling) and
 * calls `onCustom` (to show the fields); `apply()` applies the source to the inputs (read-only
 * model defaults, or editable). Returns
 * `show()`, which sets the choice from the form: "model", the preset its values hold, or
 * "custom" (call it whenever the form is filled).
 */
export function bindPresets(preset, source, inputs, apply, onCustom, saved) {
  const doc = preset.ownerDocument;
  const choices = [["model", "The model's defaults"], ...Object.entries(SAMPLING_PRESETS).map(([name, p]) => [name, p.label]), ["custom", "Custom"]];
  preset.replaceChildren(
    ...choices.map(([value, label]) => {
      const option = doc.createElement("option");
      option.value = value;
      option.textContent = label;
      return option;
    }),
  );
  const show = () => {
    if (source.value === "model") {
      preset.value = "model";
      return;
    }
    const values = Object.fromEntries(inputs().map(([field, input]) => [field, input.value === "" ? null : Number(input.value)]));
    preset.value = presetOf(values) ?? "custom";
  };
  preset.addEventListener("change", () => {
    const name = preset.value;
    source.value = name === "model" ? "model" : "custom";
    const chosen = SAMPLING_PRESETS[name];
    if (chosen) for (const [field, input] of inputs()) input.value = String(chosen.values[field]);
    apply();
    if (name === "custom") {
      // Blank fields (no model loaded to show its defaults) start from the saved values, never 0.
      const values = saved?.() ?? {};
      for (const [field, input] of inputs()) if (input.value === "" && values[field] != null) input.value = String(values[field]);
      onCustom?.();
    } else show();
  });
  for (const [, input] of inputs()) input.addEventListener("input", show);
  source.addEventListener("change", show);
  return show;
}
