//! What the app keeps between runs, opened once at start: the chat history and the settings
//! (`perch-store`), in Perch's data directory.

use crate::commands::CommandError;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use perch_engine::{EngineConfig, KeepAlive};
use perch_store::{History, SetAside, Settings};

use crate::commands::sentence;

/// The history and the settings, with what went wrong opening them.
pub struct Store {
    history: Arc<Mutex<History>>,
    settings: Mutex<Settings>,
    settings_path: PathBuf,
    total_memory_bytes: u64,
    notices: Mutex<Vec<String>>,
    /// `downloads.json`: the revision each download that has not completed asked for.
    downloads: Mutex<PathBuf>,
    /// Each recent client's latest model, shared by the engines the app loads one after
    /// another, so that a switch explains a client's cache miss ([`EngineConfig::client_models`]).
    client_models: Arc<perch_engine::ClientModels>,
}

impl Store {
    /// File names inside the data directory.
    pub const HISTORY_FILE: &'static str = "history.sqlite3";
    pub const SETTINGS_FILE: &'static str = "settings.json";
    pub const DOWNLOADS_FILE: &'static str = "downloads.json";

    /// Opens `dir/history.sqlite3` and `dir/settings.json`. Never fails: a damaged file is set
    /// aside, a history that cannot be opened at all is kept in memory for this run, unreadable
    /// settings fall back to the defaults, and each of these becomes a notice for the UI.
    pub fn open(dir: &Path, total_memory_bytes: u64) -> Store {
        let mut notices = Vec::new();
        let set_aside_notice = |what: &str, s: SetAside| {
            format!(
                "Your {what} could not be read ({}); it was moved to {} and a new one was started.",
                s.reason.trim_end_matches('.'),
                s.moved_to.display()
            )
        };
        let history = match History::open(&dir.join(Self::HISTORY_FILE)) {
            Ok((history, set_aside)) => {
                notices.extend(set_aside.map(|s| set_aside_notice("chat history", s)));
                history
            }
            Err(err) => {
                notices.push(format!(
                    "{} Chats are not saved in this session.",
                    sentence(&err)
                ));
                History::in_memory().expect("an in-memory SQLite database opens")
            }
        };
        let settings_path = dir.join(Self::SETTINGS_FILE);
        let settings = match Settings::load(&settings_path, total_memory_bytes) {
            Ok((settings, set_aside)) => {
                notices.extend(set_aside.map(|s| set_aside_notice("settings file", s)));
                settings
            }
            Err(err) => {
                notices.push(format!("{} The default settings are used.", sentence(&err)));
                Settings::default()
            }
        };
        Store {
            history: Arc::new(Mutex::new(history)),
            settings: Mutex::new(settings),
            settings_path,
            total_memory_bytes,
            notices: Mutex::new(notices),
            downloads: Mutex::new(dir.join(Self::DOWNLOADS_FILE)),
            client_models: Arc::default(),
        }
    }

    /// Repository id → the revision its download asked for, for the downloads that have not
    /// completed (what a stopped download resumes at); empty when the file is missing or damaged.
    pub fn download_revisions(&self) -> std::collections::BTreeMap<String, String> {
        self.downloads
            .lock()
            .map(|path| read_revisions(&path))
            .unwrap_or_default()
    }

    /// Records the revision a download of `repo_id` asks for (`Some`), or forgets it once the
    /// download completed (`None`). Best effort: a file that cannot be written only loses the
    /// revision a stopped download resumes at (it then resumes at the picker's).
    pub fn set_download_revision(&self, repo_id: &str, revision: Option<&str>) {
        let Ok(path) = self.downloads.lock() else {
            return;
        };
        let mut map = read_revisions(&path);
        match revision {
            Some(revision) => map.insert(repo_id.to_owned(), revision.to_owned()),
            None => map.remove(repo_id),
        };
        if let Ok(text) = serde_json::to_string_pretty(&map) {
            let temporary = path.with_extension("json.tmp");
            if std::fs::write(&temporary, text).is_ok() {
                let _ = std::fs::rename(&temporary, &*path);
            }
        }
    }

