//! Hub commands: search the Hugging Face Hub, download a model into the Hugging Face cache
//! (where `list_models` and mlx-lm find it) at a revision, cancel a download, list the downloads
//! that stopped before their end and resume or discard them. The endpoint and token come
//! from the environment as for `huggingface_hub` (`HF_ENDPOINT`, `HF_TOKEN`).

use super::CommandError;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use perch_hub::{
    memory_fit, DownloadProgress, Downloaded, HubClient, HubModel, MemoryFit, SearchQuery,
};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::{AppHandle, Manager, Runtime, State};

use super::poisoned;
use crate::store::Store;

/// The downloads in progress: repository id → its cancel flag.
#[derive(Default)]
pub struct Downloads(Mutex<HashMap<String, Arc<AtomicBool>>>);

/// A search result with what it means for this machine.
#[derive(Clone, Debug, Serialize)]
pub struct HubModelView {
    #[serde(flatten)]
    pub model: HubModel,
    /// Weights plus the KV cache they would use of the settings' budget (all of it, or what
    /// the model's whole context takes when less) against RAM (`perch_hub::memory_fit`).
    pub fit: MemoryFit,
    /// The same divided over the machines of Settings → Hosts, by their last reading
    /// ([`super::hosts::GroupMemory::fit`]); `None` without hosts or a reading of them.
    pub group_fit: Option<MemoryFit>,
    /// Tokens of one conversation the settings' KV cache budget holds for this model, from its
    /// `config.json`'s real KV bytes per token (`perch_engine::models::kv_footprint`), at most
    /// its context length; `None` when its config is unknown or not one Perch loads.
    pub context_tokens: Option<u64>,
    /// Its snapshot in the Hugging Face cache (what `load_model` takes), when downloaded.
    pub snapshot_dir: Option<PathBuf>,
    /// When its architecture is one Perch does not run: a sentence naming it and those it runs
    /// (`perch_engine::models::unsupported_architecture_note`); `None` when it runs or the Hub
    /// does not say.
    pub architecture_note: Option<String>,
}

fn client() -> Result<HubClient, CommandError> {
    let cache = perch_hub::hf_cache_dir()
        .ok_or("No Hugging Face cache directory is known; set HF_HUB_CACHE.")?;
    Ok(HubClient::from_env(cache))
}

/// Models whose id contains `text` (from mlx-community unless `author` says otherwise; an
/// empty `author` searches everyone), most downloaded first.
#[tauri::command]
pub async fn search_models<R: Runtime>(
    app: AppHandle<R>,
    text: String,
    author: Option<String>,
) -> Result<Vec<HubModelView>, CommandError> {
    let store = app.state::<Store>();
    let settings = store.settings()?;
    let kv_cache_bytes = settings.kv_cache_bytes as u64;
    let total_memory = store.total_memory_bytes();
    let query = SearchQuery {
        text,
        author: match author {
            Some(author) if author.is_empty() => None,
            Some(author) => Some(author),
            None => SearchQuery::default().author,
        },
        ..SearchQuery::default()
    };
    let client = client()?;
    tauri::async_runtime::spawn_blocking(move || {
        let found = client
            .search(&query)
            .map_err(|e| CommandError::network(&e))?;
        // The configs of the models Perch runs (or whose architecture the Hub does not say),
        // fetched together: their KV cache's real size.
        let notes: Vec<Option<String>> = found
            .iter()
            .map(|m| {
                m.model_type
                    .as_deref()
                    .and_then(perch_engine::models::unsupported_architecture_note)
            })
            .collect();
        let ids: Vec<String> = found
            .iter()
            .zip(&notes)
            .filter(|(_, note)| note.is_none())
            .map(|(m, _)| m.id.clone())
            .collect();
        let mut configs = client.config_texts(&ids).into_iter();
        Ok(found
            .into_iter()
            .zip(notes)
            .map(|(model, architecture_note)| {
                let budget = architecture_note
                    .is_none()
                    .then(|| configs.next())
                    .flatten()
                    .and_then(|config| config.ok())
                    .and_then(|text| perch_engine::models::kv_footprint(&text, None).ok())
                    .map(|footprint| footprint.within_budget(kv_cache_bytes));
                let kv_bytes = budget.map_or(kv_cache_bytes, |b| b.bytes);
                HubModelView {
                    fit: memory_fit(model.weights_bytes, kv_bytes, total_memory),
                    group_fit: app.state::<super::hosts::GroupMemory>().fit(
                        &settings.hosts,
                        model.weights_bytes,
                        kv_bytes,
                    ),
                    context_tokens: budget.map(|b| b.tokens),
                    snapshot_dir: perch_hub::cached_snapshot(client.cache_dir(), &model.id),
                    architecture_note,
                    model,
                }
            })
            .collect())
    })
    .await
    .map_err(|_| "The search crashed.".to_string())?
}

