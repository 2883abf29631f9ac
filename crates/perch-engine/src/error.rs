//! The engine's error type: one enum, messages a user can act on.

use std::path::PathBuf;

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
    #[error(
        "the prompt needs {prompt_tokens} tokens of KV cache and one more to generate, but the KV cache budget holds \
         {capacity_tokens}; shorten the prompt or raise the KV cache budget"
    )]
    KvCacheTooSmall {
        prompt_tokens: usize,
        capacity_tokens: usize,
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
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
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
