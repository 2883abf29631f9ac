//! Sampling: logits processors (logit bias; repetition, presence and frequency penalties) and the
//! sampler (temperature, top-p, min-p, XTC, top-k, seeded categorical; argmax at temperature 0).
//! Same math and order as mlx-lm's `sample_utils.py` (its `make_sampler` and
//! `make_logits_processors`), random draws included: a seeded request draws XTC's uniform and
//! then the categorical from one key stream, as mlx_lm draws them from MLX's global one after
//! `mx.random.seed`; the stream's keys are split on the host ([`super::threefry`]), and a request
//! without a seed gets a random one. Rows of a batch step with only a temperature, top-p and
//! min-p draw together ([`sample_batched`]), each the token it draws alone. Everything else
//! stays on the MLX device, so sampling never forces a sync.

use std::collections::HashMap;

use mlx_rs::ops::argpartition_axis;
use mlx_rs::ops::indexing::{argmax_axis, put_along_axis, scatter_add_single, take_along_axis};
use mlx_rs::{ops, random, Array};
use serde::{Deserialize, Serialize};

use super::threefry;
use crate::error::{EngineError, Result};

/// mlx_lm's default XTC threshold (`make_sampler`, `--xtc-threshold`).
pub const DEFAULT_XTC_THRESHOLD: f32 = 0.1;

