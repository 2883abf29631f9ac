//! The user's settings: a JSON file, validated on load and on save, written atomically (a
//! temporary file renamed over the old one), so a crash never leaves half a file.

use std::io::Write;
use std::path::{Path, PathBuf};

use perch_engine::EngineConfig;
use serde::{Deserialize, Serialize};

use crate::{set_aside, ConversationSettings, SetAside};

/// Errors of [`Settings`].
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A value outside its domain; `field` is the setting's name in the file.
    #[error("setting {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("cannot read the settings {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot save the settings to {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What the user chose. Absent fields in the file take their defaults, which work on any
/// machine that can run the default model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// What new conversations start with (system prompt, sampling, max tokens).
    pub chat: ConversationSettings,
    /// Memory for the engine's KV block pool, in bytes (`EngineConfig::kv_cache_bytes`).
    pub kv_cache_bytes: usize,
    /// Tokens per KV block, the prefix cache's granularity (`EngineConfig::block_size`).
    pub block_size: usize,
    /// Where Perch keeps its own models; `None` is `perch_hub::models_dir()`.
    pub models_dir: Option<PathBuf>,
    /// Start Perch when the user logs in (macOS login item; an XDG autostart entry on Linux).
    pub launch_at_login: bool,
    /// The global shortcut that shows the chat, in Tauri's accelerator syntax
    /// (`CommandOrControl+Shift+Space`); empty for none. Its syntax is checked by the app,
    /// which owns the shortcut parser.
    pub shortcut: String,
    /// The local API server the app runs over its loaded model (`perch-server`).
    pub server: ServerSettings,
    /// Speculative decoding: a smaller model with the model's tokenizer (a directory or a
    /// downloaded Hub id) loaded beside it (`EngineConfig::draft_model`); chats then use it.
    /// `None`: no draft.
    pub draft_model: Option<String>,
    /// Tokens the draft model proposes per step (1 to 64).
    pub num_draft_tokens: usize,
    /// Prompt lookup in the batch (`EngineConfig::prompt_lookup` with its defaults): greedy
    /// chats and API requests draft from their own prompt and output. Off by default.
    pub prompt_lookup: bool,
    /// Unload the model after this many seconds with no request (`EngineConfig::keep_alive`;
    /// LM Studio's idle TTL); the next chat or request loads it again. `None`: keep it loaded.
    pub unload_after_idle_secs: Option<u64>,
    /// The app's first-run screen was finished or skipped once: it is not shown again. Set by
    /// the app alone (a settings form saved with `false` does not bring it back).
    pub first_run_done: bool,
    /// The machines a model could be divided over (`perch serve --hosts`), rank 0 first, each
    /// `host` or `user@host` reached over `ssh`; at most [`Settings::MAX_HOSTS`]. Empty: this
    /// machine alone. The app reads their memory when asked (Settings → Hosts) and then judges
    /// models against the group too.
    pub hosts: Vec<String>,
}

/// The app's local server: OpenAI- and Anthropic-compatible endpoints over the model the app
/// has loaded (the same engine as the chat window, so both are batched together). Off by
/// default; when on, it listens on 127.0.0.1 unless other devices are allowed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerSettings {
    pub enabled: bool,
    /// TCP port; 0 takes a free one when the server starts (the app shows which).
    pub port: u16,
    /// When set, requests must carry it (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    pub api_key: Option<String>,
    /// Listen on every network interface (0.0.0.0), so other devices on the network can call
    /// it; otherwise 127.0.0.1 only.
    pub allow_lan: bool,
    /// Serve the loaded model under any name a request gives (coding agents send their
    /// vendor's model names, `claude-…`, `gpt-…`); otherwise requests must name it.
    pub any_model_name: bool,
    /// Other names the loaded model answers to and `/v1/models` lists (an agent's model names,
    /// as `perch serve --alias NAME`); at most [`ServerSettings::MAX_ALIASES`].
    pub model_aliases: Vec<String>,
}

