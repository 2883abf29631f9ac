//! Continuous batching over a block-pool KV cache (mlx-lm's `BatchGenerator`: `insert`, `step`,
//! `remove`; vLLM v1's scheduler for admission, prefix caching and preemption).
//!
//! Each step: every sequence whose prompt is in its cache gets a block for the token it feeds
//! (when none is free, the newest running request is preempted: it goes back to the front of the
//! queue and is recomputed later, mostly from the prefix cache, since its full blocks are
//! published first); waiting requests are admitted while the batch has room and the block pool
//! has blocks for their prompts (reusing the longest cached prefix); one prefill pass runs over
//! up to `prefill_batch_size` sequences still prefilling; then one batched decode step of every
//! sequence whose prompt is in its cache. The scheduler ([`perch_sched::plan::schedule`]) makes
//! all of those decisions before anything runs and returns them as one value, a [`StepPlan`]
//! (vLLM v1's `SchedulerOutput`), which this module executes through the model runner
//! (`worker::runner`: forward passes, slot caches, sampling, the decode step in flight) and joins
//! with the sequences, the block pool and the prefix cache.
//!
//! Sequences compute in the runner's slot caches (`kv::slot_cache`: a prefill one for prompt
//! chunks, a decode one for a token per row), each row at its own positions, so a row of the
//! batch computes what the sequence computes alone (see `kv_cache_manager.rs` for why the pool is
//! not read on every step). The block tables account for that memory; full blocks are copied
//! into the [`BlockStore`] once, when registered in the prefix cache, and copied out on a hit.
//!
//! Inter-token latency: while any sequence is decoding, a step prefills at most
//! `prefill_token_budget` prompt tokens in all (vLLM's chunked-prefill token budget), so a long
//! prompt delays running streams by one such slice per token, never by the whole prompt; with
//! nobody decoding, prefill runs in whole `prefill_step_size` chunks. The bound on a running
//! stream's wait is one decode step plus one budget-sized slice of prefill at the deepest context
//! being prefilled (mlx_lm's `BatchGenerator` prefills whole 2,048-token chunks: on a CPU, a p95
//! ITL seven times longer with four long prompts arriving).

pub(crate) mod lockstep;

use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{Array, Dtype};

use crate::api::KvCacheStats;
use crate::api::{
    CachePin, FinishReason, GenerateOutput, GenerateRequest, PromptCacheReport, TokenEvent,
};
use crate::api::{StepTimes, TokenLogprobs};
use crate::attention::KvQuantization;
use crate::device::Backend;
use crate::engine::images::{self, SequenceImage};
use crate::error::{EngineError, Result};
use crate::kv::block_store::BlockStore;
use crate::kv::cache::{KvCache, KvLimit};
use crate::kv::slot_cache::{CopyIndices, RowKv, RowQuantization, SlotAttention, SlotKvCache};
use crate::kv::tail_cache::{Tail, TailCache};
use crate::models::Model;
use crate::output::{Pushed, TokenSink};
use crate::prompt_cache::{self, PromptCache};
use crate::sample::grammar::GrammarState;
use crate::sample::sampler::Sampler;
use crate::sample::RecentTokens;
use crate::sequence::generate::{check_request, kv_options};
use crate::sequence::speculative::{check_num_draft_tokens, Draft};
use crate::spec_decode;
use crate::spec_decode::ngram::{Backoff, PromptLookup};
use crate::spec_decode::policy::SpecPolicy;
use crate::text::tokenizer::Tokenizer;
use crate::worker::draft::{DraftRow, DraftRunner};
use crate::worker::runner::{DecodeRow, FedRow, ModelRunner, Proposed, Slot};
use lockstep::{BatchCall, Lockstep, Stage};
use perch_sched::block_pool::{BlockHash, BlockId, BlockPool};
use perch_sched::budget::KvBudget;
use perch_sched::cache_miss::{explain_miss, ClientHistory, ClientModels, ClientTally, Lookup};
use perch_sched::kv_cache_manager::{
    BlockContents, ComputedBlocks, KvCacheManager, PinOutcome, RequestId,
};
use perch_sched::plan::{self, Admission, Decision, SlotKind, StepLimits, StepPlan};
use perch_sched::scheduler;
use perch_sched::scheduler::{PrefillShape, Priority, Progress};
use perch_sched::throughput::ThroughputWindow;

/// Span of the engine's tok/s rates.
pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(5);

/// Limits of the batch and size of its KV block pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BatchConfig {
    /// Most sequences running at once, prefilling or decoding (mlx-lm's `completion_batch_size`).
    pub max_running: usize,
    /// Sequences that advance their prefill by one chunk in each step (mlx-lm's
    /// `prefill_batch_size`); each chunk is `prefill_step_size` tokens of its request.
    pub prefill_batch_size: usize,
    /// While some sequence is decoding, the most prompt tokens one step prefills (over all
    /// chunks): the bound on how long a prompt arriving makes running streams wait.
    pub prefill_token_budget: usize,
    /// A sequence takes a prefill slot only while the prompt
    /// tokens left of every sequence in a slot fit `prefill_token_budget` (the first one
    /// excepted; [`scheduler::take_prefill_slots`]), so a long prompt prefills alone and is
    /// answered first. On by default on CPU, where a pass of the budget's tokens already keeps
    /// the cores busy and more rows only make every prompt wait for all of them; off on GPUs,
    /// whose passes gain from more rows.
    pub prefill_fits_budget: bool,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool: with the block size, the KV cache capacity in tokens.
    pub num_blocks: usize,
    /// Bytes the prefix cache keeps of the layers whose cache per sequence is bounded
    /// (sliding-window layers' KV, linear-attention layers' recurrent states), least recently
    /// used dropped first: beyond them a cached block keeps its full-attention layers' KV only
    /// (see `crate::kv::block_store`). 0 for models without such layers.
    pub bounded_layer_bytes: usize,
    /// Quantize every KV cache (running sequences and cached blocks); `None` keeps the compute
    /// dtype.
    pub kv_quantization: Option<KvQuantization>,
    /// How steps read the slot caches (the backend decides by default).
    pub slot_attention: SlotAttention,
    /// Run decode steps through MLX's compiler ([`crate::worker::compiled`]); on by default on GPUs,
    /// where a decode step is bound by the host.
    pub compile_decode: bool,
    /// Prompt lookup (n-gram) speculative decoding ([`crate::spec_decode`]): while at most
    /// [`PromptLookup::max_rows`] rows decode and every one is greedy over a plain KV cache, a
    /// row whose last tokens occurred earlier in its tokens feeds what followed them as
    /// proposals, and a verify step keeps those the model agrees with. Models with sliding
    /// layers or recurrent states, sampled rows, log-probabilities, grammars and bounded or
    /// quantized rows decode a token a step. `None`: off.
    pub prompt_lookup: Option<PromptLookup>,
    /// The budget was lowered to fit the memory left after loading (errors say so).
    pub lowered_for_memory: Option<crate::memory::LoweredBudget>,
    /// The pool's blocks pay for a draft model's KV too ([`BatchConfig::counting_draft`]): a
    /// prompt too long for the pool is then said to share it with the draft.
    pub draft_kv_counted: bool,
}

impl BatchConfig {
    /// Large enough for GEMM efficiency on CPU (the kernels reach ~100 GFLOP/s from ~256 rows),
    /// small enough that a slice costs a few decode steps.
    pub const DEFAULT_PREFILL_TOKEN_BUDGET: usize = 256;

    /// Sequences that prefill in one step: 8 (mlx_lm's `prefill_batch_size`) on every backend,
    /// within the step's token budget: short prompts share a pass, which fills a GPU and, on CPU,
    /// gives the matmuls enough rows (a 32-token chunk alone leaves one of two cores idle).
    pub fn default_prefill_batch_size(_backend: Backend) -> usize {
        8
    }

    /// On CPU only (see [`BatchConfig::prefill_fits_budget`]).
    pub fn default_prefill_fits_budget(backend: Backend) -> bool {
        backend == Backend::Cpu
    }

    /// [`BatchConfig::DEFAULT_PREFILL_TOKEN_BUDGET`] on CPU; 2,048 on a GPU, where a step of a
    /// 1B model over 2,048 prompt tokens takes milliseconds.
    pub fn default_prefill_token_budget(backend: Backend) -> usize {
        match backend {
            Backend::Cpu => Self::DEFAULT_PREFILL_TOKEN_BUDGET,
            Backend::Metal | Backend::Cuda => 2048,
        }
    }

    /// Default limits with a pool sized to `kv_cache_bytes` for `model` (see
    /// [`kv_bytes_per_token`]).
    pub fn for_budget(
        model: &dyn Model,
        kv_cache_bytes: usize,
        block_size: usize,
        kv_quantization: Option<KvQuantization>,
    ) -> Self {
        let block_size = block_size.max(1);
        let budget = kv_budget_for_model(model, kv_quantization, kv_cache_bytes);
        let num_blocks = budget.pool_bytes / (budget.block_bytes_per_token * block_size).max(1);
        Self {
            max_running: 32,
            prefill_batch_size: Self::default_prefill_batch_size(Backend::current()),
            prefill_token_budget: Self::default_prefill_token_budget(Backend::current()),
            prefill_fits_budget: Self::default_prefill_fits_budget(Backend::current()),
            block_size,
            num_blocks,
            bounded_layer_bytes: budget.bounded_bytes,
            kv_quantization,
            slot_attention: SlotAttention::Auto,
            compile_decode: Self::default_compile_decode(Backend::current()),
            prompt_lookup: None,
            lowered_for_memory: None,
            draft_kv_counted: false,
        }
    }

    /// Compiled decode steps on a GPU (Metal, CUDA); not on CPU, where MLX's compiler would
    /// build its fused kernels with the system's C++ compiler.
    pub fn default_compile_decode(backend: Backend) -> bool {
        backend != Backend::Cpu
    }

    /// This configuration with the pool's blocks also paying for `draft`'s KV, where the draft
    /// proposes inside the batch ([`drafts_in_batch`]): as vLLM sizes its blocks over the
    /// target's and the draft's layers, a pooled token costs both models' KV, so the pool has
    /// `num_blocks · m / (m + d)` blocks (`m`, `d`: [`kv_bytes_per_token`] of the model in
    /// this KV format and of the draft, whose rows are never quantized). A conservative bound:
    /// the draft holds rows only for the sequences that draft. Unchanged without a draft, or
    /// when it runs beside the batch.
    pub fn counting_draft(self, model: &dyn Model, draft: Option<&dyn Model>) -> Self {
        let Some(draft) = draft.filter(|d| drafts_in_batch(model, *d)) else {
            return self;
        };
        let m = kv_bytes_per_token(model, self.kv_quantization).max(1);
        let d = kv_bytes_per_token(draft, None);
        Self {
            num_blocks: ((self.num_blocks as u128 * m as u128) / (m + d) as u128) as usize,
            draft_kv_counted: true,
            ..self
        }
    }
}

/// Whether `draft` proposes inside the batch for `model` ([`BatchGenerator::with_draft`]): both
/// without sliding-window layers, whose rows cannot be rewound. Linear-attention layers can:
/// the model's recurrent states go back over its verify step, a draft's to where its row was
/// before proposing ([`crate::worker::draft::DraftRunner::settle`]).
pub fn drafts_in_batch(model: &dyn Model, draft: &dyn Model) -> bool {
    !model.has_sliding_window_layers() && !draft.has_sliding_window_layers()
}

/// KV cache bytes one token takes across all layers: keys and values of `layers * kv_heads`
/// head vectors of `head_dim` values, in the compute dtype or quantized (packed values plus a
/// scale and bias per group). SmolLM2-135M on CPU: 46,080 bytes in float32, 12,960 with 8-bit
/// and 7,200 with 4-bit quantization (group size 64). Linear-attention layers (hybrid models)
/// hold no KV and are not counted (their states are budgeted apart, see `crate::kv::block_store`).
pub fn kv_bytes_per_token(model: &dyn Model, kv_quantization: Option<KvQuantization>) -> usize {
    kv_bytes_by_layer(model, kv_quantization)
        .iter()
        .map(|(bytes, _)| bytes)
        .sum()
}

/// [`KvBudget::split`] for `model`'s caches ([`kv_bytes_by_layer`]).
pub fn kv_budget_for_model(
    model: &dyn Model,
    kv_quantization: Option<KvQuantization>,
    budget: usize,
) -> KvBudget {
    let layers = kv_bytes_by_layer(model, kv_quantization);
    let bytes = |sliding: bool| -> usize {
        layers
            .iter()
            .filter(|(_, window)| window.is_some() == sliding)
            .map(|(bytes, _)| bytes)
            .sum()
    };
    let window = layers.iter().filter_map(|(_, w)| *w).max();
    KvBudget::split(
        budget,
        bytes(false),
        bytes(true),
        window.map(|w| w.max(1) as usize),
        model.has_recurrent_layers(),
    )
}

/// [`kv_bytes_per_token`] by cache layer that holds positions (linear-attention layers left
/// out), with each layer's sliding window.
fn kv_bytes_by_layer(
    model: &dyn Model,
    kv_quantization: Option<KvQuantization>,
) -> Vec<(usize, Option<i32>)> {
    let info = model.info();
    let dtype_bytes = match Backend::current().compute_dtype(Dtype::Float32) {
        Dtype::Float32 => 4,
        _ => 2,
    };
    model
        .make_cache(None)
        .iter()
        .filter(|layer| !layer.is_recurrent())
        .map(|layer| {
            let [kv_heads, head_dim] = layer
                .head_shape()
                .map_or([info.num_kv_heads, info.head_dim], |[h, d]| {
                    [h as usize, d as usize]
                });
            let per_vector = match kv_quantization {
                None => head_dim * dtype_bytes,
                Some(q) => q.bytes_per_vector(head_dim, dtype_bytes),
            };
            (2 * kv_heads * per_vector, layer.window())
        })
        .collect()
}

/// The bytes a forward pass's activations take at their peak, estimated from `model`'s shapes
/// ([`crate::models::ModelInfo`]) for `tokens` new tokens over `rows` rows, each attending over
/// at most `context` positions: per token, the residual stream and its normed copies (4 ×
/// hidden), the query, key and value projections and the feed-forward hidden (3 × its width:
/// gate, up and their product), one layer's at a time, in the compute dtype; attention's scores
/// and their softmax for every query head (2 × heads × tokens × context in the compute dtype)
/// where MLX materializes them ([`attention_materializes_scores`]); and float32 logits of each
/// row's last position. An estimate for admission, not a measurement: MLX's allocator rounds
/// buffers up and a graph may hold more at once.
pub fn step_activation_bytes(
    model: &dyn Model,
    (tokens, rows, context): (usize, usize, usize),
) -> usize {
    let info = model.info();
    let dtype_bytes = match Backend::current().compute_dtype(Dtype::Float32) {
        Dtype::Float32 => 4,
        _ => 2,
    };
    let projections = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim;
    let per_token = dtype_bytes * (4 * info.hidden_size + projections + 3 * info.mlp_width);
    let scores = match attention_materializes_scores(Backend::current(), info.head_dim) {
        true => (2 * dtype_bytes)
            .saturating_mul(info.num_heads)
            .saturating_mul(tokens)
            .saturating_mul(context),
        false => 0,
    };
    tokens
        .saturating_mul(per_token)
        .saturating_add(scores)
        .saturating_add(4 * rows * info.vocab_size)
}

/// Whether a prompt chunk's attention builds its scores in memory: on the CPU (MLX's
/// `scaled_dot_product_attention` has no CPU kernel and runs its unfused fallback) and on Metal
/// for head sizes its fused prompt kernel lacks (MLX 0.32: it has 64, 80 and 128); CUDA's
/// prompt chunks stay fused in cuDNN (and its device memory is not judged here).
pub fn attention_materializes_scores(backend: Backend, head_dim: usize) -> bool {
    match backend {
        Backend::Cpu => true,
        Backend::Metal => !matches!(head_dim, 64 | 80 | 128),
        Backend::Cuda => false,
    }
}

/// One pass of the idle warm-up ([`BatchGenerator::queue_idle_warm_up`]).
#[derive(Clone, Copy, Debug)]
enum IdleWarmUp {
    Prefill(PrefillShape),
    /// A decode step of one sequence of this many positions.
    Decode {
        positions: usize,
    },
}

/// What a step produced for one request.
#[derive(Debug)]
pub enum BatchEvent {
    /// The request was admitted for the first time, reading this from the prefix cache.
    Admitted {
        request: RequestId,
        prompt_cache: PromptCacheReport,
    },
    Token {
        request: RequestId,
        event: TokenEvent,
    },
    /// The request is done and has left the batch.
    Finished {
        request: RequestId,
        output: Box<GenerateOutput>,
    },
    /// The request left the batch unfinished: its KV cache does not fit in the memory left
    /// with nothing else running ([`BatchGenerator::set_memory_headroom`]).
    Refused {
        request: RequestId,
        error: EngineError,
    },
}

/// A decode step as prompt lookup's choice measures it ([`SpecPolicy`]).
struct DecodedStep {
    rows: usize,
    /// A verify step, or a plain one.
    verified: bool,
    /// Tokens it produced: one a row for a plain step (handed out by the step after it), the
    /// emitted ones for a verify step.
    tokens: usize,
    /// Of the step's time, the wait for the plain step in flight before it: that step's.
    previous_seconds: f64,
}

/// What [`SpecPolicy`] learns from a decode step (a [`DecodedStep`] and the step's own time),
/// in whole nanoseconds: rank 0 of a divided model records its own and sends it with its next
/// step's call, and the other ranks record that one in place of theirs, so that every rank
/// chooses between verify and plain steps alike (each rank's clock would choose its own way).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StepTiming {
    rows: usize,
    verified: bool,
    tokens: usize,
    own_nanos: u64,
    previous_nanos: u64,
}

