//! Conversations and their messages in SQLite (WAL mode, `synchronous = FULL`): a message is
//! on disk when [`History::save_answer`] or [`History::begin_turn`] returns, so a crash or
//! `kill -9` afterwards loses nothing that was shown as finished.

use std::path::{Path, PathBuf};

use perch_engine::sample::generation_config::{SamplingDefaults, SamplingDefaultsSource};
use perch_engine::sample::sampler::SamplingParams;
use perch_engine::{ChatMessage, ContentPart, FinishReason, GenerationStats};
use rusqlite::{params, Connection, ErrorCode, OptionalExtension, Transaction};
use serde::{Deserialize, Serialize};

use crate::{set_aside, unix_millis, SetAside};

/// The layout this code reads and writes (SQLite's `user_version`).
/// 2 added `messages.sampling`, 3 the `images` table.
const SCHEMA_VERSION: i32 = 3;

const SCHEMA: &str = "
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY,
    title TEXT,                  -- NULL: the first user message stands for it
    settings TEXT NOT NULL,      -- ConversationSettings as JSON
    created_at INTEGER NOT NULL, -- Unix milliseconds
    updated_at INTEGER NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    finish_reason TEXT,          -- answers only: stop | length | cancelled | error
    stats TEXT,                  -- answers only: GenerationStats as JSON
    error TEXT,                  -- answers that failed: the sentence shown
    created_at INTEGER NOT NULL,
    sampling TEXT                -- answers only: AnswerSampling as JSON (layout 2 on)
);
CREATE INDEX messages_by_conversation ON messages (conversation_id, id);
";

/// The images attached to messages (layout 3 on; a fresh history gets it after [`SCHEMA`]).
const IMAGES_TABLE: &str = "
CREATE TABLE images (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,   -- its order among the message's images
    digest TEXT NOT NULL,        -- SHA-256 of the file's bytes, hex: its name in the images folder
    media_type TEXT NOT NULL,    -- image/png | image/jpeg | image/webp | image/gif
    PRIMARY KEY (message_id, position)
);
CREATE INDEX images_by_digest ON images (digest);
";

/// The image formats a message may carry.
const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/webp", "image/gif"];
/// The most images one message may carry, and the largest one (as the engine takes them).
const MAX_IMAGES: usize = perch_engine::image_processor::MAX_IMAGES;
const MAX_IMAGE_BYTES: usize = perch_engine::image_processor::MAX_IMAGE_BYTES;

/// Title shown for a conversation with no title and no user message yet.
const UNTITLED: &str = "New chat";

/// Errors of [`History`].
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("cannot create the folder of the chat history {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the chat history at {path} cannot be used: {reason}")]
    Unusable { path: PathBuf, reason: String },
    #[error("cannot open the chat history at {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error(
        "the chat history at {path} was written by a newer Perch (layout {found}; this one reads \
         {SCHEMA_VERSION}); it was left untouched"
    )]
    NewerSchema { path: PathBuf, found: i32 },
    #[error("the chat history at {path} is damaged and could not be moved aside: {source}")]
    SetAside {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("chat history: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("conversation {0} does not exist")]
    NoSuchConversation(i64),
    #[error("a message cannot be empty")]
    EmptyMessage,
    #[error("{0}")]
    BadImage(String),
    #[error("cannot keep an attached image in {path}: {source}")]
    ImageFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the conversation has no user message to answer")]
    NoUserMessage,
    #[error("stored {what} is not valid JSON: {source}")]
    BadJson {
        what: &'static str,
        source: serde_json::Error,
    },
}

type Result<T> = std::result::Result<T, HistoryError>;

/// Who wrote a message. The system prompt is a [`ConversationSettings`] field, not a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// How a conversation is answered; each conversation keeps its own copy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "StoredConversationSettings")]
pub struct ConversationSettings {
    /// Sent first as the `system` message; empty sends none.
    pub system_prompt: String,
    /// Whether answers sample with the loaded model's defaults or with `sampling`'s values.
    pub sampling_source: SamplingSource,
    /// With [`SamplingSource::Model`], only its seed, logit bias and presence and frequency
    /// penalties are used (see [`ConversationSettings::effective_sampling`]).
    pub sampling: SamplingParams,
    /// Most tokens per answer.
    pub max_tokens: usize,
    /// Bound the answer's KV cache to this many positions, the first 4 and the most recent
    /// (mlx_lm's `--max-kv-size`); `None`: unbounded.
    #[serde(default)]
    pub max_kv_size: Option<usize>,
    /// Quantize the answer's KV cache to this many bits (group size 64) once it holds
    /// `quantized_kv_start` positions (mlx_lm's `--kv-bits`); `None`: full precision.
    #[serde(default)]
    pub kv_bits: Option<i32>,
    pub quantized_kv_start: usize,
}

/// Where a conversation's temperature, top-p, top-k, min-p and repetition penalty come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplingSource {
    /// The loaded model's defaults ([`SamplingDefaults`]: its `generation_config.json`'s, else
    /// Perch's), whichever model answers.
    #[default]
    Model,
    /// The conversation's own values.
    Custom,
}

/// The sampling an answer was generated with, as sent to the engine, and where its values came
/// from. Kept with the answer in the history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AnswerSampling {
    pub params: SamplingParams,
    pub source: AnswerSamplingSource,
}

/// Where an answer's sampling values came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerSamplingSource {
    /// The model's `generation_config.json`.
    Model,
    /// Perch's defaults (the model names none).
    Perch,
    /// The conversation's own values.
    Custom,
}

impl Default for ConversationSettings {
    fn default() -> Self {
        Self {
            system_prompt: String::new(),
            sampling_source: SamplingSource::Model,
            sampling: SamplingParams::default(),
            max_tokens: 1024,
            max_kv_size: None,
            kv_bits: None,
            quantized_kv_start: 5000,
        }
    }
}

impl ConversationSettings {
    /// The sampling an answer uses when `defaults` are the loaded model's: with
    /// [`SamplingSource::Model`], `sampling` with `defaults`' values in place of its five;
    /// with [`SamplingSource::Custom`], `sampling` as it is.
    pub fn effective_sampling(&self, defaults: &SamplingDefaults) -> AnswerSampling {
        match self.sampling_source {
            SamplingSource::Custom => AnswerSampling {
                params: self.sampling.clone(),
                source: AnswerSamplingSource::Custom,
            },
            SamplingSource::Model => AnswerSampling {
                params: defaults.apply_to(&self.sampling),
                source: match defaults.source {
                    SamplingDefaultsSource::Model => AnswerSamplingSource::Model,
                    SamplingDefaultsSource::Perch => AnswerSamplingSource::Perch,
                },
            },
        }
    }
}

