//! Model commands: the local list, load and unload, the engine's stats, MLX memory.

use super::{CommandError, CommandErrorKind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use perch_engine::device::{clear_cache as mlx_clear_cache, memory_stats};
use perch_engine::sample::generation_config::SamplingDefaults;
use perch_engine::{EngineConfig, EngineHandle, EngineStats, LoadProgress, Residency};
use perch_hub::LocalModel;
use perch_server::{Served, ServedModel};
use serde::Serialize;
use tauri::{AppHandle, Manager, Runtime, State};

use super::{off_main_thread, poisoned};
use crate::store::Store;

/// The loaded model, if any, and what is happening to it.
#[derive(Default)]
pub struct AppState {
    model: Mutex<ModelSlot>,
    /// Held for a whole load or unload: loads run one at a time, so a second load waits for the
    /// first and then replaces it (the first engine is shut down before the next model is read,
    /// never two models resident), and the progress shown is the running load's.
    loads: Mutex<()>,
    /// How far the model being loaded has come; written by the engine thread.
    load_progress: Arc<Mutex<LoadProgress>>,
    /// What the local server serves: the loaded model, or nothing.
    served: ServedModel,
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
    /// `bytes_read` of `bytes_total` bytes of weights read so far.
    Loading {
        name: String,
        #[serde(flatten)]
        progress: LoadProgress,
    },
    Loaded {
        name: String,
        path: PathBuf,
        /// What conversations that follow the model sample with (its `generation_config.json`'s
        /// values, else Perch's), shown by the settings forms.
        sampling_defaults: SamplingDefaults,
        /// Whether it takes images (its vision tower and image processor loaded).
        vision: bool,
    },
    Failed {
        name: String,
        error: String,
    },
}

impl AppState {
    /// The loaded model as the local server sees it (shared, follows every load and unload).
    pub fn served(&self) -> ServedModel {
        self.served.clone()
    }

    fn slot(&self) -> Result<std::sync::MutexGuard<'_, ModelSlot>, CommandError> {
        self.model.lock().map_err(|_| poisoned())
    }

    /// The loaded model's engine, or the sentence saying why there is none.
    pub fn engine(&self) -> Result<EngineHandle, CommandError> {
        let slot = self.slot()?;
        match (&slot.engine, &slot.status) {
            (Some(engine), _) => Ok(engine.clone()),
            (None, ModelStatus::Loading { name, .. }) => Err(CommandError::new(
                CommandErrorKind::ModelNotLoaded,
                &format!("{name} is still loading."),
            )),
            (None, _) => Err(CommandError::new(
                CommandErrorKind::ModelNotLoaded,
                &"No model is loaded; choose one under Models.",
            )),
        }
    }

    /// One line for the tray (its status item and tooltip): the model and what the engine is
    /// doing ([`tray_line`]). Asks the engine thread for its stats: not for the UI thread.
    pub fn tray_line(&self) -> String {
        let status = self.status();
        let stats = match status {
            ModelStatus::Loaded { .. } => self.engine().ok().and_then(|e| e.stats().ok()),
            _ => None,
        };
        tray_line(&status, stats.as_ref())
    }

    pub fn status(&self) -> ModelStatus {
        let mut status = self.slot().map(|s| s.status.clone()).unwrap_or_default();
        if let ModelStatus::Loading { progress, .. } = &mut status {
            *progress = self.load_progress.lock().map(|p| *p).unwrap_or_default();
        }
        status
    }

    /// Loads the model in `path` on an engine thread with `config` (replacing the loaded
    /// model) and waits for it, after any load already running; blocking, so commands call it
    /// off the UI thread.
    pub fn load(&self, path: PathBuf, config: EngineConfig) -> Result<ModelStatus, CommandError> {
        let _one_at_a_time = self.loads.lock().map_err(|_| poisoned())?;
        let name = perch_hub::model_name(&path);
        let previous = std::mem::replace(
            &mut *self.slot()?,
            ModelSlot {
                status: ModelStatus::Loading {
                    name: name.clone(),
                    progress: LoadProgress::default(),
                },
                engine: None,
            },
        );
        self.served.replace(None);
        if let Some(engine) = previous.engine {
            engine.shutdown();
        }
        let progress = Arc::clone(&self.load_progress);
        if let Ok(mut p) = progress.lock() {
            *p = LoadProgress::default();
        }
        let loaded = EngineHandle::load_with_progress(&path, config, move |p| {
            if let Ok(mut current) = progress.lock() {
                *current = p;
            }
        });
        let (slot, result) = match loaded {
            Ok(engine) => {
                self.served.replace(Some(Served {
                    engine: engine.clone(),
                    model_id: name.clone(),
                }));
                let status = ModelStatus::Loaded {
                    name,
                    path,
                    sampling_defaults: engine.tokenizer().sampling_defaults().clone(),
                    vision: engine.tokenizer().image_processor().is_some(),
                };
                let slot = ModelSlot {
                    status: status.clone(),
                    engine: Some(engine),
                };
                (slot, Ok(status))
            }
            Err(err) => {
                let error = CommandError::new(CommandErrorKind::InvalidModel, &err);
                let slot = ModelSlot {
                    status: ModelStatus::Failed {
                        name,
                        error: error.message.clone(),
                    },
                    engine: None,
                };
                (slot, Err(error))
            }
        };
        *self.slot()? = slot;
        result
    }

    /// Shuts the loaded model's engine down (after any load running) and frees MLX's cache.
    pub fn unload(&self) -> Result<(), CommandError> {
        let _one_at_a_time = self.loads.lock().map_err(|_| poisoned())?;
        self.served.replace(None);
        let previous = std::mem::take(&mut *self.slot()?);
        if let Some(engine) = previous.engine {
            engine.shutdown();
        }
        mlx_clear_cache();
        Ok(())
    }
}

