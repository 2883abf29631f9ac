//! Generating one sequence: chunked prefill, then decode with an asynchronous pipeline (step n+1
//! is dispatched to MLX before step n's token is read back, as mlx-lm's `generate_step` does),
//! streaming text deltas, stop tokens and stop strings, and per-request stats.

use std::ops::ControlFlow;
use std::time::Instant;

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};
use serde::{Deserialize, Serialize};

use crate::cache::{KvCache, KvLimit, KvQuantization};
use crate::device::{memory_stats, reset_peak_memory};
use crate::error::{EngineError, Result};
use crate::models::Model;
use crate::sampler::{Sampler, SamplingParams};
use crate::stop::{StopMatcher, StopOutcome};
use crate::tokenizer::{StreamingDetokenizer, Tokenizer};

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
#[derive(Clone, Debug)]
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
    /// Constrain the output to a grammar (JSON, see [`crate::grammar`]); batch engine only
    /// ([`crate::EngineHandle`]); [`generate`] refuses it.
    pub grammar: Option<crate::grammar::Grammar>,
    /// Bound each attention layer's KV cache to this many positions: the first
    /// [`KvLimit::KEEP`] and the most recent ones (mlx_lm's `--max-kv-size`, a
    /// `RotatingKVCache(max_kv_size, keep=4)` per layer). Sliding-window layers keep their own
    /// window. [`generate`], and the engine beside its batch (see [`crate::EngineHandle`]).
    pub max_kv_size: Option<usize>,
    /// Quantize the KV cache once it holds [`GenerateRequest::quantized_kv_start`] positions
    /// (mlx_lm's `--kv-bits`, `--kv-group-size`). [`generate`], and the engine beside its batch
    /// (whose pool is quantized as a whole by `EngineConfig`'s KV quantization).
    pub kv_quantization: Option<KvQuantization>,
    /// With `kv_quantization`: positions kept in full precision before the cache is quantized
    /// (mlx_lm's `--quantized-kv-start`; a cache is converted after the forward pass that takes
    /// it to this many positions, as mlx_lm's `maybe_quantize_kv_cache`).
    pub quantized_kv_start: usize,
    /// Speculative decoding with the engine's draft model ([`crate::EngineConfig::draft_model`]),
    /// proposing this many tokens a step (see [`crate::speculative`]). [`generate`] refuses it
    /// (the CLI calls [`crate::generate_speculative`] with its draft).
    pub num_draft_tokens: Option<usize>,
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
        }
    }

    /// Whether the request asks for a KV cache option only [`generate`] runs.
    pub fn has_single_stream_kv_options(&self) -> bool {
        self.max_kv_size.is_some() || self.kv_quantization.is_some()
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

/// Natural-log probabilities of one generated token and of the most likely alternatives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    /// The sampled token's.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
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

/// Runs `request` to completion, calling `on_token` for every generated token (stop tokens
/// excluded). Returning `ControlFlow::Break` from `on_token` cancels.
///
/// Errors: [`EngineError::EmptyPrompt`], [`EngineError::PromptTooLong`] (prompt plus one token
/// exceeds the context), invalid sampling parameters, and MLX failures.
pub fn generate(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
    mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
) -> Result<GenerateOutput> {
    let prompt = &request.prompt;
    let (max_tokens, stop_ids) = check_request(model, tokenizer, request)?;
    if request.grammar.is_some() {
        return Err(EngineError::InvalidGrammar(
            "constrained output runs in the batch engine (EngineHandle), not in generate".into(),
        ));
    }
    if request.num_draft_tokens.is_some() {
        return Err(EngineError::Request(
            "a draft model is given to generate_speculative, not generate".into(),
        ));
    }

    reset_peak_memory();
    let start = Instant::now();
    let mut cache = own_cache(model, request)?;
    let quantize = |cache: &mut [KvCache]| quantize_reached(request, cache);
    let mut sampler = Sampler::for_tokenizer(request.sampling.clone(), tokenizer)?;
    let mut history = RecentTokens::new(&request.sampling, prompt);

    // Prefill all but the last prompt token in chunks; the last one goes through the first step.
    let step = request.prefill_step_size.max(1);
    for chunk in prompt[..prompt.len() - 1].chunks(step) {
        model.prefill_sequence(
            &Array::from_slice(chunk, &[1, chunk.len() as i32]),
            &mut cache,
        )?;
        quantize(&mut cache)?;
        eval(cache.iter().flat_map(KvCache::state))?;
    }

    let mut sink = TokenSink::new(request, stop_ids, max_tokens);

    let last = Array::from_slice(&prompt[prompt.len() - 1..], &[1]);
    if request.next_token_logprobs {
        let logits = model.forward_sequence(&last.reshape(&[1, 1])?, &mut cache)?;
        let vocab = logits.shape()[2];
        let distribution = log_softmax_f32(&logits.reshape(&[vocab])?)?;
        let mut output = sink.output;
        output.next_token_logprobs = Some(distribution.as_slice::<f32>().to_vec());
        let total = start.elapsed().as_secs_f64();
        output.stats.set_timings(0, total, total);
        output.stats.peak_memory_bytes = memory_stats().peak_bytes;
        return Ok(output);
    }
    let top = request.logprobs;
    let mut pending = decode_step(model, &mut cache, &mut sampler, &last, &mut history, top)?;
    quantize(&mut cache)?;
    async_eval(pending.arrays().chain(history.state()))?;
    let mut first_token_at = None;
    loop {
        // Queue step n+1 before waiting on step n, so MLX computes while we detokenize.
        let next = if sink.generated + 1 < max_tokens {
            let next = decode_step(
                model,
                &mut cache,
                &mut sampler,
                &pending.token,
                &mut history,
                top,
            )?;
            quantize(&mut cache)?;
            async_eval(next.arrays().chain(history.state()))?;
            Some(next)
        } else {
            None
        };
        let (id, logprobs) = pending.read();
        first_token_at.get_or_insert_with(|| start.elapsed().as_secs_f64());
        match sink.push(tokenizer, id, logprobs)? {
            Pushed::Token(event) => {
                if on_token(&event).is_break() {
                    sink.output.finish_reason = FinishReason::Cancelled;
                    break;
                }
            }
            Pushed::Last(event) => {
                if let Some(event) = event {
                    let _ = on_token(&event);
                }
                break;
            }
        }
        match next {
            Some(next) => pending = next,
            None => break,
        }
    }
    if let Some(tail) = sink.finish(tokenizer)? {
        let _ = on_token(&tail);
    }
    let n = sink.generated;
    let mut output = sink.output;

    let total = start.elapsed().as_secs_f64();
    output
        .stats
        .set_timings(n, first_token_at.unwrap_or(total), total);
    output.stats.peak_memory_bytes = memory_stats().peak_bytes;
    Ok(output)
}

/// Validates a request against the model; returns the effective `max_tokens` (bounded by the
/// context) and the stop token ids (the request's plus EOS unless `ignore_eos`).
pub(crate) fn check_request(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
) -> Result<(usize, Vec<u32>)> {
    let info = model.info();
    let prompt = &request.prompt;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if prompt.len() >= info.context_length {
        return Err(EngineError::PromptTooLong {
            prompt_tokens: prompt.len(),
            context_length: info.context_length,
        });
    }
    // Ids from a client index the embedding table: one past its end must not reach MLX.
    if let Some((position, &token)) = prompt
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= info.vocab_size)
    {
        return Err(EngineError::TokenOutOfVocabulary {
            position,
            token,
            vocab_size: info.vocab_size,
        });
    }
    request.sampling.validate(info.vocab_size)?;
    let max_tokens = request
        .max_tokens
        .min(info.context_length - prompt.len())
        .max(1);
    let mut stop_ids = request.stop_token_ids.clone();
    if !request.ignore_eos {
        stop_ids.extend_from_slice(tokenizer.eos_token_ids());
    }
    Ok((max_tokens, stop_ids))
}

