//! What clients of the engine see: requests and their settings, the events a request's stream
//! carries, outputs and per-request stats, and the engine's live stats. Plain data (serde where
//! it crosses a process or the web view), no MLX.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::attention::KvQuantization;
use crate::device::MemoryStats;
pub use crate::error::{ErrorKind, RequestError};
use crate::sample::sampler::SamplingParams;
pub use crate::sample::TokenLogprobs;
use crate::text::chat_template::ChatMessage;
pub use perch_sched::cache_miss::{CacheMiss, ClientModels, ClientTally, MissRecord};
use perch_sched::scheduler::Priority;

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The caller asked to stop.
    Cancelled,
    /// The request failed (reported by the engine; [`generate`] returns `Err` instead).
    Error,
}

/// One generation job.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// Prompt token ids (already chat-templated when it is a chat).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Token ids that end generation, besides the tokenizer's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the text is cut where the first one begins.
    pub stop_strings: Vec<String>,
    /// Prompt tokens per forward pass during prefill (bounds prefill memory).
    pub prefill_step_size: usize,
    /// Keep generating through EOS (benchmarks); `stop_token_ids` still apply.
    pub ignore_eos: bool,
    /// Report log-probabilities with each token: the sampled token's and those of the `n` most
    /// likely tokens (`Some(0)`: the sampled token's only), as OpenAI's `logprobs` /
    /// `top_logprobs`. They are taken after logits processors (bias, repetition penalty) and
    /// before temperature and truncation, as mlx_lm's `generate_step` yields them.
    pub logprobs: Option<usize>,
    /// Generate nothing: return the log-probabilities of every vocabulary token for the position
    /// after the prompt ([`GenerateOutput::next_token_logprobs`]; `log_softmax` of the model's
    /// last logits in float32, no logits processors), as genlm's `next_token_logprobs`.
    pub next_token_logprobs: bool,
    /// Constrain the output to a grammar (JSON, see [`crate::sample::grammar`]); batch engine only
    /// ([`crate::EngineHandle`]); [`generate`] refuses it.
    pub grammar: Option<crate::sample::grammar::Grammar>,
    /// Bound each attention layer's KV cache to this many positions: the first
    /// [`KvLimit::KEEP`] and the most recent ones (mlx_lm's `--max-kv-size`, a
    /// `RotatingKVCache(max_kv_size, keep=4)` per layer). Sliding-window layers keep their own
    /// window. [`generate`], and the engine's batch (bounded rows of its slot caches; such a
    /// request shares no prefix-cache blocks, and its prompt chunks are its own
    /// `prefill_step_size` within the batch's prefill budget, since what a bounded cache reads
    /// depends on where they end).
    pub max_kv_size: Option<usize>,
    /// Quantize the KV cache once it holds [`GenerateRequest::quantized_kv_start`] positions
    /// (mlx_lm's `--kv-bits`, `--kv-group-size`). [`generate`], and the engine's batch: quantized
    /// rows of its float slot caches, which compute what a quantized cache gives but take a
    /// full-precision row's memory (the memory is saved by `EngineConfig`'s KV quantization,
    /// which quantizes the whole pool and then refuses a request's own); such a request shares
    /// no prefix-cache blocks and its prompt chunks are its own, as a bounded one's.
    pub kv_quantization: Option<KvQuantization>,
    /// With `kv_quantization`: positions kept in full precision before the cache is quantized
    /// (mlx_lm's `--quantized-kv-start`; a cache is converted after the forward pass that takes
    /// it to this many positions, as mlx_lm's `maybe_quantize_kv_cache`).
    pub quantized_kv_start: usize,
    /// Speculative decoding with the engine's draft model ([`crate::EngineConfig::draft_model`]),
    /// proposing this many tokens a step (see [`crate::sequence::speculative`]). [`generate`] refuses it
    /// (the CLI calls [`crate::generate_speculative`] with its draft).
    pub num_draft_tokens: Option<usize>,
    /// How long the engine keeps the model's weights in memory once it is idle after this
    /// request (Ollama's per-request `keep_alive`); `None`: the engine's
    /// ([`crate::EngineConfig::keep_alive`]). The last request submitted decides.
    pub keep_alive: Option<KeepAlive>,
    /// Images, in the order the prompt holds their tokens: each one's
    /// [`VisionTower::tokens`](crate::models::vision::VisionTower::tokens) image tokens
    /// ([`VisionTower::image_token_id`](crate::models::vision::VisionTower::image_token_id))
    /// in a row, whose embeddings its features replace. The engine's batch only ([`generate`]
    /// and speculative requests refuse them). Not serialized: a batch divided over ranks sends
    /// their pixel values beside the request ([`crate::engine::follow`]).
    #[serde(skip)]
    pub images: Vec<crate::image_processor::ImageInput>,
    /// Its lane in the batch ([`Priority`]): a higher lane's request is admitted, prefills and
    /// is kept from preemption ahead of lower lanes' (the app's chat asks for
    /// [`Priority::High`]; API requests for what their `priority` says).
    pub priority: Priority,
    /// Prefixes of the prompt to keep in the prefix cache once computed (Anthropic's
    /// `cache_control` breakpoints, OpenAI's `prompt_cache_key`; see
    /// [`perch_sched::prefix_pins`]). Ignored by a request whose KV cache is its own.
    pub cache_pins: Vec<CachePin>,
    /// Who sent it (an API key's fingerprint, a user agent, the app): a prompt is compared
    /// with the same client's previous one to explain a prefix-cache miss
    /// ([`GenerationStats::cache_miss`]).
    pub client: Option<String>,
}