/// The models the tray offers to switch to: those of [`list_models`] Perch runs, at most
/// `limit`, as (name, directory), with whether each is the loaded one. Reads the disk.
pub fn switchable_models<R: Runtime>(
    app: &AppHandle<R>,
    limit: usize,
) -> Result<Vec<(String, PathBuf, bool)>, CommandError> {
    let loaded = match app.state::<AppState>().status() {
        ModelStatus::Loaded { path, .. } => Some(path),
        _ => None,
    };
    let models_dir = app.state::<Store>().models_dir()?;
    Ok(
        perch_hub::local_models(&models_dir, perch_hub::hf_cache_dir().as_deref())
            .into_iter()
            .filter(|model| {
                model.model_type.as_deref().is_some_and(|t| {
                    perch_engine::models::unsupported_architecture_note(t).is_none()
                })
            })
            .take(limit)
            .map(|model| {
                let current = loaded.as_ref() == Some(&model.path);
                (model.name, model.path, current)
            })
            .collect(),
    )
}

/// Models in Perch's models directory (from the settings) and in the Hugging Face cache.
#[tauri::command]
pub async fn list_models<R: Runtime>(
    app: AppHandle<R>,
) -> Result<Vec<LocalModelView>, CommandError> {
    off_main_thread(app, |app| {
        let store = app.state::<Store>();
        let settings = store.settings()?;
        let kv_cache_bytes = settings.kv_cache_bytes as u64;
        let total_memory = store.total_memory_bytes();
        let group = app.state::<super::hosts::GroupMemory>();
        Ok(
            perch_hub::local_models(&store.models_dir()?, perch_hub::hf_cache_dir().as_deref())
                .into_iter()
                .map(|model| LocalModelView {
                    vision: model.config.as_ref().is_some_and(|config| {
                        perch_engine::models::takes_images(config, &model.path)
                    }),
                    architecture_note: model
                        .model_type
                        .as_deref()
                        .and_then(perch_engine::models::unsupported_architecture_note),
                    fit: perch_hub::memory_fit(
                        Some(model.size_bytes),
                        kv_cache_bytes,
                        total_memory,
                    ),
                    group_fit: group.fit(&settings.hosts, Some(model.size_bytes), kv_cache_bytes),
                    model,
                })
                .collect(),
        )
    })
    .await
}

