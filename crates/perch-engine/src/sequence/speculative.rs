//! Speculative decoding of one sequence, as mlx_lm's `speculative_generate_step` does it: a small
//! draft model proposes `num_draft_tokens` tokens one at a time, the model scores the last
//! accepted token and all the proposals in one forward pass and samples a token at each of those
//! positions; the proposals are accepted while they equal the model's own tokens, then the
//! model's token at the first difference (or after the last proposal) is emitted too, and both
//! caches are trimmed back to what was accepted.
//!
//! Every emitted token is the model's own sample given the tokens before it, so the output's
//! distribution is the model's, with any sampler and logits processors: with greedy sampling it
//! is generation without a draft, token for token (up to the reduction order of a multi-token
//! forward pass), and a seeded request draws its keys in mlx_lm's order (the draft's samples,
//! then the model's, one per position). This acceptance rule is mlx_lm's, not the rejection
//! rule of Leviathan et al. (accept a proposal with probability `min(1, p/q)`): that rule
//! accepts more often, but needs both samplers' final distributions, which top-p, min-p, XTC and
//! top-k truncation make sampler-specific.

use std::ops::ControlFlow;
use std::time::Instant;

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};

use crate::api::{FinishReason, GenerateOutput, GenerateRequest, TokenEvent};
use crate::device::{memory_stats, reset_peak_memory};
use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;
use crate::models::Model;
use crate::nn::mlx_ext::slice;
use crate::output::{Pushed, TokenSink};
use crate::sample::sampler::Sampler;
use crate::sample::{sample_after, sample_rows, Sampled};
use crate::sequence::generate::{check_request, own_cache, quantize_reached};
use crate::text::tokenizer::Tokenizer;

/// A draft model for [`generate_speculative`].
pub struct Draft<'a> {
    pub model: &'a dyn Model,
    /// Its tokenizer, which must map tokens to the ids the model's does.
    pub tokenizer: &'a Tokenizer,
    /// Tokens proposed per step (mlx_lm's `--num-draft-tokens`, default 3).
    pub num_draft_tokens: usize,
}

impl Draft<'_> {
    /// mlx_lm's command-line default.
    pub const DEFAULT_NUM_DRAFT_TOKENS: usize = 3;
    /// The most tokens one step may propose.
    pub const MAX_NUM_DRAFT_TOKENS: usize = 64;
}

/// Runs `request` as [`crate::sequence::generate()`] does, with `draft` proposing tokens. Events carry
/// `from_draft` for accepted proposals; the stats count proposed and accepted tokens.
///
/// Errors, besides [`crate::sequence::generate()`]'s: a draft whose tokenizer differs from the model's,
/// whose vocabulary is larger than the model's, `num_draft_tokens` of 0 or above
/// [`Draft::MAX_NUM_DRAFT_TOKENS`], models with linear-attention layers (their recurrent state
/// cannot be rewound), `max_kv_size` (a rotating cache neither), grammars and next-token
/// log-probabilities.
pub fn generate_speculative(
    model: &dyn Model,
    draft: &Draft<'_>,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
    mut on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
) -> Result<GenerateOutput> {
    let mut sequence = SoloSequence::new(model, Some(draft), tokenizer, request)?;
    reset_peak_memory();
    while !sequence.step(tokenizer, &mut on_token)? {}
    sequence.finish(tokenizer, &mut on_token)
}

