//! One step of the batch as a value (vLLM v1's `SchedulerOutput`): from the running sequences
//! as the scheduler sees them ([`Running`]), [`plan_step`] decides which sequences take a
//! prefill slot, the chunk each prefilling sequence computes in this step's one prefill pass and
//! its padded width, and which sequences decode. The engine's batch executes the plan (its model
//! runner runs the pass and the decode step) and reports the tokens back; admission and
//! preemption ([`crate::scheduler::admit`], [`crate::scheduler::when_short`]) are decided where
//! the block pool is consulted, before and while the plan's decode rows get their blocks.

use crate::kv_cache_manager::RequestId;
use crate::scheduler::{self, Progress};

/// Which of the batch's slot caches a running sequence computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// None yet: it holds what it loaded from the prefix cache in a cache of its own.
    None,
    /// A row of the prefill slot cache (its prompt is still being computed).
    Prefill,
    /// A row of the decode slot cache.
    Decode,
}

/// A running sequence as the scheduler plans a step for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Running {
    pub id: RequestId,
    pub progress: Progress,
    pub slot: SlotKind,
    /// A next-token-logprobs request whose one decode step has run: it waits for its result and
    /// does not step again.
    pub scored: bool,
    /// For a hybrid model's sequence that recomputes shared prefix-cache blocks: the end of
    /// those blocks, where a prefill chunk must stop (the block ending there receives the
    /// recurrent states).
    pub branch_at: Option<usize>,
}

/// The limits a step is planned within (the engine's `BatchConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Most sequences in prefill slots (mlx-lm's `prefill_batch_size`).
    pub prefill_batch_size: usize,
    /// While some sequence decodes, the most prompt tokens one step prefills; also the widest
    /// chunk a pass runs (the slot caches' sliding rings are sized by it).
    pub prefill_token_budget: usize,
    /// Sequences take a prefill slot only while their prompts fit the budget (the first one
    /// excepted): see [`scheduler::take_prefill_slots`].
    pub prefill_fits_budget: bool,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Chunks end on the last block boundary they cross (hybrid models, whose recurrent states
    /// exist only after the last token computed: see [`scheduler::align_chunk_to_block`]).
    pub align_chunks_to_blocks: bool,
}

/// The prefill pass of a step: every sequence in a prefill slot (after those entering) with the
/// chunk it computes, in the order of [`plan_step`]'s input, all padded to `width` tokens
/// ([`crate::shapes::prefill_chunk_bucket`] of the longest chunk).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillPass {
    pub chunks: Vec<(RequestId, usize)>,
    pub width: usize,
}

impl PrefillPass {
    /// Prompt tokens the pass computes (padding excluded).
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|&(_, chunk)| chunk).sum()
    }

    /// The chunk of `id`, if it is in the pass.
    pub fn chunk_of(&self, id: RequestId) -> Option<usize> {
        self.chunks
            .iter()
            .find_map(|&(row, chunk)| (row == id).then_some(chunk))
    }
}

/// What one step runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Sequences that take a prefill slot now, oldest first.
    pub enter_prefill: Vec<RequestId>,
    /// The step's prefill pass; `None` when no sequence is in a prefill slot.
    pub prefill: Option<PrefillPass>,
    /// Sequences that decode after the pass, in the input's order: those whose prompt is cached
    /// by then (a prompt the pass completes decodes in the same step), scored ones left out. Each
    /// needs a block for the token it feeds; one the pool cannot give leads to
    /// [`scheduler::when_short`] while the plan runs, so a row may not run.
    pub decode: Vec<RequestId>,
}

