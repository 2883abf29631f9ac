//! The batch's model runner: executes the steps [`crate::engine::batch::BatchGenerator`] schedules (vLLM
//! v1's split of scheduler and model runner). It owns the model's side of the batch: the slot
//! caches, the forward passes, sampling, and the decode step in flight. The generator decides which sequences step and with how many tokens (through the
//! plain functions of [`perch_sched::scheduler`]), owns the sequences, their block tables and the
//! prefix cache, and hands the runner what one step needs: token chunks, per-sequence caches,
//! samplers.
//!
//! Decode steps are pipelined: [`ModelRunner::dispatch_decode`] builds a step and dispatches it
//! (`async_eval`) before the previous step's tokens are read ([`ModelRunner::read_in_flight`]);
//! a sequence whose token from the previous step is not read yet feeds it from the device.
//! Prefill passes over the slot caches are pipelined too ([`ModelRunner::prefill_step`]): a pass
//! is dispatched and not waited for, so the host publishes its blocks and builds the next pass
//! while the device runs it; the next pass waits for it before dispatching anything.

use std::collections::HashMap;
use std::time::Instant;

use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array, Dtype};

use crate::attention::KvQuantization;
use crate::device::Backend;
use crate::error::Result;
use crate::kv::cache::KvCache;
use crate::kv::slot_cache::{RowKv, SlotAttention, SlotKvCache};
use crate::models::{Model, Spliced};
use crate::nn::mlx_ext::slice;
use crate::sample::sampler::{sample_batched, Sampler};
use crate::sample::{log_softmax_f32, sample_next, RecentTokens, Sampled, TokenLogprobs};
use crate::worker::compiled::CompiledSlotForward;
use perch_sched::kv_cache_manager::RequestId;
use perch_sched::scheduler::PrefillShape;
use perch_sched::shapes::row_bucket;

/// Which slot cache a sequence's KV (and recurrent state) lives in, and its row there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Slot {
    /// A row of the prefill slot cache, while its prompt is prefilled.
    Prefill(usize),
    /// A row of the decode slot cache, from its first decode step on.
    Decode(usize),
}

/// The batch's two slot caches: a sequence prefills in one and moves to the other when its
/// prompt is cached, so a prefill step's rows are prompt chunks only and a decode step's rows one
/// token each (a forward pass over both would pad every decode row to the chunk length).
struct Slots {
    prefill: SlotKvCache,
    decode: SlotKvCache,
}

impl Slots {
    fn get(&self, slot: Slot) -> (&SlotKvCache, usize) {
        match slot {
            Slot::Prefill(row) => (&self.prefill, row),
            Slot::Decode(row) => (&self.decode, row),
        }
    }
}

/// One sequence's part in a decode step.
pub(crate) struct DecodeRow<'a> {
    pub id: RequestId,
    /// Its row of the step's logits: its decode slot.
    pub row: usize,
    /// Its last known token, fed unless the step in flight sampled a newer one.
    pub last_token: u32,
    pub sampler: &'a mut Sampler,
    pub history: &'a mut RecentTokens,
    /// Top log-probabilities asked for.
    pub logprobs: Option<usize>,
    /// The whole next-token distribution asked for ([`crate::GenerateRequest::next_token_logprobs`]).
    pub distribution: bool,
    /// A constrained sequence's logit bias `[1, vocab]` (0 or −∞, see [`crate::sample::grammar`]),
    /// added before its processors and sampler.
    pub mask: Option<Array>,
}

/// A token a read step produced.
pub(crate) struct StepToken {
    pub id: RequestId,
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
    /// `[vocab]` log-probabilities, when the row asked for them.
    pub distribution: Option<Vec<f32>>,
}

/// Runs the batch's forward passes; see the module docs.
pub(crate) struct ModelRunner<'m> {
    model: &'m dyn Model,
    slots: Slots,
    /// Decode steps through MLX's compiler, when enabled.
    compiled_decode: Option<CompiledSlotForward>,
    /// The decode step dispatched and not read yet.
    in_flight: Option<InFlight>,
    /// The widest chunk a prefill row feeds (the prefill cache's step).
    max_prefill_tokens: usize,
    /// Decode steps run at each row count, while [`ModelRunner::print_step_graph`] is on.
    graph_steps: std::collections::HashMap<usize, usize>,
    /// With speculative decoding in the batch: the tokens a row feeds in a verify step (every
    /// verify step is this wide, so that MLX meets few shapes) and the most rows one has.
    verify_steps: Option<(usize, usize)>,
    /// Whether a pass of fed rows ([`ModelRunner::fed_step`]) is as wide as the verify steps
    /// rather than its longest row: on GPUs, whose backends pay for each new shape.
    pad_fed_steps: bool,
}

impl<'m> ModelRunner<'m> {
    /// `max_prefill_tokens`: the widest prefill chunk a row feeds in one step, and
    /// `block_size`: the prefix cache's (both size the sliding layers' rings, see
    /// [`SlotKvCache::with_windows`]).
    pub fn new(
        model: &'m dyn Model,
        slot_attention: SlotAttention,
        quantization: Option<KvQuantization>,
        compile_decode: bool,
        (max_prefill_tokens, block_size): (usize, usize),
    ) -> Self {
        let num_layers = model.info().num_layers;
        let layers = model.make_cache(None);
        let windows: Vec<Option<i32>> = layers.iter().map(KvCache::window).collect();
        let recurrent: Vec<bool> = layers.iter().map(KvCache::is_recurrent).collect();
        let cache = |max_step_tokens| {
            SlotKvCache::new(num_layers, quantization)
                .with_attention(slot_attention)
                .with_windows(&windows, max_step_tokens, block_size)
                .with_recurrent_layers(&recurrent)
        };
        let decode = cache(1);
        let compiled_decode = compile_decode.then(|| CompiledSlotForward::new(model, &decode));
        Self {
            model,
            slots: Slots {
                prefill: cache(max_prefill_tokens),
                decode,
            },
            compiled_decode,
            in_flight: None,
            max_prefill_tokens,
            graph_steps: Default::default(),
            verify_steps: None,
            pad_fed_steps: Backend::current() != Backend::Cpu,
        }
    }

    /// This runner with its passes of fed rows padded to the verify steps' width, or not
    /// (the backend decides otherwise: see [`ModelRunner::fed_step`]); tests run the GPUs' way
    /// on the CPU with it.
    pub fn with_padded_fed_steps(mut self, padded: bool) -> Self {
        self.pad_fed_steps = padded;
        self
    }