/// Per-request sampling settings. The defaults are greedy decoding with no processors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`
    /// (Holtzman et al. 2019). 0 or 1 disables it.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 disables it.
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables it.
    pub min_p: f32,
    /// Multiplicative penalty on tokens seen in the last `repetition_context_size` tokens
    /// (Keskar et al. 2019, sign-aware). 1 or 0 disables it.
    pub repetition_penalty: f32,
    pub repetition_context_size: usize,
    /// Subtracted once from the logit of every token seen in the last `presence_context_size`
    /// tokens (OpenAI's `presence_penalty`, as mlx_lm applies it). 0 disables it.
    pub presence_penalty: f32,
    pub presence_context_size: usize,
    /// Subtracted from a token's logit once per occurrence in the last `frequency_context_size`
    /// tokens (OpenAI's `frequency_penalty`, as mlx_lm applies it). 0 disables it.
    pub frequency_penalty: f32,
    pub frequency_context_size: usize,
    /// Added to the logits of the given token ids.
    pub logit_bias: HashMap<u32, f32>,
    /// XTC ("exclude top choices", Weidmann 2024, as mlx_lm's `apply_xtc`): with this
    /// probability per token, every token whose probability exceeds `xtc_threshold` except the
    /// least likely of them is excluded, so a less obvious but still likely token is chosen.
    /// Special tokens (the tokenizer's end-of-sequence ids and newline, set by the engine) are
    /// never excluded. 0 disables it; only in effect when sampling (temperature > 0).
    pub xtc_probability: f32,
    /// The probability above which XTC counts a token as a top choice, in `[0, 0.5]`
    /// (mlx_lm's default 0.1; at most one token can exceed 0.5, so nothing would be excluded).
    pub xtc_threshold: f32,
    /// Seed of this request's random stream; `None`: a random seed (as MLX's global generator
    /// would draw; not MLX's global stream).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 0.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 0.0,
            repetition_context_size: 20,
            presence_penalty: 0.0,
            presence_context_size: 20,
            frequency_penalty: 0.0,
            frequency_context_size: 20,
            logit_bias: HashMap::new(),
            xtc_probability: 0.0,
            xtc_threshold: DEFAULT_XTC_THRESHOLD,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// The penalties that read recent tokens, as (kind, penalty, window): only those in effect.
    fn penalties(&self) -> impl Iterator<Item = (Penalty, f32, usize)> {
        [
            (
                Penalty::Repetition,
                self.repetition_penalty,
                self.repetition_context_size,
            ),
            (
                Penalty::Presence,
                self.presence_penalty,
                self.presence_context_size,
            ),
            (
                Penalty::Frequency,
                self.frequency_penalty,
                self.frequency_context_size,
            ),
        ]
        .into_iter()
        .filter(|(kind, value, _)| {
            *value != 0.0 && !(*kind == Penalty::Repetition && *value == 1.0)
        })
        .map(|(kind, value, window)| (kind, value, window.max(1)))
    }

    /// How many recent tokens the penalties read: 0 when none is in effect.
    pub(crate) fn history_window(&self) -> usize {
        self.penalties().map(|(_, _, w)| w).max().unwrap_or(0)
    }

    /// Whether these settings take the argmax of the logits with no processor (no logit bias,
    /// no penalty).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.logit_bias.is_empty() && self.history_window() == 0
    }

    /// Whether logits processors change the logits (a logit bias, or penalties that read recent
    /// tokens): mlx_lm then processes and samples the rows of a multi-token step one by one.
    pub fn has_logits_processors(&self) -> bool {
        !self.logit_bias.is_empty() || self.history_window() > 0
    }

    /// Rejects values outside their domain with a message naming the parameter.
    pub fn validate(&self, vocab_size: usize) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidSampling(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.top_k >= vocab_size && self.top_k != 0 {
            return bad(format!(
                "top_k must be below the vocabulary size {vocab_size}, got {}",
                self.top_k
            ));
        }
        if !(self.repetition_penalty >= 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be >= 0, got {}",
                self.repetition_penalty
            ));
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return bad(format!(
                "xtc_probability must be in [0, 1], got {}",
                self.xtc_probability
            ));
        }
        if !(0.0..=0.5).contains(&self.xtc_threshold) {
            return bad(format!(
                "xtc_threshold must be in [0, 0.5], got {}",
                self.xtc_threshold
            ));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() {
                return bad(format!("{name} must be a finite number, got {value}"));
            }
        }
        if let Some(id) = self
            .logit_bias
            .keys()
            .find(|id| **id as usize >= vocab_size)
        {
            return bad(format!(
                "logit_bias names token {id}, outside the vocabulary of {vocab_size}"
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Penalty {
    Repetition,
    Presence,
    Frequency,
}

/// Turns one step's logits into a token, keeping the request's random stream.
pub struct Sampler {
    params: SamplingParams,
    /// Its random stream's key (a request without a seed gets one at random), split on the
    /// host ([`threefry`]) as MLX's `KeySequence` splits its key at each draw.
    key: threefry::Key,
    bias: Option<(Array, Array)>,
    /// Token ids XTC never excludes (empty: every token may be).
    xtc_protected: Vec<u32>,
    /// `[1, vocab]` bool, false at the protected ids: built at the first XTC step (the vocabulary
    /// is known then), with its vocabulary size.
    xtc_allowed: Option<(i32, Array)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        let key = threefry::key(params.seed.unwrap_or_else(random_seed));
        let bias = if params.logit_bias.is_empty() {
            None
        } else {
            let mut pairs: Vec<(u32, f32)> =
                params.logit_bias.iter().map(|(k, v)| (*k, *v)).collect();
            pairs.sort_by_key(|p| p.0);
            let ids: Vec<u32> = pairs.iter().map(|p| p.0).collect();
            let values: Vec<f32> = pairs.iter().map(|p| p.1).collect();
            let n = ids.len() as i32;
            Some((
                Array::from_slice(&ids, &[1, n]),
                Array::from_slice(&values, &[1, n]),
            ))
        };
        Ok(Self {
            params,
            key,
            bias,
            xtc_protected: Vec::new(),
            xtc_allowed: None,
        })
    }

    /// The sampler of a request to a model with `tokenizer`: XTC never excludes its special
    /// tokens ([`crate::Tokenizer::xtc_special_tokens`], read only when XTC is on).
    pub fn for_tokenizer(params: SamplingParams, tokenizer: &crate::Tokenizer) -> Result<Self> {
        let protected = if params.xtc_probability > 0.0 {
            tokenizer.xtc_special_tokens()
        } else {
            &[]
        };
        Ok(Self::new(params)?.protecting(protected))
    }

    /// The same sampler with `ids` never excluded by XTC: mlx_lm passes the tokenizer's
    /// encoding of "\n" (with its special tokens) and its end-of-sequence ids
    /// ([`crate::Tokenizer::xtc_special_tokens`]). Ids outside the vocabulary are ignored.
    pub fn protecting(mut self, ids: &[u32]) -> Self {
        self.xtc_protected = ids.to_vec();
        self.xtc_allowed = None;
        self
    }

    /// Where XTC may exclude tokens in a vocabulary of `vocab` (see `xtc_allowed`); `None`
    /// when nothing is protected.
    fn xtc_allowed(&mut self, vocab: i32) -> Option<Array> {
        if self.xtc_protected.is_empty() {
            return None;
        }
        match &self.xtc_allowed {
            Some((size, allowed)) if *size == vocab => Some(allowed.clone()),
            _ => {
                let mut host = vec![true; vocab as usize];
                for &id in &self.xtc_protected {
                    if let Some(allowed) = host.get_mut(id as usize) {
                        *allowed = false;
                    }
                }
                let allowed = Array::from_slice(&host, &[1, vocab]);
                self.xtc_allowed = Some((vocab, allowed.clone()));
                Some(allowed)
            }
        }
    }

    /// Whether this sampler takes the argmax of the logits with no processor: rows of a batch
    /// that all do can be sampled by one argmax.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.is_plain_greedy()
    }

    /// [`SamplingParams::has_logits_processors`] of its settings.
    pub fn has_logits_processors(&self) -> bool {
        self.params.has_logits_processors()
    }

    /// Applies the logits processors in mlx_lm's order (logit bias, then the repetition,
    /// presence and frequency penalties): `logits` `[1, vocab]`, `history` the recent token ids
    /// (1-D; read by the penalties only) → processed logits `[1, vocab]`.
    pub fn process_logits(&self, logits: &Array, history: Option<&Array>) -> Result<Array> {
        let mut logits = logits.clone();
        if let Some((ids, values)) = &self.bias {
            let current = take_along_axis(&logits, ids, -1)?;
            logits = put_along_axis(&logits, ids, ops::add(&current, values)?, -1)?;
        }
        let Some(history) = history.filter(|h| h.shape()[0] > 0) else {
            return Ok(logits);
        };
        let seen = history.shape()[0];
        for (kind, penalty, window) in self.params.penalties() {
            let start = (seen - window as i32).max(0);
            let recent = crate::nn::mlx_ext::slice(history, &[start], &[seen])?;
            let as_row = recent.reshape(&[1, -1])?;
            logits = match kind {
                Penalty::Repetition => {
                    let selected = take_along_axis(&logits, &as_row, -1)?;
                    let penalized = ops::select(
                        &selected.lt(Array::from_f32(0.0))?,
                        ops::multiply(&selected, Array::from_f32(penalty))?,
                        ops::divide(&selected, Array::from_f32(penalty))?,
                    )?;
                    put_along_axis(&logits, &as_row, &penalized, -1)?
                }
                // A repeated token is written twice with the same value: penalized once.
                Penalty::Presence => {
                    let selected = take_along_axis(&logits, &as_row, -1)?;
                    let penalized = ops::subtract(&selected, Array::from_f32(penalty))?;
                    put_along_axis(&logits, &as_row, &penalized, -1)?
                }
                // Scatter-add accumulates: penalized once per occurrence.
                Penalty::Frequency => {
                    let n = recent.shape()[0];
                    let updates = Array::full::<f32>(&[n, 1, 1], Array::from_f32(-penalty))?
                        .as_dtype(logits.dtype())?;
                    scatter_add_single(&logits, &recent, &updates, 1)?
                }
            };
        }
        Ok(logits)
    }

    /// Draws a token from `logprobs` `[1, vocab]` (log-softmax of processed logits) → `[1]` uint32.
    pub fn sample(&mut self, logprobs: &Array) -> Result<Array> {
        let SamplingParams {
            temperature,
            top_p,
            min_p,
            top_k,
            xtc_probability,
            xtc_threshold,
            ..
        } = self.params;
        if temperature == 0.0 {
            return Ok(argmax_axis(logprobs, -1, None)?);
        }
        let mut logprobs = logprobs.clone();
        if top_p > 0.0 && top_p < 1.0 {
            logprobs = apply_top_p(&logprobs, &Array::from_f32(top_p))?;
        }
        if min_p > 0.0 {
            logprobs = apply_min_p(&logprobs, &Array::from_f32(min_p.ln()))?;
        }
        if xtc_probability > 0.0 {
            let draw = Array::from_f32(threefry::uniform(self.next_key()));
            let allowed = self.xtc_allowed(logprobs.shape()[1]);
            logprobs = apply_xtc(
                &logprobs,
                &draw,
                (xtc_probability, xtc_threshold),
                allowed.as_ref(),
            )?;
        }
        if top_k > 0 {
            logprobs = apply_top_k(&logprobs, top_k as i32)?;
        }
        let scaled = ops::multiply(&logprobs, Array::from_f32(1.0 / temperature))?;
        let key = Array::from_slice(&self.next_key(), &[2]);
        Ok(random::categorical(&scaled, -1, None, Some(&key))?)
    }

    /// The next key of its stream (MLX's `KeySequence`: split, keep the first half, use the
    /// second).
    fn next_key(&mut self) -> threefry::Key {
        let (next, sub) = threefry::split(self.key);
        self.key = next;
        sub
    }

    /// Its settings as a row of [`sample_batched`], when it can be one: sampling (a
    /// temperature) with at most top-p and min-p, no logits processors, top-k or XTC (those
    /// run per row, [`Sampler::sample`]).
    pub(crate) fn batched_row(&self) -> Option<BatchedRow> {
        let p = &self.params;
        (p.temperature > 0.0
            && !p.has_logits_processors()
            && p.top_k == 0
            && p.xtc_probability == 0.0)
            .then_some(BatchedRow {
                inv_temperature: 1.0 / p.temperature,
                top_p: (p.top_p > 0.0 && p.top_p < 1.0).then_some(p.top_p),
                min_p: (p.min_p > 0.0).then_some(p.min_p),
            })
    }
}

/// A sampler's settings as a row of [`sample_batched`] ([`Sampler::batched_row`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchedRow {
    inv_temperature: f32,
    top_p: Option<f32>,
    min_p: Option<f32>,
}

