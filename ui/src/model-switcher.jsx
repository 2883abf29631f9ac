// The chat header's model switcher: the models on this machine (`list_models`) with their size,
// whether they fit in memory (its `fit`) and whether Perch runs them; choosing one loads it
// (app.jsx shows the progress in the status line).

import { useEffect, useImperativeHandle, useLayoutEffect, useRef, useState } from "preact/hooks";
import { decimalBytes, describeFit } from "./format.js";

/** One option's text: "SmolLM2-135M · 104 MB · fits in memory", "… · too large for this machine",
 * "… · not supported" (`fit`: list_models' rule, the Hub search's); "sees images" for a model that
 * takes them. */
export function optionLabel(model) {
  const parts = [model.name, decimalBytes(model.size_bytes)];
  if (model.vision && !model.architecture_note) parts.push("sees images");
  if (model.architecture_note) parts.push("not supported");
  else if (model.fit && model.fit !== "unknown") parts.push(describeFit(model.fit));
  return parts.join(" · ");
}

/**
 * The #chat-model select. `status`: the last model_status (the loaded model is selected; the
 * switcher is off while one loads); `onLoad(path)` loads a model. `handle.current.refresh()`
 * lists the models again (after a download, a load, a new models directory).
 */
export function ModelSwitcher({ api, status, onLoad, handle }) {
  const select = useRef(null);
  const [models, setModels] = useState(null); // null until listed
  const path = status?.state === "loaded" ? status.path : null;

  const refresh = async () => setModels(await api.listModels());
  useImperativeHandle(handle, () => ({ refresh }));
  useEffect(() => {
    refresh().catch(() => {}); // the Models view says why the list is unavailable
  }, []);

  // The loaded model is selected when it changes or the list does, not at every status (polled
  // every second): an open menu is left alone.
  useLayoutEffect(() => {
    select.current.value = path ?? "";
  }, [path, models]);

  const listed = models ?? [];
  // A loaded model that is not listed (one loaded from elsewhere, e.g. $PERCH_MODEL) is added.
  const extra = path && !listed.some((m) => m.path === path) ? { path, name: status.name ?? path } : null;
  return (
    <select
      id="chat-model"
      aria-label="Model"
      ref={select}
      disabled={status?.state === "loading"}
      onChange={(event) => {
        const chosen = event.currentTarget.value;
        if (chosen && chosen !== path) onLoad(chosen);
      }}
    >
      {models && (
        <option value="" disabled>
          {listed.length || extra ? "Choose a model" : "No models on this machine: see Models"}
        </option>
      )}
      {listed.map((model) => (
        <option key={model.path} value={model.path} disabled={Boolean(model.architecture_note)} title={model.architecture_note || undefined}>
          {optionLabel(model)}
        </option>
      ))}
      {extra && <option key={`loaded:${extra.path}`} value={extra.path}>{extra.name}</option>}
    </select>
  );
}
