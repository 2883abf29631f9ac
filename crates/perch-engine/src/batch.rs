//! Continuous batching (mlx-lm's `BatchGenerator`: `insert`, `step`, `remove`): sequences join
//! and leave between steps; each step runs at most one prefill chunk, then one decode step for
//! every sequence whose prompt is in its cache, batched through [`Model::forward_batch`].
//!
//! Each sequence keeps its own contiguous KV cache, so a row of the batch computes exactly what
//! the sequence computes alone (projections are batched, attention is per sequence; see
//! `kv_cache_manager.rs` for why the pool is not read on every step). Prefill chunks interleave
//! with decode steps, so a long prompt delays running streams by one chunk per step at most.

use std::time::{Duration, Instant};

use mlx_rs::transforms::eval;
use mlx_rs::Array;

use crate::cache::KvCache;
use crate::error::Result;
use crate::generate::{check_request, sample_next, GenerateOutput, GenerateRequest, Pushed, RecentTokens, TokenEvent, TokenSink};
use crate::generate::FinishReason;
use crate::kv_cache_manager::RequestId;
use crate::mlx_ext::slice;
use crate::models::Model;
use crate::sampler::Sampler;
use crate::throughput::ThroughputWindow;
use crate::tokenizer::Tokenizer;

/// Span of the engine's tok/s rates.
pub const THROUGHPUT_WINDOW: Duration = Duration::from_secs(5);

/// What a step produced for one request.
#[derive(Debug)]
pub enum BatchEvent {
    Token { request: RequestId, event: TokenEvent },
    /// The request is done and has left the batch.
    Finished { request: RequestId, output: GenerateOutput },
}

struct Sequence {
    id: RequestId,
    request: GenerateRequest,
    cache: Vec<KvCache>,
    sampler: Sampler,
    history: RecentTokens,
    sink: TokenSink,
    /// Prompt tokens already in the cache (all but the last, once prefill is done).
    prefilled: usize,
    /// The token the next decode step feeds (the last prompt token, then each sampled one).
    next_input: u32,
    start: Instant,
    first_token_at: Option<f64>,
}

impl Sequence {
    fn prefill_done(&self) -> bool {
        self.prefilled + 1 >= self.request.prompt.len()
    }
}

/// Runs many requests over one model, one step at a time.
pub struct BatchGenerator<'m> {
    model: &'m dyn Model,
    tokenizer: &'m Tokenizer,
    sequences: Vec<Sequence>,
    next_id: RequestId,
    /// Largest number of sequences decoded together (mlx-lm's `completion_batch_size`).
    pub max_running: usize,
    /// Prompt tokens processed, over the last seconds.
    pub prompt_throughput: ThroughputWindow,
    /// Tokens generated, over the last seconds.
    pub generation_throughput: ThroughputWindow,
}

impl<'m> BatchGenerator<'m> {
    pub fn new(model: &'m dyn Model, tokenizer: &'m Tokenizer) -> Self {
        Self {
            model,
            tokenizer,
            sequences: Vec::new(),
            next_id: 1,
            max_running: 32,
            prompt_throughput: ThroughputWindow::new(THROUGHPUT_WINDOW),
            generation_throughput: ThroughputWindow::new(THROUGHPUT_WINDOW),
        }
    }

    /// Adds a request; it starts prefilling at the next step. Errors as [`crate::generate`]'s
    /// checks (empty or too long prompt, bad sampling parameters).
    pub fn insert(&mut self, request: GenerateRequest) -> Result<RequestId> {
        let (max_tokens, stop_ids) = check_request(self.model, self.tokenizer, &request)?;
        let id = self.next_id;
        self.next_id += 1;
        let sink = TokenSink::new(&request, stop_ids, max_tokens);
        self.sequences.push(Sequence {
            id,
            cache: self.model.make_cache(),
            sampler: Sampler::new(request.sampling.clone())?,
            history: RecentTokens::new(&request.sampling, &request.prompt),
            sink,
            prefilled: 0,
            next_input: *request.prompt.last().expect("checked non-empty"),
            request,
            start: Instant::now(),
            first_token_at: None,
        });
        Ok(id)
    }