/// A prefix of a request's prompt to keep in the prefix cache ([`GenerateRequest::cache_pins`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachePin {
    /// The prefix's length in tokens (kept in whole blocks: rounded down to one).
    pub tokens: usize,
    /// How long it is kept after the request computed it (or after the last request that
    /// pinned it again).
    pub ttl: std::time::Duration,
    /// A client's key (`prompt_cache_key`): the key's newest prefix replaces the one it pinned
    /// before. Without one, the pin is the prefix's own.
    pub key: Option<String>,
}

impl CachePin {
    /// Anthropic's default time to live: five minutes.
    pub const DEFAULT_TTL: std::time::Duration = std::time::Duration::from_secs(300);
    /// Anthropic's longer one (`"ttl": "1h"`).
    pub const LONG_TTL: std::time::Duration = std::time::Duration::from_secs(3600);
}

/// How long an idle engine keeps its model's weights (and draft model, KV pool and prefix
/// cache) in memory before it unloads them; the next request loads them again (Ollama's
/// `keep_alive`, LM Studio's idle TTL). An unloaded engine keeps its thread, tokenizer and
/// limits: its handle stays valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepAlive {
    /// Unload after this long with no request (zero: as soon as the last request ends).
    Idle(std::time::Duration),
    /// Never unload.
    Forever,
}

impl KeepAlive {
    /// LM Studio's default idle time-to-live: an hour.
    pub const DEFAULT_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);

    /// Ollama's forms: a number of seconds (`300`, `0`), a duration (`5m`, `1h30m`, `90s`;
    /// parsed by `humantime`), and any negative value (`-1`, `-1m`) for never. Errors name the
    /// value and the forms.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let text = text.trim();
        if let Ok(seconds) = text.parse::<f64>() {
            return Self::from_seconds(seconds);
        }
        if let Some(magnitude) = text.strip_prefix('-') {
            return humantime::parse_duration(magnitude)
                .map(|_| Self::Forever)
                .map_err(|_| Self::not_a_duration(text));
        }
        humantime::parse_duration(text)
            .map(Self::capped)
            .map_err(|_| Self::not_a_duration(text))
    }

    /// `seconds` as Ollama reads a number: negative keeps the model loaded; so does anything
    /// longer than [`KeepAlive::NEVER_AFTER`].
    pub fn from_seconds(seconds: f64) -> std::result::Result<Self, String> {
        if seconds.is_nan() {
            return Err("keep_alive is not a number".into());
        }
        if seconds < 0.0 || seconds > Self::NEVER_AFTER.as_secs_f64() {
            return Ok(Self::Forever);
        }
        Ok(Self::Idle(std::time::Duration::from_secs_f64(seconds)))
    }

    /// Longer than this is never: a century.
    pub const NEVER_AFTER: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 86_400);

    fn capped(time: std::time::Duration) -> Self {
        match time > Self::NEVER_AFTER {
            true => Self::Forever,
            false => Self::Idle(time),
        }
    }

    fn not_a_duration(text: &str) -> String {
        format!(
            "keep_alive {text:?} is not a duration: give seconds (300), a duration (5m, \
             1h30m), 0 to unload at once or -1 to keep the model loaded"
        )
    }
}