/// A cache of `model` for one sequence that nothing copies positions out of (sliding layers
/// drop what their window left), bounded as the request's `max_kv_size` says (global layers;
/// sliding ones keep their window). Errors for KV options that do not fit the model.
pub(crate) fn own_cache(model: &dyn Model, request: &GenerateRequest) -> Result<Vec<KvCache>> {
    let limit = kv_options(model, request)?;
    let mut cache = model.make_cache(None);
    for layer in cache.iter_mut() {
        layer.release_before(i32::MAX);
        if let Some(limit) = limit.filter(|_| !layer.is_recurrent() && layer.window().is_none()) {
            layer.limit_to(limit);
        }
    }
    Ok(cache)
}

/// Quantizes the layers of `cache` that hold the request's `quantized_kv_start` positions
/// (mlx_lm's `maybe_quantize_kv_cache`, after each forward pass); nothing without KV bits.
pub(crate) fn quantize_reached(request: &GenerateRequest, cache: &mut [KvCache]) -> Result<()> {
    if let Some(q) = request.kv_quantization {
        for layer in cache.iter_mut() {
            if layer.offset() as usize >= request.quantized_kv_start {
                layer.quantize(q)?;
            }
        }
    }
    Ok(())
}

/// Checks a request's KV cache options against the model; returns the bound each attention
/// layer's cache gets from `max_kv_size`.
pub(crate) fn kv_options(model: &dyn Model, request: &GenerateRequest) -> Result<Option<KvLimit>> {
    if let Some(q) = request.kv_quantization {
        if request.max_kv_size.is_some() {
            return Err(EngineError::Request(
                "max_kv_size and kv_bits cannot be combined: a bounded (rotating) KV cache is not \
                 quantized (mlx_lm's RotatingKVCache neither)"
                    .into(),
            ));
        }
        // Each layer's head size must be whole groups (Gemma 4's layers differ).
        for head_dim in model
            .make_cache(None)
            .iter()
            .filter_map(|c| c.head_shape())
            .map(|[_, d]| d)
            .chain(std::iter::once(model.info().head_dim as i32))
        {
            KvQuantization::new(q.bits, q.group_size, head_dim)?;
        }
    }
    request
        .max_kv_size
        .map(|size| KvLimit::new(size, KvLimit::KEEP))
        .transpose()
}

