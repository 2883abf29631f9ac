//! Perch's generation engine on MLX: continuous batching over a block-pool KV cache with prefix
//! caching, one sequence's generation and speculative decoding beside it, the models, their
//! tokenizers and chat templates, and sampling.
//!
//! Clients (the app, the CLI, the HTTP server) talk to the engine thread through
//! [`EngineHandle`]; everything else here is what that thread runs. The modules, each depending
//! only on those listed after it (`tests/module_graph.rs` checks there is no circle):
//!
//! - [`engine`]: the handle, the engine thread and its loop over the batch
//!   ([`engine::batch`]: admission, prefill chunks and decode steps, as `perch_sched` decides
//!   them, over the block pool and the prefix cache);
//! - [`sequence`]: one sequence with caches of its own (`generate`, speculative decoding);
//! - [`spec_decode`]: speculative decoding inside the batch (proposers, the acceptance rule);
//! - [`worker`]: the batch's model runner (forward passes over the slot caches, compiled decode
//!   steps, CUDA's decode attention kernel);
//! - [`prompt_cache`]: prompt-cache files (mlx_lm's layout);
//! - [`models`]: the architectures, each one forward over [`kv::LayerCaches`];
//! - [`kv`]: the caches a forward reads and writes (one sequence's [`kv::cache::KvCache`]s, a
//!   batch's slot caches) and the prefix cache's block store;
//! - [`attention`]: scaled dot-product attention over what a cache holds;
//! - [`text`]: tokenizer, detokenizer, chat templates, stop strings, tool calls;
//! - [`sample`]: the sampler, logits processors, grammars, generation configs;
//! - [`nn`]: layers and weights; [`device`]: backend and memory; [`api`]: the request, event and
//!   stats types clients see; [`error`]: the error type.
//!
//! Scheduling decisions (block pool, KV cache manager, scheduler, budgets, step shapes) live in
//! the `perch-sched` crate, which knows nothing of MLX.

pub mod api;
pub(crate) mod attention;
pub mod device;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod image_processor;
pub mod kv;
pub mod limits;
pub mod memory;
pub mod models;
pub mod nn;
pub(crate) mod output;
pub mod prompt_cache;
pub mod sample;
pub(crate) mod sequence;
pub mod spec_decode;
pub mod text;
pub(crate) mod worker;

#[doc(hidden)]
pub mod testing;

pub use api::{
    CacheMiss, CachePin, ClientModels, EngineEvent, EngineLimits, EngineRequest, EngineStats,
    FinishReason, GenerateOutput, GenerateRequest, GenerationStats, KeepAlive, KvCacheStats,
    Prompt, PromptCacheReport, Residency, StepTimes, TokenEvent, TokenLogprobs,
};
pub use attention::KvQuantization;
#[doc(hidden)]
pub use engine::FaultInjection;
pub use engine::{EngineConfig, EngineHandle, RequestStream};
pub use error::{EngineError, Result};
pub use image_processor::{ImageInput, ImageProcessor};
pub use kv::slot_cache::SlotAttention;
pub use nn::weights::LoadProgress;
pub use perch_sched::scheduler::Priority;
pub use perch_sched::RequestId;
pub use sample::grammar::Grammar;
pub use sample::sampler::SamplingParams;
pub use sequence::generate::generate;
pub use sequence::speculative::{generate_speculative, Draft};
pub use spec_decode::ngram::PromptLookup;
pub use text::chat_template::{ChatMessage, ContentPart};
pub use text::tokenizer::Tokenizer;

/// The kernels [`check_kernels`] checks, by name.
pub const KERNELS: [&str; 6] = [
    "decode-attention",
    "gated-delta",
    "experts",
    "add-norm",
    "norm-rope",
    "gemm",
];

/// Checks Perch's CUDA kernels named in `only` ([`KERNELS`]; all when it is empty) — the masked
/// decode attention, the Gated DeltaNet recurrence, the experts' quantized products, the residual
/// add with the RMS norm after it, the queries' and keys' norms and RoPE, the small dense
/// products — against
/// MLX's own operations on random inputs; one line per case, an error at the first case outside
/// its tolerance. MLX's CUDA backend only (`perch check-kernels` on the device).
pub fn check_kernels(only: &[String]) -> Result<Vec<String>> {
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let mut lines = Vec::new();
    if wanted(KERNELS[0]) {
        lines.extend(attention::decode_kernel::check()?);
    }
    if wanted(KERNELS[1]) {
        lines.extend(models::gated_delta::check_kernel()?);
    }
    if wanted(KERNELS[2]) {
        lines.extend(nn::expert_kernel::check()?);
        lines.extend(models::moe::check_shared_fold()?);
        lines.extend(models::moe::check_grouped()?);
    }
    if wanted(KERNELS[3]) {
        lines.extend(nn::norm_kernel::check()?);
    }
    if wanted(KERNELS[4]) {
        lines.extend(nn::rope_kernel::check()?);
    }
    if wanted(KERNELS[5]) {
        lines.extend(nn::gemm_kernel::check()?);
    }
    Ok(lines)
}
