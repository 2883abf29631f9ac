//! Choosing the next token: the sampler and its logits processors ([`sampler`]), constrained
//! output ([`grammar`]), a model's sampling defaults ([`generation_config`]), and the steps that
//! turn a row of logits into a token with its log-probabilities.

pub mod generation_config;
pub mod grammar;
pub mod sampler;
pub(crate) mod threefry;

use mlx_rs::{ops, Array};
use serde::Serialize;

use crate::error::Result;
use sampler::{Sampler, SamplingParams};

/// Natural-log probabilities of one generated token and of the most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprobs {
    /// The sampled token's.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// `log_softmax` in float32 along the last axis (lazy), as a model's logits are scored.
pub(crate) fn log_softmax_f32(logits: &Array) -> Result<Array> {
    let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
    Ok(ops::subtract(&logits, &logits.logsumexp_axis(-1, true)?)?)
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
    let (tokens, logprobs) = sample_positions(logits, sampler)?;
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    (0..rows)
        .map(|r| {
            let token = crate::nn::mlx_ext::slice(&tokens, &[r], &[r + 1])?;
            let logprobs = top_logprobs
                .map(|n| {
                    let row = crate::nn::mlx_ext::slice(&logprobs, &[r, 0], &[r + 1, vocab])?;
                    top_of(&row, &token, n)
                })
                .transpose()?;
            Ok(Sampled { token, logprobs })
        })
        .collect()
}

/// [`sample_rows`]'s one sampler call: the tokens `[rows]` (uint32) and the log-probabilities
/// they were drawn from `[rows, vocab]` (lazy).
pub(crate) fn sample_positions(logits: &Array, sampler: &mut Sampler) -> Result<(Array, Array)> {
    debug_assert!(!sampler.has_logits_processors());
    let logprobs = ops::subtract(logits, &logits.logsumexp_axis(-1, true)?)?;
    let tokens = sampler.sample(&logprobs)?.as_dtype(mlx_rs::Dtype::Uint32)?;
    Ok((tokens, logprobs))
}

/// The sampled `token`'s log-probability `[1, 1]` and the `n` most likely ids and theirs
/// `[1, n]`, from `logprobs` `[1, vocab]`.
fn top_of(logprobs: &Array, token: &Array, n: usize) -> Result<[Array; 3]> {
    let logprobs = logprobs.as_dtype(mlx_rs::Dtype::Float32)?;
    let chosen = logprobs.take_along_axis(token.reshape(&[1, 1])?, -1)?;
    let n = (n as i32).min(logprobs.shape()[1]);
    let order = ops::argsort_axis(&ops::negative(&logprobs)?, -1)?;
    let ids = crate::nn::mlx_ext::slice(&order, &[0, 0], &[1, n])?;
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
            let kept = crate::nn::mlx_ext::slice(tokens, &[start], &[len])?;
            self.tokens = Some(ops::concatenate(&[kept, token.clone()], 0)?);
        }
        Ok(())
    }

    pub(crate) fn state(&self) -> impl Iterator<Item = &Array> {
        self.tokens.iter()
    }
}
