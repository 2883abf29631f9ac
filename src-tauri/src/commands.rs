//! The commands the web UI calls. Each is thin: it calls `perch-engine` (through the
//! [`EngineHandle`]) or `perch-hub` and turns any error into one sentence for the UI.

use std::path::PathBuf;
use std::sync::Mutex;

use perch_engine::device::{clear_cache as mlx_clear_cache, memory_stats};
use perch_engine::{
    ChatMessage, EngineConfig, EngineEvent, EngineHandle, EngineRequest, EngineStats, FinishReason,
    GenerateRequest, GenerationStats, Prompt,
};
use perch_hub::LocalModel;
use serde::{Deserialize, Serialize};
use tauri::ipc::Channel;
use tauri::{AppHandle, Manager, Runtime, State};

/// The loaded model, if any, and what is happening to it.
#[derive(Default)]
pub struct AppState {
    model: Mutex<ModelSlot>,
}

/// The engine exactly when `status` is `Loaded`.
#[derive(Default)]
struct ModelSlot {
    status: ModelStatus,
    engine: Option<EngineHandle>,
}

/// What the UI shows about the model.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ModelStatus {
    #[default]
    NotLoaded,
    Loading {
        name: String,
    },
    Loaded {
        name: String,
        path: PathBuf,
    },
    Failed {
        name: String,
        error: String,
    },
}

impl AppState {
    fn slot(&self) -> Result<std::sync::MutexGuard<'_, ModelSlot>, String> {
        self.model.lock().map_err(|_| poisoned())
    }

    fn engine(&self) -> Result<EngineHandle, String> {
        let slot = self.slot()?;
        match (&slot.engine, &slot.status) {
            (Some(engine), _) => Ok(engine.clone()),
            (None, ModelStatus::Loading { name }) => Err(format!("{name} is still loading.")),
            (None, _) => Err("No model is loaded; choose one under Models.".into()),
        }
    }

    fn status(&self) -> ModelStatus {
        self.slot().map(|s| s.status.clone()).unwrap_or_default()
    }

    /// Loads the model in `path` on an engine thread (replacing the loaded one) and waits for
    /// it; blocking, so commands call it off the UI thread.
    pub fn load(&self, path: PathBuf) -> Result<ModelStatus, String> {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        let previous = std::mem::replace(
            &mut *self.slot()?,
            ModelSlot {
                status: ModelStatus::Loading { name: name.clone() },
                engine: None,
            },
        );
        if let Some(engine) = previous.engine {
            engine.shutdown();
        }
        let (slot, result) = match EngineHandle::load(&path, EngineConfig::default()) {
            Ok(engine) => {
                let status = ModelStatus::Loaded { name, path };
                let slot = ModelSlot {
                    status: status.clone(),
                    engine: Some(engine),
                };
                (slot, Ok(status))
            }
            Err(err) => {
                let error = sentence(&err);
                let slot = ModelSlot {
                    status: ModelStatus::Failed {
                        name,
                        error: error.clone(),
                    },
                    engine: None,
                };
                (slot, Err(error))
            }
        };
        *self.slot()? = slot;
        result
    }

    pub fn unload(&self) -> Result<(), String> {
        let previous = std::mem::take(&mut *self.slot()?);
        if let Some(engine) = previous.engine {
            engine.shutdown();
        }
        mlx_clear_cache();
        Ok(())
    }
}

fn poisoned() -> String {
    "Perch's state is broken after an earlier crash; restart the app.".into()
}

/// An error as one sentence: capitalised, ending with a full stop.
pub fn sentence(err: &dyn std::fmt::Display) -> String {
    let text = err.to_string();
    let mut chars = text.trim().chars();
    let mut out: String = match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => return "Something went wrong.".into(),
    };
    if !out.ends_with(['.', '!', '?']) {
        out.push('.');
    }
    out
}

/// Models in Perch's models directory and in the Hugging Face cache.
#[tauri::command]
pub fn list_models() -> Vec<LocalModel> {
    perch_hub::local_models(
        &perch_hub::models_dir(),
        perch_hub::hf_cache_dir().as_deref(),
    )
}

/// Loads the model directory `path` (replacing the loaded model).
#[tauri::command]
pub async fn load_model<R: Runtime>(
    app: AppHandle<R>,
    path: PathBuf,
) -> Result<ModelStatus, String> {
    // Loading takes seconds: keep it off the async runtime's workers.
    tauri::async_runtime::spawn_blocking(move || app.state::<AppState>().load(path))
        .await
        .map_err(|_| "Loading the model crashed.".to_string())?
}