    /// This runner with verify steps of `(width, max_rows)` ([`ModelRunner::verify`]), which
    /// warm-up then meets too.
    pub fn with_verify_steps(mut self, verify_steps: Option<(usize, usize)>) -> Self {
        self.verify_steps = verify_steps;
        self
    }

    /// Sets its verify steps ([`ModelRunner::with_verify_steps`]).
    pub fn set_verify_steps(&mut self, verify_steps: Option<(usize, usize)>) {
        self.verify_steps = verify_steps;
    }

    /// One decode step over the decode slot cache `slots` (the runner's or a scratch one set up
    /// as it): compiled when enabled, as `forward_slots` otherwise.
    fn forward_decode(
        model: &dyn Model,
        compiled: Option<&mut CompiledSlotForward>,
        ids: &Array,
        slots: &mut SlotKvCache,
        new_tokens: &[usize],
    ) -> Result<Array> {
        // Quantized rows' round trips are not among a trace's inputs, nor a recorded step's
        // replays among its outputs (see `SlotKvCache`).
        match compiled.filter(|_| !slots.has_quantized_rows() && !slots.records_replay()) {
            Some(compiled) => compiled.forward(model, ids, slots, new_tokens),
            None => model.forward_slots(ids, slots, new_tokens),
        }
    }

    /// Runs, over a scratch slot cache, one decode step of every row bucket up to `max_rows`
    /// (sequences of no positions: the first capacity bucket), argmax included, so that MLX
    /// meets those shapes before requests do: its CUDA backend spends tens of milliseconds on
    /// each new one (a first-call cost a running stream would otherwise see as one slow token),
    /// and compiled steps are traced. Then, where long sequences at the largest row bucket are
    /// read another way (CUDA's explicit read), one step of that shape. With verify steps
    /// ([`ModelRunner::with_verify_steps`]), one of each row bucket up to twice their rows too.
    /// Returns the number of shapes run.
    pub fn warm_up(&mut self, max_rows: usize) -> Result<usize> {
        self.warm_up_rows(max_rows, false)
    }

    /// [`ModelRunner::warm_up`], and for a model with recurrent layers, at every row bucket
    /// from 2 rows, a one-token step in which one row feeds its token and the others nothing (a
    /// draft's rows that propose nothing in a round while others do): that step is another
    /// trace ([`SlotKvCache::begin_step`]), met here rather than mid-request.
    pub fn warm_up_with_idle_rows(&mut self, max_rows: usize) -> Result<usize> {
        let idle_rows = self.slots.decode.has_recurrent_layers();
        self.warm_up_rows(max_rows, idle_rows)
    }

    fn warm_up_rows(&mut self, max_rows: usize, idle_rows: bool) -> Result<usize> {
        let mut slots = self.slots.decode.empty_like();
        let mut shapes = 0;
        for n in 1..=max_rows.max(1) {
            slots.push(&[], 0, RowKv::Plain)?;
            if n < max_rows && row_bucket(n + 1) == row_bucket(n) {
                continue;
            }
            // A cache with no buffers steps uncompiled, which creates them: the first shape
            // steps twice so that its compiled form is met too.
            if self.compiled_decode.is_some() && !slots.has_buffers() {
                self.warm_up_step(&mut slots, 1)?;
            }
            self.warm_up_step(&mut slots, 1)?;
            shapes += 1;
            if idle_rows && n >= 2 {
                let mut one_fed = vec![0; slots.slots()];
                one_fed[0] = 1;
                self.warm_up_step_keeping(&mut slots, 1, &one_fed)?;
                shapes += 1;
            }
            // Verify steps run with up to `rows` rows ready, in a cache of up to twice as many
            // (free slots are compacted only once the rest fit half the rows).
            if let Some((width, _)) = self
                .verify_steps
                .filter(|&(_, rows)| row_bucket(n) <= row_bucket(2 * rows))
            {
                self.warm_up_step(&mut slots, width)?;
                shapes += 1;
            }
        }
        // Long sequences at the largest row bucket may be read another way (explicitly on
        // CUDA, see `SlotAttention`): one step there meets that graph's kernels now too, which
        // MLX's CUDA backend builds at run time (seconds, the first time, for fused ones).
        let len = SlotAttention::EXPLICIT_FROM_POSITIONS.div_ceil(slots.rows().max(1));
        if slots.has_buffers() && len < self.model.info().context_length {
            let mut long = slots.empty_like();
            for _ in 0..slots.len() {
                long.push_zeros(&slots, len)?;
            }
            let backend = Backend::current();
            if long.read(backend, 1) != slots.read(backend, 1) {
                self.warm_up_step(&mut long, 1)?;
                shapes += 1;
            }
        }
        Ok(shapes)
    }

    /// Runs one batched prefill pass of `shape` over a scratch prefill cache (rows of zeros
    /// when it starts after `computed` positions), evaluated, so that MLX meets that shape
    /// before a request does (see [`perch_sched::scheduler::prefill_warm_up_shapes`]); changes nothing
    /// in the batch. Does nothing for a shape wider than the prefill cache's step.
    pub fn warm_up_prefill(&mut self, shape: PrefillShape) -> Result<()> {
        if shape.width > self.max_prefill_tokens {
            return Ok(());
        }
        let mut slots = self.slots.prefill.empty_like();
        if shape.computed > 0 {
            let like = self.shaped_like(&self.slots.prefill)?;
            for _ in 0..shape.rows {
                slots.push_zeros(&like, shape.computed)?;
            }
        } else {
            for _ in 0..shape.rows {
                slots.push(&[], 0, RowKv::Plain)?;
            }
        }
        let ids = ops::zeros_dtype(&[shape.rows as i32, shape.width as i32], Dtype::Uint32)?;
        self.model
            .forward_slots(&ids, &mut slots, &vec![shape.width; shape.rows])?;
        eval(slots.state())?;
        crate::distributed::note_progress();
        Ok(())
    }

    /// Runs one decode step (and verify step, with them) of a lone sequence of `positions`
    /// zeroed positions over a scratch decode cache, argmax included, evaluated (see
    /// [`perch_sched::scheduler::decode_warm_up_positions`]); changes nothing in the batch.
    pub fn warm_up_decode_at(&mut self, positions: usize) -> Result<()> {
        let mut long = self.slots.decode.empty_like();
        long.push_zeros(&self.shaped_like(&self.slots.decode)?, positions)?;
        self.warm_up_step(&mut long, 1)?;
        let Some((width, _)) = self.verify_steps else {
            return Ok(());
        };
        // A verify step's capacity holds its row's `width` new positions: the same capacity
        // bucket as the decode step's starts that many positions earlier.
        let mut long = self.slots.decode.empty_like();
        long.push_zeros(
            &self.shaped_like(&self.slots.decode)?,
            positions.saturating_sub(width - 1),
        )?;
        self.warm_up_step(&mut long, width)
    }

