//! The engine thread and its handle. The thread owns the model, the tokenizer and every MLX
//! array; the rest of Perch (CLI, app, HTTP API) talks to it through [`EngineHandle`], which is
//! `Clone + Send`: `submit` returns a stream of [`EngineEvent`]s, `cancel` stops a request at the
//! next token, `stats` reports the queue and memory.
//!
//! Nothing a client calls waits for a step: `submit` and `cancel` send a command, `stats` reads
//! the snapshot the thread publishes between steps: after any step that admits, preempts or ends
//! a request (before that step's events are sent, so a client that has seen a request finish
//! sees it counted), at least every [`STATS_INTERVAL`] while tokens stream, and whenever it goes
//! idle. Chat templates are rendered on
//! the caller's thread. A panic inside a step ends every request in the batch with
//! `Finished { Error }` and the thread goes on with a fresh batch (the prefix cache is lost).
//!
//! Scheduling: continuous batching through [`BatchGenerator`]. Between steps the thread reads
//! commands, hands new requests to the batch (which admits them by room and free KV blocks) and
//! drops cancelled ones; each step is admission, prefill chunks and one batched decode step.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::batch::{BatchConfig, BatchEvent, BatchGenerator, KvCacheStats, StepTimes};
use crate::cache::KvQuantization;
use crate::chat_template::ChatMessage;
use crate::device::{memory_stats, Backend, MemoryStats};
use crate::error::{EngineError, Result};
use crate::generate::{FinishReason, GenerateRequest, GenerationStats, TokenEvent, TokenLogprobs};
use crate::kv_cache_manager::RequestId;
use crate::models::{self, Model};
use crate::prompt_cache::{load_prompt_cache, save_prompt_cache};
use crate::slot_cache::SlotAttention;
use crate::speculative::{Draft, SoloSequence};
use crate::tokenizer::Tokenizer;
use crate::weights::LoadProgress;

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
    /// builds a cuDNN attention plan and loads kernels for each new shape (60–110 ms on an H100
    /// at 8 × 128 tokens; `perch bench --concurrency 8` there: TTFT p50 32–49 ms in one pass,
    /// 90–230 ms split in two, 2026-11-24).
    pub arrival_window: std::time::Duration,
    /// Requests that may wait beyond the `max_running` that run: past `max_running +
    /// max_queued_requests` requests in the engine, [`EngineHandle::submit`] answers
    /// [`EngineError::Busy`] at once.
    pub max_queued_requests: usize,
    /// A draft model (a directory in the mlx-community layout) loaded beside the model, for
    /// requests with [`GenerateRequest::num_draft_tokens`] (speculative decoding). Its tokenizer
    /// must be the model's; loading fails otherwise. Such requests run beside the batch, one
    /// round of proposals each per engine step (see [`crate::speculative`]).
    pub draft_model: Option<PathBuf>,
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
            fault_injection: FaultInjection::default(),
        }
    }
}

/// What to generate from: token ids, or a conversation rendered with the chat template.
#[derive(Clone, Debug)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
    /// Continue from a prompt-cache file (Perch's or mlx_lm's, see [`crate::prompt_cache`]) with
    /// these tokens after its prefix, as `mlx_lm.generate --prompt-cache-file` does.
    AfterCache {
        cache_file: PathBuf,
        tokens: Vec<u32>,
    },
}

/// A request as submitted: the prompt plus every per-request setting of [`GenerateRequest`]
/// (whose own `prompt` field is filled in by the engine).
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt: Prompt,
    pub params: GenerateRequest,
}

/// What a request's stream carries, in order: tokens, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// A generated token and the text it completes (may be empty); `id` is `None` for text held
    /// back until the end (see [`crate::TokenEvent`]); `logprobs` when the request asked.
    Token {
        id: Option<u32>,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended. `error` is set when `finish_reason` is `Error`; `refused` when the
    /// engine refused the request before running it, so that the error is about the request
    /// itself (a prompt longer than the context or empty, more KV cache than the budget holds,
    /// invalid sampling settings, a chat template or prompt-cache error), not a failure while
    /// running it.
    Finished {
        finish_reason: FinishReason,
        stats: GenerationStats,
        error: Option<String>,
        refused: bool,
        /// The request's stop string that ended it, when one did.
        stop_string: Option<String>,
        /// A [`GenerateRequest::next_token_logprobs`] request's answer: `[vocab]` natural-log
        /// probabilities of the token after the prompt.
        next_token_logprobs: Option<Vec<f32>>,
    },
}

impl EngineEvent {
    /// The `Finished` of a request refused before it ran, with the reason.
    pub(crate) fn refused(error: String) -> Self {
        EngineEvent::Finished {
            finish_reason: FinishReason::Error,
            stats: GenerationStats::default(),
            error: Some(error),
            refused: true,
            stop_string: None,
            next_token_logprobs: None,
        }
    }
}

/// The engine's state as of its last step (see [`EngineHandle::stats`]).
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    /// Requests admitted (prefilling or decoding).
    pub running: usize,
    /// Requests queued: not admitted yet, or preempted and waiting for recompute.
    pub waiting: usize,
    pub finished_requests: u64,
    /// Prompt tokens per second over the last [`crate::batch::THROUGHPUT_WINDOW`].
    pub prompt_tps: f64,
    /// Generated tokens per second over the same window.
    pub generation_tps: f64,
    /// The KV block pool and prefix cache.
    pub kv_cache: KvCacheStats,
    /// Where the batch's steps spent their time since the model loaded.
    pub step_times: StepTimes,
    pub memory: MemoryStats,
    /// Warm-up passes still queued, run while idle ([`EngineConfig::idle_warm_up`]).
    pub warm_ups_left: usize,
}