/// [`ConversationSettings`] as stored (JSON in the history and the settings file): fields may be
/// missing. Settings saved before `sampling_source` existed follow the model when their sampling
/// was the old default, greedy decoding (what every conversation started with, and what made
/// small models loop), and keep their values otherwise.
#[derive(Deserialize)]
#[serde(default)]
struct StoredConversationSettings {
    system_prompt: String,
    sampling_source: Option<SamplingSource>,
    sampling: SamplingParams,
    max_tokens: usize,
    max_kv_size: Option<usize>,
    kv_bits: Option<i32>,
    quantized_kv_start: usize,
}

impl Default for StoredConversationSettings {
    fn default() -> Self {
        let settings = ConversationSettings::default();
        Self {
            system_prompt: settings.system_prompt,
            sampling_source: None,
            sampling: settings.sampling,
            max_tokens: settings.max_tokens,
            max_kv_size: settings.max_kv_size,
            kv_bits: settings.kv_bits,
            quantized_kv_start: settings.quantized_kv_start,
        }
    }
}

impl From<StoredConversationSettings> for ConversationSettings {
    fn from(stored: StoredConversationSettings) -> Self {
        let sampling_source = stored.sampling_source.unwrap_or_else(|| {
            let greedy = SamplingParams {
                seed: stored.sampling.seed,
                ..SamplingParams::default()
            };
            if stored.sampling == greedy {
                SamplingSource::Model
            } else {
                SamplingSource::Custom
            }
        });
        Self {
            system_prompt: stored.system_prompt,
            sampling_source,
            sampling: stored.sampling,
            max_tokens: stored.max_tokens,
            max_kv_size: stored.max_kv_size,
            kv_bits: stored.kv_bits,
            quantized_kv_start: stored.quantized_kv_start,
        }
    }
}

/// One row of the conversations list.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ConversationSummary {
    pub id: i64,
    /// The title given, else the start of the first user message, else "New chat".
    pub title: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub message_count: usize,
}

/// A conversation with its settings and messages in order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Conversation {
    #[serde(flatten)]
    pub summary: ConversationSummary,
    pub settings: ConversationSettings,
    pub messages: Vec<Message>,
}

/// One saved message. Answers carry why they ended and their stats.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub id: i64,
    pub role: Role,
    pub content: String,
    pub finish_reason: Option<FinishReason>,
    pub stats: Option<GenerationStats>,
    pub error: Option<String>,
    pub created_at_ms: i64,
    /// Answers only: the sampling it was generated with (`None` for answers saved before
    /// Perch recorded it).
    pub sampling: Option<AnswerSampling>,
    /// The images the user attached, in order, as data URLs (`data:image/png;base64,…`).
    pub images: Vec<String>,
}

/// An image attached to a message, as the app sends it: its media type (`image/png`,
/// `image/jpeg`, `image/webp`, `image/gif`) and its bytes in base64.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Attachment {
    pub media_type: String,
    pub data: String,
}

/// What the user asks for next in a conversation.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Turn {
    /// A new user message, with the images attached to it.
    Send {
        content: String,
        #[serde(default)]
        images: Vec<Attachment>,
    },
    /// Answer the last user message again (the answers after it are deleted).
    Regenerate,
    /// Replace the last user message (and delete the answers after it), then answer it.
    EditLast { content: String },
}

/// The chat history of the app: conversations and their messages, and the images attached to
/// them as files named by their SHA-256 in a folder beside the database (`images/`), each kept
/// once however many messages carry it and removed with the last of them.
pub struct History {
    conn: Connection,
    images: ImageFiles,
}

/// Where a history keeps its images.
enum ImageFiles {
    Dir(PathBuf),
    /// An in-memory history's, gone with it.
    Temp(tempfile::TempDir),
}

impl ImageFiles {
    /// The folder beside the database at `path`.
    fn beside(path: &Path) -> Self {
        let parent = path.parent().filter(|d| !d.as_os_str().is_empty());
        ImageFiles::Dir(parent.unwrap_or(Path::new(".")).join("images"))
    }

    fn dir(&self) -> &Path {
        match self {
            ImageFiles::Dir(dir) => dir,
            ImageFiles::Temp(dir) => dir.path(),
        }
    }
}

/// Why an existing file cannot be used as the history, when setting it aside is the fix.
struct Damage(String);

enum OpenFailure {
    Damaged(Damage),
    Fatal(HistoryError),
}

impl From<HistoryError> for OpenFailure {
    fn from(err: HistoryError) -> Self {
        OpenFailure::Fatal(err)
    }
}

impl History {
    /// Opens (or creates) the history at `path`. A file that is not a readable Perch history
    /// (corrupt pages, not SQLite, someone else's tables) is renamed to
    /// `<path>.corrupt-<unix ms>` with its `-wal`/`-shm` files, a fresh history is started, and
    /// the [`SetAside`] says so. A history from a newer Perch is an error and left untouched.
    pub fn open(path: &Path) -> Result<(History, Option<SetAside>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| HistoryError::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        match Self::open_checked(path) {
            Ok(history) => Ok((history, None)),
            Err(OpenFailure::Fatal(err)) => Err(err),
            Err(OpenFailure::Damaged(Damage(reason))) => {
                let moved_to = set_aside(path, "corrupt", &["-wal", "-shm"]).map_err(|source| {
                    HistoryError::SetAside {
                        path: path.to_owned(),
                        source,
                    }
                })?;
                let history = match Self::open_checked(path) {
                    Ok(history) => history,
                    Err(OpenFailure::Fatal(err)) => return Err(err),
                    Err(OpenFailure::Damaged(Damage(reason))) => {
                        return Err(HistoryError::Unusable {
                            path: path.to_owned(),
                            reason,
                        })
                    }
                };
                Ok((history, Some(SetAside { moved_to, reason })))
            }
        }
    }

