//! What Perch's app keeps between runs: the chat history ([`History`], SQLite in WAL mode)
//! and the user's [`Settings`] (a JSON file). Both survive a crash or `kill -9` with everything
//! they reported as saved, and neither overwrites a damaged file: it is renamed aside
//! ([`SetAside`]) and reported, and a fresh one is started.

mod history;
mod settings;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

pub use history::{
    AnswerSampling, AnswerSamplingSource, Attachment, Conversation, ConversationSettings,
    ConversationSummary, History, HistoryError, Message, Role, SamplingSource, Turn,
};
pub use settings::{ServerSettings, Settings, SettingsError};

/// A damaged file that was renamed so a fresh one could start; nothing in it was deleted.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SetAside {
    /// Where the damaged file is now.
    pub moved_to: PathBuf,
    /// What was wrong with it, as one sentence.
    pub reason: String,
}

/// Renames `path` (and its `suffixes` siblings, e.g. SQLite's `-wal`) to
/// `<name>.<label>-<unix ms><suffix>`, so that nothing is overwritten; returns the new path.
fn set_aside(path: &Path, label: &str, suffixes: &[&str]) -> std::io::Result<PathBuf> {
    let stamp = unix_millis();
    let with = |suffix: &str| {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    };
    let moved_to = with(&format!(".{label}-{stamp}"));
    std::fs::rename(path, &moved_to)?;
    for suffix in suffixes {
        let sibling = with(suffix);
        if sibling.exists() {
            std::fs::rename(&sibling, with(&format!(".{label}-{stamp}{suffix}")))?;
        }
    }
    Ok(moved_to)
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