impl ServerSettings {
    /// `perch serve`'s port too.
    pub const DEFAULT_PORT: u16 = 8080;
    /// Longest API key accepted, in bytes.
    pub const MAX_KEY_BYTES: usize = 512;
    /// Most other model names, and the longest one in bytes.
    pub const MAX_ALIASES: usize = 64;
    pub const MAX_ALIAS_BYTES: usize = 256;

    /// A key must fit an HTTP header as typed: visible ASCII, no spaces, not empty; other model
    /// names are bounded in number and length, each without spaces or control characters.
    fn validate(&self) -> Result<(), SettingsError> {
        let alias = |reason: String| {
            Err(SettingsError::Invalid {
                field: "server.model_aliases",
                reason,
            })
        };
        if self.model_aliases.len() > Self::MAX_ALIASES {
            return alias(format!(
                "holds {} names, more than {}",
                self.model_aliases.len(),
                Self::MAX_ALIASES
            ));
        }
        for name in &self.model_aliases {
            if name.is_empty()
                || name.len() > Self::MAX_ALIAS_BYTES
                || name.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return alias(format!(
                    "{name:?} is not a model name: 1 to {} bytes, no spaces",
                    Self::MAX_ALIAS_BYTES
                ));
            }
        }
        let invalid = |reason: String| {
            Err(SettingsError::Invalid {
                field: "server.api_key",
                reason,
            })
        };
        match &self.api_key {
            Some(key) if key.is_empty() => invalid("is empty; leave it unset for no key".into()),
            Some(key) if key.len() > Self::MAX_KEY_BYTES => invalid(format!(
                "is {} bytes long, more than {}",
                key.len(),
                Self::MAX_KEY_BYTES
            )),
            Some(key) if !key.bytes().all(|b| b.is_ascii_graphic()) => {
                invalid("may hold visible ASCII characters only, no spaces".into())
            }
            _ => Ok(()),
        }
    }
}

impl Default for ServerSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            port: Self::DEFAULT_PORT,
            api_key: None,
            allow_lan: false,
            any_model_name: false,
            model_aliases: Vec::new(),
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            chat: ConversationSettings::default(),
            kv_cache_bytes: EngineConfig::DEFAULT_KV_CACHE_BYTES,
            block_size: EngineConfig::DEFAULT_BLOCK_SIZE,
            models_dir: None,
            launch_at_login: false,
            shortcut: "CommandOrControl+Shift+Space".into(),
            server: ServerSettings::default(),
            draft_model: None,
            num_draft_tokens: 3,
            prompt_lookup: false,
            unload_after_idle_secs: Some(perch_engine::KeepAlive::DEFAULT_IDLE.as_secs()),
            first_run_done: false,
            hosts: Vec::new(),
        }
    }
}

impl ConversationSettings {
    /// Most tokens one answer may ask for.
    pub const MAX_TOKENS_LIMIT: usize = 1 << 20;

    /// Checks the sampling parameters (those that need the vocabulary are checked again by
    /// the engine) and `max_tokens`; fields are named as in the settings file (`chat.*`).
    pub fn validate(&self) -> Result<(), SettingsError> {
        let invalid = |field, reason: String| Err(SettingsError::Invalid { field, reason });
        if let Err(err) = self.sampling.validate(usize::MAX) {
            return invalid("chat.sampling", err.to_string());
        }
        if !(1..=Self::MAX_TOKENS_LIMIT).contains(&self.max_tokens) {
            return invalid(
                "chat.max_tokens",
                format!(
                    "must be between 1 and {}, got {}",
                    Self::MAX_TOKENS_LIMIT,
                    self.max_tokens
                ),
            );
        }
        if let Some(size) = self.max_kv_size {
            if size <= 4 {
                return invalid(
                    "chat.max_kv_size",
                    format!("must be more than the 4 positions always kept, got {size}"),
                );
            }
            if self.kv_bits.is_some() {
                return invalid(
                    "chat.kv_bits",
                    "cannot be combined with max_kv_size (a bounded KV cache is not quantized)"
                        .into(),
                );
            }
        }
        if let Some(bits) = self.kv_bits {
            if ![2, 3, 4, 5, 6, 8].contains(&bits) {
                return invalid(
                    "chat.kv_bits",
                    format!("must be 2, 3, 4, 5, 6 or 8, got {bits}"),
                );
            }
        }
        Ok(())
    }
}

