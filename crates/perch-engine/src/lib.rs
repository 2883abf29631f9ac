//! Perch's generation engine on MLX: loading mlx-community models, tokenization and chat
//! templates, sampling, generation with streaming text and per-request stats.
//!
//! Layout: [`models`] (architectures and their registry) built from [`layers`] and [`weights`];
//! [`cache`] (KV cache of one sequence), [`block_pool`] and [`kv_cache_manager`] (paged KV blocks
//! with prefix caching, for the batch engine); [`tokenizer`] and [`chat_template`] (text); [`sampler`] and [`stop`]
//! (choosing tokens, ending); [`generate`] (the loop); [`engine`] (the engine thread and
//! [`EngineHandle`]); [`device`] (backend, dtype, memory).

pub mod attention;
pub mod batch;
pub mod block_pool;
pub mod block_store;
pub mod cache;
pub mod chat_template;
mod compiled;
mod cuda_kernel;
pub mod decode_kernel;
pub mod device;
pub mod engine;
pub mod error;
pub mod generate;
pub mod generation_config;
pub mod grammar;
pub mod kv_cache_manager;
pub mod layer_caches;
pub mod layers;
pub mod limits;
mod mlx_ext;
pub mod models;
pub mod prompt_cache;
mod runner;
pub mod sampler;
pub mod scheduler;
pub mod slot_cache;
pub mod speculative;
pub mod stop;
mod tail_cache;
pub mod throughput;
pub mod tokenizer;
pub mod tool_calls;
pub mod weights;

pub use cache::KvQuantization;
pub use chat_template::ChatMessage;
#[doc(hidden)]
pub use engine::FaultInjection;
pub use engine::{
    EngineConfig, EngineEvent, EngineHandle, EngineLimits, EngineRequest, EngineStats, Prompt,
    RequestStream,
};
pub use error::{EngineError, Result};
pub use generate::{
    generate, FinishReason, GenerateOutput, GenerateRequest, GenerationStats, TokenEvent,
    TokenLogprobs,
};
pub use grammar::Grammar;
pub use speculative::{generate_speculative, Draft};
pub use tokenizer::Tokenizer;
pub use weights::LoadProgress;
