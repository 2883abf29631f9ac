// First run: what Perch is, what this machine can run (its memory), models that fit — the ones
// already here, and the Hub's most downloaded mlx-community models when it is reachable — a
// download with progress and cancel, and then the chat. Shown until it is finished or skipped
// once (remembered in the settings, `finish_first_run`).

import { useLayoutEffect, useRef, useState } from "preact/hooks";
import { DownloadProgress } from "./download-progress.jsx";
import { ErrorMessage } from "./error-message.jsx";
import { decimalBytes } from "./format.js";

const DONE_KEY = "perch.onboarded";

/** How many of the Hub's models that fit are offered. */
const HUB_OFFERS = 4;

/** "This machine has 16 GB of memory: models up to about 12 GB fit." (system_stats' usable memory) */
export function describeMachine(system) {
  if (!(system?.ram_total_bytes > 0)) return "Perch could not read this machine's memory; the sizes below tell what each model needs.";
  return `This machine has ${decimalBytes(system.ram_total_bytes)} of memory: models up to about ${decimalBytes(system.usable_memory_bytes)} fit.`;
}

/**
 * Whether the first run is still to be shown: not when the settings say it was done, nor when
 * the web view's storage does (where earlier versions kept it: moved to the settings).
 */
export async function firstRunPending(api, storage) {
  const view = await api.getSettings();
  if (view.settings.first_run_done) return false;
  if (storage?.getItem(DONE_KEY) === "1") {
    await api.finishFirstRun();
    return false;
  }
  return true;
}

/**
 * One model offered (`offer`: {title, details, action}): its name, size, and Use or Download;
 * while it downloads, its bar and Cancel.
 */
function Offer({ offer, busy, download, failed, failure, onClick, onCancel }) {
  const action = useRef(null);
  const cancel = useRef(null);
  // Focus follows the download: to Cancel when it starts, back to the button when it fails.
  const downloading = Boolean(download);
  const first = useRef(true);
  useLayoutEffect(() => {
    if (first.current) {
      first.current = false;
      return;
    }
    if (downloading) cancel.current?.focus?.();
    else if (failed) action.current?.focus?.();
  }, [downloading]);
  return (
    <li>
      <span class="repo">{offer.title}</span>
      <span class="details">{` ${offer.details} `}</span>
      <button type="button" ref={action} aria-label={`${offer.action} ${offer.title}`} hidden={downloading} disabled={busy} onClick={onClick}>
        {offer.action}
      </button>
      {downloading && (
        <>
          <DownloadProgress repo={offer.title} progress={download} />
          <button type="button" class="cancel" ref={cancel} onClick={onCancel}>Cancel</button>
        </>
      )}
      {!downloading && failed && <ErrorMessage error={failure} />}
    </li>
  );
}

/**
 * The #onboarding dialog. `open`: whether it is shown (app.jsx makes the rest of the page inert
 * meanwhile); `onLoad(path)` loads a model (resolves when it is loaded); `onDone()` closes it and
 * shows the chat; `error`: {error}, a failure to say on it (reading whether it is pending).
 */