/// Whether the engine's model is in memory ([`EngineStats::residency`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Residency {
    #[default]
    Loaded,
    /// Unloaded after [`KeepAlive`]'s idle time; the next request loads it again.
    Unloaded,
    /// Being loaded again for a request.
    Loading {
        #[serde(flatten)]
        progress: crate::nn::weights::LoadProgress,
    },
}

impl GenerateRequest {
    /// Prompt tokens per forward pass unless a request says otherwise (mlx-lm's default).
    pub const DEFAULT_PREFILL_STEP_SIZE: usize = 2048;
    /// mlx_lm's `--quantized-kv-start` default.
    pub const DEFAULT_QUANTIZED_KV_START: usize = 5000;

    pub fn new(prompt: Vec<u32>) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            prefill_step_size: Self::DEFAULT_PREFILL_STEP_SIZE,
            ignore_eos: false,
            logprobs: None,
            next_token_logprobs: false,
            grammar: None,
            max_kv_size: None,
            kv_quantization: None,
            quantized_kv_start: Self::DEFAULT_QUANTIZED_KV_START,
            num_draft_tokens: None,
            keep_alive: None,
            images: Vec::new(),
            priority: Priority::Normal,
            cache_pins: Vec::new(),
            client: None,
        }
    }

    /// Whether the engine runs the request beside its batch, with caches of its own
    /// (see [`crate::EngineHandle`]): speculative decoding that the batch does not run, which
    /// is all of it when `batch_drafts` is false (the batch has no draft model: a model or draft
    /// with sliding-window or linear-attention layers), else what
    /// [`GenerateRequest::drafts_in_batch`] leaves out.
    pub fn runs_beside_batch(&self, batch_drafts: bool) -> bool {
        self.num_draft_tokens.is_some() && !(batch_drafts && self.drafts_in_batch())
    }

    /// Whether a speculative request is one the batch's draft model proposes for: greedy or
    /// sampled, without logits processors, log-probabilities, a grammar, images or KV cache
    /// options. Requests with logits processors (penalties, a logit bias: mlx_lm then samples
    /// a verify pass's positions one by one, each after the tokens before it) run beside the
    /// batch.
    pub fn drafts_in_batch(&self) -> bool {
        self.num_draft_tokens.is_some()
            && !self.sampling.has_logits_processors()
            && self.logprobs.is_none()
            && !self.next_token_logprobs
            && self.grammar.is_none()
            && self.images.is_empty()
            && self.max_kv_size.is_none()
            && self.kv_quantization.is_none()
    }
}

/// Timings and counts of one request. Rates are in tokens per second, times in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_prompt_tokens: usize,
    pub prompt_tps: f64,
    pub generation_tokens: usize,
    /// Decode rate over the tokens after the first.
    pub generation_tps: f64,
    /// Time to first token: from the request's start until the first token is known.
    pub ttft_s: f64,
    pub total_s: f64,
    /// MLX's peak memory during the request, in bytes.
    pub peak_memory_bytes: usize,
    /// Speculative decoding ([`generate_speculative`]): tokens the draft model proposed, and
    /// those of them the model accepted (each an emitted token with `from_draft`).
    #[serde(default)]
    pub draft_tokens: usize,
    #[serde(default)]
    pub accepted_draft_tokens: usize,
    /// The engine ended generation before `max_tokens` (finish reason `Length`) for lack of KV
    /// memory: the request's tokens filled the KV pool, or it was preempted and memory did not
    /// come back for it.
    #[serde(default)]
    pub cut_for_memory: bool,
    /// The lane it was scheduled in ([`GenerateRequest::priority`]).
    #[serde(default)]
    pub priority: Priority,
    /// Of the prompt, the tokens its [`GenerateRequest::cache_pins`] keep in the prefix cache
    /// (whole blocks; the longest pin that was taken).
    #[serde(default)]
    pub pinned_prompt_tokens: usize,
    /// A pin that was not taken, and why (a sentence).
    #[serde(default)]
    pub pin_refused: Option<String>,
    /// Why fewer prompt tokens came from the prefix cache than could have
    /// ([`perch_sched::cache_miss`]); `None` when every whole block before the last token did.
    #[serde(default)]
    pub cache_miss: Option<CacheMiss>,
}