    /// A history that lives only in memory (when the file cannot be opened at all).
    pub fn in_memory() -> Result<History> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch("PRAGMA foreign_keys = ON;")?;
        conn.execute_batch(SCHEMA)?;
        conn.execute_batch(IMAGES_TABLE)?;
        let dir = tempfile::tempdir().map_err(|source| HistoryError::ImageFile {
            path: std::env::temp_dir(),
            source,
        })?;
        Ok(History {
            conn,
            images: ImageFiles::Temp(dir),
        })
    }

    fn open_checked(path: &Path) -> std::result::Result<History, OpenFailure> {
        let fatal = |source| {
            OpenFailure::Fatal(HistoryError::Open {
                path: path.to_owned(),
                source,
            })
        };
        let conn = Connection::open(path).map_err(fatal)?;
        // Read before anything is written: a file that is not a database fails here, and a
        // newer layout is left byte for byte as it was.
        let version: i32 = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .map_err(|e| classify(e, path))?;
        if version > SCHEMA_VERSION {
            return Err(OpenFailure::Fatal(HistoryError::NewerSchema {
                path: path.to_owned(),
                found: version,
            }));
        }
        let check: String = conn
            .query_row("PRAGMA quick_check", [], |row| row.get(0))
            .map_err(|e| classify(e, path))?;
        if check != "ok" {
            return Err(OpenFailure::Damaged(Damage(format!(
                "SQLite's check found: {check}"
            ))));
        }
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
            .map_err(|e| classify(e, path))?;
        if version == 0 && tables > 0 {
            return Err(OpenFailure::Damaged(Damage(
                "it holds tables that are not Perch's chat history".into(),
            )));
        }
        // The first write: only now that the file is known to be ours.
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;
             PRAGMA busy_timeout = 5000;",
        )
        .map_err(|e| classify(e, path))?;
        if version == 0 {
            conn.execute_batch(&format!(
                "BEGIN; {SCHEMA} {IMAGES_TABLE} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
            ))
            .map_err(fatal)?;
        } else {
            if version == 1 {
                // Layout 1 → 2: answers saved before have no sampling recorded.
                conn.execute_batch(
                    "BEGIN; ALTER TABLE messages ADD COLUMN sampling TEXT; PRAGMA user_version = 2; COMMIT;",
                )
                .map_err(|e| classify(e, path))?;
            }
            if version <= 2 {
                // Layout 2 → 3: messages saved before have no images.
                conn.execute_batch(&format!(
                    "BEGIN; {IMAGES_TABLE} PRAGMA user_version = 3; COMMIT;"
                ))
                .map_err(|e| classify(e, path))?;
            }
        }
        let history = History {
            conn,
            images: ImageFiles::beside(path),
        };
        // Every query this code runs must compile against the tables found.
        for sql in [LIST_SQL, MESSAGES_SQL, SETTINGS_SQL, IMAGES_SQL] {
            if let Err(err) = history.conn.prepare(sql) {
                return Err(OpenFailure::Damaged(Damage(format!(
                    "its tables do not have Perch's layout ({err})"
                ))));
            }
        }
        Ok(history)
    }

    /// Starts an empty conversation with `settings`.
    pub fn create_conversation(
        &mut self,
        settings: &ConversationSettings,
    ) -> Result<ConversationSummary> {
        let now = activity_stamp(&self.conn)?;
        self.conn.execute(
            "INSERT INTO conversations (title, settings, created_at, updated_at)
             VALUES (NULL, ?1, ?2, ?2)",
            params![to_json(settings)?, now],
        )?;
        let id = self.conn.last_insert_rowid();
        self.summary(id)
    }

    /// Conversations, most recently active first. A non-empty `search` keeps those whose title
    /// or any message contains it (case-insensitive for ASCII letters).
    pub fn conversations(&self, search: &str) -> Result<Vec<ConversationSummary>> {
        let search = search.trim();
        let pattern = (!search.is_empty()).then(|| format!("%{}%", escape_like(search)));
        let mut statement = self.conn.prepare(LIST_SQL)?;
        let rows = statement.query_map(params![pattern, None::<i64>], summary_from_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// One conversation with its messages.
    pub fn conversation(&self, id: i64) -> Result<Conversation> {
        let summary = self.summary(id)?;
        let settings = self.settings(id)?;
        let mut statement = self.conn.prepare(MESSAGES_SQL)?;
        let mut messages: Vec<Message> = statement
            .query_map([id], message_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        for message in messages.iter_mut().filter(|m| m.role == Role::User) {
            message.images = self.images_of(message.id)?;
        }
        Ok(Conversation {
            summary,
            settings,
            messages,
        })
    }

    /// Gives conversation `id` a title; an empty one goes back to the first user message.
    pub fn rename(&mut self, id: i64, title: &str) -> Result<ConversationSummary> {
        let title = Some(title.trim()).filter(|t| !t.is_empty());
        let changed = self.conn.execute(
            "UPDATE conversations SET title = ?2 WHERE id = ?1",
            params![id, title],
        )?;
        if changed == 0 {
            return Err(HistoryError::NoSuchConversation(id));
        }
        self.summary(id)
    }

    /// Replaces the settings of conversation `id`; later answers use them.
    pub fn set_settings(&mut self, id: i64, settings: &ConversationSettings) -> Result<()> {
        let changed = self.conn.execute(
            "UPDATE conversations SET settings = ?2 WHERE id = ?1",
            params![id, to_json(settings)?],
        )?;
        if changed == 0 {
            return Err(HistoryError::NoSuchConversation(id));
        }
        Ok(())
    }

    /// Deletes conversation `id` and its messages.
    pub fn delete(&mut self, id: i64) -> Result<()> {
        let digests = self.digests_of(id)?;
        let changed = self
            .conn
            .execute("DELETE FROM conversations WHERE id = ?1", [id])?;
        if changed == 0 {
            return Err(HistoryError::NoSuchConversation(id));
        }
        self.remove_unused_images(&digests)
    }

    /// The digests of the images conversation `id`'s messages carry.
    fn digests_of(&self, id: i64) -> Result<Vec<String>> {
        let mut statement = self.conn.prepare(
            "SELECT DISTINCT i.digest FROM images i JOIN messages m ON m.id = i.message_id
             WHERE m.conversation_id = ?1",
        )?;
        let rows = statement.query_map([id], |row| row.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Removes the files of those of `digests` no message carries any more (a file that
    /// cannot be removed stays: it is unreferenced, not lost).
    fn remove_unused_images(&self, digests: &[String]) -> Result<()> {
        for digest in digests {
            let used: i64 = self.conn.query_row(
                "SELECT count(*) FROM images WHERE digest = ?1",
                [digest],
                |row| row.get(0),
            )?;
            if let Some(path) = self.image_path(digest).filter(|_| used == 0) {
                let _ = std::fs::remove_file(path);
            }
        }
        Ok(())
    }

    /// Writes `attachments` to the images folder (each under its SHA-256; a file already there
    /// is that image already) after checking them all; returns their digests and those of the
    /// files this call wrote. On disk (files and folder synced) when this returns.
    fn keep_images(&self, attachments: &[Attachment]) -> Result<(Vec<String>, Vec<String>)> {
        use base64::Engine as _;
        use sha2::{Digest, Sha256};
        if attachments.len() > MAX_IMAGES {
            return Err(HistoryError::BadImage(format!(
                "{} images in one message; the most is {MAX_IMAGES}",
                attachments.len()
            )));
        }
        // Every image checked before any is written.
        let mut decoded = Vec::with_capacity(attachments.len());
        for attachment in attachments {
            if !IMAGE_TYPES.contains(&attachment.media_type.as_str()) {
                return Err(HistoryError::BadImage(format!(
                    "images of type {} cannot be attached: use PNG, JPEG, WebP or GIF",
                    attachment.media_type
                )));
            }
            if attachment.data.len() > MAX_IMAGE_BYTES / 3 * 4 + 4 {
                return Err(HistoryError::BadImage(format!(
                    "an image larger than {} MB cannot be attached",
                    MAX_IMAGE_BYTES >> 20
                )));
            }
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(attachment.data.trim())
                .map_err(|e| HistoryError::BadImage(format!("the image's data is damaged: {e}")))?;
            let digest: String = Sha256::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            decoded.push((digest, bytes));
        }
        let dir = self.images.dir();
        let file_error = |path: &Path| {
            let path = path.to_owned();
            move |source| HistoryError::ImageFile { path, source }
        };
        let mut written = Vec::new();
        let mut write_all = || -> Result<()> {
            for (digest, bytes) in &decoded {
                let path = dir.join(digest);
                if path.exists() {
                    continue;
                }
                std::fs::create_dir_all(dir).map_err(file_error(dir))?;
                let mut file = tempfile::NamedTempFile::new_in(dir).map_err(file_error(dir))?;
                std::io::Write::write_all(&mut file, bytes).map_err(file_error(&path))?;
                file.as_file().sync_all().map_err(file_error(&path))?;
                file.persist(&path).map_err(|e| HistoryError::ImageFile {
                    path: path.clone(),
                    source: e.error,
                })?;
                written.push(digest.clone());
            }
            // The names too, before the rows that point at them are committed.
            #[cfg(unix)]
            if !written.is_empty() {
                std::fs::File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(file_error(dir))?;
            }
            Ok(())
        };
        if let Err(err) = write_all() {
            let _ = self.remove_unused_images(&written);
            return Err(err);
        }
        Ok((decoded.into_iter().map(|(d, _)| d).collect(), written))
    }

    /// The file of the image whose digest is `digest`, when it is one (64 lowercase hex digits:
    /// a name inside the folder, whatever the database holds).
    fn image_path(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.len() == 64
            && digest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        hex.then(|| self.images.dir().join(digest))
    }

    /// The images message `id` carries, as data URLs.
    fn images_of(&self, id: i64) -> Result<Vec<String>> {
        use base64::Engine as _;
        let mut statement = self.conn.prepare(IMAGES_SQL)?;
        let rows = statement.query_map([id], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, String>(1)?))
        })?;
        let mut urls = Vec::new();
        for row in rows {
            let (digest, media_type) = row?;
            let Some(path) = self.image_path(&digest) else {
                continue;
            };
            // A file gone (removed by hand, lost in a crash) is an image the message no longer
            // shows, not a conversation that cannot be read.
            let bytes = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => return Err(HistoryError::ImageFile { path, source }),
            };
            urls.push(format!(
                "data:{media_type};base64,{}",
                base64::engine::general_purpose::STANDARD.encode(bytes)
            ));
        }
        Ok(urls)
    }

    /// The rows of `turn` in one transaction (`digests`: the sent message's images' files).
    fn apply_turn(&mut self, id: i64, turn: &Turn, digests: &[String]) -> Result<()> {
        let tx = self.conn.transaction()?;
        let last_user: Option<i64> = tx
            .query_row(
                "SELECT max(id) FROM messages WHERE conversation_id = ?1 AND role = 'user'",
                [id],
                |row| row.get(0),
            )
            .optional()?
            .flatten();
        let now = unix_millis();
        match turn {
            Turn::Send { content, images } => {
                // A message of images only is not empty.
                let content = match images.is_empty() {
                    true => non_empty(content)?,
                    false => content.as_str(),
                };
                let message = insert_message(&tx, id, Role::User, content, now)?;
                for (position, (digest, image)) in digests.iter().zip(images).enumerate() {
                    tx.execute(
                        "INSERT INTO images (message_id, position, digest, media_type)
                         VALUES (?1, ?2, ?3, ?4)",
                        params![message, position as i64, digest, image.media_type],
                    )?;
                }
            }
            Turn::Regenerate => {
                let last_user = last_user.ok_or(HistoryError::NoUserMessage)?;
                delete_after(&tx, id, last_user)?;
            }
            Turn::EditLast { content } => {
                let content = non_empty(content)?;
                let last_user = last_user.ok_or(HistoryError::NoUserMessage)?;
                delete_after(&tx, id, last_user)?;
                tx.execute(
                    "UPDATE messages SET content = ?2, created_at = ?3 WHERE id = ?1",
                    params![last_user, content, now],
                )?;
            }
        }
        touch(&tx, id, now)?;
        tx.commit()?;
        Ok(())
    }

    /// Applies `turn` to conversation `id` in one transaction and returns its settings and the
    /// messages to answer (the system prompt first; answers that failed are left out).
    pub fn begin_turn(
        &mut self,
        id: i64,
        turn: &Turn,
    ) -> Result<(ConversationSettings, Vec<ChatMessage>)> {
        // The files first: a message is never saved without its images. A turn that fails after
        // them removes those it wrote.
        let (digests, written) = match turn {
            Turn::Send { images, .. } => self.keep_images(images)?,
            _ => (Vec::new(), Vec::new()),
        };
        if let Err(err) = self.apply_turn(id, turn, &digests) {
            let _ = self.remove_unused_images(&written);
            return Err(err);
        }
        let conversation = self.conversation(id)?;
        let system = Some(conversation.settings.system_prompt.trim())
            .filter(|s| !s.is_empty())
            .map(|s| ChatMessage::new("system", s));
        let messages = system
            .into_iter()
            .chain(
                conversation
                    .messages
                    .iter()
                    .filter(|m| m.finish_reason != Some(FinishReason::Error))
                    .map(|m| match m.images.is_empty() {
                        true => ChatMessage::new(m.role.as_str(), m.content.clone()),
                        // The images before the text, as chat apps send them.
                        false => ChatMessage::from_parts(
                            m.role.as_str(),
                            m.images
                                .iter()
                                .map(|url| ContentPart::Image(url.clone()))
                                .chain([ContentPart::Text(m.content.clone())])
                                .collect(),
                        ),
                    }),
            )
            .collect();
        Ok((conversation.settings, messages))
    }

    /// Saves the answer to the last user message of conversation `id` (also a cancelled or
    /// failed one); it is on disk when this returns.
    pub fn save_answer(
        &mut self,
        id: i64,
        content: &str,
        finish_reason: FinishReason,
        stats: &GenerationStats,
        error: Option<&str>,
        sampling: Option<&AnswerSampling>,
    ) -> Result<Message> {
        let tx = self.conn.transaction()?;
        let now = unix_millis();
        let message_id = insert_message(&tx, id, Role::Assistant, content, now)?;
        tx.execute(
            "UPDATE messages SET finish_reason = ?2, stats = ?3, error = ?4, sampling = ?5
             WHERE id = ?1",
            params![
                message_id,
                finish_reason_text(finish_reason),
                to_json(stats)?,
                error,
                sampling.map(to_json).transpose()?
            ],
        )?;
        touch(&tx, id, now)?;
        tx.commit()?;
        Ok(Message {
            id: message_id,
            role: Role::Assistant,
            content: content.to_owned(),
            finish_reason: Some(finish_reason),
            stats: Some(stats.clone()),
            error: error.map(str::to_owned),
            created_at_ms: now,
            sampling: sampling.cloned(),
            images: Vec::new(),
        })
    }

    fn summary(&self, id: i64) -> Result<ConversationSummary> {
        self.conn
            .query_row(LIST_SQL, params![None::<String>, id], summary_from_row)
            .optional()?
            .ok_or(HistoryError::NoSuchConversation(id))
    }

    fn settings(&self, id: i64) -> Result<ConversationSettings> {
        let json: String = self
            .conn
            .query_row(SETTINGS_SQL, [id], |row| row.get(0))
            .optional()?
            .ok_or(HistoryError::NoSuchConversation(id))?;
        from_json(&json, "conversation settings")
    }
}

/// Summaries of the conversations matching LIKE pattern ?1 (all when NULL), or only of
/// conversation ?2 when it is set. A missing title is the first 60 characters of the first
/// user message.
const LIST_SQL: &str = "
SELECT c.id,
       coalesce(c.title,
                (SELECT replace(substr(m.content, 1, 60), char(10), ' ') FROM messages m
                 WHERE m.conversation_id = c.id AND m.role = 'user' ORDER BY m.id LIMIT 1)),
       c.created_at, c.updated_at,
       (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id)
FROM conversations c
WHERE (?2 IS NULL OR c.id = ?2)
  AND (?1 IS NULL
       OR c.title LIKE ?1 ESCAPE '\\'
       OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id
                  AND m.content LIKE ?1 ESCAPE '\\'))