enum Command {
    Submit {
        id: RequestId,
        request: Box<EngineRequest>,
        events: Sender<EngineEvent>,
    },
    PromptCache(PromptCacheJob),
    Cancel(RequestId),
    ClearCache(Sender<()>),
    Shutdown,
}

/// How stale the published stats may get while requests only stream tokens.
pub const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Engine threads alive in this process: loading or holding a model.
static LIVE_ENGINES: AtomicUsize = AtomicUsize::new(0);

/// How many engine threads are alive in this process (each loads or holds one model): what
/// shows two models resident at once.
pub fn live_engines() -> usize {
    LIVE_ENGINES.load(Ordering::Acquire)
}

/// Counts an engine thread from its start to its end (panics included).
struct LiveEngine;

impl LiveEngine {
    fn start() -> Self {
        LIVE_ENGINES.fetch_add(1, Ordering::AcqRel);
        LiveEngine
    }
}

impl Drop for LiveEngine {
    fn drop(&mut self) {
        LIVE_ENGINES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How many tokens a request can hold, fixed at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EngineLimits {
    /// The model's context (`max_position_embeddings`): prompt plus generated tokens.
    pub context_length: usize,
    /// Tokens the KV block pool holds (all requests together).
    pub kv_cache_tokens: usize,
}

impl EngineLimits {
    /// The longest prompt that can run with room for `generate` tokens after it.
    pub fn max_prompt_tokens(&self, generate: usize) -> usize {
        self.context_length
            .min(self.kv_cache_tokens)
            .saturating_sub(generate.max(1))
    }
}

/// A cloneable, thread-safe handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    next_id: Arc<AtomicU64>,
    /// Cancels are also recorded here so the running request sees them between tokens, while
    /// the engine thread is busy generating and not reading commands.
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    /// The engine thread and its command channel; the thread is joined by
    /// [`EngineHandle::shutdown`] or when the last handle goes.
    thread: Arc<EngineThreadGuard>,
    tokenizer: Arc<Tokenizer>,
    limits: EngineLimits,
    /// Published by the engine thread after every step.
    stats: Arc<Mutex<EngineStats>>,
    /// Requests submitted and not finished; bounded by `max_requests`.
    outstanding: Arc<AtomicUsize>,
    max_requests: usize,
    /// Whether a draft model is loaded ([`EngineConfig::draft_model`]).
    draft_model: bool,
}

/// A submitted request: its id (for `cancel`) and its event stream.
pub struct RequestStream {
    pub id: RequestId,
    pub events: Receiver<EngineEvent>,
}

impl EngineHandle {
    /// Starts the engine thread and loads the model in `model_dir` there (MLX arrays belong to
    /// the thread that creates them). Returns once the model is loaded and the engine is ready
    /// (its KV pool made and its stats published; on GPUs after the warm-up, which compiles the
    /// decode shapes), or the load's error.
    pub fn load(model_dir: &Path, config: EngineConfig) -> Result<Self> {
        Self::load_with_progress(model_dir, config, |_| {})
    }

    /// [`EngineHandle::load`], calling `progress` (on the engine thread) as the weights are read.
    pub fn load_with_progress(
        model_dir: &Path,
        config: EngineConfig,
        mut progress: impl FnMut(LoadProgress) + Send + 'static,
    ) -> Result<Self> {
        let dir = model_dir.to_path_buf();
        // The prefix cache lives in this engine only, so the directory identifies the model.
        let model_id = dir
            .canonicalize()
            .unwrap_or_else(|_| dir.clone())
            .display()
            .to_string();
        Self::spawn_with(config, model_id, move || {
            Ok((
                models::load_with_progress(&dir, &mut progress)?,
                Tokenizer::load(&dir)?,
            ))
        })
    }