impl GenerationStats {
    /// Anthropic's `cache_creation_input_tokens`: the prompt tokens its pins keep that were
    /// computed by this request (not read from the cache).
    pub fn cache_creation_tokens(&self) -> usize {
        self.pinned_prompt_tokens
            .saturating_sub(self.cached_prompt_tokens)
    }
}

impl GenerationStats {
    /// Fills the timing fields from `generated` tokens, the time to the first one and the total
    /// time (seconds); the decode rate counts the tokens after the first.
    pub(crate) fn set_timings(&mut self, generated: usize, ttft_s: f64, total_s: f64) {
        self.generation_tokens = generated;
        self.ttft_s = ttft_s;
        self.total_s = total_s;
        self.prompt_tps = self.prompt_tokens as f64 / ttft_s.max(1e-9);
        self.generation_tps = if generated > 1 {
            (generated - 1) as f64 / (total_s - ttft_s).max(1e-9)
        } else {
            0.0
        };
    }
}

/// A streamed piece of output.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    /// The generated token, or `None` for text released when generation ends (the tail of a
    /// character or of a possible stop string that was held back).
    pub id: Option<u32>,
    /// Text this token completes; may be empty (mid-character, or held back as a possible stop string).
    pub text: String,
    /// When the request asked for them ([`GenerateRequest::logprobs`]).
    pub logprobs: Option<TokenLogprobs>,
    /// A draft model's token the model accepted ([`generate_speculative`]; mlx_lm's `from_draft`).
    pub from_draft: bool,
}

/// The outcome of a finished request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// The stop string that ended generation (finish reason `Stop` without it: a stop token).
    pub stop_string: Option<String>,
    /// For a [`GenerateRequest::next_token_logprobs`] request: `[vocab]` natural-log
    /// probabilities of the next token.
    pub next_token_logprobs: Option<Vec<f32>>,
    pub stats: GenerationStats,
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
    /// The batch admitted the request (once, before its first token; a request that runs beside
    /// the batch sends none): what its prompt read from the prefix cache.
    Admitted { prompt_cache: PromptCacheReport },
    /// The request ended. `error` is set when `finish_reason` is `Error`: what kind of failure
    /// (a request the engine refused before running it, as a prompt longer than the context, or
    /// a failure while running it) and a sentence.
    Finished {
        finish_reason: FinishReason,
        stats: GenerationStats,
        error: Option<RequestError>,
        /// The request's stop string that ended it, when one did.
        stop_string: Option<String>,
        /// A [`GenerateRequest::next_token_logprobs`] request's answer: `[vocab]` natural-log
        /// probabilities of the token after the prompt.
        next_token_logprobs: Option<Vec<f32>>,
    },
}

/// What a request's prompt read from the prefix cache ([`EngineEvent::Admitted`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PromptCacheReport {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// Why fewer came from it than could have ([`GenerationStats::cache_miss`]).
    pub miss: Option<CacheMiss>,
}

