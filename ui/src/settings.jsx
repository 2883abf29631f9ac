// The settings view: a form over the `Settings` of perch-store (src/settings.rs there), read
// with `get_settings` and saved with `save_settings`, which validates and says what is wrong.
// Each input names its setting with data-setting="path.in.settings" (src/form.js reads and
// writes them); the inputs hold the values, so what the form shows is what is saved.

import { useImperativeHandle, useRef, useState } from "preact/hooks";
import { ErrorMessage } from "./error-message.jsx";
import { HostsReading } from "./hosts.jsx";
import { getPath, readInput, setPath, writeInput, SAMPLING_DEFAULT_FIELDS } from "./form.js";
import { PRESET_CHOICES } from "./presets.js";
import { useSampling } from "./sampling.js";

const SAVED = "Saved. The idle unload, KV cache budget, block size and draft model apply when a model is next loaded.";
const SAMPLING_SETTINGS = new Set(SAMPLING_DEFAULT_FIELDS.map((name) => `chat.sampling.${name}`));

let messages = 0;

/**
 * `handle.current.load()` reads the saved settings into the form (app.jsx calls it whenever the
 * view is shown, and when the tray changed them). Until they arrive the form cannot be saved (its
 * Save button is disabled and the view's `data-ready` is "false"), so that edits made to the
 * form's previous contents are never overwritten by, or saved over, the settings on disk.
 */