impl StepTiming {
    fn new(step: &DecodedStep, seconds: f64) -> Self {
        let nanos = |s: f64| (s.max(0.0) * 1e9) as u64;
        Self {
            rows: step.rows,
            verified: step.verified,
            tokens: step.tokens,
            own_nanos: nanos(seconds - step.previous_seconds),
            previous_nanos: nanos(step.previous_seconds),
        }
    }

    fn record(&self, policy: &mut SpecPolicy) {
        let seconds = |nanos: u64| nanos as f64 / 1e9;
        policy.record(
            self.rows,
            self.verified,
            self.tokens,
            seconds(self.own_nanos),
        );
        policy.charge_plain(self.rows, seconds(self.previous_nanos));
    }
}

struct Sequence {
    id: RequestId,
    request: GenerateRequest,
    /// Prompt then generated tokens: what the KV cache must hold, up to the last one.
    tokens: Vec<u32>,
    /// One per layer; empty while waiting, and while the sequence is in a slot.
    cache: Vec<KvCache>,
    /// What it asks of its KV cache: a bound (`max_kv_size`) or a quantization (`kv_bits` from
    /// `quantized_kv_start`). Either makes its rows of the slot caches bounded or quantized ones
    /// (see `kv::slot_cache`), and its KV then is its own: it shares no block with the prefix
    /// cache and its prompt goes in its own chunks (where they end decides what it holds).
    kv: RowKv,
    /// Its row of one of the batch's slot caches (`None` until it takes one).
    slot: Option<Slot>,
    /// Tokens in `cache` (all but the last of `tokens` once prefill is done).
    computed: usize,
    /// Leading full blocks already registered in the prefix cache.
    published_blocks: usize,
    /// A hybrid model's recurrent states at the last block boundary a decode step crossed:
    /// `(tokens, per layer what [`KvCache::block_parts`] gives)`, so that the block ending there
    /// keeps them when it is published (see [`crate::kv::block_store`]).
    boundary_state: Option<(usize, Vec<Vec<Array>>)>,
    /// A hybrid model's sequence that recomputes shared prefix-cache blocks after the last one
    /// with recurrent states: the end of those blocks, where a prefill chunk stops and the
    /// last of them receives the states ([`BlockStore::put_bounded`]).
    branch_at: Option<usize>,
    /// Blocks of its prefix hit whose sliding KV (or states) it keeps from being dropped while
    /// it runs ([`BlockStore::pin`]).
    pinned: Vec<BlockId>,
    sampler: Sampler,
    history: RecentTokens,
    /// Where a constrained request is in its grammar ([`GenerateRequest::grammar`]).
    grammar: Option<GrammarState>,
    sink: TokenSink,
    /// Whether this request was admitted before (its prefix lookup is counted once).
    admitted_once: bool,
    /// Its tokens' full-block hashes and how many tokens they were taken from (admission asks
    /// every step while it waits; the tokens do not change meanwhile).
    block_hashes: Option<(usize, Vec<BlockHash>)>,
    /// Its `max_tokens` was lowered to what the KV pool holds: reaching it is a cut for memory
    /// ([`GenerationStats::cut_for_memory`](crate::api::GenerationStats)).
    pool_bound: bool,
    /// A prefix state from a prompt-cache file without token ids: the sequence starts from it
    /// (`tokens` begins with placeholders for it) and its blocks never join the prefix cache.
    preloaded: Option<PromptCache>,
    start: Instant,
    first_token_at: Option<f64>,
    /// Its images' features and places ([`images`]); their tokens in `tokens` are placeholders.
    images: Vec<SequenceImage>,
    /// Its multimodal RoPE positions, when its images move its positions (Qwen's).
    rope: Option<images::RopePositions>,
    /// Its images' token spans `[start, end)`, when their tokens attend to each other both ways
    /// ([`crate::models::vision::VisionTower::attends_both_ways`]): no prefill chunk cuts one
    /// ([`plan::Running::whole`]).
    whole: Vec<(usize, usize)>,
    /// Its request's pins not taken yet ([`GenerateRequest::cache_pins`]): each is taken once
    /// its blocks are published ([`publish`]).
    pins_left: Vec<CachePin>,
    /// Where they end, on block boundaries ([`plan::Waiting::pin_ends`]).
    pin_ends: Vec<usize>,
    /// Its prompt-lookup proposals' record ([`BatchConfig::prompt_lookup`]).
    lookup: Backoff,
}

impl Sequence {
    /// Whether its full blocks go to the prefix cache when it leaves the batch (see
    /// [`plan::Running::keeps_blocks`]): a plain KV without a preloaded prefix, with `caching`.
    fn keeps_blocks(&self, caching: bool) -> bool {
        caching && self.kv.is_plain() && self.preloaded.is_none()
    }

    /// Fills the output's token count and timings from now (when the sequence leaves).
    fn set_timings(&mut self) {
        let total = self.start.elapsed().as_secs_f64();
        let generated = self.sink.generated;
        let ttft = self.first_token_at.unwrap_or(total);
        self.sink.output.stats.set_timings(generated, ttft, total);
    }

    /// Its progress, as the [`scheduler`] sees it.
    fn progress(&self) -> Progress {
        Progress {
            num_tokens: self.tokens.len(),
            num_computed: self.computed,
            prefill_step_size: self.request.prefill_step_size,
        }
    }

    fn prefill_done(&self) -> bool {
        self.progress().prefill_done()
    }

    /// Its full blocks' hashes as `kv` keys them, hashed again only when its tokens grew.
    fn block_hashes(&mut self, kv: &KvCacheManager) -> &[BlockHash] {
        let len = self.tokens.len();
        if self.block_hashes.as_ref().is_none_or(|(at, _)| *at != len) {
            self.block_hashes = Some((len, kv.block_hashes(&self.tokens)));
        }
        &self.block_hashes.as_ref().expect("set just above").1
    }

    /// Whether its decode rows may join a verify step ([`crate::spec_decode`]): greedy, or
    /// sampled without logits processors (one sampler call over its fed positions: a row
    /// feeding only its last token draws as a plain step does), without log-probabilities or a
    /// grammar, over a plain KV cache, positions without images' shifts. Which of them propose
    /// is [`BatchGenerator::proposals`]' choice.
    fn may_verify(&self) -> bool {
        self.kv.is_plain()
            && !self.sampler.has_logits_processors()
            && self.request.logprobs.is_none()
            && !self.request.next_token_logprobs
            && self.grammar.is_none()
            && self.rope.is_none()
    }

    /// The most tokens it may propose now: it emits at most one more than it proposes, within
    /// its `max_tokens` and the model's context. A sampled sequence proposes up to as many as
    /// it has left, as mlx_lm's `speculative_generate_step` drafts `min(max_tokens - n,
    /// num_draft_tokens)`: each proposal is a draw of its random stream, so proposing fewer
    /// would move its later draws. (The context bound is Perch's: mlx_lm drafts past it.)
    fn proposal_room(&self, context_length: usize) -> usize {
        let left = self.sink.max_tokens().saturating_sub(self.sink.generated);
        let room = match self.sampler.is_plain_greedy() {
            true => left.saturating_sub(1),
            false => left,
        };
        room.min(context_length.saturating_sub(self.computed + 2))
    }

    /// A next-token-logprobs request whose one decode step has run: it waits for its result and
    /// must not step again (a generating sequence does, feeding its token from the device).
    fn scored(&self) -> bool {
        self.request.next_token_logprobs && self.computed >= self.tokens.len()
    }
}

/// A waiting request that does not fit the memory left with nothing running, being judged at
/// the readings after ([`BatchGenerator::relieve_or_refuse`]).
#[derive(Clone, Copy, Debug)]
struct Relief {
    request: RequestId,
    stage: ReliefStage,
    /// Memory was read since the stage began.
    read: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReliefStage {
    /// Waits for a fresh reading; nothing dropped yet.
    Fresh,
    /// The prefix cache was dropped and freed memory given back.
    Relieved,
}

/// Runs many requests over one model, one step at a time.
pub struct BatchGenerator<'m> {
    model: &'m dyn Model,
    tokenizer: &'m Tokenizer,
    config: BatchConfig,
    /// Admitted sequences, oldest first (the newest is preempted first).
    running: Vec<Sequence>,
    waiting: VecDeque<Sequence>,
    /// See [`BatchGenerator::hold_admissions`].
    admissions_held: bool,
    /// See [`BatchGenerator::set_memory_headroom`].
    memory_headroom: Option<crate::memory::Available>,
    /// See [`BatchGenerator::set_memory_capacity`].
    memory_capacity: Option<u64>,
    /// The waiting request that did not fit with nothing running, how far it has been judged,
    /// and whether memory was read since ([`BatchGenerator::relieve_or_refuse`]).
    relief: Option<Relief>,
    /// A slot cache row's bytes per position ([`kv_bytes_per_token`]).
    row_bytes_per_position: usize,
    kv: KvCacheManager,
    store: BlockStore,
    /// Partial last blocks of sequences that left, for prompts that extend them.
    tails: TailCache,
    /// Each recent client's latest prompt, to explain a miss ([`explain_miss`]), and its
    /// prefix-cache tally.
    clients: ClientHistory,
    /// This model's id and the process's record of each client's latest model, when shared
    /// ([`BatchGenerator::with_client_models`]).
    client_models: Option<(String, std::sync::Arc<ClientModels>)>,
    /// Executes the steps: forward passes, slot caches, sampling, the decode step in flight.
    runner: ModelRunner<'m>,
    /// The draft model's runner, when the batch has one ([`BatchGenerator::with_draft`]).
    draft: Option<DraftRunner<'m>>,
    /// Speculative decoding's choice between verify and plain decode steps ([`SpecPolicy`]).
    spec_policy: SpecPolicy,
    /// The decode step this step ran, while speculative decoding is on ([`SpecPolicy::record`]).
    decoded: Option<DecodedStep>,
    /// Rank 0 of a divided model: what its last step taught [`SpecPolicy`], for the other ranks
    /// with its next step ([`StepTiming`]).
    timing_to_send: Option<StepTiming>,
    /// A rank other than 0 ([`BatchGenerator::follow_stage`]): its [`SpecPolicy`] learns rank
    /// 0's step times only.
    follows: bool,
    /// The draft tokens a row [`BatchGenerator::with_draft`] was given (rank 0 sends them).
    draft_tokens: Option<usize>,
    next_id: RequestId,
    preemptions: u64,
    /// When a sequence of each lane (`Priority as usize`) last ran: lower lanes' passes are
    /// smaller while a higher lane is active ([`scheduler::lane_budget`]).
    lane_seen: [Option<Instant>; 3],
    /// Prefill slots given up to a higher lane ([`StepPlan::yield_prefill`]) since start.
    prefill_yields: u64,
    times: StepTimes,
    /// Passes still to run while idle ([`BatchGenerator::warm_up_idle`]).
    idle_warm_ups: VecDeque<IdleWarmUp>,
    /// Rank 0's link to the other ranks of a divided model ([`BatchGenerator::lead_ranks`]).
    lockstep: Option<Lockstep<'m>>,
    /// The group's time of the call being made ([`lockstep`]): what the batch's
    /// choices read as now (pins' expiry, lanes last seen) on every rank alike. `None`: this
    /// process's clock.
    group_time: Option<Instant>,
    /// Prompt tokens processed, over the last seconds.
    pub prompt_throughput: ThroughputWindow,
    /// Tokens generated, over the last seconds.
    pub generation_throughput: ThroughputWindow,
}

impl<'m> BatchGenerator<'m> {
    /// `model_id` seeds the prefix-cache hashes (see [`perch_sched::block_pool::BlockHash::root`]).
    pub fn new(
        model: &'m dyn Model,
        tokenizer: &'m Tokenizer,
        config: BatchConfig,
        model_id: &str,
    ) -> Self {
        let config = BatchConfig {
            max_running: config.max_running.max(1),
            prefill_batch_size: config.prefill_batch_size.max(1),
            prefill_token_budget: config.prefill_token_budget.max(1),
            // Tensor parallelism's sums are traced into compiled steps (checked on the CPU and
            // on a GPU over ring); pipeline stages step uncompiled: each pass evaluates its
            // hand-over as it is built (the decoder's forward), which a traced step cannot.
            compile_decode: config.compile_decode
                && !matches!(
                    model.division(),
                    Some(crate::distributed::Division::Pipeline(_))
                ),
            ..config
        };
        let budget = kv_budget_for_model(model, config.kv_quantization, 0);
        let row_bytes_per_position = kv_bytes_per_token(model, config.kv_quantization);
        Self {
            model,
            tokenizer,
            kv: KvCacheManager::new(
                BlockPool::new(config.num_blocks, config.block_size),
                model_id,
            )
            .with_window_cost(budget.window_cost()),
            store: BlockStore::new(config.num_blocks)
                .with_layers(&model.make_cache(None), config.bounded_layer_bytes)
                .with_pool_charge(match budget.window_cost() {
                    Some(_) => budget.block_bytes_per_token * config.block_size,
                    None => 0,
                }),
            tails: TailCache::default(),
            clients: ClientHistory::default(),
            client_models: None,
            runner: ModelRunner::new(
                model,
                config.slot_attention,
                config.kv_quantization,
                config.compile_decode,
                (
                    perch_sched::shapes::prefill_chunk_bucket(config.prefill_token_budget.max(1)),
                    config.block_size,
                ),
            )
            .with_verify_steps(
                // Models whose rows never verify (sliding rings) warm none.
                config
                    .prompt_lookup
                    .filter(|_| !model.has_sliding_window_layers())
                    .map(|l| (1 + l.num_draft_tokens, l.max_rows.min(config.max_running))),
            ),
            draft: None,
            spec_policy: SpecPolicy::default(),
            decoded: None,
            timing_to_send: None,
            follows: false,
            draft_tokens: None,
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 1,
            preemptions: 0,
            lane_seen: [None; 3],
            prefill_yields: 0,
            times: StepTimes::default(),
            idle_warm_ups: VecDeque::new(),
            admissions_held: false,
            memory_headroom: None,
            memory_capacity: None,
            relief: None,
            row_bytes_per_position,
            lockstep: None,
            group_time: None,
            prompt_throughput: ThroughputWindow::new(THROUGHPUT_WINDOW),
            generation_throughput: ThroughputWindow::new(THROUGHPUT_WINDOW),
        }
    }

    /// Explains a client's miss as [`perch_sched::cache_miss::CacheMiss::AnotherModel`] when
    /// `models` (shared by the process's engines) says its previous request went to another
    /// model than `model_id`.
    pub fn with_client_models(
        mut self,
        model_id: &str,
        models: std::sync::Arc<ClientModels>,
    ) -> Self {
        self.client_models = Some((model_id.to_owned(), models));
        self
    }

    /// This batch with `draft` proposing, in verify steps ([`crate::spec_decode`]), for the rows
    /// of requests that ask for speculative decoding ([`GenerateRequest::drafts_in_batch`])
    /// while at most [`BatchGenerator::speculative_rows`] rows decode. Unchanged when the model
    /// or the draft has sliding-window layers (their rings cannot be rewound; see
    /// [`drafts_in_batch`]): [`BatchGenerator::drafts`] tells. Verify steps are warmed for `num_draft_tokens`
    /// proposals a row (the requests' default; [`Draft::DEFAULT_NUM_DRAFT_TOKENS`] when out of
    /// range), unless prompt lookup sets them. The draft's KV is counted in the pool by the
    /// configuration ([`BatchConfig::counting_draft`]; a pool that does not count it holds
    /// the draft's rows beyond its budget).
    pub fn with_draft(mut self, draft: &'m dyn Model, num_draft_tokens: usize) -> Self {
        if !drafts_in_batch(self.model, draft) {
            return self;
        }
        let max_rows = self.speculative_rows();
        let config = &self.config;
        self.draft_tokens = Some(num_draft_tokens);
        self.draft = Some(DraftRunner::new(
            draft,
            config.slot_attention,
            config.compile_decode,
            (config.prefill_token_budget, config.block_size),
            max_rows,
        ));
        if config.prompt_lookup.is_none() {
            let k = warmed_draft_tokens(num_draft_tokens);
            self.runner.set_verify_steps(Some((1 + k, max_rows)));
        }
        self
    }

    /// Whether the batch has a draft model ([`BatchGenerator::with_draft`]).
    pub fn drafts(&self) -> bool {
        self.draft.is_some()
    }

    /// The most decode rows a verify step has: prompt lookup's `max_rows`, or
    /// [`spec_decode::DEFAULT_MAX_ROWS`], within `max_running`.
    pub fn speculative_rows(&self) -> usize {
        self.config
            .prompt_lookup
            .map_or(spec_decode::DEFAULT_MAX_ROWS, |l| l.max_rows)
            .min(self.config.max_running)
    }

    /// Positions the block table of a request bounded by `limit` holds at most: its bound and a
    /// prefill step (what its rows of the slot caches hold at most, see `kv::slot_cache`).
    fn bounded_tokens(&self, limit: KvLimit) -> usize {
        limit.max_size as usize
            + perch_sched::shapes::prefill_chunk_bucket(self.config.prefill_token_budget.max(1))
    }

    /// Empty caches for one sequence, one per layer, in the configured format.
    fn make_cache(&self) -> Vec<KvCache> {
        self.model.make_cache(self.config.kv_quantization)
    }