/// Deletes a model on this machine (its directory in Perch's models directory, or its
/// repository in the Hugging Face cache; [`perch_hub::delete_local_model`]) and returns the
/// bytes freed. The loaded model is refused: unload it, or load another, first.
#[tauri::command]
pub async fn delete_model<R: Runtime>(
    app: AppHandle<R>,
    path: PathBuf,
) -> Result<u64, CommandError> {
    off_main_thread(app, move |app| {
        if let ModelStatus::Loaded {
            name, path: loaded, ..
        } = app.state::<AppState>().status()
        {
            if loaded == path {
                return Err(CommandError::invalid(&format!(
                    "{name} is loaded: unload it or load another model before deleting it."
                )));
            }
        }
        perch_hub::delete_local_model(
            &app.state::<Store>().models_dir()?,
            perch_hub::hf_cache_dir().as_deref(),
            &path,
        )
        .map_err(|err| match err {
            perch_hub::HubError::NotLocalModel(_) => CommandError::invalid(&err),
            other => CommandError::storage(&other),
        })
    })
    .await
}

/// A model on this machine, and whether Perch runs it.
#[derive(Clone, Debug, Serialize)]
pub struct LocalModelView {
    #[serde(flatten)]
    pub model: LocalModel,
    /// When its `model_type` is one Perch does not run: a sentence naming it and those it runs.
    pub architecture_note: Option<String>,
    /// Its weights and the settings' KV cache budget against the usable memory (the Hub
    /// search's rule, [`perch_hub::memory_fit`]).
    pub fit: perch_hub::MemoryFit,
    /// The same divided over the machines of Settings → Hosts, by their last reading
    /// ([`super::hosts::GroupMemory::fit`]); `None` without hosts or a reading of them.
    pub group_fit: Option<perch_hub::MemoryFit>,
    /// Whether it takes images ([`perch_engine::models::takes_images`]).
    pub vision: bool,
}

/// Loads the model directory `path` (replacing the loaded model), with the KV cache budget and
/// block size of the settings.
#[tauri::command]
pub async fn load_model<R: Runtime>(
    app: AppHandle<R>,
    path: PathBuf,
) -> Result<ModelStatus, CommandError> {
    let config = app.state::<Store>().engine_config()?;
    // Loading takes seconds: keep it off the async runtime's workers.
    tauri::async_runtime::spawn_blocking(move || app.state::<AppState>().load(path, config))
        .await
        .map_err(|_| "Loading the model crashed.".to_string())?
}

/// Unloads the model (waits for its engine thread to end, off the UI thread).
#[tauri::command]
pub async fn unload_model<R: Runtime>(app: AppHandle<R>) -> Result<(), CommandError> {
    off_main_thread(app, |app| app.state::<AppState>().unload()).await
}

#[tauri::command]
pub fn model_status(state: State<'_, AppState>) -> ModelStatus {
    state.status()
}

/// The engine's stats (requests, tok/s, KV blocks, MLX memory), or `None` with no model: the
/// snapshot of the engine's last step, so it never waits for the engine.
#[tauri::command]
pub fn engine_stats(state: State<'_, AppState>) -> Result<Option<EngineStats>, CommandError> {
    match state.engine() {
        Ok(engine) => engine
            .stats()
            .map(Some)
            .map_err(|e| CommandError::engine(&e)),
        Err(_) => Ok(None),
    }
}

/// Starts a new MLX peak-memory measurement (the dashboard's "reset peak").
#[tauri::command]
pub fn reset_peak_memory() {
    perch_engine::device::reset_peak_memory();
}

/// Returns MLX's cached buffers to the system; the bytes freed.
#[tauri::command]
pub fn clear_cache() -> usize {
    let before = memory_stats().cache_bytes;
    mlx_clear_cache();
    before.saturating_sub(memory_stats().cache_bytes)
}

