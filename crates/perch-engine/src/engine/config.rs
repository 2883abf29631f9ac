//! The engine's settings.

use std::path::PathBuf;

use crate::api::KeepAlive;
use crate::attention::KvQuantization;
use crate::device::Backend;
use crate::engine::batch::BatchConfig;
use crate::kv::slot_cache::SlotAttention;
use crate::sequence::speculative::Draft;
use crate::spec_decode::ngram::PromptLookup;

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most requests running at once (the completion batch size); more wait in line.
    pub max_running: usize,
    /// Requests whose prefill advances by one chunk per step (see [`BatchConfig`]).
    pub prefill_batch_size: usize,
    /// Prompt tokens prefilled per step while other requests are decoding (see [`BatchConfig`]).
    pub prefill_token_budget: usize,
    /// Memory for the KV block pool, in bytes; the pool holds this many bytes' worth of tokens.
    pub kv_cache_bytes: usize,
    /// Tokens per KV block (the prefix cache's granularity).
    pub block_size: usize,
    /// Quantize the KV cache (8 or 4 bits, MLX affine) so the same budget holds 3.6x or 6.4x
    /// the tokens (float32, head dimension 64); `None` keeps the compute dtype. Loading fails
    /// with [`EngineError::InvalidKvQuantization`] when it does not fit the model.
    pub kv_quantization: Option<KvQuantization>,
    /// How batched steps read their slot caches (see [`SlotAttention`]); the backend decides by
    /// default.
    pub slot_attention: SlotAttention,
    /// Batched decode steps compiled by MLX (see [`BatchConfig::compile_decode`]); on by
    /// default on GPUs.
    pub compile_decode: bool,
    /// While idle, run the prefill passes and decode steps requests meet most, one at a time,
    /// before a request does (see [`BatchGenerator::queue_idle_warm_up`]); a request that
    /// arrives waits for one pass at most. On by default on CUDA, where each new shape costs
    /// tens of milliseconds the first time (a cuDNN plan and a CUDA graph); off elsewhere
    /// (Metal's cost per shape is unmeasured here).
    pub idle_warm_up: bool,
    /// Next-token-logprobs calls that arrive at an idle engine are gathered into one batch
    /// until this many are waiting or [`EngineConfig::logprobs_batch_timeout`] has passed since
    /// the first (genlm's `AsyncMlxLM(batch_size=5, timeout=0.001)`). Calls arriving while the
    /// engine is busy join the next step anyway.
    pub logprobs_batch_size: usize,
    pub logprobs_batch_timeout: std::time::Duration,
    /// Requests that reach an idle engine together start together: after the first, the engine
    /// keeps taking requests until none arrives for this long (or four times it has passed),
    /// so a burst (a client's fan-out, a benchmark's N requests) is prefilled in one pass
    /// instead of racing the first step. Zero (the CPU default) starts at once. On GPUs the
    /// first pass over a new batch shape is what a burst split in two pays: MLX's CUDA backend
    /// builds a cuDNN attention plan and loads kernels for each new shape (60 ms or more at 8 ×
    /// 128 tokens).
    pub arrival_window: std::time::Duration,
    /// Requests that may wait beyond the `max_running` that run: past `max_running +
    /// max_queued_requests` requests in the engine, [`EngineHandle::submit`] answers
    /// [`EngineError::Busy`] at once.
    pub max_queued_requests: usize,
    /// A draft model (a directory in the mlx-community layout) loaded beside the model, for
    /// requests with [`GenerateRequest::num_draft_tokens`] (speculative decoding). Its tokenizer
    /// must be the model's; loading fails otherwise. Those without logits processors run in the
    /// batch, greedy or sampled, the draft proposing in its verify steps (see
    /// [`BatchGenerator::with_draft`]); the others beside it, one round of proposals each per
    /// engine step (see [`crate::sequence::speculative`]).
    pub draft_model: Option<PathBuf>,
    /// The proposals a step that requests using the draft model ask for by default (`perch serve
    /// --num-draft-tokens`): the batch's verify steps are warmed for `1 +` this many tokens a
    /// row (another count meets its shape on its first step; a count out of range warms the
    /// default's). [`Draft::DEFAULT_NUM_DRAFT_TOKENS`] by default.
    pub num_draft_tokens: usize,
    /// Prompt lookup (n-gram) speculative decoding in the batch for greedy requests (see
    /// [`BatchConfig::prompt_lookup`]); off by default.
    pub prompt_lookup: Option<PromptLookup>,
    /// How long the engine keeps the model in memory once idle ([`KeepAlive`]); requests may
    /// change it ([`crate::GenerateRequest::keep_alive`]). Never unloads by default (the CLI's
    /// one-off commands); `perch serve` and the app unload after an idle hour unless told
    /// otherwise.
    pub keep_alive: KeepAlive,
    /// The model each recent client's latest request went to, shared with the process's other
    /// engines (the app passes one to each model it loads): a client's first request here after
    /// requests to another model has its miss explained as such
    /// ([`perch_sched::cache_miss::CacheMiss::AnotherModel`]). `None`: this engine alone.
    pub client_models: Option<std::sync::Arc<perch_sched::cache_miss::ClientModels>>,
    /// Faults on purpose, for tests of what clients do when the engine is slow or fails.
    #[doc(hidden)]
    pub fault_injection: FaultInjection,
}

