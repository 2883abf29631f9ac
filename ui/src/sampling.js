// A form's sampling: its Sampling menu (the model's defaults, a preset, Custom), its source
// ("model" or "custom") and the five fields a preset or the model's defaults set. Used by the
// Settings form and by a conversation's settings. With the source "model" the fields are
// read-only and show the loaded model's defaults (and are not saved as the user's); with
// "custom" they are the user's. The values live in the inputs (the forms are uncontrolled, read
// when saved); this hook writes them when a preset is chosen or the model's defaults are shown.

import { useLayoutEffect, useMemo, useRef, useState } from "preact/hooks";
import { describeSamplingDefaults, samplingDefault, SAMPLING_DEFAULT_FIELDS } from "./form.js";
import { presetOf, SAMPLING_PRESETS } from "./presets.js";

/**
 * `status`: the last model_status (its sampling defaults); `saved()`: the saved sampling, which
 * blank fields start from when Custom is chosen; `onCustom()`: called when Custom is chosen (to
 * show the fields). Returns {source, choice, note, refs, filled, onSourceChange, onPresetChange,
 * onFieldInput}: the source and Sampling menus' values, the note under them, a ref callback per
 * field, and the handlers. Call `filled(source)` after the form's inputs were written.
 */
export function useSampling({ status, saved, onCustom }) {
  const inputs = useRef({});
  const [source, setSource] = useState("model");
  const [choice, setChoice] = useState("model");
  // The latest props, and the source as last applied: read by handlers that may run before
  // the next redraw (a script changing the source and the values at once).
  const latest = useRef(null);
  latest.current = { status, saved, onCustom };
  const sourceNow = useRef("model");

  const refs = useMemo(
    () => Object.fromEntries(SAMPLING_DEFAULT_FIELDS.map((name) => [name, (input) => input && (inputs.current[name] = input)])),
    [],
  );
  const shown = () =>
    Object.fromEntries(SAMPLING_DEFAULT_FIELDS.map((name) => [name, inputs.current[name].value === "" ? null : Number(inputs.current[name].value)]));
  const showDefaults = () => {
    for (const name of SAMPLING_DEFAULT_FIELDS) {
      const value = samplingDefault(latest.current.status, name);
      inputs.current[name].value = value == null ? "" : String(value);
    }
  };
  /** Applies `next` source: the model's defaults shown, or the preset the fields hold. */
  const apply = (next) => {
    sourceNow.current = next;
    setSource(next);
    if (next === "model") {
      showDefaults();
      setChoice("model");
    } else {
      setChoice(presetOf(shown()) ?? "custom");
    }
  };

  // A new model_status (another model loaded): its defaults are shown while following the model.
  const defaults = JSON.stringify(status?.state === "loaded" ? (status.sampling_defaults ?? null) : null);
  useLayoutEffect(() => {
    if (source === "model") showDefaults();
  }, [source, defaults]);

  return {
    source,
    choice,
    note: source === "model" ? describeSamplingDefaults(status) : "",
    refs,
    filled: apply,
    onSourceChange: (event) => apply(event.currentTarget.value),
    onPresetChange: (event) => {
      const name = event.currentTarget.value;
      const preset = SAMPLING_PRESETS[name];
      if (preset) for (const field of SAMPLING_DEFAULT_FIELDS) inputs.current[field].value = String(preset.values[field]);
      if (name !== "custom") {
        apply(name === "model" ? "model" : "custom");
        return;
      }
      // Custom keeps the values shown; blank ones (no model loaded to show its defaults) start
      // from the saved values, never 0. The choice stays Custom even where they match a preset.
      sourceNow.current = "custom";
      setSource("custom");
      const values = latest.current.saved?.() ?? {};
      for (const field of SAMPLING_DEFAULT_FIELDS) {
        if (inputs.current[field].value === "" && values[field] != null) inputs.current[field].value = String(values[field]);
      }
      setChoice("custom");
      latest.current.onCustom?.();
    },
    // Edited values are no preset any more (or another one).
    onFieldInput: () => {
      if (sourceNow.current !== "model") setChoice(presetOf(shown()) ?? "custom");
    },
  };
}