/// What [`TokenSink::push`] made of a token.
pub(crate) enum Pushed {
    /// A token to stream; generation goes on.
    Token(TokenEvent),
    /// Generation ends here (stop token, stop string or length), with this token's text if any.
    Last(Option<TokenEvent>),
}

/// Turns sampled ids into streamed text and the finish decision: stop tokens, stop strings,
/// `max_tokens`, detokenization. Shared by [`generate`] and the batch generator.
pub(crate) struct TokenSink {
    stop_ids: Vec<u32>,
    max_tokens: usize,
    detokenizer: StreamingDetokenizer,
    stops: StopMatcher,
    stopped_by_string: bool,
    /// Tokens sampled so far, a final stop token included.
    pub generated: usize,
    pub output: GenerateOutput,
}

impl TokenSink {
    pub(crate) fn new(request: &GenerateRequest, stop_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            stop_ids,
            max_tokens,
            detokenizer: StreamingDetokenizer::new(),
            stops: StopMatcher::new(request.stop_strings.iter().cloned()),
            stopped_by_string: false,
            generated: 0,
            output: GenerateOutput {
                token_ids: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                stop_string: None,
                next_token_logprobs: None,
                stats: GenerationStats {
                    prompt_tokens: request.prompt.len(),
                    ..Default::default()
                },
            },
        }
    }

    /// The most tokens this request may generate.
    pub(crate) fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub(crate) fn push(
        &mut self,
        tokenizer: &Tokenizer,
        id: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Result<Pushed> {
        self.generated += 1;
        if self.stop_ids.contains(&id) {
            self.output.finish_reason = FinishReason::Stop;
            return Ok(Pushed::Last(None));
        }
        self.output.token_ids.push(id);
        let delta = self.detokenizer.push(tokenizer, id)?;
        let (text, stopped) = match self.stops.push(&delta) {
            StopOutcome::Continue(text) => (text, false),
            StopOutcome::Stopped { text, stop } => {
                self.output.stop_string = Some(stop);
                (text, true)
            }
        };
        self.output.text.push_str(&text);
        let event = TokenEvent {
            id: Some(id),
            text,
            logprobs,
            from_draft: false,
        };
        if stopped {
            self.output.finish_reason = FinishReason::Stop;
            self.stopped_by_string = true;
            return Ok(Pushed::Last(Some(event)));
        }
        if self.generated >= self.max_tokens {
            return Ok(Pushed::Last(Some(event)));
        }
        Ok(Pushed::Token(event))
    }

    /// Releases text held back mid-character or as a possible stop string (which may still turn
    /// out to contain a stop string).
    pub(crate) fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<TokenEvent>> {
        if self.stopped_by_string {
            return Ok(None);
        }
        let tail = self.detokenizer.finish(tokenizer)?;
        let rest = match self.stops.push(&tail) {
            StopOutcome::Continue(text) => text + &self.stops.finish(),
            StopOutcome::Stopped { text, stop } => {
                self.output.finish_reason = FinishReason::Stop;
                self.output.stop_string = Some(stop);
                text
            }
        };
        if rest.is_empty() {
            return Ok(None);
        }
        self.output.text.push_str(&rest);
        Ok(Some(TokenEvent {
            id: None,
            text: rest,
            logprobs: None,
            from_draft: false,
        }))
    }
}

