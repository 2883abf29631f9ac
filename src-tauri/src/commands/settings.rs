//! The settings: read, validated and saved, and problems found at start.

use super::CommandError;
use std::path::PathBuf;

use perch_store::Settings;
use serde::Serialize;
use tauri::{AppHandle, Emitter, Manager, Runtime, State};

use super::off_main_thread;
use super::server::LocalServer;
use crate::desktop;
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

fn view(store: &Store) -> Result<SettingsView, CommandError> {
    Ok(SettingsView {
        settings: store.settings()?,
        models_dir: store.models_dir()?,
        total_memory_bytes: store.total_memory_bytes(),
        defaults: Settings::default(),
    })
}

#[tauri::command]
pub fn get_settings(store: State<'_, Store>) -> Result<SettingsView, CommandError> {
    view(&store)
}

/// Validates `settings`, applies the global shortcut and launch at login, and saves them; on
/// any error nothing changes. The local server starts, restarts or stops to match (a port
/// already in use is such an error). The KV budget and block size apply from the next model
/// load; new conversations start with the chat defaults. Runs off the main thread (it writes the
/// settings file and binds a port; the shortcut plugin hops to the main thread itself).
#[tauri::command]
pub async fn save_settings<R: Runtime>(
    app: AppHandle<R>,
    settings: Settings,
) -> Result<SettingsView, CommandError> {
    off_main_thread(app, move |app| {
        apply_and_save(app, settings)?;
        view(&app.state::<Store>())
    })
    .await
}

/// What [`save_settings`] does, blocking (it writes a file and binds a port): validate, apply,
/// save, or change nothing.
pub fn apply_and_save<R: Runtime>(
    app: &AppHandle<R>,
    mut settings: Settings,
) -> Result<(), CommandError> {
    let _turn = SAVING.lock().unwrap_or_else(|p| p.into_inner());
    let store = app.state::<Store>();
    store.validate_settings(&settings)?;
    let old = store.settings()?;
    // Only `finish_first_run` sets it; a form read before the first run ended keeps it.
    settings.first_run_done |= old.first_run_done;
    desktop::apply(app, Some(&old), &settings)?;
    let server = app.state::<LocalServer>();
    let saved = server
        .apply(&settings.server)
        .and_then(|()| store.save_settings(settings.clone()));
    if let Err(err) = saved {
        let _ = server.apply(&old.server);
        let _ = desktop::apply(app, Some(&settings), &old);
        return Err(err);
    }
    Ok(())
}

/// Saves of the settings take turns: each reads what it merges with and writes it back.
static SAVING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Turns the local server on or off and saves that in the settings (the tray's switch), as
/// [`save_settings`] would with only `server.enabled` changed; then tells the window
/// (`settings-changed`), whose Settings form reloads. Blocking.
pub fn set_server_enabled<R: Runtime>(
    app: &AppHandle<R>,
    enabled: bool,
) -> Result<(), CommandError> {
    let mut settings = app.state::<Store>().settings()?;
    settings.server.enabled = enabled;
    apply_and_save(app, settings)?;
    let _ = app.emit("settings-changed", ());
    Ok(())
}

/// Remembers that the first-run screen was finished or skipped (`Settings::first_run_done`),
/// off the UI thread (it writes the settings file).
#[tauri::command]
pub async fn finish_first_run<R: Runtime>(app: AppHandle<R>) -> Result<(), CommandError> {
    off_main_thread(app, |app| {
        let _turn = SAVING.lock().unwrap_or_else(|p| p.into_inner());
        let store = app.state::<Store>();
        let mut settings = store.settings()?;
        if !settings.first_run_done {
            settings.first_run_done = true;
            store.save_settings(settings)?;
        }
        Ok(())
    })
    .await
}

/// Problems found at start (a damaged history or settings file set aside, …), one sentence each.
#[tauri::command]
pub fn startup_notices(store: State<'_, Store>) -> Vec<String> {
    store.notices()
}