    /// An empty cache like `cache` holding one empty sequence whose buffers a one-token step
    /// made (built, never evaluated): what warm-up's zeroed sequences are shaped like
    /// ([`SlotKvCache::push_zeros`]).
    fn shaped_like(&self, cache: &SlotKvCache) -> Result<SlotKvCache> {
        let mut shaped = cache.empty_like();
        shaped.push(&[], 0, RowKv::Plain)?;
        self.model
            .forward_slots(&Array::from_slice(&[0u32], &[1, 1]), &mut shaped, &[1])?;
        Ok(shaped)
    }

    /// One decode step of warm-up over the scratch cache `slots`, `width` tokens a row (a
    /// verify step's when more than one), argmax included, evaluated. A one-token step's rows
    /// each keep their token, as [`ModelRunner::dispatch_decode`]'s do (a recurrent cache's step
    /// in which a row feeds nothing is another trace: [`SlotKvCache::begin_step`]), so its
    /// sequences grow by one position (warm-up's stay within the capacity bucket they start
    /// in); a wider step's keep none, and their lengths.
    fn warm_up_step(&mut self, slots: &mut SlotKvCache, width: usize) -> Result<()> {
        let kept = vec![usize::from(width == 1); slots.slots()];
        self.warm_up_step_keeping(slots, width, &kept)
    }

    /// [`ModelRunner::warm_up_step`] in which slot `s` keeps `kept[s]` of its tokens.
    fn warm_up_step_keeping(
        &mut self,
        slots: &mut SlotKvCache,
        width: usize,
        kept: &[usize],
    ) -> Result<()> {
        let rows = slots.rows() as i32;
        let ids = Array::from_slice(&vec![0u32; slots.rows() * width], &[rows, width as i32]);
        let compiled = self.compiled_decode.as_mut();
        Self::greedy_step(self.model, compiled, &ids, slots, kept)?;
        // A warm-up call builds many shapes (their first compilation can take seconds each):
        // each one is progress for a divided model's watchdog.
        crate::distributed::note_progress();
        Ok(())
    }

    /// One step of `ids` `[rows, width]` over `slots` (slot `s` then holds `new_tokens[s]` more
    /// positions) and its greedy token at every position, `[rows * width]`, evaluated with the
    /// cache.
    fn greedy_step(
        model: &dyn Model,
        compiled: Option<&mut CompiledSlotForward>,
        ids: &Array,
        slots: &mut SlotKvCache,
        new_tokens: &[usize],
    ) -> Result<Array> {
        let logits = Self::forward_decode(model, compiled, ids, slots, new_tokens)?;
        let vocab = logits.shape()[2];
        let greedy = greedy_tokens(&log_softmax(&logits.reshape(&[-1, vocab])?)?)?;
        eval(std::iter::once(&greedy).chain(slots.state()))?;
        Ok(greedy)
    }

    /// Decode steps run through MLX's compiler so far.
    pub fn compiled_decode_steps(&self) -> usize {
        self.compiled_decode
            .as_ref()
            .map_or(0, CompiledSlotForward::steps)
    }

    /// Forgets every slot and the step in flight (after an MLX failure).
    pub fn clear(&mut self) {
        self.slots.prefill.clear();
        self.slots.decode.clear();
        self.in_flight = None;
    }