    /// The history, locked; other threads (saving answers) wait.
    pub fn history(&self) -> Result<MutexGuard<'_, History>, CommandError> {
        self.history.lock().map_err(|_| super::commands::poisoned())
    }

    /// The history, for a thread that outlives the command that started it.
    pub fn shared_history(&self) -> Arc<Mutex<History>> {
        Arc::clone(&self.history)
    }

    pub fn settings(&self) -> Result<Settings, CommandError> {
        Ok(self.lock_settings()?.clone())
    }

    /// Checks `settings` without saving them (the same rules as [`Store::save_settings`]).
    pub fn validate_settings(&self, settings: &Settings) -> Result<(), CommandError> {
        settings
            .validate(self.total_memory_bytes)
            .map_err(|e| CommandError::invalid(&e))
    }

    /// Validates and saves `settings`; on error nothing changes.
    pub fn save_settings(&self, settings: Settings) -> Result<(), CommandError> {
        let mut current = self.lock_settings()?;
        settings
            .save(&self.settings_path, self.total_memory_bytes)
            .map_err(|e| match e {
                perch_store::SettingsError::Invalid { .. } => CommandError::invalid(&e),
                _ => CommandError::storage(&e),
            })?;
        *current = settings;
        Ok(())
    }

    /// The engine configuration the settings ask for (KV budget, block size, draft model, prompt
    /// lookup, idle unload).
    /// Errors when the draft model is neither a model directory nor a downloaded Hub id.
    pub fn engine_config(&self) -> Result<EngineConfig, CommandError> {
        let settings = self.lock_settings()?;
        let draft_model = match settings.draft_model.as_deref() {
            None => None,
            Some(draft) => Some(resolve_model(draft).ok_or_else(|| {
                CommandError::invalid(&format!(
                    "The draft model {draft} is neither a model directory nor a downloaded \
                     model: change it in Settings."
                ))
            })?),
        };
        Ok(EngineConfig {
            kv_cache_bytes: settings.kv_cache_bytes,
            block_size: settings.block_size,
            draft_model,
            prompt_lookup: settings
                .prompt_lookup
                .then(perch_engine::PromptLookup::default),
            keep_alive: match settings.unload_after_idle_secs {
                Some(secs) => KeepAlive::Idle(std::time::Duration::from_secs(secs)),
                None => KeepAlive::Forever,
            },
            client_models: Some(self.client_models.clone()),
            ..EngineConfig::default()
        })
    }

    /// Tokens the draft model proposes per step (the setting).
    pub fn num_draft_tokens(&self) -> Result<usize, CommandError> {
        Ok(self.lock_settings()?.num_draft_tokens)
    }

    /// Perch's models directory: the setting, else `perch_hub::models_dir()`.
    pub fn models_dir(&self) -> Result<PathBuf, CommandError> {
        Ok(self
            .lock_settings()?
            .models_dir
            .clone()
            .unwrap_or_else(perch_hub::models_dir))
    }

    /// The machine's memory, which bounds the KV budget.
    pub fn total_memory_bytes(&self) -> u64 {
        self.total_memory_bytes
    }

    /// Problems found at start, for the UI to show once.
    pub fn notices(&self) -> Vec<String> {
        self.notices.lock().map(|n| n.clone()).unwrap_or_default()
    }

    /// Adds a problem found at start (after the store opened: the desktop hooks).
    pub fn add_notice(&self, notice: String) {
        if let Ok(mut notices) = self.notices.lock() {
            notices.push(notice);
        }
    }

    fn lock_settings(&self) -> Result<MutexGuard<'_, Settings>, CommandError> {
        self.settings
            .lock()
            .map_err(|_| super::commands::poisoned())
    }
}

/// A model directory (with `config.json`), or the snapshot of a Hub id (`org/name`) in the
/// Hugging Face cache.
fn resolve_model(model: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(model);
    if dir.join("config.json").is_file() {
        return Some(dir);
    }
    perch_hub::hf_cache_dir().and_then(|cache| perch_hub::cached_snapshot(&cache, model))
}

/// The revisions `downloads.json` at `path` records; empty when it is missing or damaged.
fn read_revisions(path: &Path) -> std::collections::BTreeMap<String, String> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use perch_engine::KeepAlive;

    use super::Store;

    /// The app's "unload the model after idle" setting is the engine's keep-alive: saved, it
    /// is what the next engine runs with; cleared, the model stays.
    #[test]
    fn the_idle_unload_setting_is_the_engines_keep_alive() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 16 << 30);
        let mut settings = store.settings().unwrap();
        settings.unload_after_idle_secs = Some(300);
        store.save_settings(settings.clone()).unwrap();
        assert_eq!(
            store.engine_config().unwrap().keep_alive,
            KeepAlive::Idle(std::time::Duration::from_secs(300))
        );
        settings.unload_after_idle_secs = None;
        store.save_settings(settings).unwrap();
        assert_eq!(
            store.engine_config().unwrap().keep_alive,
            KeepAlive::Forever
        );
        // Kept across runs.
        drop(store);
        let again = Store::open(dir.path(), 16 << 30);
        assert_eq!(again.settings().unwrap().unload_after_idle_secs, None);
    }

    /// Every engine the app loads shares one record of each client's latest model, so that a
    /// model switch explains a client's next miss.
    #[test]
    fn the_engines_share_the_clients_models() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 16 << 30);
        let models = |store: &Store| store.engine_config().unwrap().client_models.unwrap();
        let (first, second) = (models(&store), models(&store));
        assert!(std::sync::Arc::ptr_eq(&first, &second));
        first.switched("agent", "a");
        assert_eq!(second.switched("agent", "b").as_deref(), Some("a"));
    }
}
