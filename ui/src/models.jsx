// The models view: the models on this machine (Perch's models directory and the Hugging Face
// cache, `list_models`) with Load and Delete, and the model picker: search the Hugging Face Hub
// (`search_models`, mlx-community by default), see size and whether it fits, download at a
// revision with progress and cancel (`download_model`, `cancel_download`) into the Hugging Face
// cache; downloads that stopped before their end (`partial_downloads`) resume or are discarded.

import { useImperativeHandle, useRef, useState } from "preact/hooks";
import { DownloadProgress } from "./download-progress.jsx";
import { ErrorMessage } from "./error-message.jsx";
import { decimalBytes, describeContext, describeFit, describeGroupFit, mib } from "./format.js";
import { useConfirm } from "./hooks.js";

/** Where a local model was found (`ModelSource` of perch-hub). */
const SOURCES = { perch: "Perch's models", hugging_face: "Hugging Face cache" };

/** A copy of map `map` with `key` set to `value`, or deleted when `value` is undefined. */
function updated(map, key, value) {
  const next = new Map(map);
  if (value === undefined) next.delete(key);
  else next.set(key, value);
  return next;
}

/** A line's text, or an error said in plain words: {text} or {error}. */
function Said({ said }) {
  if (!said) return null;
  return "error" in said ? <ErrorMessage error={said.error} /> : said.text;
}

/** "Not supported yet", with the sentence that names the architecture and those Perch runs. */
function Unsupported({ sentence }) {
  return (
    <span class="unsupported" title={sentence}>
      Not supported yet <small>{`(${sentence}) `}</small>
    </span>
  );
}

/** A model on this machine: Load, and Delete then "Confirm delete" for 4 s. */
function LocalModel({ model, onLoad, onDelete }) {
  const [armed, confirm] = useConfirm(4000);
  const [deleting, setDeleting] = useState(false);
  const bits = model.quantization_bits ? `, ${model.quantization_bits}-bit` : "";
  const source = SOURCES[model.source] ?? model.source;
  const remove = async () => {
    if (!confirm()) return;
    setDeleting(true);
    // Deleted, the item goes; refused, it stays and can be asked again.
    if (!(await onDelete(model))) setDeleting(false);
  };
  return (
    <li>
      {`${model.name} (${model.model_type ?? "?"}${bits}, ${mib(model.size_bytes)}, ${source}) `}
      {model.group_fit && <span class={`details fit-${model.group_fit}`}>{`${describeGroupFit(model.group_fit)} `}</span>}
      {model.vision && <span class="badge vision">Sees images</span>}{model.vision && " "}
      {/* A model of an architecture Perch does not run says so, and which ones it runs. */}
      <button type="button" disabled={Boolean(model.architecture_note)} onClick={() => onLoad(model.path)}>Load</button>{" "}
      <button type="button" class={armed ? "confirm" : undefined} aria-label={`${armed ? "Confirm delete" : "Delete"} ${model.name}`} disabled={deleting} onClick={remove}>
        {armed ? "Confirm delete" : "Delete"}
      </button>
      {model.architecture_note && <Unsupported sentence={model.architecture_note} />}
    </li>
  );
}

/** A Hub search result: size, fit, context, downloads; Download, its progress and Cancel, or Load. */
function Result({ model, progress, snapshot, failed, failure, onDownload, onCancel, onLoad }) {
  const size = model.weights_bytes == null ? "size unknown" : decimalBytes(model.weights_bytes);
  const architecture = model.model_type ? ` · ${model.model_type}` : "";
  const group = describeGroupFit(model.group_fit);
  const details = ` ${size} · ${describeFit(model.fit)}${group && `, ${group}`}${describeContext(model.context_tokens)} · ${model.downloads.toLocaleString()} downloads${architecture} `;
  return (
    <li data-repo={model.id}>
      <span class="repo">{model.id}</span>
      <span class={`details fit-${model.fit}`}>{details}</span>
      {/* Said before any byte is downloaded; downloading stays possible (the cache is mlx-lm's too). */}
      {model.architecture_note && <Unsupported sentence={model.architecture_note} />}
      {progress ? (
        <>
          <DownloadProgress repo={model.id} progress={progress} />
          <button type="button" onClick={onCancel}>Cancel</button>
        </>
      ) : snapshot ? (
        <button type="button" onClick={() => onLoad(snapshot)}>Load</button>
      ) : (
        <button type="button" onClick={onDownload}>Download</button>
      )}
      {failed && <ErrorMessage error={failure} />}
    </li>
  );
}