    pub fn has_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// The sequences the decode step in flight holds rows of (none without one).
    pub fn in_flight_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.in_flight.iter().flat_map(InFlight::ids)
    }

    /// The slot cache `slot` is in, and its row there.
    pub fn slot_cache(&self, slot: Slot) -> (&SlotKvCache, usize) {
        self.slots.get(slot)
    }

    /// Positions a decoding sequence's sliding layers hold in the decode slot cache's rings (the
    /// window, a block and bucket rounding); `None` without sliding layers.
    pub fn decode_ring_positions(&self) -> Option<usize> {
        self.slots.decode.ring_positions()
    }

    /// The rows and capacity of the decode and of the prefill slot cache's buffers, in that
    /// order.
    pub fn slot_shapes(&self) -> [(usize, usize); 2] {
        let shape = |cache: &SlotKvCache| (cache.rows(), cache.capacity());
        [shape(&self.slots.decode), shape(&self.slots.prefill)]
    }

    /// Prefill slots up to the last occupied one, free ones included (the rows of
    /// [`ModelRunner::prefill_step`]'s chunks).
    pub fn prefill_slot_span(&self) -> usize {
        self.slots.prefill.slots()
    }

    /// Puts a sequence whose `cache` holds `computed` positions into the next prefill slot,
    /// bounded by `limit` when its request bounds its KV cache (`max_kv_size`).
    pub fn enter_prefill(&mut self, cache: &[KvCache], computed: usize, kv: RowKv) -> Result<Slot> {
        Ok(Slot::Prefill(self.slots.prefill.push(cache, computed, kv)?))
    }

    /// Sets what `slot`'s RoPE positions add to its cache positions (a sequence whose images
    /// move its positions, [`SlotKvCache::set_rope_shift`]).
    pub fn set_rope_shift(&mut self, slot: Slot, shift: i32) {
        match slot {
            Slot::Prefill(row) => self.slots.prefill.set_rope_shift(row, shift),
            Slot::Decode(row) => self.slots.decode.set_rope_shift(row, shift),
        }
    }

    /// One prefill step over the prefill slots: slot `r` feeds `chunks[r]` (one per slot of
    /// [`ModelRunner::prefill_slot_span`]; empty for a free one), all padded to `width` tokens in
    /// one forward pass, `spliced` replacing some tokens' embeddings (images') and giving each
    /// token's multimodal RoPE positions where rows need them; dispatched (`async_eval`), not waited for. Nothing reads a prefill pass
    /// on the host (a prompt's last token is sampled by its first decode step), so the host
    /// copies a pass's blocks into the prefix cache ([`ModelRunner::end_prefill_step`] after
    /// them) and builds the next pass while the device runs it; the next pass waits for this
    /// one before it dispatches anything ([`SlotKvCache::wait_for_pass_in_flight`], inside
    /// the forward for a pass run in parts), so at most one pass is in flight: pipelined, long
    /// prompts prefill about a quarter faster on a GPU than waiting for each pass, and a pass
    /// dispatched before the last one was done would copy the buffers that one still reads
    /// instead of writing them in place (gigabytes more at the peak).
    pub fn prefill_step(
        &mut self,
        chunks: &[&[u32]],
        width: usize,
        spliced: Option<&Spliced>,
    ) -> Result<()> {
        let mut ids = vec![0u32; self.slots.prefill.rows() * width];
        for (row, chunk) in chunks.iter().enumerate() {
            ids[row * width..row * width + chunk.len()].copy_from_slice(chunk);
        }
        let ids = Array::from_slice(&ids, &[(ids.len() / width) as i32, width as i32]);
        let lengths: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        self.model
            .forward_slots_spliced(&ids, spliced, &mut self.slots.prefill, &lengths)?;
        self.slots.prefill.wait_for_pass_in_flight()?;
        async_eval(self.slots.prefill.state())?;
        Ok(())
    }

    /// Marks the last [`ModelRunner::prefill_step`], and what was dispatched after it (the
    /// copies of its blocks), as the pass in flight.
    pub fn end_prefill_step(&mut self) -> Result<()> {
        self.slots.prefill.mark_pass_in_flight()
    }

    /// Puts a sequence into a decode slot: from its prefill slot (freed; see
    /// [`ModelRunner::free_slot`] for the moves returned; its bound goes with it) or, with
    /// `None`, from its own `cache` of `computed` positions, bounded by `limit`.
    pub fn enter_decode(
        &mut self,
        from: Option<Slot>,
        cache: &[KvCache],
        computed: usize,
        kv: RowKv,
    ) -> Result<(Slot, Vec<(Slot, Slot)>)> {
        match from {
            Some(Slot::Decode(_)) => unreachable!("a decoding sequence is in its slot"),
            Some(Slot::Prefill(row)) => {
                let slot = self.slots.decode.push_from(&self.slots.prefill, row)?;
                let moves = self.free_slot(Slot::Prefill(row))?;
                Ok((Slot::Decode(slot), moves))
            }
            None => Ok((
                Slot::Decode(self.slots.decode.push(cache, computed, kv)?),
                Vec::new(),
            )),
        }
    }

    /// Moves the sequence in decode slot `row` into a prefill slot (a draft's row that fell
    /// behind prefills what it lacks there, [`crate::worker::draft`]). Returns its prefill slot
    /// and the decode slots that moved ([`ModelRunner::free_slot`]).
    pub fn reenter_prefill(&mut self, row: usize) -> Result<(Slot, Vec<(Slot, Slot)>)> {
        let slot = self.slots.prefill.push_from(&self.slots.decode, row)?;
        let moves = self.free_slot(Slot::Decode(row))?;
        Ok((Slot::Prefill(slot), moves))
    }

    /// Frees `slot`. Returns the sequences that moved, `(from, to)` (when its cache compacted
    /// its rows; see [`SlotKvCache::remove`]).
    pub fn free_slot(&mut self, slot: Slot) -> Result<Vec<(Slot, Slot)>> {
        let (cache, row, kind): (_, _, fn(usize) -> Slot) = match slot {
            Slot::Prefill(row) => (&mut self.slots.prefill, row, Slot::Prefill),
            Slot::Decode(row) => (&mut self.slots.decode, row, Slot::Decode),
        };
        Ok(cache
            .remove(row)?
            .into_iter()
            .map(|(from, to)| (kind(from), kind(to)))
            .collect())
    }

    /// Builds one decode step of `rows` (in the order they were scheduled) and dispatches it
    /// (`async_eval`) without waiting; the step in flight so far stays to be read. Rows with a
    /// plain greedy sampler and no log-probabilities asked share one argmax, sampled rows with
    /// only a temperature, top-p and min-p one batched draw ([`sample_batched`], each with its
    /// own key); the others are sampled one by one with their own processors, masks and keys
    /// ([`Draw`]). Returns the step and the seconds
    /// spent building its graph.
    pub fn dispatch_decode(&mut self, mut rows: Vec<DecodeRow>) -> Result<(InFlight, f64)> {
        let start = Instant::now();
        // Every row of the decode slot cache (padding and free slots included).
        let num_rows = self.slots.decode.rows();
        let ids = self.decode_inputs(&rows, num_rows)?;
        let decode = &mut self.slots.decode;
        let one_each = vec![1; decode.slots()];
        let logits = Self::forward_decode(
            self.model,
            self.compiled_decode.as_mut(),
            &ids,
            decode,
            &one_each,
        )?;
        let vocab = logits.shape()[2];
        let logits = logits.reshape(&[num_rows as i32, vocab])?;
        let draw: Vec<Draw> = rows
            .iter()
            .map(|r| match (r.logprobs, &r.mask) {
                (None, None) if r.sampler.is_plain_greedy() => Draw::Greedy,
                (None, None) if r.sampler.batched_row().is_some() => Draw::Batched,
                _ => Draw::Own,
            })
            .collect();
        let logprobs = (draw.iter().any(|d| *d != Draw::Own))
            .then(|| log_softmax(&logits))
            .transpose()?;
        let greedy = match (&logprobs, draw.contains(&Draw::Greedy)) {
            (Some(logprobs), true) => Some(greedy_tokens(logprobs)?),
            _ => None,
        };
        // The sampled rows without processors, top-k, XTC, masks or log-probabilities: one
        // draw for them all.
        let (batched_at, mut batched_samplers): (Vec<u32>, Vec<&mut Sampler>) = rows
            .iter_mut()
            .zip(&draw)
            .filter(|(_, d)| **d == Draw::Batched)
            .map(|(r, _)| (r.row as u32, &mut *r.sampler))
            .unzip();
        let batched = match &logprobs {
            Some(logprobs) if !batched_at.is_empty() => {
                let at = Array::from_slice(&batched_at, &[batched_at.len() as i32]);
                Some(sample_batched(
                    &logprobs.take_axis(&at, 0)?,
                    &mut batched_samplers,
                )?)
            }
            _ => None,
        };
        let mut entries = Vec::with_capacity(rows.len());
        let mut batched_place = 0;
        for (r, &draw) in rows.iter_mut().zip(&draw) {
            let at = r.row as i32;
            let row_logits = || slice(&logits, &[at, 0], &[at + 1, vocab]);
            let source = match draw {
                Draw::Greedy => Source::Greedy,
                Draw::Batched => {
                    batched_place += 1;
                    Source::Batched(batched_place - 1)
                }
                Draw::Own => {
                    let mut masked = row_logits()?;
                    if let Some(mask) = &r.mask {
                        masked = ops::add(&masked, &mask.as_dtype(masked.dtype())?)?;
                    }
                    Source::Own(sample_next(&masked, r.sampler, r.history, r.logprobs)?)
                }
            };
            let distribution = if r.distribution {
                Some(log_softmax_f32(&row_logits()?.reshape(&[vocab])?)?)
            } else {
                None
            };
            entries.push(StepEntry {
                id: r.id,
                row: r.row,
                source,
                distribution,
            });
        }
        let step = InFlight {
            entries,
            greedy,
            batched,
        };
        let built = start.elapsed().as_secs_f64();
        self.print_step_graph(num_rows, &step);
        async_eval(
            step.arrays()
                .chain(rows.iter().flat_map(|r| r.history.state())),
        )?;
        Ok((step, built))
    }

    /// With `PERCH_DECODE_GRAPH_DIR` set, writes the graph of the [`GRAPH_AFTER_STEPS`]th
    /// decode step of each row count to `decode-ROWS.txt` there (MLX's listing, an operation a
    /// line): what a step launches, for the benchmarks' accounts. Not the first step: rows
    /// entering the batch leave their cache copies to be evaluated with it. A diagnostic, off by
    /// default; a file it cannot write is said on stderr, and the step goes on.
    fn print_step_graph(&mut self, num_rows: usize, step: &InFlight) {
        /// Decode steps at a row count before the one written.
        const GRAPH_AFTER_STEPS: usize = 8;
        // Read once: this runs on every decode step.
        static DIR: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();
        let Some(dir) = DIR.get_or_init(|| std::env::var_os("PERCH_DECODE_GRAPH_DIR")) else {
            return;
        };
        let steps = self.graph_steps.entry(num_rows).or_default();
        *steps += 1;
        if *steps != GRAPH_AFTER_STEPS {
            return;
        }
        let path = std::path::Path::new(&dir).join(format!("decode-{num_rows}.txt"));
        let mut outputs: Vec<&Array> = step.arrays().collect();
        outputs.extend(self.slots.decode.state());
        if let Err(e) = crate::nn::mlx_ext::print_graph(&path, &outputs) {
            eprintln!("perch: PERCH_DECODE_GRAPH_DIR: {e}");
        }
    }

    /// Waits for what runs on the device: the decode step in flight (kept, to be read) and the
    /// prefill pass in flight. Their errors surface here (a rank of a divided model gone).
    pub fn wait_for_work_in_flight(&mut self) -> Result<()> {
        if let Some(step) = &self.in_flight {
            eval(step.arrays())?;
        }
        self.slots.prefill.wait_for_pass_in_flight()
    }

    /// Makes `step` the step in flight (after the previous one was read).
    pub fn set_in_flight(&mut self, step: InFlight) {
        self.in_flight = Some(step);
    }

    /// Token ids `[num_rows, 1]` for a decode step: each row feeds its sequence's last known
    /// token or, when the step in flight sampled one not read yet, that one (gathered on the
    /// device); other rows feed 0 (padding) or, when every row's token is on the device, what
    /// the gather gives them (nothing reads a padding row's outputs). In the steady state of
    /// decoding (every row stepped again in the row it had, [`InFlight::in_place`]), the step's
    /// tokens themselves: no array written by the host and no gather, each of which costs a GPU
    /// backend's host more than the step's other operations (docs/benchmarks.md).
    fn decode_inputs(&self, rows: &[DecodeRow], num_rows: usize) -> Result<Array> {
        // Made in the shape the step reads, with no reshape among the step's operations.
        let shape = [num_rows as i32, 1];
        let host = || {
            let mut host = vec![0u32; num_rows];
            for r in rows {
                host[r.row] = r.last_token;
            }
            Array::from_slice(&host, &shape)
        };
        let Some(step) = &self.in_flight else {
            return Ok(host());
        };
        let pending: HashMap<RequestId, usize> = step
            .entries
            .iter()
            .enumerate()
            .map(|(k, e)| (e.id, k))
            .collect();
        if let Some(tokens) = step.in_place(rows, &pending, num_rows) {
            return Ok(tokens.reshape(&shape)?);
        }
        let mut from_device = vec![false; num_rows];
        let mut source = vec![0u32; num_rows];
        for r in rows {
            if let Some(&k) = pending.get(&r.id) {
                from_device[r.row] = true;
                source[r.row] = k as u32;
            }
        }
        if !from_device.contains(&true) {
            return Ok(host());
        }
        let gathered = step.tokens_of(&source)?;
        if rows.iter().all(|r| from_device[r.row]) {
            return Ok(gathered);
        }
        let mask = Array::from_slice(&from_device, &shape);
        Ok(ops::select(&mask, &gathered, host())?)
    }

    /// Waits for the step in flight, if any, and returns its tokens (in the order its rows were
    /// scheduled) with the seconds waited.
    pub fn read_in_flight(&mut self) -> Result<Option<(Vec<StepToken>, f64)>> {
        let Some(step) = self.in_flight.take() else {
            return Ok(None);
        };
        let start = Instant::now();
        eval(step.arrays())?;
        let waited = start.elapsed().as_secs_f64();
        let greedy: Vec<u32> = step
            .greedy
            .as_ref()
            .map(|g| g.as_slice::<u32>().to_vec())
            .unwrap_or_default();
        let batched: Vec<u32> = step
            .batched
            .as_ref()
            .map(|b| b.as_slice::<u32>().to_vec())
            .unwrap_or_default();
        let tokens = step
            .entries
            .iter()
            .map(|entry| {
                let (token, logprobs) = match &entry.source {
                    Source::Own(sampled) => sampled.read(),
                    Source::Greedy => (greedy[entry.row], None),
                    Source::Batched(k) => (batched[*k], None),
                };
                StepToken {
                    id: entry.id,
                    token,
                    logprobs,
                    distribution: entry
                        .distribution
                        .as_ref()
                        .map(|d| d.as_slice::<f32>().to_vec()),
                }
            })
            .collect();
        Ok(Some((tokens, waited)))
    }
}