/// `log_softmax` in float32 along the last axis (lazy), as a model's logits are scored.
pub(crate) fn log_softmax_f32(logits: &Array) -> Result<Array> {
    let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
    Ok(ops::subtract(&logits, &logits.logsumexp_axis(-1, true)?)?)
}

/// One decode step: `token` `[1]` → the sampled next token (lazy).
fn decode_step(
    model: &dyn Model,
    cache: &mut [KvCache],
    sampler: &mut Sampler,
    token: &Array,
    history: &mut RecentTokens,
    top_logprobs: Option<usize>,
) -> Result<Sampled> {
    let logits = model.forward_sequence(&token.reshape(&[1, 1])?, cache)?;
    let vocab = logits.shape()[2];
    sample_next(
        &logits.reshape(&[1, vocab])?,
        sampler,
        history,
        top_logprobs,
    )
}

/// One sampling step's result, lazy: the token `[1]` (uint32) and, when asked, the sampled
/// token's log-probability `[1, 1]` with the top ids and log-probabilities `[1, n]`.
pub(crate) struct Sampled {
    pub token: Array,
    logprobs: Option<[Array; 3]>,
}

impl Sampled {
    /// The arrays to evaluate.
    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        std::iter::once(&self.token).chain(self.logprobs.iter().flatten())
    }

    /// The token id and its log-probabilities (evaluates what is still lazy).
    pub(crate) fn read(&self) -> (u32, Option<TokenLogprobs>) {
        let id = self.token.as_slice::<u32>()[0];
        let logprobs = self
            .logprobs
            .as_ref()
            .map(|[chosen, ids, values]| TokenLogprobs {
                logprob: chosen.as_slice::<f32>()[0],
                // No alternatives asked (`Some(0)`): empty arrays have no data to read.
                top: if ids.size() == 0 {
                    Vec::new()
                } else {
                    ids.as_slice::<u32>()
                        .iter()
                        .copied()
                        .zip(values.as_slice::<f32>().iter().copied())
                        .collect()
                },
            });
        (id, logprobs)
    }
}

/// Logits processors, log-softmax and the sampler for one sequence: `logits` `[1, vocab]` → the
/// next token (lazy), also appended to `history`, with `top_logprobs` alternatives when asked.
pub(crate) fn sample_next(
    logits: &Array,
    sampler: &mut Sampler,
    history: &mut RecentTokens,
    top_logprobs: Option<usize>,
) -> Result<Sampled> {
    let sampled = sample_after(logits, sampler, history.tokens.as_ref(), top_logprobs)?;
    history.push(&sampled.token)?;
    Ok(sampled)
}

