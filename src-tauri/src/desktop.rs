//! The app's hooks into the desktop, from the settings: the global shortcut that summons the chat
//! (`tauri-plugin-global-shortcut`) and launch at login (`tauri-plugin-autostart`: a LaunchAgent
//! on macOS, an XDG autostart entry `~/.config/autostart/Perch.desktop` on Linux).
//!
//! The plugins are added by [`crate::run`] only: they need a real desktop session. On Tauri's mock
//! runtime (the command tests) [`apply`] finds neither and only validates.

use crate::commands::CommandError;
use std::str::FromStr;

use perch_store::Settings;
use tauri::{AppHandle, Manager, Runtime};
use tauri_plugin_autostart::{AutoLaunchManager, MacosLauncher};
use tauri_plugin_global_shortcut::{GlobalShortcut, Shortcut, ShortcutState};

/// The plugins, with the shortcut opening the chat.
pub fn plugins<R: Runtime>(builder: tauri::Builder<R>) -> tauri::Builder<R> {
    builder
        .plugin(
            tauri_plugin_global_shortcut::Builder::new()
                .with_handler(|app, _shortcut, event| {
                    if event.state() == ShortcutState::Pressed {
                        crate::open_view(app, "chat");
                    }
                })
                .build(),
        )
        .plugin(tauri_plugin_autostart::init(
            MacosLauncher::LaunchAgent,
            None,
        ))
}

/// The shortcut in `text` (Tauri's accelerator syntax, e.g. `CommandOrControl+Shift+Space`);
/// `None` when empty. The error is a sentence for the UI.
pub fn parse_shortcut(text: &str) -> Result<Option<Shortcut>, CommandError> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    Shortcut::from_str(text).map(Some).map_err(|err| {
        CommandError::invalid(&format!(
            "The shortcut {text:?} is not valid ({err}); write it like CommandOrControl+Shift+Space."
        ))
    })
}

/// Makes the desktop match `new` (the shortcut registered, the login item present or not),
/// coming from `old` (`None` at start). On error the shortcut of `old` is registered again.
pub fn apply<R: Runtime>(
    app: &AppHandle<R>,
    old: Option<&Settings>,
    new: &Settings,
) -> Result<(), CommandError> {
    let shortcut = parse_shortcut(&new.shortcut)?;
    let previous = old
        .map(|o| parse_shortcut(&o.shortcut))
        .transpose()?
        .flatten();
    if let Some(shortcuts) = app.try_state::<GlobalShortcut<R>>() {
        if old.is_none() || previous != shortcut {
            if let Some(previous) = previous {
                let _ = shortcuts.unregister(previous);
            }
            if let Some(shortcut) = shortcut {
                if let Err(err) = shortcuts.register(shortcut) {
                    if let Some(previous) = previous {
                        let _ = shortcuts.register(previous);
                    }
                    return Err(CommandError::invalid(&format!(
                        "The shortcut {} could not be registered ({err}); another app may use it.",
                        new.shortcut.trim()
                    )));
                }
            }
        }
    }
    if let Some(login) = app.try_state::<AutoLaunchManager>() {
        if login.is_enabled().ok() != Some(new.launch_at_login) {
            let changed = if new.launch_at_login {
                login.enable()
            } else {
                login.disable()
            };
            changed.map_err(|err| format!("Launch at login could not be changed: {err}."))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortcuts_parse_or_explain() {
        assert!(parse_shortcut("").unwrap().is_none());
        assert!(parse_shortcut("CommandOrControl+Shift+Space")
            .unwrap()
            .is_some());
        assert_eq!(
            parse_shortcut("Ctrl+Alt+K").unwrap(),
            parse_shortcut(" control+alt+k ").unwrap()
        );
        let err = parse_shortcut("Ctrl+Nope").unwrap_err();
        assert_eq!(err.kind, crate::commands::CommandErrorKind::InvalidInput);
        assert!(
            err.message
                .starts_with("The shortcut \"Ctrl+Nope\" is not valid"),
            "{err}"
        );
    }
}