impl Settings {
    /// Smallest KV budget accepted: 16 MiB, ~360 tokens of SmolLM2-135M in float32.
    pub const MIN_KV_CACHE_BYTES: usize = 16 << 20;
    /// Idle times accepted for [`Settings::unload_after_idle_secs`]: a minute to 30 days.
    pub const IDLE_UNLOAD_SECS: std::ops::RangeInclusive<u64> = 60..=30 * 24 * 3600;
    /// Block sizes accepted: powers of two in this range.
    pub const BLOCK_SIZES: std::ops::RangeInclusive<usize> = 8..=256;
    /// Most hosts [`Settings::hosts`] lists.
    pub const MAX_HOSTS: usize = 64;
    /// Checks every value; `total_memory_bytes` (the machine's RAM) bounds the KV budget.
    pub fn validate(&self, total_memory_bytes: u64) -> Result<(), SettingsError> {
        let invalid = |field, reason: String| Err(SettingsError::Invalid { field, reason });
        self.chat.validate()?;
        if self.kv_cache_bytes < Self::MIN_KV_CACHE_BYTES {
            return invalid(
                "kv_cache_bytes",
                format!(
                    "must be at least {} MiB, got {} bytes",
                    Self::MIN_KV_CACHE_BYTES >> 20,
                    self.kv_cache_bytes
                ),
            );
        }
        if self.kv_cache_bytes as u64 > total_memory_bytes {
            return invalid(
                "kv_cache_bytes",
                format!(
                    "{} MiB is more than this machine's {} MiB of memory",
                    self.kv_cache_bytes >> 20,
                    total_memory_bytes >> 20
                ),
            );
        }
        if !Self::BLOCK_SIZES.contains(&self.block_size) || !self.block_size.is_power_of_two() {
            return invalid(
                "block_size",
                format!(
                    "must be a power of two from {} to {}, got {}",
                    Self::BLOCK_SIZES.start(),
                    Self::BLOCK_SIZES.end(),
                    self.block_size
                ),
            );
        }
        if let Some(dir) = &self.models_dir {
            if !dir.is_absolute() {
                return invalid(
                    "models_dir",
                    format!("must be an absolute path, got {}", dir.display()),
                );
            }
        }
        if let Some(secs) = self.unload_after_idle_secs {
            if !Self::IDLE_UNLOAD_SECS.contains(&secs) {
                return invalid(
                    "unload_after_idle_secs",
                    format!(
                        "must be {} to {} seconds (a minute to 30 days), got {secs}; leave it \
                         unset to keep the model loaded",
                        Self::IDLE_UNLOAD_SECS.start(),
                        Self::IDLE_UNLOAD_SECS.end()
                    ),
                );
            }
        }
        if !(1..=64).contains(&self.num_draft_tokens) {
            return invalid(
                "num_draft_tokens",
                format!("must be 1 to 64, got {}", self.num_draft_tokens),
            );
        }
        if self
            .draft_model
            .as_deref()
            .is_some_and(|d| d.trim().is_empty())
        {
            return invalid(
                "draft_model",
                "is empty; leave it unset for no draft".into(),
            );
        }
        if self.hosts.len() > Self::MAX_HOSTS {
            return invalid(
                "hosts",
                format!(
                    "at most {} hosts, got {}",
                    Self::MAX_HOSTS,
                    self.hosts.len()
                ),
            );
        }
        if let Some(why) = self
            .hosts
            .iter()
            .find_map(|h| perch_hub::hosts::Host::parse(h).err())
        {
            return invalid("hosts", why);
        }
        self.server.validate()
    }