/// One row of a step of several tokens a row: a verify step ([`ModelRunner::verify`]), or a
/// draft's first proposal step ([`ModelRunner::propose`]).
pub(crate) struct FedRow<'a> {
    /// Its decode slot.
    pub row: usize,
    /// What it feeds from the host: in a verify step its sequence's last token, then prompt
    /// lookup's proposals (the draft's are in `proposed`); in a draft's step the tokens its
    /// sequence has that the draft's cache lacks, ending with the last one.
    pub fed: &'a [u32],
    /// In a verify step, the draft's proposals fed after `fed`, still on the device: its column
    /// of [`Proposed::tokens`] and how many (`None`: none).
    pub proposed: Option<(usize, usize)>,
    /// A sampled row's sampler (one without logits processors), whose draws take the place of
    /// the greedy tokens, in mlx_lm's order (`speculative_generate_step`): in a draft's steps
    /// one draw a proposal, in a verify step one draw for all its positions. `None`: greedy.
    pub sampler: Option<&'a mut Sampler>,
}

impl FedRow<'_> {
    /// The tokens it feeds in all.
    fn len(&self) -> usize {
        self.fed.len() + self.proposed.map_or(0, |(_, k)| k)
    }
}

/// A draft's proposals not read yet ([`ModelRunner::propose`]): the verify step feeds them
/// from the device, so the draft's steps and the verify pass run with one wait.
pub struct Proposed {
    /// `[k, rows]` uint32: step `i`'s proposal of the draft's decode row `r` at `[i, r]`.
    pub tokens: Array,
    /// Each proposing row's column of `tokens` (its decode row in the draft's slot cache), in
    /// the order the rows were given.
    pub columns: Vec<usize>,
    /// The draft's slot cache after the steps, to evaluate with the verify pass.
    pub state: Vec<Array>,
    /// A draft with recurrent layers: each proposing row's states after the first step (when
    /// it holds its sequence's tokens and no proposal yet; views, in `columns`' order), where
    /// it goes back when the model rejects proposals. Empty otherwise.
    pub states_before: Vec<Vec<Vec<Array>>>,
}