    /// Starts the engine thread with whatever `load` returns, called on that thread; `model_id`
    /// seeds the prefix cache's block hashes.
    pub fn spawn_with(
        config: EngineConfig,
        model_id: String,
        load: impl FnOnce() -> Result<(Box<dyn Model>, Tokenizer)> + Send + 'static,
    ) -> Result<Self> {
        let (commands, inbox) = mpsc::channel();
        let cancelled = Arc::new(Mutex::new(HashSet::new()));
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let outstanding = Arc::new(AtomicUsize::new(0));
        let max_requests = config
            .max_running
            .saturating_add(config.max_queued_requests);
        let draft_model = config.draft_model.is_some();
        let queue = Queue {
            inbox,
            submitted: Vec::new(),
            prompt_cache_jobs: Vec::new(),
            cancelled: Arc::clone(&cancelled),
            finished_requests: 0,
            shutting_down: false,
            outbox: Vec::new(),
            stats: Arc::clone(&stats),
            published_at: Instant::now(),
            outstanding: Arc::clone(&outstanding),
            solo: HashSet::new(),
        };
        let (loaded_tx, loaded_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("perch-engine".into())
            .spawn(move || {
                let _live = LiveEngine::start();
                match load().and_then(|loaded| {
                    // The quantization must fit every layer's head size.
                    if let Some(q) = config.kv_quantization {
                        let info = loaded.0.info();
                        for layer in loaded.0.make_cache(None) {
                            let [_, head_dim] =
                                layer.head_shape().unwrap_or([0, info.head_dim as i32]);
                            KvQuantization::new(q.bits, q.group_size, head_dim)?;
                        }
                    }
                    let draft = match &config.draft_model {
                        Some(dir) => Some(load_draft(dir, loaded.0.as_ref(), &loaded.1)?),
                        None => None,
                    };
                    Ok((loaded, draft))
                }) {
                    Ok(((model, tokenizer), draft)) => {
                        let tokenizer = Arc::new(tokenizer);
                        let pool = BatchConfig::for_budget(
                            model.as_ref(),
                            config.kv_cache_bytes,
                            config.block_size,
                            config.kv_quantization,
                        );
                        let limits = EngineLimits {
                            context_length: model.info().context_length,
                            kv_cache_tokens: crate::kv_cache_manager::max_sequence_tokens(
                                pool.num_blocks,
                                pool.block_size,
                                crate::batch::KvBudget::for_model(
                                    model.as_ref(),
                                    config.kv_quantization,
                                    0,
                                )
                                .window_cost(),
                            ),
                        };
                        let ready = {
                            let tokenizer = Arc::clone(&tokenizer);
                            move || {
                                let _ = loaded_tx.send(Ok((tokenizer, limits)));
                            }
                        };
                        EngineThread {
                            model,
                            draft,
                            tokenizer,
                            model_id,
                            queue,
                            config,
                        }
                        .run(ready);
                        // The model and every array are gone; no kernel may outlive the
                        // thread (see `EngineThreadGuard`).
                        let _ = crate::mlx_ext::synchronize();
                    }
                    Err(err) => {
                        let _ = loaded_tx.send(Err(err));
                    }
                }
            })
            .map_err(|e| EngineError::Io {
                path: "engine thread".into(),
                source: e,
            })?;
        let (tokenizer, limits) = loaded_rx.recv().map_err(|_| EngineError::EngineStopped)??;
        Ok(Self {
            thread: Arc::new(EngineThreadGuard {
                commands,
                thread: Mutex::new(Some(thread)),
            }),
            tokenizer,
            limits,
            next_id: Arc::new(AtomicU64::new(1)),
            cancelled,
            stats,
            outstanding,
            max_requests,
            draft_model,
        })
    }

    /// The loaded model's tokenizer and chat template, shared with the engine thread: clients
    /// count and render tokens with it (token strings for log-probabilities, a completion's text
    /// prompt, token counting) without a round trip through the engine.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Whether a draft model is loaded, for requests with
    /// [`GenerateRequest::num_draft_tokens`].
    pub fn has_draft_model(&self) -> bool {
        self.draft_model
    }

    /// The model's context and the KV pool's size in tokens.
    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// Queues a request; never waits for the engine. A [`Prompt::Chat`] is rendered here, on
    /// the caller's thread. Errors in the request itself (a chat template that fails, an empty
    /// or too long prompt, bad sampling parameters) arrive as a `Finished` event with reason
    /// `Error` and `refused` set. Errors: [`EngineError::Busy`] when `max_running +
    /// max_queued_requests` requests are already in the engine, [`EngineError::EngineStopped`].
    pub fn submit(&self, mut request: EngineRequest) -> Result<RequestStream, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = mpsc::channel();
        let stream = RequestStream {
            id,
            events: receiver,
        };
        if let Prompt::Chat(messages) = &request.prompt {
            match self.tokenizer.encode_chat(messages) {
                Ok(tokens) => request.prompt = Prompt::Tokens(tokens),
                Err(err) => {
                    let _ = events.send(EngineEvent::refused(err.to_string()));
                    return Ok(stream);
                }
            }
        }
        let limit = self.max_requests;
        self.outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| EngineError::Busy { limit })?;
        self.thread
            .commands
            .send(Command::Submit {
                id,
                request: Box::new(request),
                events,
            })
            .map_err(|_| {
                self.outstanding.fetch_sub(1, Ordering::AcqRel);
                EngineError::EngineStopped
            })?;
        Ok(stream)
    }

    /// Stops a request: a waiting one never starts, a running one ends before its next token.
    /// Either way its stream ends with `Finished { finish_reason: Cancelled }`.
    pub fn cancel(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
        let _ = self.thread.commands.send(Command::Cancel(id));
    }

    /// The log-probabilities of every vocabulary token for the position after `token_ids`:
    /// `[vocab]` floats, `log_softmax` of the model's last logits in float32 (genlm's
    /// `next_token_logprobs`). Concurrent calls run batched (see
    /// [`EngineConfig::logprobs_batch_size`]), and a call whose tokens extend an earlier call's
    /// reads the earlier tokens' KV from the prefix cache, its last partial block included, so
    /// scoring a sequence that grows a token at a time computes about one token per call.
    /// Blocks until answered. Errors: the engine's refusal (an empty prompt, one longer than the
    /// context, an id outside the vocabulary) as [`EngineError::Request`], MLX failures.
    pub fn next_token_logprobs(&self, token_ids: Vec<u32>) -> Result<Vec<f32>> {
        let stream = self.submit(Self::scoring_request(token_ids))?;
        Self::scoring_answer(stream)
    }