    /// Makes this batch rank 0's of a model divided over ranks ([`lockstep`]):
    /// each call on it from here on goes first to the other ranks' batches
    /// ([`lockstep::follow`]), the first making theirs with this configuration.
    /// Errors when the model is not divided or this is not rank 0.
    pub(crate) fn lead_ranks(&mut self, model_id: &str) -> Result<()> {
        let group = match self.model.division() {
            Some(division) if division.rank() == 0 && division.size() > 1 => division.group(),
            _ => {
                return Err(EngineError::Distributed(
                    "only rank 0 of a divided model leads the other ranks' batches".into(),
                ))
            }
        };
        self.lockstep = Some(Lockstep::new(group));
        self.lead(BatchCall::Fresh {
            config: self.config.clone(),
            model_id: model_id.to_owned(),
            stage: self.stage(),
            draft_tokens: self.draft_tokens,
        })
    }

    /// What this rank's part of the model makes its batch choose by ([`Stage`]).
    pub(crate) fn stage(&self) -> Stage {
        Stage {
            row_bytes_per_position: self.row_bytes_per_position,
        }
    }

    /// A follower's batch, made on rank 0's `stage`: admission counts rank 0's bytes a position.
    /// A pipeline stage's own bytes (its prefix cache's) weigh against rank 0's scaled by
    /// `stage_scale`, `(own, rank 0's)` cache layers (`lockstep::join_ranks`, which refused the
    /// group at load unless every stage holds rank 0's kinds of layers in its proportions).
    pub(crate) fn follow_stage(&mut self, stage: Stage, (own, rank_0): (usize, usize)) {
        self.row_bytes_per_position = stage.row_bytes_per_position;
        self.store.set_budget_scale(own, rank_0);
        self.follows = true;
    }

    /// `(own, rank 0's)` cache layers: a pipeline stage's against rank 0's (`(1, 1)` but on a
    /// follower of pipeline stages; [`BatchGenerator::follow_stage`]).
    pub(crate) fn stage_scale(&self) -> (usize, usize) {
        self.store.budget_scale()
    }

    /// Whether this is rank 0's batch of a divided model ([`BatchGenerator::lead_ranks`]).
    pub fn leads_ranks(&self) -> bool {
        self.lockstep.is_some()
    }

    /// Rank 0 of a divided model: why the ranks stopped working together, once they did
    /// (every later call fails with it).
    pub fn group_stopped(&self) -> Option<String> {
        Some(self.lockstep.as_ref()?.stopped()?.to_owned())
    }

    /// Rank 0, idle: tells the other ranks it is still there ([`BatchCall::Alive`]).
    pub(crate) fn tell_ranks_alive(&mut self) -> Result<()> {
        self.lead(BatchCall::Alive)
    }

    /// Rank 0: the other ranks stop following (its engine is stopping).
    pub(crate) fn stop_followers(&mut self) {
        let _ = self.lead(BatchCall::Stop);
    }

    /// Rank 0 of a divided model: sends `call` to the other ranks, which make it on their
    /// batches as this one makes it here, and takes its time as the group's. Nothing without
    /// other ranks. Errors when a rank is gone or its batch differs from this one (then every
    /// later call errors alike: the group stopped).
    fn lead(&mut self, call: BatchCall) -> Result<()> {
        if self.lockstep.is_none() {
            return Ok(());
        }
        // A collective issued after a rank is gone may never return (MLX's ring backend fails
        // only the collectives pending when it notices): the passes in flight, whose
        // collectives come first, are waited for, and their failure stops the group here.
        let waited = self.runner.wait_for_work_in_flight();
        self.stop_group_on(waited)?;
        let digest = self.digest();
        let lockstep = self.lockstep.as_mut().expect("checked above");
        self.group_time = Some(lockstep.lead(&call, digest)?);
        Ok(())
    }

    /// A follower's wait, before it receives the next call, for what its last call left
    /// running ([`BatchGenerator::lead`]'s reason).
    pub(crate) fn wait_for_work_in_flight(&mut self) -> Result<()> {
        self.runner.wait_for_work_in_flight()
    }

    /// A pass that failed on rank 0 of a divided model stops the group: the other ranks may not
    /// have failed alike, and after a rank is gone MLX's ring backend may never answer a later
    /// collective; every later call fails with this error instead of sending anything.
    fn stop_group_on<T>(&mut self, result: Result<T>) -> Result<T> {
        if let (Err(e), Some(lockstep)) = (&result, &mut self.lockstep) {
            lockstep.stop(e);
        }
        result
    }

    /// A follower's call: the group's time rank 0 made it at ([`lockstep`]).
    pub(crate) fn set_group_time(&mut self, at: Instant) {
        self.group_time = Some(at);
    }

    /// Now, as the batch's choices read it: the group's time of the call being made when the
    /// model is divided over ranks, else this process's clock.
    fn now(&self) -> Instant {
        self.group_time.unwrap_or_else(Instant::now)
    }