impl Proposed {
    /// Where step `i`'s proposal of `column` is in `tokens` flattened.
    fn flat_index(&self, column: usize, i: usize) -> usize {
        i * self.tokens.shape()[1] as usize + column
    }
}

/// `pieces` (1-D, laid end to end) gathered at `at`: one concatenation and one take (lazy).
fn gather(pieces: Vec<Array>, at: &[u32]) -> Result<Array> {
    gather_as(pieces, at, &[at.len() as i32])
}

/// [`gather`] with `at` in `shape`, the result's shape.
fn gather_as(mut pieces: Vec<Array>, at: &[u32], shape: &[i32]) -> Result<Array> {
    let all = match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => ops::concatenate(&pieces, 0)?,
    };
    Ok(all.take_axis(Array::from_slice(at, shape), 0)?)
}

/// One draw of `sampler` from `logits` `[1, vocab]`: `[1]` uint32 (lazy).
fn draw(sampler: &mut Sampler, logits: &Array) -> Result<Array> {
    Ok(crate::sample::sample_after(logits, sampler, None, None)?.token)
}

/// [`FedRow`]s laid out for one pass over the decode slot cache ([`ModelRunner::fed_step`]).
struct FedStep {
    /// Tokens a row, padding included.
    width: usize,
    /// `[rows, width]`, every slot's row (padding for a slot not fed).
    ids: Array,
    /// Per slot, the tokens it keeps (a fed row's count; `others` for the rest).
    new_tokens: Vec<usize>,
}

impl ModelRunner<'_> {
    /// `rows` as one pass over the decode slot cache: as wide as the longest row or, on GPUs
    /// (whose backends pay for each new shape), as the runner's verify steps, which warm-up
    /// meets; the slots not in `rows` keep `others` positions.
    fn fed_step(
        &self,
        rows: &[FedRow],
        others: usize,
        proposed: Option<&Proposed>,
    ) -> Result<FedStep> {
        let longest = rows.iter().map(FedRow::len).max().unwrap_or(1);
        let width = match self.verify_steps {
            Some((width, _)) if self.pad_fed_steps => width.max(longest),
            _ => longest,
        };
        let decode = &self.slots.decode;
        let num_rows = decode.rows();
        let mut ids = vec![0u32; num_rows * width];
        let mut new_tokens = vec![others; decode.slots()];
        // Where each fed position's token is among the host's `ids` followed by the draft's
        // proposals (flattened), when some row feeds proposals from the device.
        let mut gather_at: Option<Vec<u32>> = proposed.map(|_| (0..ids.len() as u32).collect());
        for r in rows {
            let at = r.row * width;
            ids[at..at + r.fed.len()].copy_from_slice(r.fed);
            new_tokens[r.row] = r.len();
            if let (Some(gather_at), Some(proposed), Some((column, k))) =
                (&mut gather_at, proposed, r.proposed)
            {
                for i in 0..k {
                    gather_at[at + r.fed.len() + i] =
                        (ids.len() + proposed.flat_index(column, i)) as u32;
                }
            }
        }
        let shape = [num_rows as i32, width as i32];
        let host = Array::from_slice(&ids, &shape);
        let ids = match (gather_at, proposed) {
            (Some(at), Some(proposed)) => gather(
                vec![host.reshape(&[-1])?, proposed.tokens.reshape(&[-1])?],
                &at,
            )?
            .reshape(&shape)?,
            _ => host,
        };
        Ok(FedStep {
            width,
            ids,
            new_tokens,
        })
    }

    /// A verify step of speculative decoding ([`crate::spec_decode`]): each row of `rows`
    /// feeds its tokens in one forward pass over the decode slot cache (padded to the longest,
    /// compiled when decode steps are), its `fed` ones from the host and then the draft's
    /// `proposed` ones from the device (one wait for the draft's steps and this pass), and the
    /// model's token after each of them comes back (its greedy token, or a sampled row's
    /// draws: one sampler call over its fed positions), per row in `rows`' order, with the
    /// draft's proposals read ([`Verified`]). Waits for the device: the tokens it accepts
    /// decide what the next step feeds. Each row's slot holds all its fed positions afterwards
    /// (the other occupied slots one, as in a decode step); those of rejected proposals are
    /// given back with [`ModelRunner::rewind_rows`] (a model with recurrent layers: run
    /// uncompiled, recording their replays). No decode step may be in flight.
    pub fn verify(
        &mut self,
        mut rows: Vec<FedRow>,
        proposed: Option<&Proposed>,
    ) -> Result<Verified> {
        debug_assert!(self.in_flight.is_none(), "the step in flight is read first");
        let FedStep {
            width,
            ids,
            new_tokens,
        } = self.fed_step(&rows, 1, proposed)?;
        let compiled = self.compiled_decode.as_mut();
        let decode = &mut self.slots.decode;
        // Recurrent layers' states go back only through the step's record.
        decode.record_replay();
        let logits = Self::forward_decode(self.model, compiled, &ids, decode, &new_tokens)?;
        let vocab = logits.shape()[2];
        let logits = logits.reshape(&[-1, vocab])?;
        let greedy = greedy_tokens(&log_softmax(&logits)?)?;
        // A sampled row's positions in one sampler call, as mlx_lm samples a verify pass
        // without logits processors.
        let mut sampled: Vec<Option<Array>> = Vec::with_capacity(rows.len());
        for r in rows.iter_mut() {
            let (from, n) = ((r.row * width) as i32, r.len() as i32);
            sampled.push(match r.sampler.as_deref_mut() {
                Some(sampler) => {
                    let positions = slice(&logits, &[from, 0], &[from + n, vocab])?;
                    Some(crate::sample::sample_positions(&positions, sampler)?.0)
                }
                None => None,
            });
        }
        eval(
            std::iter::once(&greedy)
                .chain(sampled.iter().flatten())
                .chain(decode.state())
                .chain(
                    proposed
                        .iter()
                        .flat_map(|p| std::iter::once(&p.tokens).chain(&p.state)),
                ),
        )?;
        let greedy = greedy.as_slice::<u32>();
        let targets = rows
            .iter()
            .zip(&sampled)
            .map(|(r, sampled)| match sampled {
                Some(tokens) => tokens.as_slice::<u32>().to_vec(),
                None => greedy[r.row * width..r.row * width + r.len()].to_vec(),
            })
            .collect();
        let drafted = match proposed {
            Some(p) => {
                let all = p.tokens.as_slice::<u32>();
                rows.iter()
                    .map(|r| match r.proposed {
                        Some((column, k)) => (0..k).map(|i| all[p.flat_index(column, i)]).collect(),
                        None => Vec::new(),
                    })
                    .collect()
            }
            None => vec![Vec::new(); rows.len()],
        };
        Ok(Verified { targets, drafted })
    }

    /// Puts decode slot `row` back to `len` positions and `states` ([`SlotKvCache::restore_row`]).
    pub fn restore_decode_row(
        &mut self,
        row: usize,
        len: usize,
        states: &[Vec<Array>],
    ) -> Result<()> {
        self.slots.decode.restore_row(row, len, states)
    }

    /// Forgets the last `n` positions of decode slot `row` ([`SlotKvCache::rewind`]).
    pub fn rewind(&mut self, row: usize, n: usize) -> Result<()> {
        self.slots.decode.rewind(row, n)
    }

    /// Forgets the last `n` positions of each decode slot `(row, n)` of `rewinds` after a
    /// verify step ([`SlotKvCache::rewind_rows`]: recurrent layers' states computed again once
    /// for all of them). Call once per verify step, with every row it gives back positions of:
    /// the step's record is spent after it.
    pub fn rewind_rows(&mut self, rewinds: &[(usize, usize)]) -> Result<()> {
        self.slots.decode.rewind_rows(rewinds)
    }
}