/// Draws a token for every row of `logprobs` `[rows, vocab]` (log-softmax of logits without
/// processors), row `r` with `samplers[r]` (each one with a [`Sampler::batched_row`]): the
/// tokens `[rows]` uint32 (lazy), each the one [`Sampler::sample`] draws for its row alone,
/// from the same key of its stream. One set of operations for all rows, as vLLM's sampler
/// takes per-row temperatures and top-p: MLX's categorical draw of a single row by its
/// inverse CDF (`categorical_inverse_cdf` of MLX 0.32: the first index whose cumulative weight
/// exceeds a uniform draw times the total, `exp(x - max)` the weights) with each row's
/// uniform drawn on the host ([`threefry`]).
pub(crate) fn sample_batched(logprobs: &Array, samplers: &mut [&mut Sampler]) -> Result<Array> {
    let rows: Vec<BatchedRow> = samplers
        .iter()
        .map(|s| s.batched_row().expect("a batched row's sampler"))
        .collect();
    let n = rows.len() as i32;
    let column = |values: Vec<f32>| Array::from_slice(&values, &[n, 1]);
    let mut x = logprobs.clone();
    if rows.iter().any(|r| r.top_p.is_some()) {
        let top_p = column(rows.iter().map(|r| r.top_p.unwrap_or(1.0)).collect());
        let filtered = apply_top_p(&x, &top_p)?;
        x = match rows.iter().all(|r| r.top_p.is_some()) {
            true => filtered,
            false => {
                let on: Vec<bool> = rows.iter().map(|r| r.top_p.is_some()).collect();
                ops::select(Array::from_slice(&on, &[n, 1]), &filtered, &x)?
            }
        };
    }
    if rows.iter().any(|r| r.min_p.is_some()) {
        // ln 0 = -inf: a row without min-p keeps every token.
        let ln_min_p = column(rows.iter().map(|r| r.min_p.unwrap_or(0.0).ln()).collect());
        x = apply_min_p(&x, &ln_min_p)?;
    }
    let x = ops::multiply(&x, column(rows.iter().map(|r| r.inv_temperature).collect()))?
        .as_dtype(mlx_rs::Dtype::Float32)?;
    let top = x.max_axis(-1, true)?;
    // exp(x - max) is NaN where the max is infinite: the draw is uniform over the maxima.
    let weights = ops::select(
        &ops::is_inf(&top)?,
        &x.eq(&top)?.as_dtype(mlx_rs::Dtype::Float32)?,
        &ops::exp(&ops::subtract(&x, &top)?)?,
    )?;
    let cdf = ops::cumsum(&weights, -1, false, false)?;
    let uniforms = column(
        samplers
            .iter_mut()
            .map(|s| threefry::uniform(s.next_key()))
            .collect(),
    );
    let u = ops::multiply(&uniforms, &weights.sum_axis(-1, true)?)?;
    // MLX's `searchsorted(cdf, u, right) - 1` of a row: the entries at most `u`, less one.
    let below = cdf
        .le(&u)?
        .as_dtype(mlx_rs::Dtype::Uint32)?
        .sum_axis(-1, false)?;
    Ok(ops::subtract(&below, Array::from_slice(&[1u32], &[1]))?.as_dtype(mlx_rs::Dtype::Uint32)?)
}

