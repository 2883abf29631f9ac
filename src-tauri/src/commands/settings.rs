//! The settings: read, validated and saved, and problems found at start.

use std::path::PathBuf;

use perch_store::Settings;
use serde::Serialize;
use tauri::State;

use crate::store::Store;

/// The settings with what the UI needs to explain them.
#[derive(Clone, Debug, Serialize)]
pub struct SettingsView {
    pub settings: Settings,
    /// The models directory in use (the setting, else Perch's default).
    pub models_dir: PathBuf,
    /// The machine's memory: the largest KV budget accepted, in bytes.
    pub total_memory_bytes: u64,
    /// The defaults, for "reset".
    pub defaults: Settings,
}

fn view(store: &Store) -> Result<SettingsView, String> {
    Ok(SettingsView {
        settings: store.settings()?,
        models_dir: store.models_dir()?,
        total_memory_bytes: store.total_memory_bytes(),
        defaults: Settings::default(),
    })
}

#[tauri::command]
pub fn get_settings(store: State<'_, Store>) -> Result<SettingsView, String> {
    view(&store)
}

/// Validates and saves `settings`. The KV budget and block size apply from the next model load;
/// new conversations start with the chat defaults.
#[tauri::command]
pub fn save_settings(store: State<'_, Store>, settings: Settings) -> Result<SettingsView, String> {
    store.save_settings(settings)?;
    view(&store)
}

/// Problems found at start (a damaged history or settings file set aside, …), one sentence each.
#[tauri::command]
pub fn startup_notices(store: State<'_, Store>) -> Vec<String> {
    store.notices().to_vec()
}