/// What a verify step gives each of its rows, in their order ([`ModelRunner::verify`]).
pub(crate) struct Verified {
    /// The model's token after each fed token (greedy, or the row's draws).
    pub targets: Vec<Vec<u32>>,
    /// The draft's proposals it fed from the device (empty for a row without).
    pub drafted: Vec<Vec<u32>>,
}

/// The log-probabilities of every row of `logits` `[rows, vocab]`, in their dtype, as a lone
/// sequence's sampler takes them (lazy).
fn log_softmax(logits: &Array) -> Result<Array> {
    Ok(ops::subtract(logits, &logits.logsumexp_axis(-1, true)?)?)
}

/// The greedy token of every row of `logprobs` `[rows, vocab]` ([`log_softmax`]): `[rows]`
/// uint32, their argmax (lazy).
fn greedy_tokens(logprobs: &Array) -> Result<Array> {
    Ok(ops::indexing::argmax_axis(logprobs, -1, None)?.as_dtype(Dtype::Uint32)?)
}

/// How a plain decode step draws a row's token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Draw {
    /// The argmax, shared by every greedy row.
    Greedy,
    /// One draw of [`sample_batched`] for every such row.
    Batched,
    /// Its own processors, mask, log-probabilities and draw ([`sample_next`]).
    Own,
}

/// A decode step dispatched and not read yet.
pub(crate) struct InFlight {
    /// One per stepped sequence, in the order they were stepped.
    entries: Vec<StepEntry>,
    /// The argmax of every row `[rows]` (uint32), when some row is plain greedy.
    greedy: Option<Array>,
    /// The batched rows' draws ([`Draw::Batched`]), in the entries' order.
    batched: Option<Array>,
}

struct StepEntry {
    id: RequestId,
    /// Its row of the step's logits.
    row: usize,
    /// Where its token is.
    source: Source,
    /// Its `[vocab]` log-probabilities, when asked.
    distribution: Option<Array>,
}

