//! One step of the batch as a value (vLLM v1's `SchedulerOutput`). [`schedule`] makes every
//! decision of a step before anything runs: the decode rows' blocks for their next token (the
//! newest sequence preempted when the pool is short), the waiting requests admitted with the
//! prefix-cache blocks each loads, then [`plan_step`]: which sequences take a prefill slot, the
//! chunk each prefilling sequence computes in the step's one prefill pass and its padded width,
//! and which sequences decode. The engine's batch executes the plan (loads, the pass, the decode
//! step through its model runner) and reports the tokens back.

use crate::block_pool::BlockId;
use crate::kv_cache_manager::{BlockContents, ComputedBlocks, KvCacheManager, RequestId};
use crate::scheduler::{self, Priority, Progress, WhenShort};

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
pub struct Running<'a> {
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
    /// A request whose KV cache is its own ([`Waiting::private`]): what it holds depends on
    /// where its chunks end (mlx_lm's rotating cache, or its cache quantized after the chunk
    /// that reaches `quantized_kv_start`), so each of its chunks is its own `prefill_step_size`
    /// within the widest step, whatever else the pass holds.
    pub own_chunks: bool,
    /// Spans of its tokens a prefill chunk must not cut in two (`[start, end)`, in order, apart):
    /// images whose tokens attend to each other both ways ([`scheduler::keep_whole`]).
    pub whole: &'a [(usize, usize)],
    /// Its request's lane ([`Priority`]).
    pub priority: Priority,
    /// Where prefixes it pins end ([`Waiting::pin_ends`]).
    pub pin_ends: &'a [usize],
    /// Whether its full blocks go to the prefix cache when it leaves the batch, so that it comes
    /// back from them: what lets it yield its prefill slot to a higher lane (false for a
    /// private KV, a preloaded prefix, or with prefix caching off: it pauses in its slot instead).
    pub keeps_blocks: bool,
}

/// The limits a step is planned within (the engine's `BatchConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Most sequences running (admitted) at once.
    pub max_running: usize,
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

/// A waiting request as the scheduler sees it (queue order: new requests and preempted ones
/// back at the front).
#[derive(Clone, Copy, Debug)]
pub struct Waiting<'a> {
    pub id: RequestId,
    /// What its KV cache must hold up to the last one: the prompt, then the tokens generated
    /// before a preemption.
    pub tokens: &'a [u32],
    /// Its request's prefill chunk size.
    pub prefill_step_size: usize,
    /// For a request that continues from a private prefix state (a prompt-cache file without
    /// token ids): the prefix's length. It starts after it and never looks up the prefix cache.
    pub preloaded: Option<usize>,
    /// For a request whose KV cache is bounded (`max_kv_size`): the positions its cache holds
    /// at most ([`KvCacheManager::bound_request`]). Such a request is private too.
    pub bounded: Option<usize>,
    /// A request whose KV cache is its own (bounded, or quantized from some position on): it
    /// never looks up the prefix cache and takes its own chunks ([`Running::own_chunks`]).
    pub private: bool,
    /// Spans of its tokens a prefill chunk must not cut in two, in order ([`Running::whole`]).
    pub whole: &'a [(usize, usize)],
    /// Its request's lane (the queue is in lane order: the engine's).
    pub priority: Priority,
    /// Where prefixes it pins end (`cache_control` breakpoints, on block boundaries, in
    /// order): with [`StepLimits::align_chunks_to_blocks`] (a hybrid model, whose recurrent
    /// states exist only where a chunk ends) a chunk stops at each, so that the block there
    /// keeps the states and a hit can start after it.
    pub pin_ends: &'a [usize],
    /// See [`Running::keeps_blocks`].
    pub keeps_blocks: bool,
}

/// A request admitted in a step, and what it starts from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub id: RequestId,
    /// Its whole prefix-cache hit (its block table's first blocks).
    pub hit: ComputedBlocks,
    /// The leading blocks of `hit` it loads ([`BlockContents::usable_blocks`]); it shares the
    /// others and recomputes them.
    pub load: usize,
    /// Blocks whose bounded parts it pins while it runs ([`BlockContents::read_by_hit`]).
    pub pinned: Vec<BlockId>,
    /// Whether it then extends the loaded blocks with a kept partial block (a tail of an earlier
    /// sequence's KV, looked up by its tokens).
    pub tail: bool,
    /// Tokens in its cache when it starts: the loaded blocks, then the tail or its preloaded
    /// prefix.
    pub num_computed: usize,
    /// See [`Running::branch_at`].
    pub branch_at: Option<usize>,
}

/// What [`schedule`] decides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// A decode row is short of blocks while a decode step is in flight: read that step (its
    /// tokens may finish sequences, freeing blocks, and a sequence about to be preempted must
    /// not lose its last token), then schedule again.
    ReadInFlight,
    /// Preempt this running sequence (the newest): free its blocks (full ones stay cached) and
    /// put it back at the front of the waiting queue; then schedule again, admitting nobody.
    Preempt(RequestId),
    /// This sequence is alone and still short of blocks (the insert-time capacity check makes
    /// this unreachable): it finishes as if it reached its length; then schedule again.
    FinishOutOfBlocks(RequestId),
    /// The step to run.
    Run(StepPlan),
}

/// The batch as [`schedule`] sees it.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// Running sequences, oldest first.
    pub running: &'a [Running<'a>],
    pub waiting: &'a [Waiting<'a>],
    /// Whether a decode step's tokens are not read yet.
    pub step_in_flight: bool,
    /// Whether waiting requests may be admitted (not in a step that preempted).
    pub admit: bool,
    /// The highest lane a sequence ran in within [`scheduler::ACTIVE_LANE_WINDOW`] (the running
    /// ones' included): lower lanes' passes are smaller while it is active
    /// ([`scheduler::lane_budget`]).
    pub active_lane: Option<Priority>,
}