    /// What the ranks of a divided batch compare before each call ([`lockstep`]):
    /// its requests in order, each one's tokens (count and last), computed positions and slot,
    /// the pool's free blocks, and what speculative decoding chooses by ([`SpecPolicy`]). A
    /// hash with fixed keys, the same in every process.
    pub(crate) fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        self.next_id.hash(&mut hasher);
        for seq in &self.running {
            let last = seq.tokens.last();
            (
                seq.id,
                seq.tokens.len(),
                last,
                seq.computed,
                seq.slot.is_some(),
            )
                .hash(&mut hasher);
        }
        for seq in &self.waiting {
            seq.id.hash(&mut hasher);
        }
        self.kv.pool().num_free_blocks().hash(&mut hasher);
        self.spec_policy.hash_into(&mut hasher);
        hasher.finish()
    }

    /// Refuses a prompt cache's prefix handled on rank 0 alone: on a model divided over ranks it
    /// goes through the calls every rank makes on its own part ([`BatchGenerator::save_prefix`],
    /// [`BatchGenerator::import_prefix_file`], [`BatchGenerator::insert_after_cache_file`]).
    fn refuse_prompt_cache_apart(&self) -> Result<()> {
        match self.lockstep {
            Some(_) => Err(EngineError::Distributed(
                "a model divided over ranks reads and writes prompt caches through save_prefix, \
                 import_prefix_file and insert_after_cache_file (each rank its own part)"
                    .into(),
            )),
            None => Ok(()),
        }
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// Queues a request; it is admitted at a step when the batch has room and blocks.
    ///
    /// Errors as [`crate::sequence::generate`]'s checks (empty or too long prompt, bad sampling parameters),
    /// and [`EngineError::KvCacheTooSmall`] when the prompt and one generated token cannot fit in
    /// the whole pool. A prompt that fits with room for fewer than `max_tokens` tokens runs with
    /// `max_tokens` lowered to the room (finish reason `length`).
    pub fn insert(&mut self, mut request: GenerateRequest) -> Result<RequestId> {
        if self.leads_ranks() {
            let images = Self::to_send(&mut request);
            self.lead(BatchCall::Insert(Box::new(request.clone()), images))?;
        }
        self.insert_with(request, None)
    }

    /// A request as rank 0 sends it to the other ranks: its seed set, so that every rank's
    /// sampler draws from the same key, and its images apart (a request does not serialize them).
    fn to_send(request: &mut GenerateRequest) -> Vec<lockstep::SentImage> {
        request.sampling.seed = request
            .sampling
            .seed
            .or_else(|| Some(crate::sample::sampler::random_seed()));
        request
            .images
            .iter()
            .map(lockstep::SentImage::new)
            .collect()
    }

    /// Queues a request that continues from `prefix`, a prompt-cache file's state, as mlx_lm's
    /// `generate(prompt_cache=...)` does: `request.prompt` holds only the tokens after it. A
    /// prefix whose token ids are known joins the prefix cache and the request is inserted with
    /// them in front; an anonymous one (an mlx_lm file) stays private to this request.
    pub fn insert_after_prefix(
        &mut self,
        request: GenerateRequest,
        prefix: PromptCache,
    ) -> Result<RequestId> {
        self.refuse_prompt_cache_apart()?;
        self.insert_after_read_prefix(request, prefix)
    }

    /// [`BatchGenerator::insert_after_prefix`] with the prompt-cache file at `path` (its part of
    /// it, on a rank of a model divided over ranks: each rank reads its own,
    /// [`prompt_cache::rank_path`], and every rank refuses when one cannot read its part).
    pub fn insert_after_cache_file(
        &mut self,
        mut request: GenerateRequest,
        path: &Path,
        model_id: &str,
    ) -> Result<RequestId> {
        if self.leads_ranks() {
            let images = Self::to_send(&mut request);
            self.lead(BatchCall::InsertAfterCache {
                request: Box::new(request.clone()),
                images,
                path: path.to_path_buf(),
                model_id: model_id.to_owned(),
            })?;
        }
        let prefix = self.read_part(path, model_id, |_| None)?;
        self.insert_after_read_prefix(request, prefix)
    }

    /// This rank's part of the prompt cache at `path`, refused when `refuse` gives a reason,
    /// once every rank of a divided model has read its own and they agree: every part read,
    /// each of one save (`perch_save`) and the same tokens ([`lockstep::agree`]).
    fn read_part(
        &self,
        path: &Path,
        model_id: &str,
        refuse: impl Fn(&PromptCache) -> Option<EngineError>,
    ) -> Result<PromptCache> {
        use std::hash::{Hash, Hasher};
        let read = prompt_cache::load_prompt_cache(&self.own_part(path), self.model, model_id)
            .and_then(|prefix| match refuse(&prefix) {
                Some(err) => Err(err),
                None => {
                    let mut hasher = std::hash::DefaultHasher::new();
                    (
                        prefix.metadata.get("perch_save"),
                        &prefix.tokens,
                        prefix.offset,
                    )
                        .hash(&mut hasher);
                    Ok((prefix, hasher.finish()))
                }
            });
        self.agree(read)
    }

    fn insert_after_read_prefix(
        &mut self,
        mut request: GenerateRequest,
        prefix: PromptCache,
    ) -> Result<RequestId> {
        match &prefix.tokens {
            // A prefix whose sliding layers hold only their window, or whose recurrent states fall
            // inside a block, stays private to this request.
            Some(tokens)
                if prefix
                    .why_not_in_prefix_cache(self.config.block_size)
                    .is_none() =>
            {
                self.import_read_prefix(tokens, &prefix.layers)?;
                request.prompt = [&tokens[..], &request.prompt[..]].concat();
                self.insert_with(request, None)
            }
            _ => self.insert_with(request, Some(prefix)),
        }
    }

    fn insert_with(
        &mut self,
        mut request: GenerateRequest,
        preloaded: Option<PromptCache>,
    ) -> Result<RequestId> {
        let prefix_len = preloaded.as_ref().map_or(0, |p| p.offset);
        // Checks and stats see the whole sequence: the cached prefix plus the new tokens.
        let continuation = std::mem::take(&mut request.prompt);
        request.prompt = [vec![0; prefix_len], continuation].concat();
        let (max_tokens, stop_ids) = check_request(self.model, self.tokenizer, &request)?;
        if request.runs_beside_batch(self.drafts()) {
            return Err(EngineError::Request(
                "this speculative request runs beside the batch (EngineHandle), not in it: the \
                 batch's draft model proposes for requests without logits processors \
                 (penalties, a logit bias), log-probabilities, grammars, images or KV cache \
                 options"
                    .into(),
            ));
        }
        if let Some(k) = request.num_draft_tokens {
            check_num_draft_tokens(k)?;
            // The draft cannot read a private prefix (`drafts_for`): a greedy request runs
            // without proposals, its ids the same; a sampled one would draw other keys than
            // mlx_lm's speculative generation.
            if preloaded.is_some() && !request.sampling.is_plain_greedy() {
                return Err(EngineError::Request(
                    "a sampled speculative request cannot start from this prompt cache: the \
                     draft model reads the prefix's token ids, which the file does not record \
                     (an mlx_lm file); without num_draft_tokens, or greedy, it runs"
                        .into(),
                ));
            }
        }
        // A bound the sequence never reaches changes nothing (mlx_lm's rotating cache trims
        // nothing then): the request runs unbounded, with the prefix cache.
        let limit = kv_options(self.model, &request)?
            .filter(|l| (l.max_size as usize) < request.prompt.len() + max_tokens);
        if let Some(limit) = limit.filter(|l| l.max_size > KvLimit::MAX_SIZE) {
            return Err(EngineError::Request(format!(
                "max_kv_size {} is more than the {} positions a bounded KV cache holds at most",
                limit.max_size,
                KvLimit::MAX_SIZE
            )));
        }
        if limit.is_some() && self.config.kv_quantization.is_some() {
            return Err(EngineError::Request(
                "max_kv_size cannot be combined with the engine's quantized KV cache: a bounded \
                 (rotating) KV cache is not quantized (mlx_lm's RotatingKVCache neither)"
                    .into(),
            ));
        }
        if limit.is_some() && preloaded.is_some() {
            return Err(EngineError::Request(
                "a request with max_kv_size cannot start from a prompt cache".into(),
            ));
        }
        // A start the sequence never reaches changes nothing either: the last step starts
        // before `prompt + max_tokens - 1` positions.
        let quantization = request
            .kv_quantization
            .map(|quantization| RowQuantization {
                quantization,
                start: request.quantized_kv_start,
            })
            .filter(|q| q.from_len() + 1 < request.prompt.len() + max_tokens);
        if quantization.is_some() && self.config.kv_quantization.is_some() {
            return Err(EngineError::Request(
                "kv_bits cannot be combined with the engine's quantized KV cache: its pool is \
                 quantized for every request already"
                    .into(),
            ));
        }
        if quantization.is_some() && preloaded.is_some() {
            return Err(EngineError::Request(
                "a request with kv_bits cannot start from a prompt cache".into(),
            ));
        }
        // A bounded cache holds at most its bound and a prefill step's worth more.
        let held = |tokens: usize| match limit {
            Some(limit) => tokens.min(self.bounded_tokens(limit)),
            None => tokens,
        };
        let capacity_tokens = self.kv.max_tokens();
        if held(request.prompt.len()) >= capacity_tokens {
            return Err(EngineError::KvCacheTooSmall {
                prompt_tokens: request.prompt.len(),
                capacity_tokens,
                lowered: self.config.lowered_for_memory,
                shared_with_draft: self.draft.is_some() && self.config.draft_kv_counted,
            });
        }
        // A bounded request whose bound the pool holds may run past the pool's size.
        let asked = max_tokens;
        let max_tokens = match limit {
            Some(limit) if self.bounded_tokens(limit) < capacity_tokens => max_tokens,
            _ => max_tokens.min(capacity_tokens - request.prompt.len()),
        };
        let mut tokens = request.prompt.clone();
        let images = match request.images.is_empty() {
            true => Vec::new(),
            false => images::prepare(self.model, &mut tokens, &request.images)?,
        };
        let rope = images::rope_positions(&images, tokens.len())?;
        let whole = self.both_ways_spans(&images, limit.is_some())?;
        // The sequence holds them from here on (until their features are computed).
        request.images = Vec::new();
        let id = self.next_id;
        self.next_id += 1;
        let history = RecentTokens::new(&request.sampling, &request.prompt[prefix_len..]);
        // Pins hold a prefix's plain KV: a request whose cache is its own has none to keep.
        let mut pins_left = std::mem::take(&mut request.cache_pins);
        let mut pin_refused = None;
        if !pins_left.is_empty() && (limit.is_some() || quantization.is_some() || prefix_len > 0) {
            pins_left.clear();
            pin_refused = Some(
                "the request's KV cache is its own (max_kv_size, kv_bits or a prompt-cache \
                 file): it keeps no prefix in the cache"
                    .to_owned(),
            );
        }
        let block_size = self.config.block_size;
        for pin in &mut pins_left {
            pin.tokens = pin.tokens.min(request.prompt.len());
        }
        let mut pin_ends: Vec<usize> = pins_left
            .iter()
            .map(|pin| pin.tokens / block_size * block_size)
            .filter(|&end| end > 0)
            .collect();
        pin_ends.sort_unstable();
        pin_ends.dedup();
        let mut sink = TokenSink::new(&request, stop_ids, max_tokens);
        sink.output.stats.pin_refused = pin_refused;
        let grammar = match &request.grammar {
            Some(grammar) => Some(self.tokenizer.grammar_env()?.start(grammar)?),
            None => None,
        };
        self.enqueue(
            Sequence {
                id,
                preloaded,
                history,
                grammar,
                tokens,
                images,
                rope,
                whole,
                cache: Vec::new(),
                // `kv_options` refused a bound and a quantization together.
                kv: match (limit, quantization) {
                    (Some(limit), _) => RowKv::Bounded(limit),
                    (None, Some(quantization)) => RowKv::Quantized(quantization),
                    (None, None) => RowKv::Plain,
                },
                slot: None,
                computed: 0,
                published_blocks: 0,
                boundary_state: None,
                branch_at: None,
                pinned: Vec::new(),
                sampler: Sampler::for_tokenizer(request.sampling.clone(), self.tokenizer)?,
                sink,
                admitted_once: false,
                block_hashes: None,
                pool_bound: max_tokens < asked,
                request,
                start: Instant::now(),
                first_token_at: None,
                pins_left,
                pin_ends,
                lookup: Backoff::default(),
            },
            false,
        );
        Ok(id)
    }

    /// Removes a request (cancel), waiting or running, and frees its blocks (full ones stay in
    /// the prefix cache). Returns its output so far with finish reason `cancelled`.
    pub fn remove(&mut self, id: RequestId) -> Result<Option<GenerateOutput>> {
        self.lead(BatchCall::Remove(id))?;
        let mut seq = if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let mut seq = self.running.remove(pos);
            self.release(&mut seq)?;
            seq
        } else if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos).expect("position is valid")
        } else {
            return Ok(None);
        };
        seq.set_timings();
        let mut output = seq.sink.output;
        output.finish_reason = FinishReason::Cancelled;
        Ok(Some(output))
    }

    /// Drops every request without output (after an MLX failure left their caches unusable),
    /// and every pinned prefix: the pool is all free afterwards. Returns their ids.
    pub fn clear(&mut self) -> Vec<RequestId> {
        let _ = self.lead(BatchCall::Clear);
        let mut ids: Vec<RequestId> = self
            .running
            .iter()
            .chain(&self.waiting)
            .map(|s| s.id)
            .collect();
        ids.sort_unstable();
        for seq in self.running.drain(..) {
            self.kv.free(seq.id);
            self.store.unpin(&seq.pinned);
        }
        self.kv.clear_pins(&mut self.store);
        self.runner.clear();
        if let Some(draft) = &mut self.draft {
            draft.clear();
        }
        self.waiting.clear();
        ids
    }

    /// Requests admitted (prefilling or decoding).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests queued for admission (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// The pool's occupancy and prefix-cache numbers.
    pub fn kv_stats(&self) -> KvCacheStats {
        let pool = self.kv.pool();
        let cached_free = pool.num_cached_free_blocks();
        let held = self.store.held_blocks();
        let (pinned_tokens, pinned_tokens_max) = self.kv.pinned_tokens();
        KvCacheStats {
            pinned_tokens,
            pinned_tokens_max,
            block_size: pool.block_size(),
            blocks_total: pool.num_blocks(),
            blocks_used: pool.num_used_blocks() - held,
            blocks_cached_free: cached_free + held,
            blocks_empty: pool.num_free_blocks() - cached_free,
            prefix_cache_hit_rate: pool.stats().hit_rate(),
            prefix_cache_bytes: self.store.nbytes() + self.tails.nbytes(),
            preemptions: self.preemptions,
            prefill_yields: self.prefill_yields,
        }
    }

    /// Each recent client's prefix-cache tally, the most recently seen first
    /// ([`GenerateRequest::client`]).
    pub fn client_tallies(&self) -> Vec<ClientTally> {
        self.clients.tallies()
    }

    /// While `held`, waiting requests are not admitted as long as one runs, and one at a time
    /// when none does (the engine's answer to memory pressure, [`crate::memory::PressureGuard`]):
    /// they wait instead of adding their caches to a process short of memory. With a memory
    /// headroom set, that one is judged against it ([`BatchGenerator::set_memory_headroom`]).
    pub fn hold_admissions(&mut self, held: bool) {
        if held != self.admissions_held {
            let _ = self.lead(BatchCall::HoldAdmissions(held));
        }
        self.admissions_held = held;
    }

    pub fn admissions_held(&self) -> bool {
        self.admissions_held
    }

    /// Rank 0 of a divided model: the other ranks' memory as their last call carried it (the
    /// least headroom of any, naming its rank; the least capacity of any; low when any is);
    /// `None` without ranks, or while none reads its memory.
    pub(crate) fn least_rank_memory(&self) -> Option<lockstep::RankMemory> {
        self.lockstep.as_ref()?.least_memory()
    }

    /// Rank 0 of a divided model, a waiting request about to be judged: an exchange whose
    /// gather brings every rank's memory read just now (they read again while a request
    /// awaits a reading), so that [`BatchGenerator::least_rank_memory`] is not a call old.
    /// Nothing without ranks.
    pub(crate) fn refresh_rank_memory(&mut self) -> Result<()> {
        self.lead(BatchCall::ReadMemory)
    }

    /// What the process may still take, read just now (`None`: no bound, as on CUDA, which has
    /// no guard): waiting requests are admitted, front first, only while the KV memory they
    /// add fits it ([`BatchGenerator::admission_growth`]), and each admission's growth is
    /// taken off it until the next reading. When nothing runs and the first waiting request
    /// does not fit at a fresh reading, the prefix cache is dropped and freed memory given
    /// back; if it still does not fit at the next reading, it is refused
    /// ([`BatchEvent::Refused`], [`EngineError::PromptOutOfMemory`]) rather than run into the
    /// memory limit.
    pub fn set_memory_headroom(&mut self, headroom: Option<crate::memory::Available>) {
        // Every rank's batch holds the same headroom and relief: an unchanged reading with no
        // request being judged changes nothing, and goes nowhere.
        if headroom != self.memory_headroom || self.relief.is_some() {
            let _ = self.lead(BatchCall::MemoryHeadroom(headroom));
        }
        self.memory_headroom = headroom;
        if let Some(relief) = &mut self.relief {
            relief.read = true;
        }
    }

    /// What the engine had above the memory floor once the model loaded, when nothing else
    /// holds memory beside the batch (`None` otherwise, or where nothing is read): a request
    /// refused for memory that needs more than this is told so as a client error
    /// ([`EngineError::PromptOutOfMemory`]'s `beyond_capacity`), others as an overload.
    pub fn set_memory_capacity(&mut self, capacity: Option<u64>) {
        if capacity != self.memory_capacity {
            let _ = self.lead(BatchCall::MemoryCapacity(capacity));
        }
        self.memory_capacity = capacity;
    }

    /// Whether a waiting request is judged at the next memory reading
    /// ([`BatchGenerator::set_memory_headroom`]): the engine then reads memory at once rather
    /// than stepping an idle batch until its next reading.
    pub fn awaits_memory_reading(&self) -> bool {
        self.relief.is_some_and(|relief| !relief.read)
    }

    /// The bytes of KV memory added if the first 1, 2, … `room` waiting requests are admitted
    /// (entry `k - 1` for `k`). Each admitted sequence takes a row of the prefill slot cache,
    /// whose capacity follows the longest prompt in it, then of the decode one, whose capacity
    /// follows the longest sequence of all
    /// ([`SlotKvCache`](crate::kv::slot_cache::SlotKvCache): rows and capacity bucketed); a
    /// cache that must grow allocates its new buffers while the old ones are still read, so
    /// growing costs the new buffers' whole size. The prompts' full blocks that become prefix
    /// cache entries are then copied into its store, up to the pool's size: not those already
    /// cached, nor those a prompt shares with the one admitted just before it (a block whose
    /// content the cache holds is not copied again), nor any of a bounded, quantized or
    /// preloaded sequence (never published). And the activations of the step that admits them
    /// ([`step_activation_bytes`]: the prompt tokens left of every prefilling row, within the
    /// prefill budget, and a token of every decoding row, over the longest sequence). Hybrid
    /// models' recurrent states are not counted (the floor under the headroom is for them), nor
    /// a running sequence's later growth.
    fn admission_growth(&mut self, room: usize) -> Vec<usize> {
        use perch_sched::shapes::{capacity_bucket, row_bucket};
        let [decode, prefill] = self.runner.slot_shapes();
        let prefilling = self.running.iter().filter(|s| !s.prefill_done());
        let mut longest_prefill = prefilling
            .clone()
            .map(|s| s.tokens.len())
            .max()
            .unwrap_or(0);
        let mut prefill_tokens: usize = prefilling
            .clone()
            .map(|s| s.tokens.len().saturating_sub(s.computed))
            .sum();
        let prefilling = prefilling.count();
        let decoding = self.running.len() - prefilling;
        let mut longest = self
            .running
            .iter()
            .map(|s| s.tokens.len() + 1)
            .max()
            .unwrap_or(0);
        let grown = |(rows, held): (usize, usize), wanted: usize, positions: usize| -> usize {
            let (rows_wanted, capacity) = (row_bucket(wanted), capacity_bucket(positions));
            match rows_wanted <= rows && capacity <= held {
                true => 0,
                false => rows_wanted.max(rows) * capacity.max(held),
            }
        };
        let block = self.config.block_size.max(1);
        let bytes_per_position = self.row_bytes_per_position.max(1);
        // The store's positions: its bytes in rank 0's over rank 0's bytes a position.
        let store_bytes = lockstep::in_rank_0_bytes(self.store.nbytes() as u64, self.stage_scale());
        let store_room = (self.config.num_blocks * block)
            .saturating_sub(store_bytes as usize / bytes_per_position);
        let mut published = 0;
        let mut growth = Vec::new();
        let mut previous: Option<&[u32]> = None;
        for (k, seq) in self.waiting.iter_mut().take(room).enumerate() {
            let publishes =
                self.kv.caching_enabled() && seq.kv.is_plain() && seq.preloaded.is_none();
            let cached = match publishes {
                true => self.kv.cached_blocks(seq.block_hashes(&self.kv)) * block,
                false => 0,
            };
            let seq: &Sequence = seq;
            longest_prefill = longest_prefill.max(seq.tokens.len());
            longest = longest.max(seq.tokens.len() + 1);
            if publishes {
                let shared = previous.map_or(0, |p| common_prefix(p, &seq.tokens) / block * block);
                published += (seq.tokens.len() / block * block).saturating_sub(cached.max(shared));
                previous = Some(&seq.tokens);
            }
            let prefill_rows = (prefilling + k + 1).min(self.config.prefill_batch_size);
            let positions = grown(decode, self.running.len() + k + 1, longest)
                + grown(prefill, prefill_rows, longest_prefill)
                + published.min(store_room);
            prefill_tokens += seq.tokens.len();
            let step_tokens = prefill_tokens.min(self.config.prefill_token_budget) + decoding;
            let activations = step_activation_bytes(
                self.model,
                (step_tokens, self.running.len() + k + 1, longest),
            );
            growth.push(
                positions
                    .saturating_mul(self.row_bytes_per_position)
                    .saturating_add(activations),
            );
        }
        growth
    }

    /// Forgets every cached prefix not in use (and every kept partial block) and drops its KV
    /// content; pinned prefixes are given up first.
    pub fn reset_prefix_cache(&mut self) {
        let _ = self.lead(BatchCall::ResetPrefixCache);
        self.forget_prefixes();
    }

    /// [`BatchGenerator::reset_prefix_cache`] on this process (a step's own choice: every rank's
    /// step makes it alike).
    fn forget_prefixes(&mut self) {
        self.kv.clear_pins(&mut self.store);
        for id in self.kv.reset_prefix_cache() {
            self.store.clear(id);
        }
        self.kv.charge_pool(&mut self.store);
        self.tails.clear();
    }

    /// Puts the full blocks of a prefix (`tokens`, with `layers` holding at least that many
    /// positions, every one from 0) into the prefix cache as free cached blocks, as if a request had computed them.
    /// Takes only as many blocks as are free; returns the tokens now cached.
    pub fn import_prefix(&mut self, tokens: &[u32], layers: &[KvCache]) -> Result<usize> {
        self.refuse_prompt_cache_apart()?;
        self.import_read_prefix(tokens, layers)
    }

    /// [`BatchGenerator::import_prefix`] of the prompt-cache file at `path` (its part of it, on a
    /// rank of a model divided over ranks, as [`BatchGenerator::insert_after_cache_file`]
    /// reads): a file whose prefix cannot join the prefix cache is refused.
    pub fn import_prefix_file(&mut self, path: &Path, model_id: &str) -> Result<usize> {
        self.lead(BatchCall::ImportPrefix {
            path: path.to_path_buf(),
            model_id: model_id.to_owned(),
        })?;
        let block_size = self.config.block_size;
        let prefix = self.read_part(path, model_id, |prefix| {
            let refused = |why: &str| EngineError::PromptCache {
                path: path.to_path_buf(),
                message: format!("{why}; submit it as Prompt::AfterCache instead"),
            };
            match (&prefix.tokens, prefix.why_not_in_prefix_cache(block_size)) {
                (Some(_), Some(why)) => Some(refused(&why)),
                (Some(_), None) => None,
                (None, _) => Some(refused("it does not record its token ids (an mlx_lm file)")),
            }
        })?;
        let tokens = prefix.tokens.as_deref().unwrap_or_default();
        self.import_read_prefix(tokens, &prefix.layers)
    }

    /// Saves the KV state of `tokens` ([`BatchGenerator::compute_prefix`]) as a prompt-cache file
    /// at `path` recording `model_id`, and returns its length in tokens. On a model divided over
    /// ranks every rank computes alike and writes its own part ([`prompt_cache::rank_path`], on
    /// its host, all under one save id), and every rank fails when one could not write its part.
    pub fn save_prefix(
        &mut self,
        tokens: &[u32],
        prefill_step_size: usize,
        path: &Path,
        model_id: &str,
    ) -> Result<usize> {
        let save_id = crate::sample::sampler::random_seed();
        self.save_prefix_as(tokens, prefill_step_size, path, model_id, save_id)?
    }

    /// [`BatchGenerator::save_prefix`] under `save_id` (rank 0's, on every rank). The outer
    /// error is a failed pass (on rank 0 it stops the group: the ranks' collectives may no
    /// longer match); the inner one the save's outcome, which every rank agreed on.
    pub(crate) fn save_prefix_as(
        &mut self,
        tokens: &[u32],
        prefill_step_size: usize,
        path: &Path,
        model_id: &str,
        save_id: u64,
    ) -> Result<Result<usize>> {
        self.lead(BatchCall::SavePrefix {
            tokens: tokens.to_vec(),
            prefill_step_size,
            path: path.to_path_buf(),
            model_id: model_id.to_owned(),
            save_id,
        })?;
        let computed = self.compute_read_prefix(tokens, prefill_step_size);
        let cache = self.stop_group_on(computed)?;
        let part =
            prompt_cache::part_of(self.model).map(|part| prompt_cache::RankPart { part, save_id });
        let saved = prompt_cache::save_prompt_cache(
            &self.own_part(path),
            &cache,
            tokens,
            model_id,
            self.config.block_size,
            part.as_ref(),
        );
        Ok(self.agree(saved.map(|()| (tokens.len(), 0))))
    }

    /// This rank's file of the prompt cache at `path` ([`prompt_cache::rank_path`]).
    fn own_part(&self, path: &Path) -> std::path::PathBuf {
        let rank = self.model.division().map_or(0, |d| d.rank());
        prompt_cache::rank_path(path, rank)
    }

    /// `mine` (with a fingerprint the ranks' must match) once every rank of a divided model
    /// knows every rank's outcome ([`lockstep::agree`]); as it is on one process.
    fn agree<T>(&self, mine: Result<(T, u64)>) -> Result<T> {
        match self.model.division().filter(|d| d.size() > 1) {
            Some(division) => lockstep::agree(division.group(), mine),
            None => mine.map(|(mine, _)| mine),
        }
    }

    fn import_read_prefix(&mut self, tokens: &[u32], layers: &[KvCache]) -> Result<usize> {
        debug_assert!(
            layers.iter().all(|l| l.first_position() == 0),
            "blocks hold every position (see PromptCache::why_not_in_prefix_cache)"
        );
        let block_size = self.config.block_size;
        // Blocks already cached are reused, not taken (and evicted from) the free queue again.
        let hit = self.kv.cached_prefix(tokens);
        let pool = self.kv.pool();
        let hit_from_free = hit
            .blocks
            .iter()
            .filter(|id| pool.block(**id).ref_cnt() == 0)
            .count();
        let room = pool.num_free_blocks() - hit_from_free;
        let new_blocks = (tokens.len() / block_size - hit.blocks.len()).min(room);
        let num_tokens = hit.num_tokens + new_blocks * block_size;
        if new_blocks == 0 {
            return Ok(num_tokens);
        }
        let id = self.next_id;
        self.next_id += 1;
        if !self.kv.allocate(
            &mut self.store,
            id,
            hit.num_tokens,
            num_tokens - hit.num_tokens,
            Some(&hit),
        ) {
            return Ok(hit.num_tokens);
        }
        // The store holds blocks in the engine's own format; convert a prefix that is not.
        let converted;
        let layers = if layers
            .iter()
            .filter(|l| !l.is_recurrent())
            .all(|l| l.quantization() == self.config.kv_quantization)
        {
            layers
        } else {
            let mut cache = self.make_cache();
            for (cache, layer) in cache.iter_mut().zip(layers) {
                // A recurrent state exists after the prefix's last token only.
                if !layer.is_recurrent() || layer.offset() == num_tokens as i32 {
                    cache.extend_from(layer, num_tokens as i32)?;
                }
            }
            converted = cache;
            &converted
        };
        let entries = self.kv.cache_blocks(id, tokens, num_tokens);
        for &(index, block) in &entries {
            self.store.put(block, layers, index, block_size)?;
        }
        let mut ids: Vec<BlockId> = entries.iter().map(|&(_, block)| block).collect();
        // Cached blocks whose sliding layers' KV was dropped get it back.
        if !self.store.has_recurrent_layers() {
            for (index, &block) in hit.blocks.iter().enumerate() {
                if !self.store.holds_every_layer(block) {
                    self.store
                        .put_bounded_from(block, layers, index, block_size)?;
                    ids.push(block);
                }
            }
        }
        eval(self.store.state(&ids))?;
        self.kv.free(id);
        self.kv.charge_pool(&mut self.store);
        Ok(num_tokens)
    }

    /// The KV state of `tokens` (one cache per layer, `tokens.len()` positions), computed now
    /// from the longest cached prefix on, in chunks of `prefill_step_size`; its full blocks join
    /// the prefix cache. For saving prompt caches; it runs outside the batch's steps.
    pub fn compute_prefix(
        &mut self,
        tokens: &[u32],
        prefill_step_size: usize,
    ) -> Result<Vec<KvCache>> {
        self.refuse_prompt_cache_apart()?;
        self.compute_read_prefix(tokens, prefill_step_size)
    }

    fn compute_read_prefix(
        &mut self,
        tokens: &[u32],
        prefill_step_size: usize,
    ) -> Result<Vec<KvCache>> {
        let hit = computed_blocks(&self.kv, &self.store, tokens);
        let mut cache = self.make_cache();
        self.store
            .load_into(&hit.blocks, &mut cache, self.config.block_size)?;
        for chunk in tokens[hit.num_tokens..].chunks(prefill_step_size.max(1)) {
            self.model.prefill_sequence(
                &Array::from_slice(chunk, &[1, chunk.len() as i32]),
                &mut cache,
            )?;
            eval(cache.iter().flat_map(KvCache::state))?;
            // One call computes the whole prefix: each chunk is progress for the watchdog.
            crate::distributed::note_progress();
            self.prompt_throughput.record(chunk.len());
        }
        self.import_read_prefix(tokens, &cache)?;
        Ok(cache)
    }

    /// One step: the scheduler's decisions ([`plan::schedule`]: blocks for the decode rows,
    /// preemption, admission, the prefill pass's chunks), then the plan: admitted requests load
    /// their prefix hits, the prefill pass runs, then one batched decode step. Returns the tokens
    /// and finished requests it produced.
    pub fn step(&mut self) -> Result<Vec<BatchEvent>> {
        let timing = self.timing_to_send.take();
        self.lead(BatchCall::Step(timing))?;
        let stepped = self.learn_and_step(timing);
        self.stop_group_on(stepped)
    }

    /// A follower's step ([`BatchCall::Step`]).
    pub(crate) fn step_following(&mut self, timing: Option<StepTiming>) -> Result<()> {
        self.learn_and_step(timing).map(drop)
    }

    /// A step of a divided batch, with rank 0's `timing` of its step before ([`StepTiming`])
    /// learned first, on every rank at the same point of the call (after the digests compared).
    fn learn_and_step(&mut self, timing: Option<StepTiming>) -> Result<Vec<BatchEvent>> {
        if let Some(timing) = timing {
            timing.record(&mut self.spec_policy);
        }
        self.run_step()
    }

    /// [`BatchGenerator::step`] on this process.
    fn run_step(&mut self) -> Result<Vec<BatchEvent>> {
        let start = Instant::now();
        let mut events = Vec::new();
        let plan = self.schedule(&mut events)?;
        self.admit(&plan.admitted, &mut events)?;
        self.times.schedule_seconds += start.elapsed().as_secs_f64();
        for &id in &plan.yield_prefill {
            let i = self.position(id).expect("planned from the running");
            let mut seq = self.running.remove(i);
            self.preempt(&mut seq)?;
            // Not for memory: counted apart from preemptions.
            self.preemptions -= 1;
            self.prefill_yields += 1;
            self.enqueue(seq, true);
        }
        if self.first_token_waits_for_lower_lane(&plan) {
            // This step only reads it, so that it is handed out now; the next one plans again
            // (what this one admitted stays admitted, and blocks allocated stay allocated).
            self.read_in_flight(&mut events)?;
            self.times.steps += 1;
            self.times.step_seconds += start.elapsed().as_secs_f64();
            return Ok(events);
        }
        self.prefill(&plan, &mut events)?;
        self.decode(&plan, &mut events)?;
        let seconds = start.elapsed().as_secs_f64();
        // What a decode step alone took, for prompt lookup's choice between verify and plain
        // steps (a step with a prefill pass says nothing about either).
        if let Some(step) = self.decoded.take() {
            if plan.prefill.is_none() && !self.follows {
                let timing = StepTiming::new(&step, seconds);
                match self.lockstep {
                    // Learned with the next step's call, on every rank.
                    Some(_) => self.timing_to_send = Some(timing),
                    None => timing.record(&mut self.spec_policy),
                }
            }
        }
        self.times.steps += 1;
        self.times.step_seconds += seconds;
        Ok(events)
    }

    /// Asks the scheduler for the step's plan, applying what it decides first (reading the step
    /// in flight, preempting, finishing a sequence the pool cannot hold) until it returns one.
    fn schedule(&mut self, events: &mut Vec<BatchEvent>) -> Result<StepPlan> {
        let limits = self.step_limits();
        let now = self.now();
        self.kv.expire_pins(&mut self.store, now);
        let mut preempted = false;
        loop {
            // Only those the batch has room for can be admitted (the queue may be long); under
            // memory pressure, none while one runs and one at a time otherwise.
            let mut room = match (self.admissions_held, self.running.is_empty()) {
                (false, _) => self.config.max_running.saturating_sub(self.running.len()),
                (true, true) => 1,
                (true, false) => 0,
            };
            let mut growth = Vec::new();
            if let Some(headroom) = self.memory_headroom.filter(|_| room > 0) {
                growth = self.admission_growth(room);
                let fits = growth
                    .iter()
                    .take_while(|&&bytes| bytes as u64 <= headroom.bytes)
                    .count();
                room = fits;
                // A refused request leaves the queue: the next one is judged.
                let unfit_alone = match growth.first() {
                    Some(&needed) if fits == 0 && self.running.is_empty() => Some(needed),
                    _ => None,
                };
                if let Some(needed) = unfit_alone {
                    if self.relieve_or_refuse(needed, headroom, events)? {
                        continue;
                    }
                }
            }
            if !preempted && room == 0 && self.make_room(events)? {
                continue;
            }
            let active_lane = self.active_lane();
            let caching = self.kv.caching_enabled();
            let running = Self::planned(&self.running, caching);
            let waiting: Vec<plan::Waiting> = self
                .waiting
                .iter()
                .take(room)
                .map(|seq| plan::Waiting {
                    id: seq.id,
                    tokens: &seq.tokens,
                    prefill_step_size: seq.request.prefill_step_size,
                    preloaded: seq.preloaded.as_ref().map(|p| p.offset),
                    bounded: seq.kv.limit().map(|limit| self.bounded_tokens(limit)),
                    private: !seq.kv.is_plain(),
                    whole: &seq.whole,
                    priority: seq.request.priority,
                    pin_ends: &seq.pin_ends,
                    keeps_blocks: seq.keeps_blocks(caching),
                })
                .collect();
            let batch = plan::Batch {
                running: &running,
                waiting: &waiting,
                step_in_flight: self.runner.has_in_flight(),
                admit: !preempted,
                active_lane,
            };
            let tails = &mut self.tails;
            let block_size = self.config.block_size;
            let decision = plan::schedule(
                &mut self.kv,
                &mut self.store,
                &batch,
                &limits,
                |tokens, from| {
                    tails
                        .lookup(tokens, from, block_size)
                        .map(|tail| tail.tokens.len())
                },
            );
            match decision {
                Decision::Run(plan) => {
                    // What was admitted is spent until the next reading.
                    let admitted = plan.admitted.len().checked_sub(1);
                    if let Some(&spent) = admitted.and_then(|k| growth.get(k)) {
                        if let Some(headroom) = &mut self.memory_headroom {
                            headroom.bytes = headroom.bytes.saturating_sub(spent as u64);
                        }
                    }
                    if !plan.admitted.is_empty() {
                        self.relief = None;
                    }
                    return Ok(plan);
                }
                Decision::ReadInFlight => self.read_in_flight(events)?,
                Decision::Preempt(id) => {
                    let i = self.position(id).expect("scheduled from the running");
                    let mut victim = self.running.remove(i);
                    self.preempt(&mut victim)?;
                    self.enqueue(victim, true);
                    preempted = true;
                }
                Decision::FinishOutOfBlocks(id) => {
                    let i = self.position(id).expect("scheduled from the running");
                    let mut seq = self.running.remove(i);
                    seq.sink.output.stats.cut_for_memory = true;
                    self.finish(seq, events)?;
                }
            }
        }
    }

    /// Nothing runs and the first waiting request's KV memory (`needed` bytes) does not fit
    /// `headroom`. It is judged at readings taken after this: first at a fresh one (the
    /// headroom may have been read while others still ran); if it does not fit that either, the
    /// prefix cache is dropped and freed memory given back; if it still does not fit at the
    /// reading after, it leaves the queue (returns true): refused, or, when it was preempted
    /// after streaming tokens, finished with what it has (`length`, as a sequence the pool
    /// cannot hold ends), so a client keeps the text it was sent.
    fn relieve_or_refuse(
        &mut self,
        needed: usize,
        headroom: crate::memory::Available,
        events: &mut Vec<BatchEvent>,
    ) -> Result<bool> {
        let Some(front) = self.waiting.front().map(|seq| seq.id) else {
            return Ok(false);
        };
        let stage = self
            .relief
            .filter(|relief| relief.request == front)
            .map(|relief| (relief.stage, relief.read));
        let (next, leaves) = match stage {
            Some((_, false)) => return Ok(false),
            None => (Some(ReliefStage::Fresh), false),
            Some((ReliefStage::Fresh, true)) => {
                self.forget_prefixes();
                crate::device::release_freed_memory();
                (Some(ReliefStage::Relieved), false)
            }
            Some((ReliefStage::Relieved, true)) => (None, true),
        };
        self.relief = next.map(|stage| Relief {
            request: front,
            stage,
            read: false,
        });
        if !leaves {
            return Ok(false);
        }
        let mut seq = self.waiting.pop_front().expect("the first waiting request");
        if seq.sink.generated > 0 {
            seq.sink.output.stats.cut_for_memory = true;
            self.finish(seq, events)?;
        } else {
            events.push(BatchEvent::Refused {
                request: seq.id,
                error: EngineError::PromptOutOfMemory {
                    prompt_tokens: seq.request.prompt.len(),
                    needed: needed as u64,
                    available: headroom,
                    beyond_capacity: self
                        .memory_capacity
                        .is_some_and(|capacity| needed as u64 > capacity),
                },
            });
        }
        Ok(true)
    }

    /// Runs a decode step of every row bucket up to `max_running` on scratch caches, so that a
    /// GPU backend compiles those graphs now rather than during the first requests (see
    /// `ModelRunner::warm_up`); changes nothing in the batch. Returns the number of shapes run.
    /// The engine calls it at load on GPUs.
    pub fn warm_up(&mut self) -> Result<usize> {
        self.lead(BatchCall::WarmUp)?;
        let start = Instant::now();
        let shapes = self.warm_up_decode_shapes();
        self.times.warm_up_seconds += start.elapsed().as_secs_f64();
        self.stop_group_on(shapes)
    }

    /// [`BatchGenerator::warm_up`]'s steps (the draft's too), counted, not timed.
    fn warm_up_decode_shapes(&mut self) -> Result<usize> {
        let mut shapes = self.runner.warm_up(self.config.max_running)?;
        let rows = self.speculative_rows();
        if let Some(draft) = &mut self.draft {
            shapes += draft.warm_up(rows)?;
        }
        self.times.warm_up_shapes += shapes as u64;
        Ok(shapes)
    }

    /// Queues the passes a batch meets most for [`BatchGenerator::warm_up_idle`]: a lone
    /// prompt's prefill chunk of every width, then a lone sequence's decode step at every
    /// capacity bucket ([`scheduler::decode_warm_up_positions`]), then bursts' and long prompts'
    /// prefill passes ([`scheduler::prefill_warm_up_shapes`]). Positions stay within the context
    /// and a quarter of the pool's tokens (warm-up's zeros are that much KV for a moment).
    pub fn queue_idle_warm_up(&mut self) {
        let _ = self.lead(BatchCall::QueueIdleWarmUp);
        let max_positions = (self.config.num_blocks * self.config.block_size / 4)
            .min(self.model.info().context_length);
        let prefill = scheduler::prefill_warm_up_shapes(
            self.config.prefill_token_budget,
            self.config.prefill_batch_size,
            max_positions,
        );
        let (lone, rest): (Vec<_>, Vec<_>) = prefill
            .into_iter()
            .partition(|s| s.rows == 1 && s.computed == 0);
        self.idle_warm_ups = lone
            .into_iter()
            .map(IdleWarmUp::Prefill)
            .chain(
                scheduler::decode_warm_up_positions(max_positions)
                    .into_iter()
                    .map(|positions| IdleWarmUp::Decode { positions }),
            )
            .chain(rest.into_iter().map(IdleWarmUp::Prefill))
            .collect();
    }

    /// Idle warm-up passes queued and not run yet.
    pub fn idle_warm_ups_left(&self) -> usize {
        self.idle_warm_ups.len()
    }

    /// Runs the next queued pass on a scratch cache (one forward pass, evaluated; nothing in
    /// the batch or the prefix cache changes), and after the last one the decode shapes of
    /// [`BatchGenerator::warm_up`] again. The engine calls it while no request runs
    /// and none is waiting to be read, so a request that arrives waits one pass at most. An
    /// error drops the rest of the queue and is returned.
    ///
    /// Why the decode shapes again: on CUDA, decode steps run after the prefill passes alone were
    /// often slower (by a third) than with the decode shapes met last; clearing MLX's buffer
    /// cache instead did not help.
    pub fn warm_up_idle(&mut self) -> Result<()> {
        if self.idle_warm_ups.is_empty() {
            return Ok(());
        }
        self.lead(BatchCall::WarmUpIdle)?;
        let warmed = self.run_idle_warm_up();
        self.stop_group_on(warmed)
    }

    /// [`BatchGenerator::warm_up_idle`]'s pass on this process.
    fn run_idle_warm_up(&mut self) -> Result<()> {
        let Some(pass) = self.idle_warm_ups.pop_front() else {
            return Ok(());
        };
        let start = Instant::now();
        let mut result = match pass {
            IdleWarmUp::Prefill(shape) => self.runner.warm_up_prefill(shape).and_then(|()| {
                // A draft's rows catch up in the same shapes.
                match &mut self.draft {
                    Some(draft) => draft.warm_up_prefill(shape),
                    None => Ok(()),
                }
            }),
            IdleWarmUp::Decode { positions } => {
                self.runner
                    .warm_up_decode_at(positions)
                    .and_then(|()| match &mut self.draft {
                        Some(draft) => draft.warm_up_decode_at(positions),
                        None => Ok(()),
                    })
            }
        };
        if result.is_ok() {
            self.times.warm_up_shapes += 1;
            if self.idle_warm_ups.is_empty() {
                result = self.warm_up_decode_shapes().map(drop);
            }
        }
        self.times.warm_up_seconds += start.elapsed().as_secs_f64();
        if result.is_err() {
            self.idle_warm_ups.clear();
        }
        result
    }

    /// Decode steps run through MLX's compiler so far ([`BatchConfig::compile_decode`]), warm-up
    /// included.
    pub fn compiled_decode_steps(&self) -> usize {
        self.runner.compiled_decode_steps()
    }

    /// Where the steps spent their time so far.
    pub fn step_times(&self) -> StepTimes {
        StepTimes {
            compiled_decode_steps: self.compiled_decode_steps() as u64,
            ..self.times
        }
    }

    /// Starts the requests the plan admits (the front of the waiting queue, in order): each
    /// loads the blocks of its prefix hit the plan lists ([`BlockStore::load_into`]), then a kept
    /// partial block or its preloaded prefix, and joins the running sequences.
    fn admit(&mut self, admitted: &[Admission], events: &mut Vec<BatchEvent>) -> Result<()> {
        let block_size = self.config.block_size;
        let hybrid = self.store.has_recurrent_layers();
        for admission in admitted {
            let mut seq = self.waiting.pop_front().expect("admitted from the front");
            debug_assert_eq!(seq.id, admission.id, "admitted in queue order");
            let (hit, load) = (&admission.hit, admission.load);
            seq.pinned = admission.pinned.clone();
            seq.cache = self.make_cache();
            // The blocks it loads are published already: a sliding layer need not load those its
            // window cannot reach.
            allow_release(&mut seq.cache, load * block_size);
            self.store
                .load_into(&hit.blocks[..load], &mut seq.cache, block_size)?;
            seq.computed = load * block_size;
            // A hybrid sequence that recomputes shared blocks leaves its states at their end; a
            // sliding one republishes them (`publish` gives them their sliding parts back).
            seq.branch_at = admission.branch_at;
            if admission.tail {
                let tail = self
                    .tails
                    .lookup(&seq.tokens, hit.num_tokens, block_size)
                    .expect("the tail the plan found");
                let new = (tail.tokens.len() - seq.computed) as i32;
                for (cache, parts) in seq.cache.iter_mut().zip(&tail.parts) {
                    cache.append_block_parts(parts, new)?;
                }
                seq.computed = tail.tokens.len();
            }
            let from_prefix_cache = seq.computed;
            if let Some(prefix) = &seq.preloaded {
                for (cache, layer) in seq.cache.iter_mut().zip(&prefix.layers) {
                    cache.extend_from(layer, prefix.offset as i32)?;
                }
                seq.computed = prefix.offset;
                // Nothing is ever copied out of a private prefix's cache.
                allow_release(&mut seq.cache, i32::MAX as usize);
            }
            if !seq.admitted_once {
                self.kv
                    .record_prefix_lookup(seq.tokens.len(), from_prefix_cache);
                seq.sink.output.stats.cached_prompt_tokens = seq.computed;
                seq.admitted_once = true;
                let client = seq.request.client.as_deref();
                let another_model = match (client, &self.client_models) {
                    (Some(client), Some((model, models))) => models.switched(client, model),
                    _ => None,
                };
                let lookup = Lookup {
                    tokens: &seq.tokens,
                    found_blocks: hit.blocks.len(),
                    loaded_blocks: load,
                    loaded_tokens: seq.computed,
                    own_cache: !seq.kv.is_plain() || seq.preloaded.is_some(),
                    previous: client.and_then(|c| self.clients.previous(c)),
                    another_model: another_model.as_deref(),
                };
                let miss = explain_miss(&self.kv, &lookup, Instant::now());
                if let Some(client) = client {
                    let (tokens, cached) = (&seq.tokens, seq.computed);
                    self.clients
                        .started(client, seq.id, tokens, cached, miss.as_ref());
                }
                seq.sink.output.stats.cache_miss = miss.clone();
                let prompt_cache = PromptCacheReport {
                    prompt_tokens: seq.request.prompt.len(),
                    cached_tokens: seq.computed,
                    miss,
                };
                events.push(BatchEvent::Admitted {
                    request: seq.id,
                    prompt_cache,
                });
            }
            debug_assert_eq!(seq.computed, admission.num_computed);
            eval(seq.cache.iter().flat_map(KvCache::state))?;
            self.store.touch(&hit.blocks[..load], block_size);
            seq.published_blocks = if hybrid { hit.blocks.len() } else { load };
            self.running.push(seq);
        }
        Ok(())
    }

    /// The running sequences as the scheduler plans a step for them, in order.
    fn planned(running: &[Sequence], caching: bool) -> Vec<plan::Running<'_>> {
        running
            .iter()
            .map(|seq| plan::Running {
                id: seq.id,
                progress: seq.progress(),
                slot: match seq.slot {
                    None => SlotKind::None,
                    Some(Slot::Prefill(_)) => SlotKind::Prefill,
                    Some(Slot::Decode(_)) => SlotKind::Decode,
                },
                scored: seq.scored(),
                branch_at: seq.branch_at,
                own_chunks: !seq.kv.is_plain(),
                whole: &seq.whole,
                priority: seq.request.priority,
                pin_ends: &seq.pin_ends,
                keeps_blocks: seq.keeps_blocks(caching),
            })
            .collect()
    }

    /// Whether the decode step in flight holds the first token of a sequence of a higher lane
    /// than every sequence the plan's prefill pass computes (a chat's, behind a background
    /// prompt): it is then read and handed out before that pass runs, which would otherwise
    /// delay it by the pass's time (steps read their tokens after their passes, so that the host
    /// builds a step while the device finishes the one before).
    fn first_token_waits_for_lower_lane(&self, plan: &StepPlan) -> bool {
        let find = |id: RequestId| self.running.iter().find(|s| s.id == id);
        let Some(pass) = plan.prefill.as_ref().and_then(|p| {
            p.chunks
                .iter()
                .filter_map(|&(id, _)| find(id).map(|s| s.request.priority))
                .min()
        }) else {
            return false;
        };
        // Usually no sequence is of a higher lane: then the step in flight is not looked at.
        let waits = |s: &Sequence| s.request.priority < pass && s.first_token_at.is_none();
        self.running.iter().any(waits)
            && self
                .runner
                .in_flight_ids()
                .any(|id| find(id).is_some_and(waits))
    }

    /// The highest lane a sequence ran in within [`scheduler::ACTIVE_LANE_WINDOW`], the running
    /// ones included (their lanes are marked seen now).
    fn active_lane(&mut self) -> Option<Priority> {
        let now = self.now();
        for seq in &self.running {
            self.lane_seen[seq.request.priority as usize] = Some(now);
        }
        [Priority::High, Priority::Normal, Priority::Low]
            .into_iter()
            .find(|&lane| {
                self.lane_seen[lane as usize]
                    .is_some_and(|at| now.duration_since(at) < scheduler::ACTIVE_LANE_WINDOW)
            })
    }

    /// Puts `seq` in the waiting queue, which is in lane order ([`Priority`]): behind every
    /// request of its lane and the higher ones, or, `preempted`, ahead of those of its lane
    /// (a preempted sequence goes on first, as vLLM's).
    fn enqueue(&mut self, seq: Sequence, preempted: bool) {
        let lane = seq.request.priority;
        let at = match preempted {
            true => self.waiting.iter().position(|w| w.request.priority >= lane),
            false => self.waiting.iter().position(|w| w.request.priority > lane),
        };
        self.waiting.insert(at.unwrap_or(self.waiting.len()), seq);
    }

    /// When the batch is full (`max_running`) and the first waiting request is of a higher lane
    /// than some running sequence, that lane's newest sequence leaves the batch for it
    /// ([`scheduler::make_room_for`]), after the decode step in flight is read (its last token
    /// must not be lost). Returns whether it changed the batch (then schedule again).
    fn make_room(&mut self, events: &mut Vec<BatchEvent>) -> Result<bool> {
        let Some(front) = self.waiting.front().map(|w| w.request.priority) else {
            return Ok(false);
        };
        if self.admissions_held || self.running.len() < self.config.max_running {
            return Ok(false);
        }
        // Not for a request that would not be admitted for memory once there is room.
        if let Some(headroom) = self.memory_headroom {
            if self
                .admission_growth(1)
                .first()
                .is_some_and(|&bytes| bytes as u64 > headroom.bytes)
            {
                return Ok(false);
            }
        }
        let lanes: Vec<Priority> = self.running.iter().map(|s| s.request.priority).collect();
        let Some(i) = scheduler::make_room_for(front, &lanes) else {
            return Ok(false);
        };
        if self.runner.has_in_flight() {
            self.read_in_flight(events)?;
            return Ok(true);
        }
        let mut victim = self.running.remove(i);
        self.preempt(&mut victim)?;
        self.enqueue(victim, true);
        Ok(true)
    }

    /// Whether the model's images attend to each other both ways
    /// ([`crate::models::vision::VisionTower::attends_both_ways`]).
    fn images_attend_both_ways(&self) -> bool {
        self.model
            .vision()
            .is_some_and(crate::models::vision::VisionTower::attends_both_ways)
    }

    /// The token spans of `images` that a prefill chunk must keep whole, when the model's
    /// images attend to each other both ways (none otherwise): each image's, images that touch
    /// in one (one run of image tokens is one block, as Hugging Face's
    /// `get_block_sequence_ids_for_mask` counts them). `Err` for a span longer than one pass
    /// computes (the prefill budget) or than a sliding layer sees (its window), and for a
    /// request whose KV cache is bounded (`bounded`: `max_kv_size`).
    fn both_ways_spans(
        &self,
        images: &[SequenceImage],
        bounded: bool,
    ) -> Result<Vec<(usize, usize)>> {
        if !self.images_attend_both_ways() || images.is_empty() {
            return Ok(Vec::new());
        }
        let window = self
            .model
            .make_cache(None)
            .iter()
            .filter_map(|c| c.window())
            .min()
            .map_or(usize::MAX, |w| w.max(1) as usize);
        if bounded {
            return Err(EngineError::Request(
                "images with max_kv_size: this model's image tokens attend to each other, which \
                 a bounded KV cache does not keep"
                    .into(),
            ));
        }
        let most = self.config.prefill_token_budget.min(window);
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(images.len());
        for image in images {
            match spans.last_mut() {
                Some(last) if last.1 == image.start => last.1 = image.end(),
                _ => spans.push((image.start, image.end())),
            }
        }
        if let Some(n) = spans.iter().map(|(s, e)| e - s).find(|&n| n > most) {
            return Err(EngineError::Request(format!(
                "an image of {n} tokens; this model's image tokens attend to each other, and at \
                 most {most} can (its prefill budget and sliding window): send a smaller image"
            )));
        }
        Ok(spans)
    }

    /// The limits [`plan::plan_step`] plans within.
    fn step_limits(&self) -> StepLimits {
        StepLimits {
            max_running: self.config.max_running,
            prefill_batch_size: self.config.prefill_batch_size,
            prefill_token_budget: self.config.prefill_token_budget,
            prefill_fits_budget: self.config.prefill_fits_budget,
            block_size: self.config.block_size,
            align_chunks_to_blocks: self.store.has_recurrent_layers(),
        }
    }

    /// The index of running request `id`, if it still runs.
    fn position(&self, id: RequestId) -> Option<usize> {
        self.running.iter().position(|s| s.id == id)
    }

    /// Runs the plan's prefill: its sequences entering take a prefill slot, and every slot's
    /// chunk runs in one forward pass padded to the plan's width (`ModelRunner::prefill_step`);
    /// then the pass's full blocks are published to the prefix cache (not waited for), and a
    /// hybrid sequence that reached its `branch_at` leaves its recurrent states in the block
    /// that ends there.
    fn prefill(&mut self, plan: &StepPlan, events: &mut Vec<BatchEvent>) -> Result<()> {
        for &id in &plan.enter_prefill {
            let i = self.position(id).expect("planned from the running");
            let seq = &mut self.running[i];
            let slot = self
                .runner
                .enter_prefill(&seq.cache, seq.computed, seq.kv)?;
            if let Some(rope) = &seq.rope {
                self.runner.set_rope_shift(slot, rope.delta);
            }
            seq.slot = Some(slot);
            seq.cache = Vec::new();
        }
        let Some(pass) = &plan.prefill else {
            return Ok(());
        };
        // The images the pass feeds get their features first (a pass of the tower each): a
        // sequence whose image the tower fails on leaves the batch refused, the others go on.
        let mut failed = Vec::new();
        for &(id, chunk) in &pass.chunks {
            let i = self.position(id).expect("planned from the running");
            let seq = &mut self.running[i];
            let (from, to) = (seq.computed, seq.computed + chunk);
            if let Err(error) = images::compute_features(self.model, &mut seq.images, from, to) {
                failed.push((id, error));
            }
        }
        for (id, error) in failed {
            let i = self.position(id).expect("planned from the running");
            let mut seq = self.running.remove(i);
            self.release(&mut seq)?;
            events.push(BatchEvent::Refused { request: id, error });
        }
        // The chunk of each prefill slot (empty for a free one); a sequence with images feeds
        // its placeholders as the image token, with the images' features ([`images`]).
        let span = self.runner.prefill_slot_span();
        let mut with_images: Vec<Option<Vec<u32>>> = vec![None; span];
        let mut pieces: Vec<Vec<images::Piece>> = vec![Vec::new(); span];
        let mut rows = vec![None; span];
        for &(id, chunk) in &pass.chunks {
            let Some(i) = self.position(id) else {
                continue; // refused above
            };
            let seq = &mut self.running[i];
            let Some(Slot::Prefill(row)) = seq.slot else {
                unreachable!("a sequence in the prefill pass is in a prefill slot")
            };
            rows[row] = Some((i, chunk));
            if !seq.images.is_empty() {
                let fed = &seq.tokens[seq.computed..seq.computed + chunk];
                let (ids, mine) =
                    images::chunk_inputs(self.model, &mut seq.images, fed, seq.computed)?;
                with_images[row] = Some(ids);
                pieces[row] = mine;
            }
        }
        let tokens: Vec<&[u32]> = rows
            .iter()
            .zip(&with_images)
            .map(|(row, ids)| match (row, ids) {
                (_, Some(ids)) => &ids[..],
                (Some((i, chunk)), None) => {
                    let seq = &self.running[*i];
                    &seq.tokens[seq.computed..seq.computed + chunk]
                }
                (None, None) => &[][..],
            })
            .collect();
        let both_ways = self.images_attend_both_ways();
        let mut spliced = images::spliced(&pieces, pass.width, both_ways)?;
        // Rows whose positions follow their images take every token's position explicitly.
        if rows
            .iter()
            .flatten()
            .any(|&(i, _)| self.running[i].rope.is_some())
        {
            // As many rows as the pass feeds (the prefill cache's row bucket, padding rows 0).
            let pass_rows = self.runner.slot_shapes()[1].0.max(span);
            let per_axis = pass_rows * pass.width;
            let mut positions = vec![0i32; 3 * per_axis];
            for (row, entry) in rows.iter().enumerate() {
                let Some((i, _)) = *entry else { continue };
                let seq = &self.running[i];
                for t in 0..pass.width {
                    let index = seq.computed + t;
                    for axis in 0..3 {
                        positions[axis * per_axis + row * pass.width + t] = match &seq.rope {
                            Some(rope) => rope.at(axis, index),
                            None => index as i32,
                        };
                    }
                }
            }
            let shape = [3, pass_rows as i32, pass.width as i32];
            let positions = Array::from_slice(&positions, &shape);
            spliced.get_or_insert_with(Default::default).rope_positions = Some(positions);
        }
        let start = Instant::now();
        self.runner
            .prefill_step(&tokens, pass.width, spliced.as_ref())?;
        self.times.prefill_seconds += start.elapsed().as_secs_f64();
        self.times.prefill_tokens += pass.num_tokens() as u64;
        self.times.prefill_passes += 1;
        self.prompt_throughput.record(pass.num_tokens());
        let start = Instant::now();
        let now = self.now();
        let hybrid = self.store.has_recurrent_layers();
        // The pass's rows' blocks copied together (`Publishing`), not waited for: the copies
        // follow the pass in flight (see `prefill_step`).
        let mut publishing = Publishing::default();
        for &(id, chunk) in &pass.chunks {
            let Some(i) = self.position(id) else {
                continue; // refused above
            };
            let seq = &mut self.running[i];
            seq.computed += chunk;
            let published = seq.published_blocks;
            publishing.add(&mut self.kv, &mut self.store, &self.runner, seq)?;
            // The recomputed shared blocks' last one gets the states at its end, and so does
            // one where a prefix this sequence pins ends.
            let block_size = self.config.block_size;
            let recomputed = seq.computed / block_size <= published;
            let at_pin = recomputed && seq.pin_ends.contains(&seq.computed);
            if hybrid && (seq.branch_at == Some(seq.computed) || at_pin) {
                if seq.branch_at == Some(seq.computed) {
                    seq.branch_at = None;
                }
                let table = self.kv.block_table(seq.id).expect("a running request");
                let id = table[seq.computed / block_size - 1];
                let states = slot_states(&self.runner, seq.slot.expect("in a prefill slot"))?;
                async_eval(states.iter().flatten())?;
                self.store.put_bounded(id, states);
            }
        }
        publishing.copy(&mut self.kv, &mut self.store, &self.runner, false)?;
        for &(id, _) in &pass.chunks {
            if let Some(i) = self.position(id) {
                take_pins(&mut self.kv, &mut self.store, &mut self.running[i], now);
            }
        }
        self.runner.end_prefill_step()?;
        self.times.publish_seconds += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// One decode step of every sequence whose prompt is cached, pipelined: the step is built
    /// and dispatched (`async_eval`) before the previous step's tokens are read, so the host
    /// builds step N+1 while the device runs step N (as [`crate::sequence::generate`] does for one
    /// sequence). A sequence whose token from the previous step is not read yet feeds it from the
    /// device ([`plan::schedule`] gave each the block for the token it feeds). Adds the previous
    /// step's tokens and finished requests to `events`: a sequence that finished there also ran
    /// in this step, whose row is dropped unread.
    fn decode(&mut self, plan: &StepPlan, events: &mut Vec<BatchEvent>) -> Result<()> {
        let mut ready = self.decode_rows(plan);
        // A constrained sequence's next mask needs its last token on the host: the step in
        // flight is read first (no pipelining while one runs; see `crate::sample::grammar`).
        if self.runner.has_in_flight() && ready.iter().any(|&i| self.running[i].grammar.is_some()) {
            self.read_in_flight(events)?;
            ready = self.decode_rows(plan);
        }
        if ready.is_empty() {
            self.read_in_flight(events)?;
            return Ok(());
        }
        if self.speculates(&ready) {
            let rows = ready.len();
            // Proposals follow a row's last token: the step in flight is read first (only when
            // some row proposes after the tokens read so far, so text without repeats keeps
            // its pipelined steps).
            let mut previous_seconds = 0.0;
            if self.runner.has_in_flight() {
                let start = Instant::now();
                self.read_in_flight(events)?;
                previous_seconds = start.elapsed().as_secs_f64();
                ready = self.decode_rows(plan);
            }
            if ready.is_empty() || self.verify(&ready, events)? {
                if let Some(step) = &mut self.decoded {
                    // Measured at the rows it was chosen for (the read may have ended some).
                    step.rows = rows;
                    step.previous_seconds = previous_seconds;
                }
                return Ok(());
            }
        }
        let start = Instant::now();
        self.enter_decode_slots(&ready)?;
        let mut first_steps = 0;
        let vocab = self.model.info().vocab_size;
        let mut rows = Vec::with_capacity(ready.len());
        for (_, seq) in picked_mut(&mut self.running, &ready) {
            // A sequence's first decode step also processes its last prompt token.
            first_steps +=
                usize::from(seq.computed + 1 == seq.tokens.len() && seq.first_token_at.is_none());
            seq.computed += 1;
            let Some(Slot::Decode(row)) = seq.slot else {
                unreachable!("a ready sequence is in a decode slot")
            };
            rows.push(DecodeRow {
                id: seq.id,
                row,
                last_token: *seq.tokens.last().expect("non-empty"),
                sampler: &mut seq.sampler,
                history: &mut seq.history,
                logprobs: seq.request.logprobs,
                distribution: seq.request.next_token_logprobs,
                mask: seq.grammar.as_mut().map(|g| g.mask(vocab)),
            });
        }
        let (step, built) = self.runner.dispatch_decode(rows)?;
        if self.store.has_recurrent_layers() {
            self.keep_boundary_states(&ready)?;
        }
        self.times.decode_build_seconds += built;
        self.times.decode_seconds += start.elapsed().as_secs_f64();
        self.times.decode_steps += 1;
        if (self.config.prompt_lookup.is_some() || self.draft.is_some())
            && ready.len() <= self.speculative_rows()
        {
            self.decoded = Some(DecodedStep {
                rows: ready.len(),
                verified: false,
                tokens: ready.len(),
                previous_seconds: 0.0,
            });
        }
        self.prompt_throughput.record(first_steps);
        self.read_in_flight(events)?;
        if self.model.has_sliding_window_layers() {
            // Decoding sequences publish blocks as they fill, before the sliding layers' rings
            // overwrite them (a block's positions last `R - window` more steps there, see
            // `slot_cache`). The copies run
            // after the step just dispatched; nothing waits for them. Only tokens already read
            // can be hashed.
            // Their copies are made together (`Publishing`), then the pins they satisfy taken.
            let start = Instant::now();
            let now = self.now();
            let mut publishing = Publishing::default();
            let publishes = |s: &Sequence| s.prefill_done() && s.computed <= s.tokens.len();
            for seq in self.running.iter_mut().filter(|s| publishes(s)) {
                publishing.add(&mut self.kv, &mut self.store, &self.runner, seq)?;
            }
            publishing.copy(&mut self.kv, &mut self.store, &self.runner, false)?;
            for seq in self.running.iter_mut().filter(|s| publishes(s)) {
                take_pins(&mut self.kv, &mut self.store, seq, now);
            }
            self.times.publish_seconds += start.elapsed().as_secs_f64();
        }
        // Unless every sequence it stepped has just finished: then it is waited for, so that
        // none of its work still runs (and holds memory) once the batch is idle.
        if step.ids().any(|id| self.running.iter().any(|s| s.id == id)) {
            self.runner.set_in_flight(step);
        } else {
            step.wait()?;
        }
        Ok(())
    }

    /// Whether this decode step verifies proposals ([`crate::spec_decode`]): prompt lookup
    /// ([`BatchConfig::prompt_lookup`]) or a draft model ([`BatchGenerator::with_draft`]) on,
    /// at most [`BatchGenerator::speculative_rows`] rows, each one that may join a verify step
    /// ([`Sequence::may_verify`]; the others feed their last token alone) in a batch whose rows
    /// all keep plain KV caches of a model without sliding layers (recurrent states go back
    /// over a verify step's record: [`ModelRunner::rewind_rows`]), and
    /// some row proposing: a row the draft model drafts for (every step), or a greedy row
    /// prompt lookup proposes for while verify steps give more tokens a second than plain ones
    /// at this row count lately ([`SpecPolicy`], at `ready.len()` rows: the count the step is
    /// measured at; always, with prompt lookup's `adaptive` off).
    fn speculates(&mut self, ready: &[usize]) -> bool {
        let lookup = self.config.prompt_lookup;
        if (lookup.is_none() && self.draft.is_none())
            || ready.len() > self.speculative_rows()
            || self.model.has_sliding_window_layers()
            || self.running.iter().any(|s| !s.kv.is_plain())
            || !ready.iter().all(|&i| self.running[i].may_verify())
        {
            return false;
        }
        let context = self.model.info().context_length;
        // A draft model proposes every step for its rows, as mlx_lm's speculative generation
        // does: the request asked for it.
        if ready.iter().any(|&i| {
            let seq = &self.running[i];
            self.drafts_for(seq).is_some() && seq.proposal_room(context) > 0
        }) {
            return true;
        }
        let Some(lookup) = lookup else {
            return false;
        };
        // The choice first: where plain steps pay, nobody's tokens are scanned.
        if lookup.adaptive && !self.spec_policy.verify_next(ready.len()) {
            return false;
        }
        ready.iter().any(|&i| {
            let seq = &self.running[i];
            looks_up(seq)
                && !lookup
                    .propose(&seq.tokens, seq.proposal_room(context))
                    .is_empty()
        })
    }

    /// The tokens the draft model proposes a step for `seq`, when it drafts for it: a greedy
    /// sequence from its second token on (the draft's first pass over the sequence's tokens
    /// would otherwise delay its first), a sampled one from its first (as mlx_lm, whose first
    /// token is a verify pass's draw after the draft's: a plain first step would draw it
    /// first), and not after a prompt-cache prefix (whose tokens the draft cannot read: a file
    /// without token ids leaves placeholders).
    fn drafts_for(&self, seq: &Sequence) -> Option<usize> {
        self.draft.as_ref()?;
        if seq.sampler.is_plain_greedy() {
            seq.first_token_at?;
        }
        if seq.preloaded.is_some() {
            return None;
        }
        seq.request.num_draft_tokens
    }

    /// Each of the `ready` rows' proposals for a verify step, each with the pool's blocks for
    /// its last token and them taken (proposals never preempt: a row the pool is short for
    /// proposes nothing): the draft model's (one batched run for all its rows, after their
    /// blocks are taken, so that a row left out spends none of its sampler's draws) for the
    /// rows it drafts for, prompt lookup's for greedy rows without a draft (while a row's
    /// [`Backoff`] lets it propose; mlx_lm accepts a sampled row's proposals by its draws,
    /// which prompt lookup does not make). The draft's are dispatched and not read: each of
    /// its rows gets its column of them and their count.
    fn proposals(&mut self, ready: &[usize]) -> Result<Proposals> {
        let context = self.model.info().context_length;
        let mut proposals = Proposals {
            host: vec![Vec::new(); ready.len()],
            drafted: vec![None; ready.len()],
            device: None,
        };
        // (place in `ready`, tokens it drafts)
        let mut drafting = Vec::new();
        for (j, &i) in ready.iter().enumerate() {
            let seq = &self.running[i];
            let room = seq.proposal_room(context);
            let proposed = match (self.drafts_for(seq), self.config.prompt_lookup) {
                (Some(k), _) if room > 0 => {
                    let k = k.min(room);
                    if self
                        .kv
                        .allocate(&mut self.store, seq.id, seq.computed, 1 + k, None)
                    {
                        drafting.push((j, k));
                    }
                    continue;
                }
                (None, Some(lookup)) if looks_up(seq) => lookup.propose(&seq.tokens, room),
                _ => continue,
            };
            if !proposed.is_empty()
                && self.kv.allocate(
                    &mut self.store,
                    seq.id,
                    seq.computed,
                    1 + proposed.len(),
                    None,
                )
            {
                proposals.host[j] = proposed.to_vec();
            }
        }
        if !drafting.is_empty() {
            let picked: Vec<usize> = drafting.iter().map(|&(j, _)| ready[j]).collect();
            let rows = picked_mut(&mut self.running, &picked)
                .zip(&drafting)
                .map(|((_, seq), &(_, k))| {
                    let sampled = !seq.sampler.is_plain_greedy();
                    DraftRow {
                        id: seq.id,
                        tokens: &seq.tokens,
                        k,
                        sampler: sampled.then_some(&mut seq.sampler),
                    }
                })
                .collect();
            let draft = self.draft.as_mut().expect("rows draft only with a draft");
            let device = draft.propose(rows)?;
            for (&(j, k), &column) in drafting.iter().zip(&device.columns) {
                proposals.drafted[j] = Some((column, k));
            }
            proposals.device = Some(device);
        }
        Ok(proposals)
    }

    /// A verify step ([`ModelRunner::verify`]) of the `ready` rows, with nothing in flight: each
    /// row feeds its last token and the tokens proposed after it ([`BatchGenerator::proposals`];
    /// those the pool has free blocks for: proposals never preempt), keeps the proposals the
    /// model agrees with ([`spec_decode::accepted`]), emits the model's token after them, and
    /// gives back the positions of the rest (in the draft's cache too). Returns false, having
    /// verified nothing, when no row proposes.
    fn verify(&mut self, ready: &[usize], events: &mut Vec<BatchEvent>) -> Result<bool> {
        let start = Instant::now();
        let Proposals {
            host,
            drafted,
            device,
        } = self.proposals(ready)?;
        let fed: Vec<Vec<u32>> = ready
            .iter()
            .zip(host)
            .map(|(&i, proposed)| {
                let last = *self.running[i].tokens.last().expect("non-empty");
                [vec![last], proposed].concat()
            })
            .collect();
        if device.is_none() && fed.iter().all(|f| f.len() == 1) {
            self.settle_drafts(ready, &vec![0; ready.len()])?;
            return Ok(false);
        }
        self.times.draft_seconds += start.elapsed().as_secs_f64();
        let verify_start = Instant::now();
        self.enter_decode_slots(ready)?;
        let rows = picked_mut(&mut self.running, ready)
            .map(|(j, seq)| {
                let Some(Slot::Decode(row)) = seq.slot else {
                    unreachable!("a ready sequence is in a decode slot")
                };
                let sampled = !seq.sampler.is_plain_greedy();
                FedRow {
                    row,
                    fed: &fed[j],
                    proposed: drafted[j],
                    sampler: sampled.then_some(&mut seq.sampler),
                }
            })
            .collect();
        let verified = self.runner.verify(rows, device.as_ref())?;
        let waited = verify_start.elapsed().as_secs_f64();
        // Each row's fed tokens in full: its last, then its proposals (the draft's, read now).
        let fed: Vec<Vec<u32>> = fed
            .into_iter()
            .zip(verified.drafted)
            .map(|(fed, drafted)| [fed, drafted].concat())
            .collect();
        let targets = verified.targets;
        let accepted: Vec<usize> = fed
            .iter()
            .zip(&targets)
            .map(|(fed, targets)| spec_decode::accepted(&fed[1..], targets))
            .collect();
        // The draft keeps what its rows' sequences now hold (before they finish and leave).
        self.settle_drafts(ready, &accepted)?;
        let mut done = Vec::new();
        let mut rewinds = Vec::new();
        let (mut generated, mut first_steps) = (0, 0);
        for (((&i, fed), targets), &accepted) in ready.iter().zip(&fed).zip(&targets).zip(&accepted)
        {
            let seq = &mut self.running[i];
            let Some(Slot::Decode(row)) = seq.slot else {
                unreachable!("a ready sequence is in a decode slot")
            };
            first_steps +=
                usize::from(seq.computed + 1 == seq.tokens.len() && seq.first_token_at.is_none());
            seq.first_token_at
                .get_or_insert_with(|| seq.start.elapsed().as_secs_f64());
            let proposed = &fed[1..];
            let mut emitted = 0;
            for (place, &token) in targets[..=accepted].iter().enumerate() {
                emitted += 1;
                if emit(seq, self.tokenizer, token, None, place < accepted, events)? {
                    done.push(seq.id);
                    break;
                }
            }
            generated += emitted;
            // The fed tokens whose successors were emitted are the cache's; the rest go.
            seq.computed += emitted;
            rewinds.push((row, fed.len() - emitted));
            let stats = &mut seq.sink.output.stats;
            stats.draft_tokens += proposed.len();
            stats.accepted_draft_tokens += accepted.min(emitted);
            // (Prompt lookup's record; a draft's rows propose whatever it says.)
            seq.lookup
                .record(proposed.len(), accepted, seq.tokens.len());
            self.times.draft_tokens += proposed.len() as u64;
            self.times.accepted_draft_tokens += accepted.min(emitted) as u64;
        }
        self.runner.rewind_rows(&rewinds)?;
        if self.store.has_recurrent_layers() {
            self.keep_boundary_states(ready)?;
        }
        self.times.decode_seconds += start.elapsed().as_secs_f64();
        self.times.decode_wait_seconds += waited;
        self.times.decode_steps += 1;
        self.times.verify_steps += 1;
        self.decoded = Some(DecodedStep {
            rows: ready.len(),
            verified: true,
            tokens: generated,
            previous_seconds: 0.0,
        });
        self.prompt_throughput.record(first_steps);
        self.generation_throughput.record(generated);
        self.finish_done(done, events)?;
        Ok(true)
    }

    /// The recurrent layers' states of the `ready` rows whose last step ended on a block
    /// boundary, kept for the block that ends there (lazy: computed with the step just
    /// dispatched; a verify step's rows that end past a boundary keep none for it).
    fn keep_boundary_states(&mut self, ready: &[usize]) -> Result<()> {
        let block_size = self.config.block_size;
        for &i in ready {
            let seq = &mut self.running[i];
            let Some(slot) = seq
                .slot
                .filter(|_| seq.computed.is_multiple_of(block_size) && seq.kv.is_plain())
            else {
                continue;
            };
            let states = slot_states(&self.runner, slot)?;
            async_eval(states.iter().flatten())?;
            seq.boundary_state = Some((seq.computed, states));
        }
        Ok(())
    }

    /// After a verify step of the `ready` rows, before their tokens are emitted: the draft's
    /// rows keep their sequences' tokens and the `accepted` proposals of each.
    fn settle_drafts(&mut self, ready: &[usize], accepted: &[usize]) -> Result<()> {
        let Some(draft) = &mut self.draft else {
            return Ok(());
        };
        for (&i, &accepted) in ready.iter().zip(accepted) {
            let seq = &self.running[i];
            draft.settle(seq.id, seq.tokens.len() + accepted)?;
        }
        Ok(())
    }

    /// The indices of the plan's decode rows still running (in order: the plan's rows follow the
    /// running sequences' order, which removals keep).
    fn decode_rows(&self, plan: &StepPlan) -> Vec<usize> {
        plan.decode
            .iter()
            .filter_map(|&id| self.position(id))
            .collect()
    }

    /// Moves every ready sequence not decoding in a slot yet into the decode slot cache: from its
    /// prefill slot, or from its own cache (a one-token prompt, or one that found no prefill
    /// slot free).
    fn enter_decode_slots(&mut self, ready: &[usize]) -> Result<()> {
        for &i in ready {
            let seq = &self.running[i];
            if let Some(Slot::Decode(_)) = seq.slot {
                continue;
            }
            let (slot, moves) =
                self.runner
                    .enter_decode(seq.slot, &seq.cache, seq.computed, seq.kv)?;
            self.slots_moved(&moves);
            if let Some(rope) = &self.running[i].rope {
                self.runner.set_rope_shift(slot, rope.delta);
            }
            let seq = &mut self.running[i];
            seq.slot = Some(slot);
            seq.cache = Vec::new();
            // Its sliding layers now hold a decode ring, not a prefill chunk's worth more
            // (`KvBudget::window_tokens`): the pool gets the difference back.
            if let Some(ring) = self.runner.decode_ring_positions() {
                self.kv.bound_window(seq.id, ring);
            }
        }
        Ok(())
    }

    /// Reads the step in flight, if any: its tokens go to their sequences' streams (events), and
    /// the sequences they finish leave the batch. Rows of sequences no longer running (finished
    /// or cancelled since the step was dispatched) are dropped.
    fn read_in_flight(&mut self, events: &mut Vec<BatchEvent>) -> Result<()> {
        let start = Instant::now();
        let Some((tokens, waited)) = self.runner.read_in_flight()? else {
            return Ok(());
        };
        // The wait for the device belongs to the decode step that was dispatched.
        self.times.decode_seconds += waited;
        self.times.decode_wait_seconds += waited;
        let mut done = Vec::new();
        let mut generated = 0;
        for step in tokens {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == step.id) else {
                continue;
            };
            seq.first_token_at
                .get_or_insert_with(|| seq.start.elapsed().as_secs_f64());
            if seq.request.next_token_logprobs {
                // Scored, not generated: the distribution is the answer; the token is dropped.
                seq.sink.output.next_token_logprobs = step.distribution;
                done.push(seq.id);
                continue;
            }
            generated += 1;
            if emit(
                seq,
                self.tokenizer,
                step.token,
                step.logprobs,
                false,
                events,
            )? {
                done.push(seq.id);
            }
        }
        self.generation_throughput.record(generated);
        self.times.token_seconds += start.elapsed().as_secs_f64() - waited;
        self.finish_done(done, events)
    }

    /// Finishes the running sequences `done` ([`BatchGenerator::finish`]).
    fn finish_done(&mut self, done: Vec<RequestId>, events: &mut Vec<BatchEvent>) -> Result<()> {
        for id in done {
            let pos = self
                .running
                .iter()
                .position(|s| s.id == id)
                .expect("finished sequence is running");
            let seq = self.running.remove(pos);
            self.finish(seq, events)?;
        }
        Ok(())
    }

    /// Takes a sequence that is done out of the batch: frees its blocks, flushes held-back text
    /// and reports it finished.
    fn finish(&mut self, mut seq: Sequence, events: &mut Vec<BatchEvent>) -> Result<()> {
        self.release(&mut seq)?;
        if let Some(client) = &seq.request.client {
            self.clients.ended(client, seq.id, &seq.tokens);
        }
        if let Some(event) = seq.sink.finish(self.tokenizer)? {
            events.push(BatchEvent::Token {
                request: seq.id,
                event,
            });
        }
        // Cut for memory only where it ended by length (held-back text can still complete a
        // stop string): at its out-of-blocks or relief end, or at a max_tokens the pool lowered.
        let output = &mut seq.sink.output;
        output.stats.cut_for_memory = output.finish_reason == FinishReason::Length
            && (output.stats.cut_for_memory || seq.pool_bound);
        seq.set_timings();
        events.push(BatchEvent::Finished {
            request: seq.id,
            output: Box::new(seq.sink.output),
        });
        Ok(())
    }

    /// Publishes a leaving sequence's full blocks to the prefix cache, then frees its blocks
    /// and its cache.
    fn release(&mut self, seq: &mut Sequence) -> Result<()> {
        if !seq.cache.is_empty() || seq.slot.is_some() {
            let now = self.now();
            publish(&mut self.kv, &mut self.store, &self.runner, seq, true, now)?;
            // Only next-token-logprobs calls keep their partial block: the next call usually
            // extends them by a token, and the copy (a wait for the device) stays off the path
            // of generating requests.
            if seq.request.next_token_logprobs && self.kv.caching_enabled() && seq.kv.is_plain() {
                self.keep_tail(seq)?;
            }
        }
        self.kv.free(seq.id);
        self.store.unpin(&std::mem::take(&mut seq.pinned));
        seq.cache = Vec::new();
        if let Some(slot) = seq.slot.take() {
            self.free_slot(slot)?;
        }
        if let Some(draft) = &mut self.draft {
            draft.remove(seq.id)?;
        }
        Ok(())
    }

    /// Keeps the KV of `seq`'s computed tokens after its last full block in the tail cache (none
    /// for a prefix without token ids, whose placeholders must never match).
    fn keep_tail(&mut self, seq: &Sequence) -> Result<()> {
        let block_size = self.config.block_size;
        let (start, end) = (seq.computed / block_size * block_size, seq.computed);
        if start == end || seq.preloaded.is_some() {
            return Ok(());
        }
        let parts = match seq.slot {
            Some(slot) => {
                let (slots, row) = self.runner.slot_cache(slot);
                (0..slots.num_layers())
                    .map(|layer| slots.copy_parts(row, layer, start, end))
                    .collect::<Result<Vec<_>>>()?
            }
            None => seq
                .cache
                .iter()
                .map(|layer| layer.block_parts(start as i32, end as i32))
                .collect::<Result<Vec<_>>>()?,
        };
        // Copies of their own now, not graphs that keep the sequence's cache alive.
        eval(parts.iter().flatten())?;
        self.tails.insert(Tail {
            tokens: seq.tokens[..end].to_vec(),
            parts,
        });
        Ok(())
    }

    /// Frees `slot`; the sequence in its cache's last slot (still running) moves into it.
    fn free_slot(&mut self, slot: Slot) -> Result<()> {
        let moves = self.runner.free_slot(slot)?;
        self.slots_moved(&moves);
        Ok(())
    }

    /// Each sequence in slot `from` is now in slot `to`, for every `(from, to)` of `moves`.
    fn slots_moved(&mut self, moves: &[(Slot, Slot)]) {
        let moved: Vec<(usize, Slot)> = moves
            .iter()
            .filter_map(|&(from, to)| {
                let i = self.running.iter().position(|s| s.slot == Some(from))?;
                Some((i, to))
            })
            .collect();
        for (i, to) in moved {
            self.running[i].slot = Some(to);
        }
    }

    /// Sends a running sequence back to be recomputed: its blocks are freed (full ones stay
    /// cached, so readmission mostly hits them) and its sampler and output carry on.
    fn preempt(&mut self, seq: &mut Sequence) -> Result<()> {
        self.release(seq)?;
        seq.computed = 0;
        seq.published_blocks = 0;
        seq.boundary_state = None;
        seq.branch_at = None;
        self.preemptions += 1;
        Ok(())
    }
}