export function SettingsView({ api, visible, inert, handle }) {
  const form = useRef(null);
  const advanced = useRef(null);
  // SettingsView from Rust: {settings, models_dir, total_memory_bytes, defaults}. Kept in a ref
  // too: saving reads it in the same event as a change made just before.
  const [view, setView] = useState(null);
  const current = useRef(null);
  const [status, setStatus] = useState(null); // the model_status read with the settings
  const [ready, setReady] = useState(false);
  // The answer to a load or save: {id, text} or {id, error}. A new id each time makes a new
  // element in the message area, so the answer shows even where the area was emptied since.
  const [message, setMessage] = useState(null);
  const sampling = useSampling({
    status,
    saved: () => current.current?.settings?.chat?.sampling,
    onCustom: () => (advanced.current.open = true),
  });

  const inputs = () => [...form.current.querySelectorAll("[data-setting]")];
  const sourceInput = () => form.current.querySelector("[data-setting='chat.sampling_source']");

  function fill(settings) {
    for (const input of inputs()) writeInput(input, getPath(settings, input.dataset.setting));
    sampling.filled(sourceInput().value);
  }

  /**
   * The form's settings over the loaded ones: fields the form does not show are kept; sampling
   * values shown read-only from the model are not saved as the user's.
   */
  function read() {
    const followModel = sourceInput().value === "model";
    let settings = current.current.settings;
    for (const input of inputs()) {
      if (followModel && SAMPLING_SETTINGS.has(input.dataset.setting)) continue;
      settings = setPath(settings, input.dataset.setting, readInput(input));
    }
    return settings;
  }

  async function load() {
    setReady(false);
    try {
      const shown = await api.getSettings();
      const model = await api.modelStatus?.().catch(() => null);
      current.current = shown;
      setView(shown);
      setStatus(model);
      fill(shown.settings);
      setMessage(null);
      setReady(true);
    } catch (error) {
      setMessage({ id: ++messages, error });
    }
  }

  async function save() {
    try {
      const shown = await api.saveSettings(read());
      current.current = shown;
      setView(shown);
      fill(shown.settings);
      setMessage({ id: ++messages, text: SAVED });
    } catch (error) {
      setMessage({ id: ++messages, error });
    }
  }

  useImperativeHandle(handle, () => ({ load }));

  const own = (name) => ({ ref: sampling.refs[name], disabled: sampling.source === "model", onInput: sampling.onFieldInput });
  return (
    <section id="view-settings" class="view" hidden={!visible} inert={inert} data-ready={String(ready)}>
      <form
        id="settings-form"
        class="fields"
        ref={form}
        onSubmit={(event) => {
          event.preventDefault();
          save();
        }}
      >
        <h3 class="wide">New conversations</h3>
        <label class="wide">System prompt <textarea data-setting="chat.system_prompt" rows="2"></textarea></label>
        <label>Sampling
          <select id="settings-preset" aria-describedby="settings-sampling-note" value={sampling.choice} onChange={sampling.onPresetChange}>
            {PRESET_CHOICES.map(([value, label]) => <option value={value}>{label}</option>)}
          </select>
        </label>
        <label>Max tokens <input type="number" step="1" min="1" data-setting="chat.max_tokens" /></label>
        <p class="wide sampling-note" id="settings-sampling-note">{sampling.note}</p>
        <h3 class="wide">App</h3>
        <label>Global shortcut <input type="text" data-setting="shortcut" placeholder="none" /></label>
        <label class="check"><input type="checkbox" data-setting="launch_at_login" /> Launch at login</label>
        <label>Unload the model after idle (minutes) <input type="number" step="1" min="1" max="43200" data-scale="60" data-optional data-setting="unload_after_idle_secs" placeholder="never" /></label>
        <details class="wide advanced" id="settings-advanced" ref={advanced}>
          <summary>Advanced</summary>
          <div class="fields">
            <h3 class="wide">Sampling</h3>
            <label>Source
              <select data-setting="chat.sampling_source" class="sampling-source" value={sampling.source} onChange={sampling.onSourceChange}>
                <option value="model">The model's defaults</option><option value="custom">Custom</option>
              </select>
            </label>
            <label>Temperature <input type="number" step="0.05" min="0" data-setting="chat.sampling.temperature" {...own("temperature")} /></label>
            <label>Top-p <input type="number" step="0.05" min="0" max="1" data-setting="chat.sampling.top_p" {...own("top_p")} /></label>
            <label>Top-k <input type="number" step="1" min="0" data-setting="chat.sampling.top_k" {...own("top_k")} /></label>
            <label>Min-p <input type="number" step="0.01" min="0" max="1" data-setting="chat.sampling.min_p" {...own("min_p")} /></label>
            <label>Repetition penalty <input type="number" step="0.05" min="0" data-setting="chat.sampling.repetition_penalty" {...own("repetition_penalty")} /></label>
            <label>Presence penalty <input type="number" step="0.1" min="-2" max="2" data-setting="chat.sampling.presence_penalty" /></label>
            <label>Frequency penalty <input type="number" step="0.1" min="-2" max="2" data-setting="chat.sampling.frequency_penalty" /></label>
            <label>XTC probability <input type="number" step="0.05" min="0" max="1" data-setting="chat.sampling.xtc_probability" /></label>
            <label>XTC threshold <input type="number" step="0.01" min="0" max="0.5" data-setting="chat.sampling.xtc_threshold" /></label>
            <h3 class="wide">KV cache of new conversations</h3>
            <label>KV cache limit (tokens) <input type="number" step="1" min="5" data-optional data-setting="chat.max_kv_size" placeholder="none" /></label>
            <label>KV cache bits
              <select data-setting="chat.kv_bits" data-type="number" data-optional>
                <option value="">full precision</option><option>8</option><option>4</option>
              </select>
            </label>
            <label>Quantize KV after (tokens) <input type="number" step="1" min="0" data-setting="chat.quantized_kv_start" /></label>
            <h3 class="wide">Engine</h3>
            <label>KV cache budget (MiB) <input type="number" step="1" min="16" max={view ? String(Math.floor(view.total_memory_bytes / 2 ** 20)) : undefined} data-scale="1048576" data-setting="kv_cache_bytes" /></label>
            <label>Block size (tokens)
              <select data-setting="block_size" data-type="number">
                <option>8</option><option>16</option><option>32</option><option>64</option><option>128</option><option>256</option>
              </select>
            </label>
            <label class="wide">Models directory <input type="text" data-optional data-setting="models_dir" placeholder={view?.models_dir} /></label>
            <label class="wide">Draft model (speculative decoding) <input type="text" data-optional data-setting="draft_model" placeholder="none: a smaller model of the same family, its directory or Hub id" /></label>
            <label>Draft tokens per step <input type="number" step="1" min="1" max="64" data-setting="num_draft_tokens" /></label>
            <label class="check wide"><input type="checkbox" data-setting="prompt_lookup" /> Prompt lookup: greedy answers draft from the conversation itself, faster where they repeat it (code edits); the next model load applies it</label>
            <h3 class="wide">Local server</h3>
            <p class="wide hint">Serves the loaded model to other apps over OpenAI's and Anthropic's APIs (base URL <code>http://127.0.0.1:PORT/v1</code>); their requests share the engine with your chats.</p>
            <label class="check wide"><input type="checkbox" data-setting="server.enabled" /> Run the local server</label>
            <label>Port <input type="number" min="0" max="65535" step="1" data-setting="server.port" /></label>
            <label>API key <input type="text" data-optional data-setting="server.api_key" placeholder="none" autocomplete="off" /></label>
            <label class="check wide"><input type="checkbox" data-setting="server.allow_lan" /> Allow other devices on the network</label>
            <label class="check wide"><input type="checkbox" data-setting="server.any_model_name" /> Answer to any model name (coding agents send their own, such as <code>claude-…</code>)</label>
            <label class="wide">Other names for the model <input type="text" data-type="list" data-setting="server.model_aliases" placeholder="none: e.g. claude-sonnet-4-5, gpt-4o" autocomplete="off" /></label>
            <h3 class="wide">Hosts</h3>
            <p class="wide hint">Machines a model too large for one can be divided over (<code>perch serve --hosts</code>), reached with ssh keys; rank 0 first, a machine named twice runs two ranks.</p>
            <label class="wide">Hosts <input type="text" data-type="list" data-setting="hosts" placeholder="none: e.g. localhost, me@studio.local" autocomplete="off" /></label>
            <HostsReading api={api} saved={view?.settings?.hosts} />
          </div>
        </details>
        <div class="row wide">
          <button type="submit" disabled={!ready}>Save</button>
          <button type="button" id="settings-reset" onClick={() => fill(current.current.defaults)}>Defaults</button>
        </div>
        <div id="settings-message" class="wide" role="status">
          {message && ("error" in message ? <ErrorMessage key={message.id} error={message.error} as="span" /> : <span key={message.id}>{message.text}</span>)}
        </div>
      </form>
    </section>
  );
}