/// One sequence with KV caches of its own, advanced a step at a time (the engine interleaves
/// such steps with its batch's): a prompt chunk, or one decode step, which with a draft model is
/// a round of proposals and their verification (speculative decoding). The engine runs requests
/// this way that its batch cannot: speculative ones its batch's draft does not propose for
/// ([`crate::GenerateRequest::runs_beside_batch`]: those with logits processors, or all without
/// a draft in the batch), exactly as [`crate::sequence::generate()`] runs them.
pub(crate) struct SoloSequence<'m> {
    model: &'m dyn Model,
    /// The draft model, for speculative decoding; `None`: one token per step.
    draft: Option<&'m dyn Model>,
    num_draft_tokens: usize,
    request: GenerateRequest,
    cache: Vec<KvCache>,
    draft_cache: Vec<KvCache>,
    sampler: Sampler,
    /// Prompt tokens (all but the last) both models have read.
    prefilled: usize,
    /// Every token so far (for the logits processors' window).
    tokens: Vec<u32>,
    sink: TokenSink,
    /// What each model reads next: the model the last emitted token, the draft that one too,
    /// or the last proposal before it when every proposal was accepted (the draft never read
    /// it).
    input: u32,
    draft_input: Vec<u32>,
    start: Instant,
    first_token_at: Option<f64>,
    done: bool,
}

impl<'m> SoloSequence<'m> {
    /// Checks the request (and the draft, if any); nothing runs yet.
    pub(crate) fn new(
        model: &'m dyn Model,
        draft: Option<&Draft<'m>>,
        tokenizer: &Tokenizer,
        request: &GenerateRequest,
    ) -> Result<Self> {
        let (max_tokens, stop_ids) = check_request(model, tokenizer, request)?;
        if request.grammar.is_some() || request.next_token_logprobs {
            return Err(EngineError::Request(
                "constrained output and next-token log-probabilities run in the batch, without \
                 per-sequence KV cache options or a draft"
                    .into(),
            ));
        }
        if !request.images.is_empty() {
            return Err(EngineError::Request(
                "speculative decoding takes no images: they run in the batch without a draft"
                    .into(),
            ));
        }
        let cache = own_cache(model, request)?;
        let mut draft_cache = Vec::new();
        if let Some(draft) = draft {
            check_draft(model, draft, tokenizer, request)?;
            draft_cache = own_cache(draft.model, request)?;
        }
        let last = request.prompt[request.prompt.len() - 1];
        Ok(Self {
            model,
            draft: draft.map(|d| d.model),
            num_draft_tokens: draft.map_or(0, |d| d.num_draft_tokens),
            cache,
            draft_cache,
            sampler: Sampler::for_tokenizer(request.sampling.clone(), tokenizer)?,
            prefilled: 0,
            tokens: request.prompt.clone(),
            sink: TokenSink::new(request, stop_ids, max_tokens),
            input: last,
            draft_input: vec![last],
            start: Instant::now(),
            first_token_at: None,
            done: false,
            request: request.clone(),
        })
    }

    /// Prompt tokens still to prefill (all but the last one go through prefill).
    pub(crate) fn prefill_left(&self) -> usize {
        self.request.prompt.len() - 1 - self.prefilled
    }