/// Downloads `repo_id` at `revision` (a branch, tag or commit; `main` when none or empty) into
/// the Hugging Face cache, sending progress on `on_progress` (at most every 100 ms), and returns
/// where it is. Resumes what an earlier download (Perch's or mlx-lm's) left; `cancel_download`
/// stops it, keeping what was fetched (`partial_downloads` lists it then).
#[tauri::command]
pub async fn download_model<R: Runtime>(
    app: AppHandle<R>,
    repo_id: String,
    revision: Option<String>,
    on_progress: Channel<DownloadProgress>,
) -> Result<Downloaded, CommandError> {
    let revision = revision
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "main".into());
    let client = client()?;
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let state = app.state::<Downloads>();
        let mut downloads = state.0.lock().map_err(|_| poisoned())?;
        if downloads.contains_key(&repo_id) {
            return Err(CommandError::invalid(&format!(
                "{repo_id} is already downloading."
            )));
        }
        downloads.insert(repo_id.clone(), Arc::clone(&cancel));
    }
    let id = repo_id.clone();
    // Cancel stops the file listing too, between its pages.
    let client = client.with_cancel(Arc::clone(&cancel));
    app.state::<Store>()
        .set_download_revision(&repo_id, Some(&revision));
    let result = tauri::async_runtime::spawn_blocking(move || {
        let snapshot = client
            .snapshot(&id, &revision)
            .map_err(|e| CommandError::network(&e))?;
        client
            .download(&snapshot, &cancel, &mut |progress| {
                // A closed channel (the window went away) does not stop the download.
                let _ = on_progress.send(progress.clone());
            })
            .map_err(|e| CommandError::network(&e))
    })
    .await
    .map_err(|_| CommandError::from("The download crashed."))
    .and_then(|r| r);
    if let Ok(mut downloads) = app.state::<Downloads>().0.lock() {
        downloads.remove(&repo_id);
    }
    if result.is_ok() {
        app.state::<Store>().set_download_revision(&repo_id, None);
    }
    result
}

/// Stops the download of `repo_id` within one read; `false` when none is running.
#[tauri::command]
pub fn cancel_download(
    downloads: State<'_, Downloads>,
    repo_id: String,
) -> Result<bool, CommandError> {
    let downloads = downloads.0.lock().map_err(|_| poisoned())?;
    Ok(match downloads.get(&repo_id) {
        Some(cancel) => {
            cancel.store(true, Ordering::Relaxed);
            true
        }
        None => false,
    })
}

/// A stopped download, with the revision it asked for when it started here.
#[derive(Clone, Debug, Serialize)]
pub struct PartialDownloadView {
    #[serde(flatten)]
    pub download: perch_hub::PartialDownload,
    /// `None`: not started by this app (mlx-lm's), or not recorded.
    pub revision: Option<String>,
}

/// The downloads in the Hugging Face cache that stopped before their end (`perch_hub::partial_downloads`),
/// those running in this app left out, each with the revision it asked for.
#[tauri::command]
pub async fn partial_downloads<R: Runtime>(
    app: AppHandle<R>,
) -> Result<Vec<PartialDownloadView>, CommandError> {
    let Some(cache) = perch_hub::hf_cache_dir() else {
        return Ok(Vec::new());
    };
    let running: Vec<String> = {
        let downloads = app.state::<Downloads>();
        let downloads = downloads.0.lock().map_err(|_| poisoned())?;
        downloads.keys().cloned().collect()
    };
    tauri::async_runtime::spawn_blocking(move || {
        let revisions = app.state::<Store>().download_revisions();
        perch_hub::partial_downloads(&cache)
            .into_iter()
            .filter(|d| !running.contains(&d.repo_id))
            .map(|download| PartialDownloadView {
                revision: revisions.get(&download.repo_id).cloned(),
                download,
            })
            .collect()
    })
    .await
    .map_err(|_| CommandError::from("Listing the stopped downloads crashed."))
}

/// Deletes what a stopped download of `repo_id` fetched (its partial files; complete files and
/// snapshots stay) and returns the bytes freed. A running download is refused: cancel it first.
#[tauri::command]
pub async fn discard_partial_download<R: Runtime>(
    app: AppHandle<R>,
    repo_id: String,
) -> Result<u64, CommandError> {
    {
        let downloads = app.state::<Downloads>();
        let downloads = downloads.0.lock().map_err(|_| poisoned())?;
        if downloads.contains_key(&repo_id) {
            return Err(CommandError::invalid(&format!(
                "{repo_id} is downloading: cancel it before discarding what it fetched."
            )));
        }
    }
    let cache = perch_hub::hf_cache_dir()
        .ok_or_else(|| CommandError::invalid(&"There is no Hugging Face cache on this machine."))?;
    tauri::async_runtime::spawn_blocking(move || {
        let discarded = perch_hub::discard_partial_download(&cache, &repo_id);
        if discarded.is_ok() {
            app.state::<Store>().set_download_revision(&repo_id, None);
        }
        discarded.map_err(|err| match err {
            perch_hub::HubError::NotLocalModel(_) => {
                CommandError::invalid(&format!("{repo_id} has no stopped download to discard."))
            }
            other => CommandError::storage(&other),
        })
    })
    .await
    .map_err(|_| CommandError::from("Discarding the download crashed."))
    .and_then(|r| r)
}