/** A stopped download: what it fetched, Resume and Discard, or its bar while it resumes. */
function Stopped({ download, progress, failed, failure, discarding, revision, onResume, onCancel, onDiscard }) {
  const id = download.repo_id;
  const fetched = `${decimalBytes(download.bytes_present)} fetched`;
  const snapshot = download.has_snapshot ? ", another revision complete" : "";
  const at = download.revision && download.revision !== "main" ? `, at ${download.revision}` : "";
  // At the revision it asked for; one not started here (mlx-lm's) at the field's.
  const resumeAt = download.revision ?? revision();
  return (
    <li data-repo={id}>
      {`${id} (${fetched}${at}${snapshot}) `}
      {progress ? (
        <>
          <DownloadProgress repo={id} progress={progress} />
          <button type="button" onClick={onCancel}>Cancel</button>
        </>
      ) : (
        <>
          <button type="button" aria-label={`Resume downloading ${id} at ${resumeAt}`} onClick={() => onResume(resumeAt)}>Resume</button>{" "}
          <button type="button" aria-label={`Discard what was fetched of ${id}`} disabled={discarding} onClick={onDiscard}>Discard</button>
        </>
      )}
      {failed && <ErrorMessage error={failure} />}
    </li>
  );
}

/**
 * `onLoad(path)` loads a model (app.jsx shows its progress in the status line); `onUnload()`
 * unloads it. `handle.current.show()` lists the local models again and, the first time, the
 * Hub's most downloaded ones (app.jsx calls it whenever the view is shown).
 */