impl EngineEvent {
    /// The `Finished` of a request that failed with `error` before producing anything.
    pub(crate) fn failed(error: RequestError) -> Self {
        EngineEvent::Finished {
            finish_reason: FinishReason::Error,
            stats: GenerationStats::default(),
            error: Some(error),
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
    /// Prompt tokens per second over the last [`crate::engine::batch::THROUGHPUT_WINDOW`].
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
    /// Whether the model is in memory, unloaded while idle, or loading again.
    pub residency: Residency,
    /// Each recent client's prefix-cache lookups and last misses, the most recently seen first
    /// ([`GenerateRequest::client`]; since the model loaded).
    pub clients: Vec<ClientTally>,
    /// A model divided over ranks: why the ranks stopped working together, once they did
    /// (every request is then refused with it; the ranks must be started again).
    pub group_stopped: Option<String>,
}

/// How many tokens a request can hold, fixed at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EngineLimits {
    /// The model's context (`max_position_embeddings`): prompt plus generated tokens.
    pub context_length: usize,
    /// Tokens the KV block pool holds (all requests together).
    pub kv_cache_tokens: usize,
    /// The KV cache budget in bytes the pool was sized for: the configured one, or less where
    /// the memory left after loading the model is short ([`crate::memory::kv_budget_within`]).
    pub kv_cache_bytes: usize,
}

impl EngineLimits {
    /// The longest prompt that can run with room for `generate` tokens after it.
    pub fn max_prompt_tokens(&self, generate: usize) -> usize {
        self.context_length
            .min(self.kv_cache_tokens)
            .saturating_sub(generate.max(1))
    }
}

/// The KV block pool's state, for engine stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct KvCacheStats {
    /// Tokens per block.
    pub block_size: usize,
    pub blocks_total: usize,
    /// Blocks in some running sequence's block table or a pinned prefix, or held for its
    /// sliding layers' window (see [`KvBudget`]).
    pub blocks_used: usize,
    /// Free blocks that still hold a cached prefix (reusable until evicted), and blocks the
    /// prefix cache's copies of sliding layers' KV hold (given up before any sequence waits).
    pub blocks_cached_free: usize,
    /// Free blocks holding nothing.
    pub blocks_empty: usize,
    /// Share of admitted prompt tokens found in the prefix cache, 0..=1.
    pub prefix_cache_hit_rate: f64,
    /// Bytes of KV content kept for cached blocks.
    pub prefix_cache_bytes: usize,
    /// Requests preempted (sent back to the queue for recompute) since start.
    pub preemptions: u64,
    /// Prefill slots given up to a higher lane's prompt since start (the request leaves the
    /// batch, its full blocks kept in the prefix cache, and comes back: see
    /// `perch_sched::plan::StepPlan::yield_prefill`).
    #[serde(default)]
    pub prefill_yields: u64,
    /// Tokens of prefixes clients pinned (`cache_control` breakpoints, `prompt_cache_key`: see
    /// [`perch_sched::prefix_pins`]); their blocks count in `blocks_used`.
    #[serde(default)]
    pub pinned_tokens: usize,
    /// The most tokens pins hold together (a share of the pool).
    #[serde(default)]
    pub pinned_tokens_max: usize,
}

/// Where the batch's steps spent their time since start (cumulative), as mlx_lm's
/// `BatchGenerator` counts its prompt and decode time: forward passes and the waits for their
/// results, against the whole steps (admission, slot moves, prefix-cache copies, detokenizing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepTimes {
    pub steps: u64,
    /// Seconds inside [`BatchGenerator::step`].
    pub step_seconds: f64,
    /// Seconds in prefill forward passes until their KV was computed.
    pub prefill_seconds: f64,
    /// Prompt tokens those passes computed (padding excluded).
    pub prefill_tokens: u64,
    /// Seconds putting full blocks into the prefix cache after prefill passes and (for models
    /// with sliding layers) after decode steps: host time (building and dispatching the copies).
    pub publish_seconds: f64,
    /// Seconds planning steps and admitting requests (the scheduler's plan, applying what it
    /// decides, loading prefix-cache hits into the batch; a wait for the step in flight that
    /// a preemption needs is counted in `decode_seconds` and here too).
    #[serde(default)]
    pub schedule_seconds: f64,
    /// Prefill forward passes (one per step, for all the prefill slots).
    pub prefill_passes: u64,
    /// Seconds building and dispatching decode steps (forward pass and sampling) plus the waits
    /// for their tokens to reach the host.
    pub decode_seconds: f64,
    /// The waits alone: near zero when the host is the bottleneck (the device finished each
    /// step before the host asked), most of `decode_seconds` when the device is.
    pub decode_wait_seconds: f64,
    /// Building the steps' graphs (until `async_eval` is called); the rest of `decode_seconds`
    /// less the waits is MLX encoding and launching them.
    pub decode_build_seconds: f64,
    pub decode_steps: u64,
    /// Of `decode_steps`, verify steps of speculative decoding in the batch
    /// ([`crate::spec_decode`]), and the tokens their rows proposed and had accepted.
    pub verify_steps: u64,
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// Of `decode_seconds`, building the draft model's proposals in verify steps (its steps'
    /// graphs, and rows catching up): the device runs them within the verify step's wait.
    pub draft_seconds: f64,
    /// Seconds handing decoded tokens to their requests (detokenizing, stop rules, finishing).
    pub token_seconds: f64,
    /// Shapes run ahead of requests so that MLX meets them first (decode steps at load,
    /// prefill passes while idle; see [`BatchGenerator::warm_up`]), and the seconds they took.
    pub warm_up_shapes: u64,
    pub warm_up_seconds: f64,
    /// Decode steps run through MLX's compiler, warm-up included
    /// ([`crate::EngineConfig::compile_decode`]).
    pub compiled_decode_steps: u64,
}
