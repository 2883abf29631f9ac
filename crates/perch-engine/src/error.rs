//! The engine's error type: one enum, messages a user can act on.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Everything that can go wrong while loading a model or generating.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file larger than Perch reads (see [`crate::limits`]).
    #[error("{path} is larger than {} MiB, more than any real model's; Perch does not read it", limit >> 20)]
    FileTooLarge { path: PathBuf, limit: u64 },
    /// Too little memory for what was asked (checked before allocating it; see
    /// [`crate::memory`]).
    #[error(
        "{what} needs {} of memory and {available}; close other apps or choose a smaller model",
        crate::memory::describe_bytes(*needed)
    )]
    OutOfMemory {
        what: String,
        needed: u64,
        available: crate::memory::Available,
    },
    /// A request whose KV cache does not fit in the memory left with nothing else running
    /// (`BatchGenerator::set_memory_headroom`).
    #[error(
        "a prompt of {prompt_tokens} tokens needs {} of memory for its KV cache and {available}; shorten the prompt, close other apps or choose a smaller model",
        crate::memory::describe_bytes(*needed)
    )]
    PromptOutOfMemory {
        prompt_tokens: usize,
        needed: u64,
        available: crate::memory::Available,
        /// `needed` is more than the engine had with the model loaded and nothing else running
        /// ([`crate::memory::PressureGuard::capacity`]): retrying the prompt cannot help.
        beyond_capacity: bool,
    },
    #[error("{path} is not a valid model config: {message}")]
    Config { path: PathBuf, message: String },
    #[error("model_type `{found}` is not supported; Perch supports: {supported}")]
    UnsupportedArchitecture { found: String, supported: String },
    #[error("weight file {path} is damaged or truncated: {message}")]
    CorruptWeights { path: PathBuf, message: String },
    #[error("the model has no weight `{name}` (is the directory complete and of the declared architecture?)")]
    MissingWeight { name: String },
    #[error("weight `{name}`: {message}")]
    WeightFormat { name: String, message: String },
    #[error("weight `{name}` has shape {found:?}, but the config implies {expected:?}")]
    ShapeMismatch {
        name: String,
        found: Vec<i32>,
        expected: Vec<i32>,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt's token {position} is id {token}, outside the vocabulary of {vocab_size}")]
    TokenOutOfVocabulary {
        position: usize,
        token: u32,
        vocab_size: usize,
    },
    #[error("the prompt has {prompt_tokens} tokens, more than the model's context of {context_length} tokens")]
    PromptTooLong {
        prompt_tokens: usize,
        context_length: usize,
    },
    /// The prompt alone does not fit in the KV block pool. (A prompt that fits with room for
    /// fewer tokens than `max_tokens` runs with `max_tokens` lowered to what fits, and finishes
    /// with reason `length`.)
    /// When the budget was lowered to fit the memory left after loading ([`crate::memory`]),
    /// the sentence says so and asks for memory rather than a larger budget; when a draft
    /// model's KV shares the pool (`BatchConfig::counting_draft`), it says that running without
    /// the draft frees it.
    #[error(
        "the prompt needs {prompt_tokens} tokens of KV cache and one more to generate, but the KV cache budget holds \
         {capacity_tokens}{}",
        kv_advice(lowered, *shared_with_draft)
    )]
    KvCacheTooSmall {
        prompt_tokens: usize,
        capacity_tokens: usize,
        lowered: Option<crate::memory::LoweredBudget>,
        shared_with_draft: bool,
    },
    /// The engine already holds as many requests as it queues (see
    /// [`crate::EngineConfig::max_queued_requests`]); try again when some have finished.
    #[error(
        "the engine is busy: {limit} requests are already running or waiting; try again shortly"
    )]
    Busy { limit: usize },
    #[error("prompt cache {path}: {message}")]
    PromptCache { path: PathBuf, message: String },
    #[error("invalid sampling parameters: {0}")]
    InvalidSampling(String),
    /// A response format (JSON schema) that cannot be compiled, or a tokenizer that
    /// constrained decoding cannot read.
    #[error("invalid response format: {0}")]
    InvalidGrammar(String),
    /// The engine refused or failed a request; its message.
    #[error("{0}")]
    Request(String),
    #[error("the engine has stopped")]
    EngineStopped,
    #[error("invalid KV cache quantization: {0}")]
    InvalidKvQuantization(String),
    #[error("CPU kernel: {0}")]
    Kernel(String),
    /// A distributed group could not form or a collective failed (`crate::distributed`).
    #[error("distributed: {0}")]
    Distributed(String),
    #[error("MLX: {0}")]
    Mlx(mlx_rs::error::Exception),
}