export function ModelsView({ api, visible, inert, onLoad, onUnload, handle }) {
  const search = useRef(null);
  const author = useRef(null);
  const revisionField = useRef(null);
  /** The local models, or {error} when listing them failed; null until listed. */
  const [local, setLocal] = useState(null);
  const [deleted, setDeleted] = useState(null); // what the last Delete did: {text} or {error}
  /** The stopped downloads the last listing found, and what the last listing or Discard said. */
  const [partials, setPartials] = useState([]);
  const [partialStatus, setPartialStatus] = useState(null);
  const [discarding, setDiscarding] = useState(new Set());
  const [results, setResults] = useState([]); // the latest search's answer
  const [message, setMessage] = useState(null); // the search's state: {text} or {error}
  const [filters, setFilters] = useState({ fits: false, supported: false });
  /** repo id → DownloadProgress of the downloads running in this window. */
  const [downloads, setDownloads] = useState(new Map());
  /** repo id → the error of its last failed download. */
  const [failures, setFailures] = useState(new Map());
  /** repo id → the snapshot directory of a download finished in this window (results of a
   * search that was answered while it ran do not know it yet). */
  const [snapshots, setSnapshots] = useState(new Map());
  const searched = useRef(false);
  /** Counts searches: only the latest one's answer is shown. */
  const searches = useRef(0);

  /** Lists the downloads that stopped before their end (a failed listing shows as none). */
  async function refreshPartials() {
    try {
      setPartials(await api.partialDownloads());
      setPartialStatus((said) => (said && "error" in said ? null : said));
    } catch (error) {
      setPartials([]);
      setPartialStatus({ error });
    }
  }

  async function refreshLocal() {
    await refreshPartials();
    setLocal(await api.listModels());
  }

  async function show() {
    await refreshLocal();
    if (!searched.current) await runSearch();
  }

  async function runSearch() {
    searched.current = true;
    const n = ++searches.current;
    setMessage({ text: "Searching…" });
    let found;
    try {
      found = await api.searchModels(search.current.value.trim(), author.current.value);
    } catch (error) {
      found = error;
    }
    // An older search answered late (searches fetch every result's config) changes nothing.
    if (n !== searches.current) return;
    if (Array.isArray(found)) {
      setResults(found);
      setMessage({ text: found.length ? "" : "No models found." });
    } else {
      setResults([]);
      setMessage({ error: found });
    }
  }

  /** Downloads `model` at `revision`, else at the revision field's (`main` when empty). */
  async function download(model, revision) {
    const id = model.id;
    setFailures((map) => updated(map, id, undefined));
    setDownloads((map) => updated(map, id, { bytes_done: 0, bytes_total: 0, files_done: 0, files_total: 0 }));
    revision ??= revisionField.current.value.trim();
    try {
      const done = await api.downloadModel(
        id,
        (progress) => setDownloads((map) => (map.has(id) ? updated(map, id, progress) : map)),
        revision || undefined,
      );
      setSnapshots((map) => updated(map, id, done.snapshot_dir));
    } catch (error) {
      setFailures((map) => updated(map, id, error));
    } finally {
      setDownloads((map) => updated(map, id, undefined));
    }
    // A cancelled or failed download is listed as stopped now; a finished one as local.
    try {
      await refreshLocal();
    } catch (error) {
      setLocal({ error });
    }
  }

  async function discard(id) {
    setDiscarding((set) => new Set(set).add(id));
    try {
      const freed = await api.discardPartialDownload(id);
      setPartialStatus({ text: `Discarded the download of ${id}: ${decimalBytes(freed)} freed.` });
      await refreshPartials();
    } catch (error) {
      setPartialStatus({ error });
    } finally {
      setDiscarding((set) => {
        const next = new Set(set);
        next.delete(id);
        return next;
      });
    }
  }

  /** Deletes a local model; says the space freed, or why not. Resolves to whether it was deleted. */
  async function remove(model) {
    try {
      const freed = await api.deleteModel(model.path);
      setDeleted({ text: `Deleted ${model.name}: ${decimalBytes(freed)} freed.` });
      await refreshLocal();
      return true;
    } catch (error) {
      setDeleted({ error });
      return false;
    }
  }

  useImperativeHandle(handle, () => ({ show }));

  // The results the filters keep ("Fits in memory", "Runs in Perch"); a download under way always shows.
  const shown = results.filter(
    (model) => downloads.has(model.id) || ((!filters.fits || model.fit === "fits" || model.group_fit === "fits") && (!filters.supported || !model.architecture_note)),
  );
  const hidden = results.length - shown.length;
  const models = Array.isArray(local) ? local : [];
  const total = models.reduce((sum, model) => sum + (model.size_bytes ?? 0), 0);
  const revision = () => revisionField.current.value.trim() || "main";
  const filter = (name) => (event) => {
    const on = event.currentTarget.checked;
    setFilters((now) => ({ ...now, [name]: on }));
  };
  return (
    <section id="view-models" class="view" hidden={!visible} inert={inert}>
      <h3>On this machine</h3>
      <p id="models-disk" class="status">
        {models.length ? `${models.length} ${models.length === 1 ? "model" : "models"}, ${decimalBytes(total)} on disk` : ""}
      </p>
      <div id="models-deleted" role="status"><Said said={deleted} /></div>
      <ul id="models">
        {/* A failed listing and an empty one are said in the list's one item. */}
        {local && !Array.isArray(local) ? (
          <li><ErrorMessage error={local.error} /></li>
        ) : local?.length === 0 ? (
          <li>No models found in Perch's models directory or the Hugging Face cache.</li>
        ) : (
          models.map((model) => <LocalModel key={model.path} model={model} onLoad={onLoad} onDelete={remove} />)
        )}
      </ul>
      <div class="row"><button type="button" id="unload" onClick={onUnload}>Unload model</button></div>
      {/* Shown while there are some, or a listing's failure (or a Discard) to say. */}
      <div id="partial-section" hidden={partials.length === 0 && !partialStatus}>
        <h3>Stopped downloads</h3>
        <div id="partial-status" role="status"><Said said={partialStatus} /></div>
        <ul id="partial-downloads">
          {partials.map((item) => (
            <Stopped
              key={item.repo_id}
              download={item}
              progress={downloads.get(item.repo_id)}
              failed={failures.has(item.repo_id)}
              failure={failures.get(item.repo_id)}
              discarding={discarding.has(item.repo_id)}
              revision={revision}
              onResume={(at) => download({ id: item.repo_id }, at)}
              onCancel={() => api.cancelDownload(item.repo_id)}
              onDiscard={() => discard(item.repo_id)}
            />
          ))}
        </ul>
      </div>
      <h3>Hugging Face Hub</h3>
      <form
        id="hub-form"
        class="row"
        onSubmit={(event) => {
          event.preventDefault();
          runSearch();
        }}
      >
        <input type="search" id="hub-search" ref={search} aria-label="Search the Hugging Face Hub" placeholder="Search models, e.g. Qwen3 4bit" />
        <select id="hub-author" ref={author} aria-label="Author">
          <option value="mlx-community">mlx-community</option>
          <option value="">Everyone</option>
        </select>
        <button type="submit">Search</button>
      </form>
      <div class="row">
        <label class="check" title="A branch, tag or commit; main when empty">Revision to download <input type="text" id="hub-revision" ref={revisionField} size="12" placeholder="main" /></label>
      </div>
      <div class="row" role="group" aria-label="Show only">
        <label class="check" title="In this machine's memory, or divided over your hosts (Settings → Hosts)"><input type="checkbox" id="hub-only-fits" onChange={filter("fits")} /> Fits in memory</label>
        <label class="check"><input type="checkbox" id="hub-only-supported" onChange={filter("supported")} /> Runs in Perch</label>
      </div>
      <div id="hub-message" role="status"><Said said={message} /></div>
      <p id="hub-hidden" class="status">{hidden > 0 ? `${hidden} more hidden by the filters.` : ""}</p>
      <ul id="hub-results">
        {shown.map((model) => (
          <Result
            key={model.id}
            model={model}
            progress={downloads.get(model.id)}
            snapshot={model.snapshot_dir ?? snapshots.get(model.id)}
            failed={failures.has(model.id)}
            failure={failures.get(model.id)}
            onDownload={() => download(model)}
            onCancel={() => api.cancelDownload(model.id)}
            onLoad={onLoad}
          />
        ))}
      </ul>
    </section>
  );
}