/// The sequences of `running` at `indices` (ascending, as a step's rows follow the running
/// sequences' order), each with its place in `indices`.
fn picked_mut<'s>(
    running: &'s mut [Sequence],
    indices: &'s [usize],
) -> impl Iterator<Item = (usize, &'s mut Sequence)> + 's {
    debug_assert!(indices.is_sorted_by(|a, b| a < b), "{indices:?}");
    let mut next = indices.iter().enumerate().peekable();
    running
        .iter_mut()
        .enumerate()
        .filter_map(move |(i, seq)| next.next_if(|&(_, &r)| r == i).map(|(j, _)| (j, seq)))
}

/// A verify step's proposals ([`BatchGenerator::proposals`]), per `ready` row.
struct Proposals {
    /// Prompt lookup's (on the host).
    host: Vec<Vec<u32>>,
    /// A draft row's column of `device` and its count.
    drafted: Vec<Option<(usize, usize)>>,
    /// The draft's, not read yet.
    device: Option<Proposed>,
}

/// Whether prompt lookup may propose for `seq` now: a greedy sequence (a sampled one accepts
/// only proposals drawn by its sampler, as mlx_lm's draft model makes them) whose
/// [`Backoff`] lets it.
fn looks_up(seq: &Sequence) -> bool {
    seq.sampler.is_plain_greedy() && seq.lookup.proposes(seq.tokens.len())
}

/// Hands `seq` its next token: into its tokens, its grammar and its stream (an event, marked
/// `from_draft` for an accepted proposal). Returns whether the sequence is done.
fn emit(
    seq: &mut Sequence,
    tokenizer: &Tokenizer,
    token: u32,
    logprobs: Option<TokenLogprobs>,
    from_draft: bool,
    events: &mut Vec<BatchEvent>,
) -> Result<bool> {
    seq.tokens.push(token);
    if let Some(grammar) = &mut seq.grammar {
        grammar.consume(token);
    }
    let request = seq.id;
    Ok(match seq.sink.push(tokenizer, token, logprobs)? {
        Pushed::Token(mut event) => {
            event.from_draft = from_draft;
            events.push(BatchEvent::Token { request, event });
            false
        }
        Pushed::Last(event) => {
            events.extend(event.map(|mut event| {
                event.from_draft = from_draft;
                BatchEvent::Token { request, event }
            }));
            true
        }
    })
}

/// [`KvCacheManager::get_computed_blocks`] cut to the blocks a cache that keeps every position
/// can load ([`BlockStore::complete_blocks`]).
fn computed_blocks(kv: &KvCacheManager, store: &BlockStore, prompt: &[u32]) -> ComputedBlocks {
    let mut hit = kv.get_computed_blocks(prompt);
    let usable = store.complete_blocks(&hit.blocks);
    hit.blocks.truncate(usable);
    hit.num_tokens = usable * kv.block_size();
    hit
}

/// The recurrent layers' states of the sequence in `slot` now, per layer (empty for attention
/// layers), copied out in the form a block keeps them ([`KvCache::block_parts`]; lazy).
fn slot_states(runner: &ModelRunner, slot: Slot) -> Result<Vec<Vec<Array>>> {
    let (slots, row) = runner.slot_cache(slot);
    let len = slots.slot_len(row);
    (0..slots.num_layers())
        .map(|layer| match slots.is_recurrent(layer) {
            true => slots.copy_parts(row, layer, len, len),
            false => Ok(Vec::new()),
        })
        .collect()
}

/// Lets the sliding-window layers of a sequence's own cache drop the positions before
/// `published` (those whose blocks were copied out to the prefix cache, or need not be): see
/// [`KvCache::release_before`].
fn allow_release(cache: &mut [KvCache], published: usize) {
    for layer in cache {
        layer.release_before(published as i32);
    }
}

/// Most positions one copy of a slot sequence's KV serves when it is published (see
/// [`publish`]): a whole default prefill chunk (`prefill_step_size`), so a pass publishes one
/// copy per row and layer part (each copy is a launch for the host; runs of 512 positions made
/// publishing a third of a long prompt's prefill on an H100).
const PUBLISH_RUN_TOKENS: usize = 2048;

/// How many leading tokens `a` and `b` have in common.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Registers the full blocks `seq` has computed since the last call in the prefix cache and
/// copies the content of those that became cache entries into the store, from its slot, then
/// takes the pins their prefixes satisfy. With `wait` false the copies are dispatched and not
/// waited for (a decode step in flight keeps running).
fn publish(
    kv: &mut KvCacheManager,
    store: &mut BlockStore,
    runner: &ModelRunner,
    seq: &mut Sequence,
    wait: bool,
    now: Instant,
) -> Result<()> {
    publish_blocks(kv, store, runner, seq, wait)?;
    take_pins(kv, store, seq, now);
    Ok(())
}

/// Takes the pins of `seq` whose prefixes its published blocks now hold
/// ([`KvCacheManager::pin_prefix`]) at `now`, noting in its stats what they keep or why one was
/// refused.
fn take_pins(kv: &mut KvCacheManager, store: &mut BlockStore, seq: &mut Sequence, now: Instant) {
    if seq.pins_left.is_empty() {
        return;
    }
    let block_size = kv.block_size();
    let stats = &mut seq.sink.output.stats;
    if !kv.caching_enabled() {
        seq.pins_left.clear();
        stats.pin_refused = Some("prefix caching is off: no prefix is kept".to_owned());
        return;
    }
    // Ready once its blocks are published and, on a hybrid model, computed by this sequence
    // (a hit's blocks it recomputes get their states only as it reaches them).
    let mut done = seq.published_blocks * block_size;
    if store.has_recurrent_layers() {
        done = done.min(seq.computed);
    }
    let (ready, later) = std::mem::take(&mut seq.pins_left)
        .into_iter()
        .partition(|pin| pin.tokens / block_size * block_size <= done);
    seq.pins_left = later;
    for pin in ready {
        match kv.pin_prefix(store, seq.id, pin.tokens, pin.key, pin.ttl, now) {
            PinOutcome::Pinned { tokens } => {
                stats.pinned_prompt_tokens = stats.pinned_prompt_tokens.max(tokens);
            }
            PinOutcome::TooLarge { max_tokens } => {
                stats.pin_refused = Some(format!(
                    "a prefix of {} tokens is more than the {max_tokens} tokens pins may hold \
                     together (a quarter of the KV cache)",
                    pin.tokens
                ));
            }
            PinOutcome::NoRoomForBoundedParts => {
                stats.pin_refused = Some(format!(
                    "the model's sliding-window KV or recurrent states for a prefix of {} tokens \
                     are more than pins may keep (half their budget)",
                    pin.tokens
                ));
            }
            PinOutcome::NotCached => {}
        }
    }
}

/// Registers the full blocks `seq` has computed since the last call in the prefix cache and
/// copies the content of those that became cache entries into the store (see [`publish`]).
fn publish_blocks(
    kv: &mut KvCacheManager,
    store: &mut BlockStore,
    runner: &ModelRunner,
    seq: &mut Sequence,
    wait: bool,
) -> Result<()> {
    let mut publishing = Publishing::default();
    publishing.add(kv, store, runner, seq)?;
    publishing.copy(kv, store, runner, wait)
}

/// Blocks that sequences filled, registered in the prefix cache, whose content is copied out of
/// their slots together ([`Publishing::copy`]): one copy a layer part for all of them (up to
/// [`PUBLISH_RUN_TOKENS`] positions), not one a sequence. Rows decoding in step fill their
/// blocks in the same steps: 32 rows of a sliding-window model published as they fill made
/// 32 copies a layer part at once.
#[derive(Default)]
struct Publishing {
    /// Each sequence's slot and its blocks to copy, `(block index, id)`.
    blocks: Vec<(Slot, Vec<(usize, BlockId)>)>,
    /// Blocks given content already (parts of a recomputed hit, a hybrid model's states),
    /// evaluated with the copies.
    done: Vec<BlockId>,
}

impl Publishing {
    /// [`publish_blocks`]'s registration for `seq`; its blocks' copies wait for
    /// [`Publishing::copy`] (a hybrid model's are made here: their states follow the copies).
    fn add(
        &mut self,
        kv: &mut KvCacheManager,
        store: &mut BlockStore,
        runner: &ModelRunner,
        seq: &mut Sequence,
    ) -> Result<()> {
        let full = seq.computed / kv.block_size();
        // An anonymous prefix's placeholder tokens must never be hashed. A sequence computes
        // only in a slot: one without a slot holds what it loaded from the prefix cache,
        // published already.
        let Some(slot) = seq.slot else {
            return Ok(());
        };
        // Nor are a bounded or quantized cache's: it does not hold a prefix's plain KV.
        if full <= seq.published_blocks || seq.preloaded.is_some() || !seq.kv.is_plain() {
            return Ok(());
        }
        let entries = kv.cache_blocks(seq.id, &seq.tokens, seq.computed);
        let block_size = kv.block_size();
        let (slots, row) = runner.slot_cache(slot);
        let hybrid = store.has_recurrent_layers();
        // Blocks of the prefix hit that this sequence recomputed because their sliding layers'
        // KV was dropped (see `BlockStore::usable_blocks`): they get it back from this sequence.
        let table = kv.block_table(seq.id).expect("a running request");
        let refill: Vec<(usize, BlockId)> = (seq.published_blocks..full)
            .map(|index| (index, table[index]))
            .filter(|&(_, id)| !hybrid && store.contains(id) && !store.holds_every_layer(id))
            .collect();
        for &(index, id) in &refill {
            let (start, end) = (index * block_size, (index + 1) * block_size);
            let parts = (0..store.num_layers())
                .map(|layer| match store.is_bounded(layer) {
                    true => slots.copy_parts(row, layer, start, end),
                    false => Ok(Vec::new()),
                })
                .collect::<Result<Vec<_>>>()?;
            store.put_bounded(id, parts);
        }
        self.done.extend(refill.iter().map(|&(_, id)| id));
        seq.published_blocks = full;
        if !hybrid {
            self.blocks.push((slot, entries));
            return Ok(());
        }
        // A recurrent layer has no positions: a block keeps its state only where the
        // sequence's state was at the block's end (now, or at the last boundary a decode step
        // crossed; see `crate::kv::block_store`), given once the block is in the store.
        self.blocks.push((slot, entries.clone()));
        self.copy_blocks(store, runner, block_size)?;
        for &(index, id) in &entries {
            let end = (index + 1) * block_size;
            let states = if end == slots.slot_len(row) {
                Some(slot_states(runner, slot)?)
            } else {
                seq.boundary_state
                    .as_ref()
                    .filter(|(at, _)| *at == end)
                    .map(|(_, states)| states.clone())
            };
            if let Some(states) = states {
                store.put_bounded(id, states);
            }
        }
        Ok(())
    }

    /// Copies the blocks added out of their slots into the store, evaluated (`wait`) or
    /// dispatched, and charges the pool for them.
    fn copy(
        mut self,
        kv: &mut KvCacheManager,
        store: &mut BlockStore,
        runner: &ModelRunner,
        wait: bool,
    ) -> Result<()> {
        self.copy_blocks(store, runner, kv.block_size())?;
        if self.done.is_empty() {
            return Ok(());
        }
        if wait {
            eval(store.state(&self.done))?;
        } else {
            async_eval(store.state(&self.done))?;
        }
        kv.charge_pool(store);
        Ok(())
    }

    /// The copies of the blocks added so far, made (lazily) and kept in the store, their ids
    /// moved to `done`: for each slot cache, runs of consecutive blocks of each row, packed
    /// into copies of at most [`PUBLISH_RUN_TOKENS`] positions, one a layer part
    /// ([`SlotKvCache::copy_ranges`]), their blocks kept as places in them
    /// (`BlockStore::put_run`): a 2,048-token chunk in blocks of 32 is 64 blocks, and a copy
    /// and a view per block and layer part cost the host more than the copies themselves. A
    /// copy lives (and counts in the prefix cache's bytes) while any of its blocks does, so
    /// evicting part of one frees its memory with the last of them.
    fn copy_blocks(
        &mut self,
        store: &mut BlockStore,
        runner: &ModelRunner,
        block_size: usize,
    ) -> Result<()> {
        let most = (PUBLISH_RUN_TOKENS / block_size).max(1);
        let blocks = std::mem::take(&mut self.blocks);
        // Per slot cache (the decode or the prefill one): its ranges (row, start, end) and
        // their blocks, in order, a range at most `most` blocks long.
        let mut caches: Vec<CacheRanges> = Vec::new();
        for (slot, entries) in &blocks {
            let (cache, row) = runner.slot_cache(*slot);
            let at = match caches.iter().position(|(c, ..)| std::ptr::eq(*c, cache)) {
                Some(at) => at,
                None => {
                    caches.push((cache, Vec::new(), Vec::new()));
                    caches.len() - 1
                }
            };
            let (_, ranges, ids) = &mut caches[at];
            let runs = entries
                .chunk_by(|a, b| b.0 == a.0 + 1)
                .flat_map(|run| run.chunks(most));
            for run in runs {
                let (first, last) = (run[0].0, run[run.len() - 1].0);
                ranges.push((row, first * block_size, (last + 1) * block_size));
                ids.extend(run.iter().map(|&(_, id)| id));
            }
        }
        for (cache, ranges, ids) in caches {
            // Consecutive ranges packed while they fit in one copy.
            let mut from = 0;
            while from < ranges.len() {
                let (mut to, mut blocks) = (from, 0);
                while to < ranges.len() {
                    let len = (ranges[to].2 - ranges[to].1) / block_size;
                    if to > from && blocks + len > most {
                        break;
                    }
                    blocks += len;
                    to += 1;
                }
                let first_block = (ranges[..from].iter())
                    .map(|r| (r.2 - r.1) / block_size)
                    .sum::<usize>();
                let mut indices = CopyIndices::default();
                let copies = (0..cache.num_layers())
                    .map(|layer| match cache.is_recurrent(layer) {
                        true => Ok(Vec::new()),
                        false => cache.copy_ranges(layer, &ranges[from..to], &mut indices),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let run_ids = &ids[first_block..first_block + blocks];
                store.put_run(run_ids, copies);
                self.done.extend_from_slice(run_ids);
                from = to;
            }
        }
        Ok(())
    }
}

/// A slot cache's ranges `(row, start, end)` to copy and their blocks, in order
/// ([`Publishing::copy_blocks`]).
type CacheRanges<'a> = (&'a SlotKvCache, Vec<(usize, usize, usize)>, Vec<BlockId>);

/// The proposals a row that verify steps are warmed (and, on GPUs, padded) for: the requests'
/// default `num_draft_tokens`, or [`Draft::DEFAULT_NUM_DRAFT_TOKENS`] when it is out of range
/// (0: requests do not speculate unless they ask).
fn warmed_draft_tokens(num_draft_tokens: usize) -> usize {
    match check_num_draft_tokens(num_draft_tokens) {
        Ok(()) => num_draft_tokens,
        Err(_) => Draft::DEFAULT_NUM_DRAFT_TOKENS,
    }
}

#[cfg(test)]
mod tests {
    use super::{attention_materializes_scores, warmed_draft_tokens};
    use crate::device::Backend;
    use crate::sequence::speculative::Draft;

    /// Verify steps are shaped for the requests' default proposals when it is a count a request
    /// may ask for, and for mlx_lm's default otherwise.
    #[test]
    fn verify_steps_follow_the_default_proposals() {
        assert_eq!(warmed_draft_tokens(5), 5);
        assert_eq!(warmed_draft_tokens(1), 1);
        let default = Draft::DEFAULT_NUM_DRAFT_TOKENS;
        assert_eq!(warmed_draft_tokens(0), default);
        assert_eq!(
            warmed_draft_tokens(Draft::MAX_NUM_DRAFT_TOKENS + 1),
            default
        );
    }

    /// Admission counts attention scores on the CPU whatever the head size, and on Metal only
    /// for head sizes MLX's fused prompt kernel lacks (Gemma 3's 256 among them).
    #[test]
    fn scores_are_counted_where_mlx_builds_them() {
        assert!(attention_materializes_scores(Backend::Cpu, 64));
        assert!(!attention_materializes_scores(Backend::Metal, 128));
        assert!(!attention_materializes_scores(Backend::Metal, 64));
        assert!(attention_materializes_scores(Backend::Metal, 256));
        assert!(!attention_materializes_scores(Backend::Cuda, 256));
    }
}