ORDER BY c.updated_at DESC, c.id DESC";

const MESSAGES_SQL: &str = "
SELECT id, role, content, finish_reason, stats, error, created_at, sampling
FROM messages WHERE conversation_id = ?1 ORDER BY id";

const SETTINGS_SQL: &str = "SELECT settings FROM conversations WHERE id = ?1";

const IMAGES_SQL: &str =
    "SELECT digest, media_type FROM images WHERE message_id = ?1 ORDER BY position";

fn summary_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<ConversationSummary> {
    let title: Option<String> = row.get(1)?;
    let title = title
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| UNTITLED.to_owned());
    Ok(ConversationSummary {
        id: row.get(0)?,
        title,
        created_at_ms: row.get(2)?,
        updated_at_ms: row.get(3)?,
        message_count: row.get::<_, i64>(4)? as usize,
    })
}

/// A row of [`MESSAGES_SQL`]; an unknown role or stats that are not valid JSON are a
/// conversion error naming the column.
fn message_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<Message> {
    let bad = |column: usize, message: String| {
        rusqlite::Error::FromSqlConversionFailure(
            column,
            rusqlite::types::Type::Text,
            message.into(),
        )
    };
    let role: String = row.get(1)?;
    let stats: Option<String> = row.get(4)?;
    let finish_reason: Option<String> = row.get(3)?;
    Ok(Message {
        id: row.get(0)?,
        role: Role::parse(&role).ok_or_else(|| bad(1, format!("unknown role {role:?}")))?,
        content: row.get(2)?,
        finish_reason: finish_reason.as_deref().and_then(parse_finish_reason),
        stats: stats
            .map(|json| serde_json::from_str(&json))
            .transpose()
            .map_err(|e| bad(4, format!("stats are not valid JSON: {e}")))?,
        error: row.get(5)?,
        created_at_ms: row.get(6)?,
        sampling: row
            .get::<_, Option<String>>(7)?
            .map(|json| serde_json::from_str(&json))
            .transpose()
            .map_err(|e| bad(7, format!("sampling is not valid JSON: {e}")))?,
        images: Vec::new(),
    })
}