/// Decides a step, vLLM v1's order: first every running sequence whose prompt is cached gets a
/// block for the token it feeds, oldest first ([`KvCacheManager::allocate`]); a row the pool is
/// short for takes pinned prefixes' blocks ([`crate::prefix_pins`]), else asks to read the step
/// in flight, else to preempt the newest sequence ([`scheduler::when_short`]). Then waiting requests are admitted front first while the batch
/// has room and the pool has blocks for their prompts ([`scheduler::admit`]), each with its
/// prefix-cache hit, the blocks of it it loads and pins, and a kept partial block after them
/// where `tail_tokens(tokens, hit_tokens)` finds one (its length). Then [`plan_step`] over all of
/// them. Changes `kv`'s block tables and `contents`' pins as decided; the caller applies a
/// decision other than [`Decision::Run`] and calls again (allocation is idempotent).
pub fn schedule(
    kv: &mut KvCacheManager,
    contents: &mut impl BlockContents,
    batch: &Batch,
    limits: &StepLimits,
    mut tail_tokens: impl FnMut(&[u32], usize) -> Option<usize>,
) -> Decision {
    let block_size = kv.block_size();
    for row in batch.running {
        if row.scored || !row.progress.prefill_done() {
            continue;
        }
        // The fed token's slot; the sampled token gets its slot at the next step.
        while !kv.allocate(contents, row.id, row.progress.num_computed, 1, None) {
            // Pinned prefixes give their blocks up before a running sequence is preempted.
            if kv.unpin_soonest(contents) {
                continue;
            }
            let lanes: Vec<Priority> = batch.running.iter().map(|r| r.priority).collect();
            return match scheduler::when_short(&lanes, batch.step_in_flight) {
                WhenShort::ReadInFlight => Decision::ReadInFlight,
                WhenShort::Preempt(victim) => Decision::Preempt(batch.running[victim].id),
                WhenShort::FinishAlone => Decision::FinishOutOfBlocks(row.id),
            };
        }
    }
    let mut running = batch.running.to_vec();
    let mut admitted = Vec::new();
    if batch.admit {
        let waiting = batch.waiting;
        scheduler::admit(waiting.len(), running.len(), limits.max_running, |k| {
            let request = &waiting[k];
            let private = request.private || request.bounded.is_some();
            let hit = match (request.preloaded, private) {
                (None, false) => kv.get_computed_blocks(request.tokens),
                _ => ComputedBlocks::default(),
            };
            if let Some(tokens) = request.bounded {
                kv.bound_request(request.id, tokens);
            }
            // What the hit reads of the bounded layers is kept from the allocations from
            // here on (its own, and the next admissions', which could drop it otherwise).
            let load = contents.usable_blocks(&hit.blocks, block_size);
            let pinned = contents
                .read_by_hit(&hit.blocks[..load], block_size)
                .to_vec();
            contents.pin(&pinned);
            let new_tokens = request.tokens.len() - hit.num_tokens;
            // Pinned prefixes give their blocks up to a request that would otherwise wait for
            // nothing (none running) or that a person waits for (the high lane).
            let unpins = running.is_empty() || request.priority == Priority::High;
            while !kv.allocate(contents, request.id, hit.num_tokens, new_tokens, Some(&hit)) {
                if !(unpins && kv.unpin_soonest(contents)) {
                    contents.unpin(&pinned);
                    kv.free(request.id);
                    return false;
                }
            }
            // A sequence starts after the last hit block whose bounded layers' parts it can
            // load, shares the blocks after it and recomputes them up to the end of the hit;
            // a hybrid one leaves its states at that end (`branch_at`).
            let branch_at = (contents.has_recurrent_layers() && load < hit.blocks.len())
                .then_some(hit.num_tokens);
            let tail = match (request.preloaded, private) {
                (None, false) if load == hit.blocks.len() => {
                    tail_tokens(request.tokens, hit.num_tokens)
                }
                _ => None,
            };
            let num_computed = request.preloaded.or(tail).unwrap_or(load * block_size);
            running.push(Running {
                id: request.id,
                progress: Progress {
                    num_tokens: request.tokens.len(),
                    num_computed,
                    prefill_step_size: request.prefill_step_size,
                },
                slot: SlotKind::None,
                scored: false,
                branch_at,
                own_chunks: private,
                whole: request.whole,
                priority: request.priority,
                pin_ends: request.pin_ends,
                keeps_blocks: request.keeps_blocks,
            });
            admitted.push(Admission {
                id: request.id,
                hit,
                load,
                pinned,
                tail: tail.is_some(),
                num_computed,
                branch_at,
            });
            true
        });
    }
    Decision::Run(StepPlan {
        admitted,
        ..plan_step(&running, limits, batch.active_lane)
    })
}

/// What one step runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Requests admitted now, from the front of the waiting queue (they run after the running
    /// ones, in this order).
    pub admitted: Vec<Admission>,
    /// Sequences of a lower lane than one whose prompt this step computes, in a prefill slot:
    /// preempted before the pass (their full blocks stay in the prefix cache, see
    /// [`plan_step`]), so that the pass computes the higher lane's rows only.
    pub yield_prefill: Vec<RequestId>,
    /// Sequences that take a prefill slot now, oldest first.
    pub enter_prefill: Vec<RequestId>,
    /// The step's prefill pass; `None` when no sequence is in a prefill slot.
    pub prefill: Option<PrefillPass>,
    /// Sequences that decode after the pass, in the input's order: those whose prompt is cached
    /// by then (a prompt the pass completes decodes in the same step), scored ones left out.
    /// [`schedule`] has given each the block for the token it feeds.
    pub decode: Vec<RequestId>,
}