/// Test hooks: a slow step, a panic in a step. The default injects nothing.
#[doc(hidden)]
#[derive(Clone, Debug, Default)]
pub struct FaultInjection {
    /// Sleep this long before every step.
    pub step_delay: std::time::Duration,
    /// Panic in the engine thread's `n`th step (counted from 1 since the model loaded).
    pub panic_at_step: Option<u64>,
}

impl EngineConfig {
    /// 2 GiB of KV cache: 46k tokens of SmolLM2-135M in float32, 8k tokens of an 8B
    /// Llama in bfloat16.
    pub const DEFAULT_KV_CACHE_BYTES: usize = 2 << 30;
    /// Larger than vLLM's 16: each cached block is one small MLX array per layer here.
    pub const DEFAULT_BLOCK_SIZE: usize = 32;
    /// Enough for a genlm-style scorer's bursts of next-token-logprobs calls.
    pub const DEFAULT_MAX_QUEUED_REQUESTS: usize = 1024;

    /// [`EngineConfig::arrival_window`]: none on CPU (prefill runs one sequence a pass there
    /// anyway), 0.5 ms on GPUs (a lone request's first token waits that much longer).
    pub fn default_arrival_window(backend: Backend) -> std::time::Duration {
        match backend {
            Backend::Cpu => std::time::Duration::ZERO,
            Backend::Metal | Backend::Cuda => std::time::Duration::from_micros(500),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: 32,
            prefill_batch_size: BatchConfig::default_prefill_batch_size(Backend::current()),
            prefill_token_budget: BatchConfig::default_prefill_token_budget(Backend::current()),
            kv_cache_bytes: Self::DEFAULT_KV_CACHE_BYTES,
            block_size: Self::DEFAULT_BLOCK_SIZE,
            kv_quantization: None,
            slot_attention: SlotAttention::Auto,
            compile_decode: BatchConfig::default_compile_decode(Backend::current()),
            idle_warm_up: Backend::current() == Backend::Cuda,
            logprobs_batch_size: 5,
            logprobs_batch_timeout: std::time::Duration::from_millis(1),
            arrival_window: Self::default_arrival_window(Backend::current()),
            max_queued_requests: Self::DEFAULT_MAX_QUEUED_REQUESTS,
            draft_model: None,
            num_draft_tokens: Draft::DEFAULT_NUM_DRAFT_TOKENS,
            prompt_lookup: None,
            keep_alive: KeepAlive::Forever,
            client_models: None,
            fault_injection: FaultInjection::default(),
        }
    }
}
