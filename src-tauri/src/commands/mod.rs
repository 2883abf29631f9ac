//! The commands the web UI calls, by domain. Each is thin: it calls `perch-engine` (through the
//! [`perch_engine::EngineHandle`]), `perch-hub` or `perch-store` and turns any error into one
//! sentence for the UI.

pub mod chat;
pub mod hub;
pub mod model;
pub mod server;
pub mod settings;
pub mod system;

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

/// [`sentence`] of an error followed by its causes (`cannot reach …: connection refused.`).
pub fn sentence_with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text = format!("{}: {cause}", text.trim_end_matches('.'));
        source = cause.source();
    }
    sentence(&text)
}

/// Runs `work` on Tauri's blocking pool: commands that wait on the engine, the disk or the
/// network are `async` and do their work here, never on the main (UI) thread, which runs every
/// non-async command.
pub(crate) async fn off_main_thread<R: tauri::Runtime, T: Send + 'static>(
    app: tauri::AppHandle<R>,
    work: impl FnOnce(&tauri::AppHandle<R>) -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tauri::async_runtime::spawn_blocking(move || work(&app))
        .await
        .map_err(|_| "Perch hit an internal error; the last action did not complete.".to_string())?
}

pub(crate) fn poisoned() -> String {
    "Perch's state is broken after an earlier crash; restart the app.".into()
}