impl From<mlx_rs::error::Exception> for EngineError {
    /// MLX's failures, but a distributed backend's (a rank gone, a collective failed), which are
    /// [`EngineError::Distributed`] with MLX's sentence alone (not its source location).
    fn from(e: mlx_rs::error::Exception) -> Self {
        match distributed_failure(e.what()) {
            Some(why) => EngineError::Distributed(why),
            None => EngineError::Mlx(e),
        }
    }
}

/// A distributed backend's failure in an MLX message (`[ring] connection to a peer was lost at
/// FILE:LINE`): the backend and its sentence, without the location.
fn distributed_failure(message: &str) -> Option<String> {
    let (at, backend) = ["ring", "jaccl", "mpi", "nccl"]
        .iter()
        .find_map(|b| message.find(&format!("[{b}]")).map(|at| (at, *b)))?;
    let rest = &message[at + backend.len() + 2..];
    let sentence = rest.split(" at /").next().unwrap_or(rest).trim();
    let sentence = sentence.trim_end_matches('"');
    Some(format!(
        "{sentence} (MLX's {backend} backend): a rank of the group stopped or cannot be reached"
    ))
}

impl EngineError {
    /// What kind of failure this is for a request that met it ([`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::PromptTooLong { .. } | EngineError::KvCacheTooSmall { .. } => {
                ErrorKind::ContextLengthExceeded
            }
            // More than the engine had at load with nothing else running: the prompt is what
            // does not fit (retrying it cannot help; a shorter one may fit). Otherwise memory
            // held elsewhere (other apps, requests beside the batch) may come back.
            EngineError::PromptOutOfMemory {
                beyond_capacity: true,
                ..
            } => ErrorKind::ContextLengthExceeded,
            EngineError::EmptyPrompt
            | EngineError::TokenOutOfVocabulary { .. }
            | EngineError::InvalidSampling(_)
            | EngineError::InvalidGrammar(_)
            | EngineError::InvalidKvQuantization(_)
            | EngineError::ChatTemplate(_)
            | EngineError::PromptCache { .. }
            | EngineError::Request(_) => ErrorKind::InvalidRequest,
            EngineError::Busy { .. }
            | EngineError::OutOfMemory { .. }
            | EngineError::PromptOutOfMemory { .. } => ErrorKind::Overloaded,
            EngineError::EngineStopped => ErrorKind::ModelNotLoaded,
            EngineError::Io { .. }
            | EngineError::FileTooLarge { .. }
            | EngineError::Config { .. }
            | EngineError::UnsupportedArchitecture { .. }
            | EngineError::CorruptWeights { .. }
            | EngineError::MissingWeight { .. }
            | EngineError::WeightFormat { .. }
            | EngineError::ShapeMismatch { .. }
            | EngineError::Tokenizer(_)
            | EngineError::Kernel(_)
            | EngineError::Distributed(_)
            | EngineError::Mlx(_) => ErrorKind::Internal,
        }
    }

    /// This error as a request's ([`RequestError`]): its kind and its sentence.
    pub fn to_request_error(&self) -> RequestError {
        RequestError::new(self.kind(), self.to_string())
    }

    /// As [`EngineError::to_request_error`], for a request the engine refused before running it:
    /// whatever went wrong is about the request (a prompt-cache file it names that cannot be
    /// read, a chat template that fails on its messages), never an internal failure.
    pub fn to_refusal(&self) -> RequestError {
        let kind = match self.kind() {
            ErrorKind::Internal => ErrorKind::InvalidRequest,
            kind => kind,
        };
        RequestError::new(kind, self.to_string())
    }
}

