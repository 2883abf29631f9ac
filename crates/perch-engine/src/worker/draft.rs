//! A draft model inside the batch (speculative decoding, [`crate::spec_decode`]): a second
//! [`ModelRunner`] over the draft model, whose decode slot cache holds a row for each sequence
//! it proposes for. A verify step of the batch asks it for proposals for every drafting row at
//! once ([`ModelRunner::propose`]: `k` batched draft steps, dispatched without a wait; the
//! verify pass feeds them from the device, [`crate::worker::runner::Proposed`]), and afterwards gives back
//! the positions of the proposals the model rejected ([`DraftRunner::settle`]).
//!
//! The draft's cache follows its sequence lazily: a sequence's row is filled from its tokens
//! the first time it proposes, and a row that fell behind (plain decode steps ran in between,
//! which the draft does not join) by more than [`MAX_FED`] tokens catches up; both prefill
//! through the draft's prefill slot cache, every such row's next chunk in one pass (widths in
//! the scheduler's buckets, [`prefill_chunk_bucket`], which warm-up meets), then move to decode
//! slots. A row at most [`MAX_FED`] tokens behind feeds them in its first proposal step. The
//! draft's slot caches grow with the rows that draft; the block pool's blocks are sized to pay
//! for the draft's KV too (`BatchConfig::counting_draft`).

use std::collections::HashMap;

use mlx_rs::Array;

use crate::error::Result;
use crate::kv::slot_cache::{RowKv, SlotAttention};
use crate::models::Model;
use crate::sample::sampler::Sampler;
use crate::worker::runner::{FedRow, ModelRunner, Proposed, Slot};
use perch_sched::kv_cache_manager::RequestId;
use perch_sched::shapes::prefill_chunk_bucket;

/// The most tokens a row feeds in its first proposal step (on GPUs every first step is this
/// wide, one shape): its last token, the last proposal before it when a verify step accepted
/// them all (the draft never read that one), and the tokens of a plain step or two since. A
/// row further behind catches up through a prefill pass first.
pub(crate) const MAX_FED: usize = 4;

/// A sequence the draft proposes for in a verify step.
pub struct DraftRow<'a> {
    pub id: RequestId,
    /// Its tokens, prompt and generated.
    pub tokens: &'a [u32],
    /// The tokens it proposes.
    pub k: usize,
    /// A sampled sequence's sampler ([`FedRow::sampler`]); `None`: greedy proposals.
    pub sampler: Option<&'a mut Sampler>,
}

/// A draft model's side of the batch; see the module docs.
pub struct DraftRunner<'m> {
    runner: ModelRunner<'m>,
    /// Each drafting sequence's decode slot and the tokens of it the slot holds (its first
    /// `len` tokens, or those and proposals not settled yet).
    rows: HashMap<RequestId, (usize, usize)>,
    /// The most tokens a catch-up pass feeds, all rows together (the batch's prefill budget).
    prefill_step: usize,
    /// A draft with linear-attention layers: each row's length and recurrent states when its
    /// last proposal round began, holding its sequence's tokens and no proposal
    /// ([`Proposed::states_before`]); [`DraftRunner::settle`] goes back there when the model
    /// rejected some, since a recurrent state cannot drop positions. Always empty for a draft
    /// of attention layers only, whose rows just drop the rejected positions.
    before_proposals: HashMap<RequestId, (usize, LayerStates)>,
}

/// A row's recurrent states, by layer ([`crate::kv::slot_cache::SlotKvCache::row_states`]).
type LayerStates = Vec<Vec<Array>>;

impl<'m> DraftRunner<'m> {
    pub fn new(
        model: &'m dyn Model,
        slot_attention: SlotAttention,
        compile_decode: bool,
        (prefill_step, block_size): (usize, usize),
        max_rows: usize,
    ) -> Self {
        Self {
            runner: ModelRunner::new(
                model,
                slot_attention,
                None,
                compile_decode,
                (prefill_chunk_bucket(prefill_step.max(1)), block_size),
            )
            // A first step feeds two tokens after a round whose proposals were all taken.
            .with_verify_steps(Some((MAX_FED, max_rows))),
            rows: HashMap::new(),
            prefill_step: prefill_step.max(1),
            before_proposals: HashMap::new(),
        }
    }