export function Onboarding({ api, open, onLoad, onDone, error }) {
  const title = useRef(null);
  const [machine, setMachine] = useState("");
  const [offers, setOffers] = useState([]);
  // What the screen says under the list: {error, text} (either may be missing).
  const [message, setMessage] = useState({});
  const [busy, setBusy] = useState(false);
  const [download, setDownload] = useState(null); // {id, progress} of the model downloading
  const [failures, setFailures] = useState({}); // repo id → its download's error
  const finished = useRef(false);
  const downloading = useRef(null); // repo id

  useLayoutEffect(() => {
    if (error) setMessage({ error: error.error });
  }, [error]);

  /** Remembers that the first run is done and shows the chat. */
  function finish() {
    if (finished.current) return;
    finished.current = true;
    if (downloading.current) api.cancelDownload(downloading.current).catch(() => {});
    // Kept in the settings; if that fails the screen comes back at the next start, nothing more.
    api.finishFirstRun().catch(() => {});
    onDone();
  }

  /** Loads a model already here, then opens the chat (the models' buttons off meanwhile). */
  async function use(path) {
    if (finished.current) return;
    setBusy(true);
    setMessage({ text: "Loading the model…" });
    try {
      await onLoad(path);
    } finally {
      setBusy(false);
    }
    finish();
  }

  /** Downloads `model` with progress and Cancel, then loads it and opens the chat. */
  async function start(model) {
    if (downloading.current) return;
    const id = model.id;
    downloading.current = id;
    setDownload({ id, progress: { bytes_done: 0, bytes_total: 0 } });
    setFailures(({ [id]: _, ...rest }) => rest);
    setBusy(true);
    try {
      const done = await api.downloadModel(id, (progress) => setDownload((now) => (now?.id === id ? { id, progress } : now)));
      downloading.current = null;
      setBusy(false);
      // Skipped meanwhile: the download stays in the cache, nothing is loaded.
      if (!finished.current) await use(done.snapshot_dir);
    } catch (failure) {
      if (!finished.current) setFailures((now) => ({ ...now, [id]: failure }));
    } finally {
      setDownload(null);
      downloading.current = null;
      setBusy(false);
    }
  }

  /** Fills the screen: the machine, then the models here and the Hub's that fit. */
  async function fill() {
    setMachine(describeMachine(await api.systemStats().catch(() => null)));
    const local = await api.listModels().catch(() => []);
    const here = local
      .filter((m) => !m.architecture_note && m.fit !== "too_large")
      .map((m) => ({ key: m.path, title: m.name, details: `${decimalBytes(m.size_bytes)} · on this machine`, action: "Use", path: m.path }));
    let found = [];
    let said = {};
    try {
      const names = new Set(local.map((m) => m.name));
      found = (await api.searchModels("", "mlx-community"))
        .filter((m) => m.fit === "fits" && !m.architecture_note && !names.has(m.id))
        .slice(0, HUB_OFFERS);
    } catch (failure) {
      said = { error: failure };
      if (local.length) said.text = "The models already on this machine are ready to use.";
    }
    const hub = found.map((m) => ({
      key: m.id,
      title: m.id,
      details: `${decimalBytes(m.weights_bytes)} · ${m.downloads.toLocaleString()} downloads`,
      action: "Download",
      model: m,
    }));
    setOffers([...here, ...hub]);
    if (!here.length && !hub.length && !("error" in said)) said = { text: "No model that fits was found; you can pick one under Models later." };
    setMessage(said);
  }

  useLayoutEffect(() => {
    if (!open) return;
    finished.current = false;
    title.current.focus?.();
    setOffers([]);
    setMessage({});
    fill();
  }, [open]);

  return (
    <section id="onboarding" class="onboarding" role="dialog" aria-modal="true" aria-labelledby="onboarding-title" hidden={!open}>
      <h2 id="onboarding-title" tabindex="-1" ref={title}>Welcome to Perch</h2>
      <p>Perch runs language models on this machine with MLX. Your chats stay here, and apps on this machine can use the same model through a local server.</p>
      <p id="onboarding-machine">{machine}</p>
      <h3>Pick a model to start with</h3>
      <ul id="onboarding-models">
        {offers.map((offer) => (
          <Offer
            key={offer.key}
            offer={offer}
            busy={busy}
            download={download?.id === offer.key ? download.progress : null}
            failed={offer.key in failures}
            failure={failures[offer.key]}
            onClick={() => (offer.model ? start(offer.model) : use(offer.path))}
            onCancel={() => api.cancelDownload(offer.key)}
          />
        ))}
      </ul>
      <div id="onboarding-message" role="status">
        {"error" in message && <ErrorMessage error={message.error} />}
        {message.text}
      </div>
      <div class="row">
        <button type="button" id="onboarding-start" onClick={finish}>Start chatting</button>
        <button type="button" id="onboarding-skip" onClick={finish}>Skip</button>
      </div>
    </section>
  );
}