/// A seed for a request that gave none: random per sampler (the standard library's per-map
/// random hasher keys, which differ for every map, and the clock).
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// XTC on `logprobs` `[1, vocab]` with `draw` a uniform in `[0, 1)` (`[]`): when `draw` is at
/// most `probability`, every token more likely than the least likely token above `threshold`
/// becomes `-inf` (nothing when fewer than two are above it), except where `allowed`
/// (`[1, vocab]` bool) is false.
fn apply_xtc(
    logprobs: &Array,
    draw: &Array,
    (probability, threshold): (f32, f32),
    allowed: Option<&Array>,
) -> Result<Array> {
    // Renormalized: top-p and min-p may have dropped tokens before.
    let probs = ops::softmax_axis(logprobs, -1, None)?;
    let above = ops::select(
        &probs.gt(Array::from_f32(threshold))?,
        &probs,
        Array::from_f32(f32::INFINITY),
    )?;
    let least_above = above.min_axis(-1, true)?;
    let mut excluded = probs.gt(&least_above)?;
    if let Some(allowed) = allowed {
        excluded = ops::logical_and(&excluded, allowed)?;
    }
    let applied = ops::logical_and(&draw.le(Array::from_f32(probability))?, &excluded)?;
    Ok(ops::select(&applied, neg_inf(), logprobs)?)
}