    /// This draft with its rounds' first steps padded to [`MAX_FED`] tokens a row, or as wide
    /// as their longest row ([`ModelRunner::with_padded_fed_steps`]; GPUs pad): tests run the
    /// GPUs' way on the CPU with it.
    pub fn with_padded_first_steps(mut self, padded: bool) -> Self {
        self.runner = self.runner.with_padded_fed_steps(padded);
        self
    }

    /// The draft's decode steps of every row bucket up to `max_rows`, one and [`MAX_FED`]
    /// tokens a row ([`ModelRunner::warm_up`]), and, with recurrent layers, those in which
    /// rows propose nothing ([`ModelRunner::warm_up_with_idle_rows`]). Returns the number of shapes
    /// run.
    pub fn warm_up(&mut self, max_rows: usize) -> Result<usize> {
        self.runner.warm_up_with_idle_rows(max_rows)
    }

    /// Its decode steps run compiled so far ([`ModelRunner::compiled_decode_steps`]).
    pub fn compiled_decode_steps(&self) -> usize {
        self.runner.compiled_decode_steps()
    }

    /// Each of `rows`' proposals: its `k` tokens of the draft after its last one, greedy or
    /// drawn by its sampler, dispatched and not read ([`ModelRunner::propose`]; `columns` in
    /// `rows`' order).
    pub fn propose(&mut self, rows: Vec<DraftRow>) -> Result<Proposed> {
        let sequences: Vec<(RequestId, &[u32])> = rows.iter().map(|r| (r.id, r.tokens)).collect();
        self.catch_up(&sequences)?;
        let k = rows.iter().map(|r| r.k).max().unwrap_or(0);
        let ks: Vec<usize> = rows.iter().map(|r| r.k).collect();
        let fed: Vec<FedRow> = rows
            .into_iter()
            .map(|r| {
                let (row, len) = self.rows[&r.id];
                FedRow {
                    row,
                    fed: &r.tokens[len..],
                    proposed: None,
                    sampler: r.sampler,
                }
            })
            .collect();
        let mut proposals = self.runner.propose(fed, &ks)?;
        // Empty unless the draft has recurrent layers.
        let states = std::mem::take(&mut proposals.states_before);
        self.before_proposals = sequences
            .iter()
            .zip(states)
            .map(|(&(id, tokens), states)| (id, (tokens.len(), states)))
            .collect();
        // Every row stepped `k` times (the most any row proposes).
        for &(id, tokens) in &sequences {
            let entry = self.rows.get_mut(&id).expect("caught up above");
            entry.1 = tokens.len() + k - 1;
        }
        Ok(proposals)
    }

    /// The decode warm-up steps at `positions` ([`ModelRunner::warm_up_decode_at`]): a draft
    /// step's capacities as its rows grow.
    pub fn warm_up_decode_at(&mut self, positions: usize) -> Result<()> {
        self.runner.warm_up_decode_at(positions)
    }

    /// The prefill warm-up pass of `shape` ([`ModelRunner::warm_up_prefill`]): rows catch up
    /// in the target's prefill shapes.
    pub fn warm_up_prefill(&mut self, shape: perch_sched::scheduler::PrefillShape) -> Result<()> {
        self.runner.warm_up_prefill(shape)
    }