/// What kind of failure ended a request: how the HTTP API (status, OpenAI's and Anthropic's
/// error types and codes) and the app report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The prompt, with one token to generate, does not fit the model's context, the KV cache
    /// budget, or the memory the engine had once the model loaded (OpenAI's
    /// `context_length_exceeded`).
    ContextLengthExceeded,
    /// The request itself is wrong: an empty prompt, a token outside the vocabulary, invalid
    /// sampling or KV settings, a response format that does not compile, a chat template or
    /// prompt-cache file that fails.
    InvalidRequest,
    /// The engine already holds as many requests as it queues, or the memory a prompt needs is
    /// held for now; retry shortly.
    Overloaded,
    /// The request was cancelled.
    Cancelled,
    /// No model is loaded: the engine stopped, or a model is still loading.
    ModelNotLoaded,
    /// The engine failed while running the request (MLX, a kernel); not the request's fault.
    Internal,
}

/// Why a request failed: its kind and one sentence a user can act on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{message}")]
pub struct RequestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl RequestError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Result alias for the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl From<mlx_rs::error::IoError> for EngineError {
    fn from(err: mlx_rs::error::IoError) -> Self {
        EngineError::CorruptWeights {
            path: PathBuf::new(),
            message: err.to_string(),
        }
    }
}

/// The end of [`EngineError::KvCacheTooSmall`]'s sentence: what to change.
fn kv_advice(lowered: &Option<crate::memory::LoweredBudget>, shared_with_draft: bool) -> String {
    use crate::memory::describe_bytes;
    let draft = match shared_with_draft {
        true => " (the draft model's KV shares it: without the draft the prompt has more room)",
        false => "",
    };
    match lowered {
        None => format!("{draft}; shorten the prompt or raise the KV cache budget"),
        Some(l) => format!(
            " (the budget was lowered from {} to fit the {} of memory left after loading the \
             model){draft}; shorten the prompt, close other apps or choose a smaller model",
            describe_bytes(l.configured_bytes as u64),
            describe_bytes(l.available_bytes)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{distributed_failure, EngineError, ErrorKind};
    use crate::memory::{Available, MemoryBound};

    /// A prompt refused for memory beyond what the engine had at load is the prompt's fault (a
    /// client error that retrying cannot mend); within it, the server is overloaded and may
    /// recover.
    #[test]
    fn a_prompt_out_of_memory_is_a_client_error_only_beyond_the_capacity() {
        let refused = |beyond_capacity| EngineError::PromptOutOfMemory {
            prompt_tokens: 1241,
            needed: 174_000_000,
            available: Available {
                bytes: 173_000_000,
                bound: MemoryBound::Cgroup,
            },
            beyond_capacity,
        };
        assert_eq!(refused(true).kind(), ErrorKind::ContextLengthExceeded);
        assert_eq!(refused(false).kind(), ErrorKind::Overloaded);
    }

    #[test]
    fn a_backend_s_failure_is_its_sentence() {
        let message = "[ring] connection to a peer was lost at /root/.cargo/registry/src/x/mlx-c/mlx/c/transforms.cpp:15";
        assert_eq!(
            distributed_failure(message).unwrap(),
            "connection to a peer was lost (MLX's ring backend): a rank of the group stopped or \
             cannot be reached"
        );
        assert_eq!(
            distributed_failure("[matmul] shapes do not match at /x.cpp:3"),
            None
        );
    }
}
