//! The commands the web UI calls, by domain. Each is thin: it calls `perch-engine` (through the
//! [`perch_engine::EngineHandle`]), `perch-hub` or `perch-store` and turns any error into a
//! [`CommandError`]: its kind and one sentence for the UI.

pub mod chat;
pub mod hosts;
pub mod hub;
pub mod model;
pub mod server;
pub mod settings;
pub mod system;

/// A command's error as the web view receives it, `{"kind": …, "message": …}`: what kind of
/// failure (for the view to choose what to offer: a retry, the model picker, Settings) and one
/// sentence a user can act on.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CommandError {
    pub kind: CommandErrorKind,
    pub message: String,
}

/// What failed, for [`CommandError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CommandErrorKind {
    /// What the user entered or chose is not valid: a setting, a conversation that is gone.
    InvalidInput,
    /// No model is loaded.
    ModelNotLoaded,
    /// The chosen model cannot be loaded: missing or damaged files, a config Perch cannot
    /// read, an architecture it does not run.
    InvalidModel,
    /// The conversation does not fit the model's context, its KV cache, or the memory the
    /// model left.
    ContextLengthExceeded,
    /// The engine holds as many requests as it takes; try again shortly.
    Overloaded,
    /// The memory a request needs is not free now (held by other apps or other requests): the
    /// message says how much it needs, how much is available and what to do.
    OutOfMemory,
    /// The Hugging Face Hub could not be reached or answered with an error.
    Network,
    /// Perch's files (history, settings, models) could not be read or written.
    Storage,
    /// Anything else: an engine failure or a bug.
    Internal,
}

impl CommandError {
    /// An error of `kind` with `message` made one [`sentence`].
    pub fn new(kind: CommandErrorKind, message: &dyn std::fmt::Display) -> Self {
        Self {
            kind,
            message: sentence(message),
        }
    }

    /// An engine error, of the kind its requests meet ([`perch_engine::api::ErrorKind`]).
    pub fn engine(err: &perch_engine::EngineError) -> Self {
        use perch_engine::api::ErrorKind;
        use perch_engine::EngineError;
        let kind = match err.kind() {
            ErrorKind::ContextLengthExceeded => CommandErrorKind::ContextLengthExceeded,
            ErrorKind::InvalidRequest => CommandErrorKind::InvalidInput,
            // The engine's sentence says what to do (its API answers 503 for both).
            ErrorKind::Overloaded
                if matches!(
                    err,
                    EngineError::OutOfMemory { .. } | EngineError::PromptOutOfMemory { .. }
                ) =>
            {
                CommandErrorKind::OutOfMemory
            }
            ErrorKind::Overloaded => CommandErrorKind::Overloaded,
            ErrorKind::ModelNotLoaded => CommandErrorKind::ModelNotLoaded,
            ErrorKind::Cancelled | ErrorKind::Internal => CommandErrorKind::Internal,
        };
        Self::new(kind, err)
    }

    pub fn invalid(message: &dyn std::fmt::Display) -> Self {
        Self::new(CommandErrorKind::InvalidInput, message)
    }

    pub fn storage(message: &dyn std::fmt::Display) -> Self {
        Self::new(CommandErrorKind::Storage, message)
    }

    /// A Hub error, with its causes (`cannot reach …: connection refused.`).
    pub fn network(err: &dyn std::error::Error) -> Self {
        Self {
            kind: CommandErrorKind::Network,
            message: sentence_with_causes(err),
        }
    }
}

/// A sentence with no kind of its own: an internal failure.
impl From<String> for CommandError {
    fn from(message: String) -> Self {
        Self::new(CommandErrorKind::Internal, &message)
    }
}

impl From<&str> for CommandError {
    fn from(message: &str) -> Self {
        Self::new(CommandErrorKind::Internal, &message)
    }
}

impl std::fmt::Display for CommandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

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
    work: impl FnOnce(&tauri::AppHandle<R>) -> Result<T, CommandError> + Send + 'static,
) -> Result<T, CommandError> {
    tauri::async_runtime::spawn_blocking(move || work(&app))
        .await
        .map_err(|_| {
            CommandError::from(
                "Perch hit an internal error; the last action did not complete.".to_string(),
            )
        })?
}

pub(crate) fn poisoned() -> CommandError {
    "Perch's state is broken after an earlier crash; restart the app."
        .to_string()
        .into()
}

#[cfg(test)]
mod tests {
    use perch_engine::memory::{Available, MemoryBound};
    use perch_engine::EngineError;

    use super::{CommandError, CommandErrorKind};

    /// A request refused for memory that may come back is said as the engine says it (how much
    /// it needs, how much is free, what to do), not as a busy engine; one beyond what the model
    /// left is the conversation's length.
    #[test]
    fn memory_refusals_keep_their_sentence() {
        let refused = |beyond_capacity| EngineError::PromptOutOfMemory {
            prompt_tokens: 1241,
            needed: 174_000_000,
            available: Available {
                bytes: 173_000_000,
                bound: MemoryBound::System,
            },
            beyond_capacity,
        };
        let now = CommandError::engine(&refused(false));
        assert_eq!(now.kind, CommandErrorKind::OutOfMemory);
        assert!(
            now.message
                .starts_with("A prompt of 1241 tokens needs 174 MB of memory for its KV cache"),
            "{}",
            now.message
        );
        assert_eq!(
            CommandError::engine(&refused(true)).kind,
            CommandErrorKind::ContextLengthExceeded
        );
        let busy = EngineError::Busy { limit: 1024 };
        assert_eq!(
            CommandError::engine(&busy).kind,
            CommandErrorKind::Overloaded
        );
    }
}
