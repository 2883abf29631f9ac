//! Generating one sequence: chunked prefill, then decode with an asynchronous pipeline (step n+1
//! is dispatched to MLX before step n's token is read back, as mlx-lm's `generate_step` does),
//! streaming text deltas, stop tokens and stop strings, and per-request stats.

use std::ops::ControlFlow;
use std::time::Instant;

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::Array;

use crate::api::FinishReason;
use crate::api::GenerateOutput;
use crate::api::GenerateRequest;
use crate::api::TokenEvent;
use crate::attention::KvQuantization;
use crate::device::{memory_stats, reset_peak_memory};
use crate::error::{EngineError, Result};
use crate::kv::cache::{KvCache, KvLimit};
use crate::models::Model;
use crate::output::Pushed;
use crate::output::TokenSink;
use crate::sample::log_softmax_f32;
use crate::sample::sample_next;
use crate::sample::sampler::Sampler;
use crate::sample::RecentTokens;
use crate::sample::Sampled;
use crate::text::tokenizer::Tokenizer;

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
    if !request.images.is_empty() {
        return Err(EngineError::Request(
            "images run in the batch engine (EngineHandle), not in generate".into(),
        ));
    }

    reset_peak_memory();
    let start = Instant::now();
    // Over ranks, a rank that stops answering would block this one in a collective for ever.
    let _watchdog = model
        .division()
        .map(|d| crate::distributed::Watchdog::start(d.rank(), crate::distributed::stall_limit()));
    let progressed = crate::distributed::note_progress;
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
        progressed();
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
        progressed();
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