    /// Removes a request (cancel); returns its output so far with finish reason `cancelled`.
    pub fn remove(&mut self, id: RequestId) -> Option<GenerateOutput> {
        let pos = self.sequences.iter().position(|s| s.id == id)?;
        let mut seq = self.sequences.remove(pos);
        seq.sink.output.finish_reason = FinishReason::Cancelled;
        Some(seq.sink.output)
    }

    /// Requests in the batch (prefilling or decoding).
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// One step: a prefill chunk of the oldest sequence still prefilling, then one decode step of
    /// up to `max_running` sequences whose prompts are cached.
    pub fn step(&mut self) -> Result<Vec<BatchEvent>> {
        if let Some(seq) = self.sequences.iter_mut().find(|s| !s.prefill_done()) {
            let end = (seq.prefilled + seq.request.prefill_step_size.max(1)).min(seq.request.prompt.len() - 1);
            let chunk = &seq.request.prompt[seq.prefilled..end];
            self.model.forward(&Array::from_slice(chunk, &[1, chunk.len() as i32]), &mut seq.cache)?;
            eval(seq.cache.iter().flat_map(KvCache::state))?;
            self.prompt_throughput.record(chunk.len());
            seq.prefilled = end;
        }

        let ready: Vec<usize> = (0..self.sequences.len())
            .filter(|&i| self.sequences[i].prefill_done())
            .take(self.max_running)
            .collect();
        if ready.is_empty() {
            return Ok(Vec::new());
        }
        let inputs: Vec<u32> = ready.iter().map(|&i| self.sequences[i].next_input).collect();
        let batch = inputs.len() as i32;
        let logits = {
            let mut caches: Vec<&mut [KvCache]> = Vec::with_capacity(ready.len());
            for (i, seq) in self.sequences.iter_mut().enumerate() {
                if ready.contains(&i) {
                    caches.push(&mut seq.cache);
                }
            }
            self.model.forward_batch(&Array::from_slice(&inputs, &[batch, 1]), &mut caches)?
        };
        let vocab = logits.shape()[2];
        let mut sampled = Vec::with_capacity(ready.len());
        for (row, &i) in ready.iter().enumerate() {
            let seq = &mut self.sequences[i];
            let row = row as i32;
            let row_logits = slice(&logits, &[row, 0, 0], &[row + 1, 1, vocab])?.reshape(&[1, vocab])?;
            sampled.push(sample_next(&row_logits, &mut seq.sampler, &mut seq.history)?);
        }
        eval(sampled.iter().chain(ready.iter().flat_map(|&i| self.sequences[i].history.state())))?;

        // A sequence's first decode step also processes its last prompt token.
        let first_steps = ready.iter().filter(|&&i| self.sequences[i].first_token_at.is_none()).count();
        self.prompt_throughput.record(first_steps);
        self.generation_throughput.record(ready.len());
        let mut events = Vec::new();
        let mut done = Vec::new();
        for (&i, token) in ready.iter().zip(&sampled) {
            let seq = &mut self.sequences[i];
            let id = token.as_slice::<u32>()[0];
            seq.first_token_at.get_or_insert_with(|| seq.start.elapsed().as_secs_f64());
            seq.next_input = id;
            match seq.sink.push(self.tokenizer, id)? {
                Pushed::Token(event) => events.push(BatchEvent::Token { request: seq.id, event }),
                Pushed::Last(event) => {
                    events.extend(event.map(|event| BatchEvent::Token { request: seq.id, event }));
                    done.push(seq.id);
                }
            }
        }
        for id in done {
            let pos = self.sequences.iter().position(|s| s.id == id).expect("finished sequence is present");
            let mut seq = self.sequences.remove(pos);
            if let Some(event) = seq.sink.finish(self.tokenizer)? {
                events.push(BatchEvent::Token { request: id, event });
            }
            let total = seq.start.elapsed().as_secs_f64();
            let generated = seq.sink.generated;
            seq.sink.output.stats.set_timings(generated, seq.first_token_at.unwrap_or(total), total);
            events.push(BatchEvent::Finished { request: id, output: seq.sink.output });
        }
        Ok(events)
    }
}