#[tauri::command]
pub fn unload_model(state: State<'_, AppState>) -> Result<(), String> {
    state.unload()
}

#[tauri::command]
pub fn model_status(state: State<'_, AppState>) -> ModelStatus {
    state.status()
}

/// Generation settings of a chat request; absent fields keep the engine's defaults.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatOptions {
    pub sampling: perch_engine::sampler::SamplingParams,
    pub max_tokens: Option<usize>,
}

/// What a chat request streams to the UI.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ChatEvent {
    /// Text the next token completes (may be empty).
    Token { text: String },
    Finished {
        finish_reason: FinishReason,
        stats: GenerationStats,
        error: Option<String>,
    },
}

/// Starts answering `messages` (rendered with the model's chat template); tokens stream to
/// `on_event`. Returns the request id, for [`stop`].
#[tauri::command]
pub fn chat(
    state: State<'_, AppState>,
    messages: Vec<ChatMessage>,
    options: Option<ChatOptions>,
    on_event: Channel<ChatEvent>,
) -> Result<u64, String> {
    let engine = state.engine()?;
    let options = options.unwrap_or_default();
    let mut params = GenerateRequest::new(Vec::new());
    params.sampling = options.sampling;
    if let Some(max_tokens) = options.max_tokens {
        params.max_tokens = max_tokens;
    }
    let stream = engine
        .submit(EngineRequest {
            prompt: Prompt::Chat(messages),
            params,
        })
        .map_err(|e| sentence(&e))?;
    let id = stream.id;
    std::thread::spawn(move || {
        for event in stream.events.iter() {
            let event = match event {
                EngineEvent::Token { text, .. } => ChatEvent::Token { text },
                EngineEvent::Finished {
                    finish_reason,
                    stats,
                    error,
                } => ChatEvent::Finished {
                    finish_reason,
                    stats,
                    error: error.map(|e| sentence(&e)),
                },
            };
            if on_event.send(event).is_err() {
                // The window went away: stop spending compute on it.
                engine.cancel(id);
                break;
            }
        }
    });
    Ok(id)
}

/// Cancels request `request_id` in the engine at once (it finishes as `cancelled`).
#[tauri::command]
pub fn stop(state: State<'_, AppState>, request_id: u64) -> Result<(), String> {
    state.engine()?.cancel(request_id);
    Ok(())
}

/// The engine's stats (requests, tok/s, KV blocks, MLX memory), or `None` with no model.
#[tauri::command]
pub fn engine_stats(state: State<'_, AppState>) -> Result<Option<EngineStats>, String> {
    match state.engine() {
        Ok(engine) => engine.stats().map(Some).map_err(|e| sentence(&e)),
        Err(_) => Ok(None),
    }
}

/// Starts a new MLX peak-memory measurement (the dashboard's "reset peak").
#[tauri::command]
pub fn reset_peak_memory() {
    perch_engine::device::reset_peak_memory();
}

/// System memory and this process's resident set, in bytes (from `sysinfo`).
#[derive(Clone, Debug, Serialize)]
pub struct SystemStats {
    pub ram_used_bytes: u64,
    pub ram_total_bytes: u64,
    /// `None` when the OS does not report it.
    pub process_rss_bytes: Option<u64>,
}

/// `sysinfo`'s view of the machine, kept between calls (refreshing it is cheap, creating it not).
#[derive(Default)]
pub struct SystemMonitor(Mutex<sysinfo::System>);

#[tauri::command]
pub fn system_stats(monitor: State<'_, SystemMonitor>) -> Result<SystemStats, String> {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate};
    let mut system = monitor.0.lock().map_err(|_| poisoned())?;
    system.refresh_memory();
    let pid = sysinfo::get_current_pid().ok();
    if let Some(pid) = pid {
        system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[pid]),
            false,
            ProcessRefreshKind::nothing().with_memory(),
        );
    }
    Ok(SystemStats {
        ram_used_bytes: system.used_memory(),
        ram_total_bytes: system.total_memory(),
        process_rss_bytes: pid.and_then(|pid| system.process(pid)).map(|p| p.memory()),
    })
}

/// Returns MLX's cached buffers to the system; the bytes freed.
#[tauri::command]
pub fn clear_cache() -> usize {
    let before = memory_stats().cache_bytes;
    mlx_clear_cache();
    before.saturating_sub(memory_stats().cache_bytes)
}