impl InFlight {
    /// The requests it stepped.
    pub fn ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.entries.iter().map(|e| e.id)
    }

    /// Waits until the device has computed the step (dropped unread: nothing of it keeps
    /// running after this returns).
    pub fn wait(self) -> Result<()> {
        eval(self.arrays())?;
        Ok(())
    }

    /// The arrays to evaluate.
    fn arrays(&self) -> impl Iterator<Item = &Array> {
        let own = self.entries.iter().flat_map(|e| {
            let sampled = match &e.source {
                Source::Own(sampled) => Some(sampled),
                _ => None,
            };
            sampled
                .into_iter()
                .flat_map(Sampled::arrays)
                .chain(e.distribution.iter())
        });
        self.greedy.iter().chain(self.batched.iter()).chain(own)
    }

    /// When the step's tokens are one array of `num_rows` (every row's argmax, or every slot's
    /// batched draw) in which each of `rows` (the next step's, whose step entries `pending` maps)
    /// finds its own token at its own row: that array (a padding row reads what the step drew
    /// at its row).
    fn in_place(
        &self,
        rows: &[DecodeRow],
        pending: &HashMap<RequestId, usize>,
        num_rows: usize,
    ) -> Option<&Array> {
        let tokens = match (&self.greedy, &self.batched) {
            (Some(tokens), None) | (None, Some(tokens)) => tokens,
            _ => return None,
        };
        let own_row = |r: &DecodeRow| {
            pending.get(&r.id).is_some_and(|&k| {
                let e = &self.entries[k];
                match e.source {
                    Source::Greedy => e.row == r.row,
                    Source::Batched(at) => at == r.row && e.row == r.row,
                    Source::Own(_) => false,
                }
            })
        };
        (tokens.shape() == [num_rows as i32] && rows.iter().all(own_row)).then_some(tokens)
    }

    /// The tokens of entries `entries` (each an index into [`InFlight::entries`]), `[entries, 1]`
    /// uint32, lazy: one gather from the greedy rows, the batched draws and the rows' own draws,
    /// laid end to end.
    fn tokens_of(&self, entries: &[u32]) -> Result<Array> {
        let mut pieces: Vec<Array> = self.greedy.iter().chain(&self.batched).cloned().collect();
        let greedy_len = self.greedy.as_ref().map_or(0, |g| g.shape()[0] as u32);
        let batched_len = self.batched.as_ref().map_or(0, |b| b.shape()[0] as u32);
        let mut own = greedy_len + batched_len;
        let mut at = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            at.push(match &e.source {
                Source::Greedy => e.row as u32,
                Source::Batched(k) => greedy_len + *k as u32,
                Source::Own(sampled) => {
                    pieces.push(sampled.token.reshape(&[1])?);
                    own += 1;
                    own - 1
                }
            });
        }
        let at: Vec<u32> = entries.iter().map(|&k| at[k as usize]).collect();
        gather_as(pieces, &at, &[at.len() as i32, 1])
    }
}

/// Where a stepped row's token is ([`InFlight`]).
enum Source {
    /// `greedy[row]`.
    Greedy,
    /// `batched[k]`.
    Batched(usize),
    /// Its own draw.
    Own(Sampled),
}

impl ModelRunner<'_> {
    /// A draft model's proposals ([`crate::worker::draft`]): each row of `rows` feeds its
    /// tokens, then more steps feed each row the draft's token before (its greedy token, or a
    /// sampled row's draw), all on the device, `k` steps in all (the most of `ks`), dispatched
    /// without waiting: each row's first `ks[i]` proposals are its column of
    /// [`Proposed::tokens`] (a verify step feeds and reads them). A sampled row
    /// draws only those (each draw takes a key of its stream; after them it feeds its greedy
    /// tokens). Each row's slot holds `fed.len() + k - 1` more positions afterwards (the draft
    /// never reads its last proposal); the other occupied slots are left as they were. No
    /// decode step may be in flight.
    pub fn propose(&mut self, mut rows: Vec<FedRow>, ks: &[usize]) -> Result<Proposed> {
        debug_assert!(
            self.in_flight.is_none(),
            "a draft's runner runs no plain steps"
        );
        let k = ks.iter().copied().max().unwrap_or(0);
        let FedStep {
            width,
            ids: mut feed,
            mut new_tokens,
        } = self.fed_step(&rows, 0, None)?;
        let decode = &mut self.slots.decode;
        let num_rows = decode.rows();
        // Each row's last fed token's place among the first step's `[rows * width]`.
        let mut last = vec![0u32; num_rows];
        for r in &rows {
            last[r.row] = (r.row * width + r.fed.len() - 1) as u32;
        }
        let mut proposals = Vec::with_capacity(k);
        let mut states_before = Vec::new();
        for step in 0..k {
            let logits = Self::forward_decode(
                self.model,
                self.compiled_decode.as_mut(),
                &feed,
                decode,
                &new_tokens,
            )?;
            let vocab = logits.shape()[2];
            let flat = logits.reshape(&[-1, vocab])?;
            let greedy = ops::indexing::argmax_axis(&flat, -1, None)?.as_dtype(Dtype::Uint32)?;
            let first_wide = step == 0 && width > 1;
            let greedy = if first_wide {
                greedy.take_axis(Array::from_slice(&last, &[num_rows as i32]), 0)?
            } else {
                greedy
            };
            if step == 0 {
                for r in &rows {
                    new_tokens[r.row] = 1;
                }
                if decode.has_recurrent_layers() {
                    states_before = rows
                        .iter()
                        .map(|r| decode.row_states(r.row))
                        .collect::<Result<_>>()?;
                }
            }
            // Sampled rows' draws replace their greedy tokens: every row's token taken from
            // the greedy ones followed by the batched draws ([`sample_batched`]) and the rows'
            // own (top-k, XTC).
            let (mut batched_at, mut batched_rows, mut batched_samplers) =
                (Vec::new(), Vec::new(), Vec::new());
            let mut own = Vec::new();
            for (r, &wanted) in rows.iter_mut().zip(ks) {
                let Some(sampler) = r.sampler.as_deref_mut().filter(|_| step < wanted) else {
                    continue;
                };
                let at = if first_wide {
                    last[r.row]
                } else {
                    r.row as u32
                };
                if sampler.batched_row().is_some() {
                    batched_at.push(at);
                    batched_rows.push(r.row);
                    batched_samplers.push(sampler);
                } else {
                    own.push((r.row, at as i32, sampler));
                }
            }
            let mut take: Vec<u32> = (0..num_rows as u32).collect();
            let mut pieces = vec![greedy];
            if !batched_at.is_empty() {
                let at = Array::from_slice(&batched_at, &[batched_at.len() as i32]);
                let logprobs = log_softmax(&flat.take_axis(&at, 0)?)?;
                pieces.push(sample_batched(&logprobs, &mut batched_samplers)?);
                for (k, &row) in batched_rows.iter().enumerate() {
                    take[row] = (num_rows + k) as u32;
                }
            }
            for (j, (row, at, sampler)) in own.into_iter().enumerate() {
                take[row] = (num_rows + batched_rows.len() + j) as u32;
                pieces.push(draw(sampler, &slice(&flat, &[at, 0], &[at + 1, vocab])?)?);
            }
            let tokens = match pieces.len() {
                1 => pieces.pop().expect("the greedy tokens"),
                _ => gather(pieces, &take)?,
            };
            feed = tokens.reshape(&[num_rows as i32, 1])?;
            proposals.push(tokens);
        }
        let tokens = ops::stack(&proposals, 0)?;
        // Dispatched now: the device runs the draft's steps while the verify pass is built.
        async_eval(std::iter::once(&tokens).chain(decode.state()))?;
        Ok(Proposed {
            tokens,
            columns: rows.iter().map(|r| r.row).collect(),
            state: decode.state().cloned().collect(),
            states_before,
        })
    }
}