    /// [`EngineHandle::next_token_logprobs`] for many prompts at once (all submitted before any
    /// is awaited, so they share steps); answers in order.
    pub fn batch_next_token_logprobs(&self, prompts: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>> {
        let streams = prompts
            .into_iter()
            .map(|ids| self.submit(Self::scoring_request(ids)))
            .collect::<Result<Vec<_>, _>>()?;
        streams.into_iter().map(Self::scoring_answer).collect()
    }

    /// The request behind a next-token-logprobs call: `token_ids`, nothing generated.
    pub fn scoring_request(token_ids: Vec<u32>) -> EngineRequest {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = 1;
        params.next_token_logprobs = true;
        EngineRequest {
            prompt: Prompt::Tokens(token_ids),
            params,
        }
    }

    fn scoring_answer(stream: RequestStream) -> Result<Vec<f32>> {
        for event in stream.events {
            if let EngineEvent::Finished {
                next_token_logprobs,
                error,
                ..
            } = event
            {
                return match (next_token_logprobs, error) {
                    (Some(logprobs), _) => Ok(logprobs),
                    (None, error) => Err(EngineError::Request(
                        error.unwrap_or_else(|| "the call was cancelled".into()),
                    )),
                };
            }
        }
        Err(EngineError::EngineStopped)
    }

    /// Empties the prefix cache (every cached block not in use, and the partial blocks kept
    /// for extension), as genlm's `clear_cache`. Answered between steps.
    pub fn clear_cache(&self) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.thread
            .commands
            .send(Command::ClearCache(tx))
            .map_err(|_| EngineError::EngineStopped)?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Queue lengths, throughput, KV blocks and MLX memory as of the engine's last step (or
    /// its last command while idle); never waits for a step. Errors:
    /// [`EngineError::EngineStopped`] once the engine thread has ended.
    pub fn stats(&self) -> Result<EngineStats, EngineError> {
        if self
            .thread
            .thread
            .lock()
            .map_or(true, |t| t.as_ref().is_none_or(|t| t.is_finished()))
        {
            return Err(EngineError::EngineStopped);
        }
        self.stats
            .lock()
            .map(|s| s.clone())
            .map_err(|_| EngineError::EngineStopped)
    }

    /// Computes the KV state of `prompt` (from the prefix cache where it can) and writes it to
    /// `path` (`.safetensors`) in mlx_lm's prompt-cache layout; returns the tokens saved. Its
    /// full blocks also join this engine's prefix cache. Errors: the prompt's (tokenizing, chat
    /// template), MLX's, and [`EngineError::PromptCache`] when the file cannot be written.
    pub fn save_prompt_cache(&self, prompt: Prompt, path: &Path) -> Result<usize> {
        let prompt = match prompt {
            Prompt::Chat(messages) => Prompt::Tokens(self.tokenizer.encode_chat(&messages)?),
            other => other,
        };
        let (reply, answer) = mpsc::channel();
        self.prompt_cache_job(
            PromptCacheJob::Save {
                prompt,
                path: path.to_path_buf(),
                reply,
            },
            answer,
        )
    }

    /// Reads a prompt-cache file written by Perch into the prefix cache, so requests starting
    /// with its tokens skip their prefill; returns the tokens now cached (whole blocks, as many
    /// as the pool has free). Errors: [`EngineError::PromptCache`] for a damaged file, another
    /// model's, or one without token ids (mlx_lm's; use [`Prompt::AfterCache`]).
    pub fn load_prompt_cache(&self, path: &Path) -> Result<usize> {
        let (reply, answer) = mpsc::channel();
        self.prompt_cache_job(
            PromptCacheJob::Load {
                path: path.to_path_buf(),
                reply,
            },
            answer,
        )
    }

    fn prompt_cache_job(
        &self,
        job: PromptCacheJob,
        answer: Receiver<Result<usize>>,
    ) -> Result<usize> {
        self.thread
            .commands
            .send(Command::PromptCache(job))
            .map_err(|_| EngineError::EngineStopped)?;
        answer.recv().map_err(|_| EngineError::EngineStopped)?
    }

    /// Stops the thread after the running request's current token and waits for it; waiting
    /// requests finish as cancelled.
    pub fn shutdown(&self) {
        self.thread.shut_down();
    }
}

/// Owns the engine thread for all of an engine's handles: the last handle dropped stops the
/// thread and waits for it, as [`EngineHandle::shutdown`] does. A process that returns from
/// `main` (after an error, say) must not exit while the engine thread still runs MLX work: on
/// CUDA, the driver's teardown then fails the thread's next stream call and the process aborts
/// ("driver shutting down", exit 134).
struct EngineThreadGuard {
    commands: Sender<Command>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineThreadGuard {
    fn shut_down(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        // Never from the engine thread itself (it would wait for itself).
        if let Some(thread) = thread.filter(|t| t.thread().id() != std::thread::current().id()) {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineThreadGuard {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// A prompt-cache file to write or read, answered with the number of tokens it holds.
enum PromptCacheJob {
    Save {
        prompt: Prompt,
        path: PathBuf,
        reply: Sender<Result<usize>>,
    },
    Load {
        path: PathBuf,
        reply: Sender<Result<usize>>,
    },
}

struct Job {
    id: RequestId,
    request: EngineRequest,
    events: Sender<EngineEvent>,
}

/// Everything the engine thread keeps besides the model and the batch, so it can be borrowed
/// while the batch steps (commands are handled between steps).
struct Queue {
    inbox: Receiver<Command>,
    /// Submitted since the last step; they join the batch before the next one.
    submitted: Vec<Job>,
    prompt_cache_jobs: Vec<PromptCacheJob>,
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    finished_requests: u64,
    shutting_down: bool,
    /// Events of this pass, sent after the pass's stats are published.
    outbox: Vec<(RequestId, Sender<EngineEvent>, EngineEvent)>,
    stats: Arc<Mutex<EngineStats>>,
    /// When `stats` was last replaced.
    published_at: Instant,
    outstanding: Arc<AtomicUsize>,
    /// Ids of the requests running beside the batch (speculative ones, and those with their own
    /// KV cache options; see [`SoloSequence`]).
    solo: HashSet<RequestId>,
}

impl Queue {
    /// Applies one command; `batch` and `jobs` (batch request id -> job) are read for stats and
    /// cancels, only when such a command comes.
    fn handle(
        &mut self,
        command: Command,
        batch: &mut BatchGenerator<'_>,
        jobs: &HashMap<RequestId, Job>,
    ) {
        match command {
            Command::Submit {
                id,
                request,
                events,
            } => self.submitted.push(Job {
                id,
                request: *request,
                events,
            }),
            Command::PromptCache(job) => self.prompt_cache_jobs.push(job),
            Command::Cancel(id) => {
                let known = jobs.values().chain(&self.submitted).any(|job| job.id == id)
                    || self.solo.contains(&id);
                if !known {
                    // Not in the engine: it already finished (a submit always reaches the thread
                    // before a cancel of the id it returned), so drop the mark.
                    if let Ok(mut set) = self.cancelled.lock() {
                        set.remove(&id);
                    }
                }
            }
            Command::ClearCache(reply) => {
                batch.reset_prefix_cache();
                self.publish(batch);
                let _ = reply.send(());
            }
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Submitted next-token-logprobs calls not in the batch yet.
    fn scoring(&self) -> usize {
        self.submitted
            .iter()
            .filter(|job| job.request.params.next_token_logprobs)
            .count()
    }

    /// Handles commands while `wanted` holds, for at most `limit`, until none arrives for `gap`.
    /// False when every handle is gone.
    fn gather(
        &mut self,
        batch: &mut BatchGenerator<'_>,
        jobs: &HashMap<RequestId, Job>,
        limit: std::time::Duration,
        gap: std::time::Duration,
        wanted: impl Fn(&Queue) -> bool,
    ) -> bool {
        let deadline = Instant::now() + limit;
        while wanted(self) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(gap.min(left)) {
                Ok(command) => self.handle(command, batch, jobs),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }

    /// Handles every command already sent, without waiting.
    fn drain(&mut self, batch: &mut BatchGenerator<'_>, jobs: &HashMap<RequestId, Job>) {
        while let Ok(command) = self.inbox.try_recv() {
            self.handle(command, batch, jobs);
        }
    }

    fn mark_cancelled(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
    }

    fn is_cancelled(&self, id: RequestId) -> bool {
        self.cancelled
            .lock()
            .map(|set| set.contains(&id))
            .unwrap_or(false)
    }

    /// Ends a request the engine refused before running it (see [`EngineEvent::Finished`]).
    fn refuse(&mut self, job: &Job, error: String) {
        self.end(job, EngineEvent::refused(error));
    }

    /// Queues a token event of `job` for [`Queue::flush`].
    fn send(&mut self, job: &Job, event: EngineEvent) {
        self.outbox.push((job.id, job.events.clone(), event));
    }

    /// Replaces the published stats with the engine's state now.
    fn publish(&mut self, batch: &mut BatchGenerator<'_>) {
        self.published_at = Instant::now();
        let stats = EngineStats {
            running: batch.num_running() + self.solo.len(),
            waiting: batch.num_waiting() + self.submitted.len(),
            finished_requests: self.finished_requests,
            prompt_tps: batch.prompt_throughput.rate(),
            generation_tps: batch.generation_throughput.rate(),
            kv_cache: batch.kv_stats(),
            step_times: batch.step_times(),
            memory: memory_stats(),
            warm_ups_left: batch.idle_warm_ups_left(),
        };
        if let Ok(mut published) = self.stats.lock() {
            *published = stats;
        }
    }

    /// Publishes the stats, then sends the pass's events: a client that sees a request end
    /// sees it counted.
    fn publish_and_flush(&mut self, batch: &mut BatchGenerator<'_>) {
        self.publish(batch);
        self.flush();
    }

    /// [`Queue::publish_and_flush`] after a step: the stats are published when requests `moved`
    /// (were admitted, preempted or left), a request ended (its `Finished` is in the outbox) or
    /// [`STATS_INTERVAL`] has passed; else only the tokens are sent.
    fn publish_if_due_and_flush(&mut self, batch: &mut BatchGenerator<'_>, moved: bool) {
        let ended = self
            .outbox
            .iter()
            .any(|(_, _, event)| matches!(event, EngineEvent::Finished { .. }));
        if moved || ended || self.published_at.elapsed() >= STATS_INTERVAL {
            self.publish(batch);
        }
        self.flush();
    }

    /// Sends the outbox.
    fn flush(&mut self) {
        for (id, events, event) in std::mem::take(&mut self.outbox) {
            let is_token = matches!(event, EngineEvent::Token { .. });
            // Nobody listens any more: treat as cancelled at the next step.
            if events.send(event).is_err() && is_token {
                self.mark_cancelled(id);
            }
        }
    }

    fn finish(
        &mut self,
        job: &Job,
        finish_reason: FinishReason,
        stats: GenerationStats,
        error: Option<String>,
    ) {
        self.end(
            job,
            EngineEvent::Finished {
                finish_reason,
                stats,
                error,
                refused: false,
                stop_string: None,
                next_token_logprobs: None,
            },
        );
    }

    /// Queues a request's `Finished` (see [`Queue::publish_and_flush`]) and forgets it.
    fn end(&mut self, job: &Job, finished: EngineEvent) {
        self.outbox.push((job.id, job.events.clone(), finished));
        if let Ok(mut set) = self.cancelled.lock() {
            set.remove(&job.id);
        }
        self.finished_requests += 1;
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Loads a draft model and checks it against the model (see [`crate::speculative::Draft`]).
fn load_draft(
    dir: &Path,
    model: &dyn Model,
    tokenizer: &Tokenizer,
) -> Result<(Box<dyn Model>, Tokenizer)> {
    let draft = models::load(dir)?;
    let draft_tokenizer = Tokenizer::load(dir)?;
    if !tokenizer.same_vocabulary(&draft_tokenizer) {
        return Err(EngineError::Request(format!(
            "the draft model {} has another tokenizer than the model: speculative decoding needs \
             a draft of the same family (the same tokens and ids)",
            dir.display()
        )));
    }
    if draft.info().vocab_size > model.info().vocab_size || draft.has_recurrent_layers() {
        return Err(EngineError::Request(format!(
            "the draft model {} cannot draft for this model (a larger vocabulary, or \
             linear-attention layers, whose state cannot be rewound)",
            dir.display()
        )));
    }
    Ok((draft, draft_tokenizer))
}

struct EngineThread {
    model: Box<dyn Model>,
    /// The draft model and its tokenizer, when [`EngineConfig::draft_model`] is set.
    draft: Option<(Box<dyn Model>, Tokenizer)>,
    tokenizer: Arc<Tokenizer>,
    model_id: String,
    queue: Queue,
    config: EngineConfig,
}

impl EngineThread {
    /// Serves until shutdown; `ready` is called once, after the fresh batch's stats are
    /// published, so a client that sees the load finish reads the real KV pool and memory.
    fn run(self, ready: impl FnOnce()) {
        let mut ready = Some(ready);
        let EngineThread {
            model,
            draft,
            tokenizer,
            model_id,
            mut queue,
            config,
        } = self;
        let batch_config = BatchConfig {
            max_running: config.max_running,
            prefill_batch_size: config.prefill_batch_size,
            prefill_token_budget: config.prefill_token_budget,
            slot_attention: config.slot_attention,
            compile_decode: config.compile_decode,
            ..BatchConfig::for_budget(
                model.as_ref(),
                config.kv_cache_bytes,
                config.block_size,
                config.kv_quantization,
            )
        };
        let mut pass = Pass {
            model: model.as_ref(),
            draft: draft.as_ref().map(|(m, t)| (m.as_ref(), t)),
            solo: Vec::new(),
            tokenizer: &tokenizer,
            model_id: &model_id,
            config: &config,
            jobs: HashMap::new(),
            steps: 0,
        };
        let mut warm_up = true;
        loop {
            let mut batch =
                BatchGenerator::new(model.as_ref(), &tokenizer, batch_config.clone(), &model_id);
            if std::mem::take(&mut warm_up) {
                // A warm-up that fails leaves nothing behind; the first request that meets the
                // same failure reports it.
                if Backend::current() != Backend::Cpu {
                    let _ = batch.warm_up();
                }
                if config.idle_warm_up {
                    batch.queue_idle_warm_up();
                }
            }
            // Stats of the fresh batch, then the failed requests' ends (after a panic).
            queue.publish_and_flush(&mut batch);
            if let Some(ready) = ready.take() {
                ready();
            }
            let served =
                std::panic::catch_unwind(AssertUnwindSafe(|| pass.serve(&mut batch, &mut queue)));
            let panic = match served {
                Ok(()) => return,
                Err(panic) => panic,
            };
            // A panic mid-pass: the batch's state is unknown. Its requests end with the panic's
            // message (sent once the next batch is up); the next loop starts a fresh batch (and
            // prefix cache) on the same model.
            let message = format!(
                "the engine failed while running this request ({}); it was stopped and the engine \
                 restarted",
                panic_message(panic.as_ref())
            );
            let solo = std::mem::take(&mut pass.solo).into_iter();
            queue.solo.clear();
            for job in std::mem::take(&mut pass.jobs)
                .into_values()
                .chain(solo.map(|(job, _)| job))
            {
                queue.finish(
                    &job,
                    FinishReason::Error,
                    GenerationStats::default(),
                    Some(message.clone()),
                );
            }
        }
    }
}

/// What a panic carried, as text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// The engine thread's state that outlives a batch: the model, the settings and the requests
/// in the batch (batch request id -> the submitted job it serves, waiting or running).
struct Pass<'m> {
    model: &'m dyn Model,
    /// The draft model and its tokenizer, when loaded.
    draft: Option<(&'m dyn Model, &'m Tokenizer)>,
    /// Requests the batch cannot run (speculative ones, per-sequence KV cache options): each
    /// runs beside it, a step of its own per engine step.
    solo: Vec<(Job, SoloSequence<'m>)>,
    tokenizer: &'m Tokenizer,
    model_id: &'m str,
    config: &'m EngineConfig,
    jobs: HashMap<RequestId, Job>,
    /// Steps run since the model loaded (for [`FaultInjection::panic_at_step`]).
    steps: u64,
}

impl Pass<'_> {
    /// Serves commands and steps the batch until shutdown or the last handle is dropped.
    fn serve(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        let config = self.config;
        loop {
            if batch.is_empty()
                && self.solo.is_empty()
                && queue.submitted.is_empty()
                && queue.prompt_cache_jobs.is_empty()
                && !queue.shutting_down
            {
                // Idle: sleep until a command arrives; a dropped last handle ends the thread.
                queue.publish_and_flush(batch);
                // Queued warm-up passes run one at a time while no command waits.
                let command = loop {
                    if batch.idle_warm_ups_left() == 0 {
                        break queue.inbox.recv().ok();
                    }
                    match queue.inbox.try_recv() {
                        Ok(command) => break Some(command),
                        Err(mpsc::TryRecvError::Empty) => {
                            // A failed pass ends the warm-up; requests meet the failure anew.
                            let _ = batch.warm_up_idle();
                            queue.publish_and_flush(batch);
                        }
                        Err(mpsc::TryRecvError::Disconnected) => break None,
                    }
                };
                match command {
                    Some(command) => queue.handle(command, batch, &self.jobs),
                    None => return,
                }
                // A next-token-logprobs call waits briefly for others to share its step.
                let timeout = config.logprobs_batch_timeout;
                let scoring = |q: &Queue| (1..config.logprobs_batch_size).contains(&q.scoring());
                // A burst of requests starts together (see `EngineConfig::arrival_window`).
                let window = config.arrival_window;
                let burst = |q: &Queue| {
                    !window.is_zero() && (1..config.max_running).contains(&q.submitted.len())
                };
                if !queue.gather(batch, &self.jobs, timeout, timeout, scoring)
                    || !queue.gather(batch, &self.jobs, window * 4, window, burst)
                {
                    return;
                }
            }
            queue.drain(batch, &self.jobs);
            self.prompt_cache_jobs(batch, queue);
            // New requests count as running (or waiting) before their first step ends.
            let arrived = !queue.submitted.is_empty();
            self.admit(batch, queue);

            // Cancelled (or no longer listened to) requests leave before the next step.
            let leaving: Vec<RequestId> = self
                .jobs
                .iter()
                .filter(|(_, job)| queue.shutting_down || queue.is_cancelled(job.id))
                .map(|(id, _)| *id)
                .collect();
            for id in leaving {
                let job = self.jobs.remove(&id).expect("listed above");
                match batch.remove(id) {
                    Ok(output) => queue.finish(
                        &job,
                        FinishReason::Cancelled,
                        output.map(|o| o.stats).unwrap_or_default(),
                        None,
                    ),
                    Err(err) => queue.finish(
                        &job,
                        FinishReason::Error,
                        GenerationStats::default(),
                        Some(err.to_string()),
                    ),
                }
            }
            for (job, sequence) in std::mem::take(&mut self.solo) {
                if queue.shutting_down || queue.is_cancelled(job.id) {
                    queue.solo.remove(&job.id);
                    let stats = sequence
                        .finish(self.tokenizer, &mut |_| ControlFlow::Continue(()))
                        .map(|o| o.stats)
                        .unwrap_or_default();
                    queue.finish(&job, FinishReason::Cancelled, stats, None);
                } else {
                    self.solo.push((job, sequence));
                }
            }
            if queue.shutting_down {
                queue.publish_and_flush(batch);
                return;
            }
            // Refused and cancelled requests hear of it now, not after the step.
            if arrived || !queue.outbox.is_empty() {
                queue.publish_and_flush(batch);
            }
            let queues = |b: &BatchGenerator<'_>| (b.num_running(), b.num_waiting());
            let before = queues(batch);
            if !batch.is_empty() {
                self.step(batch, queue);
            }
            self.step_solo(batch, queue);
            let moved = queues(batch) != before;
            queue.publish_if_due_and_flush(batch, moved);
        }
    }

    fn prompt_cache_jobs(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        for job in std::mem::take(&mut queue.prompt_cache_jobs) {
            match job {
                PromptCacheJob::Save {
                    prompt,
                    path,
                    reply,
                } => {
                    let saved = tokens_of(&prompt, self.tokenizer).and_then(|tokens| {
                        // Checked before the prefix is computed for nothing.
                        if let Some(reason) = crate::prompt_cache::unsupported_reason(self.model) {
                            return Err(EngineError::PromptCache {
                                path: path.clone(),
                                message: reason.into(),
                            });
                        }
                        let cache = batch
                            .compute_prefix(&tokens, GenerateRequest::DEFAULT_PREFILL_STEP_SIZE)?;
                        save_prompt_cache(
                            &path,
                            &cache,
                            &tokens,
                            self.model_id,
                            batch.config().block_size,
                        )?;
                        Ok(tokens.len())
                    });
                    let _ = reply.send(saved);
                }
                PromptCacheJob::Load { path, reply } => {
                    let loaded =
                        load_prompt_cache(&path, self.model, self.model_id).and_then(|prefix| {
                            let refused = |why: &str| EngineError::PromptCache {
                                path: path.clone(),
                                message: format!("{why}; submit it as Prompt::AfterCache instead"),
                            };
                            let block_size = batch.config().block_size;
                            match (&prefix.tokens, prefix.why_not_in_prefix_cache(block_size)) {
                                (Some(_), Some(why)) => Err(refused(&why)),
                                (Some(tokens), None) => batch.import_prefix(tokens, &prefix.layers),
                                (None, _) => Err(refused(
                                    "it does not record its token ids (an mlx_lm file)",
                                )),
                            }
                        });
                    let _ = reply.send(loaded);
                }
            }
        }
    }

    /// Hands the submitted requests to the batch (or refuses them).
    fn admit(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        for job in std::mem::take(&mut queue.submitted) {
            let params = &job.request.params;
            if params.num_draft_tokens.is_some() || params.has_single_stream_kv_options() {
                match self.start_solo(&job) {
                    Ok(sequence) => {
                        queue.solo.insert(job.id);
                        self.solo.push((job, sequence));
                    }
                    Err(err) => queue.refuse(&job, err.to_string()),
                }
                continue;
            }
            let inserted = match &job.request.prompt {
                Prompt::AfterCache { cache_file, tokens } => {
                    load_prompt_cache(cache_file, self.model, self.model_id).and_then(|prefix| {
                        let mut request = job.request.params.clone();
                        request.prompt = tokens.clone();
                        batch.insert_after_prefix(request, prefix)
                    })
                }
                prompt => tokens_of(prompt, self.tokenizer).and_then(|tokens| {
                    let mut request = job.request.params.clone();
                    request.prompt = tokens;
                    batch.insert(request)
                }),
            };
            match inserted {
                Ok(id) => {
                    self.jobs.insert(id, job);
                }
                Err(err) => queue.refuse(&job, err.to_string()),
            }
        }
    }
}

impl<'m> Pass<'m> {
    /// The sequence of a request that runs beside the batch (checked; nothing runs yet): a
    /// speculative one, or one with per-sequence KV cache options.
    fn start_solo(&self, job: &Job) -> Result<SoloSequence<'m>> {
        let draft = match (job.request.params.num_draft_tokens, self.draft) {
            (None, _) => None,
            (Some(num_draft_tokens), Some((model, tokenizer))) => Some(Draft {
                model,
                tokenizer,
                num_draft_tokens,
            }),
            (Some(_), None) => {
                return Err(EngineError::Request(
                    "no draft model is loaded: speculative decoding needs one (the engine's \
                     draft_model, `perch serve --draft-model`)"
                        .into(),
                ))
            }
        };
        let mut request = job.request.params.clone();
        request.prompt = match &job.request.prompt {
            Prompt::AfterCache { cache_file, .. } => {
                return Err(EngineError::PromptCache {
                    path: cache_file.clone(),
                    message: "a speculative request, or one with its own KV cache options, cannot \
                              start from a prompt cache"
                        .into(),
                })
            }
            prompt => tokens_of(prompt, self.tokenizer)?,
        };
        // Its prompt goes in chunks no larger than the batch's prefill budget, one per step,
        // so that running streams keep their pace.
        request.prefill_step_size = request
            .prefill_step_size
            .min(self.config.prefill_token_budget.max(1));
        SoloSequence::new(self.model, draft.as_ref(), self.tokenizer, &request)
    }

    /// One step of every request beside the batch (a prompt chunk, a token, or a round of
    /// proposals); their events go to the outbox.
    fn step_solo(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        // By index, the sequences staying in `self.solo` while they step: a panic mid-step
        // finds every request there (see `EngineThread::run`).
        let mut i = 0;
        while i < self.solo.len() {
            let (job, sequence) = &mut self.solo[i];
            let job = &*job;
            let mut tokens = 0;
            let mut send = |event: &TokenEvent| {
                tokens += event.id.is_some() as usize;
                queue.send(job, token_message(event));
                ControlFlow::Continue(())
            };
            let stepped = sequence.step(self.tokenizer, &mut send);
            batch.generation_throughput.record(tokens);
            if let Ok(false) = stepped {
                i += 1;
                continue;
            }
            let (job, sequence) = self.solo.remove(i);
            queue.solo.remove(&job.id);
            let mut send = |event: &TokenEvent| {
                queue.send(&job, token_message(event));
                ControlFlow::Continue(())
            };
            let output = stepped.and_then(|_| sequence.finish(self.tokenizer, &mut send));
            match output {
                Ok(output) => queue.end(&job, finished_event(output)),
                Err(err) => queue.finish(
                    &job,
                    FinishReason::Error,
                    GenerationStats::default(),
                    Some(err.to_string()),
                ),
            }
        }
    }

    /// One batch step; its events go to the outbox.
    fn step(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        self.steps += 1;
        let faults = &self.config.fault_injection;
        if !faults.step_delay.is_zero() {
            std::thread::sleep(faults.step_delay);
        }
        if faults.panic_at_step == Some(self.steps) {
            panic!("fault injected at step {}", self.steps);
        }
        match batch.step() {
            Ok(events) => {
                for event in events {
                    match event {
                        BatchEvent::Token { request, event } => {
                            let job = self.jobs.get(&request).expect("event of a running request");
                            let message = EngineEvent::Token {
                                id: event.id,
                                text: event.text,
                                logprobs: event.logprobs,
                            };
                            queue.send(job, message);
                        }
                        BatchEvent::Finished { request, output } => {
                            let job = self
                                .jobs
                                .remove(&request)
                                .expect("finished request was running");
                            queue.end(&job, finished_event(output));
                        }
                    }
                }
            }
            Err(err) => {
                // An MLX failure mid-step leaves the batch's caches unusable: fail its requests,
                // every one the batch held (a request being admitted when the step failed is in
                // neither its running nor its waiting list, but still has a job).
                let message = err.to_string();
                batch.clear();
                for (_, job) in self.jobs.drain() {
                    queue.finish(
                        &job,
                        FinishReason::Error,
                        GenerationStats::default(),
                        Some(message.clone()),
                    );
                }
            }
        }
    }
}

/// The end of a request that ran to its end (stopped, cut or cancelled).
fn finished_event(output: crate::GenerateOutput) -> EngineEvent {
    EngineEvent::Finished {
        finish_reason: output.finish_reason,
        stats: output.stats,
        error: None,
        refused: false,
        stop_string: output.stop_string,
        next_token_logprobs: output.next_token_logprobs,
    }
}

/// A generated token's event for its stream.
fn token_message(event: &TokenEvent) -> EngineEvent {
    EngineEvent::Token {
        id: event.id,
        text: event.text.clone(),
        logprobs: event.logprobs.clone(),
    }
}

/// The token ids of a prompt given as tokens or as a chat.
fn tokens_of(prompt: &Prompt, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Tokens(ids) => Ok(ids.clone()),
        Prompt::Chat(messages) => tokenizer.encode_chat(messages),
        Prompt::AfterCache { cache_file, .. } => Err(EngineError::PromptCache {
            path: cache_file.clone(),
            message: "only token ids or a chat can be saved as a prompt cache".into(),
        }),
    }
}
