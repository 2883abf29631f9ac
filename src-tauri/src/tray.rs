//! The tray icon and its menu: a status line (the model, what the engine is doing, memory), New
//! chat, the views, a "Switch model" submenu of the models on this machine that Perch runs, the
//! local server's switch, Quit. The icon is the monochrome perch (`icons/`), a template image
//! on macOS (drawn in the menu bar's colour). What can take time (loading a model, binding the
//! server's port, reading the engine's stats or the disk) runs on threads of its own, never on
//! the thread that delivers the menu's events; a failure is sent to the window as a `notice`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tauri::menu::{CheckMenuItem, Menu, MenuItem, PredefinedMenuItem, Submenu};
use tauri::tray::{MouseButton, MouseButtonState, TrayIcon, TrayIconBuilder, TrayIconEvent};
use tauri::{AppHandle, Emitter, Manager, Runtime};

use crate::commands::model::{switchable_models, AppState};
use crate::commands::server::LocalServer;
use crate::commands::settings::set_server_enabled;
use crate::commands::CommandError;
use crate::store::Store;
use crate::{open_view, place_under, show, WINDOW};

/// Models the "Switch model" submenu lists at most.
pub const SWITCH_MODELS: usize = 12;

/// How often the status line is refreshed; the model list and the server's switch every
/// [`MODELS_EVERY`] refreshes (the list reads the disk).
const REFRESH: Duration = Duration::from_secs(2);
const MODELS_EVERY: u32 = 5;

/// The id of a "Switch model" item: the model's directory after this prefix, so that a click
/// needs nothing shared with the thread that rebuilds the submenu.
const MODEL_ID: &str = "model:";

/// The menu's items that change while the app runs (owned by the refresh thread).
struct Live<R: Runtime> {
    status: MenuItem<R>,
    switch: Submenu<R>,
    server: CheckMenuItem<R>,
    /// The submenu's models (name, directory) and their items.
    models: Vec<(String, PathBuf)>,
    items: Vec<CheckMenuItem<R>>,
}

pub fn build<R: Runtime>(app: &AppHandle<R>) -> tauri::Result<()> {
    let item = |id: &str, text: &str| MenuItem::with_id(app, id, text, true, None::<&str>);
    // What the engine is doing, as the menu's first line (not clickable) and the tooltip.
    let status = MenuItem::with_id(app, "status", "Perch", false, None::<&str>)?;
    let switch = Submenu::with_id(app, "switch", "Switch model", true)?;
    let server = CheckMenuItem::with_id(app, "server", "Local server", true, false, None::<&str>)?;
    let menu = Menu::with_items(
        app,
        &[
            &status,
            &PredefinedMenuItem::separator(app)?,
            &item("new-chat", "New chat")?,
            &switch,
            &item("chat", "Chat")?,
            &item("dashboard", "Dashboard")?,
            &item("models", "Models")?,
            &item("settings", "Settings…")?,
            &PredefinedMenuItem::separator(app)?,
            &server,
            &PredefinedMenuItem::separator(app)?,
            &item("quit", "Quit Perch")?,
        ],
    )?;
    let live = Live {
        status,
        switch,
        server,
        models: Vec::new(),
        items: Vec::new(),
    };
    let mut tray = TrayIconBuilder::with_id("perch")
        .tooltip("Perch")
        .menu(&menu)
        .show_menu_on_left_click(false)
        .icon_as_template(true)
        .on_menu_event(|app, event| match event.id().as_ref() {
            "quit" => app.exit(0),
            "new-chat" => {
                open_view(app, "chat");
                if let Some(window) = app.get_webview_window(WINDOW) {
                    let _ = window.emit("new-chat", ());
                }
            }
            "server" => toggle_server(app),
            id => match id.strip_prefix(MODEL_ID) {
                Some(path) => switch_model(app, PathBuf::from(path)),
                None => open_view(app, id),
            },
        })
        .on_tray_icon_event(|tray, event| {
            // Delivered on macOS and Windows only.
            if let TrayIconEvent::Click {
                button: MouseButton::Left,
                button_state: MouseButtonState::Up,
                rect,
                ..
            } = event
            {
                if let Some(window) = tray.app_handle().get_webview_window(WINDOW) {
                    if window.is_visible().unwrap_or(false) {
                        let _ = window.hide();
                    } else {
                        place_under(&window, rect);
                        show(&window);
                    }
                }
            }
        });
    if let Some(icon) = app.default_window_icon() {
        tray = tray.icon(icon.clone());
    }
    let tray = tray.build(app)?;
    follow(app.clone(), tray, live);
    Ok(())
}

