use std::path::PathBuf;
use std::time::Duration;

/// What can go wrong talking to the Hub or writing into the cache.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("{0:?} is not a Hugging Face repository id (expected `org/name`)")]
    InvalidRepoId(String),
    #[error("{revision:?} cannot be used as a revision (a branch, tag or commit): {reason}")]
    InvalidRevision { revision: String, reason: String },
    #[error("{path:?} cannot be written into the cache: {reason}")]
    InvalidFile { path: String, reason: String },
    #[error("cannot reach {url}")]
    Network {
        url: String,
        #[source]
        source: Box<ureq::Error>,
    },
    #[error("{url} answered HTTP {status}{}", status_hint(*.status))]
    Status { url: String, status: u16 },
    #[error("{url} gave an answer Perch cannot use: {reason}")]
    BadResponse { url: String, reason: String },
    #[error("the Hub did not answer within {limit:?} (last request: {url})")]
    TimedOut { url: String, limit: Duration },
    #[error("the download of {path} stopped after {received} of {expected} bytes")]
    Interrupted {
        path: String,
        received: u64,
        expected: u64,
        #[source]
        source: Option<std::io::Error>,
    },
    #[error(
        "{path} does not match the Hub's checksum (expected {expected}, got {actual}); \
         the damaged file was deleted, download it again"
    )]
    Checksum {
        path: String,
        expected: String,
        actual: String,
    },
    #[error(
        "not enough disk space in {}: the download needs {needed} more bytes, {available} are free",
        dir.display()
    )]
    DiskFull {
        dir: PathBuf,
        needed: u64,
        available: u64,
    },
    #[error("cannot write {}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the download was cancelled; what was fetched is kept and the next download resumes it"
    )]
    Cancelled,
    #[error("{} is not a model in Perch's models directory or the Hugging Face cache", .0.display())]
    NotLocalModel(PathBuf),
}

impl HubError {
    /// Whether trying again may succeed: lost connections, timeouts and the Hub's 5xx/429
    /// answers.
    pub fn is_transient(&self) -> bool {
        match self {
            HubError::Network { .. } | HubError::Interrupted { .. } | HubError::TimedOut { .. } => {
                true
            }
            HubError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}

fn status_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => " (the repository is private or gated: accept its terms on huggingface.co and set HF_TOKEN)",
        404 => " (no such repository, revision or file)",
        429 => " (rate limited: try again later)",
        _ => "",
    }
}

pub(crate) fn io_error(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.into();
    move |source| HubError::Io { path, source }
}
