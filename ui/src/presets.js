// Sampling presets: named sets of the sampling fields a user would otherwise tune one by one
// (LM Studio and Ollama users know them as "precise" and "creative" settings). Choosing one
// makes the chat's sampling "custom" with these values; the model's defaults stay one choice away.

/** name → {label, values}: values of SAMPLING_DEFAULT_FIELDS (form.js). top_k 0 is off. */
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

/** The Sampling menu's choices, [value, label]: the model's defaults, the presets, then Custom. */
export const PRESET_CHOICES = [
  ["model", "The model's defaults"],
  ...Object.entries(SAMPLING_PRESETS).map(([name, preset]) => [name, preset.label]),
  ["custom", "Custom"],
];