/// Loads `path` in the background (replacing the loaded model), as the Models view's Load; the
/// loaded model itself is left as it is (its requests keep running).
fn switch_model<R: Runtime>(app: &AppHandle<R>, path: PathBuf) {
    let app = app.clone();
    std::thread::spawn(move || {
        if loaded_model(&app).as_deref() == Some(path.as_path()) {
            return;
        }
        let loaded = app
            .state::<Store>()
            .engine_config()
            .and_then(|config| app.state::<AppState>().load(path, config));
        if let Err(err) = loaded {
            tell(&app, err);
        }
    });
}

/// Turns the local server on when it is off and off when on, saving the setting.
fn toggle_server<R: Runtime>(app: &AppHandle<R>) {
    let app = app.clone();
    std::thread::spawn(move || {
        let running = app.state::<LocalServer>().status().running;
        if let Err(err) = set_server_enabled(&app, !running) {
            tell(&app, err);
        }
    });
}

/// The loaded model's directory, if one is loaded.
fn loaded_model<R: Runtime>(app: &AppHandle<R>) -> Option<PathBuf> {
    match app.state::<AppState>().status() {
        crate::commands::model::ModelStatus::Loaded { path, .. } => Some(path),
        _ => None,
    }
}

/// Shows the window with the failure of a tray action.
fn tell<R: Runtime>(app: &AppHandle<R>, err: CommandError) {
    if let Some(window) = app.get_webview_window(WINDOW) {
        show(&window);
        let _ = window.emit("notice", err);
    }
}

/// On a thread of its own, every [`REFRESH`]: puts the model and what the engine is doing in
/// the status line and tooltip when it changed ([`crate::commands::model::tray_line`]; reading
/// the engine's stats waits on the engine thread), and every [`MODELS_EVERY`] refreshes sets
/// the submenu's models and the server's switch to what they are.
fn follow<R: Runtime>(app: AppHandle<R>, tray: TrayIcon<R>, mut live: Live<R>) {
    let spawned = std::thread::Builder::new()
        .name("perch-tray".into())
        .spawn(move || {
            let mut shown = String::new();
            for tick in 0u32.. {
                let line = app.state::<AppState>().tray_line();
                if line != shown {
                    let _ = live.status.set_text(&line);
                    let _ = tray.set_tooltip(Some(format!("Perch — {line}")));
                    shown = line;
                }
                if tick % MODELS_EVERY == 0 {
                    let running = app.state::<LocalServer>().status().running;
                    let _ = live.server.set_checked(running);
                    if let Ok(models) = switchable_models(&app, SWITCH_MODELS) {
                        let _ = set_models(&app, &mut live, models);
                    }
                }
                // A click flips an item's check by itself: every refresh puts them back.
                let loaded = loaded_model(&app);
                for ((_, path), item) in live.models.iter().zip(&live.items) {
                    let _ = item.set_checked(loaded.as_deref() == Some(path.as_path()));
                }
                std::thread::sleep(REFRESH);
            }
        });
    if let Err(err) = spawned {
        eprintln!("perch: the tray will not show the engine's state: {err}");
    }
}

/// Replaces the submenu's items with `models` when they changed (the caller sets their checks).
fn set_models<R: Runtime>(
    app: &AppHandle<R>,
    live: &mut Live<R>,
    models: Vec<(String, PathBuf, bool)>,
) -> tauri::Result<()> {
    let models: Vec<(String, PathBuf)> = models.into_iter().map(|(n, p, _)| (n, p)).collect();
    if live.models == models && !live.switch.items()?.is_empty() {
        return Ok(());
    }
    for item in live.switch.items()? {
        live.switch.remove(&item)?;
    }
    live.items.clear();
    if models.is_empty() {
        let none = MenuItem::with_id(app, "no-models", "No models here yet", false, None::<&str>)?;
        live.switch.append(&none)?;
    }
    for (name, path) in &models {
        let id = format!("{MODEL_ID}{}", path_text(path));
        let item = CheckMenuItem::with_id(app, id, name, true, false, None::<&str>)?;
        live.switch.append(&item)?;
        live.items.push(item);
    }
    live.models = models;
    Ok(())
}

/// A directory as the text of a menu id (lossy for a path that is not UTF-8: such a model's
/// load then fails with a sentence).
fn path_text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