fn neg_inf() -> Array {
    Array::from_f32(f32::NEG_INFINITY)
}

/// Keeps the most likely tokens until their mass reaches `top_p` of the total: `logprobs`
/// `[rows, vocab]`, `top_p` a scalar or `[rows, 1]`.
fn apply_top_p(logprobs: &Array, top_p: &Array) -> Result<Array> {
    let sorted = ops::sort_axis(logprobs, -1)?;
    let probs = ops::exp(&sorted)?;
    let mass_above = ops::cumsum(&probs, -1, true, false)?;
    let (rows, vocab) = (logprobs.shape()[0], logprobs.shape()[1]);
    let first = |a: &Array| crate::nn::mlx_ext::slice(a, &[0, 0], &[rows, 1]);
    let total = ops::add(&first(&mass_above)?, &first(&probs)?)?;
    let dropped = mass_above
        .ge(&ops::multiply(&total, top_p)?)?
        .sum_axis(-1, true)?
        .as_dtype(mlx_rs::Dtype::Int32)?;
    let dropped = ops::minimum(&dropped, Array::from_int(vocab - 1))?;
    let threshold = take_along_axis(&sorted, &dropped, -1)?;
    Ok(ops::select(&logprobs.lt(&threshold)?, neg_inf(), logprobs)?)
}