/// Plans a step over `running` (oldest first): sequences still prefilling take free prefill slots
/// ([`scheduler::take_prefill_slots`]); every sequence in a prefill slot of the highest lane
/// there ([`scheduler::prefill_lane`]; the others pause) gets its next chunk, within the
/// budget that lane's passes take ([`scheduler::lane_budget`], with `active_lane`): a
/// private one its own ([`Running::own_chunks`]), the others an equal share of what is left of the
/// step's prefill budget ([`scheduler::prefill_budget`], [`scheduler::plan_slot_chunks`]),
/// aligned to blocks where the limits ask and stopped at its `branch_at`; then every sequence
/// whose prompt is cached after the pass decodes.
pub fn plan_step(
    running: &[Running<'_>],
    limits: &StepLimits,
    active_lane: Option<Priority>,
) -> StepPlan {
    let progress: Vec<Progress> = running.iter().map(|r| r.progress).collect();
    let lanes: Vec<Priority> = running.iter().map(|r| r.priority).collect();
    // The highest lane with a prompt to compute (in a prefill slot or waiting for one): only its
    // rows compute prompt tokens this step. A lower lane's row in a prefill slot leaves it and
    // the batch (`yield_prefill`: a row in the pass costs a row's compute even without tokens,
    // and holds a slot the higher lane may need), its full blocks kept in the prefix cache; one
    // that cannot keep its blocks there ([`Running::keeps_blocks`]) pauses in its slot. Lower
    // lanes' rows take no slot meanwhile.
    let lane = (0..running.len())
        .filter(|&i| running[i].slot != SlotKind::Decode && !progress[i].prefill_done())
        .map(|i| lanes[i])
        .min();
    let below = |i: usize| lane.is_some_and(|top| lanes[i] > top);
    let yielding =
        |i: usize| running[i].slot == SlotKind::Prefill && below(i) && running[i].keeps_blocks;
    let yield_prefill: Vec<RequestId> = (0..running.len())
        .filter(|&i| yielding(i))
        .map(|i| running[i].id)
        .collect();
    let taken = (0..running.len())
        .filter(|&i| running[i].slot == SlotKind::Prefill && !yielding(i))
        .count();
    let entering: Vec<usize> = scheduler::take_prefill_slots(
        &progress,
        &lanes,
        |i| running[i].slot != SlotKind::None,
        taken,
        limits.prefill_batch_size.max(1),
        limits
            .prefill_fits_budget
            .then_some(limits.prefill_token_budget),
    )
    .into_iter()
    .filter(|&i| !below(i))
    .collect();
    let members: Vec<usize> = (0..running.len())
        .filter(|&i| (running[i].slot == SlotKind::Prefill || entering.contains(&i)) && !below(i))
        .collect();
    let prefill = (!members.is_empty()).then(|| {
        let widest = limits.prefill_token_budget.max(1);
        let own = |i: usize| {
            progress[i]
                .prompt_left()
                .min(progress[i].prefill_step_size.max(1))
                .min(widest)
        };
        // Private rows take their own chunks, oldest first, while they fit the budget (the
        // first always does: a chunk is at most the budget); one that does not waits for a
        // step with room. The other rows share what is left, less while a higher lane is
        // active ([`scheduler::lane_budget`]).
        let active: Vec<Priority> = running
            .iter()
            .filter(|r| r.progress.prefill_done())
            .map(|r| r.priority)
            .chain(active_lane)
            .collect();
        let mut budget = scheduler::prefill_budget(&progress, limits.prefill_token_budget);
        let mut own_chunks = Vec::new();
        for &i in members.iter().filter(|&&i| running[i].own_chunks) {
            if own(i) <= budget {
                budget -= own(i);
                own_chunks.push(i);
            }
        }
        let shared: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| !running[i].own_chunks)
            .collect();
        let rows: Vec<Progress> = shared.iter().map(|&i| progress[i]).collect();
        // Unbounded while nothing decodes, but a pass is at most `widest` wide anyway.
        let budget = scheduler::lane_budget(
            budget.min(widest),
            lane.expect("members are of the lane"),
            &active,
        );
        // `shared` follows `members`' order, so their shares come in that order too.
        let mut shares = scheduler::plan_slot_chunks(&rows, budget, widest).into_iter();
        let chunks: Vec<(RequestId, usize)> = members
            .iter()
            .filter(|&&i| !running[i].own_chunks || own_chunks.contains(&i))
            .map(|&i| {
                let row = &running[i];
                let computed = row.progress.num_computed;
                let chunk = if row.own_chunks {
                    own(i)
                } else {
                    let mut chunk = shares.next().expect("a share for each shared row");
                    if limits.align_chunks_to_blocks {
                        chunk = scheduler::align_chunk_to_block(computed, chunk, limits.block_size);
                        if let Some(&at) = row.pin_ends.iter().find(|&&at| at > computed) {
                            chunk = chunk.min(at - computed);
                        }
                    }
                    if let Some(at) = row.branch_at.filter(|&at| computed < at) {
                        chunk = chunk.min(at - computed);
                    }
                    chunk
                };
                (row.id, scheduler::keep_whole(computed, chunk, row.whole))
            })
            .collect();
        let longest = chunks.iter().map(|&(_, c)| c).max().unwrap_or(1);
        PrefillPass {
            chunks,
            width: crate::shapes::prefill_chunk_bucket(longest),
        }
    });
    // No pass where no row has a chunk (every private row waiting for a step with room).
    let prefill = prefill.filter(|p| !p.chunks.is_empty());
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
        admitted: Vec::new(),
        yield_prefill,
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
            max_running: 8,
            prefill_batch_size: 2,
            prefill_token_budget: 256,
            prefill_fits_budget: false,
            block_size: 16,
            align_chunks_to_blocks: false,
        }
    }

    /// [`limits`] with chunks aligned to blocks (a hybrid model's).
    fn aligned_limits() -> StepLimits {
        StepLimits {
            align_chunks_to_blocks: true,
            ..limits()
        }
    }

    fn row(
        id: RequestId,
        num_tokens: usize,
        num_computed: usize,
        slot: SlotKind,
    ) -> Running<'static> {
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
            whole: &[],
            own_chunks: false,
            priority: Priority::Normal,
            pin_ends: &[],
            keeps_blocks: true,
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
        let plan = plan_step(&running, &limits(), None);
        assert_eq!(plan.enter_prefill, vec![3]);
        let pass = plan.prefill.expect("a prefill pass");
        assert_eq!(pass.chunks, vec![(2, 128), (3, 128)]);
        assert_eq!(pass.width, 128);
        assert_eq!(pass.num_tokens(), 256);
        assert_eq!(plan.decode, vec![1]);
    }

    #[test]
    fn a_higher_lane_prefills_while_a_lower_one_pauses_and_decode_rows_step() {
        let lane = |row: Running<'static>, priority| Running { priority, ..row };
        let running = [
            row(1, 40, 39, SlotKind::Decode),
            // A background prompt mid-way, and a chat's that has just arrived.
            lane(row(2, 16_000, 4096, SlotKind::Prefill), Priority::Low),
            lane(row(3, 100, 0, SlotKind::None), Priority::High),
        ];
        let plan = plan_step(&running, &limits(), None);
        assert_eq!(plan.enter_prefill, vec![3]);
        // The chat's whole prompt (but its last token) in the pass, the background's none: it
        // leaves its slot (and the batch, its blocks cached) until then.
        let pass = plan.prefill.expect("a prefill pass");
        assert_eq!(pass.chunks, vec![(3, 99)]);
        assert_eq!(plan.yield_prefill, vec![2]);
        assert_eq!(plan.decode, vec![1, 3]);
        // Back without a slot while the chat's prompt is computed: it takes none.
        let back = lane(row(2, 16_000, 4096, SlotKind::None), Priority::Low);
        let chat = lane(row(3, 300, 99, SlotKind::Prefill), Priority::High);
        let plan = plan_step(&[running[0], back, chat], &limits(), None);
        assert!(plan.enter_prefill.is_empty() && plan.yield_prefill.is_empty());
        assert_eq!(plan.prefill.unwrap().chunks, vec![(3, 200)]);
        // A row that cannot keep its blocks (a private KV) pauses in its slot instead.
        let private = Running {
            own_chunks: true,
            keeps_blocks: false,
            ..running[1]
        };
        let plan = plan_step(&[running[0], private, running[2]], &limits(), None);
        assert!(plan.yield_prefill.is_empty());
        assert_eq!(plan.prefill.unwrap().chunks, vec![(3, 99)]);
        // Once the chat decodes, the background prompt goes on, an eighth of the budget a pass
        // while the chat's tokens come, and while the high lane was active within the window;
        // all of it beside rows of its own lane.
        let decoding = lane(row(3, 101, 100, SlotKind::Decode), Priority::High);
        let plan = plan_step(&[running[0], running[1], decoding], &limits(), None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(2, 32)]);
        assert_eq!(plan.decode, vec![1, 3]);
        let background = lane(running[0], Priority::Low);
        let plan = plan_step(&[background, running[1]], &limits(), Some(Priority::High));
        assert_eq!(plan.prefill.unwrap().chunks, vec![(2, 32)]);
        // Alone (nothing decodes, the budget unbounded), the same.
        let plan = plan_step(&[running[1]], &limits(), Some(Priority::High));
        assert_eq!(plan.prefill.unwrap().chunks, vec![(2, 32)]);
        let plan = plan_step(&[background, running[1]], &limits(), Some(Priority::Low));
        assert_eq!(plan.prefill.unwrap().chunks, vec![(2, 256)]);
    }

    #[test]
    fn a_higher_lane_prompt_finds_a_slot_when_lower_lanes_hold_them_all() {
        let lane = |row: Running<'static>, priority| Running { priority, ..row };
        // Both prefill slots (batch size 2) held by background prompts: they give them up.
        let running = [
            lane(row(1, 4000, 512, SlotKind::Prefill), Priority::Low),
            lane(row(2, 4000, 256, SlotKind::Prefill), Priority::Low),
            lane(row(3, 50, 0, SlotKind::None), Priority::High),
        ];
        let plan = plan_step(&running, &limits(), None);
        assert_eq!(plan.yield_prefill, vec![1, 2]);
        assert_eq!(plan.enter_prefill, vec![3]);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(3, 49)]);
    }

    #[test]
    fn a_private_lower_lane_row_takes_its_own_chunks_while_a_higher_lane_is_active() {
        // Its chunks cannot shrink (where they end decides what its cache holds): the budget
        // it takes is the whole one, not the lower lane's eighth.
        let private = Running {
            own_chunks: true,
            keeps_blocks: false,
            priority: Priority::Low,
            ..row(1, 4000, 0, SlotKind::Prefill)
        };
        let chat = Running {
            priority: Priority::High,
            ..row(2, 40, 39, SlotKind::Decode)
        };
        let plan = plan_step(&[private, chat], &limits(), Some(Priority::High));
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 256)]);
        assert_eq!(plan.decode, vec![2]);
    }

    #[test]
    fn alone_a_prompt_prefills_the_widest_chunk_and_decodes_when_done() {
        // Nobody decodes: the budget does not bind, the slot caches' width does.
        let plan = plan_step(&[row(7, 1000, 0, SlotKind::None)], &limits(), None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(7, 256)]);
        assert!(plan.decode.is_empty());
        // A chunk that completes the prompt (all but its last token) decodes in the same step.
        let plan = plan_step(&[row(7, 100, 50, SlotKind::Prefill)], &limits(), None);
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
            None,
        );
        assert_eq!(plan.prefill, None);
        assert!(plan.enter_prefill.is_empty());
        assert_eq!(plan.decode, vec![1, 2]);
    }

    #[test]
    fn scored_requests_wait_for_their_result() {
        let mut scored = row(1, 10, 10, SlotKind::Decode);
        scored.scored = true;
        let plan = plan_step(&[scored, row(2, 12, 11, SlotKind::Decode)], &limits(), None);
        assert_eq!(plan.decode, vec![2]);
    }

    #[test]
    fn hybrid_chunks_end_on_blocks_and_at_a_branch() {
        let limits = aligned_limits();
        // 0..100 of a 200-token prompt alone: 100 tokens stop at 96, the last boundary crossed.
        let mut first = row(1, 200, 0, SlotKind::Prefill);
        let plan = plan_step(
            &[first],
            &StepLimits {
                prefill_token_budget: 100,
                ..limits
            },
            None,
        );
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 96)]);
        // Recomputing shared blocks up to 40: the chunk stops there.
        first.progress.num_computed = 16;
        first.branch_at = Some(40);
        let plan = plan_step(&[first], &limits, None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 24)]);
        // A pinned prefix ending at 64 (after the branch): the chunk from 40 stops there, and
        // one from there goes on to the last boundary crossed; without block-aligned chunks a
        // pin's end stops nothing.
        first.progress.num_computed = 40;
        first.pin_ends = &[32, 64];
        let plan = plan_step(&[first], &limits, None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 24)]);
        first.progress.num_computed = 64;
        let plan = plan_step(&[first], &limits, None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 128)]);
        first.progress.num_computed = 40;
        let unaligned = StepLimits {
            align_chunks_to_blocks: false,
            ..limits
        };
        let plan = plan_step(&[first], &unaligned, None);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 159)]);
        first.pin_ends = &[];
        // Past the branch, only blocks bind.
        first.progress.num_computed = 40;
        let plan = plan_step(&[first], &limits, None);
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
            None,
        );
        assert_eq!(plan.enter_prefill, vec![1]);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 256)]);
    }

    #[test]
    fn a_private_request_prefills_its_own_chunks_whatever_the_pass_holds() {
        let limits = aligned_limits();
        let mut bounded = row(2, 1000, 0, SlotKind::Prefill);
        bounded.own_chunks = true;
        bounded.progress.prefill_step_size = 100;
        let running = [
            row(1, 40, 39, SlotKind::Decode),
            bounded,
            row(3, 1000, 0, SlotKind::Prefill),
        ];
        // Its chunk is its prefill_step_size, not aligned to blocks; the other row gets what is
        // left of the budget (aligned: 156 → 144).
        let pass = plan_step(&running, &limits, None).prefill.unwrap();
        assert_eq!(pass.chunks, vec![(2, 100), (3, 144)]);
        // Alone, still its own step, never the whole budget.
        let pass = plan_step(&[bounded], &limits, None).prefill.unwrap();
        assert_eq!(pass.chunks, vec![(2, 100)]);
        // A second bounded row whose chunk does not fit what is left waits for the next step.
        let mut second = bounded;
        second.id = 4;
        second.progress.prefill_step_size = 200;
        let running = [running[0], bounded, second];
        let pass = plan_step(&running, &limits, None).prefill.unwrap();
        assert_eq!(pass.chunks, vec![(2, 100)]);
    }

    /// Admits `request` (the prompt 0..100, cached by an earlier request) alone and checks
    /// that it was not looked up in the prefix cache; returns the manager.
    fn admitted_without_the_prefix_cache(request: Waiting<'_>) -> KvCacheManager {
        let mut kv = manager(64);
        cache_prefix(&mut kv, 100, request.tokens);
        let queue = [request];
        let batch = admitting(&queue);
        let plan = run(schedule(
            &mut kv,
            &mut Contents::default(),
            &batch,
            &limits(),
            |_, _| panic!("a bounded or private request looks up no tail"),
        ));
        assert_eq!(plan.admitted[0].hit, ComputedBlocks::default());
        assert_eq!(plan.admitted[0].num_computed, 0);
        kv
    }

    #[test]
    fn a_bounded_request_skips_the_prefix_cache_and_its_blocks_stop_at_the_bound() {
        let prompt: Vec<u32> = (0..100).collect();
        let mut kv = admitted_without_the_prefix_cache(Waiting {
            bounded: Some(40),
            ..waiting(1, &prompt)
        });
        // 40 positions in blocks of 16, however long it runs; none of them cached.
        assert_eq!(kv.block_table(1).unwrap().len(), 3);
        assert!(kv.allocate(&mut Contents::default(), 1, 100, 1000, None));
        assert_eq!(kv.block_table(1).unwrap().len(), 3);
        assert!(kv.cache_blocks(1, &prompt, 100).is_empty());
        kv.free(1);
        assert_eq!(kv.pool().num_free_blocks(), 64);
    }

    #[test]
    fn a_private_request_skips_the_prefix_cache_and_its_table_grows() {
        let prompt: Vec<u32> = (0..100).collect();
        let mut kv = admitted_without_the_prefix_cache(Waiting {
            private: true,
            ..waiting(1, &prompt)
        });
        // Unbounded: its table grows with it.
        assert!(kv.allocate(&mut Contents::default(), 1, 100, 100, None));
        assert_eq!(kv.block_table(1).unwrap().len(), 13);
    }

    /// A prefix cache's contents for a model without bounded layers, or (with `usable`) one
    /// whose hits can load only their first blocks, like a hybrid model's.
    #[derive(Default)]
    struct Contents {
        usable: Option<usize>,
        pins: Vec<BlockId>,
        cleared: Vec<BlockId>,
        /// The most blocks' bounded parts pinned at once (none: any).
        pinned_parts_max: Option<usize>,
    }

    impl BlockContents for Contents {
        fn usable_blocks(&self, blocks: &[BlockId], _: usize) -> usize {
            self.usable.map_or(blocks.len(), |n| n.min(blocks.len()))
        }
        fn read_by_hit<'a>(&self, blocks: &'a [BlockId], _: usize) -> &'a [BlockId] {
            &blocks[blocks.len().saturating_sub(1)..]
        }
        fn pin(&mut self, ids: &[BlockId]) {
            self.pins.extend(ids);
        }
        fn unpin(&mut self, ids: &[BlockId]) {
            self.pins.retain(|id| !ids.contains(id));
        }
        fn pinned_parts_fit(&self, ids: &[BlockId]) -> bool {
            self.pinned_parts_max
                .is_none_or(|max| self.pins.len() + ids.len() <= max)
        }
        fn has_recurrent_layers(&self) -> bool {
            self.usable.is_some()
        }
        fn clear(&mut self, id: BlockId) {
            self.cleared.push(id);
        }
        fn drop_least_recent(&mut self) -> bool {
            false
        }
        fn held_blocks(&self) -> usize {
            0
        }
        fn blocks_to_charge(&self) -> isize {
            0
        }
        fn hold_blocks(&mut self, _: Vec<BlockId>) {}
        fn release_blocks(&mut self, _: usize) -> Vec<BlockId> {
            Vec::new()
        }
    }

    /// The step [`schedule`] plans for `batch` within [`limits`], no kept partial blocks.
    fn planned(kv: &mut KvCacheManager, contents: &mut Contents, batch: &Batch) -> StepPlan {
        run(schedule(kv, contents, batch, &limits(), |_, _| None))
    }

    fn manager(num_blocks: usize) -> KvCacheManager {
        KvCacheManager::new(crate::BlockPool::new(num_blocks, 16), "test")
    }

    /// Runs `request` over `tokens` (all computed), caches its full blocks and frees it.
    fn cache_prefix(kv: &mut KvCacheManager, request: RequestId, tokens: &[u32]) {
        kv.allocate(&mut Contents::default(), request, 0, tokens.len(), None);
        kv.cache_blocks(request, tokens, tokens.len());
        kv.free(request);
    }

    fn waiting(id: RequestId, tokens: &[u32]) -> Waiting<'_> {
        Waiting {
            id,
            tokens,
            prefill_step_size: 512,
            preloaded: None,
            bounded: None,
            private: false,
            whole: &[],
            priority: Priority::Normal,
            pin_ends: &[],
            keeps_blocks: true,
        }
    }

    /// A batch with nothing running and `queue` waiting to be admitted.
    fn admitting<'a>(queue: &'a [Waiting<'a>]) -> Batch<'a> {
        Batch {
            running: &[],
            waiting: queue,
            step_in_flight: false,
            admit: true,
            active_lane: None,
        }
    }

    fn run(decision: Decision) -> StepPlan {
        match decision {
            Decision::Run(plan) => plan,
            other => panic!("expected a plan, got {other:?}"),
        }
    }

    #[test]
    fn admission_loads_the_prefix_hit_and_plans_the_rest() {
        let mut kv = manager(16);
        let shared: Vec<u32> = (0..40).collect();
        cache_prefix(&mut kv, 100, &shared);
        let (a, b) = ([&shared[..], &[7; 10]].concat(), vec![9; 20]);
        let queue = [waiting(1, &a), waiting(2, &b)];
        let batch = admitting(&queue);
        let mut contents = Contents::default();
        let plan = planned(&mut kv, &mut contents, &batch);
        let hit = &plan.admitted[0];
        // Two full blocks of the 40 shared tokens are cached.
        assert_eq!(
            (hit.id, hit.load, hit.hit.num_tokens, hit.num_computed),
            (1, 2, 32, 32)
        );
        assert_eq!(plan.admitted[1].num_computed, 0);
        assert_eq!(plan.enter_prefill, vec![1, 2]);
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 17), (2, 19)]);
        // The hit's blocks are shared; the rest are new (and lost any cached content).
        assert_eq!(kv.block_table(1).unwrap()[..2], hit.hit.blocks[..]);
        assert_eq!(contents.cleared.len(), 2 + 2);
        assert!(contents.pins.is_empty() || contents.pins == hit.hit.blocks[1..]);
    }

    #[test]
    fn admission_is_first_come_first_served_within_the_pool_and_the_batch() {
        let mut kv = manager(4);
        let (long, short) = (vec![1; 60], vec![2; 10]);
        // The long prompt needs 4 blocks of 16 and the pool has 4: the short one waits behind it.
        let queue = [waiting(1, &long), waiting(2, &short)];
        let batch = admitting(&queue);
        let plan = planned(&mut kv, &mut Contents::default(), &batch);
        assert_eq!(plan.admitted.iter().map(|a| a.id).collect::<Vec<_>>(), [1]);
        // A full batch, or a step that preempted, admits nobody.
        let mut kv = manager(16);
        let running = [row(5, 10, 9, SlotKind::Decode)];
        for (max_running, admit) in [(1, true), (8, false)] {
            let batch = Batch {
                running: &running,
                waiting: &queue,
                step_in_flight: false,
                admit,
                active_lane: None,
            };
            let limits = StepLimits {
                max_running,
                ..limits()
            };
            let plan = run(schedule(
                &mut kv,
                &mut Contents::default(),
                &batch,
                &limits,
                |_, _| None,
            ));
            assert!(plan.admitted.is_empty());
            assert_eq!(plan.decode, vec![5]);
        }
    }

    /// A pinned prefix outlives the least-recently-used eviction that takes an unpinned one,
    /// until it expires; a request alone that the pool is short for gets the pins' blocks.
    #[test]
    fn pinned_prefixes_outlive_eviction_until_they_expire_or_a_lone_request_needs_them() {
        use crate::kv_cache_manager::PinOutcome;
        use std::time::{Duration, Instant};
        let now = Instant::now();
        let ttl = Duration::from_secs(300);
        // 16 blocks of 16 tokens: pins hold 4 blocks at most.
        let mut kv = manager(16);
        let mut contents = Contents::default();
        let pinned: Vec<u32> = (0..49).collect();
        let unpinned: Vec<u32> = (1000..1049).collect();
        assert_eq!(queue_hit(&mut kv, &mut contents, &pinned, 1), 0);
        assert_eq!(queue_hit(&mut kv, &mut contents, &unpinned, 2), 0);
        // Three whole blocks of the 49 tokens, and the last one's bounded parts.
        let pin = kv.pin_prefix(&mut contents, 1, 49, None, ttl, now);
        assert_eq!(pin, PinOutcome::Pinned { tokens: 48 });
        assert_eq!(kv.pinned_tokens(), (48, 64));
        assert_eq!(contents.pins.len(), 1);
        kv.free(1);
        kv.free(2);
        // Five blocks pass the share.
        let long: Vec<u32> = (2000..2081).collect();
        queue_hit(&mut kv, &mut contents, &long, 7);
        let pin = kv.pin_prefix(&mut contents, 7, 81, Some("k".into()), ttl, now);
        assert_eq!(pin, PinOutcome::TooLarge { max_tokens: 64 });
        kv.free(7);
        // Three blocks pinned, 13 free: a 208-token prompt takes every free one, evicting the
        // unpinned prompt's blocks and not the pinned one's.
        let other: Vec<u32> = (5000..5208).collect();
        let limits = StepLimits {
            prefill_token_budget: 512,
            ..limits()
        };
        let decide = |kv: &mut KvCacheManager, contents: &mut Contents, queue: &[Waiting]| {
            schedule(kv, contents, &admitting(queue), &limits, |_, _| None)
        };
        let plan = run(decide(&mut kv, &mut contents, &[waiting(3, &other)]));
        assert_eq!(plan.admitted.len(), 1);
        assert_eq!(kv.cached_prefix(&pinned).num_tokens, 48, "pinned: kept");
        assert_eq!(
            kv.cached_prefix(&unpinned).num_tokens,
            0,
            "unpinned: evicted"
        );
        kv.free(3);
        // Expired, the pin's blocks are free again.
        kv.expire_pins(&mut contents, now + ttl - Duration::from_secs(1));
        assert_eq!(kv.pinned_tokens().0, 48);
        kv.expire_pins(&mut contents, now + ttl);
        assert_eq!(kv.pinned_tokens().0, 0);
        assert!(contents.pins.is_empty());
        assert_eq!(kv.pool().num_free_blocks(), 16);
        // Pinned again by a request that hits it, then a lone prompt needing all 16 blocks
        // takes the pin's.
        assert_eq!(queue_hit(&mut kv, &mut contents, &pinned, 4), 3);
        let pin = kv.pin_prefix(&mut contents, 4, 49, None, ttl, now);
        assert_eq!(pin, PinOutcome::Pinned { tokens: 48 });
        kv.free(4);
        let all: Vec<u32> = (9000..9241).collect();
        let plan = run(decide(&mut kv, &mut contents, &[waiting(6, &all)]));
        assert_eq!(plan.admitted.len(), 1);
        assert_eq!(kv.pinned_tokens().0, 0);
        kv.pool().check_invariants();
    }

    /// Pins give their blocks up to a running sequence that needs them (before anyone is
    /// preempted) and to a high-lane request, not to a normal one that can wait; the bounded
    /// parts they keep have a share of their own.
    #[test]
    fn pins_give_way_to_running_sequences_and_the_high_lane() {
        use crate::kv_cache_manager::PinOutcome;
        use std::time::{Duration, Instant};
        let (now, ttl) = (Instant::now(), Duration::from_secs(300));
        let pinned = |kv: &mut KvCacheManager, contents: &mut Contents, first: u32| {
            let prefix: Vec<u32> = (first..first + 33).collect();
            queue_hit(kv, contents, &prefix, 1);
            let pin = kv.pin_prefix(contents, 1, 33, None, ttl, now);
            kv.free(1);
            pin
        };
        // 8 blocks of 16: two pinned, two sequences of 48 tokens hold the other six, and each
        // needs a fourth block for its next token.
        let (mut kv, mut contents) = (manager(8), Contents::default());
        assert_eq!(
            pinned(&mut kv, &mut contents, 0),
            PinOutcome::Pinned { tokens: 32 }
        );
        kv.allocate(&mut contents, 2, 0, 48, None);
        kv.allocate(&mut contents, 3, 0, 48, None);
        let running = [
            row(2, 49, 48, SlotKind::Decode),
            row(3, 49, 48, SlotKind::Decode),
        ];
        let batch = Batch {
            running: &running,
            waiting: &[],
            step_in_flight: false,
            admit: true,
            active_lane: None,
        };
        let plan = planned(&mut kv, &mut contents, &batch);
        assert_eq!(plan.decode, vec![2, 3], "nobody preempted");
        assert_eq!(kv.pinned_tokens().0, 0);
        // One sequence of 80 tokens holds five blocks, one is free: a normal request of two
        // blocks waits with the pin kept, a high-lane one takes the pin's blocks.
        let (mut kv, mut contents) = (manager(8), Contents::default());
        pinned(&mut kv, &mut contents, 0);
        kv.allocate(&mut contents, 2, 0, 80, None);
        let running = [row(2, 80, 79, SlotKind::Decode)];
        let prompt: Vec<u32> = (500..532).collect();
        for (lane, admitted, pinned_left) in [(Priority::Normal, 0, 32), (Priority::High, 1, 0)] {
            let queue = [Waiting {
                priority: lane,
                ..waiting(4, &prompt)
            }];
            let batch = Batch {
                running: &running,
                waiting: &queue,
                ..batch
            };
            let plan = planned(&mut kv, &mut contents, &batch);
            assert_eq!(plan.admitted.len(), admitted, "{lane:?}");
            assert_eq!(kv.pinned_tokens().0, pinned_left, "{lane:?}");
        }
        // Bounded parts: room for one pin's, so a second pin displaces the first; none at all
        // refuses a pin.
        let mut kv = manager(64);
        let mut contents = Contents {
            pinned_parts_max: Some(1),
            ..Contents::default()
        };
        assert_eq!(
            pinned(&mut kv, &mut contents, 0),
            PinOutcome::Pinned { tokens: 32 }
        );
        assert_eq!(
            pinned(&mut kv, &mut contents, 100),
            PinOutcome::Pinned { tokens: 32 }
        );
        assert_eq!((kv.pinned_tokens().0, contents.pins.len()), (32, 1));
        contents.pinned_parts_max = Some(0);
        let pin = pinned(&mut kv, &mut contents, 200);
        assert_eq!(pin, PinOutcome::NoRoomForBoundedParts);
        assert_eq!(kv.pinned_tokens().0, 0);
    }

    /// Admits `tokens` as `request` with its prefix hit, computes the rest and caches it; returns
    /// the blocks it hit.
    fn queue_hit(
        kv: &mut KvCacheManager,
        contents: &mut Contents,
        tokens: &[u32],
        request: RequestId,
    ) -> usize {
        let hit = kv.get_computed_blocks(tokens);
        let new = tokens.len() - hit.num_tokens;
        assert!(kv.allocate(contents, request, hit.num_tokens, new, Some(&hit)));
        kv.cache_blocks(request, tokens, tokens.len());
        hit.blocks.len()
    }

    #[test]
    fn a_short_pool_reads_the_step_in_flight_then_preempts_the_newest() {
        let mut kv = manager(4);
        let mut contents = Contents::default();
        // Two decoding sequences hold a full block each, the third is prefilling, one is free.
        kv.allocate(&mut contents, 1, 0, 16, None);
        kv.allocate(&mut contents, 2, 0, 16, None);
        kv.allocate(&mut contents, 3, 0, 5, None);
        let running = [
            row(1, 17, 16, SlotKind::Decode),
            row(2, 17, 16, SlotKind::Decode),
            row(3, 6, 0, SlotKind::Prefill),
        ];
        let mut batch = Batch {
            running: &running,
            waiting: &[],
            step_in_flight: true,
            admit: true,
            active_lane: None,
        };
        let decide = |kv: &mut KvCacheManager, contents: &mut Contents, batch: &Batch| {
            schedule(kv, contents, batch, &limits(), |_, _| None)
        };
        assert_eq!(
            decide(&mut kv, &mut contents, &batch),
            Decision::ReadInFlight
        );
        batch.step_in_flight = false;
        assert_eq!(decide(&mut kv, &mut contents, &batch), Decision::Preempt(3));
        kv.free(3);
        // Sequence 1 got its block on the first call; 2 now gets the freed one.
        let plan = run(decide(
            &mut kv,
            &mut contents,
            &Batch {
                running: &running[..2],
                admit: false,
                ..batch
            },
        ));
        assert_eq!(plan.decode, vec![1, 2]);
        assert_eq!(kv.block_table(2).unwrap().len(), 2);
        // Alone and short: it finishes.
        let mut kv = manager(1);
        kv.allocate(&mut contents, 1, 0, 16, None);
        let batch = Batch {
            running: &running[..1],
            ..batch
        };
        assert_eq!(
            decide(&mut kv, &mut contents, &batch),
            Decision::FinishOutOfBlocks(1)
        );
    }

    #[test]
    fn a_hit_past_the_last_state_branches_and_a_tail_extends_a_whole_hit() {
        let mut kv = manager(16);
        let prompt: Vec<u32> = (0..60).collect();
        cache_prefix(&mut kv, 100, &prompt);
        // Only the first of three cached blocks holds recurrent states.
        let mut contents = Contents {
            usable: Some(1),
            ..Contents::default()
        };
        let queue = [waiting(1, &prompt)];
        let batch = admitting(&queue);
        let limits = aligned_limits();
        let plan = run(schedule(&mut kv, &mut contents, &batch, &limits, |_, _| {
            Some(50)
        }));
        let admission = &plan.admitted[0];
        assert_eq!((admission.load, admission.num_computed), (1, 16));
        assert_eq!((admission.branch_at, admission.tail), (Some(48), false));
        assert_eq!(contents.pins, admission.hit.blocks[..1]);
        // The chunk stops at the branch point, where the block ending there gets the states.
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 32)]);
        // Every block usable: a kept partial block after them is loaded too.
        let mut kv = manager(16);
        cache_prefix(&mut kv, 100, &prompt);
        let plan = run(schedule(
            &mut kv,
            &mut Contents::default(),
            &batch,
            &limits,
            |tokens, from| {
                assert_eq!((tokens.len(), from), (60, 48));
                Some(55)
            },
        ));
        let admission = &plan.admitted[0];
        assert_eq!(
            (admission.load, admission.tail, admission.num_computed),
            (3, true, 55)
        );
        assert_eq!(plan.prefill.unwrap().chunks, vec![(1, 4)]);
    }
}