/// The tray's line for `status` and the engine's `stats`: "No model loaded", "Loading
/// SmolLM2… 40%", "SmolLM2 · idle · 0.3 GB", "SmolLM2 · 2 generating, 1 waiting · 85 tok/s ·
/// 0.4 GB" (MLX's memory in use), "SmolLM2 · unloaded while idle", "Loading SmolLM2 again…
/// 40%", "SmolLM2 failed to load".
pub fn tray_line(status: &ModelStatus, stats: Option<&EngineStats>) -> String {
    match status {
        ModelStatus::NotLoaded => "No model loaded".into(),
        ModelStatus::Loading { name, progress } => format!("Loading {name}…{}", percent(progress)),
        ModelStatus::Failed { name, .. } => format!("{name} failed to load"),
        ModelStatus::Loaded { name, .. } => {
            let Some(s) = stats else {
                return format!("{name} · idle");
            };
            match s.residency {
                Residency::Loaded => {}
                Residency::Unloaded => return format!("{name} · unloaded while idle"),
                Residency::Loading { progress } => {
                    return format!("Loading {name} again…{}", percent(&progress))
                }
            }
            // MLX's memory in use (weights, KV cache, activations), in decimal GB.
            let memory = format!("{:.1} GB", s.memory.active_bytes as f64 / 1e9);
            if s.running + s.waiting == 0 {
                return format!("{name} · idle · {memory}");
            }
            let waiting = match s.waiting {
                0 => String::new(),
                n => format!(", {n} waiting"),
            };
            format!(
                "{name} · {} generating{waiting} · {:.0} tok/s · {memory}",
                s.running, s.generation_tps
            )
        }
    }
}

/// " 40%" of a load's progress, or nothing before its size is known.
fn percent(progress: &LoadProgress) -> String {
    match progress.bytes_total {
        0 => String::new(),
        total => format!(" {}%", 100 * progress.bytes_read.min(total) / total),
    }
}

#[cfg(test)]
mod tray_tests {
    use super::*;

    #[test]
    fn the_tray_says_what_the_engine_is_doing() {
        let name = "SmolLM2".to_string();
        let loaded = ModelStatus::Loaded {
            name: name.clone(),
            path: "/m".into(),
            sampling_defaults: SamplingDefaults::from_generation_config(None, "/m".as_ref())
                .unwrap(),
            vision: false,
        };
        assert_eq!(tray_line(&ModelStatus::NotLoaded, None), "No model loaded");
        let loading = |bytes_read, bytes_total| ModelStatus::Loading {
            name: name.clone(),
            progress: LoadProgress {
                bytes_read,
                bytes_total,
            },
        };
        assert_eq!(tray_line(&loading(40, 100), None), "Loading SmolLM2… 40%");
        assert_eq!(tray_line(&loading(0, 0), None), "Loading SmolLM2…");
        assert_eq!(tray_line(&loading(200, 100), None), "Loading SmolLM2… 100%");
        let failed = ModelStatus::Failed {
            name: name.clone(),
            error: "no config.json".into(),
        };
        assert_eq!(tray_line(&failed, None), "SmolLM2 failed to load");
        assert_eq!(tray_line(&loaded, None), "SmolLM2 · idle");
        let mut stats = EngineStats::default();
        stats.memory.active_bytes = 345_000_000;
        assert_eq!(tray_line(&loaded, Some(&stats)), "SmolLM2 · idle · 0.3 GB");
        stats.running = 2;
        stats.generation_tps = 84.6;
        assert_eq!(
            tray_line(&loaded, Some(&stats)),
            "SmolLM2 · 2 generating · 85 tok/s · 0.3 GB"
        );
        stats.waiting = 1;
        assert_eq!(
            tray_line(&loaded, Some(&stats)),
            "SmolLM2 · 2 generating, 1 waiting · 85 tok/s · 0.3 GB"
        );
        // Unloaded after the idle time, and loading again for the next request.
        stats.residency = Residency::Unloaded;
        assert_eq!(
            tray_line(&loaded, Some(&stats)),
            "SmolLM2 · unloaded while idle"
        );
        stats.residency = Residency::Loading {
            progress: LoadProgress {
                bytes_read: 30,
                bytes_total: 120,
            },
        };
        assert_eq!(
            tray_line(&loaded, Some(&stats)),
            "Loading SmolLM2 again… 25%"
        );
    }
}