    /// Gives every row of `rows` more than [`MAX_FED`] tokens behind (or with no slot yet) all
    /// its tokens but the last: they move to prefill slots, prefill in passes of each one's next
    /// chunk, and move back to decode slots.
    fn catch_up(&mut self, rows: &[(RequestId, &[u32])]) -> Result<()> {
        // (sequence, its prefill slot, tokens it holds, its tokens)
        let mut behind: Vec<(RequestId, usize, usize, &[u32])> = Vec::new();
        for &(id, tokens) in rows {
            let (slot, held) = match self.rows.get(&id).copied() {
                Some((_, len)) if len + MAX_FED >= tokens.len() => continue,
                Some((row, len)) => {
                    self.rows.remove(&id);
                    let (slot, moves) = self.runner.reenter_prefill(row)?;
                    self.decode_slots_moved(&moves);
                    (slot, len)
                }
                None => (self.runner.enter_prefill(&[], 0, RowKv::Plain)?, 0),
            };
            let Slot::Prefill(slot) = slot else {
                unreachable!("a prefill slot")
            };
            behind.push((id, slot, held, tokens));
        }
        loop {
            // At most `prefill_step` tokens a pass in all, as the model's prefill passes.
            let mut room = self.prefill_step;
            let mut chunks: Vec<&[u32]> = vec![&[]; self.runner.prefill_slot_span()];
            for (_, slot, held, tokens) in &mut behind {
                let end = (*held + room).min(tokens.len() - 1);
                chunks[*slot] = &tokens[*held..end];
                room -= end - *held;
                *held = end;
            }
            let Some(widest) = chunks.iter().map(|c| c.len()).max().filter(|&w| w > 0) else {
                break;
            };
            self.runner
                .prefill_step(&chunks, prefill_chunk_bucket(widest), None)?;
            self.runner.end_prefill_step()?;
        }
        for i in 0..behind.len() {
            let (id, slot, held, _) = behind[i];
            let (to, moves) =
                self.runner
                    .enter_decode(Some(Slot::Prefill(slot)), &[], 0, RowKv::Plain)?;
            for (from, to) in moves {
                if let Some(entry) = behind[i + 1..]
                    .iter_mut()
                    .find(|e| Slot::Prefill(e.1) == from)
                {
                    let Slot::Prefill(to) = to else {
                        unreachable!("prefill slots move within the prefill cache")
                    };
                    entry.1 = to;
                }
            }
            let Slot::Decode(row) = to else {
                unreachable!("enter_decode gives a decode slot")
            };
            self.rows.insert(id, (row, held));
        }
        Ok(())
    }

    /// After a verify step: sequence `id`'s slot keeps its first `valid` tokens (those its
    /// sequence had before the proposals and the proposals it accepted), the rest given back.
    /// A draft with recurrent layers goes back to where the row held its sequence's tokens
    /// before the proposals: its next proposal step feeds the accepted ones and the model's
    /// token after them (or the row catches up, past [`MAX_FED`]).
    pub fn settle(&mut self, id: RequestId, valid: usize) -> Result<()> {
        let before = self.before_proposals.remove(&id);
        if let Some((row, len)) = self.rows.get_mut(&id) {
            if *len > valid {
                match before {
                    Some((held, states)) => {
                        self.runner.restore_decode_row(*row, held, &states)?;
                        *len = held;
                    }
                    None => {
                        self.runner.rewind(*row, *len - valid)?;
                        *len = valid;
                    }
                }
            }
        }
        Ok(())
    }

    /// Forgets sequence `id` (it left the batch), freeing its slot.
    pub fn remove(&mut self, id: RequestId) -> Result<()> {
        self.before_proposals.remove(&id);
        if let Some((row, _)) = self.rows.remove(&id) {
            let moves = self.runner.free_slot(Slot::Decode(row))?;
            self.decode_slots_moved(&moves);
        }
        Ok(())
    }

    /// Forgets every sequence (after an MLX failure).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.before_proposals.clear();
        self.runner.clear();
    }

    /// Each sequence in decode slot `from` is now in `to`, for every `(from, to)` of `moves`.
    fn decode_slots_moved(&mut self, moves: &[(Slot, Slot)]) {
        let moves: HashMap<Slot, Slot> = moves.iter().copied().collect();
        for (row, _) in self.rows.values_mut() {
            if let Some(&Slot::Decode(to)) = moves.get(&Slot::Decode(*row)) {
                *row = to;
            }
        }
    }
}
