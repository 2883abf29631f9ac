//! Perch's menu-bar app: a tray icon with a menu (Chat, Dashboard, Models, Settings, Quit) and
//! one window whose web UI (`ui/`) shows the chat, the local models and the engine's numbers.
//!
//! Platform behaviour:
//! - macOS: no Dock icon (accessory app); the window is hidden at start, a click on the tray
//!   icon shows it under the icon, and it hides when it loses focus (a popover).
//! - Linux: tray clicks are not delivered and a tray host may be missing (the icon is then
//!   invisible), so the window opens from the tray menu and is shown at start.
//!
//! The engine runs on its own thread ([`perch_engine::EngineHandle`]); commands
//! ([`commands`]) only call into it. Chats and settings persist in Perch's data directory
//! ([`store::Store`]).

pub mod commands;
pub mod desktop;
pub mod store;
pub mod tray;

use tauri::{AppHandle, Emitter, Manager, PhysicalPosition, Rect, Runtime, WebviewWindow};

pub use commands::model::AppState;
use store::Store;

/// The window's label in `tauri.conf.json` and in the capability.
pub const WINDOW: &str = "chat";

/// The views of the UI; the tray menu's items and the `navigate` event name them.
pub const VIEWS: [&str; 4] = ["chat", "dashboard", "models", "settings"];

/// Commands and state over `store`, without tray or windows: what tests build on
/// `tauri::test::mock_builder`.
pub fn with_commands<R: Runtime>(builder: tauri::Builder<R>, store: Store) -> tauri::Builder<R> {
    use commands::{chat, hosts, hub, model, server, settings, system};
    let state = AppState::default();
    let local_server = server::LocalServer::new(state.served());
    builder
        .manage(state)
        .manage(local_server)
        .manage(system::SystemMonitor::default())
        .manage(hub::Downloads::default())
        .manage(hosts::GroupMemory::default())
        .manage(store)
        .invoke_handler(tauri::generate_handler![
            model::list_models,
            model::delete_model,
            model::load_model,
            model::unload_model,
            model::model_status,
            model::engine_stats,
            model::clear_cache,
            model::reset_peak_memory,
            chat::list_conversations,
            chat::create_conversation,
            chat::get_conversation,
            chat::rename_conversation,
            chat::delete_conversation,
            chat::set_conversation_settings,
            chat::chat,
            chat::stop,
            settings::get_settings,
            settings::save_settings,
            settings::startup_notices,
            settings::finish_first_run,
            system::system_stats,
            hub::search_models,
            hub::download_model,
            hub::cancel_download,
            hub::partial_downloads,
            hub::discard_partial_download,
            server::server_status,
            hosts::check_hosts,
            hosts::hosts_status,
        ])
}

/// Runs the app: tray, window behaviour, the store in Perch's data directory
/// (`perch_hub::data_dir()`), and the default model loading in the background. Without a
/// display (no `DISPLAY` or `WAYLAND_DISPLAY` on Linux, or one that GTK cannot open) it prints
/// one sentence and returns a failure instead of panicking.
pub fn run() -> std::process::ExitCode {
    if let Some(problem) = missing_display() {
        eprintln!("{problem}");
        return std::process::ExitCode::FAILURE;
    }
    // Tauri (tao, GTK) panics when the display cannot be opened: that panic becomes the sentence.
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let built = std::panic::catch_unwind(|| {
        let store = Store::open(&perch_hub::data_dir(), perch_hub::total_memory_bytes());
        desktop::plugins(with_commands(tauri::Builder::default(), store))
            .setup(setup)
            .build(tauri::generate_context!())
    });
    std::panic::set_hook(quiet);
    let app = match built {
        Ok(Ok(app)) => app,
        Ok(Err(err)) => {
            eprintln!("Perch could not start its window: {err}.");
            return std::process::ExitCode::FAILURE;
        }
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            eprintln!(
                "Perch could not open a window on this display ({why}); the `perch` command line \
                 runs without one."
            );
            return std::process::ExitCode::FAILURE;
        }
    };
    app.run(|_, _| {});
    std::process::ExitCode::SUCCESS
}

/// Why no window can open here, before trying: a Linux session without a display server.
fn missing_display() -> Option<String> {
    let unset = |name: &str| std::env::var_os(name).is_none_or(|v| v.is_empty());
    (cfg!(target_os = "linux") && unset("DISPLAY") && unset("WAYLAND_DISPLAY")).then(|| {
        "Perch needs a graphical session (neither DISPLAY nor WAYLAND_DISPLAY is set); the \
         `perch` command line runs without one."
            .to_string()
    })
}

/// The tray, the window's behaviour, the saved settings applied, the default model loading.
fn setup(app: &mut tauri::App) -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(target_os = "macos")]
    app.set_activation_policy(tauri::ActivationPolicy::Accessory);
    tray::build(app.handle())?;
    if let Some(window) = app.get_webview_window(WINDOW) {
        if cfg!(target_os = "macos") {
            let popover = window.clone();
            window.on_window_event(move |event| {
                if let tauri::WindowEvent::Focused(false) = event {
                    let _ = popover.hide();
                }
            });
        } else {
            show(&window);
        }
    }
    let store = app.state::<Store>();
    if let Err(problem) = store.settings().and_then(|settings| {
        desktop::apply(app.handle(), None, &settings)?;
        app.state::<commands::server::LocalServer>()
            .apply(&settings.server)
    }) {
        store.add_notice(problem.message);
    }
    load_default_model(app.handle().clone());
    Ok(())
}

/// Shows the window on `view` (one of [`VIEWS`]).
pub fn open_view<R: Runtime>(app: &AppHandle<R>, view: &str) {
    if let Some(window) = app.get_webview_window(WINDOW) {
        show(&window);
        if VIEWS.contains(&view) {
            let _ = window.emit("navigate", view);
        }
    }
}

pub(crate) fn show<R: Runtime>(window: &WebviewWindow<R>) {
    let _ = window.show();
    let _ = window.unminimize();
    let _ = window.set_focus();
}

/// Centres the window horizontally under the tray icon's rectangle.
pub(crate) fn place_under<R: Runtime>(window: &WebviewWindow<R>, icon: Rect) {
    let scale = window.scale_factor().unwrap_or(1.0);
    let icon_position = icon.position.to_physical::<f64>(scale);
    let icon_size = icon.size.to_physical::<f64>(scale);
    // Before the first show the window reports 1x1: fall back to the configured width.
    let width = match window.outer_size() {
        Ok(size) if size.width > 1 => size.width as f64,
        _ => 420.0 * scale,
    };
    let x = icon_position.x + icon_size.width / 2.0 - width / 2.0;
    let y = icon_position.y + icon_size.height;
    let _ = window.set_position(PhysicalPosition::new(x.max(0.0), y));
}

/// Loads the default model (`perch_hub::DEFAULT_MODEL_NAME` in Perch's models directory, or
/// `$PERCH_MODEL`) on a background thread; the UI follows it through `model_status`.
fn load_default_model<R: Runtime>(app: AppHandle<R>) {
    let store = app.state::<Store>();
    let (Ok(models_dir), Ok(config)) = (store.models_dir(), store.engine_config()) else {
        return;
    };
    let path = std::env::var_os("PERCH_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| models_dir.join(perch_hub::DEFAULT_MODEL_NAME));
    if !path.join("config.json").is_file() {
        return;
    }
    std::thread::spawn(move || {
        let _ = app.state::<AppState>().load(path, config);
    });
}