fn insert_message(
    tx: &Transaction<'_>,
    conversation_id: i64,
    role: Role,
    content: &str,
    now: i64,
) -> Result<i64> {
    let inserted = tx.execute(
        "INSERT INTO messages (conversation_id, role, content, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![conversation_id, role.as_str(), content, now],
    );
    match inserted {
        Ok(_) => Ok(tx.last_insert_rowid()),
        Err(err) if err.sqlite_error_code() == Some(ErrorCode::ConstraintViolation) => {
            Err(HistoryError::NoSuchConversation(conversation_id))
        }
        Err(err) => Err(err.into()),
    }
}

fn delete_after(tx: &Transaction<'_>, conversation_id: i64, message_id: i64) -> Result<()> {
    tx.execute(
        "DELETE FROM messages WHERE conversation_id = ?1 AND id > ?2",
        params![conversation_id, message_id],
    )?;
    Ok(())
}

/// Now in Unix milliseconds, but later than every conversation's `updated_at`, so the list's
/// order is the order of activity even within one millisecond.
fn activity_stamp(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row(
        "SELECT max(?1, coalesce(max(updated_at) + 1, 0)) FROM conversations",
        [unix_millis()],
        |row| row.get(0),
    )?)
}

fn touch(tx: &Transaction<'_>, conversation_id: i64, now: i64) -> Result<()> {
    let now = activity_stamp(tx)?.max(now);
    let changed = tx.execute(
        "UPDATE conversations SET updated_at = ?2 WHERE id = ?1",
        params![conversation_id, now],
    )?;
    if changed == 0 {
        return Err(HistoryError::NoSuchConversation(conversation_id));
    }
    Ok(())
}

fn non_empty(content: &str) -> Result<&str> {
    if content.trim().is_empty() {
        return Err(HistoryError::EmptyMessage);
    }
    Ok(content)
}

/// Escapes LIKE's wildcards so `search` matches literally (with `ESCAPE '\'`).
fn escape_like(search: &str) -> String {
    let mut out = String::with_capacity(search.len());
    for c in search.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn finish_reason_text(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
        FinishReason::Error => "error",
    }
}

fn parse_finish_reason(text: &str) -> Option<FinishReason> {
    [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Cancelled,
        FinishReason::Error,
    ]
    .into_iter()
    .find(|r| finish_reason_text(*r) == text)
}