/// [`sample_next`] after the tokens `history` (the logits processors' window), which it leaves
/// as it is.
pub(crate) fn sample_after(
    logits: &Array,
    sampler: &mut Sampler,
    history: Option<&Array>,
    top_logprobs: Option<usize>,
) -> Result<Sampled> {
    let logits = sampler.process_logits(logits, history)?;
    let logprobs = ops::subtract(&logits, &logits.logsumexp_axis(-1, true)?)?;
    let token = sampler.sample(&logprobs)?.as_dtype(mlx_rs::Dtype::Uint32)?;
    let logprobs = top_logprobs
        .map(|n| top_of(&logprobs, &token, n))
        .transpose()?;
    Ok(Sampled { token, logprobs })
}

/// Samples every row of `logits` `[rows, vocab]` with one sampler call (one random key for all,
/// as mlx_lm samples a multi-token step without logits processors); the sampler must have none
/// ([`Sampler::has_logits_processors`]). One [`Sampled`] per row.
pub(crate) fn sample_rows(
    logits: &Array,
    sampler: &mut Sampler,
    top_logprobs: Option<usize>,
) -> Result<Vec<Sampled>> {
    debug_assert!(!sampler.has_logits_processors());
    let logprobs = ops::subtract(logits, &logits.logsumexp_axis(-1, true)?)?;
    let tokens = sampler.sample(&logprobs)?.as_dtype(mlx_rs::Dtype::Uint32)?;
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    (0..rows)
        .map(|r| {
            let token = crate::mlx_ext::slice(&tokens, &[r], &[r + 1])?;
            let logprobs = top_logprobs
                .map(|n| {
                    let row = crate::mlx_ext::slice(&logprobs, &[r, 0], &[r + 1, vocab])?;
                    top_of(&row, &token, n)
                })
                .transpose()?;
            Ok(Sampled { token, logprobs })
        })
        .collect()
}

/// The sampled `token`'s log-probability `[1, 1]` and the `n` most likely ids and theirs
/// `[1, n]`, from `logprobs` `[1, vocab]`.
fn top_of(logprobs: &Array, token: &Array, n: usize) -> Result<[Array; 3]> {
    let logprobs = logprobs.as_dtype(mlx_rs::Dtype::Float32)?;
    let chosen = logprobs.take_along_axis(token.reshape(&[1, 1])?, -1)?;
    let n = (n as i32).min(logprobs.shape()[1]);
    let order = ops::argsort_axis(&ops::negative(&logprobs)?, -1)?;
    let ids = crate::mlx_ext::slice(&order, &[0, 0], &[1, n])?;
    let values = logprobs.take_along_axis(&ids, -1)?;
    Ok([chosen, ids.as_dtype(mlx_rs::Dtype::Uint32)?, values])
}

/// The last `repetition_context_size` token ids, kept on the device only when a repetition
/// penalty needs them, and bounded so the graph does not grow with the sequence.
pub(crate) struct RecentTokens {
    tokens: Option<Array>,
    keep: i32,
}

impl RecentTokens {
    pub(crate) fn new(sampling: &SamplingParams, prompt: &[u32]) -> Self {
        let keep = sampling.history_window();
        let tail = &prompt[prompt.len().saturating_sub(keep)..];
        Self {
            tokens: (keep > 0).then(|| Array::from_slice(tail, &[tail.len() as i32])),
            keep: keep as i32,
        }
    }

    pub(crate) fn push(&mut self, token: &Array) -> Result<()> {
        if let Some(tokens) = &self.tokens {
            let len = tokens.shape()[0];
            let start = (len + 1 - self.keep).max(0);
            let kept = crate::mlx_ext::slice(tokens, &[start], &[len])?;
            self.tokens = Some(ops::concatenate(&[kept, token.clone()], 0)?);
        }
        Ok(())
    }

    pub(crate) fn state(&self) -> impl Iterator<Item = &Array> {
        self.tokens.iter()
    }
}