    /// Reads the settings at `path`; a missing file gives the defaults. A file that is not
    /// valid JSON or holds invalid values is renamed to `<path>.invalid-<unix ms>` (the
    /// [`SetAside`] says why) and the defaults are used. Fails only when the file exists but
    /// cannot be read or moved.
    pub fn load(
        path: &Path,
        total_memory_bytes: u64,
    ) -> Result<(Settings, Option<SetAside>), SettingsError> {
        let read_error = |source| SettingsError::Read {
            path: path.to_owned(),
            source,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                return Ok((Settings::default(), None))
            }
            Err(err) => return Err(read_error(err)),
        };
        let problem = match serde_json::from_str::<Settings>(&text) {
            Ok(settings) => match settings.validate(total_memory_bytes) {
                Ok(()) => return Ok((settings, None)),
                Err(err) => err.to_string(),
            },
            Err(err) => format!("not valid settings JSON: {err}"),
        };
        let moved_to = set_aside(path, "invalid", &[]).map_err(read_error)?;
        Ok((
            Settings::default(),
            Some(SetAside {
                moved_to,
                reason: problem,
            }),
        ))
    }

    /// Validates and writes the settings to `path`: a temporary file in the same folder,
    /// flushed to disk, then renamed over `path`. On error the old file is unchanged.
    pub fn save(&self, path: &Path, total_memory_bytes: u64) -> Result<(), SettingsError> {
        self.validate(total_memory_bytes)?;
        let write_error = |source| SettingsError::Write {
            path: path.to_owned(),
            source,
        };
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(write_error)?;
        let mut file = tempfile::NamedTempFile::new_in(dir).map_err(write_error)?;
        let json = serde_json::to_string_pretty(self).map_err(|e| write_error(e.into()))?;
        file.write_all(json.as_bytes()).map_err(write_error)?;
        file.as_file().sync_all().map_err(write_error)?;
        file.persist(path).map_err(|e| write_error(e.error))?;
        // The rename itself is durable once the folder is synced (POSIX).
        #[cfg(unix)]
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(write_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RAM: u64 = 16 << 30;

    #[test]
    fn defaults_are_valid_and_a_missing_file_gives_them() {
        Settings::default().validate(RAM).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (settings, set_aside) = Settings::load(&dir.path().join("settings.json"), RAM).unwrap();
        assert_eq!((settings, set_aside), (Settings::default(), None));
    }

    #[test]
    fn saved_settings_load_back_and_absent_fields_take_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/settings.json");
        let mut settings = Settings::default();
        settings.chat.sampling.temperature = 0.8;
        settings.chat.system_prompt = "Be brief.".into();
        settings.block_size = 16;
        settings.prompt_lookup = true;
        settings.models_dir = Some(dir.path().join("models"));
        settings.server = ServerSettings {
            enabled: true,
            port: 1234,
            api_key: Some("sk-local".into()),
            allow_lan: true,
            any_model_name: true,
            model_aliases: vec!["claude-sonnet-4-5".into(), "gpt-4o".into()],
        };
        settings.save(&path, RAM).unwrap();
        assert_eq!(Settings::load(&path, RAM).unwrap(), (settings, None));

        std::fs::write(&path, r#"{"block_size": 64}"#).unwrap();
        let (partial, set_aside) = Settings::load(&path, RAM).unwrap();
        assert_eq!(set_aside, None);
        assert_eq!(partial.block_size, 64);
        assert_eq!(partial.kv_cache_bytes, Settings::default().kv_cache_bytes);
        assert!(
            !partial.server.enabled,
            "the local server is off unless turned on"
        );
        assert_eq!(partial.server.port, 8080);
        assert!(
            !partial.prompt_lookup,
            "prompt lookup is off unless turned on"
        );
    }

    #[test]
    fn invalid_values_are_named() {
        type Case = (&'static str, fn(&mut Settings));
        let cases: [Case; 24] = [
            ("chat.sampling", |s| s.chat.sampling.temperature = -1.0),
            ("unload_after_idle_secs", |s| {
                s.unload_after_idle_secs = Some(5)
            }),
            ("unload_after_idle_secs", |s| {
                s.unload_after_idle_secs = Some(u64::MAX)
            }),
            ("chat.max_kv_size", |s| s.chat.max_kv_size = Some(4)),
            ("chat.kv_bits", |s| s.chat.kv_bits = Some(7)),
            ("chat.kv_bits", |s| {
                s.chat.max_kv_size = Some(64);
                s.chat.kv_bits = Some(8);
            }),
            ("num_draft_tokens", |s| s.num_draft_tokens = 0),
            ("num_draft_tokens", |s| s.num_draft_tokens = 65),
            ("draft_model", |s| s.draft_model = Some(" ".into())),
            ("chat.max_tokens", |s| s.chat.max_tokens = 0),
            ("kv_cache_bytes", |s| s.kv_cache_bytes = 1 << 20),
            ("kv_cache_bytes", |s| s.kv_cache_bytes = 32 << 30),
            ("block_size", |s| s.block_size = 48),
            ("block_size", |s| s.block_size = 512),
            ("models_dir", |s| {
                s.models_dir = Some("relative/models".into())
            }),
            ("server.api_key", |s| s.server.api_key = Some(String::new())),
            ("server.api_key", |s| {
                s.server.api_key = Some("two words".into())
            }),
            ("server.api_key", |s| {
                s.server.api_key = Some("k".repeat(513))
            }),
            ("server.model_aliases", |s| {
                s.server.model_aliases = vec!["gpt 4o".into()]
            }),
            ("server.model_aliases", |s| {
                s.server.model_aliases = vec![String::new()]
            }),
            ("server.model_aliases", |s| {
                s.server.model_aliases = vec!["m".into(); 65]
            }),
            ("hosts", |s| {
                s.hosts = vec!["studio.local".into(), "-oProxyCommand=x".into()]
            }),
            ("hosts", |s| s.hosts = vec!["a b".into()]),
            ("hosts", |s| s.hosts = vec!["h".into(); 65]),
        ];
        for (field, break_it) in cases {
            let mut settings = Settings::default();
            break_it(&mut settings);
            match settings.validate(RAM) {
                Err(SettingsError::Invalid { field: got, .. }) => assert_eq!(got, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        let group = Settings {
            hosts: vec!["me@studio.local".into(), "10.0.0.2".into()],
            ..Settings::default()
        };
        group.validate(RAM).unwrap();
    }

    #[test]
    fn saving_invalid_settings_leaves_the_file_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settings.json");
        Settings::default().save(&path, RAM).unwrap();
        let before = std::fs::read(&path).unwrap();
        let bad = Settings {
            block_size: 3,
            ..Default::default()
        };
        assert!(bad.save(&path, RAM).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn broken_files_are_set_aside_not_overwritten() {
        for (contents, why) in [
            (r#"{"block_size": "#, "not valid settings JSON"),
            (r#"{"block_size": 3}"#, "block_size"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("settings.json");
            std::fs::write(&path, contents).unwrap();
            let (settings, set_aside) = Settings::load(&path, RAM).unwrap();
            assert_eq!(settings, Settings::default());
            let set_aside = set_aside.expect("set aside");
            assert!(set_aside.reason.contains(why), "{}", set_aside.reason);
            assert_eq!(
                std::fs::read_to_string(&set_aside.moved_to).unwrap(),
                contents
            );
            assert!(!path.exists());
        }
    }
}