fn to_json(value: &impl Serialize) -> Result<String> {
    serde_json::to_string(value).map_err(|source| HistoryError::BadJson {
        what: "value",
        source,
    })
}

fn from_json<T: serde::de::DeserializeOwned>(json: &str, what: &'static str) -> Result<T> {
    serde_json::from_str(json).map_err(|source| HistoryError::BadJson { what, source })
}

/// Corrupt or non-database files are damage (set aside); anything else (permissions, a full
/// disk, a lock) is an error the user must see, and the file is left alone.
fn classify(err: rusqlite::Error, path: &Path) -> OpenFailure {
    match err.sqlite_error_code() {
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => {
            OpenFailure::Damaged(Damage(format!("{err}")))
        }
        _ => OpenFailure::Fatal(HistoryError::Open {
            path: path.to_owned(),
            source: err,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_temp() -> (tempfile::TempDir, PathBuf, History) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.sqlite3");
        let (history, set_aside) = History::open(&path).unwrap();
        assert_eq!(set_aside, None);
        (dir, path, history)
    }

    fn send(history: &mut History, id: i64, text: &str) -> Vec<ChatMessage> {
        let turn = Turn::Send {
            content: text.into(),
            images: Vec::new(),
        };
        history.begin_turn(id, &turn).unwrap().1
    }

    fn answer(history: &mut History, id: i64, text: &str, reason: FinishReason) -> Message {
        let stats = GenerationStats {
            generation_tokens: 7,
            ttft_s: 0.25,
            ..Default::default()
        };
        history
            .save_answer(id, text, reason, &stats, None, None)
            .unwrap()
    }

    fn attachment(media_type: &str, bytes: &[u8]) -> Attachment {
        use base64::Engine as _;
        Attachment {
            media_type: media_type.into(),
            data: base64::engine::general_purpose::STANDARD.encode(bytes),
        }
    }

    /// The image files in the history's folder.
    fn image_files(history: &History) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(history.images.dir())
            .map(|dir| {
                dir.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    #[test]
    fn images_are_kept_once_by_content_and_removed_with_their_last_conversation() {
        use base64::Engine as _;
        let (_dir, path, mut history) = open_temp();
        let settings = ConversationSettings::default();
        let first = history.create_conversation(&settings).unwrap().id;
        let second = history.create_conversation(&settings).unwrap().id;
        let (png, jpeg) = (
            b"\x89PNG pretend".as_slice(),
            b"\xff\xd8 pretend".as_slice(),
        );
        let turn = Turn::Send {
            content: "What are these?".into(),
            images: vec![attachment("image/png", png), attachment("image/jpeg", jpeg)],
        };
        let (_, messages) = history.begin_turn(first, &turn).unwrap();
        let user = messages.last().unwrap();
        let urls: Vec<&str> = user.image_urls().collect();
        let encode = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        assert_eq!(
            urls,
            [
                format!("data:image/png;base64,{}", encode(png)),
                format!("data:image/jpeg;base64,{}", encode(jpeg)),
            ]
        );
        assert_eq!(user.content, "What are these?");
        // The same image in another conversation, alone and without text: one file for both.
        let only_image = Turn::Send {
            content: String::new(),
            images: vec![attachment("image/png", png)],
        };
        history.begin_turn(second, &only_image).unwrap();
        assert_eq!(image_files(&history).len(), 2);
        // Read back after reopening, in order, answers carrying none.
        answer(&mut history, first, "Two images.", FinishReason::Stop);
        drop(history);
        let (mut history, _) = History::open(&path).unwrap();
        let messages = history.conversation(first).unwrap().messages;
        assert_eq!(messages[0].images.len(), 2);
        assert!(messages[0].images[1].starts_with("data:image/jpeg;base64,"));
        assert!(messages[1].images.is_empty());
        // Deleting the first conversation keeps the PNG the second still shows.
        history.delete(first).unwrap();
        assert_eq!(image_files(&history).len(), 1);
        assert_eq!(
            history.conversation(second).unwrap().messages[0]
                .images
                .len(),
            1
        );
        history.delete(second).unwrap();
        assert!(image_files(&history).is_empty());

        // Refused before anything is saved: another type, damaged data, too many.
        let id = history.create_conversation(&settings).unwrap().id;
        let refused = |history: &mut History, images: Vec<Attachment>| {
            let turn = Turn::Send {
                content: "x".into(),
                images,
            };
            history.begin_turn(id, &turn).unwrap_err().to_string()
        };
        assert!(refused(&mut history, vec![attachment("image/bmp", png)]).contains("PNG, JPEG"));
        let damaged = Attachment {
            media_type: "image/png".into(),
            data: "@@not base64".into(),
        };
        assert!(refused(&mut history, vec![damaged]).contains("damaged"));
        assert!(
            refused(&mut history, vec![attachment("image/png", png); 17]).contains("17 images")
        );
        // A good image before a bad one: neither is written.
        let mixed = vec![attachment("image/png", png), attachment("image/bmp", jpeg)];
        assert!(refused(&mut history, mixed).contains("PNG, JPEG"));
        assert!(history.conversation(id).unwrap().messages.is_empty());
        assert!(image_files(&history).is_empty());
        // Written, then the turn fails (no such conversation): the files go again.
        let lost = Turn::Send {
            content: "x".into(),
            images: vec![attachment("image/png", png)],
        };
        assert!(history.begin_turn(id + 100, &lost).is_err());
        assert!(image_files(&history).is_empty());

        // A file gone from the folder, and a row naming a path outside it: the conversation
        // still reads, without them.
        history.begin_turn(id, &lost).unwrap();
        for file in image_files(&history) {
            std::fs::remove_file(history.images.dir().join(file)).unwrap();
        }
        history
            .conn
            .execute(
                "INSERT INTO images (message_id, position, digest, media_type)
                 SELECT id, 1, '../history.sqlite3', 'image/png' FROM messages",
                [],
            )
            .unwrap();
        let messages = history.conversation(id).unwrap().messages;
        assert_eq!(messages.len(), 1);
        assert!(messages[0].images.is_empty());
        history.delete(id).unwrap();
        assert!(path.exists(), "a digest is never a path out of the folder");
    }

    #[test]
    fn conversations_are_listed_newest_first_with_derived_titles() {
        let (_dir, _path, mut history) = open_temp();
        let settings = ConversationSettings::default();
        let first = history.create_conversation(&settings).unwrap();
        let second = history.create_conversation(&settings).unwrap();
        assert_eq!(first.title, "New chat");
        send(
            &mut history,
            first.id,
            "Why is the sky\nblue? Explain it to a child in one short paragraph please.",
        );
        let listed = history.conversations("").unwrap();
        assert_eq!(
            listed.iter().map(|c| c.id).collect::<Vec<_>>(),
            [first.id, second.id]
        );
        assert_eq!(
            listed[0].title,
            "Why is the sky blue? Explain it to a child in one short para"
        );
        assert_eq!(listed[0].message_count, 1);

        let renamed = history.rename(second.id, "  Sky  ").unwrap();
        assert_eq!(renamed.title, "Sky");
        assert_eq!(history.rename(first.id, "").unwrap().title, listed[0].title);

        history.delete(first.id).unwrap();
        assert_eq!(history.conversations("").unwrap().len(), 1);
        assert!(matches!(
            history.conversation(first.id),
            Err(HistoryError::NoSuchConversation(_))
        ));
        assert!(matches!(
            history.delete(first.id),
            Err(HistoryError::NoSuchConversation(_))
        ));
        let count: i64 = history
            .conn
            .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
            .unwrap();
        assert_eq!(count, 0, "deleting a conversation deletes its messages");
    }

    #[test]
    fn search_matches_titles_and_messages_literally() {
        let (_dir, _path, mut history) = open_temp();
        let settings = ConversationSettings::default();
        let a = history.create_conversation(&settings).unwrap().id;
        let b = history.create_conversation(&settings).unwrap().id;
        let c = history.create_conversation(&settings).unwrap().id;
        send(&mut history, a, "Tell me about PARIS");
        answer(&mut history, b, "", FinishReason::Stop); // an answer alone still counts
        history.rename(b, "100% done").unwrap();
        send(&mut history, c, "snake_case or camelCase?");
        let ids = |q: &str| -> Vec<i64> {
            history
                .conversations(q)
                .unwrap()
                .iter()
                .map(|c| c.id)
                .collect()
        };
        assert_eq!(ids("paris"), [a]);
        assert_eq!(ids("100%"), [b]);
        assert_eq!(ids("%"), [b], "% is literal");
        assert_eq!(ids("e_c"), [c], "_ is literal");
        assert_eq!(ids("x_c"), Vec::<i64>::new());
        assert_eq!(ids("  ").len(), 3);
    }

    #[test]
    fn turns_send_regenerate_and_edit_the_last_user_message() {
        let (_dir, _path, mut history) = open_temp();
        let settings = ConversationSettings {
            system_prompt: "Be brief.".into(),
            max_tokens: 32,
            ..Default::default()
        };
        let id = history.create_conversation(&settings).unwrap().id;
        let prompt = send(&mut history, id, "Hi");
        assert_eq!(
            prompt,
            [
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi")
            ]
        );
        answer(&mut history, id, "Hello!", FinishReason::Stop);
        send(&mut history, id, "Capital of France?");
        answer(&mut history, id, "Par", FinishReason::Cancelled);

        let (got_settings, prompt) = history.begin_turn(id, &Turn::Regenerate).unwrap();
        assert_eq!(got_settings, settings);
        assert_eq!(
            prompt.last().unwrap(),
            &ChatMessage::new("user", "Capital of France?")
        );
        assert_eq!(prompt.len(), 4, "the cancelled answer is gone");
        answer(&mut history, id, "Paris.", FinishReason::Stop);

        let edit = Turn::EditLast {
            content: "Capital of Italy?".into(),
        };
        let (_, prompt) = history.begin_turn(id, &edit).unwrap();
        assert_eq!(
            prompt[1..],
            [
                ChatMessage::new("user", "Hi"),
                ChatMessage::new("assistant", "Hello!"),
                ChatMessage::new("user", "Capital of Italy?"),
            ]
        );
        let failed = history
            .save_answer(
                id,
                "",
                FinishReason::Error,
                &GenerationStats::default(),
                Some("Boom."),
                None,
            )
            .unwrap();
        assert_eq!(failed.error.as_deref(), Some("Boom."));
        let prompt = send(&mut history, id, "Again?");
        assert!(
            prompt
                .iter()
                .all(|m| !(m.role == "assistant" && m.content.is_empty())),
            "failed answers are not sent back to the model: {prompt:?}"
        );
        let saved = history.conversation(id).unwrap();
        assert_eq!(saved.messages.len(), 5);
        assert_eq!(saved.messages[3].finish_reason, Some(FinishReason::Error));
    }

    #[test]
    fn bad_turns_are_errors_that_change_nothing() {
        let (_dir, _path, mut history) = open_temp();
        let id = history
            .create_conversation(&ConversationSettings::default())
            .unwrap()
            .id;
        let blank = Turn::Send {
            content: " \n".into(),
            images: Vec::new(),
        };
        assert!(matches!(
            history.begin_turn(id, &blank),
            Err(HistoryError::EmptyMessage)
        ));
        assert!(matches!(
            history.begin_turn(id, &Turn::Regenerate),
            Err(HistoryError::NoUserMessage)
        ));
        let edit = Turn::EditLast {
            content: "x".into(),
        };
        assert!(matches!(
            history.begin_turn(id, &edit),
            Err(HistoryError::NoUserMessage)
        ));
        let send = Turn::Send {
            content: "x".into(),
            images: Vec::new(),
        };
        assert!(matches!(
            history.begin_turn(id + 1, &send),
            Err(HistoryError::NoSuchConversation(_))
        ));
        assert!(matches!(
            history.save_answer(
                id + 1,
                "x",
                FinishReason::Stop,
                &GenerationStats::default(),
                None,
                None
            ),
            Err(HistoryError::NoSuchConversation(_))
        ));
        assert_eq!(history.conversation(id).unwrap().messages, []);
        let count: i64 = history
            .conn
            .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
            .unwrap();
        assert_eq!(count, 0);
    }

    #[test]
    fn everything_survives_reopening() {
        let (_dir, path, mut history) = open_temp();
        let mut settings = ConversationSettings::default();
        settings.sampling.temperature = 0.7;
        settings.sampling.seed = Some(3);
        let id = history.create_conversation(&settings).unwrap().id;
        send(&mut history, id, "Hi");
        let saved = answer(&mut history, id, "Hello!", FinishReason::Length);
        let before = history.conversation(id).unwrap();
        drop(history);
        let (history, set_aside) = History::open(&path).unwrap();
        assert_eq!(set_aside, None);
        let after = history.conversation(id).unwrap();
        assert_eq!(after, before);
        assert_eq!(after.settings, settings);
        assert_eq!(after.messages[1], saved);
        assert_eq!(
            after.messages[1].stats.as_ref().unwrap().generation_tokens,
            7
        );
    }

    fn assert_set_aside(path: &Path, original: &[u8], why: &str) {
        let (mut history, set_aside) = History::open(path).unwrap();
        let set_aside = set_aside.unwrap_or_else(|| panic!("{why}: not set aside"));
        assert!(
            std::fs::read(&set_aside.moved_to).unwrap() == original,
            "{why}: contents changed"
        );
        assert!(set_aside
            .moved_to
            .to_string_lossy()
            .contains("history.sqlite3.corrupt-"));
        assert_eq!(
            history.conversations("").unwrap(),
            [],
            "{why}: a fresh history"
        );
        history
            .create_conversation(&ConversationSettings::default())
            .unwrap();
    }

    #[test]
    fn a_file_that_is_not_a_database_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.sqlite3");
        let garbage = b"this is not SQLite, and it must not be overwritten".repeat(100);
        std::fs::write(&path, &garbage).unwrap();
        assert_set_aside(&path, &garbage, "garbage");
    }

    #[test]
    fn corrupt_and_truncated_databases_are_set_aside() {
        for damage in ["pages", "truncate"] {
            let (_dir, path, mut history) = open_temp();
            let id = history
                .create_conversation(&ConversationSettings::default())
                .unwrap()
                .id;
            for i in 0..200 {
                send(
                    &mut history,
                    id,
                    &format!("message {i} {}", "x".repeat(200)),
                );
            }
            drop(history); // checkpoints the WAL into the file
            let mut bytes = std::fs::read(&path).unwrap();
            assert!(bytes.len() >= 16 * 4096, "{} bytes", bytes.len());
            match damage {
                "pages" => bytes[4096..12 * 4096].fill(0xA5),
                _ => bytes.truncate(bytes.len() / 2),
            }
            std::fs::write(&path, &bytes).unwrap();
            assert_set_aside(&path, &bytes, damage);
        }
    }

    #[test]
    fn someone_elses_database_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.sqlite3");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('mine');")
            .unwrap();
        drop(conn);
        let original = std::fs::read(&path).unwrap();
        assert_set_aside(&path, &original, "foreign tables");
    }

    #[test]
    fn a_newer_layout_is_an_error_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.sqlite3");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE future (x); PRAGMA user_version = 99;")
            .unwrap();
        drop(conn);
        let original = std::fs::read(&path).unwrap();
        let err = History::open(&path).err().expect("newer layout must fail");
        assert!(
            matches!(err, HistoryError::NewerSchema { found: 99, .. }),
            "{err}"
        );
        assert!(
            std::fs::read(&path).unwrap() == original,
            "the file was changed"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// Layout 1's schema, as Perch wrote it before answers recorded their sampling.
    const SCHEMA_V1: &str = "
        CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT, settings TEXT NOT NULL,
            created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('user', 'assistant')), content TEXT NOT NULL,
            finish_reason TEXT, stats TEXT, error TEXT, created_at INTEGER NOT NULL);
        CREATE INDEX messages_by_conversation ON messages (conversation_id, id);
        PRAGMA user_version = 1;";

    #[test]
    fn a_layout_1_history_is_upgraded_and_old_settings_follow_the_model_when_they_were_greedy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.sqlite3");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(SCHEMA_V1).unwrap();
        // Two conversations saved by the old Perch: one left at the old greedy default (with a
        // seed), one with a temperature the user chose.
        let greedy = r#"{"system_prompt":"","sampling":{"temperature":0.0,"top_p":0.0,"top_k":0,"min_p":0.0,"repetition_penalty":0.0,"repetition_context_size":20,"seed":5},"max_tokens":1024}"#;
        let custom =
            r#"{"system_prompt":"Be kind.","sampling":{"temperature":0.7},"max_tokens":300}"#;
        conn.execute(
            "INSERT INTO conversations (settings, created_at, updated_at) VALUES (?1, 1, 1), (?2, 2, 2)",
            params![greedy, custom],
        )
        .unwrap();
        conn.execute_batch(
            "INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'user', 'Hi', 1);
             INSERT INTO messages (conversation_id, role, content, finish_reason, stats, created_at)
                 VALUES (1, 'assistant', 'Hello', 'stop', NULL, 2);",
        )
        .unwrap();
        drop(conn);

        let (mut history, set_aside) = History::open(&path).unwrap();
        assert!(set_aside.is_none());
        let version: i32 = history
            .conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let first = history.conversation(1).unwrap();
        assert_eq!(first.settings.sampling_source, SamplingSource::Model);
        assert_eq!(first.settings.sampling.seed, Some(5));
        assert_eq!(first.messages.len(), 2);
        assert_eq!(first.messages[1].sampling, None);
        let second = history.conversation(2).unwrap();
        assert_eq!(second.settings.sampling_source, SamplingSource::Custom);
        assert_eq!(second.settings.sampling.temperature, 0.7);
        assert_eq!(second.settings.max_tokens, 300);

        // Answers now keep their sampling, through a reopen.
        let defaults = SamplingDefaults::default();
        let used = first.settings.effective_sampling(&defaults);
        assert_eq!(used.source, AnswerSamplingSource::Perch);
        assert_eq!(used.params.temperature, defaults.temperature);
        assert_eq!(used.params.seed, Some(5));
        history
            .begin_turn(
                1,
                &Turn::Send {
                    content: "Again".into(),
                    images: Vec::new(),
                },
            )
            .unwrap();
        let saved = history
            .save_answer(
                1,
                "Hi again",
                FinishReason::Stop,
                &GenerationStats::default(),
                None,
                Some(&used),
            )
            .unwrap();
        assert_eq!(saved.sampling.as_ref(), Some(&used));
        drop(history);
        let (history, _) = History::open(&path).unwrap();
        let reread = history.conversation(1).unwrap();
        assert_eq!(
            reread.messages.last().unwrap().sampling.as_ref(),
            Some(&used)
        );
    }

    #[test]
    fn custom_sampling_is_used_as_it_is_and_new_settings_follow_the_model() {
        let mut settings = ConversationSettings::default();
        assert_eq!(settings.sampling_source, SamplingSource::Model);
        settings.sampling.temperature = 0.3;
        settings.sampling_source = SamplingSource::Custom;
        let used = settings.effective_sampling(&SamplingDefaults::default());
        assert_eq!(used.source, AnswerSamplingSource::Custom);
        assert_eq!(used.params, settings.sampling);
        // Saved with its source, it reads back as saved (not by the legacy rule).
        let json = serde_json::to_string(&settings).unwrap();
        assert!(json.contains(r#""sampling_source":"custom""#), "{json}");
        assert_eq!(
            serde_json::from_str::<ConversationSettings>(&json).unwrap(),
            settings
        );
        settings.sampling = SamplingParams::default();
        let json = serde_json::to_string(&settings).unwrap();
        assert_eq!(
            serde_json::from_str::<ConversationSettings>(&json)
                .unwrap()
                .sampling_source,
            SamplingSource::Custom
        );
    }
}