/// Drops tokens whose probability is below `min_p` times the top token's: `logprobs`
/// `[rows, vocab]`, `ln_min_p` the logarithm of `min_p`, a scalar or `[rows, 1]`.
fn apply_min_p(logprobs: &Array, ln_min_p: &Array) -> Result<Array> {
    let top = logprobs.max_axis(-1, true)?;
    let floor = ops::add(&top, ln_min_p)?;
    Ok(ops::select(&logprobs.lt(&floor)?, neg_inf(), logprobs)?)
}

/// Keeps the `k` most likely tokens of each row of `logprobs` `[rows, vocab]`.
fn apply_top_k(logprobs: &Array, k: i32) -> Result<Array> {
    let (rows, vocab) = (logprobs.shape()[0], logprobs.shape()[1]);
    let order = argpartition_axis(&ops::negative(logprobs)?, k - 1, -1)?;
    let dropped = crate::nn::mlx_ext::slice(&order, &[0, k], &[rows, vocab])?;
    let fill = ops::broadcast_to(neg_inf(), dropped.shape())?;
    Ok(put_along_axis(logprobs, &dropped, &fill, -1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logprobs(values: &[f32]) -> Array {
        let logits = Array::from_slice(values, &[1, values.len() as i32]);
        ops::subtract(&logits, logits.logsumexp_axis(-1, true).unwrap()).unwrap()
    }

    fn finite(a: &Array) -> Vec<bool> {
        a.as_slice::<f32>().iter().map(|v| v.is_finite()).collect()
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        let token = s.sample(&logprobs(&[0.1, 3.0, 2.9, -1.0])).unwrap();
        assert_eq!(token.as_slice::<u32>(), &[1]);
    }

    #[test]
    fn filters_keep_the_expected_tokens() {
        // probabilities ~ [0.5, 0.3, 0.15, 0.05]
        let lp = logprobs(&[0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()]);
        assert_eq!(
            finite(&apply_top_k(&lp, 2).unwrap()),
            [true, true, false, false]
        );
        assert_eq!(
            finite(&apply_top_p(&lp, &Array::from_f32(0.7)).unwrap()),
            [true, true, false, false]
        );
        assert_eq!(
            finite(&apply_top_p(&lp, &Array::from_f32(0.9)).unwrap()),
            [true, true, true, false]
        );
        assert_eq!(
            finite(&apply_min_p(&lp, &Array::from_f32(0.2f32.ln())).unwrap()),
            [true, true, true, false]
        );
        assert_eq!(
            finite(&apply_min_p(&lp, &Array::from_f32(0.5f32.ln())).unwrap()),
            [true, true, false, false]
        );
    }

    /// Rows sampled together draw the tokens each draws alone from the same key, over
    /// temperatures, top-p and min-p mixed in one batch, float32 and bfloat16 logits, steps
    /// after steps (each row's stream advancing once a step).
    #[test]
    fn batched_rows_draw_what_each_draws_alone() {
        let settings = [
            (1.0, 0.0, 0.0),
            (0.7, 0.9, 0.0),
            (1.3, 0.0, 0.05),
            (0.5, 0.8, 0.1),
            (1.0, 1.0, 0.0),
            (0.2, 0.0, 0.0),
        ];
        let params: Vec<SamplingParams> = settings
            .iter()
            .enumerate()
            .map(|(i, &(temperature, top_p, min_p))| SamplingParams {
                temperature,
                top_p,
                min_p,
                seed: Some(100 + i as u64),
                ..Default::default()
            })
            .collect();
        for dtype in [mlx_rs::Dtype::Float32, mlx_rs::Dtype::Bfloat16] {
            for subset in [&params[..], &params[..1], &params[2..4]] {
                let n = subset.len() as i32;
                let mut together: Vec<Sampler> = subset
                    .iter()
                    .map(|p| Sampler::new(p.clone()).unwrap())
                    .collect();
                let mut alone: Vec<Sampler> = subset
                    .iter()
                    .map(|p| Sampler::new(p.clone()).unwrap())
                    .collect();
                let (mut batched, mut single) = (Vec::new(), Vec::new());
                for step in 0..40 {
                    let key = random::key(step).unwrap();
                    let logits = ops::multiply(
                        random::normal::<f32>(&[n, 512], None, None, Some(&key)).unwrap(),
                        Array::from_f32(3.0),
                    )
                    .unwrap()
                    .as_dtype(dtype)
                    .unwrap();
                    let lp =
                        ops::subtract(&logits, logits.logsumexp_axis(-1, true).unwrap()).unwrap();
                    let mut refs: Vec<&mut Sampler> = together.iter_mut().collect();
                    let tokens = sample_batched(&lp, &mut refs).unwrap();
                    batched.extend_from_slice(tokens.as_slice::<u32>());
                    for (r, sampler) in alone.iter_mut().enumerate() {
                        let row =
                            crate::nn::mlx_ext::slice(&lp, &[r as i32, 0], &[r as i32 + 1, 512])
                                .unwrap();
                        let token = sampler
                            .sample(&row)
                            .unwrap()
                            .as_dtype(mlx_rs::Dtype::Uint32);
                        single.push(token.unwrap().as_slice::<u32>()[0]);
                    }
                }
                assert_eq!(batched, single, "{dtype:?}, {n} rows");
                let distinct: std::collections::HashSet<_> = single.iter().collect();
                assert!(distinct.len() > 20, "draws vary: {distinct:?}");
            }
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let probs = [0.6f32, 0.3, 0.1];
        let lp = logprobs(&probs.map(f32::ln));
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |n: usize| {
            let mut s = Sampler::new(params.clone()).unwrap();
            (0..n)
                .map(|_| s.sample(&lp).unwrap().as_slice::<u32>()[0])
                .collect::<Vec<_>>()
        };
        let a = draw(3000);
        assert_eq!(a[..50], draw(50)[..], "same seed, same tokens");
        for (token, p) in probs.iter().enumerate() {
            let freq = a.iter().filter(|t| **t as usize == token).count() as f32 / a.len() as f32;
            // 3000 draws: standard error <= 0.009, so 0.04 is > 4 sigma.
            assert!(
                (freq - p).abs() < 0.04,
                "token {token}: frequency {freq} vs probability {p}"
            );
        }
        let other = {
            let mut s = Sampler::new(SamplingParams {
                seed: Some(8),
                ..params.clone()
            })
            .unwrap();
            (0..50)
                .map(|_| s.sample(&lp).unwrap().as_slice::<u32>()[0])
                .collect::<Vec<_>>()
        };
        assert_ne!(other, a[..50], "another seed gives another stream");
    }

    /// A sampler given several positions (a verify pass's, one draw for them all) filters each
    /// row by its own values, as mlx_lm's filters do along the last axis.
    #[test]
    fn filters_apply_to_each_row() {
        let rows = [[0.5f32, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]];
        let values: Vec<f32> = rows.iter().flatten().map(|p| p.ln()).collect();
        let logits = Array::from_slice(&values, &[2, 4]);
        let lp = ops::subtract(&logits, logits.logsumexp_axis(-1, true).unwrap()).unwrap();
        assert_eq!(
            finite(&apply_top_k(&lp, 2).unwrap()),
            [true, true, false, false, false, false, true, true]
        );
        assert_eq!(
            finite(&apply_top_p(&lp, &Array::from_f32(0.7)).unwrap()),
            [true, true, false, false, false, false, true, true]
        );
        assert_eq!(
            finite(&apply_min_p(&lp, &Array::from_f32(0.5f32.ln())).unwrap()),
            [true, true, false, false, false, false, true, true]
        );
    }

    #[test]
    fn low_temperature_concentrates_on_the_top_token() {
        let lp = logprobs(&[1.0, 0.9, 0.8]);
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.01,
            seed: Some(1),
            ..Default::default()
        })
        .unwrap();
        assert!((0..100).all(|_| s.sample(&lp).unwrap().as_slice::<u32>()[0] == 0));
    }

    #[test]
    fn repetition_penalty_and_logit_bias() {
        let logits = Array::from_slice(&[2.0f32, -2.0, 1.0, 0.5], &[1, 4]);
        let history = Array::from_slice(&[0u32, 1, 1], &[3]);
        let s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            logit_bias: HashMap::from([(3, 10.0)]),
            ..Default::default()
        })
        .unwrap();
        let out = s.process_logits(&logits, Some(&history)).unwrap();
        assert_eq!(out.as_slice::<f32>(), &[1.0, -4.0, 1.0, 10.5]);
        let window = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            repetition_context_size: 1,
            ..Default::default()
        })
        .unwrap();
        let out = window.process_logits(&logits, Some(&history)).unwrap();
        assert_eq!(
            out.as_slice::<f32>(),
            &[2.0, -4.0, 1.0, 0.5],
            "only the last token is in context"
        );
    }

    #[test]
    fn presence_and_frequency_penalties() {
        // mlx_lm's processors on these inputs: presence subtracts once per distinct recent
        // token, frequency once per occurrence; each reads its own window.
        let logits = Array::from_slice(&[2.0f32, -2.0, 1.0, 0.5], &[1, 4]);
        let history = Array::from_slice(&[2u32, 0, 1, 1], &[4]);
        let run = |params: SamplingParams| {
            let s = Sampler::new(params).unwrap();
            assert!(!s.is_plain_greedy());
            s.process_logits(&logits, Some(&history))
                .unwrap()
                .as_slice::<f32>()
                .to_vec()
        };
        let presence = run(SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(presence, [1.5, -2.5, 0.5, 0.5]);
        let frequency = run(SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(frequency, [1.5, -3.0, 0.5, 0.5]);
        let windows = run(SamplingParams {
            presence_penalty: 1.0,
            presence_context_size: 1,
            frequency_penalty: 0.25,
            frequency_context_size: 3,
            ..Default::default()
        });
        assert_eq!(windows, [1.75, -3.5, 1.0, 0.5]);
        let negative = run(SamplingParams {
            frequency_penalty: -1.0,
            ..Default::default()
        });
        assert_eq!(
            negative,
            [3.0, 0.0, 2.0, 0.5],
            "a negative penalty favours repeats"
        );
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let bad = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        };
        assert!(
            matches!(bad.validate(10), Err(EngineError::InvalidSampling(m)) if m.contains("top_p"))
        );
        let bad = SamplingParams {
            logit_bias: HashMap::from([(99, 1.0)]),
            ..Default::default()
        };
        assert!(bad.validate(10).is_err());
        assert!(SamplingParams::default().validate(10).is_ok());
    }
}