/// Plans a step over `running` (oldest first): sequences still prefilling take free prefill slots
/// ([`scheduler::take_prefill_slots`]); every sequence in a prefill slot gets its next chunk, an
/// equal share of the step's prefill budget ([`scheduler::prefill_budget`],
/// [`scheduler::plan_slot_chunks`]), aligned to blocks where the limits ask and stopped at its
/// `branch_at`; then every sequence whose prompt is cached after the pass decodes.
pub fn plan_step(running: &[Running], limits: &StepLimits) -> StepPlan {
    let progress: Vec<Progress> = running.iter().map(|r| r.progress).collect();
    let taken = running
        .iter()
        .filter(|r| r.slot == SlotKind::Prefill)
        .count();
    let entering = scheduler::take_prefill_slots(
        &progress,
        |i| running[i].slot != SlotKind::None,
        taken,
        limits.prefill_batch_size.max(1),
        limits
            .prefill_fits_budget
            .then_some(limits.prefill_token_budget),
    );
    let members: Vec<usize> = (0..running.len())
        .filter(|&i| running[i].slot == SlotKind::Prefill || entering.contains(&i))
        .collect();
    let prefill = (!members.is_empty()).then(|| {
        let budget = scheduler::prefill_budget(&progress, limits.prefill_token_budget);
        let rows: Vec<Progress> = members.iter().map(|&i| progress[i]).collect();
        let chunks = scheduler::plan_slot_chunks(&rows, budget, limits.prefill_token_budget.max(1));
        let chunks: Vec<(RequestId, usize)> = members
            .iter()
            .zip(chunks)
            .map(|(&i, mut chunk)| {
                let row = &running[i];
                let computed = row.progress.num_computed;
                if limits.align_chunks_to_blocks {
                    chunk = scheduler::align_chunk_to_block(computed, chunk, limits.block_size);
                }
                if let Some(at) = row.branch_at.filter(|&at| computed < at) {
                    chunk = chunk.min(at - computed);
                }
                (row.id, chunk)
            })
            .collect();
        let longest = chunks.iter().map(|&(_, c)| c).max().unwrap_or(1);
        PrefillPass {
            chunks,
            width: crate::shapes::prefill_chunk_bucket(longest),
        }
    });
    let decode = running
        .iter()
        .filter(|row| !row.scored)
        .filter(|row| {
            let chunk = prefill.as_ref().and_then(|p| p.chunk_of(row.id));
            Progress {
                num_computed: row.progress.num_computed + chunk.unwrap_or(0),
                ..row.progress
            }
            .prefill_done()
        })
        .map(|row| row.id)
        .collect();
    StepPlan {
        enter_prefill: entering.iter().map(|&i| running[i].id).collect(),
        prefill,
        decode,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> StepLimits {
        StepLimits {
            prefill_batch_size: 2,
            prefill_token_budget: 256,
            prefill_fits_budget: false,
            block_size: 16,
            align_chunks_to_blocks: false,
        }
    }

    fn row(id: RequestId, num_tokens: usize, num_computed: usize, slot: SlotKind) -> Running {
        Running {
            id,
            progress: Progress {
                num_tokens,
                num_computed,
                prefill_step_size: 512,
            },
            slot,
            scored: false,
            branch_at: None,
        }
    }

    #[test]
    fn prefill_shares_the_budget_while_others_decode() {
        let running = [
            row(1, 40, 39, SlotKind::Decode),
            row(2, 1000, 0, SlotKind::Prefill),
            row(3, 1000, 0, SlotKind::None),
            // No prefill slot left for it (batch size 2).
            row(4, 1000, 0, SlotKind::None),
        ];
        let plan = plan_step(&running, &limits());
        assert_eq!(plan.enter_prefill, vec![3]);
        let pass = plan.prefill.expect("a prefill pass");
        assert_eq!(pass.chunks, vec![(2, 128), (3, 128)]);
        assert_eq!(pass.width, 128);
        assert_eq!(pass.num_tokens(), 256);
        assert_eq!(plan.decode, vec![1]);
    }

    #[test]
    fn alone_a_prompt_prefills_the_widest_chunk_and_decodes_when_done() {
        // Nobody decodes: the budget does not bind, the slot caches' width does.
        let plan = plan_step(&[row(7, 1000, 0, SlotKind::None)], &limits());
        assert_eq!(plan.prefill.unwrap().chunks, vec![(7, 256)]);
        assert!(plan.decode.is_empty());
        // A chunk that completes the prompt (all but its last token) decodes in the same step.
        let plan = plan_step(&[row(7, 100, 50, SlotKind::Prefill)], &limits());
        let pass = plan.prefill.unwrap();
        assert_eq!(pass.chunks, vec![(7, 49)]);
        assert_eq!(pass.width, 64);
        assert_eq!(plan.decode, vec![7]);
    }

    #[test]
    fn a_cached_prompt_decodes_without_a_pass() {
        // One-token prompt, or a prefix hit that covers all but the last token.
        let plan = plan_step(
            &[row(1, 1, 0, SlotKind::None), row(2, 33, 32, SlotKind::None)],
            &limits(),
        );
        assert_eq!(plan.prefill, None);
        assert!(plan.enter_prefill.is_empty());
        assert_eq!(plan.decode, vec![1, 2]);
    }

    #[test]
    fn scored_requests_wait_for_their_result() {
        let mut scored = row(1, 10, 10, SlotKind::Decode);
        scored.scored = true;
        let plan = plan_step(&[scored, row(2, 12, 11, SlotKind::Decode)], &limits());
        assert_eq!(plan.decode, vec![2]);
    }

    #[test]
    fn hybrid_chunks_end_on_blocks_and_at_a_branch() {
        let limits = StepLimits {
            align_chunks_to_blocks: true,
            ..limits()
        };
        // 0..100 of a 200-token prompt alone: 100 tokens stop at 96, the last boundary crossed.
        let mut first = row(1, 200, 0, SlotKind::Prefill);
        let plan = plan_step(
            &[first],
            &StepLimits {
                prefill_token_budget: 100,
                ..limits
            },
        );
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 96)]);
        // Recomputing shared blocks up to 40: the chunk stops there.
        first.progress.num_computed = 16;
        first.branch_at = Some(40);
        let plan = plan_step(&[first], &limits);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 24)]);
        // Past the branch, only blocks bind.
        first.progress.num_computed = 40;
        let plan = plan_step(&[first], &limits);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 152)]);
    }

    #[test]
    fn prefill_slots_fitted_to_the_budget_keep_a_long_prompt_alone() {
        let limits = StepLimits {
            prefill_fits_budget: true,
            ..limits()
        };
        let plan = plan_step(
            &[
                row(1, 1000, 0, SlotKind::None),
                row(2, 20, 0, SlotKind::None),
            ],
            &limits,
        );
        assert_eq!(plan.enter_prefill, vec![1]);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 256)]);
    }
}