    /// One step: the next prompt chunk of both models (the draft first, as mlx_lm), or one
    /// round of proposals and verification, whose tokens go to `on_token`. True when the
    /// sequence has ended (then call [`SoloSequence::finish`]).
    pub(crate) fn step(
        &mut self,
        tokenizer: &Tokenizer,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<bool> {
        if self.done {
            return Ok(true);
        }
        let left = self.prefill_left();
        if left > 0 {
            let n = left.min(self.request.prefill_step_size.max(1));
            let chunk = &self.request.prompt[self.prefilled..self.prefilled + n];
            let draft = self.draft.map(|d| (d, &mut self.draft_cache));
            for (m, c) in draft.into_iter().chain([(self.model, &mut self.cache)]) {
                m.prefill_sequence(&ids(chunk), c)?;
                quantize_reached(&self.request, c)?;
                eval(c.iter().flat_map(KvCache::state))?;
            }
            self.prefilled += n;
            return Ok(false);
        }
        self.done = self.round(tokenizer, on_token)?;
        Ok(self.done)
    }

    /// Proposals, their verification, the emitted tokens and the caches trimmed back.
    fn round(
        &mut self,
        tokenizer: &Tokenizer,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<bool> {
        let request = &self.request;
        let window = request.sampling.history_window();
        let top = request.logprobs;
        let max_tokens = self.sink.max_tokens();
        let k = (max_tokens - self.sink.generated).min(self.num_draft_tokens);
        // Proposals stay on the device, each feeding the next draft step and then the model's
        // pass, so a round waits for the device once (as mlx_lm's `async_eval`s). Logits
        // processors read the proposals before them, so with processors each is read first.
        let lazy = !self.sampler.has_logits_processors();
        let mut proposals: Vec<Array> = Vec::with_capacity(k);
        let mut proposed: Vec<u32> = Vec::with_capacity(k);
        let mut feed = ids(&self.draft_input);
        for _ in 0..k {
            let draft = self.draft.expect("proposals come from a draft");
            let logits = last_rows(&draft.forward_sequence(&feed, &mut self.draft_cache)?, 1)?;
            quantize_reached(request, &mut self.draft_cache)?;
            let history = (!lazy)
                .then(|| recent(&self.tokens, &proposed, window))
                .flatten();
            let sampled = sample_after(&logits, &mut self.sampler, history.as_ref(), None)?;
            if lazy {
                async_eval([&sampled.token])?;
            } else {
                proposed.push(sampled.read().0);
            }
            feed = sampled.token.reshape(&[1, 1])?;
            proposals.push(sampled.token);
        }
        self.sink.output.stats.draft_tokens += k;

        let input = Array::from_slice(&[self.input], &[1]);
        let verify = ops::concatenate(
            &std::iter::once(input)
                .chain(proposals.iter().cloned())
                .collect::<Vec<_>>(),
            0,
        )?;
        let logits = self
            .model
            .forward_sequence(&verify.reshape(&[1, k as i32 + 1])?, &mut self.cache)?;
        quantize_reached(request, &mut self.cache)?;
        let rows = last_rows(&logits, k + 1)?;
        // As mlx_lm: without logits processors one sampler call for every position (one random
        // key), with them position by position, each after the tokens before it.
        let samples: Vec<Sampled> = if self.sampler.has_logits_processors() {
            let mut samples = Vec::with_capacity(k + 1);
            for i in 0..=k {
                let row = slice(&rows, &[i as i32, 0], &[i as i32 + 1, rows.shape()[1]])?;
                let history = recent(&self.tokens, &proposed[..i], window);
                samples.push(sample_after(
                    &row,
                    &mut self.sampler,
                    history.as_ref(),
                    top,
                )?);
            }
            samples
        } else {
            sample_rows(&rows, &mut self.sampler, top)?
        };
        eval(samples.iter().flat_map(Sampled::arrays).chain(&proposals))?;
        if lazy {
            proposed = proposals.iter().map(|p| p.as_slice::<u32>()[0]).collect();
        }

        let mut accepted = 0;
        let mut ended = false;
        for (i, sample) in samples.iter().enumerate() {
            let (id, logprobs) = sample.read();
            let from_draft = i < k && id == proposed[i];
            self.first_token_at
                .get_or_insert_with(|| self.start.elapsed().as_secs_f64());
            self.tokens.push(id);
            let pushed = self.sink.push(tokenizer, id, logprobs)?;
            if from_draft {
                accepted += 1;
            }
            match pushed {
                Pushed::Token(mut event) => {
                    event.from_draft = from_draft;
                    if on_token(&event).is_break() {
                        self.sink.output.finish_reason = FinishReason::Cancelled;
                        ended = true;
                        break;
                    }
                }
                Pushed::Last(event) => {
                    if let Some(mut event) = event {
                        event.from_draft = from_draft;
                        let _ = on_token(&event);
                    }
                    ended = true;
                    break;
                }
            }
            if !from_draft {
                break;
            }
        }
        self.sink.output.stats.accepted_draft_tokens += accepted;
        if ended {
            return Ok(true);
        }
        // Keep what was accepted: the model read `input` and every proposal, the draft its
        // input and every proposal but the last.
        let emitted = self.tokens[self.tokens.len() - 1];
        trim(&mut self.cache, (k - accepted) as i32);
        trim(
            &mut self.draft_cache,
            (k - accepted).saturating_sub(1) as i32,
        );
        self.input = emitted;
        self.draft_input = if k > 0 && accepted == k {
            vec![proposed[k - 1], emitted]
        } else {
            vec![emitted]
        };
        Ok(false)
    }

    /// Ends the sequence (early, for a cancel): the text held back goes to `on_token`, and the
    /// output with its stats is returned.
    pub(crate) fn finish(
        mut self,
        tokenizer: &Tokenizer,
        on_token: &mut dyn FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<GenerateOutput> {
        if let Some(tail) = self.sink.finish(tokenizer)? {
            let _ = on_token(&tail);
        }
        let n = self.sink.generated;
        let mut output = self.sink.output;
        let total = self.start.elapsed().as_secs_f64();
        output
            .stats
            .set_timings(n, self.first_token_at.unwrap_or(total), total);
        output.stats.peak_memory_bytes = memory_stats().peak_bytes;
        Ok(output)
    }
}

/// Refuses `num_draft_tokens` of 0 or above [`Draft::MAX_NUM_DRAFT_TOKENS`].
pub(crate) fn check_num_draft_tokens(num_draft_tokens: usize) -> Result<()> {
    if !(1..=Draft::MAX_NUM_DRAFT_TOKENS).contains(&num_draft_tokens) {
        return Err(EngineError::Request(format!(
            "num_draft_tokens must be 1 to {}, not {num_draft_tokens}",
            Draft::MAX_NUM_DRAFT_TOKENS
        )));
    }
    Ok(())
}

fn check_draft(
    model: &dyn Model,
    draft: &Draft<'_>,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
) -> Result<()> {
    let refuse = |message: &str| Err(EngineError::Request(message.to_string()));
    check_num_draft_tokens(draft.num_draft_tokens)?;
    if !tokenizer.same_vocabulary(draft.tokenizer) {
        return refuse(
            "the draft model's tokenizer does not match the model's: speculative decoding needs \
             a draft of the same family (the same tokens and ids)",
        );
    }
    if draft.model.info().vocab_size > model.info().vocab_size {
        return Err(EngineError::Request(format!(
            "the draft model's vocabulary ({}) is larger than the model's ({})",
            draft.model.info().vocab_size,
            model.info().vocab_size
        )));
    }
    if model.has_recurrent_layers() || draft.model.has_recurrent_layers() {
        return refuse(
            "speculative decoding needs caches it can rewind: models with linear-attention \
             layers (a recurrent state) cannot draft or be drafted for",
        );
    }
    if request.max_kv_size.is_some() {
        return refuse("speculative decoding cannot rewind a cache bounded by max_kv_size");
    }
    Ok(())
}

/// Token ids `[1, n]`.
fn ids(tokens: &[u32]) -> Array {
    Array::from_slice(tokens, &[1, tokens.len() as i32])
}

/// The last `n` positions' logits `[n, vocab]` of logits `[1, seq, vocab]`.
fn last_rows(logits: &Array, n: usize) -> Result<Array> {
    let s = logits.shape();
    let rows = slice(logits, &[0, s[1] - n as i32, 0], &[1, s[1], s[2]])?;
    Ok(rows.reshape(&[n as i32, s[2]])?)
}

/// The logits processors' window over `tokens` then `more`: their last `window` ids, `None`
/// without processors that read them.
fn recent(tokens: &[u32], more: &[u32], window: usize) -> Option<Array> {
    if window == 0 {
        return None;
    }
    // Only the window's tail is copied, however long the sequence.
    let from_tokens = window.saturating_sub(more.len()).min(tokens.len());
    let tail: Vec<u32> = tokens[tokens.len() - from_tokens..]
        .iter()
        .chain(&more[more.len().saturating_sub(window)..])
        .copied()
        .collect();
    Some(Array::from_slice(&tail, &[tail.len() as i32]))
}

fn trim(cache: &mut [KvCache], n: i32) {
    for layer in cache {
        layer.trim(n);
    }
}
